"""Tree aggregation of feedback (``IterationBody(feedback_combine=...)``):
combined sync runs equal flat runs up to float rounding and repeat bit for bit, through
the coordinator straight and through group aggregator actors, on real Spark + Ray; bad
combiners and async iterations are refused before any job; the pure merge logic."""

from __future__ import annotations

import numpy as np
import pytest
from paths import BENCHMARKS

import hybrid_iter as hi
from coordinator._protocol import Emissions, Reply
from coordinator._tree import SumCombiner, fold, group_bounds, precombine
from hybrid_iter._runtime.controller import FailurePolicy, Verdict
from hybrid_iter.testing import FaultInjection

PARTS = 4
DIM = 64


class Noisy(hi.PartitionOperator):
    """Feeds back two float vectors per epoch (so the task merges its own values too)
    whose sum depends on the order of the additions (values of very different scales)."""

    def open(self, ctx):
        self.rows = []

    def process_data(self, stream, batch, ctx, out):
        self.rows.extend(batch.column("x").to_pylist())

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        rng = np.random.default_rng([ctx.partition_id, epoch])
        scale = 10.0 ** rng.integers(-8, 9, DIM)
        for _ in range(2):
            out.feedback((rng.standard_normal(DIM) * scale, float(sum(self.rows)), 1))
        out.output("seen", ctx.partition_id)


class Summer(hi.CoordinatorOperator):
    """Adds the feedback up; per epoch outputs the total and how many calls it took;
    continues while ``epoch < last``."""

    def __init__(self, last: int = 2) -> None:
        self.last = last

    def open(self, init_variables, ctx):
        self.acc, self.calls = None, 0

    def process_feedback(self, value, ctx, out):
        self.calls += 1
        if self.acc is None:
            self.acc = [np.array(value[0]), value[1], value[2]]
        else:
            self.acc = [self.acc[0] + value[0], self.acc[1] + value[1], self.acc[2] + value[2]]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("total", self.acc)
        out.output("calls", self.calls)
        self.acc, self.calls = None, 0
        if epoch < self.last:
            out.criteria()
            # the feedback edge is publish_variables (docs/semantics.md): keep it alive
            out.publish_variables(w=np.zeros(1))


@pytest.fixture(scope="module")
def data(spark):
    df = spark.range(0, 400, numPartitions=PARTS).selectExpr("CAST(id AS DOUBLE) AS x").cache()
    df.count()
    yield df
    df.unpersist()


def _run(df, last=2, config_kw=None, **body_kw):
    body = hi.IterationBody(partition=Noisy(), coordinator=Summer(last), criteria=True, **body_kw)
    config = hi.IterationConfig(
        staleness=0, max_epochs=10, parallelism=PARTS, progress=False, **(config_kw or {})
    )
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(df), config, body
    )


def test_combined_runs_equal_flat_and_repeat_bit_for_bit(data):
    flat = _run(data)
    direct = _run(data, feedback_combine="sum")  # 4 subtasks <= fan-in: no groups
    grouped = _run(data, feedback_combine="sum", feedback_fan_in=2)  # 2 group actors
    again = _run(data, feedback_combine="sum", feedback_fan_in=2)
    assert flat.epochs == direct.epochs == grouped.epochs == 3
    # flat: one process_feedback per record; combined: one per epoch, whatever the tree
    assert flat.outputs["calls"] == [2 * PARTS] * 3
    assert direct.outputs["calls"] == grouped.outputs["calls"] == [1] * 3
    # the per-partition record counts are the records emitted, not the merged values
    assert (
        dict(direct.feedback_counts)
        == dict(grouped.feedback_counts)
        == dict(flat.feedback_counts)
        == {p: 6 for p in range(PARTS)}
    )
    assert sorted(grouped.outputs["seen"]) == sorted(flat.outputs["seen"])
    for f, d, g, a in zip(
        flat.outputs["total"],
        direct.outputs["total"],
        grouped.outputs["total"],
        again.outputs["total"],
    ):
        np.testing.assert_allclose(d[0], f[0], rtol=1e-12, atol=1e-6)
        np.testing.assert_allclose(g[0], f[0], rtol=1e-12, atol=1e-6)
        assert d[1:] == f[1:] == g[1:] and g[2] == 2 * PARTS
        assert np.array_equal(g[0], a[0])  # bit for bit, run to run
    # the tree really changed the merge order somewhere (else the test proves nothing)
    assert any(
        not np.array_equal(f[0], g[0])
        for f, g in zip(flat.outputs["total"], grouped.outputs["total"])
    )


@pytest.mark.parametrize("transport", ["ray", "endpoint"])
def test_a_killed_coordinator_restores_a_tree_run_to_the_same_bits(data, tmp_path, transport):
    """SIGKILL-like exit of the coordinator process (its group actors die with it) at
    alignment 3: Ray restarts it, it reloads the checkpoint of alignment 2, the relaunched
    tasks find their new groups (over the endpoint: the new groups' new endpoints), and
    the result is the fault-free Ray run's, bit for bit."""
    tree = {"feedback_combine": "sum", "feedback_fan_in": 2}
    clean = _run(data, last=4, **tree)
    killed = _run(
        data,
        last=4,
        config_kw={
            "checkpoint": hi.CheckpointConfig(str(tmp_path), every_epochs=2),
            "hooks": FaultInjection(kill_coordinator_at=3),
            "transport": transport,
        },
        **tree,
    )
    assert killed.attempts, "the fault did not happen"
    assert clean.epochs == killed.epochs == 5
    for a, b in zip(clean.outputs["total"], killed.outputs["total"], strict=True):
        assert np.array_equal(a[0], b[0]) and a[1:] == b[1:]
    assert killed.outputs["calls"] == [1] * 5


class NoMerge:
    def combine(self, a, b):
        return a + b


@pytest.mark.parametrize(
    "combine, message",
    [
        (NoMerge(), "NoMerge has no merge method"),
        ("mean", "feedback_combine='mean' is not supported"),
        (3, "int has no merge method"),
    ],
)
def test_a_non_combinable_feedback_is_refused_at_once(combine, message):
    with pytest.raises(hi.IterationConfigError, match=message):
        hi.IterationBody(partition=Noisy(), coordinator=Summer(), feedback_combine=combine)


def test_async_with_feedback_combine_is_refused_before_any_job(spark, data):
    body = hi.IterationBody(partition=Noisy(), coordinator=Summer(), feedback_combine="sum")
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup(None))
    for staleness in (None, 1):
        config = hi.IterationConfig(staleness=staleness, max_epochs=3, parallelism=PARTS)
        with pytest.raises(hi.IterationConfigError, match="needs a sync iteration"):
            hi.iterate_bounded_streams_until_termination(
                {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(data), config, body
            )
    assert set(tracker.getJobIdsForGroup(None)) == before
    with pytest.raises(hi.IterationConfigError, match="feedback_fan_in"):
        hi.IterationBody(partition=Noisy(), feedback_combine="sum", feedback_fan_in=0)


def test_a_feedback_sum_cannot_add_fails_the_run_naming_the_fix(data):
    class Words(Noisy):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.feedback("a word")

    body = hi.IterationBody(partition=Words(), coordinator=Summer(), feedback_combine="sum")
    config = hi.IterationConfig(staleness=0, max_epochs=2, parallelism=2, progress=False)
    with pytest.raises(hi.IterationFailedError, match="sums numbers, numpy arrays"):
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(data), config, body
        )


@pytest.mark.timeout(300)
def test_arrays_a_group_cannot_sum_fail_the_run_instead_of_hanging(data):
    """Partitions 0..2 feed back 3 values, partition 3 feeds back 4: each alone is a
    valid sum, the first merge that meets both (in partition 3's group) cannot add them.
    The run fails naming the shapes; before, the group's merge raised in its own task and
    every subtask waited for a reply forever."""

    class Ragged(Noisy):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.feedback(np.ones(4 if ctx.partition_id == 3 else 3))

    body = hi.IterationBody(
        partition=Ragged(),
        coordinator=Summer(),
        feedback_combine="sum",
        feedback_fan_in=2,
        criteria=True,
    )
    config = hi.IterationConfig(staleness=0, max_epochs=3, parallelism=PARTS, progress=False)
    with pytest.raises(hi.IterationFailedError, match=r"shapes \(3,\) and \(4,\)") as info:
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(data), config, body
        )
    assert "combining feedback" in str(info.value) and "FeedbackShapeMismatch" in str(info.value)
    # a relaunch would meet the same shapes
    assert FailurePolicy.classify(info.value) is Verdict.FATAL


@pytest.mark.timeout(300)
def test_a_merge_that_raises_in_the_root_fails_the_run(data):
    """A user combiner whose merge raises only when it meets two groups' values (in the
    root aggregator): the run fails with the user's error, nobody hangs."""

    class Picky:
        def merge(self, a, b):
            if a >= 2 and b >= 2:  # two groups' partial sums (each member feeds back 1)
                raise ArithmeticError("Picky cannot merge two partial sums")
            return a + b

    class One(Noisy):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.feedback(1)

    class Count(Summer):
        def process_feedback(self, value, ctx, out):
            self.acc = value

    body = hi.IterationBody(
        partition=One(),
        coordinator=Count(),
        feedback_combine=Picky(),
        feedback_fan_in=2,
        criteria=True,
    )
    config = hi.IterationConfig(staleness=0, max_epochs=3, parallelism=PARTS, progress=False)
    with pytest.raises(
        hi.IterationFailedError, match="Picky cannot merge two partial sums"
    ) as info:
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(data), config, body
        )
    # raised in the root (without it the coordinator would meet the same merge)
    assert "the feedback tree's root" in str(info.value)
    assert "combining feedback" in str(info.value)


# -- the pure parts ---


class _Remote:
    """``handle.method.remote(...)`` of a stand-in actor: a coroutine to await."""

    def __init__(self, fn):
        self.remote = fn


class _StubCoordinator:
    """Records the root's calls; answers each member with ``aligned`` = its pid (so a
    reply handed to the wrong member shows)."""

    def __init__(self):
        self.calls, self.failures = [], []

        async def report_group(first, epoch, members, combined, attempt=0):
            self.calls.append((first, epoch, [m[0] for m in members], combined))
            return [Reply(epoch, False, m[0]) for m in members]

        async def fail(failure, attempt=0):
            self.failures.append(failure)

        self.report_group, self.fail = _Remote(report_group), _Remote(fail)


def _root_run(combiner, arrival, partials):
    import asyncio

    import cloudpickle

    from coordinator._tree import RootAggregator, TreeSpec

    bounds = [(0, 3), (3, 6), (6, 8)]
    stub = _StubCoordinator()

    async def main():
        root = RootAggregator(stub, bounds, TreeSpec(cloudpickle.dumps(combiner), 2))
        calls = {}
        for lo in arrival:  # groups call in this order
            hi_ = dict(bounds)[lo]
            members = [(p, 0, Emissions(combined_count=1), None) for p in range(lo, hi_)]
            combined = Emissions(feedback=[partials[lo]], combined_count=0)
            calls[lo] = asyncio.ensure_future(root.report_group(lo, 1, members, combined, 0))
            await asyncio.sleep(0)  # let it register before the next group calls
        return {lo: await asyncio.wait_for(c, 10) for lo, c in calls.items()}

    return stub, asyncio.run(main())


def test_the_root_merges_groups_in_partition_order_and_routes_each_reply():
    """Groups call in the order 6, 0, 3; the root folds their partials by first
    partition (1e16 + -1e16 + 1.0 = 1.0; in arrival order it would be 0.0), makes one
    call with the members in partition order and hands each group its own replies."""
    partials = {0: 1e16, 3: -1e16, 6: 1.0}
    stub, replies = _root_run("sum", [6, 0, 3], partials)
    ((first, epoch, pids, combined),) = stub.calls
    assert (first, epoch, pids) == (0, 1, list(range(8)))
    assert combined.feedback == [1.0] and combined.combined_count == 0
    assert combined.feedback[0] == fold([partials[k] for k in sorted(partials)], SumCombiner())
    for lo, hi_ in [(0, 3), (3, 6), (6, 8)]:
        assert [r.aligned for r in replies[lo]] == list(range(lo, hi_))


def test_a_merge_failing_in_the_root_answers_every_group_and_tells_the_coordinator():
    class Broken:
        def merge(self, a, b):
            raise ArithmeticError("cannot merge")

    stub, replies = _root_run(Broken(), [3, 6, 0], {0: 1.0, 3: 2.0, 6: 3.0})
    assert stub.calls == []  # nothing forwarded
    (failure,) = stub.failures
    assert "cannot merge" in str(failure) and "the feedback tree's root" in str(failure)
    for lo, n in [(0, 3), (3, 3), (6, 2)]:
        assert len(replies[lo]) == n
        assert all(r.terminated and r.error is failure for r in replies[lo])


def test_a_group_call_resolves_once_every_member_has_its_reply_in_member_order():
    import asyncio

    from coordinator._tree import _GroupCall, _Member

    async def main():
        call = _GroupCall(3, asyncio.get_running_loop().create_future())
        members = [_Member(call, i) for i in range(3)]
        a, b, c = (Reply(1, False, k) for k in range(3))
        members[2].set_result(c)
        members[0].set_result(a)
        assert not call.future.done() and members[0].done() and not members[1].done()
        members[1].set_result(b)
        assert call.future.done()
        with pytest.raises(asyncio.InvalidStateError):
            members[1].set_result(b)
        return await call.future

    assert [r.aligned for r in asyncio.run(main())] == [0, 1, 2]


# -- the merge logic ---------------------------------------------------------------------


def test_sum_merges_structures_in_a_fixed_left_to_right_order():
    s = SumCombiner()
    vals = [(np.array([1e16, 1.0]), 1, {"a": 2.0}), (np.array([1.0, 1.0]), 2, {"a": 3.0})]
    vals.append((np.array([-1e16, 0.0]), 3, {"a": 4.0}))
    total = fold(vals, s)
    assert total[1] == 6 and total[2] == {"a": 9.0}
    assert total[0].tolist() == [((1e16 + 1.0) + -1e16), 2.0]  # the left fold's rounding
    assert vals[0][0].tolist() == [1e16, 1.0]  # inputs are never written to
    with pytest.raises(ValueError, match="same structure"):
        s.merge((1, 2), (1,))
    with pytest.raises(ValueError, match="same keys"):
        s.merge({"a": 1}, {"b": 1})
    with pytest.raises(ValueError, match="shapes"):
        s.merge(np.zeros(2), np.zeros(3))


def test_groups_bound_the_fan_in_and_precombine_keeps_the_record_count():
    assert group_bounds(32, 32) == []
    for n in (33, 100, 1024, 5000):
        b = group_bounds(n, 32)
        assert len(b) <= 32 and b[0][0] == 0 and b[-1][1] == n
        assert all(lo < hi for lo, hi in b) and all(
            b[i][1] == b[i + 1][0] for i in range(len(b) - 1)
        )
    assert max(hi - lo for lo, hi in group_bounds(1024, 32)) == 32
    em = precombine(Emissions(feedback=[1.0, 2.0, 3.0], outputs=[("t", 1)]), SumCombiner())
    assert em.feedback == [6.0] and em.feedback_count == 3 and em.outputs == [("t", 1)]


# -- the scale harness, reduced ----------------------------------------------------------------


def _bench_scale():
    import importlib.util
    import sys

    path = BENCHMARKS / "bench_scale.py"
    mod = sys.modules.get("bench_scale")
    if mod is None:
        spec = importlib.util.spec_from_file_location("bench_scale", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_scale"] = mod
        spec.loader.exec_module(mod)
    return mod


def test_the_scale_harness_at_64_subtasks_flat_and_tree(session):
    """64 simulated subtasks through the real coordinator and task-side code: flat, every
    call and value reaches the coordinator; tree (fan-in 32), 2 groups whose calls the
    root aggregator merges into one call and one value per epoch, and the sum is right
    (checked inside ``run_config``)."""
    bench = _bench_scale()
    flat = bench.run_config(64, 1000, tree=False, epochs=2, idle_window=0.1)
    tree = bench.run_config(64, 1000, tree=True, epochs=2, idle_window=0.1)
    assert flat["coordinator_calls_per_epoch"] == 64 and tree["groups"] == 2
    assert tree["coordinator_calls_per_epoch"] == 1
    assert tree["root_cpu_s_per_epoch"] is not None  # the root ran, and was measured
    assert flat["process_feedback_calls_per_epoch"] == 64
    assert tree["process_feedback_calls_per_epoch"] == 1
    assert tree["coordinator_bytes_in_per_epoch"] < flat["coordinator_bytes_in_per_epoch"] / 10
    assert bench.fit_growth([2, 4, 8], [1.0, 2.0, 4.0]) == pytest.approx(1.0)


def _sigkill_process_named(marker: bytes) -> int | None:
    """SIGKILL the one process whose command line holds ``marker`` (from outside: not
    through Ray); its pid, or None."""
    import os
    import signal

    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker in cmd:
            os.kill(int(pid), signal.SIGKILL)
            return int(pid)
    return None


@pytest.mark.timeout(300)
def test_a_root_aggregator_killed_from_outside_fails_the_run_naming_it(data, tmp_path):
    """SIGKILL the root aggregator's process in the middle of a run (no checkpoints, so
    nothing to restart from): the run fails with an error that says an actor died; no
    hang, no result that lacks some partitions' feedback."""
    flag = tmp_path / "killed"

    class KillRoot(Noisy):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            if epoch == 1 and ctx.partition_id == 0 and not flag.exists():
                flag.write_text(str(_sigkill_process_named(b"RootAggregator")))
            out.feedback(np.ones(3))

    body = hi.IterationBody(
        partition=KillRoot(),
        coordinator=Summer(3),
        feedback_combine="sum",
        feedback_fan_in=2,
        criteria=True,
    )
    config = hi.IterationConfig(staleness=0, max_epochs=10, parallelism=PARTS, progress=False)
    with pytest.raises(hi.IterationFailedError) as info:
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(data), config, body
        )
    assert flag.read_text() != "None"  # the root was found and killed
    assert "ActorDiedError" in str(info.value)


def test_aggregator_actors_are_placed_where_their_coordinator_was(session):
    """The coordinator tier's placement rule (the head node, or the configured resources:
    ``hybrid_iter/_cluster/placement.py``) reaches the aggregators: the coordinator hands
    its placement (``CoordinatorSpec.placement``) to its tree, whose aggregators ask for
    the same resources, so they go where it went."""
    import ray

    where = {"node:127.0.0.1": 0.001}

    class TreeHost:  # stands in for a coordinator actor (defined here: shipped by value)
        def start(self):
            import cloudpickle

            from coordinator._tree import CoordinatorTree, TreeSpec

            spec = TreeSpec(cloudpickle.dumps("sum"), fan_in=2)
            self.tree = CoordinatorTree(spec, 4, placement=where)
            return [self.tree.root, *self.tree.groups]

    host = ray.remote(num_cpus=0, resources=where)(TreeHost).remote()
    try:
        actors = ray.get(host.start.remote(), timeout=120)
        assert len(actors) == 1 + 2  # the root and two groups of two
        held = ray.get(
            [
                a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_assigned_resources())
                for a in actors
            ],
            timeout=120,
        )
    finally:
        ray.kill(host, no_restart=True)  # its aggregators die with it (it owns them)
    for resources in held:
        assert resources.get("node:127.0.0.1") == pytest.approx(0.001), resources
        assert not resources.get("CPU"), resources
