"""Saving and loading models through ``pyarrow.fs`` (local paths and storage URIs in
Spark's spellings: file:, s3a://, s3://, gs://, abfss://, hdfs://). Runs on the driver.

A saved model is a directory: ``arrays.npz`` (numpy arrays, no pickles; the save's id
in the zip comment) written first, then ``metadata.json`` (format, model class,
parameters, library version, the save's id, the arrays' shapes and dtypes, and the size
and SHA-256 of ``arrays.npz``, sealed with its own digest: ``coordinator._manifest``);
both are written to a temporary name and moved into place. A directory without
``metadata.json`` is not a model (an interrupted save), so loading it fails clearly
instead of reading half a model. Loading checks ``arrays.npz`` against the metadata
(size, digest, the save it is from, then every array's shape and dtype, and that its
values are finite) before a model is built: any difference is a ``SavedModelError``
naming the file. A model saved by an earlier hybrid_iter (no digest recorded) still loads,
with an ``UnverifiedModelWarning`` (the zip's CRC-32 of each array still catches flipped
bytes in the arrays' data).
"""

from __future__ import annotations

import io
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

import storage_uri
from coordinator._finite import first_nonfinite, nonfinite_text
from coordinator._manifest import (
    FileDigest,
    new_save_id,
    read_manifest,
    read_verified,
    write_digested,
    write_manifest,
)

from .._errors import (
    IterationConfigError,
    ModelExistsError,
    ModelNotFoundError,
    SavedModelError,
    UnverifiedModelWarning,
)

__all__ = [
    "data_dir",
    "has_spark_metadata",
    "read_model",
    "saved_layout",
    "spark_layout",
    "write_model",
]

FORMAT = "hybrid_iter.ml"
FORMAT_VERSION = 1
_META = "metadata.json"
_ARRAYS = "arrays.npz"
#: the zip comment of ``arrays.npz``, before the save's id
_COMMENT = "hybrid_iter.ml save "
_FIX = (
    "restore the model directory from a copy of that save, or save the model again "
    "(model.save(path, overwrite=True) or model.write().overwrite().save(path))"
)


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
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    for name, value in named.items():
        _refuse_nonfinite(
            value,
            "the model",
            "a model with non-finite values is not saved (it could not be loaded): fit it "
            "again (check the data and the parameters that diverged)",
            name,
        )
    save_id = new_save_id()
    buf = io.BytesIO()
    np.savez(buf, **named)
    with zipfile.ZipFile(buf, "a") as z:  # the save's id, where np.load does not look
        z.comment = (_COMMENT + save_id).encode()
    digest = write_digested(fs, f"{root}/{_ARRAYS}", lambda f: f.write(buf.getbuffer()))
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "class": model_class,
        "hybrid_iter_version": __version__,
        "params": dict(params),
        "arrays": sorted(arrays),
        "save_id": save_id,
        "shapes": {k: {"shape": list(v.shape), "dtype": v.dtype.str} for k, v in named.items()},
        "files": {_ARRAYS: digest.to_plain()},
    }
    write_manifest(fs, meta_path, meta)
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


def has_spark_metadata(path: str) -> bool:
    """Whether ``path`` holds Spark's metadata of a model: ``path/metadata``, which
    ``DefaultParamsWriter`` writes (and refuses to write again) and ``DefaultParamsReader``
    reads."""
    import pyarrow.fs as pafs

    fs, root = _filesystem(path)
    return bool(fs.get_file_info(f"{root}/metadata").type != pafs.FileType.NotFound)


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
    try:
        meta, sealed = read_manifest(fs, meta_path, _FIX)
    except FileNotFoundError as ex:  # gone since the check above
        raise ModelNotFoundError(f"{path!r} holds no saved model ({_META} is missing)") from ex
    if meta.get("format") != FORMAT:
        raise IterationConfigError(
            f"{path!r} is not a hybrid_iter.ml model (format {meta.get('format')!r})"
        )
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise IterationConfigError(
            f"{path!r} was saved by a newer hybrid_iter (model format "
            f"{meta['format_version']}); upgrade hybrid_iter to load it"
        )
    arrays_path = f"{root}/{_ARRAYS}"
    files = meta.get("files")
    if files is None and not sealed:
        warnings.warn(
            f"{meta_path} records no digest of {_ARRAYS} (saved by an earlier hybrid_iter): "
            f"the model is loaded unverified; save it again to get a copy that is checked",
            UnverifiedModelWarning,
            stacklevel=3,
        )
        data = _read_plain(fs, arrays_path)
    else:
        try:
            expected = FileDigest.from_plain(dict(files or {})[_ARRAYS], arrays_path, _FIX)
            save_id = str(meta["save_id"])
        except (KeyError, TypeError) as ex:
            raise SavedModelError(
                f"{meta_path} names no digest of {_ARRAYS} or no save id; {_FIX}"
            ) from ex
        data = memoryview(read_verified(fs, arrays_path, expected, _FIX, _other_save(save_id)))
    arrays = _parse(data, arrays_path)
    if files is not None:
        _check_shapes(arrays, meta.get("shapes"), arrays_path, meta_path)
    for name, value in arrays.items():
        _refuse_nonfinite(
            value,
            arrays_path,
            f"a saved model holds none (a save refuses them), so the file was changed after "
            f"it; {_FIX}",
            name,
        )
    return meta["class"], dict(meta["params"]), arrays


def _refuse_nonfinite(value: np.ndarray, where: str, fix: str, name: str = "") -> None:
    bad = first_nonfinite(value)
    if bad is not None:
        raise SavedModelError(f"{where}: {nonfinite_text(name or 'array', value, bad)}; {fix}")


def _read_plain(fs: Any, path: str) -> bytes:
    try:
        with fs.open_input_stream(path) as f:
            return bytes(f.read())
    except FileNotFoundError as ex:
        raise SavedModelError(f"{path} is missing; {_FIX}") from ex
    except OSError as ex:
        raise SavedModelError(f"{path} cannot be read ({ex}); {_FIX}") from ex


def _save_id_of(data: Any) -> str | None:
    """The save id in the zip comment of an ``arrays.npz`` (None: unreadable, or none)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            comment = z.comment.decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    return comment[len(_COMMENT) :] if comment.startswith(_COMMENT) else None


def _other_save(save_id: str) -> Any:
    def other(data: Any) -> str | None:
        theirs = _save_id_of(memoryview(data))
        return theirs if theirs is not None and theirs != save_id else None

    return other


def _parse(data: Any, path: str) -> dict[str, np.ndarray]:
    """The arrays of an npz file's bytes (every member's CRC-32 checked by zipfile)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as ex:
        raise SavedModelError(f"{path} is not a readable npz file ({ex}); {_FIX}") from ex


def _check_shapes(arrays: Mapping[str, np.ndarray], shapes: Any, path: str, meta_path: str) -> None:
    """The arrays are those the metadata lists, with its shapes and dtypes."""
    try:
        want = {k: (tuple(v["shape"]), str(v["dtype"])) for k, v in shapes.items()}
    except (AttributeError, KeyError, TypeError) as ex:
        raise SavedModelError(f"{meta_path} lists no shapes of its arrays; {_FIX}") from ex
    got = {k: (tuple(v.shape), v.dtype.str) for k, v in arrays.items()}
    if got != want:
        raise SavedModelError(
            f"{path} holds the arrays {got}, its save wrote {want} (as {meta_path} lists "
            f"them); {_FIX}"
        )
