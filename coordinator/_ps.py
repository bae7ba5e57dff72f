"""Parameter-server shards: one key range of a flat parameter vector and its update rule.

Written as a plain class; ``hybrid_iter.ps`` makes it an async Ray actor
(``ray.remote(num_cpus=0)``) where it launches it, one per shard. Spark tasks call the
shards directly (not through the iteration's coordinator, which keeps only the epoch
accounting, the losses, termination and bounded-staleness gating).

Protocol of a worker (one subtask) in epoch ``e``, steps ``s = 0 .. S_p - 1``:
``pull(e, 0)``, then per step ``push(pid, e, s, grad, rows, last=(s == S_p - 1),
pull_next=not last)``, whose reply is the parameters for step ``s + 1``. A worker with no
step in an epoch (no rows) sends ``push(pid, e, 0, None, 0, last=True)``.

* **sync**: step ``(e, s)`` is applied once every worker that takes part in it has
  pushed (a worker whose epoch has fewer steps is done once it pushed ``last``), with the
  workers' mean gradients weighted by their rows and summed in worker order, so results
  are deterministic; ``pull(e, s)`` waits for exactly the parameters before step
  ``(e, s)``. Epoch ``e`` ends when every worker's last step is applied.
* **async**: every push is applied on arrival (the worker's own mean gradient); a pull
  returns the newest parameters.

Sync mode materialises each version at most once for the workers: inline in the reply
when small, else put once into the object store (``put``) and read zero-copy by every
task on the node. Async mode (``FreeShard``) sends a large version's first pull as the
array itself (most versions are pulled once there) and puts a version pulled again. Gradients arrive dense (an array of the shard's length) or sparse
(``(indices, values)`` with sorted, unique indices local to the shard).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._actor import NonFiniteVariables
from ._errors import IterationConfigError
from ._finite import first_nonfinite
from ._variables import INLINE_LIMIT, OncePerVersion

__all__ = [
    "AdamRule",
    "FreeShard",
    "NonFiniteGradient",
    "ParameterShard",
    "SGDRule",
    "ShardSpec",
    "make_rule",
    "shard_class",
]


class NonFiniteGradient(NonFiniteVariables, FloatingPointError):
    """A gradient holding NaN or infinity, refused before any shard applied any of it:
    by the ``ps.train`` worker that computed it (which names the parameter and index),
    or by the shard a ``Sparse`` push reached. Not retried (a ``VariablesMismatchError``):
    the same parameters and data give the same gradient again."""


class SGDRule:
    """``w -= lr * g`` (with ``momentum``: ``v = momentum * v + g; w -= lr * v``).

    Sparse updates touch only the given keys (their momentum too: "lazy" momentum)."""

    def __init__(self, size: int, dtype: np.dtype, *, learning_rate: float, momentum: float = 0.0):
        self.lr = learning_rate
        self.momentum = momentum
        self.v = np.zeros(size, dtype=dtype) if momentum else None
        self._tmp = _Scratch(size, dtype)

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        if self.v is not None:
            self.v *= self.momentum
            self.v += g
            g = self.v
        # ``w -= lr * g`` without a fresh temporary: at 1e7 values a new 80 MB array per
        # step costs more in page faults than the arithmetic (same rounding: lr * g first)
        t = self._tmp.get()
        np.multiply(g, self.lr, out=t)
        w -= t

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        if self.v is not None:
            v = self.momentum * self.v[idx] + vals
            self.v[idx] = v
            vals = v
        w[idx] -= self.lr * vals

    def state(self) -> dict[str, Any]:
        return {"v": self.v}


class AdamRule:
    """Adam (Kingma & Ba) with bias correction; sparse updates are "lazy" (only the given
    keys' moments move), the step count is the shard's number of updates."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype,
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
    ):
        self.lr, self.b1, self.b2, self.eps = learning_rate, beta1, beta2, epsilon
        self.m = np.zeros(size, dtype=dtype)
        self.v = np.zeros(size, dtype=dtype)
        self.t = 0
        self._tmp = _Scratch(size, dtype)
        self._tmp2 = _Scratch(size, dtype)

    def _scale(self) -> np.float64:
        # a numpy scalar, not a float: with float32 shards it makes the update's
        # arithmetic float64 (NEP 50), as it always was
        self.t += 1
        return np.float64(self.lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t))

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        a = self._scale()
        t, t2 = self._tmp.get(), self._tmp2.get()
        # the textbook expressions evaluated in the same order, into reused buffers
        self.m *= self.b1
        np.multiply(g, 1 - self.b1, out=t)
        self.m += t
        self.v *= self.b2
        np.multiply(g, g, out=t)
        t *= 1 - self.b2
        self.v += t
        np.sqrt(self.v, out=t)
        t += self.eps
        np.multiply(self.m, a, out=t2)
        np.divide(t2, t, out=t)
        w -= t

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        a = self._scale()
        m = self.b1 * self.m[idx] + (1 - self.b1) * vals
        v = self.b2 * self.v[idx] + (1 - self.b2) * (vals * vals)
        self.m[idx], self.v[idx] = m, v
        w[idx] -= a * m / (np.sqrt(v) + self.eps)

    def state(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v, "t": self.t}


class _Scratch:
    """One reusable work array, allocated on first use (sparse-only shards never pay)."""

    def __init__(self, size: int, dtype: np.dtype) -> None:
        self.size, self.dtype = size, dtype
        self._a: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self._a is None:
            self._a = np.empty(self.size, dtype=self.dtype)
        return self._a


_RULES: dict[str, type] = {"sgd": SGDRule, "adam": AdamRule}


def make_rule(name: str, params: Mapping[str, float], size: int, dtype: np.dtype) -> Any:
    """The update rule ``name`` for a shard of ``size`` parameters."""
    try:
        klass = _RULES[name]
    except KeyError:
        raise IterationConfigError(
            f"unknown update rule {name!r}; known: {sorted(_RULES)}"
        ) from None
    return klass(size, dtype, **dict(params))


@dataclass(frozen=True)
class ShardSpec:
    """What one shard needs: its key range, initial values, update rule, worker count."""

    shard_id: int
    lo: int
    hi: int
    init: np.ndarray
    rule: str
    rule_params: Mapping[str, float]
    num_workers: int
    sync: bool
    inline_limit: int = INLINE_LIMIT
    extra: Mapping[str, Any] = field(default_factory=dict)


class _ShardCore:
    """One shard's state and update logic, without waiting (no coroutine: Ray makes a
    class with any ``async def`` an asyncio actor, so the two shells below differ only
    in ``pull``/``push``)."""

    def __init__(self, spec: ShardSpec, put: Callable[[Any], Any] | None = None) -> None:
        if put is None:
            try:
                import ray

                put = ray.put if ray.is_initialized() else None
            except ImportError:  # pragma: no cover - ray is a dependency
                put = None
        self.spec = spec
        self._refs = OncePerVersion(put, spec.inline_limit)
        self.w = np.array(spec.init, copy=True)
        if self.w.shape != (spec.hi - spec.lo,):
            raise IterationConfigError(
                f"shard {spec.shard_id}: {self.w.shape} initial values for keys "
                f"[{spec.lo}, {spec.hi})"
            )
        self.rule = make_rule(spec.rule, spec.rule_params, len(self.w), self.w.dtype)
        # sync steps with several pushes sum them here (reused: no fresh array per step)
        self._acc = _Scratch(len(self.w), self.w.dtype)
        self._part = _Scratch(len(self.w), self.w.dtype)
        self.version = 0
        # sync bookkeeping: the next step to apply, pushes per step, last steps per epoch
        self.epoch = 0
        self.step = 0
        self._pushes: dict[tuple[int, int], dict[int, tuple[Any, float]]] = {}
        self._steps: dict[int, dict[int, int]] = {}
        self._waiters: list[tuple[tuple[int, int], asyncio.Future[None]]] = []
        self.stats = {"pushes": 0, "updates": 0, "pulls": 0, "puts": 0, "apply_seconds": 0.0}

    # -- calls from the driver ------------------------------------------------------------

    def values(self) -> np.ndarray:
        return self.w

    def info(self) -> dict[str, Any]:
        """Counters; ``cpu_seconds`` is this shard process's CPU time so far (every
        thread: Ray's (de)serialisation and object-store puts included)."""
        return {
            "shard": self.spec.shard_id,
            "keys": [self.spec.lo, self.spec.hi],
            "version": self.version,
            "cpu_seconds": time.process_time(),
            **self.stats,
        }

    # -- internals ------------------------------------------------------------------------

    def _refuse_nonfinite(self, pid: int, epoch: int, step: int, grad: Any) -> None:
        """Refuse a sparse push holding NaN/inf whole, before any of it is stored or
        applied. The worker checked every gradient before sending any slice (so no shard
        applies part of a bad step); this is defence in depth for producers other than
        it, and cheap for sparse pushes (a pass over the entries pushed, next to their
        fancy-indexed update). Dense pushes are not checked again here: that would be a
        second full pass per push in the one process that applies every worker's update
        (the bottleneck in async mode), for values the worker has just checked."""
        if not isinstance(grad, tuple):
            return
        keys, vals = grad
        i = first_nonfinite(vals)
        if i is not None:
            spec = self.spec
            raise NonFiniteGradient(
                f"parameter shard {spec.shard_id} (keys [{spec.lo}, {spec.hi})) refused the "
                f"sparse push of partition {pid} at epoch {epoch}, step {step}: the value for "
                f"key {spec.lo + int(keys[i])} is {vals[i]}; nothing of the push was applied"
            )

    def _current(self) -> tuple[int, np.ndarray | None, Any]:
        ref = self._refs.ref(self.version, self.w, self.w.nbytes)  # one copy per version
        self.stats["puts"] = self._refs.puts
        return (self.version, None, ref) if ref is not None else (self.version, self.w.copy(), None)

    def _advance(self) -> None:
        """Apply every sync step whose pushes are all in; end epochs; wake pullers."""
        n = self.spec.num_workers
        while True:
            key = (self.epoch, self.step)
            got = self._pushes.get(key, {})
            lasts = self._steps.get(self.epoch, {})
            if any(p not in got and lasts.get(p, self.step + 1) > self.step for p in range(n)):
                break  # a worker still owes this step
            if got:
                parts = [got[p] for p in sorted(got)]
                self._apply(parts, sum(r for _, r in parts))
                del self._pushes[key]
                self.step += 1
            else:  # nobody takes part in this step: the epoch is over
                self._steps.pop(self.epoch, None)
                self.epoch += 1
                self.step = 0
        if self._waiters:
            now = (self.epoch, self.step)
            keep = []
            for key, fut in self._waiters:
                if key <= now:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((key, fut))
            self._waiters = keep

    def _apply(self, parts: list[tuple[Any, float]], total: float) -> None:
        """One update from ``parts`` (gradient, weight): ``sum(weight * g) / total``."""
        started = time.perf_counter()
        if total <= 0:
            return
        sparse = [p for p in parts if isinstance(p[0], tuple)]
        if len(sparse) == len(parts):
            if len(parts) == 1:
                (idx, vals), weight = parts[0]
                vals = vals * (weight / total) if weight != total else vals
            else:
                idx = np.concatenate([g[0] for g, _ in parts])
                vals = np.concatenate([g[1] * (r / total) for g, r in parts])
                idx, inverse = np.unique(idx, return_inverse=True)
                vals = np.bincount(inverse, weights=vals, minlength=len(idx))
            if len(idx):
                self.rule.sparse(self.w, idx, vals.astype(self.w.dtype, copy=False))
        else:
            if len(parts) == 1 and parts[0][1] == total:
                g = np.asarray(parts[0][0], dtype=self.w.dtype)
            else:
                g, part = self._acc.get(), self._part.get()
                g.fill(0)
                for grad, r in parts:
                    if isinstance(grad, tuple):
                        np.add.at(g, grad[0], grad[1] * (r / total))
                    else:
                        np.multiply(grad, r / total, out=part)
                        g += part
            self.rule.dense(self.w, g)
        self.version += 1
        self.stats["updates"] += 1
        self.stats["apply_seconds"] += time.perf_counter() - started


class ParameterShard(_ShardCore):
    """A shard as an asyncio Ray actor: sync mode, where pulls and fused pushes wait for
    every worker's push of a step. All public methods are called through Ray."""

    # -- calls from workers ---------------------------------------------------------------

    async def pull(self, epoch: int, step: int) -> tuple[int, np.ndarray | None, Any]:
        """``(version, inline values or None, object ref or None)``; sync: the parameters
        before step ``(epoch, step)``, async: the newest."""
        if self.spec.sync:
            await self._ready(epoch, step)
        self.stats["pulls"] += 1
        return self._current()

    async def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
        pull_next: bool,
    ) -> tuple[int, np.ndarray | None, Any] | None:
        """Worker ``pid``'s gradient of step ``(epoch, step)`` (None: no step; a dense
        array or ``(indices, values)``); with ``pull_next`` the reply carries the
        parameters of its next step."""
        self.stats["pushes"] += 1
        self._refuse_nonfinite(pid, epoch, step, grad)
        if not self.spec.sync:
            if grad is not None:
                self._apply([(grad, 1.0)], 1.0)
            return self._current() if pull_next else None
        if grad is not None:
            self._pushes.setdefault((epoch, step), {})[pid] = (grad, float(rows))
        if last:
            self._steps.setdefault(epoch, {})[pid] = step + 1 if grad is not None else step
        self._advance()
        if not pull_next:
            return None
        await self._ready(epoch, step + 1)
        self.stats["pulls"] += 1
        return self._current()

    async def push_packed(self, msg: tuple[Any, ...]) -> tuple[int, np.ndarray | None, Any] | None:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return await self.push(*msg)

    async def _ready(self, epoch: int, step: int) -> None:
        if (self.epoch, self.step) >= (epoch, step):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(((epoch, step), fut))
        await fut


class FreeShard(_ShardCore):
    """A shard as a plain (one-thread) Ray actor: async mode, where nothing waits, so
    every call runs straight through without an event loop (less CPU per call than the
    asyncio shell). All public methods are called through Ray."""

    def __init__(self, spec: ShardSpec, put: Callable[[Any], Any] | None = None) -> None:
        super().__init__(spec, put)
        self._direct = -1  # the version last sent as an array (not a reference)

    def pull(self, epoch: int = 0, step: int = 0) -> tuple[int, np.ndarray | None, Any]:
        """The newest parameters ``(version, inline values or None, object ref or None)``
        (the step is not waited for in async mode: clients call it without arguments)."""
        self.stats["pulls"] += 1
        return self._newest()

    def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
        pull_next: bool,
    ) -> tuple[int, np.ndarray | None, Any] | None:
        """Apply ``grad`` (None: no step) on arrival; with ``pull_next`` reply with the
        newest parameters."""
        self.stats["pushes"] += 1
        self._refuse_nonfinite(pid, epoch, step, grad)
        if grad is not None:
            self._apply([(grad, 1.0)], 1.0)
        if not pull_next:
            return None
        self.stats["pulls"] += 1
        return self._newest()

    def push_packed(self, msg: tuple[Any, ...]) -> tuple[int, np.ndarray | None, Any] | None:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return self.push(*msg)

    def _newest(self) -> tuple[int, np.ndarray | None, Any]:
        # In async mode versions change with every push, so most are pulled once: the
        # first pull of a version gets the array itself (Ray copies it into the reply, as
        # a hand-rolled actor would; safe without a copy here, since this one-thread actor
        # serialises its reply before it runs the next call); a version pulled again is
        # put into the object store once and shared by reference.
        if not self._refs.would_put(self.w.nbytes):
            return self._current()
        if self._direct != self.version:
            self._direct = self.version
            return (self.version, self.w, None)
        return self._current()


def shard_class(sync: bool) -> type[_ShardCore]:
    """The actor class of a shard: asyncio for sync mode (pulls wait), plain for async."""
    return ParameterShard if sync else FreeShard
