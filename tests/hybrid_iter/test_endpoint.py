"""The coordinator endpoint: subtasks that reach their coordinator without Ray.

The same iterations run over both transports (``IterationConfig(transport=...)``) on
real Spark and Ray and give the same results: sync bit for bit, async, termination,
large variables, checkpoint and restore after an injected fault and after a SIGKILLed
Spark worker. Bad input (an unreachable address, a wrong token, another protocol
version) is a clear error naming the address and the fix. The endpoint's own pieces
(variables streamed once per version per process, TLS) run against the real coordinator
in this process, without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
from checkpoint_job import DIMS, Step
from hypothesis import given, settings
from hypothesis import strategies as st
from ops import GradientDescent, LinRegPartition, Recorder, RecordingCoordinator, make_regression
from test_recovery import CopyingGrad, CountingGrad, _kill_when_written

import coordinator._endpoint as endpoint
import coordinator._shared_versions as shared_versions
import hybrid_iter as hi
from coordinator import CoordinatorSpec, IterationCoordinator
from coordinator._endpoint import VERSIONS, FlightLink
from coordinator._flight import PROTOCOL_VERSION, EndpointAddress, EndpointSpec, FlightServing
from hybrid_iter._runtime.task import TaskPlan, run_subtask
from hybrid_iter.testing import FaultInjection

FEATURES = ["x0", "x1", "x2", "x3"]
TRANSPORTS = ["ray", "endpoint"]


@pytest.fixture(scope="module")
def regression(spark):
    return make_regression(spark, rows=1200, dims=4, partitions=2)


def _iterate(init, df, body, **config):
    return hi.iterate_bounded_streams_until_termination(
        init, hi.ReplayableDataStreamList.not_replay(df), hi.IterationConfig(**config), body
    )


def both(fn):
    """``fn(transport)`` over Ray and over the endpoint."""
    return {t: fn(t) for t in TRANSPORTS}


# -- the same results over both transports ------------------------------------------------


def test_sync_gives_the_same_variables_and_losses_bit_for_bit(spark, regression):
    df, X, y = regression
    got = both(
        lambda t: _iterate(
            {"w": np.zeros(4), "b": 0.0},
            df,
            hi.IterationBody(
                LinRegPartition(FEATURES),
                GradientDescent(lr=0.3, total_rows=len(y), intercept=True),
            ),
            max_epochs=12,
            parallelism=2,
            transport=t,
        )
    )
    ray, ep = got["ray"], got["endpoint"]
    assert ep.terminated_by == ray.terminated_by == "max_epochs"
    assert ep.epochs == ray.epochs == 12
    assert ep.variables["w"].tobytes() == ray.variables["w"].tobytes()
    assert float(ep.variables["b"]) == float(ray.variables["b"])
    assert ep.outputs["loss"] == ray.outputs["loss"]
    assert ep.rows == ray.rows and ep.feedback_counts == ray.feedback_counts


def test_async_runs_every_epoch_and_converges_alike(spark, regression):
    df, X, y = regression
    got = both(
        lambda t: _iterate(
            {"w": np.zeros(4)},
            df,
            hi.IterationBody(LinRegPartition(FEATURES), GradientDescent(lr=0.5, total_rows=len(y))),
            staleness=None,
            max_epochs=30,
            parallelism=2,
            transport=t,
        )
    )
    ray, ep = got["ray"], got["endpoint"]
    assert ep.terminated_by == ray.terminated_by == "max_epochs"
    assert ep.subtask_epochs == ray.subtask_epochs == {0: 30, 1: 30}
    assert ep.feedback_counts == ray.feedback_counts
    # async: the order feedback arrives in differs from run to run, the optimum does not
    truth = np.linalg.lstsq(X, y, rcond=None)[0]
    for r in (ray, ep):
        np.testing.assert_allclose(r.variables["w"], truth, atol=0.05)


def test_termination_and_every_callback_are_the_same(spark):
    df = spark.range(40, numPartitions=2)
    got = both(
        lambda t: _iterate(
            {"version": 0},
            df,
            hi.IterationBody(Recorder(criteria_until=3), RecordingCoordinator(), criteria=True),
            parallelism=2,
            max_epochs=50,
            transport=t,
        )
    )
    ray, ep = got["ray"], got["endpoint"]
    assert ep.terminated_by == ray.terminated_by == "criteria"
    assert ep.epochs == ray.epochs == 4
    assert sorted(ep.outputs["event"]) == sorted(ray.outputs["event"])
    assert ep.outputs["coord"] == ray.outputs["coord"]


class ReadsBig(hi.PartitionOperator):
    """Reads every version of a large variable; outputs what it saw and how many large
    versions its process streamed."""

    def open(self, ctx):
        self.seen = []

    def process_data(self, stream, batch, ctx, out):
        pass

    def process_variables(self, variables, ctx, out):
        big, m = variables["big"], variables["m"]
        self.seen.append(
            (
                float(big.sum()),
                big.dtype.str,
                big.shape,
                m.dtype.str,
                m.shape,
                float(variables["s"]),
                variables["s"].shape,
                big.flags.writeable,
            )
        )

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1)

    def on_iteration_terminated(self, ctx, out):
        from coordinator._endpoint import VERSIONS  # this worker's, not the driver's

        out.output("seen", (ctx.partition_id, self.seen))
        out.output("fetched", (ctx.partition_id, os.getpid(), VERSIONS.fetched, VERSIONS.mapped))


class PublishesBig(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.big = np.array(init_variables["big"])

    def process_feedback(self, value, ctx, out):
        pass

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.big = self.big + 1.0
        out.publish_variables(big=self.big, m=np.full((3, 5), epoch, np.int32), s=epoch * 0.5)


BIG = 200_000  # 1.6 MB: past the inline limit, streamed over the endpoint


def test_large_variables_reach_every_subtask_alike_read_only_and_streamed_once(spark):
    df = spark.range(20, numPartitions=2)
    init = {"big": np.arange(BIG, dtype=np.float64), "m": np.zeros((3, 5), np.int32), "s": 0.0}
    got = both(
        lambda t: _iterate(
            init,
            df,
            hi.IterationBody(ReadsBig(), PublishesBig()),
            parallelism=2,
            max_epochs=4,
            transport=t,
        )
    )
    ray, ep = got["ray"], got["endpoint"]
    assert sorted(ep.outputs["seen"]) == sorted(ray.outputs["seen"])
    for _pid, seen in ep.outputs["seen"]:
        assert len(seen) == 5  # versions 0..4
        assert all(not writeable for *_, writeable in seen)
        assert {(s[1], s[2], s[3], s[4], s[6]) for s in seen} == {
            ("<f8", (BIG,), "<i4", (3, 5), ())
        }
    # each Python worker read each large version once (a reused worker counts on), and
    # on the coordinator's host mapped it from the server's shared-memory file
    for _pid, _process, fetched, mapped in ep.outputs["fetched"]:
        assert 5 <= fetched and fetched % 5 == 0
        assert mapped == fetched
    assert ep.variables["big"].tobytes() == ray.variables["big"].tobytes()


class SumsBig(hi.PartitionOperator):
    """Keeps the newest large version and reads all of it at every watermark: the pages
    a mapping of a file cut short would fault on."""

    def open(self, ctx):
        self.big = None

    def process_data(self, stream, batch, ctx, out):
        pass

    def process_variables(self, variables, ctx, out):
        self.big = variables["big"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("sum", (ctx.partition_id, epoch, float(self.big.sum())))
        out.feedback(1)


def _tamper_when_paused(directory, tried: dict) -> threading.Thread:
    """From outside the paused Spark worker, as a cleaner of ``/dev/shm`` or another
    process of the user would: overwrite, then truncate, every variables file the worker
    holds open; record each attempt's outcome (errno or "done"), then release it."""

    def target() -> None:
        marker = directory / "pid-0"
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polls a file the worker writes, bounded
        pid = int(marker.read_text())
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if "hi-vars-" not in os.readlink(path):
                    continue
            except OSError:
                continue

            def overwrite(path=path):
                with open(path, "r+b") as f:
                    f.seek(4096)
                    f.write(b"\0" * 4096)

            for what, act in (("write", overwrite), ("truncate", lambda p=path: os.truncate(p, 0))):
                try:
                    act()
                    tried[(fd, what)] = "done"
                except OSError as ex:
                    tried[(fd, what)] = ex.errno
        (directory / "release-0").write_text("")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_version_file_cannot_be_cut_short_or_changed_under_its_reader(spark, tmp_path):
    """A file in /dev/shm that is truncated under a mapping kills its reader with
    SIGBUS on the next access, and one overwritten changes the reader's variables; the
    sealed memory file refuses both, for anyone, so the run ends with the right values."""
    import errno

    from hybrid_iter.testing import PauseWorker

    df = spark.range(20, numPartitions=2)
    init = {"big": np.arange(BIG, dtype=np.float64), "m": np.zeros((3, 5), np.int32), "s": 0.0}
    tried: dict = {}
    tamper = _tamper_when_paused(tmp_path, tried)
    try:
        result = _iterate(
            init,
            df,
            hi.IterationBody(SumsBig(), PublishesBig()),
            parallelism=2,
            max_epochs=4,
            transport="endpoint",
            hooks=PauseWorker(directory=str(tmp_path), partition=0, at_epoch=2),
        )
    finally:
        tamper.join(300)
    assert tried, "the paused worker mapped no variables file"
    assert set(tried.values()) == {errno.EPERM}, tried
    base = float(np.arange(BIG, dtype=np.float64).sum())
    sums = sorted(result.outputs["sum"])
    assert sums == sorted((p, e, base + e * BIG) for p in range(2) for e in range(4))


@pytest.fixture(scope="module")
def ck_df(spark):
    from checkpoint_job import data

    frame = data(spark).cache()
    frame.count()
    return frame


def _ck_run(df, partition, coordinator=None, **config):
    return _iterate(
        {"w": np.zeros(DIMS)},
        df,
        hi.IterationBody(partition, coordinator or Step()),
        **{"max_epochs": 24, "parallelism": 2, **config},
    )


@pytest.fixture(scope="module")
def clean(ck_df):
    return _ck_run(ck_df, CopyingGrad(), transport="ray")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_injected_fault_is_restored_from_a_checkpoint_bit_for_bit(
    ck_df, clean, tmp_path, transport
):
    faulty = _ck_run(
        ck_df,
        CopyingGrad(),
        checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=4),
        hooks=FaultInjection(fail_partition=0, at_epoch=14),
        transport=transport,
    )
    assert len(faulty.attempts) == 1
    assert faulty.checkpoint["restored_from"].endswith("chk-0000000012.ckpt")
    assert faulty.variables["w"].tobytes() == clean.variables["w"].tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sigkilled_spark_worker_is_recovered_bit_for_bit(ck_df, tmp_path, transport):
    reference = _ck_run(ck_df, CountingGrad(), transport="ray")
    marker, done = tmp_path / "worker.pid", threading.Event()
    killer = _kill_when_written(marker, done)
    try:
        faulty = _ck_run(
            ck_df,
            CountingGrad(str(marker), block_at=11),
            checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=5),
            transport=transport,
        )
    finally:
        done.set()
        killer.join()
    assert marker.exists()
    assert len(faulty.attempts) == 1
    assert faulty.checkpoint["restored_from"].endswith("chk-0000000010.ckpt")
    assert faulty.variables["w"].tobytes() == reference.variables["w"].tobytes()


# -- bad input ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_endpoint_fails_the_run_naming_the_address(spark):
    df = spark.range(10, numPartitions=2)
    where = f"127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(hi.IterationFailedError) as info:
        _iterate(
            {"version": 0},
            df,
            hi.IterationBody(Recorder(), RecordingCoordinator()),
            parallelism=2,
            max_epochs=2,
            transport="endpoint",
            endpoint=hi.EndpointConfig(advertise=where, connect_timeout=5),
        )
    text = str(info.value)
    assert f"coordinator endpoint at {where} cannot be reached" in text
    assert "advertise" in text


def test_bad_endpoint_settings_are_refused_before_any_job(tmp_path):
    with pytest.raises(hi.IterationConfigError, match="transport must be one of"):
        hi.IterationConfig(transport="grpc")
    with pytest.raises(hi.IterationConfigError, match="'host:port'"):
        hi.EndpointConfig(bind="localhost")
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(hi.IterationConfigError, match="tls_cert and tls_key go together"):
        hi.EndpointConfig(tls_cert=str(cert))
    with pytest.raises(hi.IterationConfigError, match="path of a PEM file"):
        hi.EndpointConfig(tls_cert=str(cert), tls_key=str(tmp_path / "missing.pem"))
    with pytest.raises(hi.IterationConfigError, match="endpoint must be an EndpointConfig"):
        hi.IterationConfig(endpoint={"bind": "127.0.0.1:0"})
    with pytest.raises(hi.IterationConfigError, match="shared_memory must be True or False"):
        hi.EndpointConfig(shared_memory="yes")


def _no_job_may_run(spark):
    """A DataFrame whose rows fail if any Spark job reads them: a refusal raised with it
    came before any job."""

    def boom(batches):
        raise RuntimeError("a Spark job ran")
        yield  # pragma: no cover

    return spark.range(4, numPartitions=2).mapInArrow(boom, "id long")


@pytest.mark.parametrize(
    ("token", "position", "code"),
    [
        ("Zq9s3cret\nvalue", 10, "U+000A"),
        ("Zq9p\u00e4ssword", 5, "U+00E4"),
        ("Zq9tab\there", 7, "U+0009"),
        ("Zq9token\x7f", 9, "U+007F"),
    ],
)
def test_a_token_grpc_cannot_carry_is_refused_naming_the_character_not_the_token(
    token, position, code
):
    with pytest.raises(hi.IterationConfigError) as info:
        hi.EndpointConfig(token=token)
    text = str(info.value)
    assert "EndpointConfig.token" in text and f"character {position} of {len(token)}" in text
    assert code in text and "printable ASCII" in text and "token_hex" in text
    assert "Zq9" not in text  # nothing of the secret


def test_the_token_rule_is_the_one_grpc_applies():
    """What the config accepts the endpoint carries (spaces and '~' included); what it
    refuses, a subtask's first call fails on, named, not as a raw Flight error."""
    for token in (" lead", "trail ", "a b~c", secrets_token()):
        hi.EndpointConfig(token=token)
        with _served(EndpointSpec(bind="127.0.0.1:0", token=token), size=10) as (_c, location):
            FlightLink(EndpointAddress(location, token, connect_timeout=10)).close()
    with _served(EndpointSpec(bind="127.0.0.1:0", token="right"), size=10) as (_c, location):
        with pytest.raises(
            hi.EndpointError, match=r"token cannot be sent: its character 2 of 3 is U\+000A"
        ):
            FlightLink(EndpointAddress(location, "a\nb", connect_timeout=10))


def secrets_token() -> str:
    import secrets

    return secrets.token_hex(32)


def test_a_bad_token_in_the_environment_variable_is_refused_before_any_job(spark, monkeypatch):
    from hybrid_iter._runtime.endpoint import TOKEN_ENV

    monkeypatch.setenv(TOKEN_ENV, "s3cr\u00e9t-from-a-secret\n")  # the newline is stripped
    with pytest.raises(hi.IterationConfigError) as info:
        _iterate(
            {"version": 0},
            _no_job_may_run(spark),
            hi.IterationBody(Recorder(), RecordingCoordinator()),
            parallelism=2,
            max_epochs=2,
            transport="endpoint",
        )
    text = str(info.value)
    assert f"the environment variable {TOKEN_ENV}" in text
    assert "character 5 of 20 is U+00E9 (not ASCII)" in text and "s3cr" not in text


def _pem_files(tmp_path):
    """The files a TLS setup can get wrong, on disk."""
    from cryptography.hazmat.primitives import serialization

    cert, key = _self_signed(tmp_path)
    _other_cert, other_key = _self_signed(tmp_path)
    k = serialization.load_pem_private_key(key, None)
    files = {
        "cert.pem": cert,
        "key.pem": key,
        "other-key.pem": other_key,
        "key.der": k.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        "key-encrypted.pem": k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        ),
        "notes.txt": b"the certificate is on the wiki\n",
        "broken.pem": b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


@pytest.mark.parametrize(
    ("cert", "key", "roots", "named", "says"),
    [
        ("notes.txt", "key.pem", None, "tls_cert", "text without a PEM block"),
        ("key.pem", "cert.pem", None, "tls_cert", "tls_cert and tls_key swapped"),
        ("broken.pem", "key.pem", None, "tls_cert", "not a readable certificate"),
        ("cert.pem", "key.der", None, "tls_key", "binary (DER?): convert it to PEM (openssl pkey"),
        ("cert.pem", "key-encrypted.pem", None, "tls_key", "encrypted private key"),
        ("cert.pem", "other-key.pem", None, "tls_key", "is not the private key of the certificate"),
        ("cert.pem", "key.pem", "key.pem", "tls_root_certs", "PEM of something else (PRIVATE KEY)"),
    ],
)
def test_tls_files_that_are_not_pem_are_refused_naming_the_file(
    tmp_path, cert, key, roots, named, says
):
    from hybrid_iter._runtime.endpoint import EndpointPlan

    d = _pem_files(tmp_path)
    tls = hi.EndpointConfig(
        tls_cert=str(d / cert),
        tls_key=str(d / key),
        tls_root_certs=str(d / roots) if roots else None,
    )
    with pytest.raises(hi.IterationConfigError) as info:
        EndpointPlan.of(hi.IterationConfig(transport="endpoint", endpoint=tls), None)
    text = str(info.value)
    given = {"tls_cert": cert, "tls_key": key, "tls_root_certs": roots}[named]
    assert f"EndpointConfig.{named} {str(d / given)!r}" in text and says in text
    assert "port" not in text


def test_a_tls_key_that_is_not_pem_fails_the_run_before_any_job_not_as_a_bind_failure(
    spark, tmp_path
):
    d = _pem_files(tmp_path)
    with pytest.raises(hi.IterationConfigError) as info:
        _iterate(
            {"version": 0},
            _no_job_may_run(spark),
            hi.IterationBody(Recorder(), RecordingCoordinator()),
            parallelism=2,
            max_epochs=2,
            transport="endpoint",
            endpoint=hi.EndpointConfig(tls_cert=str(d / "cert.pem"), tls_key=str(d / "key.der")),
        )
    assert "EndpointConfig.tls_key" in str(info.value) and "free port" not in str(info.value)


def test_a_taken_port_fails_the_run_naming_the_port_with_the_cause_chained(spark):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(hi.SessionError) as info:
            _iterate(
                {"version": 0},
                spark.range(4, numPartitions=2),
                hi.IterationBody(Recorder(), RecordingCoordinator()),
                parallelism=2,
                max_epochs=2,
                transport="endpoint",
                endpoint=hi.EndpointConfig(bind=f"127.0.0.1:{port}"),
            )
    text = str(info.value)
    assert f"on 127.0.0.1:{port}" in text and f"port {port} is in use" in text
    assert isinstance(info.value.__cause__, hi.EndpointBindError)


def test_a_server_that_does_not_start_names_the_cause_it_finds_not_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(hi.EndpointBindError, match=f"port {port} is in use there"):
            FlightServing(EndpointSpec(bind=f"127.0.0.1:{port}", token="t"))
    with pytest.raises(hi.EndpointBindError, match="is not an address of the node"):
        FlightServing(EndpointSpec(bind="192.0.2.1:0", token="t"))  # TEST-NET-1
    with pytest.raises(hi.EndpointBindError, match="does not resolve") as info:
        FlightServing(EndpointSpec(bind="no-such-host.invalid:0", token="t"))
    # bytes gRPC refuses as a certificate (the driver checks the files first)
    garbage = EndpointSpec(bind="127.0.0.1:0", token="t", tls_cert=b"x", tls_key=b"y")
    with pytest.raises(hi.EndpointBindError) as info:
        FlightServing(garbage)
    text = str(info.value)
    assert "the cause is not the port" in text and "TLS certificate or key" in text
    assert "free port" not in text and info.value.__cause__ is not None


# -- the endpoint against the real coordinator in this process (no Ray) -------------------

N = 2
EPOCHS = 4


class Reader(hi.PartitionOperator):
    """A partition operator that feeds back what it read of the variables."""

    def open(self, ctx):
        pass

    def process_data(self, stream, batch, ctx, out):
        pass

    def process_variables(self, variables, ctx, out):
        self.v = variables["v"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(float(self.v.sum()))

    def close(self):
        pass


class Bump(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.v = np.array(init_variables["v"])

    def process_feedback(self, value, ctx, out):
        out.output("read", (ctx.epoch, value))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.v = self.v + 1.0
        out.publish_variables(v=self.v)


@contextmanager
def _served(spec: EndpointSpec, size: int = 50_000) -> Iterator[tuple[IterationCoordinator, str]]:
    """A real coordinator on a loop thread of this process, served on ``spec``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    coord = IterationCoordinator(
        CoordinatorSpec(
            num_subtasks=N,
            num_streams=1,
            staleness=0,
            max_epochs=EPOCHS,
            has_criteria=False,
            init_variables={"v": np.zeros(size)},
            operators=cloudpickle.dumps((Bump(), None, [])),
            attempt=0,
        )
    )
    try:
        location = asyncio.run_coroutine_threadsafe(coord.serve_endpoint(spec), loop).result(60)
        yield coord, location
    finally:
        coord.close_endpoint()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _run_stage(link_of) -> dict[int, Exception | None]:
    plan = TaskPlan(
        ray_address="",
        namespace="",
        actor_name="in-process",
        operator=cloudpickle.dumps(Reader()),
        num_subtasks=N,
        numeric_columns=(None,),
        staleness=0,
        has_criteria=False,
        max_epochs=EPOCHS,
    )
    batch = pa.record_batch({"x": pa.array([1.0])})
    outcome: dict[int, Exception | None] = {}

    def subtask(pid: int) -> None:
        try:
            run_subtask(plan, pid, iter([(0, batch)]), link_of())
            outcome[pid] = None
        except Exception as ex:
            outcome[pid] = ex

    threads = [threading.Thread(target=subtask, args=(p,)) for p in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a subtask hangs"
    return outcome


@pytest.mark.parametrize("shared", [True, False], ids=["mapped", "streamed"])
def test_subtasks_of_one_process_read_each_large_version_once(shared):
    spec = EndpointSpec(bind="127.0.0.1:0", token="secret", shared_memory=shared)
    with _served(spec) as (coord, location):
        fetched, mapped = VERSIONS.fetched, VERSIONS.mapped
        outcome = _run_stage(lambda: FlightLink(EndpointAddress(location, "secret")))
        assert outcome == {0: None, 1: None}
        result = coord.result()
        # the newest versions and the spares to write again: a bounded set of files
        assert 0 < len(_files_of(os.getpid())) <= 4 if shared else not _files_of(os.getpid())
    assert not _files_of(os.getpid())  # the run's end removed them
    assert result.epochs == EPOCHS and not result.failures
    # versions 0..EPOCHS, each read by both subtasks, read once: mapped on this host
    assert VERSIONS.fetched - fetched == EPOCHS + 1
    assert VERSIONS.mapped - mapped == (EPOCHS + 1 if shared else 0)
    reads = sorted(v for _tag, v in ((r.tag, r.value) for r in result.outputs))
    assert reads == sorted((e, float(e) * 50_000) for e in range(EPOCHS) for _ in range(N))


def test_a_full_shared_memory_streams_the_versions_instead(monkeypatch):
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_versions.os, "posix_fallocate", full)
    spec = EndpointSpec(bind="127.0.0.1:0", token="t")
    with _served(spec) as (coord, location):
        fetched, mapped = VERSIONS.fetched, VERSIONS.mapped
        outcome = _run_stage(lambda: FlightLink(EndpointAddress(location, "t")))
        assert outcome == {0: None, 1: None}
        result = coord.result()
        assert not _files_of(os.getpid())
    assert result.epochs == EPOCHS and not result.failures
    assert VERSIONS.fetched - fetched == EPOCHS + 1 and VERSIONS.mapped == mapped
    reads = sorted(r.value for r in result.outputs)
    assert reads == sorted((e, float(e) * 50_000) for e in range(EPOCHS) for _ in range(N))


def _files_of(pid: int) -> set[int]:
    """The version files (inodes) the server of process ``pid`` holds: open for writing
    (a reader's are open read-only)."""
    held = set()
    for fd in shared_versions.files_of(pid):
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        if flags & os.O_ACCMODE == os.O_RDWR:
            held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return held


def test_a_wrong_token_is_refused_naming_the_address_and_the_fix():
    with _served(EndpointSpec(bind="127.0.0.1:0", token="right")) as (_coord, location):
        with pytest.raises(hi.EndpointAuthError) as info:
            FlightLink(EndpointAddress(location, "wrong", connect_timeout=10))
    where = location.split("://")[1]
    assert f"endpoint at {where} refused this subtask's token" in str(info.value)
    assert "EndpointConfig(token=...)" in str(info.value)


def test_another_protocol_version_is_refused_naming_both():
    with _served(EndpointSpec(bind="127.0.0.1:0", token="t")) as (_coord, location):
        with pytest.raises(hi.EndpointVersionMismatch) as info:
            FlightLink(EndpointAddress(location, "t", connect_timeout=10), _protocol=99)
    text = str(info.value)
    assert f"client 99, coordinator {PROTOCOL_VERSION}" in text
    assert location.split("://")[1] in text and "same hybrid_iter" in text


def test_a_closed_port_is_unreachable_within_the_connect_timeout():
    where = f"127.0.0.1:{_free_port()}"
    with pytest.raises(hi.EndpointError, match=f"endpoint at {where} cannot be reached within 3 s"):
        FlightLink(EndpointAddress(f"grpc+tcp://{where}", "t", connect_timeout=3))


def _self_signed(tmp_path, host: str = "127.0.0.1") -> tuple[bytes, bytes]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hybrid-iter-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem


def test_tls_serves_subtasks_that_trust_the_certificate_and_refuses_others(tmp_path):
    cert, key = _self_signed(tmp_path)
    other, _ = _self_signed(tmp_path)
    spec = EndpointSpec(bind="127.0.0.1:0", token="t", tls_cert=cert, tls_key=key)
    with _served(spec, size=10) as (coord, location):
        assert location.startswith("grpc+tls://")
        outcome = _run_stage(lambda: FlightLink(EndpointAddress(location, "t", cert)))
        assert outcome == {0: None, 1: None}
        assert coord.result().epochs == EPOCHS
        with pytest.raises(hi.EndpointError, match="TLS on both sides"):
            FlightLink(EndpointAddress(location, "t", other, connect_timeout=5))
        plain = location.replace("grpc+tls", "grpc+tcp")
        with pytest.raises(hi.EndpointError, match="cannot be reached"):
            FlightLink(EndpointAddress(plain, "t", connect_timeout=5))


def test_a_tls_iteration_on_spark_and_ray_gives_the_ray_result(spark, regression, tmp_path):
    df, X, y = regression
    cert, key = _self_signed(tmp_path)
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(key)
    tls = hi.EndpointConfig(
        bind="127.0.0.1:0", tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem")
    )

    def run(transport, endpoint=None):
        return _iterate(
            {"w": np.zeros(4)},
            df,
            hi.IterationBody(LinRegPartition(FEATURES), GradientDescent(0.3, len(y))),
            max_epochs=6,
            parallelism=2,
            transport=transport,
            endpoint=endpoint,
        )

    assert run("endpoint", tls).variables["w"].tobytes() == run("ray").variables["w"].tobytes()


# -- the variables codec -------------------------------------------------------------------

DTYPES = ["<f8", ">f8", "<f4", "<i8", "<i4", "|i1", "|u1", "|b1", "<c16", "<u2"]
#: one version's variables: (dtype, shape, seed) each
ARRAYS = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 5), min_size=0, max_size=3),
        st.integers(0, 2**32 - 1),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(
    arrays=ARRAYS,
    chunk=st.integers(1, 64),
)
def test_streamed_variables_come_back_equal_and_read_only(arrays, chunk):
    values = {}
    for i, (dtype, shape, seed) in enumerate(arrays):
        raw = np.random.default_rng(seed).integers(
            0, 256, int(np.prod(shape, dtype=int)) * np.dtype(dtype).itemsize, dtype=np.uint8
        )
        values[f"v{i}"] = raw.view(np.dtype(dtype)).reshape(shape)
    layout = tuple((n, a.dtype.str, tuple(a.shape), a.nbytes) for n, a in values.items())
    ref = endpoint.EndpointRef("server", 3, layout)
    saved = endpoint._CHUNK
    endpoint._CHUNK = chunk  # small chunks: variables split over several
    try:
        pieces = [endpoint._piece(b) for b in endpoint._chunks(ref, values)]
    finally:
        endpoint._CHUNK = saved
    got = endpoint.assemble(ref, pieces)
    assert list(got) == list(values)
    for name, arr in values.items():
        back = got[name]
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert back.tobytes() == arr.tobytes()
        assert not back.flags.writeable
    if pieces:
        with pytest.raises(ValueError):
            endpoint.assemble(ref, pieces[:-1])


def test_a_variable_larger_than_a_chunk_is_streamed_whole():
    spec = EndpointSpec(bind="127.0.0.1:0", token="s")
    with _served(spec, size=700_000) as (coord, location):  # 5.6 MB: 3 chunks
        link = FlightLink(EndpointAddress(location, "s"))
        payload = link.variables(-1).result(60)
        values = link.resolve(payload)
        assert values["v"].shape == (700_000,) and not values["v"].flags.writeable
        assert values["v"].tobytes() == coord.store.values["v"].tobytes()
        link.close()


# -- the shared-memory version files -------------------------------------------------------


def _variables(arrays) -> dict[str, np.ndarray]:
    """Arrays of any dtype and shape (0-d, empty), every other one not contiguous."""
    values = {}
    for i, (dtype, shape, seed) in enumerate(arrays):
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=int))
        raw = np.random.default_rng(seed).integers(0, 256, 2 * n * dt.itemsize, dtype=np.uint8)
        whole = raw.view(dt)
        values[f"v{i}"] = (whole[::2] if i % 2 else whole[:n]).reshape(shape)
    return values


def _ref(values, version: int = 1, server: str = "s" * 32) -> endpoint.EndpointRef:
    layout = tuple((n, a.dtype.str, tuple(a.shape), a.nbytes) for n, a in values.items())
    return endpoint.EndpointRef(server, version, layout)


@settings(max_examples=40, deadline=None)
@given(arrays=ARRAYS)
def test_a_version_file_maps_back_bit_for_bit_read_only(arrays):
    files = shared_versions.SharedFiles("s" * 32)
    values = _variables(arrays)
    ref = _ref(values)
    where = files.write(ref, values)
    assert where is not None
    ref = dataclasses.replace(ref, shared=where)
    got = shared_versions.map_version(ref)
    assert got is not None and list(got) == list(values)
    for n, arr in values.items():
        back = got[n]
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert back.tobytes() == arr.tobytes()
        assert not back.flags.writeable
        assert back.ctypes.data % back.dtype.alignment == 0
    assert os.stat(_proc(where)).st_mode & 0o777 == 0o600
    files.remove_all()
    assert not _files_of(os.getpid())  # closed (a reader's mapping keeps only its memory)


def _proc(where: str) -> str:
    pid, fd = where.split("/")
    return f"/proc/{pid}/fd/{fd}"


def test_a_version_a_reader_maps_is_never_written_over():
    """Newer versions go to other files while a reader maps an old one; once it lets go,
    its file is written again (no new memory per version)."""
    files = shared_versions.SharedFiles("s" * 32)

    def publish(version):
        values = {"w": np.full(1000, float(version)), "k": np.int64(version)}
        ref = _ref(values, version)
        return dataclasses.replace(ref, shared=files.write(ref, values))

    held = shared_versions.map_version(publish(1))
    assert held is not None
    created = set()
    for version in range(2, 12):
        ref = publish(version)
        created |= _files_of(os.getpid())
        got = shared_versions.map_version(ref)
        assert got is not None and float(got["w"][0]) == version and int(got["k"]) == version
        del got
    assert held["w"].tobytes() == np.full(1000, 1.0).tobytes() and int(held["k"]) == 1
    # a bounded set of files written again, not one per version
    assert len(_files_of(os.getpid())) <= shared_versions.LINKED + shared_versions.SPARES
    assert len(created) <= shared_versions.LINKED + shared_versions.SPARES + 1
    # a version whose file was written again since is not mapped (it is streamed instead)
    assert shared_versions.map_version(publish(12)) is not None
    assert shared_versions.map_version(dataclasses.replace(ref, version=3)) is None
    files.remove_all()


def test_a_file_that_is_not_the_versions_own_is_not_mapped(tmp_path):
    files = shared_versions.SharedFiles("s" * 32)
    values = {"w": np.arange(100.0)}
    ref = _ref(values, 7)
    ref = dataclasses.replace(ref, shared=files.write(ref, values))
    assert shared_versions.map_version(ref) is not None
    # another version's or another server's header, another size, not a location
    assert shared_versions.map_version(dataclasses.replace(ref, version=8)) is None
    assert shared_versions.map_version(dataclasses.replace(ref, server="t" * 32)) is None
    wider = (("w", "<f8", (200,), 1600),)
    assert shared_versions.map_version(dataclasses.replace(ref, layout=wider)) is None
    for where in ("../x", "1/x", f"{os.getpid()}/-1", ""):
        assert shared_versions.map_version(dataclasses.replace(ref, shared=where)) is None
    # a regular file of the same size and header, or a pipe, under that number: not a
    # memfd of the server
    path = tmp_path / "copy"
    path.write_bytes(os.pread(int(ref.shared.split("/")[1]), 2048, 0))
    with open(path, "rb") as f:
        assert (
            shared_versions.map_version(
                dataclasses.replace(ref, shared=f"{os.getpid()}/{f.fileno()}")
            )
            is None
        )
    r, w = os.pipe()
    try:
        assert (
            shared_versions.map_version(dataclasses.replace(ref, shared=f"{os.getpid()}/{r}"))
            is None
        )
    finally:
        os.close(r)
        os.close(w)
    # readable by others: not trusted
    os.chmod(_proc(ref.shared), 0o644)
    assert shared_versions.map_version(ref) is None
    files.remove_all()


def test_an_unsealed_memory_file_is_not_mapped():
    """A reader maps only a file whose size can never change under its mapping."""
    import mmap

    values = {"w": np.arange(100.0)}
    ref = _ref(values, 3)
    _at, size = shared_versions.offsets(ref.layout)
    fd = os.memfd_create(f"hi-vars-{ref.server}", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
        with mmap.mmap(fd, size) as m:
            m[: shared_versions._HEADER] = shared_versions._file_header(ref, size)
        assert (
            shared_versions.map_version(dataclasses.replace(ref, shared=f"{os.getpid()}/{fd}"))
            is None
        )
    finally:
        os.close(fd)


def test_an_endpoint_coordinator_puts_nothing_into_the_object_store():
    from coordinator._variables import VariablesStore

    puts = []
    store = VariablesStore(
        {"w": np.zeros(100_000)},
        put=lambda v: puts.append(v) or len(puts),
        get=lambda r: puts[r - 1],
    )
    store.publish({"w": np.ones(100_000)})
    assert store.puts == 1
    store.without_object_store()
    store.publish({"w": np.full(100_000, 2.0)})
    payload = store.payload()
    assert store.puts == 1 and len(puts) == 1 and payload.ref is None
    assert payload.inline is not None and float(payload.inline["w"][0]) == 2.0


def test_a_worker_keeps_a_bounded_number_of_versions_across_runs():
    cache = endpoint._VersionCache()
    read = []

    def fetch(ref):
        read.append((ref.server, ref.version))
        return {"w": np.full(3, float(ref.version))}

    for server in ("a", "b", "c", "d", "e"):  # one run after another in one Python worker
        for version in range(4):
            ref = endpoint.EndpointRef(server, version, (("w", "<f8", (3,), 24),))
            assert float(cache.get(ref, fetch)["w"][0]) == version
            assert float(cache.get(ref, fetch)["w"][0]) == version  # read once
    assert len(read) == 20 and len(set(read)) == 20
    assert len(cache._held) <= endpoint._CACHED
