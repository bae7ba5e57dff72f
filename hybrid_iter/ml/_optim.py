"""L-BFGS and OWL-QN as a pure state machine: told ``(f, grad f)`` at a point, it decides
the next point. Runs wherever it is driven: in the Ray coordinator actor during a fit
(each point is one epoch: a full pass of the partitions), in the driver in tests.

    opt = LBFGS(x0, l1=None, max_iter=100, tol=1e-6)
    while not opt.done:
        f, g = evaluate(opt.point)        # the smooth part and its gradient
        opt.tell(f, g)
    opt.x, opt.objective, opt.converged, opt.history

It minimises ``F(x) = f(x) + sum_j l1_j |x_j|``: plain L-BFGS (Nocedal & Wright,
algorithm 7.4, the two-loop recursion) when ``l1`` is absent or zero, OWL-QN (Andrew &
Gao, 2007: the pseudo-gradient, the orthant projection of every trial point, directions
kept in the orthant) otherwise. Coordinates with ``fixed[j]`` stay at their start value.

Line search: backtracking with the Armijo condition (``c1 = 1e-4``), the next trial
step from a safeguarded quadratic interpolation; step 1 is tried first (after the first
iteration, whose first trial is scaled to ``1 / ||pg||``). Every trial is one ``tell``:
in a fit, one epoch of the same barrier stage. A curvature pair with ``s.y <= 0`` is
not stored (the inverse Hessian estimate stays positive definite).

Convergence (MLlib's ``tol``): the relative change of the objective in one iteration,
``|F_prev - F| <= tol * max(|F|, |F_prev|)``, confirmed by a small gradient,
``||pg|| <= 10 * tol * |F|`` (Breeze, under MLlib, also stops on a small gradient; on
ill-conditioned real data a single small step alone stops 1e-5 short of the optimum), or
a change below ``tol / 1000`` (rounding stops progress), or a zero projected gradient. Stopping at
``max_iter`` iterations, or when no step lowers ``F`` (rounding: the optimum is reached
to machine precision), is not convergence unless the rule above holds.
"""

from __future__ import annotations

import math

import numpy as np

from coordinator._finite import all_finite

from .._errors import IterationConfigError, UsageError

__all__ = ["LBFGS"]

_C1 = 1e-4
_MAX_TRIALS = 30
#: convergence also needs ||pseudo-gradient|| <= GRADIENT_FACTOR * tol * |F|
GRADIENT_FACTOR = 10.0


class LBFGS:
    """The minimiser's state. ``point`` is where ``F`` is wanted next; ``tell(f, g)``
    gives the smooth part ``f`` and its gradient there. ``history`` holds ``F`` at the
    start point and after every iteration (MLlib's ``objectiveHistory``)."""

    def __init__(
        self,
        x0: np.ndarray,
        *,
        l1: np.ndarray | float | None = None,
        fixed: np.ndarray | None = None,
        memory: int = 10,
        max_iter: int = 100,
        tol: float = 1e-6,
    ) -> None:
        if memory < 1 or max_iter < 0 or not tol >= 0:
            raise IterationConfigError(
                f"LBFGS needs memory >= 1, max_iter >= 0, tol >= 0; got {memory}, {max_iter}, {tol}"
            )
        x0 = np.array(x0, dtype=np.float64).ravel()
        n = len(x0)
        self.free = np.ones(n, dtype=bool) if fixed is None else ~np.asarray(fixed, dtype=bool)
        if l1 is None:
            l1v = np.zeros(n)
        else:
            l1v = np.broadcast_to(np.asarray(l1, dtype=np.float64), (n,)).copy()
        if (l1v < 0).any() or not all_finite(l1v):
            raise IterationConfigError("LBFGS(l1=...) must be finite and >= 0")
        self.l1 = l1v * self.free
        self.owlqn = bool((self.l1 > 0).any())
        self.memory = memory
        self.max_iter = max_iter
        self.tol = tol
        self.S: list[np.ndarray] = []
        self.Y: list[np.ndarray] = []
        self.x = x0
        self.f = math.nan  # smooth part at x
        self.g = np.zeros(n)  # its gradient
        self.objective = math.nan  # F at x
        self.history: list[float] = []
        self.iterations = 0
        self.evaluations = 0
        self.done = False
        self.converged = False
        self.reason = ""
        self.point = x0.copy()
        self._started = False
        # the line search of the current iteration
        self._d = np.zeros(n)
        self._slope = 0.0  # pg . d, < 0
        self._alpha = 1.0
        self._trials = 0
        self._orthant = np.zeros(n)
        self._pg = np.zeros(n)

    # -- F and the pseudo-gradient ------------------------------------------------------

    def _full(self, f: float, x: np.ndarray) -> float:
        return f + float(self.l1 @ np.abs(x)) if self.owlqn else f

    def _pseudo_gradient(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        g = g * self.free
        if not self.owlqn:
            return g
        lam = self.l1
        pg = np.where(x > 0, g + lam, np.where(x < 0, g - lam, 0.0))
        at0 = x == 0
        right, left = g + lam, g - lam
        pg = np.where(at0 & (right < 0), right, pg)
        pg = np.where(at0 & (left > 0), left, pg)
        return pg

    def _project(self, x: np.ndarray) -> np.ndarray:
        if not self.owlqn:
            return x
        return np.where(np.sign(x) == self._orthant, x, 0.0)

    # -- the two-loop recursion --------------------------------------------------------

    def _direction(self, pg: np.ndarray) -> np.ndarray:
        q = -pg
        rhos = [1.0 / float(s @ y) for s, y in zip(self.S, self.Y)]
        alphas = []
        for s, y, rho in zip(reversed(self.S), reversed(self.Y), reversed(rhos)):
            a = rho * float(s @ q)
            alphas.append(a)
            q -= a * y
        if self.S:
            s, y = self.S[-1], self.Y[-1]
            q *= float(s @ y) / float(y @ y)
        for (s, y, rho), a in zip(zip(self.S, self.Y, rhos), reversed(alphas)):
            b = rho * float(y @ q)
            q += (a - b) * s
        q *= self.free
        if self.owlqn:  # keep the direction in the orthant the pseudo-gradient points to
            q = np.where(q * pg < 0, q, 0.0)
        return q

    # -- the state machine -------------------------------------------------------------

    def tell(self, f: float, g: np.ndarray) -> None:
        """The smooth part ``f`` and its gradient ``g`` at ``self.point``."""
        if self.done:
            raise UsageError("LBFGS.tell() after the minimisation finished")
        g = np.asarray(g, dtype=np.float64).ravel()
        self.evaluations += 1
        if not self._started:
            if not (math.isfinite(f) and all_finite(g)):
                raise FloatingPointError(
                    f"the objective or its gradient is not finite at the start point ({f})"
                )
            self._started = True
            self._accept(self.point, float(f), g)
            return
        trial = self.point
        F = self._full(float(f), trial) if math.isfinite(f) else math.inf
        ok = math.isfinite(F) and all_finite(g)
        if ok:
            if self.owlqn:
                bound = self.objective + _C1 * float(self._pg @ (trial - self.x))
            else:
                bound = self.objective + _C1 * self._alpha * self._slope
            if F <= bound:
                self._accept(trial, float(f), g)
                return
        self._trials += 1
        if self._trials >= _MAX_TRIALS:
            if self.S:  # a stale curvature estimate: start over from steepest descent
                self.S.clear()
                self.Y.clear()
                self._begin_iteration(first=True)
                return
            self._finish(False, "no step lowers the objective (line search failed)")
            return
        if ok and math.isfinite(F):
            # the minimiser of the quadratic through F(0), F'(0) and F(alpha)
            a = self._alpha
            denom = 2.0 * (F - self.objective - self._slope * a)
            new = -self._slope * a * a / denom if denom > 0 else 0.5 * a
            self._alpha = min(max(new, 0.1 * a), 0.5 * a)
        else:
            self._alpha *= 0.1
        self.point = self._project(self.x + self._alpha * self._d)

    def _accept(self, x: np.ndarray, f: float, g: np.ndarray) -> None:
        first = not self.history
        F = self._full(f, x)
        if not first:
            s, y = x - self.x, (g - self.g) * self.free
            sy = float(s @ y)
            if sy > 1e-10 * float(np.linalg.norm(s) * np.linalg.norm(y)):
                self.S.append(s)
                self.Y.append(y)
                if len(self.S) > self.memory:
                    self.S.pop(0)
                    self.Y.pop(0)
            self.iterations += 1
        prev = self.objective
        self.x, self.f, self.g, self.objective = x.copy(), f, g.copy(), F
        self.history.append(F)
        pg = self._pseudo_gradient(x, g)
        if not pg.any():
            self._finish(True, "the gradient is zero")
            return
        if not first:
            change = abs(prev - F) / max(abs(F), abs(prev), 1e-300)
            gnorm = float(np.linalg.norm(pg))
            # a small step on an ill-conditioned problem is not the optimum yet: the
            # gradient must be small too (else the objective can be 1e-5 off)
            if change <= self.tol and gnorm <= GRADIENT_FACTOR * self.tol * max(abs(F), 1e-8):
                self._finish(True, f"relative change of the objective <= tol ({self.tol:g})")
                return
            if change <= 1e-3 * self.tol:  # stagnation: rounding limits further progress
                self._finish(True, f"relative change of the objective <= tol ({self.tol:g})")
                return
        if self.iterations >= self.max_iter:
            self._finish(False, f"max_iter ({self.max_iter}) iterations")
            return
        self._begin_iteration(first=first)

    def _begin_iteration(self, *, first: bool) -> None:
        pg = self._pseudo_gradient(self.x, self.g)
        d = self._direction(pg)
        slope = float(pg @ d)
        if not slope < 0:  # not a descent direction: forget the curvature pairs
            self.S.clear()
            self.Y.clear()
            d = self._direction(pg)
            slope = float(pg @ d)
            first = True
        self._pg = pg
        self._d = d
        self._slope = slope
        self._trials = 0
        self._alpha = min(1.0, 1.0 / float(np.linalg.norm(pg))) if first and not self.S else 1.0
        if self.owlqn:
            self._orthant = np.where(self.x != 0, np.sign(self.x), np.sign(-pg))
        self.point = self._project(self.x + self._alpha * d)

    def _finish(self, converged: bool, reason: str) -> None:
        self.done = True
        self.converged = converged
        self.reason = reason
        self.point = self.x.copy()
