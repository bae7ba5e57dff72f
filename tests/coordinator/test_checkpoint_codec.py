"""The checkpoint container hands back exactly what was saved: shape (0-d included), dtype
(units, byte order, widths, structured layouts), memory order and bits (NaN payloads,
-0.0), nested in containers; through real files (``pyarrow.fs``). What it cannot encode
fails at once naming the value; an older container format is refused saying why; files
sealed with the previous key are read during a key rotation. No Spark, no Ray."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hybrid_iter as hi
from coordinator import CheckpointSpec, CheckpointStore, OutputRecord
from coordinator._checkpoint import (
    _MAGIC,
    KEY_ENV,
    PREVIOUS_KEY_ENV,
    _header,
    dumps_state,
    key_id,
    previous_checkpoint_key,
    read_record,
    write_record,
)

KEY = b"k" * 32
_names = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return CheckpointStore(str(tmp_path_factory.mktemp("codec")), key=KEY, run_id="codec")


def round_trip(store, obj):
    """Write ``obj`` as a sealed file and read it back (a new name each time)."""
    name = f"rec-{next(_names)}.ckpt"
    write_record(store, name, obj)
    return read_record(store, name)


def _padding_free(dtype: np.dtype) -> np.ndarray:
    """Which bytes of one ``dtype`` item hold its value: not a structured dtype's padding
    (an aligned struct's) nor a long double's, which hold whatever memory held."""
    mask = np.zeros(dtype.itemsize, bool)

    def mark(dt: np.dtype, base: int) -> None:
        if dt.names is not None:
            for name in dt.names:
                field, offset = dt.fields[name][:2]
                mark(field, base + offset)
        elif dt.subdtype is not None:
            item, shape = dt.subdtype
            for i in range(int(np.prod(shape))):
                mark(item, base + i * item.itemsize)
        elif dt.type in _EXTENDED and _EXTENDED_BYTES < dt.itemsize // _parts(dt):
            # x87 extended precision: 10 bytes of value in a 16-byte slot
            step = dt.itemsize // _parts(dt)
            for part in range(_parts(dt)):
                mask[base + part * step : base + part * step + _EXTENDED_BYTES] = True
        else:
            mask[base : base + dt.itemsize] = True

    mark(dtype, 0)
    return mask


#: long double types and how many bytes of theirs hold the value (x87's 80 bits where
#: numpy's long double is that format, padded to 12 or 16 bytes)
_EXTENDED = (np.longdouble, np.clongdouble)
_EXTENDED_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize


def _parts(dt: np.dtype) -> int:
    return 2 if dt.kind == "c" else 1


def _has_padding(dtype: np.dtype) -> bool:
    return not bool(_padding_free(dtype).all())


def value_bytes(arr: np.ndarray, order: str = "C") -> bytes:
    """``arr.tobytes(order)`` without the padding bytes of its dtype."""
    raw = arr.tobytes(order=order)
    if arr.dtype.itemsize == 0 or not _has_padding(arr.dtype):
        return raw
    items = np.frombuffer(raw, np.uint8).reshape(-1, arr.dtype.itemsize)
    return items[:, _padding_free(arr.dtype)].tobytes()


def assert_same(saved, back, where="value"):
    """``back`` is ``saved``: same types, shapes, dtypes, memory order and bits."""
    assert type(back) is type(saved), where
    if isinstance(saved, np.ndarray):
        assert back.shape == saved.shape, where
        assert back.dtype == saved.dtype and str(back.dtype) == str(saved.dtype), where
        assert back.dtype.isalignedstruct == saved.dtype.isalignedstruct, where
        if saved.dtype.kind == "T":  # variable-width strings: compare the strings
            assert back.tolist() == saved.tolist(), where
            return
        assert back.dtype.descr == saved.dtype.descr, where
        assert value_bytes(back) == value_bytes(saved), where  # logical order, every bit
        if saved.flags.c_contiguous or saved.flags.f_contiguous:
            assert back.flags.c_contiguous == saved.flags.c_contiguous, where
            assert back.flags.f_contiguous == saved.flags.f_contiguous, where
            assert value_bytes(back, "A") == value_bytes(saved, "A"), where  # memory
    elif isinstance(saved, dict):
        assert list(back) == list(saved), where
        for k in saved:
            assert_same(saved[k], back[k], f"{where}[{k!r}]")
    elif isinstance(saved, list | tuple):
        assert len(back) == len(saved), where
        for i, (a, b) in enumerate(zip(saved, back, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(saved, np.generic):
        assert back.dtype == saved.dtype, where
        assert value_bytes(np.asarray(back)) == value_bytes(np.asarray(saved)), where
    else:
        assert back == saved, where


# -- strategies -------------------------------------------------------------------------------

_scalar_dtypes = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64, 128)),
    hnp.complex_number_dtypes(endianness="?", sizes=(64, 128, 256)),
    hnp.datetime64_dtypes(max_period="Y", min_period="as", endianness="?"),
    hnp.timedelta64_dtypes(max_period="Y", min_period="as", endianness="?"),
    st.sampled_from([np.dtype("M8"), np.dtype("m8")]),  # generic units
)
dtypes = st.one_of(
    _scalar_dtypes,
    hnp.byte_string_dtypes(min_len=1, max_len=8),
    hnp.unicode_string_dtypes(endianness="?", min_len=1, max_len=4),
    st.integers(1, 8).map(lambda n: np.dtype(f"V{n}")),
    hnp.array_dtypes(_scalar_dtypes, max_size=3, allow_subarrays=True),
    hnp.array_dtypes(_scalar_dtypes, max_size=3).map(lambda d: np.dtype(d.descr, align=True)),
)
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=3)


@st.composite
def arrays(draw):
    """Arrays of any of those dtypes and shapes, in C or F order, whose bytes are random
    (so floats include NaN payloads, signalling NaNs, -0.0, infinities, subnormals)."""
    dtype, shape = draw(dtypes), draw(shapes)
    order = draw(st.sampled_from("CF"))
    size = int(np.prod(shape))
    raw = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)  # a bool byte is 0 or 1
    flat = np.frombuffer(raw, dtype=dtype, count=size) if size else np.zeros(0, dtype)
    return flat.reshape(shape).copy(order=order)


def nested(leaves):
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=4), inner, max_size=3),
        ),
        max_leaves=6,
    )


# -- exactly what was saved -------------------------------------------------------------------

_PAYLOADS = np.array(
    [0x7FF0000000000001, 0xFFF8000000000ABC, 0x7FF4000000000000, 0x8000000000000000],
    dtype=np.uint64,
).view(np.float64)  # signalling NaN, negative quiet NaN with payload, another, -0.0


def _dirty_padding() -> np.ndarray:
    """An aligned struct whose padding bytes hold leftovers, as uninitialised memory does."""
    arr = np.frombuffer(bytearray(b"\xdd" * 16), np.dtype([("f0", "?"), ("f1", "<i2")], align=True))
    arr = arr.reshape(2, 2)
    arr["f0"], arr["f1"] = True, 7
    return arr


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=arrays())
@example(arr=_dirty_padding())
@example(arr=np.array(3.5))
@example(arr=np.array(-0.0, dtype=np.float16))
@example(arr=np.asfortranarray(np.arange(6.0).reshape(2, 3)))
@example(arr=np.array(["2024-03-01T12:00:00.000000001"], dtype="datetime64[ns]"))
@example(arr=np.array(7, dtype="timedelta64[us]"))
@example(arr=_PAYLOADS.reshape(2, 2).copy(order="F"))
@example(arr=np.array([b"ab", b""], dtype="S3"))
@example(arr=np.array(["x", "yz"], dtype=">U2"))
@example(arr=np.zeros((2, 0, 3), order="F"))
def test_every_array_comes_back_as_it_was_saved(store, arr):
    assert_same(arr, round_trip(store, arr))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    obj=nested(
        st.one_of(
            arrays(),
            st.integers(),
            st.text(max_size=4),
            st.none(),
            st.floats(allow_nan=False),
            _scalar_dtypes.map(lambda d: np.zeros((), d)[()]),  # numpy scalars
        )
    )
)
def test_arrays_nested_in_dicts_lists_and_tuples_come_back_as_saved(store, obj):
    assert_same(obj, round_trip(store, obj))


@settings(max_examples=100, deadline=None)
@given(arr=arrays(), data=st.data())
def test_a_strided_view_comes_back_contiguous_with_the_same_values(store, arr, data):
    """Decided layout of views: the same logical array (shape, dtype, every element's
    bits), contiguous, in F order when the view's strides are F order, else in C order."""
    if arr.ndim == 0:
        return
    steps = tuple(data.draw(st.sampled_from([1, 2, -1])) for _ in range(arr.ndim))
    axes = tuple(data.draw(st.permutations(range(arr.ndim))))
    view = arr[tuple(slice(None, None, s) for s in steps)].transpose(axes)
    back = round_trip(store, view)
    assert back.shape == view.shape and back.dtype == view.dtype
    assert value_bytes(back) == value_bytes(view)
    assert back.flags.c_contiguous or back.flags.f_contiguous
    if view.flags.f_contiguous and not view.flags.c_contiguous:
        assert back.flags.f_contiguous


def test_arrays_an_npy_header_cannot_describe_stay_in_the_authenticated_pickle(store):
    values = {
        "strings": np.array(["a", "longer text", ""], dtype=np.dtypes.StringDType()),
        "objects": np.array([{"a": 1}, None, (2, 3)], dtype=object),
        "fields": np.zeros(2, dtype=[("o", object), ("x", "f8")]),
        "meta": np.zeros(3, dtype=np.dtype("f8", metadata={"unit": "m"})),
    }
    back = round_trip(store, values)
    assert back["strings"].tolist() == values["strings"].tolist()
    assert back["strings"].dtype == values["strings"].dtype
    assert back["objects"].tolist() == values["objects"].tolist()
    assert back["fields"].dtype == values["fields"].dtype
    assert back["meta"].dtype.metadata == {"unit": "m"}


def test_numeric_and_time_arrays_are_npy_records_outside_the_pickle(store):
    """The non-executable section holds what it can describe exactly (read with
    allow_pickle=False): 0-d, Fortran, datetime and string arrays included."""
    values = [
        np.array(3.5),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.array(["2024-01-01"], dtype="M8[D]"),
        np.array([b"ab"], dtype="S2"),
    ]
    name = f"rec-{next(_names)}.ckpt"
    write_record(store, name, values)
    with store.fs.open_input_stream(f"{store.dir}/{name}") as f:
        header, _ = _header(f.read(), name)
    assert len(header["arrays"]) == 4


def test_one_array_referenced_twice_comes_back_as_one_array(store):
    w = np.arange(4.0)
    back = round_trip(store, {"a": w, "b": [w]})
    assert back["a"] is back["b"][0]


# -- an older format ------------------------------------------------------------------------


def test_a_file_of_the_previous_container_format_is_refused_saying_why(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r")
    store.save(4, {"w": np.array(1.0)}, [])
    path = tmp_path / "chk-0000000004.ckpt"
    blob = path.read_bytes()
    header, pos = _header(blob, "x")
    # format 2's header: the same fields, without the checksum format 3 added later
    old = json.dumps({k: v for k, v in header.items() if k != "header_sha256"}).encode()
    body = b"HICKPT2\n" + struct.pack("<I", len(old)) + old + blob[pos:-32]
    path.write_bytes(body + hmac.new(KEY, body, hashlib.sha256).digest())
    loaded = store.load_latest()
    assert loaded.epoch == -1
    why = loaded.skipped[0][1]
    assert "container format 2" in why and "shape (1,)" in why and "empty directory" in why


def test_a_format_byte_flipped_to_another_version_is_damage_not_another_version(tmp_path):
    """'3' and '2' differ in one bit: a file whose header reads as this format's is damaged."""
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r")
    store.save(4, {"w": np.array(1.0)}, [])
    path = tmp_path / "chk-0000000004.ckpt"
    blob = bytearray(path.read_bytes())
    blob[6] ^= 1  # "HICKPT3" -> "HICKPT2"
    path.write_bytes(bytes(blob))
    why = store.load_latest().skipped[0][1]
    assert "damaged" in why and "format byte reads '2'" in why and "another" not in why


# -- what cannot be encoded is named --------------------------------------------------------


def test_an_unencodable_output_names_its_tag_epoch_and_emitter(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r")
    outputs = [
        OutputRecord("w0", 3, "coordinator", 1.5),
        OutputRecord("handle", 4, "coordinator", {"conn": threading.Lock()}),
    ]
    with pytest.raises(hi.CheckpointEncodeError) as err:
        store.save(4, {"w": np.zeros(2)}, outputs)
    message = str(err.value)
    assert "output 'handle' of epoch 4" in message and "the coordinator" in message
    assert "['conn']" in message and "_thread.lock" in message
    assert "emit that instead" in message  # the fix
    assert isinstance(err.value, hi.CheckpointError) and isinstance(err.value, TypeError)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_an_unencodable_variable_or_nested_value_is_named_by_its_path(tmp_path):
    store = CheckpointStore(str(tmp_path), key=KEY, run_id="r")
    with pytest.raises(hi.CheckpointEncodeError, match=r"variable 'w' \(a _thread.lock\)"):
        store.save(1, {"variables": {"w": threading.Lock()}}, [])
    gen = (i for i in range(3))
    with pytest.raises(hi.CheckpointEncodeError, match=r"at \['cut'\]\['unapplied'\]\[2\]"):
        store.save(1, {"cut": {"unapplied": {2: gen}}}, [])


def test_unencodable_operator_state_names_the_operator_and_the_fix():
    with pytest.raises(hi.CheckpointEncodeError) as err:
        dumps_state({"ok": 1, "client": threading.Lock()}, "the state of the operator Step")
    message = str(err.value)
    assert message.startswith("the state of the operator Step at ['client']")
    assert "snapshot_state()" in message and "restore_state()" in message


# -- key rotation ---------------------------------------------------------------------------

OLD, NEW = b"o" * 32, b"n" * 32


def test_files_sealed_with_the_previous_key_are_read_and_sealed_again(tmp_path):
    old = CheckpointStore(str(tmp_path), key=OLD, run_id="r", keep_last=5)
    old.save(2, {"w": np.array(2.0)}, ["a"])
    old.save(4, {"w": np.array(4.0)}, ["b"])
    # the new key alone does not read them, and says how to rotate
    refused = CheckpointStore(str(tmp_path), key=NEW, run_id="r").load_latest()
    assert refused.epoch == -1 and PREVIOUS_KEY_ENV in refused.skipped[0][1]
    rotating = CheckpointStore(str(tmp_path), key=NEW, previous_key=OLD, run_id="r", keep_last=5)
    loaded = rotating.load_latest()
    assert loaded.epoch == 4 and loaded.data["w"].shape == () and not loaded.skipped
    assert rotating.outputs_until(4) == ["a", "b"]
    rotating.save(6, {"w": np.array(6.0)}, ["c"])  # written with the new key
    for name in ("chk-0000000004.ckpt", "chk-0000000006.ckpt", "out-0000000002.pkl"):
        with rotating.fs.open_input_stream(f"{rotating.dir}/{name}") as f:
            assert _header(f.read(), name)[0]["key_id"] == key_id(NEW), name
    # what was read (or written) since is readable with the new key alone
    after = CheckpointStore(str(tmp_path), key=NEW, run_id="r")
    assert after.load_latest().epoch == 6 and after.outputs_until(6) == ["a", "b", "c"]
    assert not after.skipped_outputs


def test_a_tampered_file_is_refused_with_either_key(tmp_path):
    CheckpointStore(str(tmp_path), key=OLD, run_id="r").save(2, {"w": np.zeros(3)}, [])
    path = tmp_path / "chk-0000000002.ckpt"
    blob = bytearray(path.read_bytes())
    blob[-40] ^= 1
    path.write_bytes(bytes(blob))
    loaded = CheckpointStore(str(tmp_path), key=NEW, previous_key=OLD, run_id="r").load_latest()
    assert loaded.epoch == -1 and "modified after it was written" in loaded.skipped[0][1]


def test_the_previous_key_comes_from_its_environment_variable(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "n" * 20)
    monkeypatch.delenv(PREVIOUS_KEY_ENV, raising=False)
    assert previous_checkpoint_key() is None
    assert CheckpointSpec("/x").previous_key is None
    monkeypatch.setenv(PREVIOUS_KEY_ENV, "o" * 20)
    assert previous_checkpoint_key() == b"o" * 20
    spec = CheckpointSpec("/x")
    assert (spec.key, spec.previous_key) == (b"n" * 20, b"o" * 20)
    assert "o" * 20 not in repr(spec)
    monkeypatch.setenv(PREVIOUS_KEY_ENV, "short")
    with pytest.raises(hi.IterationConfigError, match=PREVIOUS_KEY_ENV):
        previous_checkpoint_key()


def test_the_key_id_in_a_header_is_only_a_hint(tmp_path):
    """A header claiming the current key's id but sealed with the previous key is still
    authenticated by its tag (and one claiming the previous key's id but sealed by
    nobody is refused)."""
    store = CheckpointStore(str(tmp_path), key=OLD, run_id="r")
    store.save(1, {"a": 1}, [])
    path = tmp_path / "chk-0000000001.ckpt"
    blob = path.read_bytes()
    header, pos = _header(blob, "x")
    new = json.dumps({**header, "key_id": key_id(NEW)}).encode()
    body = _MAGIC + struct.pack("<I", len(new)) + new + blob[pos:-32]
    path.write_bytes(body + hmac.new(OLD, body, hashlib.sha256).digest())
    reader = CheckpointStore(str(tmp_path), key=NEW, previous_key=OLD, run_id="r")
    assert reader.load_latest().data == {"a": 1}
