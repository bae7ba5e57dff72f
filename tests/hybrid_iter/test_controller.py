"""The driver's run controller and the checkpoint identity rules, without Spark or Ray.

``FailurePolicy`` decides by exception type (the failure's own, or its cause's inside
``IterationFailedError``), never by message text: the table below is the whole policy.
``RunController`` only moves along its allowed transitions. ``RestoredCheckpoint`` says
whether a restore found what was written, from the epochs a store reports (never from
file names).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import hybrid_iter as hi
from coordinator import (
    CallTimeout,
    CheckpointStore,
    ForeignCheckpoint,
    MissingCheckpoint,
    RemoteFailure,
    RestoredCheckpoint,
)
from coordinator._errors import (
    CheckpointEncodeError,
    FeedbackShapeMismatch,
    NonFiniteVariables,
    UnpicklableOperator,
)
from coordinator._identity import (
    damaged_since,
    iteration_fingerprint,
    refuse_foreign_run,
    refuse_not_online,
    refuse_unresumable,
)
from coordinator._spec import bounded_checkpoint_spec
from hybrid_iter._errors import StoredArraysLost
from hybrid_iter._runtime.controller import (
    FATAL_CAUSES,
    FailurePolicy,
    RunController,
    RunState,
    RunStateError,
    Verdict,
)

KEY = b"k" * 32


def failed(cause: BaseException | None, *, source: int | str = 0, epoch: int = 3):
    """The run's failure as the driver sees it: an IterationFailedError whose one
    RemoteFailure carries ``cause`` (None: a failure naming no user code)."""
    if cause is None:
        return hi.IterationFailedError("the coordinator actor died: lost", {})
    failure = RemoteFailure(
        source, epoch, "process_data", type(cause).__name__, str(cause), "", cause
    )
    return hi.IterationFailedError(f"the iteration failed: {failure}", {source: failure})


# -- the failure policy ---------------------------------------------------------------------

POLICY_TABLE = [
    # the failure itself
    (hi.IterationConfigError("bad arg"), Verdict.FATAL),
    (hi.ConfigTypeError("bad type"), Verdict.FATAL),
    (hi.DataValidationError("a null"), Verdict.FATAL),
    (KeyboardInterrupt(), Verdict.FATAL),
    (SystemExit(1), Verdict.FATAL),
    (RuntimeError("a Spark stage failed"), Verdict.RELAUNCH),
    (OSError("connection reset"), Verdict.RELAUNCH),
    (hi.WorkerDiedError("killed", {}, 1, 9, None, "", ""), Verdict.RELAUNCH),
    (failed(None), Verdict.RELAUNCH),
    # the cause inside IterationFailedError
    (failed(ValueError("user bug")), Verdict.RELAUNCH),
    (failed(ZeroDivisionError("user bug")), Verdict.RELAUNCH),
    (failed(CallTimeout("blocked")), Verdict.FATAL),
    (failed(hi.VariablesMismatchError("shape")), Verdict.FATAL),
    (failed(NonFiniteVariables("nan")), Verdict.FATAL),
    (failed(FeedbackShapeMismatch("shapes")), Verdict.FATAL),
    (failed(hi.IterationConfigError("bad")), Verdict.FATAL),
    (failed(StoredArraysLost("gone")), Verdict.FATAL),
    (failed(ForeignCheckpoint("another run")), Verdict.FATAL),
    (failed(MissingCheckpoint("not visible")), Verdict.FATAL),
    (failed(hi.ValueEncodeError("a lock")), Verdict.FATAL),
    (failed(CheckpointEncodeError("a lock")), Verdict.FATAL),
    (failed(UnpicklableOperator("a lock")), Verdict.FATAL),
    (failed(hi.UsageError("criteria")), Verdict.FATAL),
]


@pytest.mark.parametrize(
    ("failure", "verdict"),
    POLICY_TABLE,
    ids=[f"{type(f).__name__}-{v.value}" for f, v in POLICY_TABLE],
)
def test_the_policy_decides_by_the_type_of_the_failure_or_its_cause(failure, verdict):
    assert FailurePolicy.classify(failure) is verdict
    decision = FailurePolicy(restarts=3).decide(failure, attempt=0)
    assert decision.verdict is verdict and decision.relaunch is (verdict is Verdict.RELAUNCH)


def test_the_message_of_a_failure_never_changes_the_decision():
    """The same words that once marked a final failure, in a failure of another type,
    are relaunched; a final type with any words is final."""
    words = "the coordinator was restarted by Ray but found no checkpoint CallTimeout"
    assert FailurePolicy.classify(failed(ValueError(words))) is Verdict.RELAUNCH
    assert FailurePolicy.classify(RuntimeError(words)) is Verdict.RELAUNCH
    timeout = RemoteFailure(0, 1, "process_data", "CallTimeout", words, "")  # no typed cause
    assert FailurePolicy.classify(hi.IterationFailedError(words, {0: timeout})) is Verdict.RELAUNCH
    assert FailurePolicy.classify(failed(CallTimeout(""))) is Verdict.FATAL


def test_a_final_cause_survives_the_trip_through_pickle():
    """The cause reaches the driver pickled (Spark task -> Ray -> driver): its type must
    survive for the policy to see it."""
    for cause in FATAL_CAUSES:
        ex = pickle.loads(pickle.dumps(failed(cause("x"))))
        assert FailurePolicy.classify(ex) is Verdict.FATAL, cause


def test_no_restart_left_exhausts_and_the_failure_is_raised_unchanged():
    policy = FailurePolicy(restarts=1)
    assert policy.decide(failed(None), 0).verdict is Verdict.RELAUNCH
    decision = policy.decide(failed(None), 1)
    assert decision.verdict is Verdict.EXHAUSTED and decision.error is None


def test_the_same_user_failure_met_again_is_not_relaunched_again():
    policy = FailurePolicy(restarts=5)
    first = failed(ValueError("bad row at 0x7f00aa"))
    assert policy.decide(first, 0).relaunch
    # the same failure, another object address: deterministic
    again = policy.decide(failed(ValueError("bad row at 0x7f11bb")), 1)
    assert again.verdict is Verdict.REPEATED
    assert isinstance(again.error, hi.IterationFailedError)
    assert "the same failure as attempt 0" in again.error.message
    # another epoch is another failure
    assert policy.decide(failed(ValueError("bad row at 0x1"), epoch=4), 1).relaunch
    # failures naming no user code are never held against each other
    assert policy.decide(failed(None), 2).relaunch and policy.decide(failed(None), 3).relaunch


# -- the controller's states ----------------------------------------------------------------


def test_a_run_that_ends_well_goes_launching_running_finished():
    run = RunController(2, checkpoint_uri=None)
    assert run.state is RunState.LAUNCHING and run.attempt == 0 and not run.restore
    run.running()
    run.finished()
    assert run.state is RunState.FINISHED and run.failed_attempts == []
    with pytest.raises(RunStateError):
        run.running()


def test_a_relaunched_attempt_restores_the_newest_checkpoint_seen_written():
    run = RunController(2, checkpoint_uri="/ckpt")
    run.running()
    run.checkpointed(4)
    run.checkpointed(-1)  # a monitor that saw none does not lower it
    decision = run.failed(failed(None))
    assert decision.relaunch and run.state is RunState.RESTORING
    assert run.attempt == 1 and run.restore and run.expect == 4
    assert run.failed_attempts == [
        "attempt 0: IterationFailedError: the coordinator actor died: lost"
    ]
    assert run.restored(None) is None and run.state is RunState.LAUNCHING
    run.running()
    run.finished()
    assert run.state is RunState.FINISHED


def test_without_checkpoints_a_relaunch_starts_over():
    run = RunController(1, checkpoint_uri=None)
    run.running()
    assert run.failed(failed(None)).relaunch
    assert not run.restore


def test_a_final_failure_ends_the_run_failed():
    run = RunController(3, checkpoint_uri="/ckpt")
    run.running()
    assert run.failed(failed(CallTimeout("blocked"))).verdict is Verdict.FATAL
    assert run.state is RunState.FAILED
    with pytest.raises(RunStateError):
        run.restored(None)


def test_a_restarted_coordinator_that_restored_less_than_written_fails_the_run():
    run = RunController(3, checkpoint_uri="s3://b/ckpt", expect=6)
    run.running()
    run.failed(failed(None))
    error = run.restored(RestoredCheckpoint(found=4, expected=6))
    assert isinstance(error, MissingCheckpoint) and run.state is RunState.FAILED
    assert "checkpoint 4" in str(error) and "checkpoint 6 was written" in str(error)
    assert "s3://b/ckpt" in str(error)


def test_an_older_restore_explained_by_damaged_files_goes_on():
    run = RunController(3, checkpoint_uri="/ckpt", expect=6)
    run.running()
    run.failed(failed(None))
    older = RestoredCheckpoint(found=4, expected=6, damaged=(6,))
    assert older.older and not older.missing
    assert run.restored(older) is None and run.state is RunState.LAUNCHING
    assert run.restores == [older]


def test_failures_are_only_taken_while_running():
    run = RunController(1, checkpoint_uri=None)
    with pytest.raises(RunStateError):
        run.failed(RuntimeError("before the launch"))
    run.abort()
    assert run.state is RunState.FAILED


def test_abort_leaves_a_finished_run_finished():
    run = RunController(1, checkpoint_uri=None)
    run.running()
    run.finished()
    run.abort()
    assert run.state is RunState.FINISHED


# -- checkpoint identity --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "expected", "damaged", "older", "missing"),
    [
        (None, None, (), False, False),  # nothing expected, nothing found: a fresh start
        (5, None, (), False, False),
        (6, 6, (), False, False),
        (7, 6, (), False, False),
        (4, 6, (), True, True),  # the newer file is not visible: the path is not shared
        (None, 6, (), True, True),
        (4, 6, (6,), True, False),  # visible but damaged: falling back is right
        (4, 6, (5,), True, True),  # damage older than expected does not explain it
        (None, 6, (7, 6), True, False),
    ],
)
def test_a_restore_is_checked_against_what_was_written(found, expected, damaged, older, missing):
    r = RestoredCheckpoint(found, expected, damaged)
    assert (r.older, r.missing) == (older, missing)
    assert damaged_since(damaged, expected or 0) is bool(
        damaged and max(damaged) >= (expected or 0)
    )


def test_the_store_reports_the_epochs_it_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r", keep_last=5)
    for e in (2, 4, 6):
        store.save(e, {"e": e}, [])
    for e in (4, 6):
        path = tmp_path / f"chk-{e:010d}.ckpt"
        path.write_bytes(path.read_bytes()[:-3])
    loaded = store.load_latest()
    assert loaded.epoch == 2 and loaded.skipped_epochs == (6, 4)
    assert [p for p, _ in loaded.skipped] == [f"{tmp_path}/chk-{e:010d}.ckpt" for e in (6, 4)]


def test_a_file_of_another_run_is_refused_naming_both_runs():
    refuse_foreign_run("/c/chk-1.ckpt", "a", "", "/c")  # no run id of ours: any is taken
    refuse_foreign_run("/c/chk-1.ckpt", "a", "a", "/c")
    with pytest.raises(ForeignCheckpoint, match=r"run 'a', not to this run 'b'"):
        refuse_foreign_run("/c/chk-1.ckpt", "a", "b", "/c")


def test_an_online_run_refuses_a_bounded_checkpoint():
    refuse_not_online({"online": True}, "/c/chk-1.ckpt")
    with pytest.raises(ForeignCheckpoint, match="not online"):
        refuse_not_online({}, "/c/chk-1.ckpt")


class Step(hi.PartitionOperator):
    def __init__(self, rate: float):
        self.rate = rate


class Streams:
    """What the fingerprint reads of a ReplayableDataStreamList."""

    replayed = (False,)
    any_replayed = False

    def __len__(self) -> int:
        return 1


def body(rate: float = 0.1) -> hi.IterationBody:
    return hi.IterationBody(partition=Step(rate), coordinator=hi.CoordinatorOperator())


def config(**kw) -> hi.IterationConfig:
    return hi.IterationConfig(staleness=0, **kw)


def test_the_fingerprint_tells_a_changed_hyper_parameter_or_initial_value():
    w = {"w": np.zeros(3)}
    same = iteration_fingerprint(body(), Streams(), w, 2, config())
    assert iteration_fingerprint(body(), Streams(), w, 2, config()) == same
    assert iteration_fingerprint(body(0.2), Streams(), w, 2, config())["body"] != same["body"]
    ones = {"w": np.ones(3)}
    assert (
        iteration_fingerprint(body(), Streams(), ones, 2, config())["init_variables"]
        != (same["init_variables"])
    )


def test_resume_from_is_checked_before_any_job(tmp_path):
    w = {"w": np.zeros(3)}
    empty = str(tmp_path / "empty")
    with pytest.raises(hi.IterationConfigError, match="holds no valid checkpoint"):
        bounded_checkpoint_spec(config(resume_from=empty), body(), Streams(), w, 2)
    spec = bounded_checkpoint_spec(
        config(checkpoint=hi.CheckpointConfig(empty)), body(), Streams(), w, 2
    )
    assert spec is not None and spec.expect_epoch is None and not spec.restore
    store = CheckpointStore(spec.uri, key=spec.key, run_id=spec.run_id)
    store.save(3, {"fingerprint": dict(spec.fingerprint)}, [])
    with pytest.raises(hi.IterationConfigError, match="already holds checkpoints of run"):
        bounded_checkpoint_spec(
            config(checkpoint=hi.CheckpointConfig(empty)), body(), Streams(), w, 2
        )
    resumed = bounded_checkpoint_spec(config(resume_from=empty), body(), Streams(), w, 2)
    assert resumed is not None and (resumed.run_id, resumed.expect_epoch) == (spec.run_id, 3)
    with pytest.raises(hi.IterationConfigError, match="is of another iteration"):
        bounded_checkpoint_spec(config(resume_from=empty), body(0.5), Streams(), w, 2)


def test_an_unresumable_directory_names_its_damaged_files():
    class Loaded:
        epoch, skipped = -1, (("/c/chk-0000000004.ckpt", "truncated"),)

    with pytest.raises(hi.IterationConfigError, match="truncated"):
        refuse_unresumable(Loaded(), "/c", {})
