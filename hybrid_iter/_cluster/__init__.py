"""The cluster layer: which cluster a run is on, and what every kind of cluster shares.

Below the session (which starts a cluster and publishes its ``ClusterContext``) and
above nothing of ours: the runtime, ``ml`` and ``ps`` read the context, never the
``Session``. One module per concept:

* ``context``: ``ClusterContext`` (the SparkSession or Connect client, the Ray address
  tasks reach, the coordinator's resources, the kind), published and withdrawn by a
  session; ``of(spark)`` and ``ray_address(spark)`` answer "which Ray" for a run;
* ``ray_join``: Ray address checks, the probe of a cluster, joining it;
* ``ray_util``: connecting on loopback (driver and Spark tasks), the namespace;
* ``placement``: where the coordinator-tier actors go (the head-node rule, once) and
  how they are launched and killed;
* ``spares``: the spare actor pool and the registry of ``Warmer``s their owners
  register; ``warm_up``: the session's background warm-up that drives it;
* ``slots``: waiting for executors and task slots; ``processes``: this driver's
  processes (the leftovers of a failed Ray start; whether a process runs is
  ``storage_uri.process_running``, shared with ``spark_ops``).
"""
