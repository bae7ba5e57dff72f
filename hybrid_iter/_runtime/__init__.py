"""hybrid_iter's runtime internals, in one place (nothing here is public API).

* ``iterate``: the bounded iteration on the driver (actor launch, barrier stage, retries);
* ``online``: the unbounded iteration (Structured Streaming micro-batches), a package
  of one module per concept; ``entry``: the argument checks both entry points share;
* ``task``: the subtask inside a Spark task (operators, the coordinator protocol);
* ``tree``: tree aggregation of feedback; ``progress``: the live progress line;
* ``placement``: where the long-lived actors go and how they start and stop;
* ``shipping``: pickling user operators; ``ray_util``: joining Ray on loopback;
* ``ray_on_spark``: Ray started on the user's Spark cluster (``Session.on_spark``).

The public API (``hybrid_iter/__init__.py``) re-exports what users call.
"""
