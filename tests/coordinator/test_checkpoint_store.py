"""The checkpoint store without Spark: nothing read back executes before it is
authenticated, a checkpoint belongs to one run, corrupt output segments are skipped."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import (
    CheckpointDamaged,
    CheckpointSpec,
    CheckpointStore,
    CoordinatorSpec,
    ForeignCheckpoint,
    IterationCoordinator,
)
from coordinator._checkpoint import _MAGIC, KEY_ENV, checkpoint_key, key_id
from coordinator._identity import damaged_since
from hybrid_iter._runtime.iterate import node_local_refusal

KEY = b"k" * 32


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _forge(path: Path, marker: Path, *, key: bytes = b"attacker" * 4, run_id: str = "r1") -> None:
    """A well-formed checkpoint file whose python section runs a payload, tagged with a
    key that is not the run's."""
    import hmac

    python = pickle.dumps({"epoch": 9, "x": Payload(str(marker))})
    header = json.dumps(
        {
            "run_id": run_id,
            "kind": "checkpoint",
            "epoch": 9,
            "key_id": key_id(KEY),  # lies about the key
            "arrays": [],
            "python": len(python),
        }
    ).encode()
    body = _MAGIC + struct.pack("<I", len(header)) + header + python
    path.write_bytes(body + hmac.new(key, body, hashlib.sha256).digest())


def test_numeric_state_round_trips_outside_the_pickle(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r1")
    w = np.arange(1000, dtype=np.float64)
    store.save(3, {"variables": {"w": w}, "n": 7, "nested": [np.int32(4), w[:3]]}, [("a", 1)])
    raw = (tmp_path / "chk-0000000003.ckpt").read_bytes()
    assert w.tobytes() in raw  # the array is stored raw (.npy), not inside the pickle
    loaded = store.load_latest()
    assert loaded.epoch == 3 and loaded.run_id == "r1"
    assert loaded.data["variables"]["w"].tobytes() == w.tobytes()
    assert loaded.data["n"] == 7
    assert store.outputs_until(3) == [("a", 1)]


def test_a_forged_checkpoint_never_runs_its_payload(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r1")
    store.save(2, {"ok": True}, [])
    marker = tmp_path / "marker"
    _forge(tmp_path / "chk-0000000009.ckpt", marker)
    # the old format: a valid sha256 checksum is no authentication
    payload = pickle.dumps(Payload(str(marker)))
    (tmp_path / "chk-0000000010.ckpt").write_bytes(
        b"HICKPT1\n" + hashlib.sha256(payload).digest() + struct.pack("<Q", len(payload)) + payload
    )
    loaded = store.load_latest()
    assert not marker.exists()
    assert loaded.epoch == 2 and loaded.data == {"ok": True}
    why = dict(loaded.skipped)
    assert "authentication failed" in why[f"{tmp_path}/chk-0000000009.ckpt"]
    assert "bad header" in why[f"{tmp_path}/chk-0000000010.ckpt"]


def test_a_tampered_byte_is_reported_and_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r1", keep_last=3)
    for e in (1, 2):
        store.save(e, {"w": np.full(10, float(e))}, [])
    f = tmp_path / "chk-0000000002.ckpt"
    blob = bytearray(f.read_bytes())
    blob[-40] ^= 1  # flip one bit of the array data
    f.write_bytes(bytes(blob))
    loaded = store.load_latest()
    assert loaded.epoch == 1
    assert "modified after it was written" in loaded.skipped[0][1]


def test_a_file_written_with_another_key_names_the_key(tmp_path):
    CheckpointStore(str(tmp_path), key=KEY, run_id="r1").save(1, {"a": 1}, [])
    loaded = CheckpointStore(str(tmp_path), key=b"x" * 32, run_id="r1").load_latest()
    assert loaded.epoch == -1
    assert "written with another key" in loaded.skipped[0][1] and KEY_ENV in loaded.skipped[0][1]


def _flip(path: Path, at: int, mask: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[at] ^= mask
    path.write_bytes(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_changed_header_byte_is_reported_as_damage_not_as_another_key(tmp_path_factory, data):
    """Whatever byte of the magic, the length or the JSON header changed, the file is
    named damaged (with what to do), never "written with another key", and the newest
    intact checkpoint is taken instead."""
    directory = tmp_path_factory.mktemp("flip")
    store = CheckpointStore(str(directory), key=KEY, run_id="r", keep_last=3)
    store.save(1, {"w": np.arange(3.0)}, [])
    store.save(2, {"w": np.arange(3.0) + 1}, [])
    path = directory / "chk-0000000002.ckpt"
    (length,) = struct.unpack("<I", path.read_bytes()[len(_MAGIC) : len(_MAGIC) + 4])
    at = data.draw(st.integers(0, len(_MAGIC) + 4 + length - 1), label="byte")
    _flip(path, at, data.draw(st.integers(1, 255), label="xor"))
    loaded = store.load_latest()
    assert loaded.epoch == 1 and loaded.data["w"].tolist() == [0.0, 1.0, 2.0]
    ((where, why),) = loaded.skipped
    assert where.endswith("chk-0000000002.ckpt")
    assert "damaged" in why and "another key" not in why and "delete this file" in why, why
    with pytest.raises(CheckpointDamaged):
        store._read(path.name, "checkpoint", 2)


def test_an_older_header_without_checksum_whose_key_field_was_damaged_is_damage(tmp_path):
    """The case reported as "written with another key (key id None)": a header of a file
    written before headers carried a checksum, its "key_id" field name changed."""
    import hmac

    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r")
    store.save(3, {"a": 1}, [])
    path = tmp_path / "chk-0000000003.ckpt"
    blob = path.read_bytes()
    (length,) = struct.unpack("<I", blob[len(_MAGIC) : len(_MAGIC) + 4])
    start = len(_MAGIC) + 4
    fields = json.loads(blob[start : start + length])
    del fields["header_sha256"]
    old = json.dumps(fields).encode()
    body = _MAGIC + struct.pack("<I", len(old)) + old + blob[start + length : -32]
    path.write_bytes(body + hmac.new(KEY, body, hashlib.sha256).digest())
    assert store.load_latest().epoch == 3  # such a file still loads
    path.write_bytes(path.read_bytes().replace(b'"key_id"', b'"kay_id"'))
    why = store.load_latest().skipped[0][1]
    assert "damaged" in why and "'kay_id'" in why and "another key" not in why


def test_a_file_under_another_files_name_is_refused(tmp_path):
    """An authentic checkpoint copied over (or renamed to) another epoch's name, or an
    output segment under a checkpoint's name, is not restored as that epoch."""
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r", keep_last=5)
    store.save(1, {"e": 1}, ["out-of-1"])
    store.save(2, {"e": 2}, [])
    (tmp_path / "chk-0000000003.ckpt").write_bytes((tmp_path / "chk-0000000001.ckpt").read_bytes())
    (tmp_path / "chk-0000000004.ckpt").write_bytes((tmp_path / "out-0000000001.pkl").read_bytes())
    loaded = store.load_latest()
    assert loaded.epoch == 2 and loaded.data == {"e": 2}
    why = dict(loaded.skipped)
    assert (
        "the checkpoint of epoch 1, not what its name says"
        in why[f"{tmp_path}/chk-0000000003.ckpt"]
    )
    assert "the outputs of epoch 1" in why[f"{tmp_path}/chk-0000000004.ckpt"]


def test_the_key_comes_from_the_environment_or_a_private_key_file(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "s" * 20)
    assert checkpoint_key() == b"s" * 20
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ValueError, match="too short"):
        checkpoint_key()
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("HYBRID_ITER_CHECKPOINT_KEY_FILE", str(tmp_path / "k" / "key"))
    first = checkpoint_key()
    assert len(first) == 32 and checkpoint_key() == first  # generated once, then reused
    assert (tmp_path / "k" / "key").stat().st_mode & 0o777 == 0o600


def test_a_checkpoint_of_another_run_is_refused_naming_both_runs(tmp_path):
    CheckpointStore(str(tmp_path), key=KEY, run_id="run-a").save(4, {"a": 1}, [])
    with pytest.raises(ForeignCheckpoint, match=r"run 'run-a', not to this run 'run-b'"):
        CheckpointStore(str(tmp_path), key=KEY, run_id="run-b").load_latest()


def test_a_restarted_coordinator_refuses_another_runs_checkpoint(tmp_path):
    """The multi-node case of the issue: a coordinator restarted where an earlier run left
    a checkpoint at the same path must fail, naming both runs, not restore it."""
    CheckpointStore(str(tmp_path), key=KEY, run_id="earlier").save(4, {"a": 1}, [])
    spec = CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=0,
        max_epochs=5,
        has_criteria=False,
        init_variables={"w": np.zeros(2)},
        operators=cloudpickle.dumps((None, None, [])),
        checkpoint=CheckpointSpec(str(tmp_path), restore=True, run_id="this", key=KEY),
    )
    coord = IterationCoordinator(spec)
    (failure,) = coord.core.failures
    assert failure.type_name == "ForeignCheckpoint"
    assert "'earlier'" in failure.message and "'this'" in failure.message
    assert asyncio.run(coord.restored(0)) is None


def test_a_restore_that_finds_less_than_was_written_fails_loudly(tmp_path):
    spec = CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=0,
        max_epochs=5,
        has_criteria=False,
        init_variables={"w": np.zeros(2)},
        operators=cloudpickle.dumps((None, None, [])),
        checkpoint=CheckpointSpec(str(tmp_path), restore=True, run_id="r", key=KEY, expect_epoch=6),
    )
    (failure,) = IterationCoordinator(spec).core.failures
    assert failure.type_name == "MissingCheckpoint"
    assert "found no checkpoint" in failure.message and "checkpoint 6" in failure.message


def test_a_corrupt_output_segment_is_skipped_and_stray_segments_pruned(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r1", keep_last=5)
    for e in (1, 2, 3):
        store.save(e, {"e": e}, [f"out{e}"])
    (tmp_path / "out-0000000001.pkl").write_bytes(b"garbage")
    store._save_segment(4, ["of a checkpoint never completed"])
    assert store.outputs_until(3) == ["out2", "out3"]
    assert [p.rsplit("/", 1)[-1] for p, _ in store.skipped_outputs] == ["out-0000000001.pkl"]
    assert not (tmp_path / "out-0000000004.pkl").exists()


def test_node_local_paths_are_refused_on_a_multi_node_cluster():
    assert node_local_refusal("/tmp/ckpt", 1, False) is None
    assert node_local_refusal("s3://bucket/ckpt", 3, False) is None
    assert node_local_refusal("/mnt/nfs/ckpt", 3, True) is None
    for uri in ("/tmp/ckpt", "file:///tmp/ckpt", "relative/dir"):
        why = node_local_refusal(uri, 3, False)
        assert why and "3 nodes" in why and "shared_filesystem=True" in why


def test_the_payload_class_would_run(tmp_path):
    """The forged payload is real: unpickling it does create the marker."""
    marker = tmp_path / "m"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.read_text() == "pwned"
    os.remove(marker)


def test_a_damaged_newest_checkpoint_falls_back_but_a_missing_one_fails(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r", keep_last=5)
    for e in (4, 6):
        store.save(e, {"e": e}, [])
    newest = tmp_path / "chk-0000000006.ckpt"
    newest.write_bytes(newest.read_bytes()[:-3])
    loaded = store.load_latest()
    assert loaded.epoch == 4
    assert loaded.skipped_epochs == (6,)
    assert damaged_since(loaded.skipped_epochs, 6)  # visible but damaged: falling back is right
    assert not damaged_since(loaded.skipped_epochs, 7)  # expected 7, never seen: missing
