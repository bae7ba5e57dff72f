"""The parameter shard's core stepped one event at a time through ``handle`` (no Ray, no
asyncio): which instructions each call gives, in which order; and driven by random
schedules of pulls, pushes, resets and retirements from several workers, against a
numpy loop written here. Slots are plain strings (the actor uses futures); every core
is validated at the end (``validate_cores``), and after every event of a schedule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_iter as hi
from coordinator import CoordinatorSpec, IterationCoordinator
from coordinator._errors import NonFiniteGradient, SpareMisuse, StaleShardCall
from coordinator._ps import FreeShard
from coordinator._shard_core import ShardCore
from coordinator._shard_protocol import (
    Configure,
    Forget,
    LoadRows,
    Lookup,
    Pull,
    Push,
    Put,
    Refuse,
    Reply,
    Reset,
    Restore,
    Retire,
    Save,
    ShardSpec,
    Values,
    Wait,
    WriteCheckpoint,
)
from coordinator._tables import Init, TableSpec

pytestmark = pytest.mark.usefixtures("validate_cores")

LR = 0.5


def make_spec(n=2, *, sync=True, size=3, staleness=None, token="t0", tables=()):
    return ShardSpec(
        shard_id=0,
        lo=0,
        hi=size,
        init=np.arange(float(size)),
        rule="sgd",
        rule_params={"learning_rate": LR},
        num_workers=n,
        sync=sync,
        token=token,
        staleness_steps=staleness,
        tables=tables,
    )


def only(out, kind):
    """The one instruction of ``out`` (asserting there is exactly one, of ``kind``)."""
    assert len(out) == 1 and isinstance(out[0], kind), out
    return out[0]


def refused(ins, slot, error, match):
    assert isinstance(ins, Refuse) and ins.slot == slot, ins
    assert isinstance(ins.error, error) and match in str(ins.error), ins.error


# -- step by step ---------------------------------------------------------------------------


def test_a_sync_step_is_applied_only_once_every_worker_pushed():
    core = ShardCore(make_spec(2))
    g0, g1 = np.array([1.0, 2.0, 3.0]), np.array([-1.0, 0.5, 4.0])
    assert only(core.handle(Pull("p0", 0, 0, 0, "t0")), Reply).value.version == 0
    assert only(core.handle(Pull("p1", 1, 0, 0, "t0")), Reply).value.version == 0
    # worker 0's step waits for worker 1's; nothing is applied meanwhile
    assert core.handle(Push("a0", 0, 0, 0, g0, 1.0, False, True, "t0")) == [Wait("a0", (0, 1))]
    assert core.version == 0 and core.w.tolist() == [0.0, 1.0, 2.0]
    out = core.handle(Push("a1", 1, 0, 0, g1, 3.0, True, False, "t0"))
    # the waiting push is answered with the values after the step, then the pusher
    assert [type(i) for i in out] == [Reply, Reply] and [i.slot for i in out] == ["a0", "a1"]
    want = np.arange(3.0) - LR * (g0 * (1.0 / 4.0) + g1 * (3.0 / 4.0))  # worker order
    got = out[0].value
    assert (got.version, got.by_ref, got.rows) == (1, False, None)
    assert got.inline.tobytes() == want.tobytes() == core.w.tobytes()
    assert got.inline is not core.w  # a copy: later steps do not change a reply
    assert out[1].value is None
    # worker 1 is done with epoch 0: its pull of epoch 1 waits for worker 0's last step
    assert core.handle(Pull("p1", 1, 1, 0, "t0")) == [Wait("p1", (1, 0))]
    out = core.handle(Push("b0", 0, 0, 1, g0, 2.0, True, False, "t0"))
    assert [i.slot for i in out] == ["p1", "b0"] and out[0].value.version == 2
    assert (core.epoch, core.step) == (1, 0)


def test_a_worker_without_a_step_does_not_hold_the_epoch():
    core = ShardCore(make_spec(2))
    assert core.handle(Push("a0", 0, 0, 0, None, 0.0, True, False, "t0")) == [Reply("a0", None)]
    assert core.handle(Pull("p0", 0, 1, 0, "t0")) == [Wait("p0", (1, 0))]
    out = core.handle(Push("a1", 1, 0, 0, np.ones(3), 5.0, True, False, "t0"))
    assert [i.slot for i in out] == ["p0", "a1"] and core.version == 1
    np.testing.assert_array_equal(out[0].value.inline, np.arange(3.0) - LR)


def test_a_fenced_call_is_refused_and_never_applied():
    core = ShardCore(make_spec(2))
    assert core.handle(Push("a0", 0, 0, 0, np.ones(3), 1.0, False, True, "t0"))[0] == Wait(
        "a0", (0, 1)
    )
    out = core.handle(Reset("r", "t1"))
    # the waiting call of the old launch is released with the refusal, then the reset
    refused(out[0], "a0", StaleShardCall, "reset for a relaunch")
    assert out[1:] == [Reply("r", None)]
    # a late push of the old launch: refused, nothing stored (a step of the new launch
    # would otherwise sum it in)
    refused(
        only(core.handle(Push("x", 1, 0, 0, np.ones(3), 1.0, True, False, "t0")), Refuse),
        "x",
        StaleShardCall,
        "earlier launch",
    )
    assert core.stats["pushes"] == 0 or core.version == 0
    assert core.handle(Push("n0", 0, 0, 0, np.zeros(3), 1.0, True, False, "t1")) == [
        Reply("n0", None)
    ]
    assert core.version == 0  # worker 1 of the new launch owes its step
    core.handle(Push("n1", 1, 0, 0, np.zeros(3), 1.0, True, False, "t1"))
    assert core.version == 1 and core.w.tolist() == [0.0, 1.0, 2.0]


def test_a_restarted_shard_accepts_nothing_until_restored_or_reset():
    core = ShardCore(make_spec(1), restarted=True)
    assert core.token is None
    refused(only(core.handle(Pull("p", 0, 0, 0, "t0")), Refuse), "p", StaleShardCall, "restarted")
    assert core.handle(Reset("r", "t2")) == [Reply("r", None)]
    assert only(core.handle(Pull("p", 0, 0, 0, "t2")), Reply).value.version == 0


def test_a_forgotten_shard_refuses_late_calls_and_releases_a_waiting_pull():
    core = ShardCore(make_spec(2))
    assert core.handle(Pull("p", 0, 0, 1, "t0")) == [Wait("p", (0, 1))]
    assert core.handle(Forget("f", declined=True)) == [Reply("f", False)]  # kept: killed
    assert not core.spare and core.handle(Pull("q", 1, 0, 0, "t0"))[0].value.version == 0
    out = core.handle(Forget("f2", declined=False))
    refused(out[0], "p", StaleShardCall, "the run ended")
    assert out[1:] == [Reply("f2", True)]
    assert core.spare and not hasattr(core, "w")  # nothing of the run is held
    for late in (
        Push("x", 0, 0, 0, np.ones(3), 1.0, True, False, "t0"),
        Retire("y", 1),
        Reset("z", "t9"),
    ):
        refused(only(core.handle(late), Refuse), late.slot, StaleShardCall, "serves no run")
    assert core.handle(Forget("f3", declined=True)) == [Reply("f3", True)]  # a spare
    # the next run configures it: a new shard's behaviour
    spec = dataclasses.replace(make_spec(1), init=np.full(3, 7.0), token="u")
    assert core.handle(Configure("c", spec, False, False)) == [Reply("c", None)]
    assert core.w.tolist() == [7.0] * 3 and core.stats["pulls"] == 0
    refused(
        only(core.handle(Configure("c2", spec, False, False)), Refuse),
        "c2",
        SpareMisuse,
        "configured already",
    )


def test_a_restarted_spare_cannot_take_a_run():
    core = ShardCore(None)
    out = core.handle(Configure("c", make_spec(1), False, True))
    refused(only(out, Refuse), "c", SpareMisuse, "restarted spare parameter shard")
    assert core.spare


def test_the_staleness_gate_opens_exactly_when_the_slowest_catches_up():
    core = ShardCore(make_spec(3, sync=False, staleness=1))
    g = np.ones(3)

    def push(slot, pid, step, pull_next=True):
        return core.handle(Push(slot, pid, 0, step, g, 1.0, False, pull_next, "t0", span=10))

    assert isinstance(only(push("a", 0, 0), Reply).value, Values)  # 1 step ahead: goes
    assert push("b", 0, 1) == [Wait("b", None)]  # 2 ahead of workers 1 and 2: waits
    assert core.stats["gate_waits"] == 1 and core.version == 2  # applied on arrival
    assert isinstance(only(push("c", 1, 0), Reply).value, Values)  # worker 2 is still at 0
    assert core.handle(Pull("d", 1, 0, 0, "t0"))[0].slot == "d"  # a pull moves nobody
    out = push("e", 2, 0)  # the slowest catches up: worker 0 leads by 1 now
    assert [i.slot for i in out] == ["b", "e"] and out[0].value.version == 4
    assert core.stats["max_lead"] == 1
    # a retired worker no longer holds the others back
    assert push("f", 0, 2) == [Wait("f", None)]
    assert push("g", 1, 1, pull_next=False) == [Reply("g", None)]
    out = core.handle(Retire("h", 2))
    assert [i.slot for i in out] == ["f", "h"]


def test_a_one_thread_shard_sends_a_version_live_once_then_puts_it_once():
    spec = dataclasses.replace(make_spec(1, sync=False, size=4), inline_limit=8)
    core = ShardCore(spec, one_thread=True, can_put=True)
    first = only(core.handle(Pull("a", 0, 0, 0, "t0")), Reply).value
    assert first.inline is core.w and not first.by_ref  # the live array, no put
    out = core.handle(Pull("b", 0, 0, 0, "t0"))
    assert isinstance(out[0], Put) and out[0].version == 0 and out[0].value is core.w
    assert out[1].value.by_ref and out[1].value.inline is None
    assert only(core.handle(Pull("c", 0, 0, 0, "t0")), Reply).value.by_ref  # no second put
    assert core.stats["puts"] == 1
    # an asyncio shell's core never sends the live array: its replies may leave later
    waiting = ShardCore(dataclasses.replace(spec, sync=True), can_put=True)
    out = waiting.handle(Pull("d", 0, 0, 0, "t0"))
    assert isinstance(out[0], Put) and out[1].value.by_ref


def test_a_one_thread_shard_cannot_hold_a_waiting_call():
    with pytest.raises(hi.UsageError, match="FreeShard"):
        ShardCore(make_spec(1, sync=True), one_thread=True)
    with pytest.raises(hi.UsageError, match="FreeShard"):
        FreeShard(make_spec(2, sync=False, staleness=1), put=None)


def test_a_dense_gradient_of_another_length_is_refused_not_broadcast():
    """numpy would add a (1,) gradient to every key: a silent wrong answer."""
    for sync in (True, False):
        core = ShardCore(make_spec(1, sync=sync))
        out = core.handle(Push("a", 0, 0, 0, np.ones(1), 1.0, True, False, "t0"))
        refused(only(out, Refuse), "a", hi.UsageError, "a dense gradient of shape (1,) for 3 keys")
        assert core.version == 0 and core.w.tolist() == [0.0, 1.0, 2.0]


def test_a_sparse_push_with_nan_is_refused_whole_in_sync_mode_too():
    core = ShardCore(make_spec(2))
    bad = (np.array([0, 2]), np.array([1.0, np.inf]))
    out = core.handle(Push("a", 0, 0, 0, bad, 1.0, True, False, "t0"))
    refused(only(out, Refuse), "a", NonFiniteGradient, "key 2 is inf")
    assert not core._pushes  # not held for the step either


def test_a_checkpoint_record_restores_exactly_and_another_cut_is_refused():
    table = TableSpec("t", 2, Init("normal", {"std": 1.0}, 3), "adagrad", {"learning_rate": 0.1})
    core = ShardCore(make_spec(1, sync=False, tables=(table,)))
    keys = (np.array([5, -2]),)
    core.handle(Pull("p", 0, 0, 0, "t0", keys))
    core.handle(
        Push("a", 0, 0, 0, np.ones(3), 1.0, False, False, "t0", (np.ones((2, 2)),), keys, 4)
    )
    out = core.handle(Save("s", "cut1", "uri", "part-0"))
    write = out[0]
    assert isinstance(write, WriteCheckpoint) and (write.uri, write.name) == ("uri", "part-0")
    assert out[1] == Reply("s", {"shard": 0, "name": "part-0", "updates": 1, "rows": 2})
    w, rows = core.w.copy(), core.tables[0].items()
    core.handle(
        Push("b", 0, 0, 1, np.ones(3), 1.0, False, False, "t0", (np.ones((2, 2)),), None, 4)
    )
    wrong = core.handle(Restore("r", write.record, "cut2", "t1", "uri/part-0"))
    refused(only(wrong, Refuse), "r", hi.CheckpointError, "belongs to another checkpoint")
    assert core.version == 2 and core.token == "t0"  # nothing changed
    got = only(core.handle(Restore("r2", write.record, "cut1", "t1", "uri/part-0")), Reply)
    assert got.value["discarded_updates"] == 1 and got.value["positions_cut"] == {0: (0, 0)}
    assert core.w.tobytes() == w.tobytes() and core.version == 1 and core.token == "t1"
    for a, b in zip(core.tables[0].items(), rows):
        assert a.tobytes() == b.tobytes()


def test_loaded_rows_already_held_are_refused_before_any_is_added():
    table = TableSpec("t", 1, Init(), "sgd", {"learning_rate": 0.1})
    core = ShardCore(make_spec(1, tables=(table,)))
    assert core.handle(LoadRows("a", "t", np.array([1, 2]), np.ones((2, 1)))) == [Reply("a", 2)]
    for keys in (np.array([3, 2]), np.array([4, 4])):  # one held, a duplicate in the batch
        out = core.handle(LoadRows("b", "t", keys, np.ones((2, 1))))
        refused(only(out, Refuse), "b", hi.UsageError, "held already")
        assert len(core.tables[0]) == 2
    refused(
        only(core.handle(LoadRows("c", "u", keys, keys)), Refuse),
        "c",
        hi.UsageError,
        "no table 'u'",
    )


def test_a_lookup_waits_for_its_step_and_creates_no_row():
    table = TableSpec("t", 1, Init("constant", {"value": 2.0}), "sgd", {"learning_rate": 1.0})
    core = ShardCore(make_spec(1, tables=(table,)))
    keys = (np.array([9]),)
    assert core.handle(Lookup("l", "t0", keys, True, (0, 1))) == [Wait("l", (0, 1))]
    core.handle(Pull("p", 0, 0, 0, "t0", keys))
    out = core.handle(Push("a", 0, 0, 0, None, 1.0, True, False, "t0", (np.ones((1, 1)),)))
    assert [i.slot for i in out] == ["l", "a"]
    assert out[0].value.version == 1 and out[0].value.rows[0].tolist() == [[1.0]]
    rows = only(core.handle(Lookup("m", "t0", (np.array([8]),))), Reply).value
    assert rows[0].tolist() == [[2.0]] and len(core.tables[0]) == 1


# -- one spare protocol for both kinds of actor ----------------------------------------------


def _coordinator_spec():
    import cloudpickle
    from test_actor import Sum

    return CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=0,
        max_epochs=1,
        has_criteria=False,
        init_variables={"total": 0.0},
        operators=cloudpickle.dumps((Sum(), None, [])),
    )


@pytest.mark.parametrize("kind", ["coordinator", "parameter shard"])
def test_the_coordinator_and_the_shards_share_one_spare_protocol(kind):
    if kind == "coordinator":
        spec, actor, give_back = _coordinator_spec(), IterationCoordinator(None), "retire"
        life = actor  # the shell goes through the life cycle
    else:
        spec, actor, give_back = make_spec(1, sync=False), FreeShard(None), "forget"
        life = actor.core  # the core does, for its shell
    assert life._spare and not hasattr(actor, "spec")
    assert getattr(actor, give_back)() is True  # a spare has nothing to give back
    actor.configure(spec)
    with pytest.raises(SpareMisuse, match=f"this {kind} is configured already"):
        actor.configure(spec)
    assert isinstance(SpareMisuse("m"), hi.UsageError)  # what callers catch still holds
    assert getattr(actor, give_back)() is True
    assert life._spare and not hasattr(actor, "spec")
    actor.configure(spec)  # a spare again: the next run takes it
    assert not life._spare and actor.spec is spec


# -- random schedules ----------------------------------------------------------------------

D = 3


class Schedule:
    """Drives a core with workers that each follow the protocol (a call at a time; a
    call that waits blocks its worker until answered), interleaved as ``picks`` say,
    with relaunches (``Reset``: a new token, new workers) at the event numbers in
    ``resets``. Checks after every event that no call is answered twice and that the
    core is valid; ``on_event(event, instructions, retired)`` checks more."""

    def __init__(self, core, picks, resets, on_event=None):
        self.core, self.picks, self.resets, self.on_event = core, iter(picks), resets, on_event
        self.answers: dict[str, list] = {}
        self.calls: dict[str, object] = {}
        self.serial = 0
        self.generation = 0
        self.retired: set[int] = set()

    def send(self, event):
        self.calls[event.slot] = event
        out = self.core.handle(event)
        for ins in out:
            if isinstance(ins, Reply | Refuse):
                self.answers.setdefault(ins.slot, []).append(ins)
                assert len(self.answers[ins.slot]) == 1, f"{ins.slot} answered twice"
        self.core.validate()
        if self.on_event is not None:
            self.on_event(event, out, self.retired)
        return out

    def slot(self):
        self.serial += 1
        return f"c{self.serial}"

    def refused(self, slot):
        return slot in self.answers and isinstance(self.answers[slot][0], Refuse)

    def run(self, plans, seed, late):
        """Run workers until each has made all its calls; a reset starts new workers
        (and lets each old one with a call left make it late: it must be refused and
        change nothing). Returns the last launch's gradients, rows and the pushes it
        accepted, in arrival order."""
        core, n, sync = self.core, len(plans), self.core.spec.sync
        event_no = 0
        while True:
            token = f"t{self.generation}"
            grads, rows = _grads(seed, self.generation, plans)
            span = None if sync else plans[0][0]
            workers = {p: worker_calls(p, plans[p], token, grads, rows, span) for p in range(n)}
            pending = {p: next(workers[p]) for p in range(n)}
            blocked: dict[int, str] = {}  # pid -> the slot of its waiting call
            accepted = []
            self.retired = set()
            while pending or blocked:
                event_no += 1
                if event_no in self.resets and self.generation < 3:
                    break
                ready = [p for p in sorted(pending) if p not in blocked]
                assert ready, "every worker waits: the protocol deadlocked"
                p = ready[next(self.picks, 0) % len(ready)]
                slot = self.slot()
                event = pending[p](slot)
                self.send(event)
                if isinstance(event, Push) and not self.refused(slot):
                    accepted.append((p, event.epoch, event.step))
                if slot not in self.answers:
                    blocked[p] = slot
                for q, waiting in list(blocked.items()):
                    if waiting in self.answers:
                        del blocked[q]
                try:
                    pending[p] = next(workers[p])
                except StopIteration:
                    del pending[p]
                    if not sync:  # no more steps: it no longer holds the others back
                        self.retired.add(p)
                        self.send(Retire(self.slot(), p))
            else:
                return grads, rows, accepted
            self.generation += 1
            stale = list(blocked.values())
            self.send(Reset(self.slot(), f"t{self.generation}"))
            assert all(self.refused(slot) for slot in stale)  # released with the refusal
            for p, flag in zip(sorted(pending), late):
                if flag:  # a task of the ended launch still running
                    before = (core.version, core.w.tobytes(), core.stats["updates"])
                    slot = self.slot()
                    self.send(pending[p](slot))
                    assert self.refused(slot)
                    assert isinstance(self.answers[slot][0].error, StaleShardCall)
                    assert (core.version, core.w.tobytes(), core.stats["updates"]) == before


def worker_calls(pid, plan, token, grads, rows, span=None):
    """The calls of worker ``pid`` whose epoch ``e`` has ``plan[e]`` steps, each a
    function of the slot its answer goes to."""
    for e, steps in enumerate(plan):
        yield lambda slot, e=e: Pull(slot, pid, e, 0, token)
        if steps == 0:
            yield lambda slot, e=e: Push(slot, pid, e, 0, None, 0.0, True, False, token)
        for s in range(steps):
            last = s == steps - 1
            g, r = grads[(pid, e, s)], rows[(pid, e, s)]
            yield lambda slot, e=e, s=s, g=g, r=r, last=last: Push(
                slot, pid, e, s, g, r, last, not last, token, span=span
            )


def sequential_sync(init, plans, grads, rows):
    """The numpy loop: each step's gradients weighted by rows, summed in worker order;
    ``before[(e, s)]``: the values before step ``(e, s)`` and their version."""
    w, version = init.copy(), 0
    before = {}
    for e in range(len(plans[0])):
        width = max(p[e] for p in plans)
        for s in range(width + 1):
            before[(e, s)] = (w.copy(), version)
            parts = [
                (grads[(p, e, s)], rows[(p, e, s)]) for p in range(len(plans)) if s < plans[p][e]
            ]
            if not parts:
                continue
            total = sum(r for _, r in parts)
            if len(parts) == 1:
                g = parts[0][0]
            else:
                g = np.zeros(D)
                for grad, r in parts:
                    g += grad * (r / total)
            w -= g * LR
            version += 1
    before["end"] = (w.copy(), version)
    return before


def _grads(seed, generation, plans):
    rng = np.random.default_rng([seed, generation])
    grads, rows = {}, {}
    for p, plan in enumerate(plans):
        for e, steps in enumerate(plan):
            for s in range(max(steps, 1)):
                grads[(p, e, s)] = rng.normal(size=D)
                rows[(p, e, s)] = float(rng.integers(1, 6))
    return grads, rows


@st.composite
def sync_schedules(draw):
    n = draw(st.integers(1, 3))
    epochs = draw(st.integers(1, 3))
    plans = [[draw(st.integers(0, 3)) for _ in range(epochs)] for _ in range(n)]
    picks = draw(st.lists(st.integers(0, 1000), min_size=100, max_size=100))
    resets = draw(st.sets(st.integers(1, 40), max_size=2))
    late = draw(st.lists(st.booleans(), min_size=3, max_size=3))
    return plans, picks, resets, late, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(sync_schedules())
def test_any_sync_schedule_gives_the_sequential_apply_bit_for_bit(schedule):
    """Workers with different step counts, pushes in any order, relaunches at any point:
    every pull gets exactly the values before its step, every call is answered once, a
    call of an ended launch changes nothing, and the result is the numpy loop's."""
    plans, picks, resets, late, seed = schedule
    init = np.arange(float(D))
    core = ShardCore(make_spec(len(plans)))
    refs: dict[int, dict] = {}

    def check(event, out, retired):
        before = refs.get(sched.generation)
        if before is None:
            before = refs[sched.generation] = sequential_sync(
                init, plans, *_grads(seed, sched.generation, plans)
            )
        for ins in out:
            if isinstance(ins, Reply) and ins.value is not None:
                call = sched.calls[ins.slot]
                at = (call.epoch, call.step + (1 if isinstance(call, Push) else 0))
                want, version = before[at]
                assert ins.value.version == version
                assert ins.value.inline.tobytes() == want.tobytes()

    sched = Schedule(core, picks, resets, check)
    grads, rows, _ = sched.run(plans, seed, late)
    want, version = sequential_sync(init, plans, grads, rows)["end"]
    assert core.w.tobytes() == want.tobytes() and core.version == version
    assert (core.epoch, core.step) == (len(plans[0]), 0)
    assert sorted(sched.answers) == sorted(sched.calls)  # every call answered, once


@st.composite
def ssp_schedules(draw):
    n = draw(st.integers(2, 3))
    steps = draw(st.integers(1, 3))
    plans = [[steps] * draw(st.integers(1, 3))] * n
    picks = draw(st.lists(st.integers(0, 1000), min_size=100, max_size=100))
    resets = draw(st.sets(st.integers(1, 20), max_size=1))
    late = draw(st.lists(st.booleans(), min_size=3, max_size=3))
    return plans, picks, resets, late, draw(st.integers(0, 2**31)), draw(st.integers(0, 2))


@settings(max_examples=150, deadline=None)
@given(ssp_schedules())
def test_any_ssp_schedule_keeps_the_staleness_bound_and_applies_on_arrival(schedule):
    """Async with ``staleness_steps=k``: a push's reply is given only while its worker
    leads the slowest unretired one by at most k steps (counted here from the pushes
    the core accepted), and the values are the numpy loop over the accepted pushes in
    arrival order."""
    plans, picks, resets, late, seed, k = schedule
    n, span = len(plans), plans[0][0]
    core = ShardCore(make_spec(n, sync=False, staleness=k))
    done: dict[tuple[int, int], int] = {}  # (launch, pid) -> steps done

    def check(event, out, retired):
        g = sched.generation
        if isinstance(event, Push) and not sched.refused(event.slot):
            done[(g, event.pid)] = event.epoch * span + event.step + 1
        for ins in out:
            call = sched.calls[ins.slot]
            if isinstance(ins, Reply) and isinstance(call, Push) and call.pull_next:
                others = [
                    done.get((g, q), 0) for q in range(n) if q != call.pid and q not in retired
                ]
                assert not others or done[(g, call.pid)] - min(others) <= k

    sched = Schedule(core, picks, resets, check)
    grads, _, accepted = sched.run(plans, seed, late)
    w = np.arange(float(D))
    for p, e, s in accepted:
        w -= grads[(p, e, s)] * LR
    assert core.w.tobytes() == w.tobytes() and core.version == len(accepted)
    assert core.stats["max_lead"] <= k
    assert sorted(sched.answers) == sorted(sched.calls)
