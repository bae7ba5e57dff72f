"""The floor: logistic regression by FTRL in one process, the same steps as ``ps.train``
sync, dense arrays of size D indexed by id."""

from __future__ import annotations

import math

import numpy as np

from .config import BATCH, FTRL


def ftrl_step(
    w: np.ndarray, z: np.ndarray, n: np.ndarray, g: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1) per coordinate."""
    a, b, l1, l2 = FTRL["alpha"], FTRL["beta"], FTRL["l1"], FTRL["l2"]
    n_new = n + g * g
    root = np.sqrt(n_new)
    sigma = (root - np.sqrt(n)) / a
    z_new = z + (g - sigma * w)
    w_new = np.zeros_like(z_new)
    np.divide(
        -(z_new - np.sign(z_new) * l1), (b + root) / a + l2, out=w_new, where=np.abs(z_new) > l1
    )
    return w_new, z_new, n_new


class NumpyFloor:
    """Logistic regression by FTRL in one process: the steps of ``ps.train`` sync on
    ``PARTS`` partitions (each step the next ``BATCH`` rows of each; per partition the
    gradient of its summed loss; per id the partitions' gradients weighted by their rows
    and added in partition order; FTRL on the ids touched), dense arrays of size D."""

    def __init__(self, dim: int) -> None:
        self.w, self.z, self.n = np.zeros(dim), np.zeros(dim), np.zeros(dim)
        self.bias = [np.zeros(1), np.zeros(1), np.zeros(1)]

    def epoch(self, ids: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> float:
        import pandas as pd

        steps = max(math.ceil(len(p) / BATCH) for p in parts)
        loss_sum = 0.0
        for s in range(steps):
            chunks = [p[s * BATCH : (s + 1) * BATCH] for p in parts]
            chunks = [c for c in chunks if len(c)]
            total = float(sum(len(c) for c in chunks))
            keys, grads, dense = [], [], []
            for c in chunks:
                x = ids[c]
                codes, uniq = pd.factorize(x.ravel())
                row_of = np.repeat(np.arange(len(c)), x.shape[1])
                zz = np.bincount(row_of, weights=self.w[uniq][codes], minlength=len(c))
                zz = zz + self.bias[0][0]
                r = 1.0 / (1.0 + np.exp(-zz)) - y[c]
                loss_sum += float(np.mean(np.logaddexp(0.0, zz) - y[c] * zz)) * len(c)
                g = np.bincount(codes, weights=r[row_of], minlength=len(uniq))
                keys.append(uniq)
                grads.append((g, len(c)))
                dense.append((np.array([r.sum()]), len(c)))
            if len(chunks) == 1:
                uniq, (g, _) = keys[0], grads[0]
                gb = dense[0][0]
            else:
                uniq, inverse = np.unique(np.concatenate(keys), return_inverse=True)
                g = np.zeros(len(uniq))
                np.add.at(g, inverse, np.concatenate([gp * (r / total) for gp, r in grads]))
                gb = np.zeros(1)
                for gp, r in dense:
                    gb += gp * (r / total)
            self.w[uniq], self.z[uniq], self.n[uniq] = ftrl_step(
                self.w[uniq], self.z[uniq], self.n[uniq], g
            )
            self.bias = list(ftrl_step(*self.bias, gb))
        return loss_sum / sum(len(p) for p in parts)

    def predict(self, ids: np.ndarray) -> np.ndarray:
        zz = self.w[ids].sum(axis=1) + self.bias[0][0]
        return 1.0 / (1.0 + np.exp(-zz))
