"""The coordinator actor's shell, driven directly with asyncio (no Ray, no Spark)."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

import hybrid_iter as hi
from coordinator import CoordinatorSpec, Emissions, IterationCoordinator

pytestmark = pytest.mark.usefixtures("validate_cores")


class Sum(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.total = 0.0
        self.seen = []

    def process_feedback(self, value, ctx, out):
        self.total += value
        self.seen.append(ctx.source_partition)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("order", list(self.seen))
        self.seen = []
        out.publish_variables(total=self.total)


def coordinator(n=3, staleness=0, max_epochs=3, op=None, tree=None):
    import cloudpickle

    spec = CoordinatorSpec(
        num_subtasks=n,
        num_streams=1,
        staleness=staleness,
        max_epochs=max_epochs,
        has_criteria=False,
        init_variables={"total": 0.0},
        operators=cloudpickle.dumps((op or Sum(), None, [])),
        tree=tree,
    )
    c = IterationCoordinator(spec, put=None)
    c.begin_attempt(0)
    return c


def test_sync_run_applies_feedback_in_partition_order_and_orders_final_outputs():
    async def main():
        c = coordinator()

        async def subtask(pid, delay):
            k, version = 0, 0
            em = Emissions()
            while True:
                await asyncio.sleep(delay)  # arrival order differs from partition order
                reply = await c.report(pid, k, version, em, [10] if k == 0 else None)
                if reply.variables is not None:
                    version = reply.variables.version
                if reply.terminated:
                    break
                em = Emissions(feedback=[1.0])
                k += 1
            await c.finish(pid, Emissions(outputs=[("bye", pid)]))

        await asyncio.gather(*(subtask(p, d) for p, d in [(0, 0.003), (1, 0.0), (2, 0.001)]))
        return c.result()

    data = asyncio.run(main())
    assert data.terminated_by == "max_epochs" and data.epochs == 3
    assert float(data.variables["total"]) == 9.0
    orders = [r.value for r in data.outputs if r.tag == "order"]
    assert orders == [[0, 1, 2]] * 3
    assert [r.value for r in data.outputs if r.tag == "bye"] == [0, 1, 2]
    assert data.subtask_epochs == {0: 3, 1: 3, 2: 3}
    assert data.rows == [30]


def test_a_protocol_violation_answers_with_an_error_instead_of_hanging():
    async def main():
        c = coordinator(n=2)
        first = asyncio.create_task(c.report(0, 0, 0, Emissions(), [1]))
        await asyncio.sleep(0)
        dup = await asyncio.wait_for(c.report(0, 0, 0, Emissions(), [1]), 5)
        # the pending call is answered too (with the failure), nobody waits forever
        return dup, await asyncio.wait_for(first, 5)

    dup, first = asyncio.run(main())
    assert dup.error is not None and "pending" in dup.error.message
    assert first.error is dup.error or first.error.message == dup.error.message


def test_coordinator_failing_in_open_answers_every_call_with_the_failure():
    class Broken(Sum):
        def open(self, init_variables, ctx):
            raise RuntimeError("cannot open")

    c = coordinator(op=Broken())
    assert c.progress().failed
    reply = asyncio.run(c.report(0, 0, 0, Emissions(), [1]))
    assert reply.error.where == "Broken.open" and "cannot open" in reply.error.message


def test_publishing_nan_fails_naming_how_many_and_where_the_first_is():
    class Diverges(Sum):
        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.publish_variables(total=np.array([1.0, np.nan, np.inf]))

    async def main():
        c = coordinator(n=1, op=Diverges())
        await c.report(0, 0, 0, Emissions(), [1])
        return await c.report(0, 1, 0, Emissions(feedback=[1.0]))

    reply = asyncio.run(main())
    assert reply.error is not None and reply.error.type_name == "NonFiniteVariables"
    assert "publish_variables(total=...) at epoch 0 has 2 NaN/inf value(s) of 3, the first " in (
        reply.error.message
    )
    assert "total[1] = nan" in reply.error.message


def test_failures_pickle_with_their_fields():
    c = coordinator(op=None)
    assert not c.progress().failed
    try:
        raise ValueError("x")
    except ValueError as ex:
        f = hi.RemoteFailure.capture(ex, source=1, epoch=2, where="Op.m")
    g = pickle.loads(pickle.dumps(f))
    assert (g.source, g.epoch, g.where, type(g.cause)) == (1, 2, "Op.m", ValueError)
    err = pickle.loads(pickle.dumps(hi.IterationFailedError("failed", {1: g})))
    assert err.failures[1].where == "Op.m"


class Accumulate(hi.CoordinatorOperator):
    """Applies feedback on arrival, never publishes."""

    def open(self, init_variables, ctx):
        self.total = 0.0

    def process_feedback(self, value, ctx, out):
        self.total += value
        out.output("total", self.total)


def test_async_feedback_after_termination_is_not_applied_but_outputs_are_kept():
    async def main():
        c = coordinator(n=2, staleness=None, max_epochs=None, op=Accumulate())
        await asyncio.gather(
            c.report(0, 0, 0, Emissions(), [1]), c.report(1, 0, 0, Emissions(), [1])
        )
        assert not (await c.report(0, 1, 0, Emissions())).terminated  # async: not held
        assert not (await c.report(0, 2, 0, Emissions(feedback=[5.0]))).terminated
        # subtask 1 finishes epoch 0 with nothing fed back: epoch 1 gets nothing -> stop
        assert (await c.report(1, 1, 0, Emissions())).terminated
        late = await c.report(0, 3, 0, Emissions(feedback=[7.0], outputs=[("late", 3)]))
        assert late.terminated
        return c.result()

    data = asyncio.run(main())
    assert data.terminated_by == "no_variables_published" and data.epochs == 1
    assert [r.value for r in data.outputs if r.tag == "total"] == [5.0]  # 7.0 never applied
    assert [r.value for r in data.outputs if r.tag == "late"] == [3]
    assert data.feedback_counts == {0: 1, 1: 0}


def test_a_direct_report_where_the_tree_has_group_actors_fails_instead_of_hanging():
    """With group actors (feedback_combine and more subtasks than the fan-in) every
    subtask reports to its group, which reports for all of its members: a direct call
    (a task-side cache of another run, say) would leave its group waiting forever. The
    coordinator answers it with an error naming the subtask."""
    import cloudpickle

    from coordinator._tree import CoordinatorTree, TreeSpec

    c = coordinator(n=4)
    # groups not started (also when an earlier test left Ray running) ...
    c._tree = CoordinatorTree(TreeSpec(cloudpickle.dumps("sum"), fan_in=2), 4, start_groups=False)
    assert len(c._tree.bounds) == 2
    c._tree.groups = ["group 0", "group 1"]  # ... so stand in for the two of them
    c.core.tree = c.core.tree_groups = True

    async def main():
        return await asyncio.wait_for(c.report(1, 0, 0, Emissions(), [1]), 5)

    reply = asyncio.run(main())
    assert reply.terminated and reply.error is not None
    assert reply.error.type_name == "ProtocolError" and "subtask 1 reported" in str(reply.error)
