"""Memory-trace reports of a run: JSON document, offline HTML page, PyTorch memory snapshot.

``engine.write_report(directory)`` calls :func:`write_report` with the engine's
:class:`RunSummary`, its ledger and the formats from the config (``report.formats``). How to
read each file is in ``docs/reports.md``. Nothing here imports the engine.
"""

from chunkmem.report.headline import headline
from chunkmem.report.summary import RunSummary
from chunkmem.report.writer import FORMATS, read_memory_trace, rerender_html, write_report

__all__ = [
    "FORMATS",
    "RunSummary",
    "headline",
    "read_memory_trace",
    "rerender_html",
    "write_report",
]
