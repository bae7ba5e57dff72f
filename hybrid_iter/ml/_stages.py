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

Persistence: ``model.write().save(path)`` (what a ``PipelineModel`` calls) writes Spark's
``DefaultParamsWriter`` metadata and the arrays under ``path/data`` (``_persist``);
``Model.load(path)`` reads that, or a directory written by ``model.save(path)`` (our own
format, any ``pyarrow.fs`` URI, no Spark needed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from .._errors import IterationConfigError

__all__ = ["ParamSpec", "StageModelReader", "StageModelWriter", "StageParams"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: Python keyword, Spark name, default, doc, and a check
    ``check(owner, keyword, value)`` that raises ``IterationConfigError``."""

    snake: str
    spark: str
    default: Any
    doc: str
    check: Callable[[str, str, Any], Any] | None = None


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
        from ._persist import write_model

        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc)
        write_model(
            f"{path}/data",
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
        from ._persist import read_model

        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        _, _, arrays = read_model(f"{path}/data")
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
