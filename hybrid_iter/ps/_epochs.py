"""The Ray coordinator side of ``ps.train``: epochs, losses, evaluation, termination, and
the shards' part of the iteration's checkpoints.

Runs in the Ray coordinator actor (``_Epochs``, a coordinator operator). Besides the
epoch accounting it owns the shards' lifecycle within the run:

* ``open`` (a new launch of the stage, the first included) resets every shard under a
  new fencing token; ``restore_state`` (a launch that resumes from a checkpoint) then
  restores every shard from its part of that checkpoint, under the same token: all
  shards roll back to the cut, not only one that died, and calls of tasks of the failed
  launch are refused from then on.
* ``snapshot_state`` (the cut of a checkpoint, every subtask held at its epoch's end, so
  no push is on the way) has every shard write its whole state as its own sealed record,
  in parallel, next to the coordinator's checkpoint, and records their names: the
  coordinator's checkpoint (authenticated, bound to the run) names the parts of its cut,
  each part carries that cut's id, so no part of another cut or run is ever restored.

Full writes, not increments: each shard writes all its rows at a cut, at the speed of
one sequential write per shard, all shards at once; a restore reads one file per shard.
Increments (rows changed since the last cut) would cut the bytes written when few keys
move between cuts, at the price of a chain of files to replay and compact on restore;
``TrainResult.restores`` and the checkpoint timings say when that is worth it.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator._shell import quiet_get

from .._operators import CoordinatorOperator
from ..ml._sgd import DIVERGENCE_PATIENCE, LossWatch
from ._optim import Optimizer

__all__ = [
    "HOT_TOP",
    "METRICS",
    "RESTART_WAIT",
    "Epochs",
    "ShardServingPlan",
    "auc",
    "hot_keys",
    "log_loss",
]

#: seconds the coordinator keeps asking a shard Ray is restarting
RESTART_WAIT = 120.0


@dataclass(frozen=True)
class ShardServingPlan:
    """Over the endpoint: what each shard serves with (``EndpointSpec``, bound to the
    port it first served on) and the location the tasks dial."""

    specs: tuple[Any, ...]
    locations: tuple[str, ...]


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities ``p`` (clipped to [eps, 1 - eps], eps
    the float64 machine epsilon, as scikit-learn does) for labels ``y`` in {0, 1}."""
    eps = np.finfo(np.float64).eps
    q = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log1p(-q)))


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half); NaN when
    only one class is present."""
    pos = int(np.count_nonzero(y == 1))
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return math.nan
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    # average ranks (1-based) of tied scores
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(len(s))
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


#: metric name -> (function of (scores, labels), higher is better)
METRICS = {"log_loss": (log_loss, False), "auc": (auc, True)}

#: how many of a table's most touched keys the progress line and ``TrainResult.hot_keys``
#: sum up (each shard reports its own top ones: the global top ones are among them)
HOT_TOP = 10


def hot_keys(infos: Sequence[dict[str, Any]], top: int = HOT_TOP) -> dict[str, dict[str, Any]]:
    """Per table, over every shard (their ``info(top)``): the ``top`` most touched keys
    ``[(key, touches), ...]``, all touches (one per key per update that touched it), and
    the share of all touches that the top keys took (a key lives on one shard, so the
    global top ``top`` are among the shards' own top ``top``)."""
    out: dict[str, dict[str, Any]] = {}
    for info in infos:
        for name, t in info.get("tables", {}).items():
            entry = out.setdefault(name, {"hottest": [], "touches": 0})
            entry["hottest"].extend((int(k), int(n)) for k, n in t.get("hottest", ()))
            entry["touches"] += int(t.get("touches", 0))
    for entry in out.values():
        entry["hottest"] = sorted(entry["hottest"], key=lambda kn: (-kn[1], kn[0]))[:top]
        total = entry["touches"]
        entry["share"] = sum(n for _, n in entry["hottest"]) / total if total else 0.0
    return out


class Epochs(CoordinatorOperator):
    """Runs in the Ray coordinator actor: the loss of each epoch, the evaluation metrics,
    termination, the stop of a run whose loss rises, and the shards' checkpoints.

    Rising loss: ``ml``'s rule (``LossWatch``) on the epoch losses, in every mode: an
    epoch is worse when its loss is above twice the best epoch loss so far *and* above
    the first epoch's loss; ``DIVERGENCE_PATIENCE`` (5) worse epochs in a row stop the
    run naming the optimizer and its learning rate. Each loss is the mean over every row
    of the epoch, so mini-batch noise is averaged out, and async/SSP staleness or a
    momentum/Adam oscillation that still converges comes back under twice its best, or
    stays under where it started, within 5 epochs (a full-batch SGD(0.1, momentum=0.9)
    run swings up to 50x above its best for 10 epochs in a row while converging: why the
    second condition). A run whose loss climbs past where it started and stays there is
    stopped; one that blows up within its first epoch and then falls is not (its first
    epoch is the reference), its ``loss`` shows it.

    Evaluation: each subtask feeds back the scores and labels of its evaluation rows;
    ``metrics`` are computed over all of them at each epoch (output ``"eval"``); with
    ``patience``, the run stops after that many epochs without a better first metric.
    """

    def __init__(
        self,
        epochs: int,
        tol: float | None,
        optimizer: Optimizer,
        *,
        shard_names: Sequence[str] = (),
        parts_uri: str | None = None,
        keep_parts: int = 3,
        metrics: Sequence[str] = (),
        patience: int | None = None,
        min_delta: float = 0.0,
        serving: ShardServingPlan | None = None,
    ) -> None:
        self.epochs = epochs
        self.tol = tol
        self.optimizer = optimizer
        self.shard_names = tuple(shard_names)
        self.parts_uri = parts_uri
        self.keep_parts = keep_parts
        self.metrics = tuple(metrics)
        self.patience = patience
        self.min_delta = min_delta
        self.serving = serving
        self._handles: list[Any] | None = None

    # -- the shards -----------------------------------------------------------------------

    def _shards(self) -> list[Any]:
        import ray

        from .._cluster.ray_util import NAMESPACE

        if self._handles is None:
            self._handles = [ray.get_actor(n, namespace=NAMESPACE) for n in self.shard_names]
        return self._handles

    def _each(self, method: str, *per_shard: Sequence[Any]) -> list[Any]:
        """``method`` on every shard (shard ``i`` with ``per_shard[k][i]`` as its k-th
        argument), all at once; their replies.

        Every call made here (reset, restore, checkpoint, counters) may be made again:
        a shard Ray is restarting after its process died answers "unavailable" (the call
        may or may not have run) until its new process is up, so such a call is made
        again, for up to ``RESTART_WAIT`` seconds. Workers' pushes are never retried
        (one could be applied twice): their task fails and the launch is redone.

        The coordinator waits for the replies on purpose (a reset, a checkpoint, a
        restore must be complete before the run goes on; the shards never call the
        coordinator, so this cannot deadlock): Ray's once-per-process warning about
        blocking gets in async actors is kept for the user's own code."""
        import ray

        handles = self._shards()
        args = [tuple(a[i] for a in per_shard) for i in range(len(handles))]
        out: list[Any] = [None] * len(handles)
        todo = list(range(len(handles)))
        deadline = time.monotonic() + RESTART_WAIT
        while todo:
            refs = [getattr(handles[i], method).remote(*args[i]) for i in todo]
            again = []
            for i, ref in zip(todo, refs):
                try:
                    out[i] = quiet_get(ref)
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    again.append(i)
            todo = again
            if todo:
                time.sleep(0.2)  # Ray is restarting a shard's process: poll it, bounded
        return out

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.sums: dict[int, list[float]] = {}
        self.evals: dict[int, list[tuple[int, Any]]] = {}
        self.t0 = math.inf
        self.watch = LossWatch(above_first=True)
        self.best: float | None = None
        self.best_epoch = -1
        self.bad = 0
        self.parts: list[tuple[str, list[str]]] = []
        self.reports: list[dict[str, Any]] = []
        self.last_info: list[dict[str, Any]] = []
        self._handles = None
        # a new launch: every shard back to its start under a token of its own, so no
        # call of an earlier launch's task can touch what this launch computes
        self.token = uuid.uuid4().hex[:16]
        if self.shard_names:
            self._each("reset", [self.token] * len(self.shard_names))
            if self.serving is not None:
                self._serve()

    def _serve(self) -> None:
        """Over the endpoint: every shard serving where the tasks' plans say (a shard Ray
        restarted is a new process: it serves again, on the address it served on)."""
        from .._errors import EndpointBindError, ShardsUnavailable

        assert self.serving is not None
        try:
            got = self._each("serve_endpoint", list(self.serving.specs))
        except Exception as ex:
            # the shard's own error, out of Ray's wrapper (RayTaskError.cause) if it has one
            cause = getattr(ex, "cause", None)
            shown = cause if isinstance(cause, BaseException) else ex
            said = (str(shown).splitlines() or [""])[0]
            # the port advice only when the shard's server said it cannot listen there
            # (EndpointBindError: it names why); any other failure is said as it is
            fix = (
                "give EndpointConfig(bind='host:port') a host whose ports stay free, or run "
                "with transport='ray'"
                if isinstance(shown, EndpointBindError)
                else "the shard actor's log in Ray's logs has the rest"
            )
            raise ShardsUnavailable(
                f"a restarted parameter shard cannot serve again on the address the tasks "
                f"dial ({', '.join(s.bind for s in self.serving.specs)}): "
                f"{type(shown).__name__}: {said}; {fix}"
            ) from ex
        for i, (loc, want) in enumerate(zip(got, self.serving.locations)):
            if loc != want:
                raise ShardsUnavailable(
                    f"parameter shard {i} serves at {loc}, the tasks dial {want}: it was "
                    f"restarted elsewhere; run with transport='ray' or keep the shards on "
                    f"one node"
                )

    def snapshot_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "sums": self.sums,
            "evals": self.evals,
            "t0": self.t0,
            "watch": (self.watch.first, self.watch.best, self.watch.worse),
            "best": (self.best, self.best_epoch, self.bad),
            "parts": list(self.parts),
            "last_info": self.last_info,
        }
        if self.shard_names and self.parts_uri is not None:
            cut = uuid.uuid4().hex[:16]
            names = [f"part-{cut}-s{i:04d}.ckpt" for i in range(len(self.shard_names))]
            started = time.perf_counter()
            n = len(self.shard_names)
            written = self._each("save_checkpoint", [self.parts_uri] * n, names, [cut] * n)
            self.parts.append((cut, names))
            self._prune()
            state["parts"] = list(self.parts)
            state["written"] = (written, time.perf_counter() - started)
        return state

    def _prune(self) -> None:
        """Keep the parts of the newest ``keep_parts`` cuts (the coordinator keeps
        ``keep_last`` checkpoints and may fall back to an older one); delete the rest,
        and parts of cuts no checkpoint names (a launch that failed after writing)."""
        from coordinator._checkpoint import CheckpointStore, delete_name, list_names

        assert self.parts_uri is not None
        self.parts = self.parts[-self.keep_parts :]
        keep = {n for _, names in self.parts for n in names}
        store = CheckpointStore(self.parts_uri, keep_last=0, key=b"-")  # listing only
        for name in list_names(store):
            if name.startswith("part-") and name.endswith(".ckpt") and name not in keep:
                delete_name(store, name)

    def restore_state(self, state: Any) -> None:
        self.sums = state["sums"]
        self.evals = state["evals"]
        self.t0 = state["t0"]
        self.watch.first, self.watch.best, self.watch.worse = state["watch"]
        self.best, self.best_epoch, self.bad = state["best"]
        self.parts = list(state["parts"])
        self.last_info = state.get("last_info", [])
        if not self.shard_names or self.parts_uri is None or not self.parts:
            return
        cut, names = self.parts[-1]
        n = len(self.shard_names)
        got = self._each(
            "restore_checkpoint", [self.parts_uri] * n, names, [cut] * n, [self.token] * n
        )
        self.reports.append(_replayed(got))

    # -- epochs ---------------------------------------------------------------------------

    def _fix(self) -> str:
        opt = self.optimizer
        lr = opt.rate
        name = opt.rate_name
        return (
            f"the optimizer {type(opt).__name__}({name}={lr:g}) overshoots: lower its "
            f"{'learning rate' if name == 'learning_rate' else name} (e.g. {name}="
            f"{lr / 10:g}), or scale the features"
        )

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        loss_sum, rows, _steps, started, scored = value
        self.t0 = min(self.t0, float(started))
        acc = self.sums.setdefault(ctx.epoch, [0.0, 0.0])
        acc[0] += loss_sum
        acc[1] += rows
        if scored is not None:
            self.evals.setdefault(ctx.epoch, []).append((ctx.source_partition, scored))

    def _evaluate(self, epoch: int) -> dict[str, float] | None:
        parts = self.evals.pop(epoch, None)
        if not self.metrics or parts is None:
            return None
        parts.sort(key=lambda p: p[0])  # partition order: the same numbers every run
        scores = np.concatenate([s for _, (s, _) in parts])
        labels = np.concatenate([y for _, (_, y) in parts])
        got: dict[str, float] = {"epoch": float(epoch), "rows": float(len(labels))}
        for m in self.metrics:
            fn, _ = METRICS[m]
            got[m] = fn(scores, labels) if len(labels) else math.nan
        return got

    def _improved(self, value: float) -> bool:
        _, higher = METRICS[self.metrics[0]]
        if self.best is None or math.isnan(self.best):
            return not math.isnan(value)
        return value > self.best + self.min_delta if higher else value < self.best - self.min_delta

    def _shard_line(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Each shard's counters now, and a summary of the epoch: keys held, bytes in and
        out per step, the balance of keys over shards."""
        infos = self._each("info", [HOT_TOP] * len(self.shard_names))
        before = {i["shard"]: i for i in self.last_info}
        keys = [sum(t["keys"] for t in i["tables"].values()) for i in infos]
        moved = sum(
            i["bytes_in"]
            + i["bytes_out"]
            - before.get(i["shard"], {}).get("bytes_in", 0)
            - before.get(i["shard"], {}).get("bytes_out", 0)
            for i in infos
        )
        calls = sum(i["calls"] - before.get(i["shard"], {}).get("calls", 0) for i in infos)
        self.last_info = infos
        mean = sum(keys) / len(keys) if keys else 0.0
        summary = {
            "keys": sum(keys),
            "keys_max_over_mean": (max(keys) / mean) if mean else 1.0,
            "bytes_per_call": moved / calls if calls else 0.0,
            "bytes": moved,
            "calls": calls,
            "hot_share": {t: h["share"] for t, h in hot_keys(infos).items()},
        }
        return infos, summary

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        for report in self.reports:
            out.output("restore", report)
        self.reports = []
        loss_sum, rows = self.sums.pop(epoch, (0.0, 0.0))
        loss = loss_sum / rows if rows else math.nan
        line: dict[str, Any] = {"loss": loss}
        stop_early = False
        if rows:
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"the loss diverged ({loss}) at epoch {epoch}; {self._fix()}"
                )
            if self.watch.rising(loss, patience=DIVERGENCE_PATIENCE, margin=2.0):
                w = self.watch
                raise FloatingPointError(
                    f"the loss is rising: {loss:.6g} at epoch {epoch}, above twice its best "
                    f"({w.best:.6g}) and above the first epoch's ({w.first:.6g}) for "
                    f"{w.worse} epochs in a row; {self._fix()}"
                )
            out.output("loss", loss)
            out.output("loss_trace", (time.time() - self.t0, loss))
        scored = self._evaluate(epoch)
        if scored is not None:
            out.output("eval", scored)
            first = scored[self.metrics[0]]
            line.update({m: scored[m] for m in self.metrics})
            if self._improved(first):
                self.best, self.best_epoch, self.bad = first, epoch, 0
            else:
                self.bad += 1
            stop_early = self.patience is not None and self.bad >= self.patience
        if self.shard_names:
            _, summary = self._shard_line()
            out.output("shards", {"epoch": epoch, **summary})
            line["keys"] = summary["keys"]
            if summary["calls"]:
                line["kB/call"] = summary["bytes_per_call"] / 1e3
            if summary["hot_share"]:  # the hottest table's top keys' share of touches
                line[f"top{HOT_TOP}%"] = 100.0 * max(summary["hot_share"].values())
        out.output("ps", line)
        # The model lives in the shards; publishing the epoch is what feeds the next
        # epoch (partition feedback alone keeps no iteration alive, docs/semantics.md).
        out.publish_variables(epoch=epoch + 1)
        go_on = epoch + 1 < self.epochs
        if self.tol is not None:
            go_on = go_on and not loss <= self.tol
        if self.patience is not None:
            go_on = go_on and not stop_early
        if (self.tol is not None or self.patience is not None) and go_on:
            out.criteria()

    def on_iteration_terminated(self, ctx: Any, out: Any) -> None:
        for report in self.reports:
            out.output("restore", report)
        self.reports = []
        if self.metrics and self.best_epoch >= 0:
            out.output("best", {"epoch": self.best_epoch, self.metrics[0]: self.best})


def _replayed(got: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a restore rolled back: per shard the updates it discarded (None: the shard's
    process died, its state was lost with it), per worker the steps it runs again."""
    positions_cut: dict[int, tuple[int, int]] = {}
    before: dict[int, tuple[int, int]] = {}
    for g in got:
        positions_cut.update(g["positions_cut"])
        if g["positions_before"] is not None:
            before.update(g["positions_before"])
    return {
        "discarded_updates": {g["shard"]: g["discarded_updates"] for g in got},
        "positions_at_cut": positions_cut,
        "positions_at_failure": before,
    }
