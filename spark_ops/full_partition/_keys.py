"""Order-preserving binary encoding of Python sort keys (``sort_partition(key_fn)``).

Runs in Spark tasks. A key function returns any Python value; Spark can only sort
columns of a declared type. Encoding each key into bytes whose unsigned lexicographic
order is the keys' Python order lets Spark's external sort (which compares binary
columns as unsigned bytes, prefix included) sort by the key without knowing its type and
without the partition ever being held in Python memory.

Layout: one tag byte per value, then its payload.

=========  ====  ======================================================================
kind       tag   payload
=========  ====  ======================================================================
end        0x00  closes a tuple or list (so a shorter prefix sorts first)
None       0x10  -
number     0x20  8 bytes: float(x) as order-preserving IEEE bits (NaN after +inf,
                 -0.0 as 0.0); then the exact remainder x - float(x): 0x80 when zero,
                 else 0x7F/0x81 and a sign-magnitude decimal (big ints, Decimals)
str        0x30  UTF-8 (code point order), 0x00 escaped as 0x00 0xFF, then 0x00
bytes      0x38  the bytes, escaped and terminated the same way
date       0x40  proleptic ordinal, 4 bytes
datetime   0x48  naive: ordinal, seconds of day, microseconds (4 + 3 + 3 bytes)
datetime   0x49  aware: the same fields of its UTC time
time       0x50  hour, minute, second, microsecond (naive times only)
timedelta  0x58  total microseconds as a number
tuple      0x60  the elements, then end
list       0x68  the elements, then end
=========  ====  ======================================================================

bool, int, float and Decimal share one kind, as they compare with each other in Python.
Kinds Python cannot compare (a str and an int) order by tag: None first, then numbers,
strings, bytes, dates, datetimes, times, durations, tuples, lists. Spark sorts ``None``
first ascending and last descending, like its own nulls.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import math
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["encode_key", "encode_keys"]

_END = b"\x00"
_NONE = b"\x10"
_NUM = b"\x20"
_STR = b"\x30"
_BYTES = b"\x38"
_DATE = b"\x40"
_DATETIME = b"\x48"
_DATETIME_TZ = b"\x49"
_TIME = b"\x50"
_TIMEDELTA = b"\x58"
_TUPLE = b"\x60"
_LIST = b"\x68"

_REM_ZERO = b"\x80"
_REM_NEG = b"\x7f"
_REM_POS = b"\x81"

_SIGN = 1 << 63
_MASK = (1 << 64) - 1
_NAN_BITS = 0x7FF8000000000000
_MAX_FLOAT = sys.float_info.max
#: Exactly representable ints: keys within it need no remainder (the vectorised path).
_EXACT_INT = 1 << 53
# Remainders of Decimals are computed exactly: enough digits for any float's expansion.
_EXACT = decimal.Context(prec=2000, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
_pack_d = struct.Struct(">d").pack
_unpack_q = struct.Struct(">Q").unpack
_pack_q = struct.Struct(">Q").pack


def _float_bits(f: float) -> bytes:
    if f != f:
        bits = _NAN_BITS
    else:
        if f == 0.0:
            f = 0.0  # -0.0 == 0.0
        (bits,) = _unpack_q(_pack_d(f))
    bits = (~bits & _MASK) if bits & _SIGN else bits | _SIGN
    return _pack_q(bits)


def _decimal_remainder(r: decimal.Decimal) -> bytes:
    """A nonzero exact value as sign, exponent and digits, ordered as numbers."""
    sign, digits, exponent = r.normalize(_EXACT).as_tuple()
    adjusted = int(exponent) + len(digits) - 1
    if sign:  # negative: larger magnitude sorts first, so every byte is inverted
        head = struct.pack(">I", (1 << 31) - 1 - adjusted)
        return _REM_NEG + head + bytes(254 - d for d in digits) + b"\xff"
    head = struct.pack(">I", adjusted + (1 << 31))
    return _REM_POS + head + bytes(d + 1 for d in digits) + b"\x00"


def _number(x: Any) -> bytes:
    if isinstance(x, float):
        return _NUM + _float_bits(x) + _REM_ZERO
    if isinstance(x, int):  # bool too
        if -_EXACT_INT <= x <= _EXACT_INT:
            return _NUM + _float_bits(float(x)) + _REM_ZERO
        try:
            f = float(x)
        except OverflowError:
            f = _MAX_FLOAT if x > 0 else -_MAX_FLOAT
        rem = x - int(f)
        tail = _REM_ZERO if rem == 0 else _decimal_remainder(decimal.Decimal(rem))
        return _NUM + _float_bits(f) + tail
    # decimal.Decimal
    if x.is_nan():
        return _NUM + _float_bits(math.nan) + _REM_ZERO
    if x.is_infinite():
        return _NUM + _float_bits(float(x)) + _REM_ZERO
    f = float(x)
    if math.isinf(f):
        f = _MAX_FLOAT if f > 0 else -_MAX_FLOAT
    exact_rem = _EXACT.subtract(x, decimal.Decimal(f))
    tail = _REM_ZERO if exact_rem == 0 else _decimal_remainder(exact_rem)
    return _NUM + _float_bits(f) + tail


def _escaped(raw: bytes) -> bytes:
    return raw.replace(b"\x00", b"\x00\xff") + b"\x00"


def _day_parts(d: _dt.datetime) -> bytes:
    seconds = d.hour * 3600 + d.minute * 60 + d.second
    return (
        d.toordinal().to_bytes(4, "big")
        + seconds.to_bytes(3, "big")
        + d.microsecond.to_bytes(3, "big")
    )


def encode_key(key: Any) -> bytes:
    """The bytes of ``key``; ``a < b`` (Python) implies ``encode_key(a) < encode_key(b)``.

    Raises ``TypeError`` for a value of a kind that has no natural order here.
    """
    t = type(key)
    if t is int or t is float:
        return _number(key)
    if t is str:
        return _STR + _escaped(key.encode("utf-8", "surrogatepass"))
    if key is None:
        return _NONE
    if isinstance(key, tuple):  # pyspark Row and namedtuples too
        return _TUPLE + b"".join(encode_key(k) for k in key) + _END
    if isinstance(key, list):
        return _LIST + b"".join(encode_key(k) for k in key) + _END
    if isinstance(key, (int, float, decimal.Decimal)):
        return _number(key)
    if isinstance(key, str):
        return _STR + _escaped(str(key).encode("utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray, memoryview)):
        return _BYTES + _escaped(bytes(key))
    if isinstance(key, _dt.datetime):  # before date: a datetime is a date
        if key.tzinfo is not None and key.utcoffset() is not None:
            utc = key.astimezone(_dt.timezone.utc)
            return _DATETIME_TZ + _day_parts(utc)
        return _DATETIME + _day_parts(key)
    if isinstance(key, _dt.date):
        return _DATE + key.toordinal().to_bytes(4, "big")
    if isinstance(key, _dt.time):
        if key.utcoffset() is not None:
            raise TypeError(
                "a time with a timezone is not a sortable key; convert it to a naive time or a datetime"
            )
        return (
            _TIME + bytes([key.hour, key.minute, key.second]) + key.microsecond.to_bytes(3, "big")
        )
    if isinstance(key, np.generic):  # numpy scalars order as the Python values they hold
        return encode_key(key.item())
    if isinstance(key, _dt.timedelta):
        micros = (key.days * 86400 + key.seconds) * 1_000_000 + key.microseconds
        return _TIMEDELTA + _number(micros)
    raise TypeError(
        f"a sort key function returned a {t.__name__} ({key!r:.80}), which has no natural "
        f"order; return None, a bool, int, float, Decimal, str, bytes, date, datetime, time, "
        f"timedelta, or a tuple or list of those"
    )


def _plain_numbers(keys: Sequence[Any]) -> bool:
    for k in keys:
        t = type(k)
        if t is float:
            continue
        if t is int and -_EXACT_INT <= k <= _EXACT_INT:
            continue
        return False
    return True


def encode_keys(keys: Sequence[Any]) -> pa.Array:
    """``encode_key`` over a batch of keys, as an Arrow binary array.

    A batch of plain floats and ints (the common case) is encoded with numpy into the
    same bytes ``encode_key`` gives, 10 per key.
    """
    n = len(keys)
    if n == 0 or not _plain_numbers(keys):
        return pa.array([encode_key(k) for k in keys], type=pa.binary())
    values = np.asarray(keys, dtype=np.float64) + 0.0  # -0.0 + 0.0 is 0.0
    values[np.isnan(values)] = np.nan  # one NaN bit pattern
    bits = values.view(np.uint64)
    negative = (bits >> np.uint64(63)).astype(bool)
    bits = np.where(negative, ~bits, bits | np.uint64(_SIGN))
    out = np.empty((n, 10), dtype=np.uint8)
    out[:, 0] = _NUM[0]
    out[:, 1:9] = bits.astype(">u8").view(np.uint8).reshape(n, 8)
    out[:, 9] = _REM_ZERO[0]
    offsets = np.arange(0, 10 * n + 1, 10, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(out.reshape(-1))]
    )
