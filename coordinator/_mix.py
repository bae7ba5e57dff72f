"""The mixing hash of int64 keys every sparse-table piece shares (routing, the index's
slots, the admission sketch's counters)."""

from __future__ import annotations

import numpy as np

__all__ = ["mix64"]

_U64 = np.uint64


def mix64(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """splitmix64 of the state ``key + (salt + 1) * golden`` as uint64 (wrapping
    arithmetic): the golden-ratio step first, so no key is a fixed point (0 included)."""
    x = np.asarray(keys, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        x = x + _U64((0x9E3779B97F4A7C15 * (salt + 1)) & 0xFFFFFFFFFFFFFFFF)
        x ^= x >> _U64(30)
        x *= _U64(0xBF58476D1CE4E5B9)
        x ^= x >> _U64(27)
        x *= _U64(0x94D049BB133111EB)
        x ^= x >> _U64(31)
    return x
