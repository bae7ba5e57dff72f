"""The locations an online iteration reads and writes itself, through pyarrow: the
user's (Spark's spellings: ``s3a://`` is S3) or one Spark listed (``file:/x``)."""

from __future__ import annotations

import json
from typing import Any

import storage_uri
from coordinator import OutputRecord

from ..._errors import IterationConfigError

__all__ = ["filesystem", "write_outputs"]


def filesystem(path: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of ``path``."""
    return storage_uri.arrow_filesystem(path, error=IterationConfigError)


def write_outputs(path: str, batch_id: int, records: list[OutputRecord]) -> None:
    """Batch ``batch_id``'s output records as JSON lines under ``path`` (one file per
    batch, written atomically; a replayed batch rewrites the same file)."""
    fs, base = filesystem(path)
    lines = "".join(
        json.dumps(
            {
                "tag": r.tag,
                "epoch": r.epoch,
                "source": str(r.source),
                "value": json.dumps(r.value, default=str),
                "batch_id": batch_id,
            }
        )
        + "\n"
        for r in records
    )
    with storage_uri.atomic_output(f"{base}/batch-{batch_id:012d}.json", fs=fs, parents=True) as f:
        f.write(lines.encode())
