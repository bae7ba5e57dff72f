"""The ``hybrid-iter`` command: option resolution, errors before anything starts, runs.

Parsing and validation call ``cli.main(argv, environ)`` in this process with the session
opener replaced by one that fails the test, so a bad option provably stops the command
before Spark or Ray start. ``run`` itself is exercised on the shared local session
(``Session.local`` finds it running and leaves it so) and, for SIGTERM, in a subprocess.
The Spark-on-Ray path (``--session raydp``) runs in test_k8s.py, as the RayJob runs it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import requires_raydp
from paths import TESTS
from raydp_job import _descendants, _process_table

import hybrid_iter as hi
from hybrid_iter import cli
from spark_ops._spark_compat import raydp_problem


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(options):
        raise AssertionError(f"a session was opened for {options}")

    monkeypatch.setattr(cli._runner, "_open_session", refuse)


def resolve(argv: list[str], environ: dict[str, str] | None = None) -> cli.RunOptions:
    return cli.resolve_run_options(cli._options._parser().parse_args(["run", *argv]), environ or {})


def _carries(pid: int, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def result_line(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith(cli.RESULT_PREFIX)]
    assert len(lines) == 1, text
    return json.loads(lines[0][len(cli.RESULT_PREFIX) :])


def test_flags_override_the_environment_which_overrides_the_defaults():
    target = "hybrid_iter.example:linear_regression"
    defaults = resolve([target])
    assert (defaults.session, defaults.ray_address, defaults.executors) == ("local", None, 1)
    assert (defaults.executor_memory, defaults.executor_wait_seconds) == ("1g", 120.0)
    env = {
        "HYBRID_ITER_SESSION": "raydp",
        "HYBRID_ITER_RAY_ADDRESS": "auto",
        "HYBRID_ITER_EXECUTORS": "4",
        "HYBRID_ITER_EXECUTOR_CORES": "2",
        "HYBRID_ITER_EXECUTOR_MEMORY": "2G",
        "HYBRID_ITER_EXECUTOR_WAIT_SECONDS": "600",
        "HYBRID_ITER_DRIVER_MEMORY": "1024",
        "HYBRID_ITER_APP_NAME": "from-env",
    }
    from_env = resolve([target], env)
    assert from_env.session == "raydp" and from_env.ray_address == "auto"
    assert (from_env.executors, from_env.executor_cores) == (4, 2)
    assert (from_env.executor_memory, from_env.driver_memory) == ("2g", "1024")
    assert from_env.executor_wait_seconds == 600.0 and from_env.app_name == "from-env"
    flags = resolve([target, "--executors", "8", "--ray-address", "10.0.0.5:6379"], env)
    assert flags.executors == 8 and flags.ray_address == "10.0.0.5:6379"
    assert flags.executor_cores == 2  # still from the environment


def test_the_ray_address_follows_rays_conventions():
    # `ray job submit` sets RAY_ADDRESS for the entrypoint: a submitted job must run on
    # that cluster, not on an embedded Ray of its own.
    raydp = [TARGET, "--session", "raydp"]
    assert resolve(raydp, {"RAY_ADDRESS": "10.0.0.7:6379"}).ray_address == "10.0.0.7:6379"
    both = {"RAY_ADDRESS": "10.0.0.7:6379", "HYBRID_ITER_RAY_ADDRESS": "10.0.0.8:6379"}
    assert resolve(raydp, both).ray_address == "10.0.0.8:6379"
    assert resolve([*raydp, "--ray-address", "local"], both).ray_address == "local"
    assert resolve(raydp, {}).ray_address is None  # the embedded Ray
    assert resolve([TARGET], {"RAY_ADDRESS": "10.0.0.7:6379"}).ray_address is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens


@pytest.mark.skipif(raydp_problem() is None, reason="RayDP runs in this environment")
def test_session_raydp_without_a_usable_raydp_fails_naming_the_extra(capsys):
    argv = ["run", TARGET, "--session", "raydp", "--ray-address", "127.0.0.1:1"]
    assert cli.main(argv, {}) == 1
    err = capsys.readouterr().err
    assert "pip install 'hybrid-iter[raydp]'" in err, err


@requires_raydp
def test_an_unreachable_ray_address_fails_fast_naming_it(capsys):
    address = f"127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    assert cli.main(["run", TARGET, "--session", "raydp"], {"RAY_ADDRESS": address}) == 1
    err = capsys.readouterr().err
    assert f"no Ray cluster reachable at {address}" in err, err
    assert "check the address" in err
    assert time.monotonic() - t0 < 60  # a safety net: Ray alone retries for minutes


@requires_raydp
def test_a_port_that_is_not_a_ray_gcs_fails_within_the_connect_timeout(capsys):
    with socket.socket() as listener:  # accepts TCP connections, never speaks gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        argv = ["run", TARGET, "--session", "raydp", "--ray-address", address]
        t0 = time.monotonic()
        assert cli.main([*argv, "--connect-timeout-seconds", "3"], {}) == 1
        seconds = time.monotonic() - t0
    err = capsys.readouterr().err
    assert f"something accepts connections at {address} but no Ray GCS answered" in err, err
    assert seconds < 60  # a safety net only


def test_spark_conf_and_params_merge_the_environment_then_the_flags():
    env = {
        "HYBRID_ITER_SPARK_CONF": "# pinned ports\nspark.driver.port=7078\n\nspark.port.maxRetries = 15\n",
        "HYBRID_ITER_PARAMS": '{"rows": 100, "name": "env", "tol": 0.5}',
    }
    options = resolve(
        [
            "m:f",
            "--conf",
            "spark.driver.port=7100",
            "--conf",
            "spark.sql.shuffle.partitions=8",
            "--param",
            "rows=20000",
            "--param",
            "flag=true",
            "--param",
            "label=plain text",
            "--param",
            'quoted="5"',
        ],
        env,
    )
    assert options.spark_conf == {
        "spark.driver.port": "7100",
        "spark.port.maxRetries": "15",
        "spark.sql.shuffle.partitions": "8",
    }
    assert options.params == {
        "rows": 20000,
        "name": "env",
        "tol": 0.5,
        "flag": True,
        "label": "plain text",
        "quoted": "5",
    }
    lines = resolve(["m:f"], {"HYBRID_ITER_PARAMS": "rows=7\nname=x"}).params
    assert lines == {"rows": 7, "name": "x"}
    as_json = resolve(["m:f"], {"HYBRID_ITER_SPARK_CONF": '{"spark.a": 1}'}).spark_conf
    assert as_json == {"spark.a": "1"}


def test_options_of_another_session_kind_are_ignored_from_the_env_but_refused_as_flags(
    nothing_starts, capsys
):
    env = {"HYBRID_ITER_EXECUTORS": "3", "HYBRID_ITER_RAY_ADDRESS": "auto"}
    options = resolve(["m:f", "--session", "local", "--parallelism", "2"], env)
    assert options.executors == 1 and options.ray_address is None and options.parallelism == 2
    assert cli.main(["run", "m:f", "--session", "local", "--executors", "2"], {}) == 2
    err = capsys.readouterr().err
    assert "--executors applies to --session raydp" in err and "--parallelism" in err
    assert cli.main(["run", "m:f", "--session", "raydp", "--parallelism", "2"], {}) == 2
    assert "--parallelism applies to --session local" in capsys.readouterr().err


TARGET = "hybrid_iter.example:linear_regression"
BAD = [
    ([TARGET, "--session", "yarn"], {}, "--session must be one of local, raydp"),
    ([TARGET], {"HYBRID_ITER_SESSION": "k8s"}, "HYBRID_ITER_SESSION must be one of"),
    (
        [TARGET, "--session", "raydp", "--executors", "two"],
        {},
        "--executors must be an integer >= 1, got 'two'",
    ),
    (
        [TARGET],
        {"HYBRID_ITER_SESSION": "raydp", "HYBRID_ITER_EXECUTOR_CORES": "0"},
        "HYBRID_ITER_EXECUTOR_CORES must be an integer >= 1",
    ),
    ([TARGET, "--parallelism", "-1"], {}, "--parallelism must be an integer >= 1"),
    (
        [TARGET, "--session", "raydp", "--executor-memory", "lots"],
        {},
        "--executor-memory must be a Spark memory size",
    ),
    ([TARGET, "--session", "raydp", "--executor-memory", "256m"], {}, "must be at least 450m"),
    ([TARGET, "--driver-memory", "100"], {}, "--driver-memory must be at least 450m"),
    (
        [TARGET, "--session", "raydp", "--ray-address", "ray://head:10001"],
        {},
        "is a Ray Client address",
    ),
    ([TARGET, "--session", "raydp", "--ray-address", " "], {}, "--ray-address must not be empty"),
    (
        [TARGET, "--session", "raydp"],
        {"RAY_ADDRESS": "ray://head:10001"},
        "RAY_ADDRESS='ray://head:10001' is a Ray Client address",
    ),
    (
        [TARGET, "--session", "raydp"],
        {"RAY_ADDRESS": "http://head:8265"},
        "is a Ray dashboard / job-submission URL, not a GCS address; run the driver on the "
        "cluster instead: `ray job submit",
    ),
    ([TARGET, "--session", "raydp", "--ray-address", "head"], {}, "is not host:port of a Ray GCS"),
    (
        [TARGET, "--session", "raydp", "--connect-timeout-seconds", "0"],
        {},
        "--connect-timeout-seconds must be a number of seconds > 0",
    ),
    (
        [TARGET, "--session", "raydp", "--executor-wait-seconds", "-5"],
        {},
        "--executor-wait-seconds must be a number of seconds > 0",
    ),
    ([TARGET, "--log-level", "LOUD"], {}, "--log-level must be DEBUG, INFO, WARNING or ERROR"),
    (
        [TARGET, "--output", "/no/such/dir/result.json"],
        {},
        "directory '/no/such/dir' does not exist",
    ),
    ([TARGET, "--conf", "spark.driver.memory"], {}, "--conf entries must be KEY=VALUE"),
    (
        [TARGET, "--conf", "sprak.driver.memory=2g"],
        {},
        "'sprak.driver.memory' is not a Spark property",
    ),
    (
        [TARGET],
        {"HYBRID_ITER_SPARK_CONF": '{"spark.a": '},
        "HYBRID_ITER_SPARK_CONF is not valid JSON",
    ),
    ([TARGET], {"HYBRID_ITER_PARAMS": '{"rows"}'}, "HYBRID_ITER_PARAMS is not valid JSON"),
    ([TARGET], {"HYBRID_ITER_PARAMS": "{} x"}, "HYBRID_ITER_PARAMS is not valid JSON"),
    ([TARGET, "--param", "2rows=5"], {}, "'2rows' is not a valid parameter name"),
    ([TARGET, "--param", "rowz=5"], {}, "with params ['rowz']"),
    (["no_colon_here"], {}, "MODULE:FUNCTION must name a module and a function"),
    (["no_such_module_xyz:main"], {}, "cannot import module 'no_such_module_xyz'"),
    (["hybrid_iter.example:nope"], {}, "'hybrid_iter.example' has no attribute 'nope'"),
    (["hybrid_iter.example:__all__"], {}, "is a list, not a function"),
]


@pytest.mark.parametrize("argv, environ, message", BAD)
def test_a_bad_option_exits_2_naming_it_before_anything_starts(
    argv, environ, message, nothing_starts, capsys
):
    assert cli.main(["run", *argv], environ) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-iter: error: ") and message in err, err


def test_a_misspelt_parameter_error_lists_the_functions_parameters(nothing_starts, capsys):
    assert cli.main(["run", TARGET, "--param", "rowz=5"], {}) == 2
    err = capsys.readouterr().err
    assert "it takes (session, rows, features, partitions, max_epochs" in err


def test_usage_errors_exit_2():
    for argv in ([], ["run"], ["deploy"]):
        with pytest.raises(SystemExit) as ex:
            cli.main(argv, {})
        assert ex.value.code == 2


def test_dry_run_prints_the_resolved_options_and_starts_nothing(nothing_starts, capsys):
    env = {"HYBRID_ITER_SESSION": "raydp", "HYBRID_ITER_EXECUTORS": "3"}
    assert cli.main(["run", TARGET, "--param", "rows=10", "--dry-run"], env) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["session"] == "raydp" and plan["executors"] == 3
    assert plan["target"] == TARGET and plan["params"] == {"rows": 10}


def test_version_reports_the_stack_java_included(capsys):
    assert cli.main(["version", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["hybrid-iter"] == hi.__version__
    assert {"python", "pyspark", "ray", "raydp", "numpy", "pyarrow", "java"} <= set(found)
    assert found["java"].split(".")[0] == "17", found["java"]
    assert cli.main(["version"]) == 0
    assert f"hybrid-iter {hi.__version__}" in capsys.readouterr().out.splitlines()
    with pytest.raises(SystemExit) as ex:
        cli.main(["--version"])
    assert ex.value.code == 0 and hi.__version__ in capsys.readouterr().out


def test_run_trains_the_example_on_the_session_and_prints_the_result(session, capsys, tmp_path):
    output = tmp_path / "result.json"
    argv = ["run", TARGET, "--param", "rows=4000", "--param", "partitions=2"]
    assert cli.main([*argv, "--output", str(output)], {}) == 0
    report = result_line(capsys.readouterr().out)
    assert report["target"] == TARGET and report["session"] == "local"
    assert report["spark_master"] == session.spark.sparkContext.master
    result = report["result"]
    assert result["rows"] == 4000 and result["partitions"] == 2
    assert result["terminated_by"] == "criteria" and result["max_weight_error"] < 0.05
    assert json.loads(output.read_text()) == report
    assert session.spark.range(3).count() == 3  # the shared session is still running


def test_results_become_json_and_a_failing_function_exits_1(session, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    assert cli.main(["run", "cli_targets:echo", "--param", "n=3", "--param", "tag=x"], {}) == 0
    result = result_line(capsys.readouterr().out)["result"]
    assert result == {
        "kind": "local",
        "count": 5,
        "params": {"n": 3, "tag": "x"},
        "vector": [0.0, 1.0, 2.0],
        "scalar": 0.5,
        "point": {"x": 1.0, "y": 2.0},
    }
    assert cli.main(["run", "cli_targets:fail"], {}) == 1
    captured = capsys.readouterr()
    assert cli.RESULT_PREFIX not in captured.out
    assert "ValueError: boom from the entry function" in captured.err
    assert "hybrid-iter: cli_targets:fail failed: boom from the entry function" in captured.err
    assert session.spark.range(3).count() == 3


@pytest.mark.integration
def test_sigterm_stops_the_session_it_started_and_exits_143(tmp_path):
    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "RAY_ADDRESS"))}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    tag = secrets.token_hex(8)  # marks every process the command starts
    env["HYBRID_ITER_TEST_CLI"] = tag
    exe = Path(sys.executable).parent / "hybrid-iter"
    assert exe.is_file(), f"{exe} missing: pip install -e . installs the hybrid-iter script"
    # Run from tests/: the CLI imports the target from the current directory.
    argv = [str(exe), "run", "cli_targets:wait_for_sigterm", "--parallelism", "1"]
    argv += ["--driver-memory", "512m", "--param", f"ready={ready}"]
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as stdout, open(err_path, "w") as stderr:  # no pipe to fill up
        proc = subprocess.Popen(
            argv, cwd=TESTS, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the target never started (exit {proc.poll()}):\n{err_path.read_text()[-4000:]}"
                )
            time.sleep(0.2)  # polling an external process's readiness, not test synchronisation
        started = _descendants(proc.pid)
        assert {"raylet", "gcs_server", "java"} <= set(started.values()), started
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert cli.RESULT_PREFIX not in out
    deadline = time.monotonic() + 30
    while True:
        table = _process_table()
        alive = {
            p: n
            for p, n in started.items()
            if p in table and table[p][1] != "Z" and _carries(p, f"HYBRID_ITER_TEST_CLI={tag}")
        }
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.25)  # waiting for processes to exit, not test synchronisation
    for pid in alive:  # ours for sure (the tag): a reused PID is never hit
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"left running after SIGTERM: {alive}"
