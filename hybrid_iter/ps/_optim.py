"""Update rules of the parameter server, as the user configures them (on the driver).

Each is a frozen dataclass checked on creation; the shards (Ray actors) run the matching
rule of ``coordinator._ps`` on their key range.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import IterationConfigError

__all__ = ["SGD", "Adam", "Optimizer"]


def _check(owner: str, name: str, value: Any, *, low: float, high: float, open_low: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = not math.isnan(v) and (v > low if open_low else v >= low) and v < high
    if not ok:
        lo = f"> {low:g}" if open_low else f">= {low:g}"
        hi = f" and < {high:g}" if math.isfinite(high) else ""
        raise IterationConfigError(f"{owner}({name}=...) must be a number {lo}{hi}, got {value!r}")


class Optimizer:
    """Base of the update rules ``SGD`` and ``Adam``."""

    rule: str = ""

    def rule_params(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}  # type: ignore[call-overload]


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent: ``w -= learning_rate * g``; with ``momentum``,
    ``v = momentum * v + g; w -= learning_rate * v`` (sparse pushes: lazy momentum)."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    rule = "sgd"

    def __post_init__(self) -> None:
        _check("SGD", "learning_rate", self.learning_rate, low=0, high=math.inf, open_low=True)
        _check("SGD", "momentum", self.momentum, low=0, high=1, open_low=False)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with bias correction; sparse pushes update only their keys' moments (lazy)."""

    learning_rate: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    rule = "adam"

    def __post_init__(self) -> None:
        _check("Adam", "learning_rate", self.learning_rate, low=0, high=math.inf, open_low=True)
        _check("Adam", "beta1", self.beta1, low=0, high=1, open_low=False)
        _check("Adam", "beta2", self.beta2, low=0, high=1, open_low=False)
        _check("Adam", "epsilon", self.epsilon, low=0, high=math.inf, open_low=True)
