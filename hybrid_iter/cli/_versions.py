"""``hybrid-iter version``: versions of the stack, Java included."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

_VERSION_DISTRIBUTIONS = ("hybrid-iter", "pyspark", "ray", "raydp", "numpy", "pyarrow", "pandas")


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _java_version() -> str:
    try:
        proc = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as ex:
        return f"not usable ({ex.__class__.__name__})"
    # `java -version` prints `openjdk version "17.0.15" 2025-04-15` on stderr
    m = re.search(r'version "([^"]+)"', proc.stderr)
    return m.group(1) if m else "unknown"


def versions() -> dict[str, str]:
    """Versions of this package, Python, the engines and Java, as plain strings."""
    found = {"python": sys.version.split()[0]}
    found.update({name: _version_of(name) for name in _VERSION_DISTRIBUTIONS})
    found["java"] = _java_version()
    return found
