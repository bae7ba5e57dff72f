"""Versioned model variables held by the coordinator (the parameter server's store).

Every ``publish`` makes a new immutable version: arrays are copied and marked read-only,
so a user operator that keeps updating its own array in place cannot change what was
published. A version is materialised for the partition tier at most once: small
versions travel inline in the reply, large ones are put into the object store once
(``put``) and read zero-copy by every task on the node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import ConfigTypeError, VariablesMismatchError

__all__ = ["VariableSpec", "VariablesPayload", "VariablesStore", "normalize_variables"]

#: Versions whose arrays total more bytes than this go through the object store.
DEFAULT_INLINE_LIMIT = 64 * 1024


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
        inline_limit: int = DEFAULT_INLINE_LIMIT,
    ) -> None:
        self._values = normalize_variables(init, what="init_variables")
        self.specs = {n: VariableSpec(n, tuple(a.shape), a.dtype) for n, a in self._values.items()}
        self.version = 0
        self._put = put
        self._inline_limit = inline_limit
        self._payload: VariablesPayload | None = None
        self.publishes = 0
        #: versions that went through the object store (at most one put per version)
        self.puts = 0

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
            checked[name] = _frozen(arr.astype(spec.dtype, copy=False))
        self._values.update(checked)
        self.version += 1
        self.publishes += 1
        self._payload = None

    def restore(self, values: Mapping[str, Any], version: int, publishes: int) -> None:
        """Take a checkpoint's version (the shapes were checked by its fingerprint)."""
        self._values = normalize_variables(values, what="checkpointed variables")
        self.version, self.publishes = version, publishes
        self._payload = None

    def payload(self) -> VariablesPayload:
        """The current version's payload, built once per version."""
        if self._payload is None:
            size = sum(a.nbytes for a in self._values.values())
            if self._put is not None and size > self._inline_limit:
                self._payload = VariablesPayload(self.version, None, self._put(dict(self._values)))
                self.puts += 1
            else:
                self._payload = VariablesPayload(self.version, dict(self._values), None)
        return self._payload
