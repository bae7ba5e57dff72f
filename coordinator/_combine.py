"""One update of a parameter shard from the workers' gradients of a step: their
weighted mean ``sum(weight * g) / total``, summed in worker order (so a sync step gives
the same bits whatever order the pushes arrived in), handed to the update rule
(``_rules.py``). Pure numpy: the shard core (``_shard_core.py``) calls it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._rules import _Scratch

__all__ = ["apply_dense", "weighted_rows"]


def apply_dense(
    rule: Any,
    w: np.ndarray,
    parts: list[tuple[Any, float]],
    total: float,
    acc: _Scratch,
    scratch: _Scratch,
) -> None:
    """Update ``w`` by ``rule`` with the weighted mean of ``parts`` (gradient, weight):
    dense arrays of ``w``'s length or sparse ``(indices, values)``; ``acc`` and
    ``scratch`` are reused work arrays of ``w``'s size (no fresh array per step)."""
    sparse = [p for p in parts if isinstance(p[0], tuple)]
    if len(sparse) == len(parts):
        if len(parts) == 1:
            (idx, vals), weight = parts[0]
            vals = vals * (weight / total) if weight != total else vals
        else:
            idx = np.concatenate([g[0] for g, _ in parts])
            vals = np.concatenate([g[1] * (r / total) for g, r in parts])
            idx, inverse = np.unique(idx, return_inverse=True)
            vals = np.bincount(inverse, weights=vals, minlength=len(idx))
        if len(idx):
            rule.sparse(w, idx, vals.astype(w.dtype, copy=False))
        return
    if len(parts) == 1 and parts[0][1] == total:
        g = np.asarray(parts[0][0], dtype=w.dtype)
    else:
        g, part = acc.get(), scratch.get()
        g.fill(0)
        for grad, r in parts:
            if isinstance(grad, tuple):
                np.add.at(g, grad[0], grad[1] * (r / total))
            else:
                np.multiply(grad, r / total, out=part)
                g += part
    rule.dense(w, g)


def weighted_rows(
    got: list[tuple[tuple[np.ndarray, np.ndarray], float]], total: float, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows and ``sum(weight * g) / total`` over the workers' gradient rows, each
    row's sum taken in worker order (``np.add.at`` adds in the order given)."""
    if len(got) == 1:
        (rows, g), weight = got[0]
        return rows, (g * (weight / total) if weight != total else g)
    rows = np.concatenate([rg[0] for rg, _ in got])
    vals = np.concatenate([rg[1] * (r / total) for rg, r in got])
    uniq, inverse = np.unique(rows, return_inverse=True)
    acc = np.zeros((len(uniq), dim))
    np.add.at(acc, inverse, vals)
    return uniq, acc
