"""Which cached data a DataFrame reads, told from its plan without a Spark job (driver).

``cached_source(df)`` answers "does ``df`` read exactly the columns of one cached
DataFrame, nothing computed on top?": its optimized plan is Spark's cache relation
(``InMemoryRelation``) alone, or a projection of plain columns of it (no filter, no
expression, no join). Then every task of ``df`` reads partition ``p`` of the cached
RDD as it is, and the answer names that RDD (``rdd_id``) and which of its columns
(``ordinals``). While the RDD stays persisted Spark serves the same rows for it; RDD ids
are never reused within an application, so ``(application id, rdd_id, ordinals)`` names
the same data for as long as ``rdd_id`` is in ``persisted_rdd_ids``. Unpersisting (or
``spark.catalog.clearCache()``, or recaching after the source changed) ends it: a
DataFrame cached again gets a new RDD.

What the application id cannot tell: a cached DataFrame whose blocks Spark evicted and
recomputes (``StorageLevel.MEMORY_ONLY`` under memory pressure) over a source that
changed meanwhile; Spark itself then serves different rows to different jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _spark_compat

__all__ = ["CachedSource", "cached_source", "cached_view", "persisted_rdd_ids", "read_columns"]


@dataclass(frozen=True)
class CachedSource:
    """The cached RDD a DataFrame reads whole, and which of its columns, in order."""

    app_id: str
    rdd_id: int
    ordinals: tuple[int, ...]
    num_partitions: int


def cached_source(df: Any) -> CachedSource | None:
    """The cached data ``df`` reads unchanged, or None (not cached, or computed on).

    ``df``'s plan is optimized once, when first needed: ask a DataFrame made for the
    question (``df.select(...)``), not one used before the cache changed."""
    found = cached_view(df)
    return None if found is None else found[0]


def cached_view(df: Any) -> tuple[CachedSource, Any] | None:
    """``cached_source(df)`` and a DataFrame of the same rows planned on the cache
    relation itself: a job over it skips analysing and optimizing the plan the cache was
    made from again, and ``exact_num_partitions`` knows its partition count without
    planning (``_spark_compat.cached_relation``). None as for ``cached_source``."""
    found = _spark_compat.cached_relation(df)
    if found is None:
        return None
    rdd_id, ordinals, partitions, frame = found
    source = CachedSource(
        app_id=str(df.sparkSession.sparkContext.applicationId),
        rdd_id=rdd_id,
        ordinals=ordinals,
        num_partitions=partitions,
    )
    return source, frame


def read_columns(df: Any, columns: Sequence[str]) -> tuple[CachedSource | None, Any]:
    """What a job reading ``columns`` of ``df`` should read: ``cached_view`` of
    ``df.select(*columns)`` when that reads cached data unchanged (its source and the
    view), else (None, that select)."""
    selected = df.select(*columns)
    view = cached_view(selected)
    return (None, selected) if view is None else view


def persisted_rdd_ids(spark: Any) -> frozenset[int]:
    """The ids of the RDDs the application keeps persisted now (driver, no job)."""
    return _spark_compat.persisted_rdd_ids(spark)
