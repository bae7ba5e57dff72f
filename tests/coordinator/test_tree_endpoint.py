"""``feedback_combine`` over the coordinator endpoint: each group aggregator actor serves
its members on its own Flight endpoint (the run's token and TLS) and a sync run gives the
Ray run's bits; a group killed from outside is restored from a checkpoint to the same
bits as over Ray, or without one fails the run naming the group's address instead of
hanging; a wrong token on a group's endpoint is refused naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from test_tree import PARTS, Noisy, Summer, _run, data  # noqa: F401

import hybrid_iter as hi
from coordinator._flight import EndpointAddress, EndpointSpec

GROUPED = {"feedback_combine": "sum", "feedback_fan_in": 2}  # two group actors of two


def test_a_grouped_run_over_the_endpoint_equals_the_ray_run_bit_for_bit(data):  # noqa: F811
    # every variables version streamed (not inline): the groups' replies carry references
    # the members read from the coordinator's endpoint
    streamed = {"inline_variables_bytes": 0}
    ray = _run(data, config_kw={"transport": "ray", **streamed}, **GROUPED)
    ep = _run(data, config_kw={"transport": "endpoint", **streamed}, **GROUPED)
    direct = _run(data, config_kw={"transport": "endpoint"}, feedback_combine="sum")
    assert ray.epochs == ep.epochs == direct.epochs == 3
    assert ray.outputs["calls"] == ep.outputs["calls"] == [1] * 3
    assert dict(ep.feedback_counts) == dict(ray.feedback_counts) == {p: 6 for p in range(PARTS)}
    assert sorted(ep.outputs["seen"]) == sorted(ray.outputs["seen"])
    for r, e in zip(ray.outputs["total"], ep.outputs["total"], strict=True):
        assert np.array_equal(r[0], e[0]) and r[1:] == e[1:]
    # the endpoint run really went through its groups: straight to the coordinator, the
    # partials are merged in another order, which rounds differently somewhere
    assert any(
        not np.array_equal(e[0], d[0])
        for e, d in zip(ep.outputs["total"], direct.outputs["total"], strict=True)
    )


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # "pid (comm) state ppid ..."


def _sigkill_ours(marker: bytes, ancestor: int) -> int | None:
    """SIGKILL the first process whose command line holds ``marker`` and that descends
    from ``ancestor`` (this test session's Ray, not another session's on the machine);
    its pid, or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            pid = int(entry)
            while pid > 1 and pid != ancestor:
                pid = _ppid(pid)
        except (OSError, ValueError):
            continue
        if pid == ancestor:
            os.kill(int(entry), signal.SIGKILL)
            return int(entry)
    return None


class KillGroup(Noisy):
    """``Noisy`` that SIGKILLs one of this session's group aggregator processes (from
    outside: not through Ray) in epoch ``at``, once (``flag`` holds the pid found)."""

    def __init__(self, flag, at: int) -> None:
        self.flag, self.at, self.session = flag, at, os.getpid()

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == self.at and ctx.partition_id == 0 and not self.flag.exists():
            self.flag.write_text(str(_sigkill_ours(b"GroupAggregator", self.session)))
        super().on_epoch_watermark_incremented(epoch, ctx, out)


def _killed_run(df, flag, transport, **config_kw):
    body = hi.IterationBody(
        partition=KillGroup(flag, 3), coordinator=Summer(4), criteria=True, **GROUPED
    )
    config = hi.IterationConfig(
        staleness=0,
        max_epochs=10,
        parallelism=PARTS,
        progress=False,
        transport=transport,
        **config_kw,
    )
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(1)}, hi.ReplayableDataStreamList.not_replay(df), config, body
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["ray", "endpoint"])
def test_a_group_killed_from_outside_is_restored_to_the_same_bits(data, tmp_path, transport):  # noqa: F811
    """SIGKILL a group aggregator's process at epoch 3 of a checkpointed run: its members'
    calls fail (Ray: the actor died; the endpoint: its connection is reset), the attempt
    fails, the next one restores the checkpoint of alignment 2 with a new coordinator and
    new groups (serving new endpoints), and the result is the fault-free run's, bit for
    bit, over either transport."""
    clean = _run(data, last=4, config_kw={"transport": transport}, **GROUPED)
    flag = tmp_path / "killed"
    ck = hi.CheckpointConfig(str(tmp_path / "ck"), every_epochs=2)
    killed = _killed_run(data, flag, transport, checkpoint=ck)
    assert flag.read_text() != "None"  # a group was found and killed
    (failed,) = killed.attempts
    died = "ActorDiedError" if transport == "ray" else "the feedback group endpoint at 127.0.0.1:"
    assert died in failed
    assert clean.epochs == killed.epochs == 5
    for a, b in zip(clean.outputs["total"], killed.outputs["total"], strict=True):
        assert np.array_equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.timeout(300)
def test_a_group_killed_without_checkpoints_fails_the_run_naming_its_address(data, tmp_path):  # noqa: F811
    """Nothing to restore from: the run fails with the group's address and what ended;
    no hang (the other group's members are answered), no result lacking some feedback."""
    flag = tmp_path / "killed"
    with pytest.raises(hi.IterationFailedError) as info:
        _killed_run(data, flag, "endpoint")
    assert flag.read_text() != "None"
    assert "the feedback group endpoint at 127.0.0.1:" in str(info.value)
    assert "its group aggregator actor, in the coordinator tier, ended" in str(info.value)


def test_a_group_endpoint_refuses_a_wrong_token_naming_its_address(session):
    """The groups serve with the run's token: a member with another one is refused at
    its first call, with the group's address and the fix; the right one is let in."""
    import ray

    from coordinator._endpoint import group_link

    class TreeHost:  # stands in for a coordinator actor (defined here: shipped by value)
        async def start(self, spec):
            import cloudpickle

            from coordinator._tree import CoordinatorTree, TreeSpec

            self.tree = CoordinatorTree(TreeSpec(cloudpickle.dumps("sum"), fan_in=2), 4)
            await self.tree.serve(spec)
            return [self.tree.location_of(p) for p in range(4)]

    host = ray.remote(num_cpus=0)(TreeHost).remote()
    try:
        spec = EndpointSpec(bind="127.0.0.1:0", token="right")
        locations = ray.get(host.start.remote(spec), timeout=120)
        # two groups of two members, each on its own port
        assert locations[0] == locations[1] != locations[2] == locations[3]
        # the right token is let in, by a process that never imports Ray (a Spark task's)
        fresh = (
            "import sys\n"
            "from coordinator._endpoint import FlightLink, group_link\n"
            "from coordinator._flight import EndpointAddress\n"
            "coordinator = EndpointAddress('grpc+tcp://127.0.0.1:1', 'right', connect_timeout=10)\n"
            f"link = group_link(coordinator, {locations[0]!r})\n"
            "assert link.server_id and isinstance(link, FlightLink)\n"
            "assert 'ray' not in sys.modules, 'a group link imported ray'\n"
        )
        subprocess.run([sys.executable, "-c", fresh], check=True, timeout=120)
        wrong = EndpointAddress("grpc+tcp://127.0.0.1:1", "wrong", connect_timeout=10)
        with pytest.raises(hi.EndpointAuthError) as info:
            group_link(wrong, locations[2])
    finally:
        ray.kill(host, no_restart=True)  # its aggregators die with it (it owns them)
    where = locations[2].split("://")[1]
    assert f"the feedback group endpoint at {where} refused this subtask's token" in str(info.value)
    assert "EndpointConfig(token=...)" in str(info.value)
