"""Unbounded (online) iterations on Spark Structured Streaming file sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from online_ops import SCHEMA, W_TRUE, Grad, Step, reference, write_file

import hybrid_iter as hi

TESTS = Path(__file__).resolve().parent
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


def run_to_end(spark, input_dir, **config):
    with start(spark, input_dir, **config) as it:
        it.await_termination(300)
        assert it.exception() is None, it.exception()
        return it.latest_variables()["w"], it.progress, it.outputs


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


def test_a_driver_killed_between_our_commit_and_sparks_replays_the_batch_once(tmp_path):
    """The driver dies right after the coordinator committed batch 2 and before Spark
    recorded it: on restart Spark runs batch 2 again; its update must not apply twice."""
    data, ckpt = tmp_path / "in", tmp_path / "ckpt"
    data.mkdir()
    batches = [write_file(data, i) for i in range(5)]
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
    resumed = subprocess.run(
        job, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = json.loads(next(x for x in resumed.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert out["batches"] == 5
    expected = reference(batches)
    assert np.frombuffer(bytes.fromhex(out["w_hex"])).tolist() == pytest.approx(
        expected.tolist(), abs=1e-12
    )


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


def test_online_config_arguments():
    with pytest.raises(hi.IterationConfigError, match="trigger"):
        hi.OnlineConfig(trigger="fast")  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match="on_outputs"):
        hi.OnlineConfig(on_outputs=3)  # type: ignore[arg-type]
