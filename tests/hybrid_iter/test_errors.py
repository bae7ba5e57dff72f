"""One exception tree, and test hooks kept out of the product (pure: no Spark, no Ray)."""

from __future__ import annotations

import inspect
import pickle
import re
from pathlib import Path

import pytest
from paths import ROOT

import coordinator
import hybrid_iter as hi
import hybrid_iter.ml
import hybrid_iter.ps
import hybrid_iter.testing
from hybrid_iter import SparkOpsError

BUILTIN_BASES = (ValueError, TypeError, RuntimeError, LookupError, TimeoutError)


def _exported_exceptions() -> list[tuple[str, type[BaseException]]]:
    found = []
    for module in (hi, coordinator, hybrid_iter.ml, hybrid_iter.ps):
        for name in module.__all__:
            obj = getattr(module, name)
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and not issubclass(obj, Warning)  # warnings are not part of the tree
            ):
                found.append((f"{module.__name__}.{name}", obj))
    return found


EXPORTED = _exported_exceptions()


def test_the_public_surface_exports_exceptions():
    names = {name for name, _ in EXPORTED}
    assert {"hybrid_iter.HybridIterError", "coordinator.RemoteFailure"} <= names


@pytest.mark.parametrize(("name", "cls"), EXPORTED, ids=[n for n, _ in EXPORTED])
def test_every_public_exception_is_in_one_tree(name, cls):
    assert issubclass(cls, (hi.HybridIterError, SparkOpsError)), name


def test_the_root_is_the_same_class_in_both_packages():
    assert hi.HybridIterError is coordinator.HybridIterError
    assert hi.IterationConfigError is coordinator.IterationConfigError
    assert hi.VariablesMismatchError is coordinator.VariablesMismatchError


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (hi.IterationConfigError, ValueError),
        (hi.ConfigTypeError, TypeError),
        (hi.ConfigTypeError, ValueError),
        (hi.DataValidationError, ValueError),
        (hi.SessionError, RuntimeError),
        (hi.StoredArraysLost, RuntimeError),
        (hi.IterationFailedError, RuntimeError),
        (hi.WorkerDiedError, hi.IterationFailedError),
        (hi.ModelExistsError, FileExistsError),
        (hi.ModelNotFoundError, FileNotFoundError),
        (hi.UsageError, RuntimeError),
        (hi.VariablesMismatchError, ValueError),
        (hi.OnlineCheckpointError, RuntimeError),
        (coordinator.NonFiniteVariables, ValueError),
        (coordinator.FeedbackShapeMismatch, ValueError),
        (coordinator.UnpicklableOperator, TypeError),
        (coordinator.MissingCheckpoint, RuntimeError),
        (coordinator.CheckpointCorrupt, ValueError),
        (coordinator.ForeignCheckpoint, ValueError),
        (coordinator.CutError, RuntimeError),
        (hybrid_iter.testing.InjectedFault, RuntimeError),
    ],
    ids=lambda v: v.__name__,
)
def test_each_error_keeps_its_builtin_base(cls, base):
    assert issubclass(cls, hi.HybridIterError)
    assert issubclass(cls, base)


@pytest.mark.parametrize(
    "cls",
    [coordinator.MissingCheckpoint, coordinator.CheckpointCorrupt, hi.OnlineCheckpointError],
    ids=lambda v: v.__name__,
)
def test_checkpoint_errors_share_a_base(cls):
    assert issubclass(cls, hi.CheckpointError)


def test_errors_pickle():
    for _, cls in EXPORTED:
        if cls is hi.IterationFailedError:
            err = cls("m", {0: ValueError("x")})
        elif cls is hi.RemoteFailure:
            err = cls(0, 1, "where", "ValueError", "x", "tb")
        elif cls is hi.OnlineCheckpointError:
            err = cls("m", (1, 2))
        else:
            try:
                err = cls("m")
            except TypeError:
                continue  # a constructor with other arguments; covered where it is raised
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err)


def test_a_dead_worker_error_pickles_with_its_fields_and_says_which_partition():
    failure = hi.RemoteFailure(1, None, "its Spark Python worker", "WorkerDied", "crashed", "")
    err = hi.WorkerDiedError("m", {1: failure}, 1, "SIGSEGV", None, "crashed", "JVM trace")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is hi.WorkerDiedError and str(back) == str(err)
    assert (back.partition, back.signal, back.report, back.spark_message) == (
        1,
        "SIGSEGV",
        "crashed",
        "JVM trace",
    )
    assert list(back.failures) == [1]
    assert (
        back.what
        == "the Spark Python worker running partition 1 died of SIGSEGV; Spark said 'crashed'"
    )


def test_a_user_function_error_is_spark_ops_and_pyspark_alike_and_pickles():
    from pyspark.errors import PythonException

    import spark_ops

    assert hi.UserFunctionError is spark_ops.UserFunctionError
    assert issubclass(hi.UserFunctionError, SparkOpsError)
    assert issubclass(hi.UserFunctionError, PythonException)  # pyspark's handlers still catch it
    err = hi.UserFunctionError(
        "map_partition function 'f' failed in partition 1: KeyError: 'k'",
        operation="map_partition",
        function="f",
        partition=1,
        exception_type="builtins.KeyError",
        exception_types=["builtins.KeyError", "builtins.LookupError", "builtins.Exception"],
    )
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.partition == 1 and back.function == "f"
    assert back.raised(LookupError) and back.raised("KeyError") and not back.raised(ValueError)


def test_bad_arguments_of_ml_and_ps_are_config_errors():
    from hybrid_iter.ml._optim import LBFGS

    with pytest.raises(hi.IterationConfigError, match="memory"):
        LBFGS([0.0], memory=0)
    with pytest.raises(hi.IterationConfigError, match="one entry") as info:
        hybrid_iter.ps.Sparse([0, 1], [1.0])
    assert isinstance(info.value, TypeError)  # a wrong argument type is caught as one


def test_fault_injection_lives_in_testing_only():
    assert "FaultInjection" not in hi.__all__ and "InjectedFault" not in hi.__all__
    assert not hasattr(hi, "FaultInjection") and not hasattr(hi, "InjectedFault")
    from hybrid_iter.testing import FaultInjection, InjectedFault, RuntimeHooks, Straggler

    assert issubclass(FaultInjection, RuntimeHooks) and issubclass(Straggler, RuntimeHooks)
    assert issubclass(InjectedFault, hi.HybridIterError)
    fault = pickle.loads(pickle.dumps(FaultInjection(fail_partition=1, at_epoch=3)))
    fault.before_watermark(1, 2, 0)  # not its point: nothing happens
    with pytest.raises(InjectedFault, match="partition 1 at epoch 3 on attempt 0"):
        fault.before_watermark(1, 3, 0)
    fault.before_watermark(1, 3, 1)  # another launch


def test_combined_hooks_pass_every_hook_point_to_each_part():
    # a hook point added to RuntimeHooks and missed here would silently skip its parts
    from hybrid_iter.testing import CombinedHooks, RuntimeHooks

    points = {n for n, v in vars(RuntimeHooks).items() if callable(v) and not n.startswith("_")}
    assert points and points <= set(vars(CombinedHooks)), points - set(vars(CombinedHooks))

    seen: list[tuple[str, int]] = []

    class Record(RuntimeHooks):
        def __init__(self, i):
            self.i = i

        def before_watermark(self, partition, epoch, attempt):
            seen.append(("before_watermark", self.i))

        def after_publish(self, epoch, variables):
            seen.append(("after_publish", self.i))

    both = CombinedHooks((Record(0), Record(1)))
    both.before_watermark(0, 0, 0)
    both.after_publish(0, {})
    both.after_batch(0, resumed=False)  # no part overrides it: nothing happens
    assert seen == [
        ("before_watermark", 0),
        ("before_watermark", 1),
        ("after_publish", 0),
        ("after_publish", 1),
    ]


def test_hooks_are_validated_with_the_argument_named():
    from hybrid_iter.testing import FaultInjection, Straggler

    with pytest.raises(hi.IterationConfigError, match="fail_partition"):
        FaultInjection(fail_partition=-1)
    with pytest.raises(hi.IterationConfigError, match="kill_driver_after_batch"):
        FaultInjection(kill_driver_after_batch="3")
    with pytest.raises(hi.IterationConfigError, match="factor"):
        Straggler(0, 0.5)
    with pytest.raises(hi.IterationConfigError, match=r"IterationConfig\.hooks"):
        hi.IterationConfig(hooks=object())  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match=r"OnlineConfig\.hooks"):
        hi.OnlineConfig(hooks=object())  # type: ignore[arg-type]
    # the default hooks do nothing at every point
    hooks = coordinator.RuntimeHooks()
    hooks.at_alignment(0, attempt=0, restarted=False)
    hooks.before_watermark(0, 0, 0)
    hooks.after_epoch_compute(0, 1.0)
    hooks.after_batch(0, resumed=False)


# -- the product neither exits its process nor sleeps to simulate -------------------------

#: the only sleeps on a product path: bounded polling of something outside the process
ALLOWED_SLEEPS = {
    "hybrid_iter/_runtime/iterate.py": 1,  # Ray restarting the coordinator
    "hybrid_iter/_cluster/slots.py": 1,  # an external registration (executors, slots)
    "hybrid_iter/_cluster/processes.py": 1,  # a failed start's processes ending
    # Ray on Spark: its worker nodes leaving, its head starting
    "hybrid_iter/_session/ray_on_spark.py": 2,
    "hybrid_iter/ps/_epochs.py": 1,  # Ray restarting a parameter shard's process
}
_EXIT = re.compile(r"\bos\._exit\(")
#: a call of time.sleep or of a bare sleep (a method named sleep is not a call)
_SLEEP = re.compile(r"\btime\.sleep\(|(?<![\w.])(?<!def )sleep\(")


def _product_sources() -> list[Path]:
    files = []
    for package in ("hybrid_iter", "coordinator", "spark_ops"):
        files += sorted((ROOT / package).rglob("*.py"))
    testing = ROOT / "hybrid_iter" / "testing"
    return [
        f for f in files if f != ROOT / "hybrid_iter" / "testing.py" and testing not in f.parents
    ]


def test_no_product_module_exits_the_process_or_sleeps_to_simulate():
    problems = []
    for path in _product_sources():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        code = [line.split("#", 1)[0] for line in lines]
        exits = [i + 1 for i, line in enumerate(code) if _EXIT.search(line)]
        sleeps = [i + 1 for i, line in enumerate(code) if _SLEEP.search(line)]
        if exits:
            problems.append(f"{rel}: os._exit at lines {exits}")
        if len(sleeps) > ALLOWED_SLEEPS.get(rel, 0):
            problems.append(f"{rel}: sleep at lines {sleeps}")
        for n in sleeps if rel in ALLOWED_SLEEPS else ():
            assert "polling" in lines[n - 1] or "poll" in lines[n - 1], (rel, n)
    assert not problems, "\n".join(problems)
