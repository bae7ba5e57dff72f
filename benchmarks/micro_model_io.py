"""Micro-benchmark of what verifying a saved ps model costs: a table of 1M keys x dim 8
written and read back as two parts (what two shards do in ``Model.save`` / ``ps.load``),
with the saved-model checks (SHA-256 while writing, Parquet page checksums, the save id;
on load one read of the bytes, their digest, the page checksums, rows, dim, finiteness)
against plain Parquet as it was written and read without them.

    python benchmarks/micro_model_io.py                  # 1M keys x dim 8, 5 runs
    python benchmarks/micro_model_io.py --keys 4000000 --dim 1 --runs 3

Prints one JSON line: seconds per save and per load (median and every run), both ways.
No Spark, no Ray: the file I/O of the shards only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from coordinator._manifest import new_save_id
from coordinator._table_io import part_name, read_part, write_part


def _plain_write(base: str, j: int, keys: np.ndarray, values: np.ndarray) -> str:
    dim = values.shape[1]
    data = pa.table(
        {
            "key": pa.array(keys),
            "values": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), dim),
        }
    )
    path = f"{base}/{part_name('w', j)}"
    fs = pafs.LocalFileSystem()
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        pq.write_table(data, f)
    return path


def _plain_read(path: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    with pafs.LocalFileSystem().open_input_file(path) as f:
        data = pq.read_table(f)
    keys = data.column("key").to_numpy()
    flat = data.column("values").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return keys, flat.reshape(len(keys), dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = np.sort(rng.choice(2**62, args.keys, replace=False)).astype(np.int64)
    values = rng.normal(size=(args.keys, args.dim))
    parts = [(keys[j :: args.shards], values[j :: args.shards]) for j in range(args.shards)]
    times: dict[str, list[float]] = {k: [] for k in ("plain_save", "plain_load", "save", "load")}
    root = tempfile.mkdtemp(prefix="micro_model_io-")
    try:
        for run in range(args.runs):
            plain, checked = f"{root}/plain{run}", f"{root}/checked{run}"
            t = time.perf_counter()
            paths = [_plain_write(plain, j, k, v) for j, (k, v) in enumerate(parts)]
            times["plain_save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for p in paths:
                _plain_read(p, args.dim)
            times["plain_load"].append(time.perf_counter() - t)
            save_id = new_save_id()
            t = time.perf_counter()
            entries = [write_part(checked, "w", j, k, v, save_id) for j, (k, v) in enumerate(parts)]
            times["save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for e in entries:
                read_part(checked, e, args.dim, save_id)
            times["load"].append(time.perf_counter() - t)
            shutil.rmtree(plain)
            shutil.rmtree(checked)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"keys": args.keys, "dim": args.dim, "shards": args.shards}
    for k, v in times.items():
        out[f"{k}_s"] = round(statistics.median(v), 3)
        out[f"{k}_runs"] = [round(x, 3) for x in v]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
