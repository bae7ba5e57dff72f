"""Evolving side inputs on real Structured Streaming queries (JSON file sources on temp
dirs), synchronised with ``process_all_available`` / ``await_termination``, never sleeps.

Each test starts one ``SideInputQuery`` (a main query plus one query per streaming view).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from paths import EXAMPLES
from pyspark.sql import functions as F

from spark_ops import (
    ListSideInput,
    MapSideInput,
    MultimapSideInput,
    SideInputConfigError,
    SideInputNotReadyError,
    SideInputValueError,
    SingletonSideInput,
    UserFunctionError,
    with_side_inputs,
)


class Sources:
    """Directories read by file streams; ``put`` adds one JSON-lines file atomically."""

    def __init__(self, spark, root: Path) -> None:
        self.spark = spark
        self.root = root

    def stream(self, name: str, schema: str):
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return self.spark.readStream.schema(schema).json(str(self.root / name))

    def put(self, name: str, rows: list[dict]) -> None:
        tmp = self.root / name / f".{uuid.uuid4().hex}.tmp"  # hidden: the source skips it
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.rename(tmp, self.root / name / f"{uuid.uuid4().hex}.json")


@pytest.fixture
def src(spark, tmp_path):
    return Sources(spark, tmp_path / "sources")


def collect_into(out: list):
    def sink(df, batch_id):
        out.extend(df.collect())

    return sink


def test_main_records_wait_for_first_side_data_then_see_updates(spark, src, tmp_path):
    main = src.stream("main", "user_id long, x double")
    limit = SingletonSideInput(src.stream("limit", "value double"), "value", name="limit")
    seg = MapSideInput(
        src.stream("dims", "user_id long, segment string"),
        key="user_id",
        value="segment",
        keyed=True,
        name="seg",
    )

    def fn(row, ctx):
        return (
            row.user_id,
            ctx.side_input(seg).get(row.user_id),
            ctx.side_input(limit),
            ctx.side_input_version(limit),
            ctx.side_input_version(seg),
        )

    out: list = []
    q = (
        with_side_inputs(main, limit, seg, key="user_id")
        .map(fn, "user_id long, seg string, lim double, v_lim long, v_seg long")
        .start(foreach_batch=collect_into(out), buffer_memory=0, key_groups=4)
    )
    try:
        src.put("main", [{"user_id": i, "x": float(i)} for i in range(6)])
        q.process_all_available()
        # no side data yet: nothing processed, the records wait on disk (budget 0)
        assert out == [] and not q.ready and q.wait_until_ready(timeout=0.01) is False
        buf = q.status()["buffer"]
        assert buf["records"] == 6 and buf["bytes_spilled"] > 0 and buf["bytes_in_memory"] == 0

        src.put("limit", [{"value": 2.0}])
        q.process_all_available()
        assert out == [] and q.versions() == {"limit": 1, "seg": 0}  # one view is not enough

        src.put("dims", [{"user_id": i, "segment": f"s{i}"} for i in range(3)])
        q.process_all_available()
        assert q.wait_until_ready(timeout=60) and q.status()["buffer"]["records"] == 0
        assert sorted(out) == [(i, f"s{i}" if i < 3 else None, 2.0, 1, 1) for i in range(6)]
        assert q.history[0].source == "buffer" and q.history[0].rows == 6
        assert dict(q.history[0].versions) == {"limit": 1, "seg": 1}

        # a new version of each view, then more main records: they see it
        src.put("limit", [{"value": 3.0}])
        src.put("dims", [{"user_id": 4, "segment": "s4"}])
        q.process_all_available()
        assert q.versions() == {"limit": 2, "seg": 2}
        del out[:]
        src.put("main", [{"user_id": 4, "x": 4.0}, {"user_id": 0, "x": 0.0}])
        q.process_all_available()
        assert sorted(out) == [(0, "s0", 3.0, 2, 2), (4, "s4", 3.0, 2, 2)]  # upsert keeps s0
        assert q.history[-1].source == "main" and dict(q.history[-1].versions) == {
            "limit": 2,
            "seg": 2,
        }
    finally:
        q.stop()
    assert not q.is_active and not any(s.name.startswith(q.name) for s in spark.streams.active)


def test_windowed_records_wait_per_window_for_the_matching_side_window(spark, src):
    main = src.stream("main", "user_id long, ts timestamp").withColumn(
        "w", F.window("ts", "1 minute")
    )
    side = src.stream("rates", "ts timestamp, rate double").withColumn(
        "w", F.window("ts", "1 minute")
    )
    rates = ListSideInput(side, "rate", window="w", name="rates")
    out: list = []
    q = (
        with_side_inputs(main, rates, window="w")
        .map(
            lambda r, ctx: (
                r.user_id,
                sorted(ctx.side_input(rates)),
                ctx.side_input_version(rates),
            ),
            "user_id long, rates array<double>, v long",
        )
        .start(foreach_batch=collect_into(out))
    )
    try:
        src.put("rates", [{"ts": "2024-01-01T10:00:05Z", "rate": 0.1}])
        q.process_all_available()
        assert q.ready
        src.put(
            "main",
            [
                {"user_id": 1, "ts": "2024-01-01T10:00:30Z"},  # minute 0: has side data
                {"user_id": 2, "ts": "2024-01-01T10:01:30Z"},  # minute 1: not yet
            ],
        )
        q.process_all_available()
        assert out == [(1, [0.1], 1)]
        st = q.status()
        assert st["buffer"]["namespaces"] == 1 and st["buffer"]["records"] == 1
        src.put("rates", [{"ts": "2024-01-01T10:01:10Z", "rate": 0.2}])
        q.process_all_available()
        assert out == [(1, [0.1], 1), (2, [0.2], 2)]
        last = q.history[-1]
        assert last.source == "buffer" and last.rows == 1
        (start, end) = last.namespaces[0]
        assert end - start == 60_000_000  # the buffer's namespace is the main record's window
    finally:
        q.stop()


def test_static_side_inputs_on_a_streaming_main_are_ready_at_once(spark, src, tmp_path):
    tags = spark.createDataFrame([(1, "a"), (1, "b"), (2, "c")], "user_id long, tag string")
    multi = MultimapSideInput(tags, key="user_id", value="tag", keyed=True)
    blocked = ListSideInput(spark.createDataFrame([(2,)], "user_id long"), "user_id")
    main = src.stream("main", "user_id long")
    path = str(tmp_path / "out")

    def fn(rows, ctx):
        for r in rows:
            if r.user_id not in ctx.side_input(blocked):
                yield (r.user_id, sorted(ctx.side_input(multi).get(r.user_id, ())))

    q = (
        with_side_inputs(main, multi, blocked, key="user_id")
        .map_partition(fn, "user_id long, tags array<string>")
        .start(format="parquet", path=path)
    )
    try:
        assert q.ready and q.versions() == {multi.name: 1, blocked.name: 1}
        src.put("main", [{"user_id": u} for u in (1, 2, 3)])
        q.process_all_available()
        got = {r.user_id: r.tags for r in spark.read.parquet(path).collect()}
        assert got == {1: ["a", "b"], 3: []}
        assert [h.source for h in q.history] == ["main"] and q.status()["buffer"]["spills"] == 0
    finally:
        q.stop()


def test_a_side_input_that_never_becomes_ready_times_out(spark, src):
    main = src.stream("main", "x long")
    limit = SingletonSideInput(src.stream("limit", "value double"), "value", name="limit")
    q = (
        with_side_inputs(main, limit)
        .filter(lambda r, ctx: r.x > ctx.side_input(limit))
        .start(foreach_batch=collect_into([]), ready_timeout=0.5)
    )
    try:
        src.put("main", [{"x": 1}])  # the running main query picks it up and buffers it
        with pytest.raises(SideInputNotReadyError, match=r"\['limit'\] .* not ready after") as info:
            q.await_termination(timeout=120)
        assert info.value.views == ("limit",) and info.value.waited > 0.5
        assert "1 main record(s) are waiting" in str(info.value)
        assert not q.is_active
    finally:
        q.stop()


def test_a_function_that_raises_in_a_micro_batch_fails_the_query_with_a_spark_ops_error(src):
    class OverLimit(ValueError):
        """A user's own exception class (shipped by value: defined in the test)."""

    main = src.stream("main", "user_id long")
    limit = SingletonSideInput(src.stream("limit", "value double"), "value", name="limit")

    def check(row, ctx):
        if row.user_id > ctx.side_input(limit):
            raise OverLimit(f"user {row.user_id} is over the limit")
        return (row.user_id,)

    q = (
        with_side_inputs(main, limit)
        .map(check, "user_id long")
        .start(foreach_batch=collect_into([]))
    )
    try:
        src.put("limit", [{"value": 1.0}])
        q.process_all_available()
        src.put("main", [{"user_id": 5}])
        with pytest.raises(UserFunctionError) as info:
            q.process_all_available()
        err = info.value
        assert err.function.endswith("check") and err.operation == "map"
        assert err.raised(OverLimit) and "user 5 is over the limit" in str(err)
    finally:
        q.stop()


def test_a_singleton_or_map_with_two_values_in_one_micro_batch_fails_the_query(spark, src):
    main = src.stream("main", "user_id long")
    limit = SingletonSideInput(src.stream("limit", "value double"), "value", name="limit")
    q = (
        with_side_inputs(main, limit)
        .filter(lambda r, ctx: True)
        .start(foreach_batch=collect_into([]))
    )
    try:
        src.put("limit", [{"value": 1.0}, {"value": 2.0}])
        with pytest.raises(SideInputValueError, match="'limit' got more than one value"):
            q.process_all_available()
        assert q.versions() == {"limit": 0}  # never half-applied
    finally:
        q.stop()
    dims = MapSideInput(
        src.stream("dims", "user_id long, segment string"), key="user_id", keyed=True, name="dims"
    )
    q = (
        with_side_inputs(main, dims, key="user_id")
        .filter(lambda r, ctx: True)
        .start(foreach_batch=collect_into([]), key_groups=2)
    )
    try:
        src.put("dims", [{"user_id": 7, "segment": "a"}, {"user_id": 7, "segment": "b"}])
        with pytest.raises(SideInputValueError, match="'dims' got key 7 more than once"):
            q.process_all_available()
        assert q.versions() == {"dims": 0}
    finally:
        q.stop()


def test_start_arguments_are_checked_before_any_query(spark, src):
    main = src.stream("main", "x long")
    limit = SingletonSideInput(src.stream("limit", "value double"), "value")
    stream = with_side_inputs(main, limit).filter(lambda r, ctx: True)
    before = len(spark.streams.active)
    bad = [
        (lambda: stream.start(), "one sink"),
        (lambda: stream.start(collect_into([]), format="parquet"), "one sink"),
        (lambda: stream.start("not callable"), "callable"),
        (lambda: stream.start(collect_into([]), ready_timeout=0), "ready_timeout"),
        (lambda: stream.start(collect_into([]), buffer_memory=-1), "buffer_memory"),
        (lambda: stream.start(collect_into([]), key_groups=0), "key_groups"),
        (lambda: stream.start(collect_into([]), trigger_interval=5), "trigger_interval"),
    ]
    for call, words in bad:
        with pytest.raises(SideInputConfigError, match=words):
            call()
    assert len(spark.streams.active) == before


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "example_clickstream_side_inputs", EXAMPLES / "clickstream_side_inputs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its functions pickle by value from here
    spec.loader.exec_module(module)
    return module


def test_clickstream_example_enriches_and_filters_with_evolving_side_inputs(session, tmp_path):
    ex = _load_example()
    summary = ex.main(session, rounds=3, clicks_per_round=60, users=20, work_dir=str(tmp_path))
    assert summary["buffered_before_ready"] == 60  # round 0's clicks waited for the side inputs
    assert summary["mismatches"] == 0  # every row matches the versions it saw
    assert summary["rows"] > 0 and summary["dropped_by_threshold"] > 0
    assert len(set(summary["thresholds_seen"])) == 3  # the learned threshold moved each round
    assert summary["dimension_versions_seen"] == [1, 2, 3]
