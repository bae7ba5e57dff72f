"""The parameter server over the endpoint: the Spark tasks reach every shard through the
shard's own Flight endpoint, without Ray.

On real Spark and Ray, the same ``ps.train`` runs over both transports: a sync run ends
bit for bit equal (dense parameters and sparse tables), an async run applies every
update, every step of a worker arrives through the endpoint, and a shard SIGKILLed from
outside mid-run is restarted, serves again where the tasks dial it, and the sync run
still ends bit for bit equal to the fault-free run. The worker side on its own (a fresh
process without Ray against a shard served in this process): pulls and pushes move the
values and never import Ray; a wrong token and an unreachable address are clear errors
naming the address, within the connect timeout. The message codec round-trips."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import threading

import cloudpickle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_ps import PARTS, D, linreg_grad, regression  # noqa: F401  (a fixture)
from test_ps_sparse import clicks, lr_grad  # noqa: F401  (a fixture)
from test_ps_sparse_recovery import PauseOnce, _init, _killer, fm_grad
from test_ps_sparse_recovery import data as fm_data  # noqa: F401  (a fixture)

import hybrid_iter as hi
from coordinator._errors import StaleShardCall
from coordinator._flight import EndpointAddress, EndpointSpec
from coordinator._ps import ServedParameterShard, ShardSpec
from coordinator._ps_endpoint import ShardClient, pack, unpack
from hybrid_iter import ps

TRANSPORTS = ("ray", "endpoint")


def _endpoint_calls(out) -> list[int]:
    return [s["endpoint_calls"] for s in out.shards]


# -- the same results over both transports ------------------------------------------------


def test_a_sync_dense_run_over_the_endpoint_equals_the_ray_run_bit_for_bit(regression):  # noqa: F811
    df, X, y, _ = regression
    init = {"w": np.zeros(D), "b": 0.0}
    got = {
        t: ps.train(
            df,
            linreg_grad,
            init,
            optimizer=ps.Adam(0.05),
            epochs=3,
            batch_size=60,
            columns=["x", "y"],
            num_shards=2,
            parallelism=PARTS,
            transport=t,
        )
        for t in TRANSPORTS
    }
    ray, ep = got["ray"], got["endpoint"]
    assert ep.params["w"].tobytes() == ray.params["w"].tobytes()
    assert float(ep.params["b"]) == float(ray.params["b"])
    assert ep.loss == ray.loss and ep.loss[-1] < ep.loss[0]
    assert [s["updates"] for s in ep.shards] == [s["updates"] for s in ray.shards] == [12, 12]
    # every step of every worker reached the shards through their endpoints, none via Ray
    assert _endpoint_calls(ray) == [0, 0]
    assert all(c >= s["pushes"] > 0 for c, s in zip(_endpoint_calls(ep), ep.shards))


def test_a_sync_run_with_a_table_over_the_endpoint_equals_the_ray_run_bit_for_bit(clicks):  # noqa: F811
    df, bags, y, x = clicks
    keys = np.unique(np.concatenate(bags))
    got = {}
    for t in TRANSPORTS:
        out = ps.train(
            df,
            lr_grad,
            {"w": ps.Table(dim=1), "a": np.zeros(1), "b": np.zeros(1)},
            keys={"w": "ids"},
            optimizer=ps.Adagrad(0.3),
            epochs=3,
            batch_size=50,
            num_shards=2,
            parallelism=PARTS,
            transport=t,
        )
        try:
            got[t] = (out.lookup("w", keys), out.params["a"], out.params["b"], out.loss)
            got[t + "-calls"] = _endpoint_calls(out)
            got[t + "-keys"] = out.params["w"].num_keys
        finally:
            out.close()
    for a, b in zip(got["ray"][:3], got["endpoint"][:3]):
        assert a.tobytes() == b.tobytes()
    assert got["ray"][3] == got["endpoint"][3]
    assert got["ray-keys"] == got["endpoint-keys"] == len(keys)
    assert got["ray-calls"] == [0, 0] and min(got["endpoint-calls"]) > 0


def test_an_async_run_over_the_endpoint_applies_every_update(clicks):  # noqa: F811
    df, _, _, _ = clicks
    out = ps.train(
        df,
        lr_grad,
        {"w": ps.Table(dim=1), "a": np.zeros(1), "b": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.SGD(0.5),
        mode="async",
        epochs=3,
        batch_size=50,
        num_shards=2,
        parallelism=PARTS,
        transport="endpoint",
    )
    try:
        steps = 2 * 3  # 2 workers x 3 steps per epoch (120 rows per partition)
        assert [s["updates"] for s in out.shards] == [steps * 3] * 2
        assert all(s["endpoint_calls"] >= s["pushes"] for s in out.shards)
        assert out.loss[-1] < out.loss[0]
    finally:
        out.close()


def test_a_shard_sigkilled_over_the_endpoint_serves_again_and_the_run_ends_bit_for_bit(
    fm_data,  # noqa: F811
    tmp_path,
):
    df, keys = fm_data

    def train(grad_fn, path, name, transport):
        return ps.train(
            df,
            grad_fn,
            _init(),
            keys={"w": "ids", "v": "ids"},
            optimizer=ps.Adagrad(0.1),
            epochs=4,
            batch_size=30,
            num_shards=3,
            parallelism=2,
            checkpoint=hi.CheckpointConfig(str(path), every_epochs=1),
            name=name,
            transport=transport,
        )

    clean = train(fm_grad, tmp_path / "clean", "ps-ep-clean", "ray")
    try:
        want = (clean.lookup("w", keys), clean.lookup("v", keys), clean.params["a"], clean.loss)
    finally:
        clean.close()
    flags = tmp_path / "flags"
    flags.mkdir()
    got: dict = {}
    thread = _killer(flags, "ps-ep-killed", 1, got)
    pause = PauseOnce(fm_grad, str(flags), 11, str(tmp_path / "killed"))
    out = train(pause, tmp_path / "killed", "ps-ep-killed", "endpoint")
    thread.join(timeout=60)
    try:
        assert "error" not in got, got.get("error")
        [restore] = out.restores
        assert restore["discarded_updates"][1] is None  # lost with its process
        assert out.result.attempts, "the stage was relaunched"
        assert out.shards[1]["pid"] != got["pid"]  # a new process, serving the same address
        np.testing.assert_array_equal(out.lookup("w", keys), want[0])
        np.testing.assert_array_equal(out.lookup("v", keys), want[1])
        np.testing.assert_array_equal(out.params["a"], want[2])
        assert out.loss == want[3]
        assert out.shards[1]["endpoint_calls"] > 0
    finally:
        out.close()


# -- the worker side on its own ------------------------------------------------------------


@pytest.fixture
def served_shard():
    """A sync shard of 4 dense keys (SGD 0.5, one worker) serving its endpoint from this
    process: its coroutines on a loop of a thread of its own, as on an actor's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    spec = ShardSpec(0, 0, 4, np.zeros(4), "sgd", {"learning_rate": 0.5}, 1, True, token="t0")
    shard = ServedParameterShard(spec, put=None)
    served = EndpointSpec(bind="127.0.0.1:0", token="secret")
    location = asyncio.run_coroutine_threadsafe(shard.serve_endpoint(served), loop).result(30)
    try:
        yield shard, location
    finally:
        shard.close_endpoint()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


#: a Spark task's side, run in a fresh interpreter: the Shards client over the endpoint
_TASK = textwrap.dedent(
    """
    import sys
    import cloudpickle
    import numpy as np
    from hybrid_iter.ps._client import Shards

    address = cloudpickle.loads(bytes.fromhex(sys.argv[1]))
    shards = Shards(["s0"], [0, 4], "<f8", sync=True, endpoints=[address])
    before = shards.pull(0, 0)
    after = shards.push(0, 0, 0, np.array([1.0, 2.0, 0.0, -2.0]), 3.0, False)
    print(shards.token, before.tolist(), after.tolist(), after.flags.writeable)
    print("ray" in sys.modules)
    """
)


def test_a_task_over_the_endpoint_pulls_and_pushes_without_importing_ray(served_shard):
    shard, location = served_shard
    address = EndpointAddress(location, "secret", connect_timeout=30)
    done = subprocess.run(
        [sys.executable, "-c", _TASK, cloudpickle.dumps(address).hex()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    values, imported = done.stdout.strip().splitlines()
    assert values == "t0 [0.0, 0.0, 0.0, 0.0] [-0.5, -1.0, 0.0, 1.0] False"
    assert imported == "False"  # the Ray path imports ray to call the shard
    assert shard.stats["endpoint_calls"] == 3  # the shard's hello, the pull, the push
    np.testing.assert_array_equal(shard.values(), [-0.5, -1.0, 0.0, 1.0])


def test_a_shards_refusal_reaches_the_task_as_itself(served_shard):
    _, location = served_shard
    client = ShardClient(EndpointAddress(location, "secret", connect_timeout=30))
    try:
        with pytest.raises(StaleShardCall, match="earlier launch"):
            client.call("pull", 0, 0, "another launch's token")
    finally:
        client.close()


def test_a_wrong_token_is_refused_naming_the_shards_address_and_the_fix(served_shard):
    _, location = served_shard
    where = location.split("://")[1]
    with pytest.raises(hi.EndpointAuthError, match=f"parameter shard endpoint at {where}.*token"):
        ShardClient(EndpointAddress(location, "wrong", connect_timeout=30))


def test_an_unreachable_shard_address_fails_within_the_connect_timeout():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = f"127.0.0.1:{port}"
    with pytest.raises(
        hi.EndpointError, match=f"shard endpoint at {where} cannot be reached within 3 s"
    ):
        ShardClient(EndpointAddress(f"grpc+tcp://{where}", "secret", connect_timeout=3))


# -- the codec ---------------------------------------------------------------------------

_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float64, np.float32, np.int64, np.uint8, np.int32]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(_arrays, st.none(), st.integers(), st.text(max_size=8)), max_size=6),
    st.booleans(),
)
def test_messages_come_back_equal_with_arrays_read_in_place(items, strided):
    if strided:  # a non-contiguous array travels too (inside the pickle)
        items = [a[::2] if isinstance(a, np.ndarray) and a.ndim else a for a in items]
    message = pack(tuple(items))
    back = unpack(memoryview(message).toreadonly())
    assert len(back) == len(items)
    for a, b in zip(items, back):
        if isinstance(a, np.ndarray):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert b.tobytes() == a.tobytes()
            if a.flags.c_contiguous and a.nbytes:
                assert not b.flags.writeable  # read where it arrived, not copied
        else:
            assert a == b


def test_a_truncated_message_is_refused():
    message = pack((np.arange(100.0), "x"))
    for cut in (3, 20, len(message) - 1):
        with pytest.raises(ValueError):
            unpack(message[:cut])
