"""Versioned model variables held by the coordinator (the parameter server's store).

Every ``publish`` makes a new immutable version: arrays are copied and marked read-only,
so a user operator that keeps updating its own array in place cannot change what was
published. A version is materialised for the partition tier at most once: small
versions travel inline in the reply, large ones are put into the object store once
(``put``) and read zero-copy by every task on the node. For a large version the put
*is* the copy: the store keeps the object store's read-only views of it (``get``), so a
published version is copied once, not once by ``publish`` and again by the put.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ConfigTypeError, VariablesMismatchError

__all__ = [
    "INLINE_LIMIT",
    "OncePerVersion",
    "VariableSpec",
    "VariablesPayload",
    "VariablesStore",
    "fetch_all",
    "normalize_variables",
]

#: Values (of a version, of a PS shard) totalling more bytes than this go through the
#: object store, put once per version; smaller ones travel inline in the reply.
INLINE_LIMIT = 64 * 1024


class OncePerVersion:
    """The object-store copy of one version at a time: the one payload path of the
    coordinator's variables and of the parameter-server shards.

    ``ref(version, value, nbytes)`` puts ``value`` at most once per ``version`` when it
    is larger than ``limit`` bytes and returns the reference; below the limit (or with
    no ``put``: no Ray) it returns None and the caller sends the value inline.
    """

    def __init__(self, put: Callable[[Any], Any] | None, limit: int = INLINE_LIMIT) -> None:
        self._put, self.limit = put, limit
        self._version: int | None = None
        self._ref: Any = None
        self.puts = 0

    def would_put(self, nbytes: int) -> bool:
        return self._put is not None and nbytes > self.limit

    def ref(self, version: int, value: Any, nbytes: int) -> Any:
        if not self.would_put(nbytes):
            return None
        if self._version != version:
            assert self._put is not None  # would_put says so
            self._ref = self._put(value)
            self._version = version
            self.puts += 1
        return self._ref

    def forget(self) -> None:
        """Versions restart (a restore): the next ``ref`` puts again."""
        self._version, self._ref = None, None


def fetch_all(pairs: Sequence[tuple[Any, Any]], get: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """The values of ``(inline, ref)`` replies, every ref fetched with one ``get`` (one
    round trip, zero-copy views of the object store); numpy arrays come back read-only.
    The one reader of what ``OncePerVersion`` produced (partition tasks, PS workers)."""
    refs = [ref for _inline, ref in pairs if ref is not None]
    got = iter(get(refs)) if refs else iter(())
    out = [inline if ref is None else next(got) for inline, ref in pairs]
    for value in out:
        for arr in value.values() if isinstance(value, Mapping) else (value,):
            if isinstance(arr, np.ndarray) and arr.flags.writeable:
                arr.flags.writeable = False
    return out


@dataclass(frozen=True)
class VariableSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class VariablesPayload:
    """What a reply carries for one version: ``inline`` values or an object ``ref``."""

    version: int
    inline: Mapping[str, np.ndarray] | None
    ref: Any | None


def _frozen(value: np.ndarray) -> np.ndarray:
    arr = np.array(value, copy=True, order="C")
    arr.flags.writeable = False
    return arr


def normalize_variables(variables: Mapping[str, Any], *, what: str) -> dict[str, np.ndarray]:
    """Check names and values of a variables mapping and return read-only arrays."""
    if not isinstance(variables, Mapping):
        raise ConfigTypeError(
            f"{what} must be a mapping of name -> numpy array or number, "
            f"got {type(variables).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for name, value in variables.items():
        if not isinstance(name, str) or not name:
            raise ConfigTypeError(f"{what}: variable names must be non-empty strings, got {name!r}")
        try:
            arr = np.asarray(value)
        except Exception as ex:
            raise ConfigTypeError(f"{what}[{name!r}] is not array-like: {ex}") from ex
        if arr.dtype.kind not in "biufc":
            raise ConfigTypeError(
                f"{what}[{name!r}] must be numeric (a numpy array or a number), "
                f"got dtype {arr.dtype} from {type(value).__name__}"
            )
        out[name] = _frozen(arr)
    return out


class VariablesStore:
    """The current variables, their version, and each version's payload."""

    def __init__(
        self,
        init: Mapping[str, np.ndarray],
        *,
        put: Callable[[Any], Any] | None = None,
        get: Callable[[Any], Any] | None = None,
        inline_limit: int = INLINE_LIMIT,
    ) -> None:
        self._values = normalize_variables(init, what="init_variables")
        self._get = get if put is not None else None
        self.specs = {n: VariableSpec(n, tuple(a.shape), a.dtype) for n, a in self._values.items()}
        self.version = 0
        self._refs = OncePerVersion(put, inline_limit)
        self._payload: VariablesPayload | None = None
        self.publishes = 0

    @property
    def puts(self) -> int:
        """Versions that went through the object store (at most one put per version)."""
        return self._refs.puts

    @property
    def values(self) -> Mapping[str, np.ndarray]:
        return dict(self._values)

    def publish(self, updates: Mapping[str, Any]) -> None:
        """Validate ``updates`` against the initial variables and make a new version."""
        if not updates:
            raise VariablesMismatchError(
                "publish_variables() needs at least one variable, e.g. publish_variables(w=w)"
            )
        checked: dict[str, np.ndarray] = {}
        for name, value in updates.items():
            spec = self.specs.get(name)
            if spec is None:
                raise VariablesMismatchError(
                    f"publish_variables got unknown variable {name!r}; the iteration's "
                    f"variables are {sorted(self.specs)} (from init_variables)"
                )
            arr = np.asarray(value)
            if tuple(arr.shape) != spec.shape:
                raise VariablesMismatchError(
                    f"publish_variables({name}=...) has shape {tuple(arr.shape)}, but "
                    f"init_variables[{name!r}] has shape {spec.shape}; publish an array of "
                    f"the same shape"
                )
            if arr.dtype.kind not in "biufc" or not np.can_cast(
                arr.dtype, spec.dtype, casting="same_kind"
            ):
                raise VariablesMismatchError(
                    f"publish_variables({name}=...) has dtype {arr.dtype}, which does not "
                    f"cast safely to {spec.dtype} of init_variables[{name!r}]"
                )
            checked[name] = arr.astype(spec.dtype, copy=False)
        values = {**self._values, **checked}
        size = sum(a.nbytes for a in values.values())
        self.version += 1
        self.publishes += 1
        self._payload = None
        if self._get is not None and self._refs.would_put(size):
            # the put copies into the object store: keep its read-only views
            ref = self._refs.ref(self.version, values, size)
            self._values = dict(self._get(ref))
            for arr in self._values.values():
                if arr.flags.writeable:  # not from a shared-memory buffer: own it
                    arr.flags.writeable = False
            self._payload = VariablesPayload(self.version, None, ref)
        else:
            self._values = {n: _frozen(a) if n in checked else a for n, a in values.items()}

    def without_object_store(self) -> None:
        """The subtasks read the versions from elsewhere (the coordinator endpoint's
        server): from the next version on, none is put into the object store (a put
        would be a copy no one reads)."""
        refs, self._refs = self._refs, OncePerVersion(None, self._refs.limit)
        self._refs.puts = refs.puts
        self._get = None

    def restore(self, values: Mapping[str, Any], version: int, publishes: int) -> None:
        """Take a checkpoint's version (the shapes were checked by its fingerprint)."""
        self._values = normalize_variables(values, what="checkpointed variables")
        self.version, self.publishes = version, publishes
        self._payload = None
        self._refs.forget()

    def payload(self) -> VariablesPayload:
        """The current version's payload, built once per version."""
        if self._payload is None:
            values = dict(self._values)
            size = sum(a.nbytes for a in values.values())
            ref = self._refs.ref(self.version, values, size)
            self._payload = VariablesPayload(self.version, None if ref else values, ref)
        return self._payload
