"""benchmarks/bench_before_after.py reads a benchmark's JSON the same way whatever the
benchmark: every number under a key naming a median is a figure, by its path, and no
other number is (a run's raw samples, its parameters and the machine are not figures)."""

from __future__ import annotations

import sys

from paths import BENCHMARKS

if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))

from bench_before_after import figure_rows, medians


def test_every_number_under_a_median_key_is_a_figure_named_by_its_path():
    report = {
        "params": {"repeats": 3, "size": 1000},
        "runs_seconds": {"ray": [0.5, 0.6]},
        "median_seconds": {"ray": {"ps_step": 0.012, "empty": 0.004}, "endpoint": 0.02},
        "entry": {"runs_s": [1.0, 2.0], "median": 1.5},
        "machine": {"cpus": 2, "load_1min_at_end": 1.2},
        "flag_median": True,
    }
    assert medians(report) == {
        "median_seconds.ray.ps_step": 0.012,
        "median_seconds.ray.empty": 0.004,
        "median_seconds.endpoint": 0.02,
        "entry.median": 1.5,
    }


def test_a_report_without_medians_has_no_figures():
    assert medians({"runs": [1.0, 2.0], "n": 3}) == {}


def test_a_benchmark_naming_its_medians_otherwise_is_read_with_its_own_word():
    report = {"steady_s_per_epoch": {"sync": 0.04, "mllib": None}, "runs": {"sync": [0.04]}}
    assert medians(report) == {}
    assert medians(report, keys=("median", "s_per_epoch")) == {"steady_s_per_epoch.sync": 0.04}


def test_records_in_a_list_are_named_by_their_whole_number_and_text_fields():
    report = {
        "results": [
            {"size": 1000, "shards": 1, "round_trip_s": 0.005, "samples": [0.004, 0.006]},
            {"size": 1000, "shards": 2, "round_trip_s": 0.007, "ok": True},
        ],
        "runs": [0.5, 0.6],
    }
    assert medians(report, keys=("round_trip_s",)) == {
        "results[size=1000,shards=1].round_trip_s": 0.005,
        "results[size=1000,shards=2].round_trip_s": 0.007,
    }


def test_a_figure_is_compared_only_once_both_sides_measured_it():
    got = {
        "bench_ps.py --sizes 1000": {
            "before": {"rt": [2.0, 4.0, 3.0], "only_before": [1.0]},
            "after": {"rt": [1.5, 1.5]},
        },
        "bench_endpoint.py": {"before": {"step": [1.0]}},  # its after run failed
    }
    (row,) = figure_rows(got)
    assert row["bench"] == "bench_ps.py" and row["figure"] == "rt"
    assert (row["before"], row["after"], row["ratio_after_over_before"]) == (3.0, 1.5, 0.5)
