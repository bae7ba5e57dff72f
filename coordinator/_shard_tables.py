"""A parameter shard's tables as its core (``_shard_core.py``) keeps them between a
worker's pull and its push: the rows remembered for each worker, a push's parts, and the
step's admission of keys into a bounded table (``_bounds.py``). Pure numpy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import UsageError
from ._tables import Table

__all__ = ["Part", "Sent", "admitted", "check_counts", "renumber", "resolved"]


@dataclass(slots=True)
class Sent:
    """The keys of a worker's next step in one table, their rows (-1: none, looked up
    again before use) and, for a table with bounds, how often the step sees each."""

    keys: np.ndarray
    rows: np.ndarray
    counts: np.ndarray | None


@dataclass(slots=True)
class Part:
    """A push's part of one table: its ``Sent`` rows, keys and counts, and the gradient
    rows ``g`` aligned with them."""

    keys: np.ndarray
    rows: np.ndarray
    counts: np.ndarray | None
    g: np.ndarray


def resolved(tab: Table, sent: Sent) -> np.ndarray:
    """``sent``'s rows, those it holds as -1 looked up again (a key admitted since)."""
    miss = sent.rows < 0
    if miss.any():
        sent.rows[miss] = tab.index.find(sent.keys[miss])
    return sent.rows


def renumber(sent_by_worker: Iterable[list[Sent | None]], t: int, remap: np.ndarray) -> None:
    """Table ``t`` lost rows: the rows remembered for every worker, renumbered (-1
    where a row went: looked up again before use)."""
    for sent in sent_by_worker:
        s = sent[t] if t < len(sent) else None
        if s is not None:
            have = s.rows >= 0
            s.rows[have] = remap[s.rows[have]]


def check_counts(shard: int, tables: Sequence[Table], pid: int, keys: Any, counts: Any) -> None:
    """A table that admits keys after N sightings needs each key's count in the step."""
    if keys is None:
        return
    for t, (tab, k) in enumerate(zip(tables, keys)):
        if k is None or tab.sketch is None:
            continue
        c = None if counts is None else counts[t]
        if c is None or np.shape(c) != np.shape(k) or (np.asarray(c) < 1).any():
            raise UsageError(
                f"parameter shard {shard}: partition {pid} sent "
                f"{len(k)} keys of table {tab.spec.name!r}, which admits a key after "
                f"{tab.spec.bounds.min_count} sightings, without a count >= 1 for each "
                f"(got {None if c is None else np.shape(c)})"
            )


def admitted(tab: Table, got: list[tuple[Part, float]], now: int) -> list[tuple[Part, float]]:
    """The parts of a bounded table's step with its keys without a row admitted (in one
    call for the whole step: the sketch counts the step's sightings as one multiset,
    whatever the order of its workers), and the gradient rows of the keys not admitted
    dropped."""
    pending = [p.rows < 0 for p, _ in got]
    if not any(m.any() for m in pending):
        return got
    keys = np.concatenate([p.keys[m] for (p, _), m in zip(got, pending)])
    counts = np.concatenate(
        [
            p.counts[m] if p.counts is not None else np.ones(int(m.sum()), np.int64)
            for (p, _), m in zip(got, pending)
        ]
    )
    uniq, inverse = np.unique(keys, return_inverse=True)
    rows = tab.admit(uniq, np.bincount(inverse, weights=counts).astype(np.int64), now)[inverse]
    out = []
    at = 0
    for (p, r), m in zip(got, pending):
        n = int(m.sum())
        p.rows[m] = rows[at : at + n]
        at += n
        keep = p.rows >= 0
        if keep.any():
            out.append((Part(p.keys[keep], p.rows[keep], None, p.g[keep]), r))
    return out
