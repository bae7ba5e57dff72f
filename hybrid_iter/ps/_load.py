"""``ps.load``: a saved model checked against its manifest, then served.

Runs on the driver; the new shard actors read and check their own parts
(``coordinator._table_io.read_part``). The order: the manifest ``model.json`` (sealed,
of a known format), the dense parameters (digest, rows, finite), every listed part
present, then the shards, each reading its parts (digest, rows, dim, save id, finite)
before it keeps a row of them; the ``Model`` is returned only once every shard has
loaded and the rows they hold add up to the manifest's, so a damaged file never serves a
row: any difference is a ``SavedModelError`` naming the file, what differs and the fix,
and the shards started for the load are stopped.

A model written by an earlier hybrid_iter (format 1: no digests) cannot be verified: it
is refused unless ``verify=False``, which loads what the files hold (still refusing a
file that does not parse, has another dim, or holds a NaN) with an
``UnverifiedModelWarning``; saving it again gives a copy that verifies.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from coordinator._table_io import (
    MODEL_FILE,
    RESTORE_FIX,
    filesystem,
    list_parts,
    missing_files,
    part_name,
    read_dense,
    read_meta,
)
from coordinator._tables import Init, TableSpec

from .._errors import ModelNotFoundError, SavedModelError, UnverifiedModelWarning
from ._client import RayShards
from ._layout import Layout
from ._model import FORMAT, Model, _Owner, _TableMeta

__all__ = ["load"]


def load(
    uri: str, *, num_shards: int | None = None, predict_fn: Any = None, verify: bool = True
) -> Model:
    """A model saved by ``TrainResult.save`` / ``Model.save``: its tables loaded into new
    shard actors (each reads its own rows, in parallel), its dense parameters on the
    driver, every file checked against the save's manifest first (``verify=False``: a
    model saved without digests, loaded unverified). Ray must be running (inside a
    ``hybrid_iter.Session``)."""
    try:
        meta, sealed = read_meta(uri, verify=verify)
    except FileNotFoundError as ex:
        raise ModelNotFoundError(str(ex)) from ex
    manifest = f"{filesystem(uri)[1]}/{MODEL_FILE}"
    fmt = meta.get("format")
    if fmt not in (1, FORMAT):
        raise SavedModelError(
            f"{manifest}: model format {fmt!r}, this hybrid_iter reads formats 1 and "
            f"{FORMAT}: load it with the hybrid_iter that saved it (or a newer one)"
        )
    save_id: str | None = None
    if verify:
        if fmt == 1 or not sealed:
            raise SavedModelError(
                f"{manifest} records no digests of its files (written by an earlier "
                f"hybrid_iter, format {fmt}), so they cannot be verified: load it with "
                f"ps.load({uri!r}, verify=False) (its files are then only checked to parse, "
                f"to have the table's dim and to hold finite values) and save that model "
                f"again (model.save(new_uri)) to get a copy ps.load verifies"
            )
        save_id = str(meta.get("save_id", ""))
    else:
        warnings.warn(
            f"ps.load({uri!r}, verify=False): the model's files are not checked against "
            f"the digests of its save (a missing or altered part is not found); save it "
            f"again to get a copy ps.load verifies",
            UnverifiedModelWarning,
            stacklevel=2,
        )
    try:
        tables = [
            _TableMeta(t["name"], int(t["dim"]), Init.from_plain(t["init"]), tuple(t["columns"]))
            for t in meta["tables"]
        ]
        parts = [_parts(uri, t, save_id) for t in meta["tables"]]
        saved = int(meta["num_shards"])
        dense_meta = meta.get("dense")
        layout, dense = None, np.zeros(0)
        if dense_meta is not None:
            arrays = read_dense(uri, meta.get("dense_file"), save_id)
            names = dense_meta["names"]
            init: Any = arrays[""] if names is None else {n: arrays[n] for n in names}
            layout, dense = Layout.of(init)
    except (KeyError, TypeError, ValueError) as ex:
        if isinstance(ex, SavedModelError):
            raise
        raise SavedModelError(
            f"{manifest} does not describe a saved model ({type(ex).__name__}: {ex}); {RESTORE_FIX}"
        ) from ex
    missing = missing_files(uri, [p["file"] for ps in parts for p in ps])
    if missing:
        raise SavedModelError(
            f"{', '.join(missing)} missing: the save listed {'it' if len(missing) == 1 else 'them'}"
            f" in {manifest}, so the model is incomplete; {RESTORE_FIX}"
        )
    names_: list[str] = []
    handles: list[Any] = []
    token = None
    address = None
    if tables:
        from ._shards import launch_table_shards

        address, names_, handles, token = launch_table_shards(
            [TableSpec(t.name, t.dim, t.init, "sgd", {"learning_rate": 1.0}) for t in tables],
            num_shards or saved or 1,
        )
        try:
            _load_rows(uri, tables, parts, handles, saved, save_id)
        except BaseException:
            _Owner(handles).close()
            raise
    return Model(
        layout=layout,
        dense=dense,
        tables=tables,
        shard_names=names_,
        handles=handles,
        token=token,
        predict_fn=predict_fn,
        columns=meta.get("columns", []),
        vector_widths=meta.get("vector_widths", {}),
        csr_columns=meta.get("csr_columns", []),
        ray_address=address,
    )


def _parts(uri: str, table: dict[str, Any], save_id: str | None) -> list[dict[str, Any]]:
    """The manifest's entries of ``table``'s parts (an unverified load of a format-1
    save: the part files the directory holds)."""
    if save_id is not None or "parts" in table:
        return [dict(p) for p in table["parts"]]
    return [{"file": f} for f in list_parts(uri, table["name"])]


def _load_rows(
    uri: str,
    tables: list[_TableMeta],
    parts: list[list[dict[str, Any]]],
    handles: list[Any],
    saved: int,
    save_id: str | None,
) -> None:
    """Every shard reads its parts (all of them when the shard count changed); with a
    save id, the rows held must add up to the manifest's."""
    calls = []
    for t, mine in zip(tables, parts):
        for j, h in enumerate(handles):
            own = [p for p in mine if p["file"] == part_name(t.name, j)]
            calls.append(
                h.load_parts.remote(
                    uri, t.name, own if saved == len(handles) else mine, t.dim, save_id
                )
            )
    held = RayShards.get(calls)
    if save_id is None:
        return
    for i, (t, mine) in enumerate(zip(tables, parts)):
        got = sum(held[i * len(handles) : (i + 1) * len(handles)])
        want = sum(int(p["rows"]) for p in mine)
        if got != want:
            raise SavedModelError(
                f"table {t.name!r}: the shards hold {got} rows after loading, its parts "
                f"listed {want} (a part holds keys of another shard); {RESTORE_FIX}"
            )
