"""Benchmarks: each runs as ``python -m benchmarks.<name>`` (docs/benchmarks.md).

Importing the package starts the record of the repository code a run loads
(:mod:`benchmarks._measured_code`), in the benchmark and in every child that imports it.
"""

from benchmarks import _measured_code  # noqa: F401  (records at import)
