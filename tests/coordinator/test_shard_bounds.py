"""A parameter shard's core with bounded tables (admission after N sightings, expiry, a
row cap), stepped one event at a time (no Ray): random sync schedules of two workers
against a loop written here with exact counts, which is the meaning of the bounds; the
same schedule with the workers' calls in any order gives the same table bit for bit;
a checkpoint taken mid-run carries what admission and expiry need. Every core is
validated at the end (``validate_cores``: a table never over its cap)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_iter as hi
from coordinator._bounds import Bounds
from coordinator._shard_core import ShardCore
from coordinator._shard_protocol import Pull, Push, Refuse, Reply, Restore, Save, ShardSpec
from coordinator._tables import Init, TableSpec

pytestmark = pytest.mark.usefixtures("validate_cores")

LR = 0.25
INIT = 0.5


def _spec(bounds: Bounds, n: int = 2) -> ShardSpec:
    table = TableSpec(
        "t", 1, Init("constant", {"value": INIT}), "sgd", {"learning_rate": LR}, bounds
    )
    return ShardSpec(
        shard_id=0,
        lo=0,
        hi=0,
        init=np.zeros(0),
        rule="sgd",
        rule_params={"learning_rate": LR},
        num_workers=n,
        sync=True,
        token="t0",
        tables=(table,),
    )


def _bounds(min_count, ttl, cap):
    # a window no schedule here fills: the sketch's counts are the exact ones
    return Bounds(min_count, ttl, cap, sketch_width=1 << 16, sketch_window=10**9)


@st.composite
def schedules(draw):
    """Two workers' steps: per step, distinct keys from a small pool with counts; the
    workers' weights; the order their calls arrive in, per step; the bounds."""
    steps = draw(st.integers(2, 9))
    plan = [
        [
            draw(st.dictionaries(st.integers(0, 12), st.integers(1, 3), min_size=0, max_size=6))
            for _ in range(steps)
        ]
        for _ in range(2)
    ]
    weights = [draw(st.integers(1, 5)) for _ in range(2)]
    orders = [draw(st.permutations([0, 1])) for _ in range(steps + 1)]
    bounds = _bounds(
        draw(st.integers(1, 4)),
        draw(st.one_of(st.none(), st.integers(1, 4))),
        draw(st.one_of(st.none(), st.integers(1, 6))),
    )
    return plan, weights, orders, bounds


def _target(key: int) -> float:
    return 0.1 * key - 0.3


def _keys(step: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array(list(step), dtype=np.int64),
        np.array(list(step.values()), dtype=np.int64),
    )


def run_core(plan, weights, orders, bounds, *, core=None, start=0, stop_after=None):
    """Drive a core through the schedule's steps ``start ..`` (each worker pulls step
    ``start`` first, as after a restore); returns the core and what each worker read at
    each step (key -> value)."""
    core = core or ShardCore(_spec(bounds))
    steps = len(plan[0])
    read: list[list[dict[int, float]]] = [[{} for _ in range(steps)] for _ in range(2)]
    replies: dict[str, object] = {}

    def take(out):
        for ins in out:
            if isinstance(ins, Reply):
                replies[ins.slot] = ins.value
            assert not isinstance(ins, Refuse), ins

    for pid in orders[start]:
        k, c = _keys(plan[pid][start])
        take(core.handle(Pull(f"pull{pid}", pid, 0, start, "t0", (k,), (c,))))
    last = {pid: f"pull{pid}" for pid in (0, 1)}
    for s in range(start, steps if stop_after is None else stop_after):
        for pid in orders[s + 1]:
            k, _ = _keys(plan[pid][s])
            values = replies.pop(last[pid]).rows[0][:, 0]
            read[pid][s] = dict(zip(k.tolist(), values.tolist()))
            g = (values - np.array([_target(x) for x in k.tolist()]))[:, None]
            final = s == steps - 1
            nk, nc = _keys(plan[pid][s + 1]) if not final else (None, None)
            slot = f"push{pid}-{s}"
            take(
                core.handle(
                    Push(
                        slot,
                        pid,
                        0,
                        s,
                        None,
                        float(weights[pid]),
                        final,
                        not final,
                        "t0",
                        (g,),
                        None if final else (nk,),
                        None,
                        None if final else (nc,),
                    )
                )
            )
            last[pid] = slot
    return core, read


def run_loop(plan, weights, bounds):
    """The bounds' meaning, with exact counts: per step, the keys without a row count
    their sightings; those with ``min_count`` take a row at its initial value; the
    step's weighted gradient (workers in order) is applied to every row it touches;
    then rows untouched for ``ttl`` steps go, and the oldest beyond the cap (ties: the
    smaller key)."""
    values: dict[int, float] = {}
    last: dict[int, int] = {}
    seen: Counter[int] = Counter()
    total = float(sum(weights))
    reads = [[{} for _ in plan[0]] for _ in range(2)]
    for s in range(len(plan[0])):
        grads = []
        for pid in (0, 1):
            step = plan[pid][s]
            reads[pid][s] = {k: values.get(k, INIT) for k in step}
            grads.append({k: reads[pid][s][k] - _target(k) for k in step})
        pending: Counter[int] = Counter()
        for pid in (0, 1):
            for k, c in plan[pid][s].items():
                if k not in values:
                    pending[k] += c
        for k in sorted(pending):
            seen[k] += pending[k]
            if seen[k] >= bounds.min_count:
                values[k], last[k] = INIT, s
        acc: dict[int, float] = {}
        for pid in (0, 1):
            for k, g in grads[pid].items():
                if k in values:
                    acc[k] = acc.get(k, 0.0) + g * (weights[pid] / total)
        for k, g in acc.items():
            values[k] -= LR * g
            last[k] = s
        if bounds.ttl_steps is not None:
            for k in [k for k in values if last[k] <= s - bounds.ttl_steps]:
                del values[k], last[k]
        if bounds.max_rows is not None and len(values) > bounds.max_rows:
            for k in sorted(values, key=lambda k: (last[k], k))[: len(values) - bounds.max_rows]:
                del values[k], last[k]
    return values, reads


def _table(core) -> dict[int, float]:
    keys, vals = core.tables[0].items()
    return dict(zip(keys.tolist(), vals[:, 0].tolist()))


@settings(max_examples=120, deadline=None)
@given(schedules())
def test_a_bounded_table_is_the_loop_over_exact_counts_bit_for_bit(schedule):
    plan, weights, orders, bounds = schedule
    core, read = run_core(plan, weights, orders, bounds)
    values, reads = run_loop(plan, weights, bounds)
    assert read == reads  # every step read the rows as the step before left them
    assert _table(core) == values
    tab = core.tables[0]
    assert not tab.bounded or tab.admitted - tab.expired == len(tab)


@settings(max_examples=60, deadline=None)
@given(schedules(), st.randoms(use_true_random=False))
def test_the_order_the_workers_calls_arrive_in_changes_nothing(schedule, rnd):
    plan, weights, orders, bounds = schedule
    other = [rnd.sample(o, 2) for o in orders]
    a, _ = run_core(plan, weights, orders, bounds)
    b, _ = run_core(plan, weights, other, bounds)
    assert _table(a) == _table(b)
    if not bounds.admits_all:
        assert np.array_equal(a.tables[0].sketch.counters, b.tables[0].sketch.counters)


@settings(max_examples=40, deadline=None)
@given(schedules(), st.data())
def test_a_checkpoint_mid_run_carries_what_admission_and_expiry_need(schedule, data):
    plan, weights, orders, bounds = schedule
    steps = len(plan[0])
    cut = data.draw(st.integers(1, steps - 1))
    whole, _ = run_core(plan, weights, orders, bounds)
    first, _ = run_core(plan, weights, orders, bounds, stop_after=cut)
    out = first.handle(Save("s", "c", "uri", "p"))
    record = out[0].record
    again = ShardCore(_spec(bounds))
    again.handle(Restore("r", record, "c", "t0", "uri/p"))
    t, u = first.tables[0], again.tables[0]
    assert _table(again) == _table(first)
    assert t.last_step[: len(t)].tolist() == u.last_step[: len(u)].tolist()
    assert (t.admitted, t.expired) == (u.admitted, u.expired)
    if t.sketch is not None:
        assert np.array_equal(t.sketch.counters, u.sketch.counters)
    # the restored core decides every later step as the uninterrupted one
    again, _ = run_core(plan, weights, orders, bounds, core=again, start=cut)
    assert _table(again) == _table(whole)
    assert again.version == whole.version


def test_keys_seen_too_rarely_read_as_their_initial_value_and_take_no_row():
    bounds = _bounds(3, None, None)
    plan = [[{7: 1}, {7: 1}, {7: 1}, {7: 1}], [{}, {}, {}, {}]]
    core, read = run_core(plan, [1, 1], [[0, 1]] * 5, bounds)
    # sightings 1 and 2 take no row; the third admits 7 and applies that step's gradient
    assert [r[7] for r in read[0]] == [INIT, INIT, INIT, INIT - LR * (INIT - _target(7)) / 2]
    assert core.tables[0].admitted == 1


def test_a_bounded_pull_without_counts_is_refused_naming_the_table():
    core = ShardCore(_spec(_bounds(2, None, None)))
    out = core.handle(Pull("p", 0, 0, 0, "t0", (np.array([1, 2]),)))
    (refusal,) = out
    assert isinstance(refusal, Refuse) and isinstance(refusal.error, hi.UsageError)
    assert "table 't'" in str(refusal.error) and "2 sightings" in str(refusal.error)
    assert len(core.tables[0]) == 0 and core.version == 0


def test_an_async_shard_admits_expires_and_caps_on_each_arrival():
    spec = dataclasses.replace(_spec(_bounds(2, 2, 3), n=1), sync=False)
    core = ShardCore(spec, one_thread=True)  # a FreeShard's core: every call on arrival
    replies = []

    def push(step, keys, nxt):
        k = np.array(keys, dtype=np.int64)
        g = np.ones((len(k), 1))
        nk = np.array(nxt, dtype=np.int64)
        out = core.handle(
            Push(
                "s",
                0,
                0,
                step,
                None,
                1.0,
                False,
                True,
                "t0",
                (g,),
                (nk,),
                None,
                (np.ones_like(nk),),
            )
        )
        replies.append(dict(zip(nxt, out[-1].value.rows[0][:, 0].tolist())))

    core.handle(Pull("p", 0, 0, 0, "t0", (np.array([1, 2]),), (np.ones(2, np.int64),)))
    push(0, [1, 2], [1, 2, 3])  # first sightings: no row
    assert len(core.tables[0]) == 0 and replies[-1] == {1: INIT, 2: INIT, 3: INIT}
    push(1, [1, 2, 3], [4, 5, 6, 1])  # 1, 2 admitted with this step's gradient
    assert replies[-1][1] == INIT - LR
    push(2, [4, 5, 6, 1], [4, 5, 6])  # 4, 5, 6 seen once; 1 updated; 2 not since step 1
    assert sorted(core.tables[0].items()[0].tolist()) == [1, 2]
    push(3, [4, 5, 6], [7])  # 4, 5, 6 admitted, the cap of 3 removes the oldest: 1 and 2
    assert sorted(core.tables[0].items()[0].tolist()) == [4, 5, 6]
    tab = core.tables[0]
    assert (tab.admitted, tab.expired) == (5, 2)
