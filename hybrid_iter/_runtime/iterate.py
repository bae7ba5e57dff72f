"""``iterate_bounded_streams_until_termination``: validation, launch, progress, result.

Runs on the driver. Everything that can be checked without a Spark job is checked
first; then the coordinator actor is started and one barrier stage runs all subtasks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from coordinator import (
    CallTimeout,
    CheckpointInfo,
    CheckpointSpec,
    CoordinatorSpec,
    IterationCoordinator,
    MissingCheckpoint,
    RemoteFailure,
    RestoredCheckpoint,
    UnpicklableOperator,
    node_local_refusal,
)
from coordinator._spec import bounded_checkpoint_spec
from spark_ops import (
    BarrierStage,
    ReplayPlan,
    exact_num_partitions,
    num_partitions,
    python_worker_death,
    spark_error_text,
)
from spark_ops._spark_compat import JobTag

from .._body import IterationBody
from .._cluster import context as cluster
from .._cluster.placement import (
    ActorKind,
    Launched,
    actor_class,
    coordinator_resources,
    kill,
    launch_held,
)
from .._cluster.ray_util import NAMESPACE, live_nodes
from .._cluster.slots import task_slots, wait_for_task_slots
from .._cluster.spares import keep_spare, register_warmer, retire_as_spare, spares, take_spare
from .._config import IterationConfig, OperatorLifecycle
from .._errors import (
    ConfigTypeError,
    DataValidationError,
    IterationConfigError,
    IterationFailedError,
    SessionError,
    WorkerDiedError,
)
from .._result import IterationResult, ReplayInfo
from .._streams import ReplayableDataStreamList
from .controller import RunController, RunState
from .endpoint import EndpointPlan
from .entry import check_entry
from .feedback_combine import tree_spec
from .metrics import RunMeter, bounded_description, bounded_meter
from .progress import ProgressPrinter
from .shipping import dumps
from .task import TaskPlan, run_round, run_subtask

__all__ = ["iterate_bounded_streams_until_termination", "node_local_refusal"]

log = logging.getLogger("hybrid_iter")


def coordinator_kind(subtasks: int, restarts: int = 0) -> ActorKind:
    """The coordinator actor of a run of ``subtasks`` subtasks that Ray restarts
    ``restarts`` times (the spare pool's key: the warm-up's spare is of this kind).

    Every subtask waits in one call at a time, plus the driver's progress poll: an async
    actor answering more calls than ``max_concurrency`` at once would deadlock. With
    checkpoints Ray restarts a coordinator whose process died; it reloads the newest
    checkpoint and the relaunched tasks find it again by name. ``busy`` answers on its
    own event loop thread while the main one is stuck in a coordinator operator (the
    driver's call_timeout watchdog asks it)."""
    return actor_class(
        IterationCoordinator,
        max_restarts=restarts,
        max_concurrency=max(1000, subtasks + 16),
        concurrency_groups={"watch": 1},
    )


#: what a spare coordinator started ahead imports: the coordinator operators of the fits
_SPARE_MODULES = ("hybrid_iter.ml",)


def _warm_coordinator(ctx: cluster.ClusterContext) -> tuple[str | None, list[Any]]:
    """The warm-up's spare coordinator: of the kind of any run without checkpoints of up
    to 984 subtasks."""
    kind = coordinator_kind(1)
    started = keep_spare(kind, _SPARE_MODULES, count=1)
    names = spares(kind)
    return (names[0] if names else None), [h.__ray_ready__.remote() for h in started]


register_warmer("spare", 10, _warm_coordinator)


def _validate(
    init_variables: Any, data_streams: Any, config: Any, body: Any
) -> tuple[dict[str, Any], ReplayableDataStreamList, list[int | None]]:
    """The checked variables, the streams, and each stream's partition count where the
    plan gives it exactly."""
    if not isinstance(config, IterationConfig):
        raise IterationConfigError(
            f"config must be a hybrid_iter.IterationConfig, got {type(config).__name__}"
        )
    variables, data_streams = check_entry(init_variables, data_streams, body)
    exact: list[int | None] = []
    for i, stream in enumerate(data_streams.streams):
        stream.validate(i)
        # exact when the plan tells without a job; the barrier stage reuses it (planning
        # a DataFrame's RDD costs tens of milliseconds)
        exact.append(exact_num_partitions(stream.df))
        if (exact[-1] if exact[-1] is not None else num_partitions(stream.df)) == 0:
            raise DataValidationError(
                f"data stream {i} has no partitions, so no rows; an iteration needs data"
            )
    if data_streams.any_replayed and config.staleness != 0:
        raise IterationConfigError(
            f"replayed streams run one Spark job per round, and round e starts only after "
            f"the watermark of round e - 1, so the iteration is synchronous: use "
            f"IterationConfig(staleness=0) (got staleness={config.staleness!r}), or read the "
            f"streams once with not_replay(...) for async or bounded-staleness training"
        )
    if config.operator_lifecycle is OperatorLifecycle.PER_ROUND:
        not_replayed = [i for i, r in enumerate(data_streams.replayed) if not r]
        if not_replayed:
            raise IterationConfigError(
                f"operator_lifecycle=PER_ROUND creates a new operator every epoch, so it "
                f"needs every data stream replayed, but data stream(s) {not_replayed} are "
                f"not replayed; use OperatorLifecycle.ALL_ROUND to read them once"
            )
    sessions = {id(df.sparkSession) for df in data_streams.dataframes}
    if len(sessions) != 1:
        raise IterationConfigError("all data streams must come from the same SparkSession")
    return variables, data_streams, exact


def _raise_failures(failures: list[RemoteFailure], spark_error: BaseException | None) -> None:
    primary = failures[0]
    if primary.source == "data" or isinstance(primary.cause, DataValidationError):
        raise DataValidationError(f"{primary}") from primary
    if isinstance(primary.cause, UnpicklableOperator):
        raise IterationConfigError(f"{primary}") from primary
    # hybrid_iter's own argument and session errors reach the caller as themselves; every
    # other error of the tree (a wrong type passed to out.*, mismatched variables, ...)
    # arrives inside IterationFailedError, as builtin errors do
    if isinstance(primary.cause, (IterationConfigError, SessionError)) and not isinstance(
        primary.cause, ConfigTypeError
    ):
        raise type(primary.cause)(str(primary)) from primary
    by_source: dict[int | str, BaseException] = {}
    for f in failures:
        by_source.setdefault(f.source, f)
    raise IterationFailedError(f"the iteration failed: {primary}", by_source) from (
        spark_error or primary
    )


def _worker_died(error: BaseException) -> WorkerDiedError | None:
    """``error`` of a failed Spark stage as a ``WorkerDiedError`` when it reports a
    Python worker that died under a subtask (no exception of user code), else None.
    Spark's whole report stays reachable: ``spark_message``, and the caller chains the
    Spark error as the cause."""
    text = spark_error_text(error)
    death = python_worker_death(text)
    if death is None:
        return None
    what = WorkerDiedError.describe(death.partition, death.signal, death.exit_code, death.report)
    message = (
        f"the iteration failed: {what}. No Python exception was raised: "
        f"{WorkerDiedError.advice(death.signal)}; Spark's full report is the error's "
        f"spark_message"
    )
    failures: dict[int | str, BaseException] = {}
    if death.partition is not None:
        failures[death.partition] = RemoteFailure(
            death.partition, None, "its Spark Python worker", "WorkerDied", death.report, ""
        )
    return WorkerDiedError(
        message,
        failures,
        death.partition,
        death.signal,
        death.exit_code,
        death.report,
        text,
    )


_ENDPOINT_FAILURE = re.compile(r"coordinator\._errors\.(Endpoint\w*): (.+)")


def _endpoint_failure(error: BaseException) -> str | None:
    """The coordinator endpoint's own error (``EndpointError``, ``EndpointAuthError``,
    ``EndpointVersionMismatch``: it names the address and the fix) in a failed stage's
    report, if a subtask raised one; the same text from classic and Connect clients. Read
    off the text: a subtask's exception reaches the driver only as text in Spark's report
    (no type crosses), where its qualified class name is the mark of it."""
    found = _ENDPOINT_FAILURE.search(spark_error_text(error))
    return None if found is None else f"{found.group(1)}: {found.group(2).strip()}"


#: how long a relaunch waits for lost executors to come back (at most call_timeout)
SLOT_WAIT_SECONDS = 120.0


def _wait_for_slots(
    spark: Any,
    n: int,
    config: IterationConfig,
    attempt: int,
    checkpoint: CheckpointSpec | None,
    expect: int | None,
) -> None:
    """Before relaunch ``attempt``: the barrier stage needs ``n`` task slots at once. A
    failure that took an executor with it leaves fewer until the cluster manager
    replaces it; Spark would then hold the stage without a word. Wait for them, bounded,
    and else fail naming the cause (the checkpoints stay for a resume)."""
    limit = min(SLOT_WAIT_SECONDS, float(config.call_timeout))
    slots = wait_for_task_slots(spark, n, limit, config.parallelism)
    if slots >= n:
        return
    where = ""
    if checkpoint is not None:
        where = (
            f"; the checkpoints in {checkpoint.uri!r}"
            + (f" (newest: epoch {expect})" if expect is not None else "")
            + " are kept: resume with IterationConfig(resume_from=...) once executors are "
            "back"
        )
    raise IterationFailedError(
        f"relaunch {attempt} needs {n} Spark task slots at once (one barrier stage), but "
        f"only {slots} are registered {limit:.0f} s after the failure: an executor was lost "
        f"and not replaced. Add executors (or let the cluster manager replace them), or run "
        f"with a lower IterationConfig(parallelism=...){where}",
        {},
    )


def iterate_bounded_streams_until_termination(
    init_variables: Mapping[str, Any],
    data_streams: ReplayableDataStreamList,
    config: IterationConfig,
    body: IterationBody,
) -> IterationResult:
    """Run ``body`` over bounded DataFrames until it terminates; see docs/semantics.md.

    ``init_variables`` are the variables at epoch 0 (numpy arrays or numbers, by name);
    the coordinator tier publishes new versions with ``out.publish_variables``.
    """
    started = time.perf_counter()
    started_wall = time.time()
    variables, streams, partitions = _validate(init_variables, data_streams, config, body)
    spark = streams.dataframes[0].sparkSession
    slots = task_slots(spark, config.parallelism)
    if slots < 1:
        raise IterationConfigError(
            "Spark has no task slots (no executor is registered); start executors or use "
            "Session.local()"
        )
    n = config.parallelism or slots
    if n > slots:
        raise IterationConfigError(
            f"IterationConfig(parallelism={n}) needs {n} Spark task slots at once (one "
            f"barrier stage), but only {slots} exist (not counting slots held by "
            f"long-running tasks, such as Session.on_spark's Ray worker nodes); lower "
            f"parallelism to <= {slots}, or give Spark more cores (local[{n}], or more "
            f"executors/cores)"
        )
    op_bytes = dumps(body.partition, f"the partition operator {type(body.partition).__name__}")
    round_bytes = (
        dumps(body.per_round_partition, "the for_each_round partition operator")
        if body.per_round_partition is not None
        else None
    )
    coord_bytes = dumps(
        (body.coordinator, body.per_round_coordinator, list(body.coordinator_listeners)),
        "the coordinator operators or listeners",
    )
    address = cluster.of(spark).ray_address
    per_round = config.operator_lifecycle is OperatorLifecycle.PER_ROUND
    tree = tree_spec(body, config.staleness)  # feedback_combine: refused here if async
    endpoint = EndpointPlan.of(config, spark)  # None: the subtasks use Ray

    from .._cluster.ray_util import connect

    connect(address, namespace=NAMESPACE)
    checkpoint = bounded_checkpoint_spec(
        config,
        body,
        streams,
        variables,
        n,
        _alive_nodes(),
        warn=lambda w: log.warning("hybrid_iter: %s", w),
    )
    run_id = uuid.uuid4().hex[:12]
    name = f"hybrid_iter.{config.name or 'iteration'}.{run_id}"
    spec = CoordinatorSpec(
        num_subtasks=n,
        num_streams=len(streams),
        staleness=config.staleness,
        max_epochs=config.max_epochs,
        has_criteria=body.has_criteria,
        init_variables=variables,
        operators=coord_bytes,
        main_per_round=per_round,
        inline_limit=config.inline_variables_bytes,
        progress_tag=config.progress_tag,
        checkpoint=checkpoint,
        hooks=config.hooks,
        tree=tree,
        placement=coordinator_resources() if tree is not None else {},
    )
    plan = TaskPlan(
        ray_address=address,
        namespace=NAMESPACE,
        actor_name=name,
        run=name,
        operator=op_bytes,
        num_subtasks=n,
        numeric_columns=tuple(s.numeric_columns for s in streams.streams),
        staleness=config.staleness,
        has_criteria=body.has_criteria,
        replayed=streams.replayed,
        main_per_round=per_round,
        per_round_operator=round_bytes,
        tree=tree,
        hooks=config.hooks,
        call_timeout=float(config.call_timeout),
        checkpoint_every=checkpoint.every_epochs if checkpoint is not None else 0,
        max_epochs=config.max_epochs,
    )
    actor_cls = coordinator_kind(n, config.restarts if checkpoint is not None else 0)
    # what a spare coordinator imports ahead: the modules of this run's operators
    warm = sorted(
        {
            type(op).__module__
            for op in (body.coordinator, body.per_round_coordinator, *body.coordinator_listeners)
            if op is not None and type(op).__module__ != "__main__"
        }
    )
    #: what the result says of how the run went (``IterationResult``'s typed fields)
    facts: dict[str, Any] = {}
    run = RunController(
        config.restarts,
        checkpoint_uri=checkpoint.uri if checkpoint is not None else None,
        resume=config.resume_from is not None,
        expect=checkpoint.expect_epoch if checkpoint is not None else None,
    )
    # ``launched`` holds the creation arguments of the actor Ray may restart
    actor, actor_name, launched = None, name, None
    meter = bounded_meter(config.name or "iteration", run_id, config.mode)
    try:
        while run.state is not RunState.FINISHED:
            attempt = run.attempt
            actor, actor_name, launched = _coordinator_for(
                run, (actor, actor_name, launched), actor_cls, name, spec, checkpoint
            )
            run_plan = dataclasses.replace(
                plan,
                actor_name=actor_name,
                attempt=attempt,
                restore=run.restore,
                endpoint=endpoint.serve(actor) if endpoint is not None else None,
            )
            if attempt > 0:
                _wait_for_slots(spark, n, config, attempt, checkpoint, run.expect)
            monitor = _Monitor(actor, spark, name, config, n, attempt=attempt, meter=meter)
            run.running()
            try:
                if streams.any_replayed:
                    _run_rounds(monitor, run_plan, streams, n, facts)
                else:
                    stage = BarrierStage(
                        streams.dataframes,
                        n,
                        functools.partial(run_subtask, run_plan),
                        partitions=partitions[0],
                    )
                    monitor.run(stage.run)
                    facts["repartitioned"] = bool(stage.repartitioned)
                data = monitor.finish()
                facts["checkpoint"] = _call(actor, "checkpoint_info")
                run.finished()
            except BaseException as ex:
                run.checkpointed(monitor.checkpointed)
                decision = run.failed(ex)
                if decision.error is not None:
                    raise decision.error from ex
                if not decision.relaunch:
                    raise
                log.warning(
                    "hybrid_iter: attempt %d of %s failed (%s); relaunching from the newest "
                    "checkpoint (%s)",
                    attempt,
                    name,
                    str(ex).splitlines()[0],
                    decision.why,
                )
                if _restarted_by_ray(actor):
                    missing = run.restored(_restored_by(actor, run.expect))
                    if missing is not None:
                        raise _missing_failure(missing) from ex
                else:
                    kill(actor, f"the coordinator actor {name}")
                    actor = None
                    run.restored(None)  # a new coordinator checks what it restores
    except BaseException:
        run.abort()
        raise
    finally:
        meter.close(failed=run.state is not RunState.FINISHED)
        # after a run that ended well, a coordinator Ray never restarts waits as the
        # driver's spare for its next run (no process to start then); else it is killed
        # and a fresh spare started
        if actor is not None and not (
            run.state is RunState.FINISHED
            and checkpoint is None
            and retire_as_spare(actor_cls, actor, actor_name)
        ):
            kill(actor, f"the coordinator actor {name}")
        if checkpoint is None:
            keep_spare(actor_cls, warm)

    times = data.alignment_times
    return IterationResult(
        variables=data.variables,
        outputs=_group_outputs(data.outputs),
        output_records=data.outputs,
        epochs=data.epochs,
        terminated_by=data.terminated_by or "unknown",
        epoch_seconds=[b - a for a, b in itertools.pairwise(times)],
        subtask_epochs=data.subtask_epochs,
        feedback_counts=data.feedback_counts,
        rows=data.rows,
        num_partitions=n,
        mode=config.mode,
        seconds=time.perf_counter() - started,
        load_seconds=(times[0] - started_wall) if times else 0.0,
        attempts=tuple(run.failed_attempts),
        restores=tuple((r.found, r.expected) for r in run.restores),
        checkpoint=facts.get("checkpoint"),
        repartitioned=facts.get("repartitioned", False),
        publishes=data.publishes,
        object_store_puts=data.object_store_puts,
        replay=facts.get("replay"),
    )


def _coordinator_for(
    run: RunController,
    current: tuple[Any, str, Launched | None],
    actor_cls: Any,
    name: str,
    spec: CoordinatorSpec,
    checkpoint: CheckpointSpec | None,
) -> tuple[Any, str, Launched | None]:
    """The coordinator of ``run``'s next attempt: (handle, name, what holds its creation
    arguments). The ``current`` one when Ray restarted it (told to serve the attempt),
    else (its handle None) a spare or a new one."""
    attempt = run.attempt
    if current[0] is not None:  # restarted by Ray: it serves the next launch once told so
        _call(current[0], "begin_attempt", attempt)
        return current
    launch_spec = dataclasses.replace(
        spec,
        attempt=attempt,
        checkpoint=checkpoint
        and dataclasses.replace(checkpoint, restore=run.restore, expect_epoch=run.expect),
    )
    # a run Ray never restarts takes the driver's spare coordinator when there is one:
    # the previous run's, retired, or one started ahead
    spare = take_spare(actor_cls, "configure", launch_spec) if checkpoint is None else None
    if spare is not None:
        return (*spare, None)
    # the driver holds the spec (it can be megabytes of initial variables) for as long
    # as Ray may restart this actor from it; a new actor accepts this launch's calls
    # from its start: the Spark stage is submitted while its process starts (a failure
    # to start reaches the tasks and the monitor)
    actor_name = f"{name}.a{attempt}"
    launched = launch_held(actor_cls, actor_name, launch_spec)
    return launched.handle, actor_name, launched


def _call(actor: Any, method: str, *args: Any, timeout: float = 120.0) -> Any:
    import ray

    return ray.get(getattr(actor, method).remote(*args), timeout=timeout)


def _restarted_by_ray(actor: Any) -> bool:
    """True when Ray restarted the coordinator after its process died: it has reloaded
    the newest checkpoint and can serve the relaunched stage."""
    import ray

    deadline = time.monotonic() + 60
    while True:
        try:
            info = _call(actor, "checkpoint_info", timeout=120)
            return bool(info["reconstructed"]) and not _call(actor, "progress").failed
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)  # Ray is restarting it: poll the restart, bounded
        except Exception:
            return False  # dead for good (or never restartable)


def _restored_by(actor: Any, expect: int | None) -> RestoredCheckpoint:
    """What a coordinator Ray restarted restored, against the newest checkpoint the
    driver saw written (``expect``)."""
    info: CheckpointInfo = _call(actor, "checkpoint_info")
    restored = RestoredCheckpoint.of_info(info, expect)
    if restored.older and not restored.missing:
        log.warning(
            "hybrid_iter: the restarted coordinator restored checkpoint %s, older than "
            "checkpoint %s, whose files are damaged (%s)",
            restored.found,
            restored.expected,
            "; ".join(f"{p}: {w}" for p, w in restored.skipped),
        )
    return restored


def _missing_failure(error: MissingCheckpoint) -> IterationFailedError:
    """A restore that missed a written checkpoint, as the run's failure (final: the
    checkpoint path is not visible where the coordinator runs)."""
    message = str(error)
    failure = RemoteFailure(
        "coordinator", None, "restoring a checkpoint", "MissingCheckpoint", message, "", error
    )
    return IterationFailedError(message, {"coordinator": failure})


def _alive_nodes() -> int:
    try:
        return len(live_nodes())
    except Exception:  # cannot tell: assume one node (the check errs on the safe side below)
        return 1


def _run_rounds(
    monitor: _Monitor, plan: TaskPlan, streams: ReplayableDataStreamList, n: int, facts: dict
) -> None:
    """One barrier job per round over Spark's cache of the replayed streams."""
    replay = ReplayPlan(streams.dataframes, streams.replayed, n)
    try:
        batches = replay.prepare()
        facts["repartitioned"] = True
        rounds = 0
        while True:
            monitor.run(
                functools.partial(replay.run_round, rounds, functools.partial(run_round, plan)),
                round_=rounds,
            )
            rounds += 1
            if monitor.closed():
                break
        facts["replay"] = ReplayInfo(
            batches=batches,
            storage_level=str(replay.storage_level),
            memory_bytes=replay.memory_bytes,
            disk_bytes=replay.disk_bytes,
            rounds=rounds,
        )
    finally:
        replay.close()


class _Monitor:
    """Runs Spark jobs of one iteration on a thread while the driver shows progress."""

    def __init__(
        self,
        actor: Any,
        spark: Any,
        name: str,
        config: IterationConfig,
        n: int,
        *,
        attempt: int = 0,
        meter: RunMeter | None = None,
    ) -> None:
        self.actor, self.name, self.n = actor, name, n
        #: every Spark job of the iteration carries it; cancelling it stops them
        self.jobs_tag = JobTag(spark, name)
        self.call_timeout = float(config.call_timeout)
        self.printer = ProgressPrinter(config.progress, label=config.name or config.mode)
        self.attempt = attempt
        self.meter = meter or RunMeter(None)
        self.meter.set(attempt=attempt)
        self.describe = functools.partial(
            bounded_description, config.name or "iteration", config.mode, n, attempt
        )
        self.results: list[bytes] = []
        self.error: BaseException | None = None
        self.jobs = 0
        self._seen = -1
        #: the newest checkpoint the coordinator reported written
        self.checkpointed = -1

    def run(self, job: Any, round_: int | None = None) -> None:
        """Run ``job()`` (a Spark job returning the subtasks' summaries; of round
        ``round_`` of replayed streams) to its end."""
        import ray

        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                with self.jobs_tag.on_this_thread(self.describe(round_)):
                    outcome["results"] = job()
            except BaseException as ex:  # surfaced on the driver thread below
                outcome["error"] = ex
            finally:
                self.actor.wake.remote()  # end the progress poll now, not at its timeout

        thread = threading.Thread(target=target, name=f"{self.name}-job{self.jobs}", daemon=True)
        self.jobs += 1
        try:
            if (
                self.jobs > 1
                and ray.get(self.actor.progress.remote(), timeout=self.call_timeout).failed
            ):
                return  # the coordinator failed in an earlier round: no further job
            # the first job starts at once, while the coordinator's process may still be
            # starting: a coordinator that cannot start fails the tasks' first calls
            thread.start()
            answered = time.monotonic()
            while thread.is_alive():
                try:
                    p = ray.get(
                        # progress off: no poll per epoch, only at the end, a
                        # failure, a checkpoint (or every 0.5 s)
                        self.actor.wait_progress.remote(
                            self._seen, 0.5, self.printer.enabled, self.checkpointed
                        ),
                        timeout=min(30.0, self.call_timeout),
                    )
                    answered = time.monotonic()
                except ray.exceptions.GetTimeoutError:
                    self._check_stuck(time.monotonic() - answered)
                    continue
                except ray.exceptions.RayActorError as ex:
                    # the coordinator died: tasks cannot go on; stop them, report it
                    self.jobs_tag.cancel()
                    thread.join()
                    raise IterationFailedError(
                        f"the coordinator actor died: {str(ex).splitlines()[0]}", {}
                    ) from ex
                self.printer.update(p)
                self.meter.progress(p, attempt=self.attempt)
                self._seen = p.aligned
                self.checkpointed = max(self.checkpointed, p.checkpointed)
                if p.failed:
                    self.jobs_tag.cancel()  # tasks stuck in user code must not hang us
                if p.done or p.failed:
                    thread.join()
            thread.join()
        except BaseException:
            if thread.is_alive():
                self.jobs_tag.cancel()
                thread.join(timeout=30)
            raise
        self.results = outcome.get("results", [])
        if "error" in outcome:
            self.error = outcome["error"]
            self._raise_if_failed()

    def _check_stuck(self, silent: float) -> None:
        """The coordinator did not answer a progress poll: ask (on its ``watch`` thread)
        whether a coordinator operator is stuck; fail the run past ``call_timeout``."""
        import ray

        try:
            busy = ray.get(self.actor.busy.options(concurrency_group="watch").remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            busy = None
        if busy is not None and busy[2] >= self.call_timeout:
            label, epoch, seconds = busy
            message = (
                f"the coordinator operator made no progress for {seconds:.0f} s in {label} at "
                f"epoch {epoch} (IterationConfig(call_timeout={self.call_timeout:g})): a "
                f"callback that blocks, or one that needs a larger call_timeout"
            )
        elif silent >= self.call_timeout + 60:
            message = (
                f"the coordinator actor did not answer for {silent:.0f} s "
                f"(IterationConfig(call_timeout={self.call_timeout:g}))"
            )
        else:
            return
        self.jobs_tag.cancel()
        failure = RemoteFailure(
            "coordinator",
            busy[1] if busy else None,
            busy[0] if busy else "coordinator actor",
            "CallTimeout",
            message,
            "",
            CallTimeout(message),
        )
        raise IterationFailedError(f"the iteration failed: {message}", {"coordinator": failure})

    def closed(self) -> bool:
        import ray

        p = ray.get(self.actor.progress.remote())
        if p.failed:
            self._raise_if_failed()
        return bool(p.done)

    def _raise_if_failed(self) -> None:
        import ray

        data = ray.get(self.actor.result.remote())
        if data.failures:
            _raise_failures(data.failures, self.error)
        if self.error is not None:
            died = _worker_died(self.error)
            if died is not None:
                raise died from self.error
            endpoint = _endpoint_failure(self.error)
            if endpoint is not None:  # no subtask reached the coordinator to report it
                raise IterationFailedError(
                    f"the iteration failed: a subtask could not use its coordinator: "
                    f"{endpoint} (Spark's whole report is this error's cause)",
                    {},
                ) from self.error
            raise IterationFailedError(
                f"the Spark stage of the iteration failed: {self.error}", {}
            ) from self.error

    def finish(self) -> Any:
        """The coordinator's result, after the last job; raises what went wrong."""
        import ray

        try:
            data = ray.get(self.actor.result.remote())
        except ray.exceptions.RayTaskError:
            # an output that does not pickle cannot travel here: name it, not Ray's trace
            unpicklable = ray.get(self.actor.unpicklable_output.remote())
            if unpicklable is None:
                raise
            _raise_failures([unpicklable], None)
        final = ray.get(self.actor.progress.remote())
        self.printer.update(final, final=True)
        self.meter.progress(final, attempt=self.attempt)
        if data.failures:
            _raise_failures(data.failures, self.error)
        ran = len(self.results)
        if ran == 0 and data.terminated_by is None:
            # Spark planned no task at all: its optimizer found every input empty
            raise DataValidationError(
                "the data streams have no rows (Spark ran no task over them); an iteration "
                "needs data: check the DataFrames' filters or sources"
            )
        if ran != self.n or data.terminated_by is None:
            raise IterationFailedError(
                f"the iteration's Spark stage ended with {ran} of {self.n} subtasks and the "
                f"coordinator {'terminated' if data.terminated_by else 'not terminated'}",
                {},
            )
        return data


def _group_outputs(records: list[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for r in records:
        grouped.setdefault(r.tag, []).append(r.value)
    return grouped
