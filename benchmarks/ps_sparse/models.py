"""The models ``ps.train`` runs (logistic regression on a table, the same on a dense
vector, a factorization machine) and how each contender calls it (``PsSpec``).

The gradient and prediction functions ship to the Spark tasks by value (this module is
a user's file to hybrid_iter): they use numpy, ``hybrid_iter.ps`` and each other only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_iter import ps

from .config import BATCH, FTRL, PARTS


def lr_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """Logistic regression on a table: the batch's mean loss, the gradient of its summed
    loss (FTRL's per-id steps assume per-example gradients summed)."""
    x, y = batch["ids"], batch["label"]
    z = x.dot(params["w"])[:, 0] + params["bias"][0]
    r = 1.0 / (1.0 + np.exp(-z)) - y
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"w": x.t_dot(r), "bias": np.array([r.sum()])}


def lr_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z = batch["ids"].dot(params["w"])[:, 0] + params["bias"][0]
    return 1.0 / (1.0 + np.exp(-z))


def dense_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """The same model with ``w`` a dense ``(D,)`` array: a sparse push (every part a
    ``ps.Sparse``: a dense part would make the push D-sized)."""
    x, y = batch["ids"], batch["label"]
    z = x.dot(params["w"]) + params["bias"][0]
    r = 1.0 / (1.0 + np.exp(-z)) - y
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    bias = ps.Sparse(np.zeros(1, np.int64), np.array([r.sum()]))
    return loss, {"w": x.t_dot(r, like=params["w"]), "bias": bias}


def dense_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z = batch["ids"].dot(params["w"]) + params["bias"][0]
    return 1.0 / (1.0 + np.exp(-z))


def _fm_terms(params: Any, x: Any) -> tuple[np.ndarray, np.ndarray]:
    v = params["v"]
    s = x.dot(v)
    s2 = x.square().dot(v.with_values(v.values**2))
    z = params["bias"][0] + x.dot(params["w"])[:, 0] + 0.5 * (s * s - s2).sum(axis=1)
    return z, s


def fm_grad(params: Any, batch: dict[str, Any]) -> tuple[float, Any]:
    """A factorization machine (Rendle 2010): log loss, the gradient of its sum."""
    x, y = batch["ids"], batch["label"]
    z, s = _fm_terms(params, x)
    r = 1.0 / (1.0 + np.exp(-z)) - y
    grad_v = x.t_dot(r[:, None] * s) - params["v"].values * x.square().t_dot(r)
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"bias": np.array([r.sum()]), "w": x.t_dot(r), "v": grad_v}


def fm_predict(params: Any, batch: dict[str, Any]) -> np.ndarray:
    z, _ = _fm_terms(params, batch["ids"])
    return 1.0 / (1.0 + np.exp(-z))


@dataclass
class PsSpec:
    name: str
    grad_fn: Callable[..., Any]
    predict_fn: Callable[..., Any]
    init: Callable[[], Any]
    optimizer: Any
    mode: str = "sync"
    shards: int | None = None  # None: ps.train's default

    def kwargs(self) -> dict[str, Any]:
        init = self.init()
        tables = [k for k, v in init.items() if isinstance(v, ps.Table)]
        ids = {"keys": {t: "ids" for t in tables}} if tables else {"sparse_columns": ["ids"]}
        return {
            "init": init,
            **ids,
            "optimizer": self.optimizer,
            "mode": self.mode,
            "batch_size": BATCH,
            "parallelism": PARTS,
            **({"num_shards": self.shards} if self.shards is not None else {}),
        }


def lr_spec(mode: str, shards: int | None = None) -> PsSpec:
    return PsSpec(
        f"ps_{mode}" + (f"_{shards}shard" if shards is not None else ""),
        lr_grad,
        lr_predict,
        lambda: {"bias": np.zeros(1), "w": ps.Table(dim=1)},
        ps.FTRL(**FTRL),
        mode,
        shards,
    )


def dense_spec(dim: int) -> PsSpec:
    return PsSpec(
        "ps_dense",
        dense_grad,
        dense_predict,
        lambda: {"bias": np.zeros(1), "w": np.zeros(dim)},
        ps.FTRL(**FTRL),
        "sync",
    )


def fm_spec(k: int) -> PsSpec:
    return PsSpec(
        "ps_fm",
        fm_grad,
        fm_predict,
        lambda: {
            "bias": np.zeros(1),
            "w": ps.Table(dim=1),
            "v": ps.Table(dim=k, init=ps.Normal(0.01, seed=7)),
        },
        ps.Adagrad(learning_rate=0.02),
        "sync",
    )
