"""Connected components by delta iteration (the DataSet ``iterateDelta`` pattern).

    python examples/connected_components_delta.py --nodes 200000 --components 50
    python examples/connected_components_delta.py --replay

The solution set holds a component label per node (initially its own id); the workset
holds the nodes whose label changed in the last round. Every round each subtask proposes
the labels of workset nodes to their neighbours over its share of the (undirected)
edges; the coordinator keeps the minimum per node (``np.minimum``); the nodes that got a
smaller label are the next workset. It ends when the workset is empty. Checked against a
plain Python union-find.
"""

from __future__ import annotations

import argparse

import numpy as np

import hybrid_iter as hi


class MinLabel(hi.DeltaStep):
    combine = np.minimum

    def prepare(self, batches):  # runs in a Spark task: the subtask's edges as arrays
        if not batches:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        u = np.concatenate([b.column("u").to_numpy() for b in batches]).astype(np.int64)
        v = np.concatenate([b.column("v").to_numpy() for b in batches]).astype(np.int64)
        return u, v

    def candidates(self, data, solution, workset, ctx):  # runs in a Spark task
        u, v = data
        forward, backward = workset[u], workset[v]  # edges touching a changed node
        keys = np.concatenate([v[forward], u[backward]])
        values = np.concatenate([solution[u[forward]], solution[v[backward]]])
        return keys, values


def generate(spark, nodes: int, components: int, edges_per_node: int, partitions: int, seed: int):
    """Nodes split into `components` contiguous blocks; random edges inside each block."""
    from pyspark.sql import functions as F

    block = -(-nodes // components)
    e = spark.range(nodes * edges_per_node, numPartitions=partitions).select(
        (F.col("id") / edges_per_node).cast("long").alias("u"), F.col("id").alias("e")
    )
    start = (F.col("u") / block).cast("long") * block
    size = F.least(F.lit(block), F.lit(nodes) - start)
    v = start + F.pmod(F.xxhash64("e", F.lit(seed)), size)
    return e.select("u", v.alias("v")).where(F.col("u") != F.col("v"))


def union_find(nodes: int, pairs) -> list[int]:
    """The reference: the smallest node id of each node's component, in plain Python."""
    parent = list(range(nodes))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(x) for x in range(nodes)]


def main(
    session: hi.Session,
    *,
    nodes: int = 20_000,
    components: int = 20,
    edges_per_node: int = 2,
    partitions: int = 2,
    max_iter: int = 200,
    replay: bool = False,
    seed: int = 5,
    progress: bool = True,
):
    df = generate(session.spark, nodes, components, edges_per_node, partitions, seed).cache()
    df.count()
    result = hi.iterate_delta(
        np.arange(nodes),
        np.arange(nodes),  # every node starts in the workset
        df,
        MinLabel(),
        max_iter=max_iter,
        replay=replay,
        config=hi.IterationConfig(progress=progress, name="components"),
    )
    labels = result.variables["solution"]
    pairs = [(int(r.u), int(r.v)) for r in df.collect()]
    ref = union_find(nodes, pairs)
    print(result.summary())
    print(
        f"{len(pairs):,} edges; {len(set(labels.tolist()))} components (reference "
        f"{len(set(ref))}); workset sizes {result.outputs['workset_size']}; "
        f"equal to union-find: {labels.tolist() == ref}"
    )
    df.unpersist()
    return result, ref


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--components", type=int, default=50)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--replay", action="store_true")
    args = ap.parse_args()
    with hi.Session.local(parallelism=args.partitions) as session:
        main(
            session,
            nodes=args.nodes,
            components=args.components,
            partitions=args.partitions,
            replay=args.replay,
        )
