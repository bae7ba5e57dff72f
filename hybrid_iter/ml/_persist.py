"""Saving and loading models through ``pyarrow.fs`` (local paths and storage URIs in
Spark's spellings: file:, s3a://, s3://, gs://, abfss://, hdfs://). Runs on the driver.

A saved model is a directory: ``arrays.npz`` (numpy arrays, no pickles) written first,
then ``metadata.json`` (format, model class, parameters, library version); a directory
without ``metadata.json`` is not a model (an interrupted save), so loading it fails
clearly instead of reading half a model.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

import storage_uri

from .._errors import IterationConfigError, ModelExistsError, ModelNotFoundError

__all__ = ["data_dir", "read_model", "saved_layout", "spark_layout", "write_model"]

FORMAT = "hybrid_iter.ml"
FORMAT_VERSION = 1
_META = "metadata.json"
_ARRAYS = "arrays.npz"


def _filesystem(path: str) -> tuple[Any, str]:
    """The ``pyarrow.fs`` filesystem and path of a model directory (a local path or a
    storage URI in Spark's spellings: ``s3a://`` is S3; see ``storage_uri``)."""
    return storage_uri.arrow_filesystem(path, what="path", error=IterationConfigError)


def data_dir(path: str) -> str:
    """Where Spark's layout (``model.write().save(path)``) keeps our arrays: ``path/data``
    (joined before any query string of the URI)."""
    return storage_uri.parse(path, what="path", error=IterationConfigError).join("data").uri


def write_model(
    path: str,
    model_class: str,
    params: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    overwrite: bool = False,
) -> str:
    """Write a model directory; refuses an existing model unless ``overwrite``."""
    import pyarrow.fs as pafs

    from .. import __version__

    fs, root = _filesystem(path)
    meta_path = f"{root}/{_META}"
    if not overwrite and spark_layout(path):
        raise ModelExistsError(
            f"{path!r} already holds a model written by model.write().save(path); replace it "
            f"with model.save({path!r}, overwrite=True), or choose another path"
        )
    if fs.get_file_info(meta_path).type != pafs.FileType.NotFound:
        if not overwrite:
            raise ModelExistsError(
                f"{path!r} already holds a saved model; replace it with "
                f"model.save({path!r}, overwrite=True) (or model.write().overwrite().save(...) "
                f"as in pyspark.ml), or choose another path"
            )
        fs.delete_file(meta_path)  # a crash below leaves "no model", never a mixed one
    fs.create_dir(root, recursive=True)
    buf = io.BytesIO()
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    np.savez(buf, **named)
    with fs.open_output_stream(f"{root}/{_ARRAYS}") as f:
        f.write(buf.getvalue())
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "class": model_class,
        "hybrid_iter_version": __version__,
        "params": dict(params),
        "arrays": sorted(arrays),
    }
    with fs.open_output_stream(meta_path) as f:
        f.write(json.dumps(meta, indent=2, sort_keys=True).encode())
    return root


def saved_layout(path: str) -> str | None:
    """What ``path`` holds: ``"ours"`` (``model.save(path)``), ``"spark"``
    (``model.write().save(path)``: Spark's metadata, our format under ``path/data``), or
    None (no model)."""
    import pyarrow.fs as pafs

    fs, root = _filesystem(path)
    if fs.get_file_info(f"{root}/{_META}").type != pafs.FileType.NotFound:
        return "ours"
    if fs.get_file_info(f"{root}/data/{_META}").type != pafs.FileType.NotFound:
        return "spark"
    return None


def spark_layout(path: str) -> bool:
    """Whether ``path`` holds a model written by ``model.write().save(path)`` rather than
    by ``model.save(path)``."""
    return saved_layout(path) == "spark"


def read_model(path: str) -> tuple[str, dict[str, Any], dict[str, np.ndarray]]:
    """``(model class name, parameters, arrays)`` of a saved model."""
    import pyarrow.fs as pafs

    fs, root = _filesystem(path)
    meta_path = f"{root}/{_META}"
    if fs.get_file_info(meta_path).type == pafs.FileType.NotFound:
        raise ModelNotFoundError(
            f"{path!r} holds no saved model ({_META} is missing): a wrong path, or a save "
            f"that did not finish; pass the directory model.save(path) or "
            f"model.write().save(path) wrote"
        )
    with fs.open_input_stream(meta_path) as f:
        meta = json.loads(f.read().decode())
    if meta.get("format") != FORMAT:
        raise IterationConfigError(
            f"{path!r} is not a hybrid_iter.ml model (format {meta.get('format')!r})"
        )
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise IterationConfigError(
            f"{path!r} was saved by a newer hybrid_iter (model format "
            f"{meta['format_version']}); upgrade hybrid_iter to load it"
        )
    with fs.open_input_stream(f"{root}/{_ARRAYS}") as f:
        data = f.read()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta["class"], dict(meta["params"]), arrays
