"""``hybrid_iter.ps``: a parameter-server trainer for any model whose gradient a Python
function computes on a numpy batch: dense arrays, and sparse tables keyed by int64 ids.

Dense parameters::

    def grad_fn(w, batch):                      # runs in the Spark tasks
        X, y = batch["features"], batch["label"]
        r = X @ w - y
        return float(r @ r) / (2 * len(y)), X.T @ r / len(y)

    with hi.Session.local() as session:
        out = ps.train(df, grad_fn, np.zeros(d), optimizer=ps.SGD(0.1),
                       mode="async", epochs=10, batch_size=1024)
    out.params, out.loss, out.result.plot("loss.png")

Sparse tables (hashed features, embeddings; any number of keys)::

    init = {"bias": np.zeros(1),
            "w": ps.Table(dim=1),                                  # zeros on first touch
            "v": ps.Table(dim=8, init=ps.Normal(0.01, seed=7))}    # seeded per key

    def grad_fn(params, batch):                # runs in the Spark tasks
        x = batch["ids"]                       # ps.CSR: offsets, ids, values (None: ones)
        w = params["w"]                        # ps.Rows: ids (unique), values (n, 1)
        z = x.dot(w)[:, 0] + params["bias"][0]
        p = 1 / (1 + np.exp(-z)); r = (p - batch["label"]) / len(z)
        return log_loss, {"bias": np.array([r.sum()]), "w": x.t_dot(r)}

    out = ps.train(df, grad_fn, init, keys={"w": "ids", "v": "ids"},
                   optimizer=ps.FTRL(alpha=0.05, beta=1.0, l1=1.0, l2=1.0),
                   eval_df=test, predict_fn=predict_fn, early_stopping=2)
    out.eval; out.save("s3://bucket/model"); out.transform(test_df); out.close()

A table's rows live only on the shards: each is created on the shard its key hashes to,
the first time a batch references it, by a per-key initializer (``Zeros``, ``Normal``,
``Uniform``, ``Constant``: a function of the seed and the key only); a step pulls only
the rows its batch references, fused with the previous push (one call per shard per
step); ``Adagrad`` and ``FTRL`` keep per-key state created with the row, and apply
regularization to the keys a step touches. ``SparseVector`` columns and variable-length
arrays of ids reach ``grad_fn`` as ``CSR``, never densified. See ``ps.train`` and
docs/ps.md.

What reaches the shards is checked: ``init`` finite and the id columns integral (before
any job), each gradient of exactly its parameter's shape (a table's ``(len(ids), dim)``)
and finite (on the worker, before any shard receives a slice of the step:
``NonFiniteGradient`` names the parameter and index, or the table and key, and the
partition, epoch and step), and a loss that keeps rising stops the run naming the
learning rate. A failed training raises ``TrainFailedError`` carrying the parameters the
shards held. With ``checkpoint=``, the shards are part of every checkpoint and a shard
or task that dies is relaunched from the newest cut (sync: bit for bit the run without
the fault).
"""

from coordinator._errors import NonFiniteGradient

from .._errors import SavedModelError, TrainFailedError, UnverifiedModelWarning
from ._csr import CSR, Rows
from ._layout import Sparse
from ._load import load
from ._model import Model, TableRef
from ._optim import FTRL, SGD, Adagrad, Adam, Optimizer
from ._tables import Constant, Initializer, Normal, Table, Uniform, Zeros
from ._train import TrainResult, train

__all__ = [
    "CSR",
    "FTRL",
    "SGD",
    "Adagrad",
    "Adam",
    "Constant",
    "Initializer",
    "Model",
    "NonFiniteGradient",
    "Normal",
    "Optimizer",
    "Rows",
    "SavedModelError",
    "Sparse",
    "Table",
    "TableRef",
    "TrainFailedError",
    "TrainResult",
    "Uniform",
    "UnverifiedModelWarning",
    "Zeros",
    "load",
    "train",
]
