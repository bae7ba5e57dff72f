"""``ps.train``'s argument checks that read the data's schema: ``init`` split into dense
parameters and tables, the id columns of each table, the feature columns, evaluation.
Driver, before any Spark job."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import IterationConfigError
from ..ml._base import check_dataframe, check_int
from ..ml._features import VECTOR, column_kind, resolve_features
from ._epochs import METRICS
from ._tables import Table

__all__ = ["check_eval", "check_keys", "column_type", "feature_columns", "split_init"]


_ID_HINT = (
    "ids are read from integer columns (long, int, short, byte), arrays of them (any "
    "length per row) or vector columns (pyspark.ml.linalg SparseVector/DenseVector)"
)


def _is_id_type(dtype: Any) -> bool:
    from pyspark.sql import types as T

    if type(dtype).__name__ == "VectorUDT":
        return True
    if isinstance(dtype, T.ArrayType):
        return isinstance(dtype.elementType, T.IntegralType)
    return isinstance(dtype, T.IntegralType)


def split_init(init: Any) -> tuple[Any, dict[str, Table]]:
    """``init``'s dense part (an array, a dict, or None) and its tables, by name."""
    if isinstance(init, Table):
        raise IterationConfigError(
            "a ps.Table must be named: pass init={'w': ps.Table(...), ...} (and keys={'w': "
            "'<id column>'})"
        )
    if not isinstance(init, Mapping):
        return init, {}
    tables = {k: v for k, v in init.items() if isinstance(v, Table)}
    seen: dict[int, str] = {}
    for name, t in tables.items():
        if id(t) in seen:
            raise IterationConfigError(
                f"init declares the table {seen[id(t)]!r} twice: {name!r} is the same "
                f"ps.Table object, so both would get the same rows (same seed, same keys); "
                f"give each name its own ps.Table(...)"
            )
        seen[id(t)] = name
    if not tables:
        return init, {}
    dense = {k: v for k, v in init.items() if k not in tables}
    return (dense or None), tables


def check_keys(
    df: Any,
    tables: Mapping[str, Table],
    keys: Any,
    sparse_columns: Any,
    dense_names: Sequence[str],
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Each table's key columns and every column read as CSR, checked against ``df``."""
    fields = {f.name: f for f in df.schema.fields}
    out: dict[str, tuple[str, ...]] = {}
    if keys is None:
        keys = {}
    if not isinstance(keys, Mapping):
        raise IterationConfigError(
            f"ps.train(keys=...) must map each table's name to its id column(s), e.g. "
            f"keys={{'w': 'ids'}}, got {type(keys).__name__}"
        )
    for name in keys:
        if name not in tables:
            what = (
                "a dense parameter (only a ps.Table takes keys)"
                if name in dense_names
                else "not in init"
            )
            raise IterationConfigError(
                f"ps.train(keys=...) names {name!r}, which is {what}; tables: {sorted(tables)}"
            )
    for name in tables:
        if name not in keys:
            raise IterationConfigError(
                f"ps.train(keys=...) gives no id column for the table {name!r}: add "
                f"keys={{{name!r}: '<column of its ids>'}}"
            )
        given = keys[name]
        cols: tuple[str, ...] = (
            (given,)
            if isinstance(given, str)
            else tuple(given)
            if isinstance(given, Sequence)
            else ()
        )
        if not cols or not all(isinstance(c, str) and c for c in cols):
            raise IterationConfigError(
                f"ps.train(keys={{{name!r}: ...}}) must be a column name or a non-empty list "
                f"of them, got {given!r}"
            )
        if len(set(cols)) != len(cols):
            raise IterationConfigError(
                f"ps.train(keys={{{name!r}: {list(cols)}}}) lists a column twice; list each once"
            )
        out[name] = cols
    if isinstance(sparse_columns, str) or not isinstance(sparse_columns, Sequence):
        raise IterationConfigError(
            f"ps.train(sparse_columns=...) must be a list of column names, got {sparse_columns!r}"
        )
    every = list(dict.fromkeys([c for cols in out.values() for c in cols] + list(sparse_columns)))
    for c in every:
        where = "sparse_columns" if c in sparse_columns else "keys"
        if c not in fields:
            raise IterationConfigError(
                f"ps.train({where}=...): column {c!r} is not in the DataFrame; its columns "
                f"are {list(fields)}"
            )
        dtype = fields[c].dataType
        if not _is_id_type(dtype):
            cast = (
                f"F.col({c!r}).cast('array<long>')"
                if type(dtype).__name__ == "ArrayType"
                else f"F.col({c!r}).cast('long')"
            )
            raise IterationConfigError(
                f"ps.train({where}=...): the id column {c!r} has type "
                f"{dtype.simpleString()}, which is not integral; {_ID_HINT}. Cast it "
                f"({cast}) or hash it to integers first"
            )
    return out, tuple(every)


def feature_columns(df: Any, columns: Any, csr: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The dense columns (numeric, arrays, vectors) besides the CSR ones, and the width of
    each dense vector column."""
    fields = {f.name: f for f in df.schema.fields}
    if columns is None:
        names = [
            n for n, f in fields.items() if column_kind(f.dataType) is not None and n not in csr
        ]
        if not names and not csr:
            raise IterationConfigError(
                "ps.train: the DataFrame has no numeric, array or vector column to train on"
            )
    elif isinstance(columns, str) or not isinstance(columns, Sequence) or not columns:
        raise IterationConfigError(
            f"ps.train(columns=...) must be a non-empty list of column names (or None for "
            f"every numeric, array and vector column), got {columns!r}"
        )
    else:
        names = []
        for n in columns:
            if n not in fields:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} is not in the DataFrame; its "
                    f"columns are {list(fields)}"
                )
            if n in csr:
                continue  # read as CSR
            if column_kind(fields[n].dataType) is None:
                raise IterationConfigError(
                    f"ps.train(columns=...): column {n!r} has type "
                    f"{fields[n].dataType.simpleString()}, which is not numeric, an array "
                    f"of numbers or a vector; cast it or leave it out"
                )
            names.append(n)
    widths = {
        n: resolve_features(df, n, param="ps.train(columns=...)").dim
        for n in names
        if column_kind(fields[n].dataType) == VECTOR
    }
    return names, widths


def check_eval(
    eval_df: Any,
    predict_fn: Any,
    eval_metrics: Any,
    label_col: Any,
    early_stopping: Any,
    needed: Sequence[str],
) -> tuple[tuple[str, ...], int | None]:
    if eval_df is None:
        if early_stopping is not None:
            raise IterationConfigError(
                "ps.train(early_stopping=...) stops on an evaluation metric: give eval_df= "
                "and predict_fn= too"
            )
        return (), None
    check_dataframe("ps.train", eval_df, call="ps.train(eval_df=...)")
    if not callable(predict_fn):
        raise IterationConfigError(
            "ps.train(eval_df=...) needs predict_fn(params, batch) -> one score per row (a "
            "probability for the log loss)"
        )
    metrics = (eval_metrics,) if isinstance(eval_metrics, str) else tuple(eval_metrics or ())
    if not metrics or any(m not in METRICS for m in metrics):
        raise IterationConfigError(
            f"ps.train(eval_metrics=...) must name metrics among {sorted(METRICS)}, got "
            f"{eval_metrics!r}"
        )
    cols = set(eval_df.columns)
    if not isinstance(label_col, str) or label_col not in cols:
        raise IterationConfigError(
            f"ps.train(label_col={label_col!r}) must be a column of eval_df (its columns are "
            f"{eval_df.columns})"
        )
    missing = [c for c in needed if c not in cols]
    if missing:
        raise IterationConfigError(
            f"ps.train(eval_df=...) lacks the column(s) {missing} that training reads; "
            f"predict_fn gets the same columns as grad_fn"
        )
    check_int("ps.train", "early_stopping", early_stopping, minimum=1, optional=True)
    return metrics, early_stopping


def column_type(df: Any, name: str) -> Any:
    return next(f.dataType for f in df.schema.fields if f.name == name)
