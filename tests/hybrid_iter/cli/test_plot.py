"""Plots and progress: IterationResult.plot (sync and async on the same axes), the CLI's
--plot and bench commands, and the live progress line's rows/s and stragglers."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT, TESTS

from coordinator import Progress
from hybrid_iter import cli, ml, ps
from hybrid_iter._result import _series
from hybrid_iter._runtime.progress import ProgressPrinter

PNG = b"\x89PNG\r\n\x1a\n"


def _frame(spark, n=400):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((n, 2))
    y = X @ np.array([1.0, -1.0]) + 0.2
    rows = [(float(a), float(b), float(t)) for (a, b), t in zip(X, y)]
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), ["a", "b", "y"])


def train_two(session, rows: int = 400):
    """A CLI entry function: the same regression sync and async, by label."""
    df = _frame(session.spark, rows).cache()
    kw = {
        "features_col": ["a", "b"],
        "label_col": "y",
        "max_iter": 15,
        "learning_rate": 0.3,
        "solver": "sgd",
    }
    return {
        "sync": ml.LinearRegression(**kw).fit(df),
        "async": ml.LinearRegression(mode="async", **kw).fit(df),
    }


def train_two_then_block_the_plot(session, rows: int = 400, blocked: str = ""):
    """A CLI entry function: ``train_two``, then a file where the plot's folder was
    (checked when the run started, gone when the plot is written)."""
    runs = train_two(session, rows)
    folder = Path(blocked).parent
    folder.rmdir()
    folder.write_text("not a folder")
    return runs


@pytest.fixture(scope="module")
def runs(session):
    return train_two(session)


def _is_png(path: Path) -> bool:
    data = Path(path).read_bytes()
    return data.startswith(PNG) and len(data) > 10_000


def test_plot_draws_sync_and_async_per_epoch_and_per_second(runs, tmp_path):
    sync, asynch = runs["sync"].result, runs["async"].result
    path = sync.plot(tmp_path / "sub" / "loss.png", compare={"async": asynch})
    assert path == tmp_path / "sub" / "loss.png" and _is_png(path)
    # the series drawn: one point per epoch; per second from the loss trace
    epochs, per_epoch, seconds, values = _series(sync, "loss")
    assert epochs == list(range(15)) and per_epoch == sync.outputs["loss"]
    assert len(seconds) == 15 and seconds == sorted(seconds) and seconds[0] >= 0
    _, _, a_seconds, a_values = _series(asynch, "loss")
    assert len(a_values) == sum(asynch.feedback_counts.values())  # every async update
    assert _is_png(asynch.plot(tmp_path / "b.png", compare=[sync]))


def test_plot_of_kmeans_cost_and_of_a_ps_run(spark, tmp_path):
    df = _frame(spark)
    km = ml.KMeans(features_col=["a", "b"], k=3, max_iter=5, seed=2).fit(df)
    assert _is_png(km.result.plot(tmp_path / "km.png"))  # tag "cost" found by itself
    assert _series(km.result, "cost")[1] == km.result.outputs["cost"]

    def grad(w, batch):
        X = np.c_[batch["a"], batch["b"]]
        r = X @ w - batch["y"]
        return float(r @ r) / 2 / len(r), X.T @ r / len(r)

    kw = {"optimizer": ps.SGD(0.2), "epochs": 3, "columns": ["a", "b", "y"], "parallelism": 2}
    one = ps.train(df, grad, np.zeros(2), **kw)
    two = ps.train(df, grad, np.zeros(2), mode="async", batch_size=50, **kw)
    assert _is_png(one.plot(tmp_path / "ps.png", compare=two))


def test_plot_without_matplotlib_says_what_to_install(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"hybrid-iter\[plot\]"):
        runs["sync"].result.plot(tmp_path / "x.png")


def test_cli_run_plot_writes_the_returned_runs(session, capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "cli.png"
    argv = ["run", "test_plot:train_two", "--param", "rows=300", "--plot", str(path)]
    assert cli.main(argv, {}) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(cli.RESULT_PREFIX))
    assert json.loads(line[len(cli.RESULT_PREFIX) :])["plot"] == str(path)
    assert _is_png(path)
    assert cli.main(["run", "test_plot:train_two", "--plot", "/no/such/dir/x.png"], {}) == 2
    assert "does not exist" in capsys.readouterr().err


def _result_line(out: str) -> dict:
    (line,) = [x for x in out.splitlines() if x.startswith(cli.RESULT_PREFIX)]
    return json.loads(line[len(cli.RESULT_PREFIX) :])


def test_cli_prints_the_result_when_there_is_nothing_to_plot_and_exits_3(
    session, capsys, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(TESTS))
    path = tmp_path / "no.png"
    assert cli.main(["run", "cli_targets:echo", "--plot", str(path)], {}) == 3
    out, err = capsys.readouterr()
    got = _result_line(out)  # the function's dict is not lost
    assert got["result"]["count"] == 5 and got["result"]["scalar"] == 0.5
    assert "returned no IterationResult" in got["plot_error"] and "plot" not in got
    assert err.rstrip().splitlines()[-1] == f"hybrid-iter: --plot: {got['plot_error']}"
    assert not path.exists()


def test_cli_prints_the_result_when_the_plot_cannot_be_written_and_exits_3(
    session, capsys, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(TESTS))
    output = tmp_path / "result.json"
    path = tmp_path / "plots" / "loss.png"
    path.parent.mkdir()
    argv = [
        "run",
        "test_plot:train_two_then_block_the_plot",
        "--param",
        "rows=300",
        "--param",
        f"blocked={path}",
        "--plot",
        str(path),
        "--output",
        str(output),
    ]
    assert cli.main(argv, {}) == 3
    out, err = capsys.readouterr()
    got = _result_line(out)
    assert set(got["result"]) == {"sync", "async"}
    assert f"could not write {path}" in got["plot_error"] and "Error" in got["plot_error"]
    assert json.loads(output.read_text()) == got  # --output is written too
    assert err.rstrip().splitlines()[-1] == f"hybrid-iter: --plot: {got['plot_error']}"


@pytest.mark.parametrize(
    "plot, message",
    [
        ("/proc/x.png", "cannot write in directory '/proc'"),
        ("/no/such/dir/x.png", "directory '/no/such/dir' does not exist"),
        ("{tmp}/loss.svg", "must name a .png file"),
        ("{tmp}/folder.png", "is a directory"),
    ],
)
def test_a_plot_path_that_cannot_be_written_exits_2_before_anything_runs(
    plot, message, tmp_path, capsys, monkeypatch
):
    (tmp_path / "folder.png").mkdir()
    plot = plot.format(tmp=tmp_path)

    def refuse(options):
        raise AssertionError(f"a session was opened for {options}")

    monkeypatch.setattr(cli._runner, "_open_session", refuse)
    monkeypatch.syspath_prepend(str(TESTS))
    for argv, env in (
        (["run", "cli_targets:echo", "--plot", plot, "--dry-run"], {}),
        (["run", "cli_targets:echo", "--dry-run"], {"HYBRID_ITER_PLOT": plot}),
        (["run", "cli_targets:echo", "--plot", plot], {}),
    ):
        assert cli.main(argv, env) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybrid-iter: error: ") and message in err, err


def test_a_plot_without_matplotlib_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["run", "cli_targets:echo", "--plot", str(tmp_path / "x.png"), "--dry-run"]
    assert cli.main(argv, {}) == 2
    assert "pip install 'hybrid-iter[plot]'" in capsys.readouterr().err


def test_bench_command_runs_the_suite_of_the_checkout(capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert cli.main(["bench", "--dry-run", "--quick", "--only", "ml,ps"]) == 0
    out = capfd.readouterr().out  # printed by the `python -m benchmarks` subprocess
    assert "bench_ml.py --rows 200000" in out and "bench_ps.py" in out
    assert cli.main(["bench", "--dry-run", "--only", "nope"]) == 1
    assert "no benchmark 'nope'" in capfd.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--dry-run"]) == 2
    assert "source checkout" in capfd.readouterr().err


def test_progress_line_shows_rows_per_second_and_stragglers():
    out = io.StringIO()
    p = ProgressPrinter(True, label="async", stream=out)
    base = {"aligned": 4, "last_epoch_seconds": 0.02, "loss": 0.5, "terminated_by": None}
    p.update(
        Progress(epochs=3, done=False, failed=False, subtask_epochs=(3, 9), rows=1_000_000, **base)
    )
    # the subtasks moved but not the global epoch: a new line (async progress)
    p.update(
        Progress(epochs=3, done=False, failed=False, subtask_epochs=(3, 10), rows=1_000_000, **base)
    )
    p.update(
        Progress(epochs=3, done=False, failed=False, subtask_epochs=(3, 10), rows=1_000_000, **base)
    )
    lines = out.getvalue().splitlines()
    assert len(lines) == 1  # off a terminal: at most one line per second
    assert "50.0M rows/s" in lines[0]
    assert "subtask epochs 3..9 (slowest p0, fastest p1)" in lines[0]
    sync = io.StringIO()
    ProgressPrinter(True, label="sync", stream=sync).update(
        Progress(2, 2, 0.01, 0.1, None, False, False, (2, 2), 500)
    )
    assert "50.0k rows/s" in sync.getvalue() and "subtask epochs" not in sync.getvalue()


def test_progress_reaches_the_driver_from_a_real_run(spark, monkeypatch):
    """The coordinator's Progress carries the rows and every subtask's epochs."""
    import hybrid_iter._runtime.iterate as iterate

    out = io.StringIO()
    original = iterate.ProgressPrinter

    class ToBuffer(original):
        def __init__(self, enabled, *, label, stream=None):
            super().__init__(enabled, label=label, stream=out)

    monkeypatch.setattr(iterate, "ProgressPrinter", ToBuffer)
    ml.LinearRegression(
        features_col=["a", "b"], label_col="y", max_iter=3, progress=True, solver="sgd"
    ).fit(_frame(spark))
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("[LinearRegression[sync]] epoch     3") and "done: criteria" in last
    assert "rows/s" in last
