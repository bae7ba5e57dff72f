"""``Session.local`` in a process of its own, with the JVM class archive cache of
``$HYBRID_ITER_CACHE_DIR`` (``tests/spark_ops/test_class_archive.py`` damages or exposes it first)::

    PYTHONPATH=tests:. python -c "import class_archive_job, sys; sys.exit(class_archive_job.main('local'))"

``main("spark")`` starts only the Spark half of ``Session.local`` (its ``SparkStart``, with
the arguments ``Session.local(1)`` gives it), without the Ray that starts beside it: the
class archive is chosen, checked, mapped and set aside there and nowhere else, and the
JVM is the one ``Session.local(1)`` would launch; a Ray start would only add its CPU.

Reports as one JSON line (prefixed with ``RESULT ``): the ``ClassArchiveWarning``\\ s the
start gave, the files of the cache the driver JVM maps (from ``/proc/<pid>/maps``), its
``-XX:SharedArchiveFile`` option, whether the session would make an archive in the
background, and an answer of Spark (the session works).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

RESULT_PREFIX = "RESULT "


def main(case: str) -> int:
    import hybrid_iter as hi
    from spark_ops._class_archive import archive_dir
    from spark_ops._spark_compat import jvm_pid

    assert case in ("local", "spark"), case
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "local":
            with hi.Session.local(1, warm_up=False) as session:
                count, mapped, cmdline = _answer(session.spark, jvm_pid)
                remakes = session._class_archive is not None
        else:
            from hybrid_iter._cluster.processes import prepare_process_env
            from hybrid_iter._session.checks import check_spark_version
            from hybrid_iter._session.local import SparkStart

            check_spark_version("class_archive_job")
            prepare_process_env()
            start = SparkStart(1, "hybrid_iter", "2g", os.cpu_count() or 1, None)
            start.begin()
            try:
                spark = start.result()
                count, mapped, cmdline = _answer(spark, jvm_pid)
                # what Session.local hands its warm-up to make (Session._class_archive)
                remakes = start.archive_key is not None
            finally:
                start.abandon()
    cache = str(archive_dir())
    report = {
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, hi.ClassArchiveWarning)
        ],
        "mapped": sorted(m for m in mapped if m.startswith(cache)),
        "option": [a for a in cmdline if a.startswith("-XX:SharedArchiveFile=")],
        "remakes": remakes,
        "count": count,
    }
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


def _answer(spark, jvm_pid):
    """An answer of Spark, the files the driver JVM maps and its command line."""
    count = spark.range(0, 100, 1, 2).count()
    pid = jvm_pid(spark)
    with open(f"/proc/{pid}/maps") as f:
        mapped = {line.split(maxsplit=5)[-1].strip() for line in f}
    with open(f"/proc/{pid}/cmdline") as f:
        cmdline = f.read().split("\0")
    return count, mapped, cmdline


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
