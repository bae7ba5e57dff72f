"""The ``pyspark.ml`` side of ``hybrid_iter.ml``: Params declared once with both their
Spark name (``maxIter``) and their Python keyword (``max_iter``), and persistence that
``Pipeline`` / ``PipelineModel.save`` / ``load`` understand. Runs on the driver.

An estimator or model class lists its parameters as ``ParamSpec`` rows in ``_SPECS``;
``StageParams`` turns each into a ``pyspark.ml.param.Param`` (so ``ParamGridBuilder``,
``CrossValidator``, ``copy(extra)`` and ``explainParams`` work), a ``getX`` / ``setX``
pair, and -- where the keyword differs from the Spark name -- a read-only attribute
(``est.max_iter``). Constructors take either spelling: ``LogisticRegression(max_iter=50)``
or ``LogisticRegression(maxIter=50)``. Values are checked when set and again before a fit
(a param map given to ``fit(df, params)`` bypasses the constructor).

``StageEstimator`` and ``StageModel`` are the bases of every estimator and model
(``linear``, ``kmeans``): keyword construction, ``fit(df)`` / ``fit(df, paramMap)`` /
``copy(extra)`` (pyspark's), the fitted model with the estimator's values and uid, its
arrays, summary and ``result``, and ``transform(df, params, features_col=...)``.

Persistence: ``model.write().save(path)`` (what a ``PipelineModel`` calls) writes Spark's
``DefaultParamsWriter`` metadata and the arrays under ``path/data`` (``_persist``);
``model.save(path)`` writes our own format (any ``pyarrow.fs`` URI, no Spark needed);
``Model.load(path)`` and ``XModel.load(path)`` read both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pyspark.ml import Estimator
from pyspark.ml import Model as SparkModel
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsReader,
    DefaultParamsWritable,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from .._errors import IterationConfigError, ModelExistsError, ModelNotFoundError
from ._base import check_features_col, check_int, check_number, check_progress

__all__ = [
    "ParamSpec",
    "StageEstimator",
    "StageModel",
    "StageModelReader",
    "StageModelWriter",
    "StageParams",
    "choice_check",
    "features_check",
    "int_check",
    "number_check",
    "progress_check",
]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: Python keyword, Spark name, default, doc, and a check
    ``check(owner, keyword, value)`` that raises ``IterationConfigError``."""

    snake: str
    spark: str
    default: Any
    doc: str
    check: Callable[[str, str, Any], Any] | None = None


# -- checks for ParamSpec rows: ``check(owner, keyword, value)`` -----------------------------


def int_check(minimum: int, optional: bool = False) -> Callable[[str, str, Any], None]:
    """An int ``>= minimum`` (or None when ``optional``)."""
    return lambda o, n, v: check_int(o, n, v, minimum=minimum, optional=optional)


def number_check(**kw: Any) -> Callable[[str, str, Any], None]:
    """A number in a range (``check_number``'s keywords)."""
    return lambda o, n, v: check_number(o, n, v, **kw)


def choice_check(*choices: Any) -> Callable[[str, str, Any], None]:
    """One of ``choices``."""

    def check(owner: str, name: str, value: Any) -> None:
        if value not in choices:
            raise IterationConfigError(
                f"{owner}({name}=...) must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )

    return check


def features_check(owner: str, name: str, value: Any) -> None:
    """A vector or array column's name, or a list of numeric columns' names."""
    check_features_col(owner, value)


def progress_check(owner: str, name: str, value: Any) -> None:
    check_progress(owner, value)


def _cap(name: str) -> str:
    return name[0].upper() + name[1:]


def _getter(spark_name: str) -> Callable[[Any], Any]:
    return lambda self: self.getOrDefault(spark_name)


class StageParams(Params):
    """Params from ``_SPECS``; ``_init_params(kwargs)`` in the subclass constructor."""

    _SPECS: ClassVar[tuple[ParamSpec, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for spec in cls.__dict__.get("_SPECS", ()):
            setattr(
                cls,
                spec.spark,
                Param(Params._dummy(), spec.spark, spec.doc, TypeConverters.identity),
            )
            for prefix, fn in (
                ("get", lambda self, _n=spec.spark: self.getOrDefault(_n)),
                ("set", lambda self, value, _n=spec.spark: self._set_checked({_n: value})),
            ):
                name = prefix + _cap(spec.spark)
                if name not in cls.__dict__:
                    setattr(cls, name, fn)
            if spec.snake != spec.spark and spec.snake not in cls.__dict__:
                setattr(cls, spec.snake, property(_getter(spec.spark)))

    @classmethod
    def _all_specs(cls) -> dict[str, ParamSpec]:
        out: dict[str, ParamSpec] = {}
        for klass in reversed(cls.__mro__):
            for spec in klass.__dict__.get("_SPECS", ()):
                out[spec.spark] = spec
        return out

    def _init_params(self, kwargs: Mapping[str, Any]) -> None:
        specs = self._all_specs()
        self._setDefault(**{s.spark: s.default for s in specs.values()})
        self._set_checked(dict(kwargs))

    def _set_checked(self, kwargs: Mapping[str, Any]) -> Any:
        specs = self._all_specs()
        by_snake = {s.snake: s for s in specs.values()}
        given: dict[str, Any] = {}
        for key, value in kwargs.items():
            spec = specs.get(key) or by_snake.get(key)
            if spec is None:
                names = ", ".join(s.snake for s in specs.values())
                raise IterationConfigError(
                    f"{type(self).__name__}() got an unknown parameter {key!r}; its "
                    f"parameters are {names} (or their Spark names)"
                )
            if spec.check is not None:
                spec.check(type(self).__name__, spec.snake, value)
            given[spec.spark] = value
        self._set(**given)
        return self

    def value(self, snake: str) -> Any:
        """A parameter's value by its Python keyword (or Spark name)."""
        specs = self._all_specs()
        spec = specs.get(snake) or {s.snake: s for s in specs.values()}[snake]
        return self.getOrDefault(spec.spark)

    def is_set(self, snake: str) -> bool:
        specs = self._all_specs()
        spec = specs.get(snake) or {s.snake: s for s in specs.values()}[snake]
        return self.isSet(spec.spark)

    def check_params(self) -> None:
        """Check every value again (a param map may have bypassed the setters)."""
        owner = type(self).__name__
        for spec in self._all_specs().values():
            if spec.check is not None:
                spec.check(owner, spec.snake, self.getOrDefault(spec.spark))

    def param_values(self) -> dict[str, Any]:
        """``{Spark name: value}`` of every parameter (JSON-friendly)."""
        out = {}
        for name in self._all_specs():
            v = self.getOrDefault(name)
            out[name] = list(v) if isinstance(v, tuple) else v
        return out

    def replace(self, **kwargs: Any) -> Any:
        """A copy with some parameters changed (keywords in either spelling)."""
        that = self.copy()
        that._set_checked(kwargs)
        return that


class StageModelWriter(MLWriter):
    """Spark's metadata (``DefaultParamsWriter``) plus the arrays under ``path/data``."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        from ._persist import data_dir, has_spark_metadata, saved_layout, write_model

        # ``write().overwrite()`` has emptied ``path`` by now (pyspark's MLWriter.save);
        # a model ``save`` wrote there would otherwise be the one ``Model.load`` reads
        if saved_layout(path) == "ours":
            raise ModelExistsError(
                f"{path!r} already holds a model saved by model.save(path); replace it with "
                f"model.write().overwrite().save({path!r}), or choose another path"
            )
        # looked at, not read off Spark's error: any other failure of the write is its own
        if has_spark_metadata(path):
            raise ModelExistsError(
                f"{path!r} already holds a saved model; replace it with "
                f"model.write().overwrite().save({path!r}) (as in pyspark.ml), or choose "
                f"another path"
            )
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc)
        write_model(
            data_dir(path),
            type(self.instance).__name__,
            self.instance.param_values(),
            self.instance._arrays,
            overwrite=True,
        )


class StageModelReader(MLReader):
    """Reads what ``StageModelWriter`` wrote."""

    def __init__(self, cls: type[Any]) -> None:  # a model class with _from_arrays
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        from ._persist import data_dir, has_spark_metadata, read_model

        # looked at, not read off Spark's error: any other failure of the read is its own
        if not has_spark_metadata(path):
            raise ModelNotFoundError(
                f"{path!r} holds no model written by model.write().save(path) (Spark's "
                f"metadata is missing): a wrong path, or a save that did not finish; a model "
                f"saved by model.save(path) loads with {self.cls.__name__}.load(path)"
            )
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        _, _, arrays = read_model(data_dir(path))
        model = self.cls._from_arrays(arrays)
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model


class StageModelIO(MLReadable, MLWritable):
    """``write()`` / ``read()`` for a model with ``_arrays`` and ``_from_arrays``."""

    def write(self) -> MLWriter:
        return StageModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return StageModelReader(cls)


class StageEstimator(StageParams, Estimator, DefaultParamsReadable, DefaultParamsWritable):
    """An estimator: keyword construction (either spelling, checked), ``fit(df)`` and
    ``fit(df, paramMap)`` (pyspark's ``Estimator.fit`` calls the subclass's ``_fit`` on a
    ``copy(paramMap)``); ``_fit`` starts with ``check_params()``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._init_params(kwargs)
        self._check_cross()

    def _check_cross(self) -> None:
        """Checks across parameters (on creation and before each fit); none by default."""

    def _model(self, model_cls: Any, arrays: dict[str, Any], result: Any, summary: Any) -> Any:
        """The fitted model: the arrays, this estimator's values and uid (as MLlib)."""
        model = model_cls._from_arrays(arrays, result=result, summary=summary)
        self._copyValues(model)
        return model._set_parent(self)

    def __repr__(self) -> str:
        given = ", ".join(
            f"{s.snake}={self.getOrDefault(s.spark)!r}"
            for s in self._all_specs().values()
            if self.isSet(s.spark)
        )
        return f"{type(self).__name__}({given})"


class StageModel(StageParams, SparkModel, StageModelIO):
    """A fitted model: numpy arrays (``_arrays``, what is saved), the estimator's
    parameters, the training's ``result`` (``IterationResult``) and ``summary`` (a
    loaded model has neither); our ``save``/``load`` and Spark's ``write``/``read``.
    Subclasses implement ``_transform(dataset, features_col)``; ``StageModel.load(path)``
    (public as ``hybrid_iter.ml.Model.load``) finds them by class name."""

    #: every model class by name, as it registered when its module was imported
    _registry: ClassVar[dict[str, type[StageModel]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        StageModel._registry[cls.__name__] = cls

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._init_params(kwargs)
        self._arrays: dict[str, np.ndarray] = {}
        self.result: Any = None
        self._summary: Any = None

    @classmethod
    def _from_arrays(
        cls, arrays: Mapping[str, np.ndarray], *, result: Any = None, summary: Any = None
    ) -> Any:
        model = cls()
        model._arrays = {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}
        model.result = result
        model._summary = summary
        return model

    @classmethod
    def _from_saved(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        """A model from our own format (``save``): parameters by either name; names that
        are not parameters (an older format's extras) are left out."""
        model = cls._from_arrays(arrays)
        known = model._all_specs()
        snake = {s.snake for s in known.values()}
        model._set_checked({k: v for k, v in params.items() if k in known or k in snake})
        return model

    def _set_parent(self, parent: Any) -> Any:
        self._resetUid(parent.uid)
        return self

    @property
    def summary(self) -> Any:
        """The training summary (a loaded model has none)."""
        if self._summary is None:
            raise IterationConfigError(
                f"this {type(self).__name__} has no training summary (it was loaded)"
            )
        return self._summary

    @property
    def has_summary(self) -> bool:
        return self._summary is not None

    hasSummary = has_summary

    def save(self, path: str, *, overwrite: bool = False) -> str:  # type: ignore[override]
        """Write the model to ``path`` (a local path or a storage URI such as ``s3a://``) in our format;
        ``model.write().save(path)`` writes Spark's (what a ``PipelineModel`` does).
        ``load`` reads both."""
        from ._persist import write_model

        return write_model(
            path, type(self).__name__, self.param_values(), self._arrays, overwrite=overwrite
        )

    @classmethod
    def load(cls, path: str) -> Any:
        """Read a model saved by ``save`` or by ``write().save`` (Spark's layout, what a
        ``PipelineModel`` writes; needs a SparkSession). On ``StageModel`` itself
        (``hybrid_iter.ml.Model``, which imports every model module first): any model."""
        from ._persist import data_dir, read_model, spark_layout

        spark = spark_layout(path)
        name, params, arrays = read_model(data_dir(path) if spark else path)
        klass = StageModel._registry.get(name)
        if klass is None or not issubclass(klass, cls):
            raise IterationConfigError(f"{path!r} holds a {name}, not a {cls.__name__}")
        if spark:
            return klass.read().load(path)
        return klass._from_saved(params, arrays)

    def transform(self, dataset: Any, params: Any = None, *, features_col: Any = None) -> Any:
        """Add the output columns (Spark SQL expressions; every input column is kept).
        ``features_col`` reads the features from other columns than at training."""
        if params:
            return self.copy(params).transform(dataset, features_col=features_col)
        return self._transform(dataset, features_col)

    def _transform(self, dataset: Any, features_col: Any = None) -> Any:
        raise NotImplementedError  # each model's output columns

    def _features(self, features_col: Any) -> Any:
        return features_col if features_col is not None else self.value("features_col")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self._arrays.items())
        return f"{type(self).__name__}({shapes})"
