"""Sessions stop what they started and nothing else; data reaches subtasks as planned."""

from __future__ import annotations

import os
import re
import socket
import subprocess

import numpy as np
import pytest
from conftest import SLOTS, requires_raydp
from ops import GradientDescent, LinRegPartition
from session_start_job import children

import hybrid_iter as hi


def small_fit(df, **config):
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(1)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=3, **config),
        hi.IterationBody(LinRegPartition(["x0"]), GradientDescent(lr=0.1, total_rows=40)),
    )


def frame(spark, partitions):
    return spark.range(40, numPartitions=partitions).selectExpr(
        "cast(id as double) / 40 as x0", "cast(id as double) / 20 as y"
    )


def test_attach_and_a_nested_local_session_leave_spark_and_ray_running(session):
    import ray

    with hi.Session.attach(session.spark) as attached:
        assert attached.ray_address == session.ray_address
        assert small_fit(frame(attached.spark, 2)).epochs == 3
    with hi.Session.local(2) as nested:  # Spark and Ray already run: it owns neither
        assert nested.spark.sparkContext is session.spark.sparkContext
    assert ray.is_initialized()
    assert session.spark.range(3).count() == 3
    assert hi.Session.current() is session
    # what runs read: the suite session's own context again (the nested ones were equal
    # to it), so its runs announce themselves to it
    from hybrid_iter._cluster import context

    assert context.current() is session.context


def test_default_parallelism_is_every_task_slot(spark):
    result = small_fit(frame(spark, SLOTS))
    assert result.num_partitions == SLOTS and result.repartitioned is False
    result = small_fit(frame(spark, 1))  # fewer partitions than slots: spread over all
    assert result.num_partitions == SLOTS and result.repartitioned is True
    assert sum(result.rows) == 40


class ReadOnly(hi.PartitionOperator):
    def process_variables(self, variables, ctx, out):
        w = variables["w"]
        out.output(
            "seen", (ctx.partition_id, ctx.variables_version, w.flags.writeable, float(w[0]))
        )

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1.0)


class AddOne(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w += 1.0  # in place: what was published must not change
        out.publish_variables(w=self.w)


def test_large_variables_go_through_the_object_store_once_per_version(spark):
    big = np.zeros(200_000)  # 1.6 MB: above the inline limit
    result = hi.iterate_bounded_streams_until_termination(
        {"w": big},
        hi.ReplayableDataStreamList.not_replay(spark.range(8, numPartitions=2)),
        hi.IterationConfig(max_epochs=4, parallelism=2),
        hi.IterationBody(ReadOnly(), AddOne()),
    )
    seen = result.outputs["seen"]
    # each subtask read versions 0..4, read-only views of the object store
    for pid in (0, 1):
        mine = [s for s in seen if s[0] == pid]
        assert [s[1] for s in mine] == [0, 1, 2, 3, 4]
        assert [s[3] for s in mine] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert not any(s[2] for s in mine)
    # one put per version, shared by both subtasks (not one per subtask)
    assert result.object_store_puts == 5
    assert float(result.variables["w"][0]) == 4.0


def _closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the block ends


@requires_raydp
def test_raydp_reads_hybrid_iter_ray_address_then_ray_address(session, monkeypatch):
    # Before any JVM starts (this process already runs Spark): the address is checked
    # first, and RAY_ADDRESS (what `ray job submit` sets) is honoured.
    ours, rays = _closed_address(), _closed_address()
    monkeypatch.delenv("HYBRID_ITER_RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", rays)
    with pytest.raises(hi.SessionError, match=f"no Ray cluster reachable at {rays}"):
        hi.Session.raydp(connect_timeout=20)
    monkeypatch.setenv("HYBRID_ITER_RAY_ADDRESS", ours)
    with pytest.raises(hi.SessionError, match=f"no Ray cluster reachable at {ours}"):
        hi.Session.raydp(connect_timeout=20)
    assert hi.Session.current() is session


@pytest.mark.parametrize(
    "address, message",
    [
        ("ray://head:10001", "is a Ray Client address.*`ray job submit --address"),
        ("http://head:8265", "dashboard / job-submission URL.*`ray job submit"),
        ("head", "not host:port of a Ray GCS"),
    ],
)
def test_addresses_spark_on_ray_cannot_use_are_refused_with_the_alternative(
    spark, address, message
):
    with pytest.raises(hi.SessionError, match=message):
        hi.Session.raydp(address=address)
    with pytest.raises(hi.SessionError, match=message):
        hi.Session.attach(spark, address)


def test_describe_says_where_the_session_runs(session):
    where = session.describe()
    assert where["kind"] == "local" and where["ray_address"] == session.ray_address
    assert where["ray_nodes"] == 1 and where["ray_head"] == "127.0.0.1"
    assert where["task_slots"] == SLOTS and where["executors"] == 0


def test_coordinator_resources_are_checked_before_anything_runs(session, spark, monkeypatch):
    with pytest.raises(hi.SessionError, match="'CPU' is not a placement resource"):
        hi.Session.raydp(coordinator_resources={"CPU": 1})
    with pytest.raises(hi.SessionError, match=r"coordinator_resources\)\['x'\] must be a number"):
        hi.Session.attach(spark, coordinator_resources={"x": "1"})
    # A resource no node offers: an error at session start, not an actor pending forever.
    with pytest.raises(hi.SessionError, match="no live node of the Ray cluster offers"):
        hi.Session.attach(spark, coordinator_resources={"hybrid_iter_nowhere": 1})
    monkeypatch.setenv("HYBRID_ITER_COORDINATOR_RESOURCES", '{"hybrid_iter_nowhere": 1}')
    with pytest.raises(hi.SessionError, match="HYBRID_ITER_COORDINATOR_RESOURCES"):
        small_fit(frame(spark, 2))
    monkeypatch.setenv("HYBRID_ITER_COORDINATOR_RESOURCES", "head")
    with pytest.raises(hi.SessionError, match="must be a JSON object"):
        small_fit(frame(spark, 2))
    assert hi.Session.current() is session


def test_the_coordinator_goes_where_coordinator_resources_say(spark):
    from hybrid_iter._cluster import placement as _placement

    assert _placement.coordinator_actor_options() == {}  # one node: nowhere else to go
    head = {"node:__internal_head__": 0.001}
    with hi.Session.attach(spark, coordinator_resources=head):
        assert _placement.coordinator_actor_options() == {"resources": head}
        assert small_fit(frame(spark, 2)).epochs == 3  # the launch asks for it, and runs


def test_the_embedded_default_listens_on_loopback_only(session, spark):
    """Session.local: Spark's JVM, Ray's GCS, raylet, workers and agents, and this driver
    accept connections on 127.0.0.1 only (Ray advertises the host's outward address and
    binds every interface unless told otherwise), from ``ss -ltnp``."""
    spark.range(4, numPartitions=2).count()  # Python workers and executors up
    mine = {os.getpid(), *children()}
    proc = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True)
    listening, elsewhere = [], []
    for line in proc.stdout.splitlines():
        local = line.split()[3]
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in mine:
                listening.append((local, name))
                host = local.rsplit(":", 1)[0].strip("[]")
                if not (host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")):
                    elsewhere.append((local, name))
    names = {n for _, n in listening}
    assert {"gcs_server", "raylet", "java"} <= names, listening  # the check sees them
    assert not elsewhere, f"listening beyond loopback: {elsewhere}"
