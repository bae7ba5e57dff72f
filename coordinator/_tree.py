"""Tree aggregation of feedback (``IterationBody(feedback_combine=...)``), sync mode only.

Without it every subtask sends its whole feedback to the coordinator actor every epoch
(N calls and N values into one process). With a combinable feedback:

* each subtask merges its own ``out.feedback`` values of an epoch into one (in emission
  order) before its call (runs in the Spark task);
* with more than ``fan_in`` subtasks, contiguous groups of subtasks report to a
  ``GroupAggregator`` actor (one per group, started by the coordinator, owned by it, so
  they die with it): the group waits for every member's call ``k``, merges the members'
  values in partition order and makes one ``report_group`` call to the coordinator,
  whose replies it hands back to the members. The coordinator then receives at most
  ``fan_in`` calls and values per epoch, whatever the number of subtasks;
* at the alignment the coordinator merges the partial values in partition order (a
  group counts at its first partition) and calls ``process_feedback`` once per epoch
  (once more for the for_each_round feedback) with the total.

The combine order is fixed by ``(num_subtasks, fan_in)`` alone, so a sync run is
bit-for-bit reproducible for a fixed partitioning; it equals the flat sum up to float
rounding. Checkpoints are unaffected: partial values of epoch ``k`` are consumed at
alignment ``k``, before a checkpoint of that alignment is cut; a restarted coordinator
starts new groups and relaunched tasks ask it for them again (``group_of``).

Over the coordinator endpoint (``transport="endpoint"``) each group also serves its
members' ``report`` on its own Flight endpoint (``serve_endpoint``,
``coordinator._tree_endpoint``); the rest of the tree is the same Ray actors.

Nothing here imports Ray at module level: the pure parts (``SumCombiner``, ``fold``,
``group_bounds``) are tested without it.
"""

from __future__ import annotations

import asyncio
import itertools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._errors import ConfigTypeError, FeedbackShapeMismatch, IterationConfigError
from ._protocol import Emissions, Reply

__all__ = [
    "DEFAULT_FAN_IN",
    "SUPPORTED_COMBINE",
    "CoordinatorTree",
    "GroupAggregator",
    "RootAggregator",
    "SumCombiner",
    "TreeSpec",
    "fold",
    "group_bounds",
    "load_combiner",
    "precombine",
]

#: at most this many calls and partial values reach the coordinator per epoch
DEFAULT_FAN_IN = 32
#: the named combiners ``feedback_combine`` accepts
SUPPORTED_COMBINE = ("sum",)


class SumCombiner:
    """``merge(a, b) = a + b`` for numbers and numpy arrays, element by element for
    tuples, lists and dicts of them (the structure of every value must be the same).

    The first operand's arrays are copied once and then added to in place, so a fold
    over many large arrays allocates one accumulator, not one array per merge (the
    rounding is that of ``a + b``)."""

    def merge(self, a: Any, b: Any) -> Any:
        return _add(a, b, owned=False)

    def __repr__(self) -> str:
        return "SumCombiner()"


def _add(a: Any, b: Any, *, owned: bool) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape != b.shape:
            raise FeedbackShapeMismatch(
                f"feedback_combine='sum': arrays of shapes {a.shape} and {b.shape} cannot be "
                f"summed; every partition must feed back arrays of the same shape"
            )
        out_dtype = np.result_type(a, b)
        if owned and isinstance(a, np.ndarray) and a.dtype == out_dtype and a.flags.writeable:
            np.add(a, b, out=a)
            return a
        return np.add(a, b)  # a fresh array: ours from now on
    if isinstance(a, tuple | list):
        if not isinstance(b, tuple | list) or len(a) != len(b):
            raise ValueError(
                f"feedback_combine='sum': cannot sum a {type(a).__name__} of {len(a)} with "
                f"{_describe(b)}; every feedback value must have the same structure"
            )
        items = [_add(x, y, owned=owned) for x, y in zip(a, b)]
        return type(a)(items) if isinstance(a, tuple) else items
    if isinstance(a, Mapping):
        if not isinstance(b, Mapping) or set(a) != set(b):
            raise ValueError(
                f"feedback_combine='sum': cannot sum a dict with keys {sorted(map(str, a))} "
                f"with {_describe(b)}; every feedback value must have the same keys"
            )
        return {k: _add(a[k], b[k], owned=owned) for k in a}
    if _is_number(a) and _is_number(b):
        return a + b
    raise TypeError(
        f"feedback_combine='sum' sums numbers, numpy arrays and tuples, lists or dicts of "
        f"them; got {_describe(a)} and {_describe(b)}. Feed back numeric values, or pass a "
        f"combiner object with merge(a, b), or leave feedback_combine unset"
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Number | np.generic) and not isinstance(v, bool | np.bool_)


def _describe(v: Any) -> str:
    return f"a {type(v).__name__}"


def _check_sum_value(v: Any) -> None:
    """Refuse what 'sum' cannot add (a lone value is never merged, so check it too)."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biufc":
            raise TypeError(f"feedback_combine='sum': a {v.dtype} array cannot be summed")
        return
    if isinstance(v, tuple | list):
        for x in v:
            _check_sum_value(x)
        return
    if isinstance(v, Mapping):
        for x in v.values():
            _check_sum_value(x)
        return
    if not _is_number(v):
        _add(v, v, owned=False)  # raises the TypeError naming the type and the fix


def load_combiner(combine: Any) -> Any:
    """The combiner object for ``feedback_combine`` (a supported name or an object with
    ``merge``); raises ``ValueError`` / ``TypeError`` naming the fix otherwise."""
    if isinstance(combine, str):
        if combine == "sum":
            return SumCombiner()
        raise IterationConfigError(
            f"feedback_combine={combine!r} is not supported; use one of "
            f"{list(SUPPORTED_COMBINE)} or an object with a merge(a, b) method"
        )
    if not callable(getattr(combine, "merge", None)):
        raise ConfigTypeError(
            f"feedback_combine must be one of {list(SUPPORTED_COMBINE)} or an object with a "
            f"merge(a, b) method returning the combined value; {type(combine).__name__} has "
            f"no merge method"
        )
    return combine


def fold(values: Sequence[Any], combiner: Any) -> Any:
    """``merge(...merge(merge(v0, v1), v2)..., vn)``: left to right, a fixed order."""
    if not values:
        raise ValueError("fold() of no values")
    if isinstance(combiner, SumCombiner):
        acc = values[0]
        if len(values) == 1:
            _check_sum_value(acc)
        for v in values[1:]:
            acc = _add(acc, v, owned=acc is not values[0])
        return acc
    acc = values[0]
    for v in values[1:]:
        acc = combiner.merge(acc, v)
    return acc


def group_bounds(num_subtasks: int, fan_in: int) -> list[tuple[int, int]]:
    """Contiguous partition ranges ``[lo, hi)`` of the aggregator groups; empty when the
    subtasks report straight to the coordinator (``num_subtasks <= fan_in``).

    At most ``fan_in`` groups; beyond ``fan_in ** 2`` subtasks the groups grow larger
    (each still makes one call per epoch)."""
    if num_subtasks <= fan_in:
        return []
    groups = min(fan_in, -(-num_subtasks // fan_in))
    cuts = np.linspace(0, num_subtasks, groups + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(cuts)]


@dataclass(frozen=True)
class TreeSpec:
    """How feedback is combined: the combiner (cloudpickle) and the fan-in."""

    combiner: bytes
    fan_in: int = DEFAULT_FAN_IN

    def __post_init__(self) -> None:
        if not isinstance(self.fan_in, int) or isinstance(self.fan_in, bool) or self.fan_in < 1:
            raise IterationConfigError(f"fan_in must be an int >= 1, got {self.fan_in!r}")

    def load(self) -> Any:
        import cloudpickle

        return load_combiner(cloudpickle.loads(self.combiner))


def precombine(em: Emissions, combiner: Any) -> Emissions:
    """A subtask's emissions with each kind of feedback merged into one value (runs in
    the Spark task, or in a group for its members); ``combined_count`` keeps the number
    of ``out.feedback`` records for the epoch accounting and ``feedback_counts``."""
    if em.combined_count is not None:
        return em
    return replace(
        em,
        feedback=[fold(em.feedback, combiner)] if em.feedback else [],
        round_feedback=[fold(em.round_feedback, combiner)] if em.round_feedback else [],
        combined_count=em.feedback_count,
    )


class CoordinatorTree:
    """The coordinator actor's side of the tree: the combiner and the group actors (the
    partial values of each epoch are the core's, ``_core.py``, merged by the operator
    host at the alignment). Runs in the Ray coordinator actor."""

    def __init__(
        self,
        spec: TreeSpec,
        num_subtasks: int,
        *,
        start_groups: bool = True,
        placement: Mapping[str, float] | None = None,
    ) -> None:
        self.spec = spec
        self.combiner = spec.load()
        self.bounds = group_bounds(num_subtasks, spec.fan_in)
        self.groups: list[Any] = []
        #: each group's endpoint location, over the coordinator endpoint (``serve``)
        self.locations: list[str] = []
        #: merges the groups' calls into one per epoch (None: no groups)
        self.root: Any = None
        self.calls = 0  # report / report_group calls received (the fan-in in practice)
        if self.bounds and start_groups:
            import ray

            # the coordinator tier's placement (the driver's rule, ``CoordinatorSpec.
            # placement``): the aggregators ask for the same resources, so they go where
            # the coordinator is
            options: dict[str, Any] = {
                "num_cpus": 0,
                "max_restarts": 0,
                "max_task_retries": 0,
                "max_concurrency": max(1000, 4 * 64),
                "enable_task_events": False,
                **({"resources": dict(placement)} if placement else {}),
            }
            me = ray.get_runtime_context().current_actor
            self.root = ray.remote(**options)(RootAggregator).remote(me, self.bounds, spec)
            cls = ray.remote(**options)(GroupAggregator)
            self.groups = [cls.remote(me, lo, hi, spec, self.root) for lo, hi in self.bounds]

    def group_of(self, pid: int) -> Any:
        """The group actor subtask ``pid`` reports to (None: straight to the coordinator)."""
        for (lo, hi), g in zip(self.bounds, self.groups):
            if lo <= pid < hi:
                return g
        return None

    async def serve(self, spec: Any) -> None:
        """Over the coordinator endpoint: every group serves its own endpoint
        (``coordinator._tree_endpoint``) with ``spec``'s token and TLS; ``location_of``
        then names a subtask's. Once: later calls find them served."""
        if self.groups and not self.locations:
            from ._tree_endpoint import group_spec

            served = group_spec(spec)
            self.locations = list(
                await asyncio.gather(*[g.serve_endpoint.remote(served) for g in self.groups])
            )

    def location_of(self, pid: int) -> str | None:
        """The endpoint location of subtask ``pid``'s group (None: straight to the
        coordinator)."""
        for (lo, hi), where in zip(self.bounds, self.locations):
            if lo <= pid < hi:
                return where
        if self.groups and not self.locations:
            raise RuntimeError("the feedback groups are not serving their endpoints")
        return None

    def abort(self, failure: Any) -> None:
        """Answer every member waiting in a group (a failure was recorded)."""
        for g in [*self.groups, *([self.root] if self.root is not None else [])]:
            try:
                g.abort.remote(failure)
            except Exception:
                pass  # a dead group: its members fail on their own


class _Aggregator:
    """What a group and the root share. The calls of one ``(attempt, call)`` key are
    held until ``expected`` have arrived; then their records are merged (``_merge``)
    and sent upstream in one ``report_group`` call, whose replies go back to the callers
    in order: one reply to a caller that waits for one (``size`` None), a slice of
    ``size`` replies to one that waits for a list. A merge that fails, or a failure the
    coordinator recorded (``abort``), answers every waiting caller: nobody waits forever.
    All public methods are called through Ray."""

    #: names the aggregator in a failure
    where = "a feedback aggregator"

    def __init__(self, coordinator: Any, upstream: Any, expected: int, spec: TreeSpec) -> None:
        self.coord = coordinator
        #: where the merged calls go: the root aggregator, or the coordinator itself
        self.up = upstream
        self.expected = expected
        self.combiner = spec.load()
        #: (attempt, call) -> caller index -> (size, payload, future)
        self._calls: dict[tuple[int, int], dict[int, tuple[int | None, Any, Any]]] = {}
        self._failure: Any = None
        self.forwarded = 0

    async def _hold(self, key: tuple[int, int], index: int, size: int | None, payload: Any) -> Any:
        if self._failure is not None:
            return _answer(Reply(key[1], True, -1, None, self._failure), size)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        calls = self._calls.setdefault(key, {})
        calls[index] = (size, payload, fut)
        if len(calls) == self.expected:
            del self._calls[key]
            _keep(asyncio.get_running_loop().create_task(self._forward(key, calls)))
        return await fut

    def _merge(self, order: list[int], payloads: list[Any]) -> tuple[int, list[Any], Emissions]:
        """``(first pid, member records, merged feedback)`` of the callers' payloads."""
        raise NotImplementedError

    async def _forward(self, key: tuple[int, int], calls: dict[int, Any]) -> None:
        attempt, epoch = key
        order = sorted(calls)
        entries = [calls[i] for i in order]
        try:
            first, members, combined = self._merge(order, [e[1] for e in entries])
        except Exception as ex:  # a combiner that cannot merge: fail the run, never hang
            await self._fail(ex, key, entries)
            return
        self.forwarded += 1
        try:
            replies = await self.up.report_group.remote(first, epoch, members, combined, attempt)
        except Exception as ex:  # upstream died: the callers fail with the cause
            for *_, fut in entries:
                if not fut.done():
                    fut.set_exception(ex)
            return
        at = 0
        for size, _, fut in entries:
            if not fut.done():
                fut.set_result(replies[at] if size is None else replies[at : at + size])
            at += 1 if size is None else size

    async def _fail(self, ex: Exception, key: tuple[int, int], entries: list[Any]) -> None:
        """Merging failed (arrays of different shapes, a user's ``merge`` raised): the run
        fails with the cause. The coordinator records it first (so the driver finds the
        cause when the members stop, and every other subtask stops too), then the
        waiting callers get it as their reply."""
        from ._errors import RemoteFailure

        attempt, epoch = key
        failure = RemoteFailure.capture(
            ex, source=self.where, epoch=epoch, where="combining feedback"
        )
        try:
            await asyncio.wait_for(self.coord.fail.remote(failure, attempt), 60)
        except Exception:
            pass  # the coordinator died or is stuck: the callers still get the failure
        reply = Reply(epoch, True, -1, None, failure)
        for size, _, fut in entries:
            if not fut.done():
                fut.set_result(_answer(reply, size))

    async def abort(self, failure: Any) -> None:
        """The coordinator recorded a failure: answer every waiting caller with it."""
        self._failure = failure
        calls, self._calls = self._calls, {}
        for (_, epoch), entries in calls.items():
            reply = Reply(epoch, True, -1, None, failure)
            for size, _, fut in entries.values():
                if not fut.done():
                    fut.set_result(_answer(reply, size))


class GroupAggregator(_Aggregator):
    """One group of subtasks ``[lo, hi)``: collects their call ``k``, merges their
    feedback in partition order and makes one ``report_group`` call (to the root
    aggregator, or to the coordinator). An asyncio Ray actor owned by the coordinator."""

    def __init__(
        self, coordinator: Any, lo: int, hi: int, spec: TreeSpec, upstream: Any = None
    ) -> None:
        super().__init__(
            coordinator, upstream if upstream is not None else coordinator, hi - lo, spec
        )
        self.lo, self.hi = lo, hi
        self.where = f"feedback group [{lo}, {hi})"
        #: its endpoint's server, over the coordinator endpoint (``serve_endpoint``)
        self._server: Any = None

    async def report(
        self,
        pid: int,
        epoch: int,
        known_version: int,
        emissions: Emissions,
        rows: Sequence[int] | None = None,
        attempt: int = 0,
        offered: tuple[Any] | None = None,
    ) -> Reply:
        """Member ``pid``'s call ``epoch``: returns the coordinator's reply to it. The
        coordinator's ``report`` signature; ``offered`` is always None here (a member of a
        tree is asked for its checkpoint state and answers the coordinator directly)."""
        reply: Reply = await self._hold(
            (attempt, epoch), pid, None, (known_version, emissions, rows)
        )
        return reply

    def _merge(self, order: list[int], payloads: list[Any]) -> tuple[int, list[Any], Emissions]:
        """The members' records without feedback, and their feedback merged."""
        members = []
        partial = []
        partial_round = []
        # members that emitted nothing but feedback (the common case) share one record
        # per (criteria, count): the call pickles it once, not once per member
        alike: dict[tuple[int, int | None], Emissions] = {}
        for p, (kv, em, rows) in zip(order, payloads):
            em = precombine(em, self.combiner)
            partial += em.feedback
            partial_round += em.round_feedback
            if em.outputs:
                rest = replace(em, feedback=[], round_feedback=[])
            else:
                key = (em.criteria, em.combined_count)
                rest = alike.get(key) or alike.setdefault(
                    key, Emissions(criteria=em.criteria, combined_count=em.combined_count)
                )
            members.append((p, kv, rest, rows))  # feedback travels once, merged
        return self.lo, members, _merged(partial, partial_round, self.combiner)

    async def serve_endpoint(self, spec: Any) -> str:
        """Serve this group's ``report`` on ``spec`` (an ``EndpointSpec``; once: a second
        call answers the same); returns the location its members dial."""
        from ._tree_endpoint import serve_group

        if self._server is None:
            self._server = await serve_group(self, spec)
        return str(self._server.location)

    async def info(self) -> dict[str, Any]:
        """Counters; ``cpu_seconds``: this group process's CPU time so far."""
        return {"lo": self.lo, "hi": self.hi, "forwarded": self.forwarded, "cpu_seconds": _cpu()}


class RootAggregator(_Aggregator):
    """Between the groups and the coordinator: waits for every group's call ``k``, merges
    their feedback in partition order and makes one ``report_group`` call for all their
    members, so the coordinator receives one call per epoch however many groups there
    are (each call costs Ray about half a millisecond of the coordinator's CPU). The
    merge order is the coordinator's own (groups by first partition, left to right), so
    the totals are the same bits as if the groups called the coordinator. An asyncio Ray
    actor owned by the coordinator; its ``report_group`` has the coordinator's signature."""

    where = "the feedback tree's root"

    def __init__(self, coordinator: Any, bounds: Sequence[tuple[int, int]], spec: TreeSpec):
        super().__init__(coordinator, coordinator, len(bounds), spec)

    async def report_group(
        self,
        first_pid: int,
        epoch: int,
        members: Sequence[Any],
        combined: Emissions,
        attempt: int = 0,
    ) -> list[Reply]:
        replies: list[Reply] = await self._hold(
            (attempt, epoch), first_pid, len(members), (members, combined)
        )
        return replies

    def _merge(self, order: list[int], payloads: list[Any]) -> tuple[int, list[Any], Emissions]:
        members = [m for group, _ in payloads for m in group]
        combined = _merged(
            [v for _, em in payloads for v in em.feedback],
            [v for _, em in payloads for v in em.round_feedback],
            self.combiner,
        )
        return order[0], members, combined

    async def info(self) -> dict[str, Any]:
        """Counters; ``cpu_seconds``: this process's CPU time so far."""
        return {"groups": self.expected, "forwarded": self.forwarded, "cpu_seconds": _cpu()}


def _answer(reply: Reply, size: int | None) -> Any:
    """``reply`` for a caller that waits for one, else ``size`` of it."""
    return reply if size is None else [reply] * size


def _merged(main: list[Any], round_: list[Any], combiner: Any) -> Emissions:
    """One record carrying each kind of feedback folded left to right."""
    return Emissions(
        feedback=[fold(main, combiner)] if main else [],
        round_feedback=[fold(round_, combiner)] if round_ else [],
        combined_count=0,
    )


#: forwarding tasks in flight (the event loop keeps only weak references to tasks)
_TASKS: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def _cpu() -> float:
    import time

    return time.process_time()


# -- the coordinator's futures of a group call ------------------------------------------------


class _GroupCall:
    """The members' replies of one ``report_group`` call; its ``future`` resolves with
    them, in member order, when the last one is set."""

    __slots__ = ("future", "missing", "replies")

    def __init__(self, size: int, future: asyncio.Future[list[Reply]]) -> None:
        self.replies: list[Reply | None] = [None] * size
        self.missing = size
        self.future = future


class _Member:
    """One member's place in a ``_GroupCall``: set like a future, at most once."""

    __slots__ = ("call", "index")

    def __init__(self, call: _GroupCall, index: int) -> None:
        self.call, self.index = call, index

    def done(self) -> bool:
        return self.call.replies[self.index] is not None

    def set_result(self, result: Reply, /) -> None:
        call = self.call
        if call.replies[self.index] is not None:
            raise asyncio.InvalidStateError(f"member #{self.index} already has its reply")
        call.replies[self.index] = result
        call.missing -= 1
        if call.missing == 0 and not call.future.done():
            call.future.set_result(call.replies)  # type: ignore[arg-type]  # all set now
