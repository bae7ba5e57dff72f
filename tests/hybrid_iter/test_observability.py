"""Progress exported through Ray's metrics API, read back from the node's Prometheus
endpoint over HTTP on 127.0.0.1, and the Spark job descriptions of the barrier stage and
of the micro-batches, read from Spark's status store (what the UI and its REST API show).

Ray exports the metrics recorded in a process through the node's metrics agent every
export interval (10 s by default), so each check polls the endpoint until the expected
values appear, within a deadline."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
import uuid

import numpy as np
import pytest
import ray
from online_ops import SCHEMA, Grad, Step, write_file
from ops import GradientDescent, LinRegPartition, make_regression

import hybrid_iter as hi
from hybrid_iter._runtime import metrics
from hybrid_iter.testing import FaultInjection

FEATURES = ["x0", "x1", "x2"]
DEADLINE_S = 180.0


@pytest.fixture(scope="module")
def regression(spark):
    df, X, y = make_regression(spark, rows=400, dims=3, partitions=2)
    return df


def _node() -> dict:
    here = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == "127.0.0.1"]
    assert len(here) == 1, ray.nodes()
    return here[0]


def metrics_port() -> int:
    port = int(_node().get("MetricsExportPort") or -1)
    assert port > 0, (
        "Ray's metrics agent is not running on this node: the export needs ray[default] "
        "(pip install -e '.[test]')"
    )
    return port


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the node's Prometheus endpoint: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def ours(samples, iteration: str) -> dict[str, tuple[dict[str, str], float]]:
    """This run's samples by name (its series are tagged with its iteration name)."""
    return {
        name: (labels, value)
        for name, labels, value in samples
        if name.startswith("ray_hybrid_iter_") and labels.get("iteration") == iteration
    }


def wait_for(iteration: str, **expected: float) -> dict[str, tuple[dict[str, str], float]]:
    """Poll the endpoint until every ``ray_hybrid_iter_<name>`` of ``iteration`` has its
    expected value (an external exporter's state, polled with a deadline)."""
    port = metrics_port()
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = ours(scrape(port), iteration)
        values = {k: got.get(f"ray_hybrid_iter_{k}", (None, None))[1] for k in expected}
        if values == expected:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"after {DEADLINE_S:.0f} s: {values} != {expected}; have {got}")
        time.sleep(0.5)


def job_descriptions(spark) -> list[str]:
    """The descriptions of the jobs Spark's status store holds (the UI's job list)."""
    jobs = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    found = []
    for i in range(jobs.size()):
        description = jobs.apply(i).description()
        if description.isDefined():
            found.append(description.get())
    return found


def listening(port: int) -> list[str]:
    """The local addresses listening on TCP ``port`` (``ss -ltn``)."""
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    hosts = []
    for line in out.splitlines():
        local = line.split()[3]
        host, _, p = local.rpartition(":")
        if p == str(port):
            hosts.append(host.strip("[]"))
    return hosts


def run_bounded(df, name: str, **config):
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(name=name, parallelism=2, **config),
        hi.IterationBody(LinRegPartition(FEATURES), GradientDescent(lr=0.5, total_rows=400)),
    )


def test_a_bounded_run_exports_its_epoch_and_last_loss(spark, regression):
    name = f"obs-{uuid.uuid4().hex[:8]}"
    result = run_bounded(regression, name, max_epochs=7)
    assert result.epochs == 7
    got = wait_for(
        name,
        epoch=result.epochs,
        loss=result.outputs["loss"][-1],
        model_version=result.publishes,
        rows=400,
        attempt=0,
        running=0,
        failed=0,
    )
    labels = got["ray_hybrid_iter_epoch"][0]
    assert labels["mode"] == "sync" and re.fullmatch(r"[0-9a-f]{12}", labels["run"])
    assert got["ray_hybrid_iter_rows_per_second"][1] > 0
    assert got["ray_hybrid_iter_epoch_seconds"][1] > 0
    assert got["ray_hybrid_iter_subtask_epoch_spread"][1] == 0
    # Spark's job list names the run, its mode, the stage and the attempt
    assert f"hybrid_iter {name}[sync]: barrier stage, 2 subtasks, attempt 0" in set(
        job_descriptions(spark)
    )
    # the endpoint and every port of this Ray node listen on loopback only
    node = _node()
    ports = [
        node[k]
        for k in (
            "MetricsExportPort",
            "MetricsAgentPort",
            "NodeManagerPort",
            "ObjectManagerPort",
            "RuntimeEnvAgentPort",
        )
    ]
    for port in ports:
        hosts = listening(port)
        assert hosts and all(h.startswith(("127.", "::ffff:127.")) for h in hosts), (port, hosts)


def test_a_relaunch_is_counted_and_named(spark, regression, tmp_path):
    name = f"obs-relaunch-{uuid.uuid4().hex[:8]}"
    result = run_bounded(
        regression,
        name,
        max_epochs=6,
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=2),
        hooks=FaultInjection(fail_partition=1, at_epoch=3),
    )
    assert len(result.attempts) == 1
    newest = max(epoch for epoch, _, _ in result.checkpoint["checkpoints"])
    wait_for(name, epoch=6, attempt=1, checkpoint_epoch=newest, running=0, failed=0)
    described = set(job_descriptions(spark))
    for attempt in (0, 1):
        assert f"hybrid_iter {name}[sync]: barrier stage, 2 subtasks, attempt {attempt}" in (
            described
        )


class CountRows(hi.PartitionOperator):
    """Feeds back the rows of its round (a fresh operator per round)."""

    def open(self, ctx):
        self.rows = 0

    def process_data(self, stream, batch, ctx, out):
        self.rows += batch.num_rows

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(self.rows)


class SumRows(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.rows = 0

    def process_feedback(self, value, ctx, out):
        self.rows += value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("loss", float(self.rows))
        out.publish_variables(rows=self.rows)


def test_replayed_rounds_are_named_per_round(spark, regression):
    name = f"obs-replay-{uuid.uuid4().hex[:8]}"
    result = hi.iterate_bounded_streams_until_termination(
        {"rows": 0},
        hi.ReplayableDataStreamList.replay(regression),
        hi.IterationConfig(
            name=name,
            parallelism=2,
            max_epochs=3,
            operator_lifecycle=hi.OperatorLifecycle.PER_ROUND,
        ),
        hi.IterationBody(CountRows(), SumRows()),
    )
    assert result.replay.rounds >= 3
    described = set(job_descriptions(spark))
    prefix = f"hybrid_iter {name}[sync]: barrier stage, 2 subtasks, attempt 0, round"
    assert {f"{prefix} {k}" for k in range(result.replay.rounds)} <= described


def test_an_online_run_exports_its_batches_as_they_commit(spark, tmp_path):
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    name = f"obs-online-{uuid.uuid4().hex[:8]}"
    for i in range(2):
        write_file(data, i)
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(str(data))
    it = hi.iterate_unbounded_streams(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, [*FEATURES, "y"])),
        hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(name=name, checkpoint_location=str(ckpt), log_every_seconds=None),
    )
    with it:
        wait_for(name, online_batches_total=2, online_rows_total=400, running=1)
        # one more file with a malformed row (a missing x1), then a clean one
        write_file(data, 2, extra_lines="1.0,,2.0,3.0\n")
        write_file(data, 3)
        got = wait_for(
            name,
            online_batches_total=4,
            online_rows_total=800,
            online_dead_letters_total=1,
            online_batch_id=3,
            online_batch_rows=200,
            model_version=4,
        )
        assert got["ray_hybrid_iter_online_batch_id"][0]["mode"] == "online_sync"
        assert got["ray_hybrid_iter_online_checkpoint_age_seconds"][1] >= 0
        assert got["ray_hybrid_iter_online_batch_seconds_count"][1] == 4
    losses = [r.value for r in it.outputs if r.tag == "loss"]
    assert it.progress.batches == 4
    wait_for(name, running=0, failed=0, loss=losses[-1], online_batches_total=4)
    described = set(job_descriptions(spark))
    for batch in range(4):
        assert f"hybrid_iter online {name}[sync]: micro-batch {batch}" in described


def test_a_failed_run_shows_as_failed(regression):
    name = f"obs-failed-{uuid.uuid4().hex[:8]}"
    with pytest.raises(hi.IterationFailedError, match="injected fault"):
        run_bounded(
            regression, name, max_epochs=6, hooks=FaultInjection(fail_partition=0, at_epoch=2)
        )
    wait_for(name, running=0, failed=1, attempt=0)


class FailAtBatch(Grad):
    """Raises in the micro-batch ``batch``'s data: the query dies there."""

    def __init__(self, batch):
        self.batch = batch

    def process_data(self, stream, batch, ctx, out):
        if ctx.batch_id == self.batch:
            raise ValueError(f"bad record in micro-batch {ctx.batch_id}")
        super().process_data(stream, batch, ctx, out)


def test_an_online_query_that_died_shows_as_failed_before_stop(spark, tmp_path):
    name = f"obs-online-failed-{uuid.uuid4().hex[:8]}"
    for i in range(3):
        write_file(tmp_path, i)
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(str(tmp_path))
    it = hi.iterate_unbounded_streams(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, [*FEATURES, "y"])),
        hi.IterationBody(FailAtBatch(1), Step()),
        hi.OnlineConfig(name=name, log_every_seconds=None),
    )
    try:
        with pytest.raises(hi.IterationFailedError, match="micro-batch 1"):
            it.await_termination(300)
        # nobody has called stop(): the handle's poll sees the query dead
        wait_for(name, running=0, failed=1, online_batches_total=1)
    finally:
        it.stop()


def test_switched_off_no_series_is_held(spark, regression, monkeypatch):
    monkeypatch.setenv(metrics.ENV, "0")
    name = f"obs-off-{uuid.uuid4().hex[:8]}"
    result = run_bounded(regression, name, max_epochs=2)
    assert result.epochs == 2
    held = [key for key in metrics._EXPORTER._series if name in key]
    assert held == []
    # the job description does not depend on the metrics
    assert f"hybrid_iter {name}[sync]: barrier stage, 2 subtasks, attempt 0" in set(
        job_descriptions(spark)
    )


@pytest.mark.parametrize(("env", "value"), [(metrics.ENV, "maybe"), (metrics.LINGER_ENV, "-1")])
def test_a_bad_setting_is_refused_before_the_run_starts(spark, regression, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    name = f"obs-bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(hi.IterationConfigError, match=env):
        run_bounded(regression, name, max_epochs=2)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if name in str(a)]
    assert not [d for d in job_descriptions(spark) if name in d]


def test_descriptions():
    assert (
        metrics.bounded_description("lr", "sync", 4, 0)
        == "hybrid_iter lr[sync]: barrier stage, 4 subtasks, attempt 0"
    )
    assert metrics.bounded_description("lr", "ssp", 2, 1, 5).endswith("attempt 1, round 5")
    assert (
        metrics.online_description("clicks", "async", 17)
        == "hybrid_iter online clicks[async]: micro-batch 17"
    )
