"""A small end-to-end iteration to smoke-test a deployment: sync linear regression.

    hybrid-iter run hybrid_iter.example:linear_regression --param rows=20000

This is what the RayJob in ``k8s/`` runs. ``linear_regression(session, ...)`` runs on the
driver: it generates rows inside Spark (no driver-side data), trains ``y = X w + b`` by
full-batch gradient descent in lock step (FLIP-176 sync mode), and returns a JSON-able
summary. The two operators live in this installed module, so Spark's Python workers and
the Ray coordinator actor import them by name: ``_Gradient`` runs in each Spark task,
``_Step`` in the Ray coordinator actor. It raises if the learned weights miss the true
ones by more than ``max_weight_error``, so a broken deployment fails the job.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ._body import IterationBody, TerminateOnMaxIterOrTol
from ._config import EndpointConfig, IterationConfig
from ._errors import IterationConfigError
from ._operators import CoordinatorOperator, PartitionOperator
from ._runtime.iterate import iterate_bounded_streams_until_termination
from ._session import Session
from ._streams import DataStream, ReplayableDataStreamList

__all__ = ["linear_regression"]


class _Gradient(PartitionOperator):
    """Spark task: caches its rows once, then sends one packed gradient per epoch."""

    def __init__(self, features: list[str]) -> None:
        self.features = features

    def open(self, ctx: Any) -> None:
        from spark_ops import NumpyCache

        self.cache = NumpyCache(self.features, extra=["y"])

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def process_variables(self, variables: Any, ctx: Any, out: Any) -> None:
        self.w = np.asarray(variables["w"], dtype=float)  # features, then the bias

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        X, y = self.cache.matrix(), self.cache.column("y")
        r = X @ self.w[:-1] + self.w[-1] - y
        # one vector per epoch: [d/dw, d/db, squared error, rows]
        out.feedback(np.concatenate([X.T @ r, [r.sum(), r @ r, float(len(y))]]))


class _Step(CoordinatorOperator):
    """Ray coordinator actor: sums the epoch's gradients, steps, publishes ``w``."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = learning_rate

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.w = np.array(init_variables["w"], dtype=float)
        self.total: np.ndarray | None = None

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        self.total = value if self.total is None else self.total + value

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        assert self.total is not None  # every subtask reports every epoch (sync mode)
        total, self.total = self.total, None
        rows = total[-1]
        out.output("loss", float(total[-2] / rows))
        self.w = self.w - self.learning_rate * total[:-2] / rows
        out.publish_variables(w=self.w)


def _check_positive(name: str, value: Any, *, integer: bool) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
        what = "int" if integer else "number"
        raise IterationConfigError(
            f"linear_regression({name}) must be a positive {what}, got {value!r}"
        )


def linear_regression(
    session: Session,
    *,
    rows: int = 100_000,
    features: int = 8,
    partitions: int | None = None,
    max_epochs: int = 200,
    learning_rate: float = 0.5,
    noise: float = 0.1,
    seed: int = 7,
    max_weight_error: float = 0.05,
    endpoint: EndpointConfig | None = None,
) -> dict[str, Any]:
    """Train on ``rows`` generated points in ``partitions`` subtasks (``None``: one per
    task slot Spark has).

    Stops when the mean squared error is within 5 % of the noise floor (``noise**2``)
    or after ``max_epochs``. ``endpoint``: the subtasks reach the coordinator over its
    endpoint with these settings (``IterationConfig(transport="endpoint")``: executors
    without Ray, k8s/components/spark-k8s); None: the session's default transport.
    Returns the epochs, the final loss, the largest weight
    error and timings; raises ``RuntimeError`` when that error exceeds
    ``max_weight_error``.
    """
    from pyspark.sql import functions as F

    from spark_ops import available_task_slots

    for name, value in (("rows", rows), ("features", features), ("max_epochs", max_epochs)):
        _check_positive(name, value, integer=True)
    for name, number in (
        ("learning_rate", learning_rate),
        ("noise", noise),
        ("max_weight_error", max_weight_error),
    ):
        _check_positive(name, number, integer=False)
    if partitions is None:
        partitions = available_task_slots(session.spark)
    _check_positive("partitions", partitions, integer=True)
    if endpoint is not None and not isinstance(endpoint, EndpointConfig):
        raise IterationConfigError(
            f"linear_regression(endpoint) must be an EndpointConfig or None, got "
            f"{type(endpoint).__name__}"
        )

    cols = [f"x{j}" for j in range(features)]
    w_true = np.linspace(-1.0, 1.0, features)
    b_true = 0.5
    df = session.spark.range(rows, numPartitions=partitions).select(
        *[F.randn(seed + j).alias(c) for j, c in enumerate(cols)]
    )
    label = sum((F.col(c) * float(w) for c, w in zip(cols, w_true)), F.lit(b_true))
    df = df.withColumn("y", label + noise * F.randn(seed + features))

    started = time.perf_counter()
    result = iterate_bounded_streams_until_termination(
        init_variables={"w": np.zeros(features + 1)},
        data_streams=ReplayableDataStreamList.not_replay(DataStream(df, (*cols, "y"))),
        config=IterationConfig(
            staleness=0,
            parallelism=partitions,
            name="example-linear-regression",
            transport="auto" if endpoint is None else "endpoint",
            endpoint=endpoint,
        ),
        body=IterationBody(
            partition=_Gradient(cols),
            coordinator=_Step(learning_rate),
            criteria=TerminateOnMaxIterOrTol(max_epochs, 1.05 * noise**2),
        ),
    )
    w = np.asarray(result.variables["w"], dtype=float)
    error = float(np.max(np.abs(w - np.append(w_true, b_true))))
    summary = {
        "rows": int(sum(result.rows)),
        "partitions": result.num_partitions,
        "epochs": result.epochs,
        "terminated_by": result.terminated_by,
        "final_loss": float(result.outputs["loss"][-1]),
        "max_weight_error": error,
        "ms_per_epoch": None
        if result.seconds_per_epoch is None
        else round(1000 * result.seconds_per_epoch, 3),
        "seconds": round(time.perf_counter() - started, 3),
    }
    if error > max_weight_error:
        raise RuntimeError(
            f"linear_regression learned weights off by {error:.4g} > max_weight_error="
            f"{max_weight_error} after {result.epochs} epochs ({result.terminated_by}); "
            f"raise max_epochs or learning_rate"
        )
    return summary
