"""Memory-trace reports of a run: JSON document, offline HTML page, PyTorch memory snapshot.

``engine.write_report(directory)`` calls :func:`write_report` with the formats from the
config (``report.formats``). How to read each file is in ``docs/reports.md``.
"""

from chunkmem.report.writer import FORMATS, write_report

__all__ = ["FORMATS", "write_report"]
