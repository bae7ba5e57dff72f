"""Unbounded (online) iterations on Spark Structured Streaming file sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import ray
from online_ops import (
    SCHEMA,
    W_TRUE,
    Grad,
    Step,
    Sums,
    Total,
    reference,
    totals,
    write_bad_file,
    write_file,
    write_parquet_file,
)
from paths import TESTS

import hybrid_iter as hi
from hybrid_iter.testing import FaultInjection

FEATURES = ["x0", "x1", "x2", "y"]


def start(spark, input_dir, body=None, *, numeric=True, **config):
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(str(input_dir))
    data = hi.DataStream(stream, FEATURES) if numeric else stream
    config.setdefault("trigger", {"availableNow": True})
    return hi.iterate_unbounded_streams(
        {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(data),
        body or hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(**config),
    )


def start_parquet(spark, input_dir, body=None, init=None, **config):
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(input_dir))
    config.setdefault("trigger", {"availableNow": True})
    return hi.iterate_unbounded_streams(
        init or {"w": np.zeros(3)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, FEATURES)),
        body or hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(**config),
    )


def run_to_end(spark, input_dir, parquet=False, **config):
    with (start_parquet if parquet else start)(spark, input_dir, **config) as it:
        it.await_termination(300)
        assert it.exception() is None, it.exception()
        variables = it.latest_variables()
        return variables.get("w", variables.get("total")), it.progress, it.outputs


@pytest.mark.spark_lines  # the compatibility set every CI environment runs
def test_sync_online_equals_numpy_per_batch_updates(spark, tmp_path):
    batches = [write_file(tmp_path, i) for i in range(5)]
    w, progress, outputs = run_to_end(spark, tmp_path)
    np.testing.assert_allclose(w, reference(batches), rtol=0, atol=1e-12)
    assert (progress.batches, progress.rows, progress.dead_letters) == (5, 1000, 0)
    assert progress.epoch_watermark == 4 and progress.version == 5
    losses = [r.value for r in outputs if r.tag == "loss"]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_async_online_converges(spark, tmp_path):
    for i in range(6):
        write_file(tmp_path, i, rows=400)
    w, progress, _ = run_to_end(spark, tmp_path, staleness=None, parallelism=2)
    np.testing.assert_allclose(w, W_TRUE, atol=0.05)
    assert progress.batches == 6 and progress.rows == 2400


def test_stopping_and_restarting_the_query_applies_every_batch_once(spark, tmp_path):
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_file(data, i) for i in range(3)]
    w1, p1, _ = run_to_end(spark, data, checkpoint_location=str(ckpt))
    assert p1.batches == 3
    batches += [write_file(data, i) for i in range(3, 6)]
    w2, p2, _ = run_to_end(spark, data, checkpoint_location=str(ckpt))
    assert (p2.batches, p2.last_batch_id, p2.rows) == (6, 5, 1200)  # counters continue
    uninterrupted = reference(batches)
    np.testing.assert_allclose(w2, uninterrupted, rtol=0, atol=1e-12)
    # a restart with nothing new applies nothing twice
    w3, p3, _ = run_to_end(spark, data, checkpoint_location=str(ckpt))
    assert p3.batches == 6 and w3.tobytes() == w2.tobytes()


def test_a_driver_killed_by_the_hook_and_by_sigkill_applies_every_batch_once(spark, tmp_path):
    """Run 1 (a driver process of its own): the driver dies right after the coordinator
    committed batch 2 and before Spark recorded it (the hook); on restart Spark runs batch
    2 again and its update must not apply twice. Run 2 (another driver process): the
    driver gets SIGKILL from outside once batch 4 has committed, wherever it is then. Run
    3 (this test's driver, on the suite's session) finishes: every row applied exactly
    once."""
    import signal

    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_file(data, i) for i in range(9)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    job = [sys.executable, str(TESTS / "online_job.py"), str(data), str(ckpt)]
    killed = subprocess.run(
        [*job, "2"], env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    assert killed.returncode == 17, killed.stderr[-3000:]  # the injected exit
    assert not (ckpt / "commits" / "2").exists()  # Spark never committed batch 2
    proc = subprocess.Popen(
        job,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("COMMITTED ") and int(line.split()[1]) >= 4:
                os.kill(proc.pid, signal.SIGKILL)  # the driver only, from outside
                break
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the dead driver had started
        except ProcessLookupError:
            pass
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(str(data))
    with hi.iterate_unbounded_streams(
        {"total": np.zeros(5)},
        hi.ReplayableDataStreamList.not_replay(stream),
        hi.IterationBody(Sums(), Total()),
        hi.OnlineConfig(checkpoint_location=str(ckpt), trigger={"availableNow": True}),
    ) as it:
        it.await_termination(300)
        assert it.exception() is None, it.exception()
        total = it.latest_variables()["total"]
        assert it.progress.rows == 1800
    # every row once (a kill while Spark plans a batch may merge two files into one batch)
    assert total[0] == 1800
    np.testing.assert_allclose(total, totals(batches), rtol=0, atol=1e-9)


def test_malformed_records_go_to_the_dead_letter_path(spark, tmp_path):
    data, dead = tmp_path / "in", tmp_path / "dead"
    data.mkdir()
    bad = "abc,1,2,3\nNaN,1,2,3\n1,2,3\n4,5,,6\n"  # wrong type, NaN, missing column, null
    batches = [write_file(data, i, extra_lines=bad if i == 1 else "") for i in range(3)]
    w, progress, _ = run_to_end(spark, data, dead_letter_path=str(dead))
    assert progress.dead_letters == 4 and progress.rows == 600
    np.testing.assert_allclose(w, reference(batches), rtol=0, atol=1e-12)  # not poisoned
    import pyarrow.parquet as pq

    dead_rows = pq.read_table(dead / "batch_id=1").to_pylist()
    assert len(dead_rows) == 4
    assert sum(1 for r in dead_rows if r["x0"] is None) == 1  # "abc" did not parse
    assert not list(dead.glob("batch_id=0"))  # clean batches write nothing


def test_outputs_reach_the_sinks(spark, tmp_path):
    data, out_dir = tmp_path / "in", tmp_path / "out"
    data.mkdir()
    for i in range(3):
        write_file(data, i)
    seen = []
    with start(
        spark,
        data,
        output_path=str(out_dir),
        on_outputs=lambda b, recs: seen.append((b, len(recs))),
    ) as it:
        it.await_termination(300)
        stream = it.outputs_stream()
    assert seen == [(0, 1), (1, 1), (2, 1)]
    files = sorted(out_dir.glob("batch-*.json"))
    assert len(files) == 3
    assert json.loads(files[0].read_text())["tag"] == "loss"
    assert stream.isStreaming


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"config": hi.IterationConfig(max_epochs=3)}, "never ends by itself"),
        ({"config": hi.IterationConfig(staleness=2)}, "bounded staleness"),
        (
            {"body": hi.IterationBody(Grad(), Step(), criteria=hi.TerminateOnMaxIter(3))},
            "no termination criteria",
        ),
        ({"bounded": True}, "needs a streaming DataFrame"),
        ({"replay": True}, "cannot be replayed"),
    ],
)
def test_rejected_configurations(spark, tmp_path, kwargs, words):
    stream = spark.readStream.schema(SCHEMA).csv(str(tmp_path))
    if kwargs.get("bounded"):
        stream = spark.range(3)
    streams = (
        hi.ReplayableDataStreamList.replay(stream)
        if kwargs.get("replay")
        else hi.ReplayableDataStreamList.not_replay(stream)
    )
    with pytest.raises(hi.IterationConfigError, match=words):
        hi.iterate_unbounded_streams(
            {"w": np.zeros(3)},
            streams,
            kwargs.get("body", hi.IterationBody(Grad(), Step())),
            kwargs.get("config"),
        )


class Unshippable(Grad):
    """A partition operator holding a lock: it cannot be pickled to the tasks."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_an_unshippable_partition_operator_fails_before_a_coordinator_starts(spark, tmp_path):
    def online_actors():
        return {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("hybrid_iter.online.unshippable.")
        }

    stream = spark.readStream.schema(SCHEMA).csv(str(tmp_path))
    with pytest.raises(hi.IterationConfigError, match="cannot be pickled"):
        hi.iterate_unbounded_streams(
            {"w": np.zeros(3)},
            hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, FEATURES)),
            hi.IterationBody(Unshippable(), Step()),
            hi.OnlineConfig(name="unshippable"),
        )
    assert not online_actors()  # the operator is shipped before a coordinator starts


def test_online_config_arguments():
    with pytest.raises(hi.IterationConfigError, match="trigger"):
        hi.OnlineConfig(trigger="fast")  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match="on_outputs"):
        hi.OnlineConfig(on_outputs=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, bad",
    [
        ("staleness", False),
        ("staleness", 0.0),
        ("parallelism", 0),
        ("progress", "yes"),
        ("progress_tag", ""),
        ("inline_variables_bytes", -1),
        ("name", 3),
        ("hooks", object()),
        ("call_timeout", 0),
    ],
)
@pytest.mark.parametrize("config", [hi.OnlineConfig, hi.IterationConfig])
def test_the_fields_both_configs_share_are_checked_alike(config, field, bad):
    # one check for both: an online config once took progress="yes", an empty
    # progress_tag, negative inline bytes and staleness=False without a word
    with pytest.raises(hi.IterationConfigError, match=rf"{config.__name__}\.{field}"):
        config(**{field: bad})


def test_an_iteration_config_carries_every_shared_field_over():
    hooks = FaultInjection()
    source = hi.IterationConfig(
        staleness=None,
        parallelism=3,
        progress=False,
        progress_tag="metric",
        inline_variables_bytes=7,
        name="n",
        hooks=hooks,
        call_timeout=9.0,
    )
    online = hi.OnlineConfig.from_iteration_config(source)
    assert online.shared_fields() == source.shared_fields()
    assert source.shared_fields()["hooks"] is hooks and source.shared_fields()["name"] == "n"


# -- bad files, corrupt checkpoints, bounded state, stop, SIGKILL ---------------------------


def _hybrid_files(ckpt):
    return sorted(p.name for p in (ckpt / "hybrid_iter").iterdir())


def test_bad_parquet_files_are_dead_lettered_and_the_stream_goes_on(spark, tmp_path):
    """A file that is not Parquet and one whose column has the wrong type go to the
    dead-letter path with their path, reason and batch id; the good files train the same
    model as numpy; a restart does not trip on them again."""
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    good = {0: write_parquet_file(data, 0), 1: write_parquet_file(data, 1, null_rows=3)}
    text = write_bad_file(data, 2, "text")
    typed = write_bad_file(data, 3, "type")
    good[4] = write_parquet_file(data, 4)
    w, progress, _ = run_to_end(spark, data, parquet=True, checkpoint_location=str(ckpt))
    np.testing.assert_allclose(w, reference([good[i] for i in (0, 1, 4)]), rtol=0, atol=1e-12)
    assert (progress.batches, progress.rows) == (5, 600)
    assert (progress.dead_letters, progress.dead_files) == (3, 2)
    bad = ckpt / "dead_letter" / "_bad_files"
    records = {
        b: [json.loads(x) for x in (bad / f"batch_id={b}.json").read_text().splitlines()]
        for b in (2, 3)
    }
    assert records[2][0]["path"].endswith(os.path.basename(text))
    assert records[2][0]["batch_id"] == 2 and "Parquet" in records[2][0]["reason"]
    assert records[3][0]["path"].endswith(os.path.basename(typed))
    assert "'x0' is string" in records[3][0]["reason"]
    import pyarrow.parquet as pq

    assert len(pq.read_table(ckpt / "dead_letter" / "batch_id=1")) == 3  # malformed rows
    # a restart finds nothing new and does not stumble over the bad files
    w2, p2, _ = run_to_end(spark, data, parquet=True, checkpoint_location=str(ckpt))
    assert p2.batches == 5 and w2.tobytes() == w.tobytes()


def _corrupt(path):
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_a_corrupt_newest_checkpoint_is_replayed_from_the_journal(spark, tmp_path):
    """The newest snapshot is corrupted between two runs: the restart restores the one
    before and the batch's journal record, so every batch is applied exactly once and
    the counters (rows, dead letters) are exact."""
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_file(data, i, extra_lines="1,,2,3\n" if i == 2 else "") for i in range(3)]
    run_to_end(spark, data, checkpoint_location=str(ckpt))
    _corrupt(ckpt / "hybrid_iter" / "chk-0000000002.ckpt")
    batches += [write_file(data, i) for i in (3, 4)]
    w, progress, _ = run_to_end(spark, data, checkpoint_location=str(ckpt))
    np.testing.assert_allclose(w, reference(batches), rtol=0, atol=1e-12)
    assert (progress.batches, progress.rows, progress.dead_letters) == (5, 1000, 1)
    assert progress.lost_batches == ()


def test_a_lost_batch_fails_loudly_unless_reset_is_chosen(spark, tmp_path):
    """Snapshot and journal of the newest batch both corrupt: Spark has committed batch
    2, nothing can restore it. The restart stops with an error naming batch 2 and the
    choices; ``on_corrupt_checkpoint="reset"`` continues without it, and says so."""
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_file(data, i) for i in range(3)]
    run_to_end(spark, data, checkpoint_location=str(ckpt))
    _corrupt(ckpt / "hybrid_iter" / "chk-0000000002.ckpt")
    _corrupt(ckpt / "hybrid_iter" / "jrn-000000000002.ckpt")
    batches.append(write_file(data, 3))
    with pytest.raises(hi.OnlineCheckpointError, match=r"micro-batches \[2\]") as err:
        start(spark, data, checkpoint_location=str(ckpt))
    assert err.value.at_risk == (2,)
    assert "on_corrupt_checkpoint='reset'" in str(err.value) and "chk-0000000002" in str(err.value)
    w, progress, _ = run_to_end(
        spark, data, checkpoint_location=str(ckpt), on_corrupt_checkpoint="reset"
    )
    assert progress.lost_batches == (2,)
    assert (progress.batches, progress.last_batch_id, progress.rows) == (3, 3, 600)
    np.testing.assert_allclose(w, reference([batches[i] for i in (0, 1, 3)]), rtol=0, atol=1e-12)


def test_state_stays_bounded_and_stop_drains(spark, tmp_path):
    """A short soak: two runs of a processing-time query stopped while running. Files
    under the checkpoint's hybrid_iter directory stay at 2 * keep_last however many
    batches pass, the coordinator holds no delivered output, stop() leaves a state from
    which every row is applied exactly once (row count and column sums: a stop while
    Spark plans a batch may make it put two files in one later batch), and progress
    reports rates, lag and checkpoint age."""
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_parquet_file(data, i, rows=20) for i in range(16)]
    sums = {
        "body": hi.IterationBody(Sums(), Total()),
        "init": {"total": np.zeros(5)},
        "checkpoint_location": str(ckpt),
    }
    counts = []
    for target in (6, 12):
        it = start_parquet(spark, data, trigger={"processingTime": "10 milliseconds"}, **sums)
        deadline = time.monotonic() + 240
        while it.progress.batches < target and time.monotonic() < deadline:
            assert it.exception() is None, it.exception()
            time.sleep(0.05)  # polling a condition, with a deadline as the safety net
        state = ray.get(it._actor.online_state.remote())
        it.stop()
        assert state.held_outputs == 0
        progress = it.progress  # still answers after stop()
        assert progress.batches >= target
        assert progress.batches_per_s > 0 and progress.rows_per_s > 0
        assert progress.last_checkpoint_age_s is not None
        assert progress.lag_files == 16 - progress.rows // 20  # files not yet trained on
        assert "batches" in progress.status_line() and "lag" in progress.status_line()
        counts.append(len(_hybrid_files(ckpt)))
    assert counts[0] <= 4 and counts[1] <= 4, _hybrid_files(ckpt)
    total, progress, _ = run_to_end(spark, data, parquet=True, **sums)
    assert progress.rows == 320 and total[0] == 320
    np.testing.assert_allclose(total, totals(batches), rtol=0, atol=1e-9)
    assert len(_hybrid_files(ckpt)) <= 4


def test_online_config_rejects_bad_journal_and_state_arguments():
    with pytest.raises(hi.IterationConfigError, match="on_corrupt_checkpoint"):
        hi.OnlineConfig(on_corrupt_checkpoint="ignore")
    with pytest.raises(hi.IterationConfigError, match="parquet_reader"):
        hi.OnlineConfig(parquet_reader="pandas")
    with pytest.raises(hi.IterationConfigError, match="keep_last"):
        hi.OnlineConfig(keep_last=1)
    with pytest.raises(hi.IterationConfigError, match="log_every_seconds"):
        hi.OnlineConfig(log_every_seconds=0)
