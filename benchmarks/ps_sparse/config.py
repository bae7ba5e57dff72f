"""What every part of the benchmark shares: the layout of a step, the optimizers'
settings, the reference's target, the hashed fields, what each contender's timer holds."""

from __future__ import annotations

#: Spark tasks (training partitions) and rows per task per step, for every contender
PARTS = 2
BATCH = 1024
#: FTRL-Proximal of ps.train and of the numpy floor (alpha: the best of 0.1, 0.2, 0.4)
FTRL = {"alpha": 0.2, "beta": 1.0, "l1": 1.0, "l2": 1.0}
#: the reference LogisticRegression's C, and the target: its held-out log loss + MARGIN
C_REF = 0.3
MARGIN = 0.008
#: the hashed fields, then their crosses
FIELDS = (
    "carrier",
    "flight",
    "tailnum",
    "origin",
    "dest",
    "hour",
    "month",
    "weekday",
    "dist",
    "manufacturer",
    "model",
    "plane_year",
    "visib",
    "precip",
    "wind",
    "temp",
)
CROSSES = (
    ("carrier", "origin"),
    ("origin", "dest"),
    ("carrier", "hour"),
    ("dest", "hour"),
    ("carrier", "month"),
    ("origin", "weekday"),
    ("month", "day"),
    ("origin", "month", "day", "hour"),
)
ALL_FLIGHTS = 327_346
#: what each contender's time to target holds (the same kind of start-up for all: the
#: data each contender reads is built before, its own start-up is inside)
TIMED_REGION = {
    "numpy": "from the model's allocation (np.zeros of size D) to the epoch's end; the "
    "hashed ids already in the driver's memory as a numpy array",
    "sklearn_sgd": "the partial_fit calls (the CSR matrix built before)",
    "ps_*": "from the ps.train call to the epoch's end: the shard actors' start (their "
    "processes start while the Spark stage starts), the Spark stage, its tasks reading "
    "their partition from the cached DataFrame, the epochs; not the teardown after the "
    "last epoch (reported as teardown_s)",
    "mllib_*": "each fit's wall time (from a cached DataFrame of SparseVectors)",
}
