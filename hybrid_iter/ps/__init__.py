"""``hybrid_iter.ps``: a parameter-server trainer for any model whose gradient a Python
function computes on a numpy batch.

    import hybrid_iter as hi
    from hybrid_iter import ps

    def grad_fn(w, batch):                      # runs in the Spark tasks
        X, y = batch["features"], batch["label"]
        r = X @ w - y
        return float(r @ r) / (2 * len(y)), X.T @ r / len(y)

    with hi.Session.local() as session:
        out = ps.train(df, grad_fn, np.zeros(d), optimizer=ps.SGD(0.1),
                       mode="async", epochs=10, batch_size=1024)
    out.params, out.loss, out.result.plot("loss.png")

The parameters live in shard actors (key ranges of one flat vector, with the optimizer
state); Spark tasks pull and push straight to them; the iteration's coordinator keeps
epochs, losses, termination and bounded staleness. See ``ps.train``.

What reaches the shards is checked: ``init`` finite (before any job), each gradient of
exactly its parameter's shape and finite (on the worker, before any shard receives a
slice of the step: ``NonFiniteGradient`` names the parameter, index, partition, epoch and
step), and a loss that keeps rising stops the run naming the learning rate. A failed
training raises ``TrainFailedError`` carrying the parameters the shards held.
"""

from coordinator._ps import NonFiniteGradient

from ._layout import Sparse
from ._optim import SGD, Adam, Optimizer
from ._train import TrainFailedError, TrainResult, train

__all__ = [
    "SGD",
    "Adam",
    "NonFiniteGradient",
    "Optimizer",
    "Sparse",
    "TrainFailedError",
    "TrainResult",
    "train",
]
