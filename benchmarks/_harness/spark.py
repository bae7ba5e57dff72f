"""The plain local SparkSession a benchmark measures Spark's own operators with (no
hybrid_iter session): ``local[cores]``, bound to loopback, the UI off unless asked for
(then on a free port, for its REST API), no console progress bar, logs at ERROR."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["local_spark"]


def local_spark(
    app: str,
    cores: int,
    driver_memory: str,
    conf: Mapping[str, str] | None = None,
    *,
    ui: bool = False,
) -> Any:
    """A ``local[cores]`` SparkSession named ``app``; ``conf`` on top of the defaults."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    settings = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.memory": driver_memory,
        "spark.ui.enabled": "true" if ui else "false",
        **({"spark.ui.port": "0"} if ui else {}),
        "spark.ui.showConsoleProgress": "false",
        **(conf or {}),
    }
    builder = SparkSession.builder.master(f"local[{cores}]").appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
