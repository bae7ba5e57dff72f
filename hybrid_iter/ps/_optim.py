"""Update rules of the parameter server, as the user configures them (on the driver).

Each is a frozen dataclass checked on creation (a parameter out of range names itself
and its range); the shards (Ray actors) run the matching rule of ``coordinator._rules``
on their key range and on their rows of every table. Regularization (``l2``; FTRL's
``l1`` and ``l2``) is applied there, to the keys each step touches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import IterationConfigError

__all__ = ["FTRL", "SGD", "Adagrad", "Adam", "Optimizer"]


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
    """Base of the update rules ``SGD``, ``Adam``, ``Adagrad`` and ``FTRL``."""

    rule: str = ""
    #: the parameter that sets the step size (named in a rising-loss error)
    rate_name: str = "learning_rate"

    def rule_params(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}  # type: ignore[call-overload]

    @property
    def rate(self) -> float:
        return float(getattr(self, self.rate_name))


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent: ``w -= learning_rate * g``; with ``momentum``,
    ``v = momentum * v + g; w -= learning_rate * v`` (sparse pushes: lazy momentum)."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    #: L2 penalty ``l2 / 2 * w^2`` per touched key (``g + l2 * w``)
    l2: float = 0.0
    rule = "sgd"

    def __post_init__(self) -> None:
        _check("SGD", "learning_rate", self.learning_rate, low=0, high=math.inf, open_low=True)
        _check("SGD", "momentum", self.momentum, low=0, high=1, open_low=False)
        _check("SGD", "l2", self.l2, low=0, high=math.inf, open_low=False)

    def rule_params(self) -> dict[str, float]:
        out = super().rule_params()
        if not self.l2:
            del out["l2"]
        return out


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


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad (Duchi et al. 2011): ``acc += g^2; w -= learning_rate * g / (sqrt(acc) +
    epsilon)`` per key; ``acc`` starts at ``initial_accumulator`` when a key is created;
    ``l2`` adds ``l2 * w`` to the gradient of each touched key."""

    learning_rate: float = 0.1
    initial_accumulator: float = 0.1
    epsilon: float = 1e-10
    l2: float = 0.0
    rule = "adagrad"

    def __post_init__(self) -> None:
        _check("Adagrad", "learning_rate", self.learning_rate, low=0, high=math.inf, open_low=True)
        _check(
            "Adagrad",
            "initial_accumulator",
            self.initial_accumulator,
            low=0,
            high=math.inf,
            open_low=False,
        )
        _check("Adagrad", "epsilon", self.epsilon, low=0, high=math.inf, open_low=True)
        _check("Adagrad", "l2", self.l2, low=0, high=math.inf, open_low=False)


@dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al., KDD 2013) with L1 and L2, per key: ``alpha`` and
    ``beta`` set the per-coordinate step ``alpha / (beta + sqrt(n))``; ``l1`` > 0 makes
    weights exactly 0 until their evidence outweighs it (sparse models); ``l2`` shrinks
    them. ``z`` and ``n`` are created with a key (0); the weight after each update is the
    closed form of them."""

    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    rule = "ftrl"
    rate_name = "alpha"

    def __post_init__(self) -> None:
        _check("FTRL", "alpha", self.alpha, low=0, high=math.inf, open_low=True)
        # beta > 0: a key's first step (n = 0) divides by (beta + sqrt(n)) / alpha + l2
        _check("FTRL", "beta", self.beta, low=0, high=math.inf, open_low=True)
        _check("FTRL", "l1", self.l1, low=0, high=math.inf, open_low=False)
        _check("FTRL", "l2", self.l2, low=0, high=math.inf, open_low=False)
