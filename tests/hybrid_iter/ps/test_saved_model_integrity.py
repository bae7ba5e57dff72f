"""A saved model is served exactly as it was saved, or not at all: ``ps.load`` and the
``ml`` models' ``load`` check every file against the save's manifest (present, size,
SHA-256, from that save, rows, dim, finite) before anything is served, and any damage
done on disk (a part deleted, copied from another save, bytes flipped, a NaN written, a
file truncated, the manifest edited) is a ``SavedModelError`` naming the file.

One ``ps.train`` per module saves two 2-shard models (the second is "another model");
each case damages a copy of the first in ``tmp_path``. The ``ml`` cases fit one KMeans.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hybrid_iter as hi
from coordinator._manifest import seal
from hybrid_iter import ml, ps

N, PARTS, KEYS = 120, 2, 60


def _grad(params, batch):
    ids, y, x = batch["ids"], batch["label"], batch["x"]
    z = ids.dot(params["w"])[:, 0] + params["a"][0] * x
    p = 1.0 / (1.0 + np.exp(-z))
    r = (p - y) / len(y)
    return float(np.mean(np.logaddexp(0.0, z) - y * z)), {
        "w": ids.t_dot(r),
        "a": np.array([r @ x]),
    }


def _train(df, seed: int, epochs: int):
    return ps.train(
        df,
        _grad,
        {"w": ps.Table(init=ps.Normal(0.1, seed=seed)), "a": np.zeros(1)},
        keys={"w": "ids"},
        optimizer=ps.SGD(0.5),
        epochs=epochs,
        batch_size=30,
        num_shards=2,
        parallelism=PARTS,
    )


@pytest.fixture(scope="module")
def saved(spark, tmp_path_factory):
    """Two saved 2-shard models (``a``: the one damaged; ``b``: another model) and what
    ``a`` serves: its keys, their rows, its dense parameter."""
    rng = np.random.default_rng(5)
    rows = [
        (
            [int(k) for k in rng.choice(KEYS, size=int(rng.integers(1, 5)), replace=False)],
            float(rng.random() < 0.5),
            float(rng.normal()),
        )
        for _ in range(N)
    ]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, PARTS), "ids array<long>, label double, x double"
    )
    root = tmp_path_factory.mktemp("saved")
    keys = np.arange(KEYS, dtype=np.int64)
    out = _train(df, seed=1, epochs=2)
    try:
        out.save(str(root / "a"))
        want, dense = out.lookup("w", keys), np.array(out.params["a"])
    finally:
        out.close()
    other = _train(df, seed=2, epochs=1)
    try:
        other.save(str(root / "b"))
    finally:
        other.close()
    assert not np.array_equal(want, _rows_of(root / "b", keys))  # truly another model
    return root, keys, want, dense


def _rows_of(model: Path, keys: np.ndarray) -> np.ndarray:
    table = pq.read_table(str(model / "tables" / "w")).to_pydict()
    got = dict(zip(table["key"], table["values"]))
    return np.array([got[int(k)] for k in keys])


def _copy(saved, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(saved[0] / "a", dst)
    return dst


def _flip(path: Path, at: float = 0.25, n: int = 8) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + n] = bytes(b ^ 0xFF for b in data[i : i + n])
    path.write_bytes(bytes(data))


def _flip_tail(path: Path) -> None:
    """The footer's length and the closing magic: no Parquet reader can open it."""
    _flip(path, at=1 - 8 / path.stat().st_size, n=8)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _nan_into_part(path: Path) -> None:
    """Rewrite a part as valid Parquet (same schema, same save id) with one NaN value."""
    table = pq.read_table(path)
    col = table.column("values").combine_chunks()
    flat = col.flatten().to_numpy().copy()
    flat[3] = np.nan
    values = pa.FixedSizeListArray.from_arrays(pa.array(flat), col.type.list_size)
    table = table.set_column(1, "values", values).replace_schema_metadata(table.schema.metadata)
    pq.write_table(table, path, write_page_checksum=True)


def _edit_manifest(model: Path, edit) -> None:
    doc = json.loads((model / "model.json").read_text())
    edit(doc)
    (model / "model.json").write_text(json.dumps(doc, indent=1, sort_keys=True))


def _reseal(model: Path, name: str, fresh: Path) -> None:
    """Point the manifest's entry of ``name`` at the file as it is now (rows, size,
    SHA-256) and seal it again: a consistent manifest, so only the later checks can
    object."""
    doc = json.loads((model / "model.json").read_text())
    for table in doc["tables"]:
        for part in table["parts"]:
            if part["file"] == name:
                part["rows"] = pq.read_metadata(fresh).num_rows
                part["bytes"] = fresh.stat().st_size
                part["sha256"] = hashlib.sha256(fresh.read_bytes()).hexdigest()
    (model / "model.json").write_text(json.dumps(seal(doc), indent=1, sort_keys=True))


P0, P1 = "tables/w/part-00000.parquet", "tables/w/part-00001.parquet"


def _part_nan_and_manifest_updated(model: Path, saved) -> None:
    _nan_into_part(model / P0)
    _reseal(model, P0, model / P0)


# (damage(model copy, saved), the file the error must name, what it must say)
DAMAGE = {
    "part_deleted": (lambda m, s: (m / P1).unlink(), P1, "missing"),
    "part_from_another_model": (
        lambda m, s: shutil.copy(s[0] / "b" / P0, m / P0),
        P0,
        "from another save",
    ),
    "part_8_bytes_flipped": (lambda m, s: _flip(m / P0), P0, "altered"),
    "dense_from_another_model": (
        lambda m, s: shutil.copy(s[0] / "b" / "dense.parquet", m / "dense.parquet"),
        "dense.parquet",
        "from another save",
    ),
    "part_nan_written": (lambda m, s: _nan_into_part(m / P0), P0, "altered|truncated"),
    "part_nan_and_manifest_updated": (_part_nan_and_manifest_updated, P0, r"holds nan at key"),
    "part_truncated": (lambda m, s: _truncate(m / P1), P1, "truncated"),
    "part_footer_broken": (lambda m, s: _flip_tail(m / P1), P1, "altered"),
    "dense_truncated": (lambda m, s: _truncate(m / "dense.parquet"), "dense.parquet", "truncated"),
    "dim_edited_in_manifest": (
        lambda m, s: _edit_manifest(m, lambda d: d["tables"][0].update(dim=2)),
        "model.json",
        "edited or damaged",
    ),
    "manifest_truncated": (
        lambda m, s: _truncate(m / "model.json"),
        "model.json",
        "not valid JSON",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_on_disk_is_a_saved_model_error_naming_the_file_and_nothing_is_served(
    saved, tmp_path, case
):
    damage, file, what = DAMAGE[case]
    model = _copy(saved, tmp_path)
    damage(model, saved)
    with pytest.raises(hi.SavedModelError, match=what) as info:
        ps.load(str(model))
    message = str(info.value)
    assert str(model / file) in message, message
    assert "save the model again" in message  # what to do
    # the shards' own error, not Ray's wrapper of it (RayTaskError(SavedModelError))
    assert type(info.value) is hi.SavedModelError


def test_an_intact_save_loads_every_row_as_saved_on_any_shard_count(saved, tmp_path):
    root, keys, want, dense = saved
    model = _copy(saved, tmp_path)
    for shards in (None, 3):  # its own parts, or every part read by every shard
        loaded = ps.load(str(model), num_shards=shards)
        try:
            np.testing.assert_array_equal(loaded.lookup("w", keys), want)
            np.testing.assert_array_equal(loaded.params["a"], dense)
            assert loaded.num_keys("w") == KEYS
        finally:
            loaded.close()


@pytest.mark.parametrize(
    ("damage", "file", "what"),
    [
        # with the digests not checked, the Parquet page checksums still see flipped bytes
        (lambda m: _flip(m / P0), P0, "CRC checksum verification failed"),
        (lambda m: _flip_tail(m / P1), P1, "not a readable Parquet file"),
        (lambda m: _truncate(m / P1), P1, "not a readable Parquet file"),
        (
            lambda m: _edit_manifest(m, lambda d: d["tables"][0].update(dim=2)),
            P0,
            "holds rows of dim 1, but .*model.json says the table's dim is 2",
        ),
        (lambda m: _nan_into_part(m / P0), P0, "holds nan at key"),
    ],
    ids=["flipped_bytes", "footer_broken", "truncated", "dim_edited", "nan"],
)
def test_an_unverified_load_still_refuses_what_does_not_parse_or_is_not_finite(
    saved, tmp_path, damage, file, what
):
    model = _copy(saved, tmp_path)
    damage(model)
    with pytest.warns(hi.UnverifiedModelWarning), pytest.raises(hi.SavedModelError, match=what):
        ps.load(str(model), verify=False)


def _as_format_1(model: Path) -> None:
    """The manifest as the previous version wrote it: no save id, no parts, no seal."""

    def old(doc):
        for key in ("save_id", "dense_file", "manifest_sha256"):
            doc.pop(key)
        for table in doc["tables"]:
            table.pop("parts")
        doc["format"] = 1

    _edit_manifest(model, old)


def test_a_save_without_digests_is_refused_unless_loaded_unverified(saved, tmp_path):
    root, keys, want, dense = saved
    model = _copy(saved, tmp_path)
    _as_format_1(model)
    with pytest.raises(hi.SavedModelError, match=r"verify=False.*save that model again"):
        ps.load(str(model))
    with pytest.warns(hi.UnverifiedModelWarning, match="save it again"):
        loaded = ps.load(str(model), verify=False)
    try:
        np.testing.assert_array_equal(loaded.lookup("w", keys), want)
        again = tmp_path / "again"
        loaded.save(str(again))  # a copy that verifies
    finally:
        loaded.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hi.UnverifiedModelWarning)
        verified = ps.load(str(again))
    try:
        np.testing.assert_array_equal(verified.lookup("w", keys), want)
    finally:
        verified.close()


def test_a_directory_without_a_manifest_is_model_not_found(tmp_path):
    with pytest.raises(hi.ModelNotFoundError, match=r"model\.json is missing"):
        ps.load(str(tmp_path))


# -- ml models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kmeans(spark, tmp_path_factory):
    """One KMeans fit saved three times: ``ours`` and ``again`` by ``model.save`` (two
    saves of one model), ``spark`` by ``model.write().save`` (Spark's layout)."""
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.normal(0, 0.1, (20, 2)), rng.normal(3, 0.1, (20, 2))])
    df = spark.createDataFrame([tuple(map(float, p)) for p in pts], "a double, b double")
    model = ml.KMeans(features_col=["a", "b"], k=2, seed=1).fit(df)
    root = tmp_path_factory.mktemp("kmeans")
    model.save(str(root / "ours"))
    model.save(str(root / "again"))
    model.write().save(str(root / "spark"))
    return root, np.array(model.cluster_centers)


def _reseal_ml(model: Path) -> None:
    meta = json.loads((model / "metadata.json").read_text())
    arrays = model / "arrays.npz"
    meta["files"]["arrays.npz"] = {
        "bytes": arrays.stat().st_size,
        "sha256": hashlib.sha256(arrays.read_bytes()).hexdigest(),
    }
    (model / "metadata.json").write_text(json.dumps(seal(meta), indent=1, sort_keys=True))


def _nan_into_npz(model: Path) -> None:
    with np.load(model / "arrays.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["centres"][0, 1] = np.nan
    np.savez(model / "arrays.npz", **arrays)


def _edit_ml(model: Path, edit) -> None:
    meta = json.loads((model / "metadata.json").read_text())
    edit(meta)
    (model / "metadata.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


ML_DAMAGE = {
    "arrays_deleted": (lambda m, r: (m / "arrays.npz").unlink(), "arrays.npz", "missing"),
    "arrays_from_another_save": (
        lambda m, r: shutil.copy(r / "again" / "arrays.npz", m / "arrays.npz"),
        "arrays.npz",
        "from another save",
    ),
    "arrays_8_bytes_flipped": (lambda m, r: _flip(m / "arrays.npz"), "arrays.npz", "altered"),
    "arrays_nan_written": (
        lambda m, r: _nan_into_npz(m),
        "arrays.npz",
        "altered|truncated|from another save",
    ),
    "arrays_nan_and_metadata_updated": (
        lambda m, r: (_nan_into_npz(m), _reseal_ml(m)),
        "arrays.npz",
        r"centres\[0, 1\] is nan",
    ),
    "arrays_truncated": (lambda m, r: _truncate(m / "arrays.npz"), "arrays.npz", "truncated"),
    "metadata_edited": (
        lambda m, r: _edit_ml(m, lambda d: d["params"].update(k=3)),
        "metadata.json",
        "edited or damaged",
    ),
    "metadata_truncated": (
        lambda m, r: _truncate(m / "metadata.json"),
        "metadata.json",
        "not valid JSON",
    ),
}


@pytest.mark.parametrize("case", list(ML_DAMAGE))
def test_a_damaged_ml_model_is_a_saved_model_error_naming_the_file(kmeans, tmp_path, case):
    damage, file, what = ML_DAMAGE[case]
    root, _ = kmeans
    model = tmp_path / "model"
    shutil.copytree(root / "ours", model)
    damage(model, root)
    for reader in (ml.KMeansModel, ml.Model):
        with pytest.raises(hi.SavedModelError, match=what) as info:
            reader.load(str(model))
        assert str(model / file) in str(info.value) and "save the model again" in str(info.value)


def test_a_damaged_ml_model_in_sparks_layout_is_refused_too(kmeans, tmp_path):
    root, centres = kmeans
    model = tmp_path / "model"
    shutil.copytree(root / "spark", model)
    np.testing.assert_array_equal(ml.KMeansModel.load(str(model)).cluster_centers, centres)
    _flip(model / "data" / "arrays.npz")
    with pytest.raises(hi.SavedModelError, match="altered") as info:
        ml.KMeansModel.load(str(model))
    assert str(model / "data" / "arrays.npz") in str(info.value)


def test_an_ml_model_saved_without_digests_loads_with_a_warning_and_zip_crcs_still_hold(
    kmeans, tmp_path
):
    root, centres = kmeans
    model = tmp_path / "model"
    shutil.copytree(root / "ours", model)

    def old(meta):
        for key in ("files", "save_id", "shapes", "manifest_sha256"):
            meta.pop(key)

    _edit_ml(model, old)
    with pytest.warns(hi.UnverifiedModelWarning, match="save it again"):
        np.testing.assert_array_equal(ml.KMeansModel.load(str(model)).cluster_centers, centres)
    arrays = model / "arrays.npz"
    at = arrays.read_bytes().find(centres.astype(np.float64).tobytes())
    assert at > 0
    _flip(arrays, at=(at + 4) / arrays.stat().st_size)  # in the centres: their CRC-32 differs
    with (
        pytest.warns(hi.UnverifiedModelWarning),
        pytest.raises(hi.SavedModelError, match="not a readable npz"),
    ):
        ml.KMeansModel.load(str(model))


def test_a_model_holding_nan_is_not_saved(tmp_path):
    from coordinator._table_io import write_part
    from hybrid_iter.ml._persist import write_model

    with pytest.raises(hi.SavedModelError, match=r"centres\[1, 0\] is nan"):
        write_model(str(tmp_path / "ml"), "KMeansModel", {}, {"centres": [[0.0], [np.nan]]})
    assert not (tmp_path / "ml" / "metadata.json").exists()
    with pytest.raises(hi.SavedModelError, match=r"holds inf at key 7 \(column 1\)"):
        write_part(
            str(tmp_path / "ps"), "w", 0, np.array([5, 7]), np.array([[0, 1], [2, np.inf]]), "x"
        )
    assert not (tmp_path / "ps" / "tables").exists()
