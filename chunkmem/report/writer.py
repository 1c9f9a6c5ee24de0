"""Write the requested report formats into a directory, each file atomically.

A file appears under its final name only once it is complete (written to a temporary file in
the same directory, flushed, then renamed over the target with :func:`os.replace`), so a run
killed mid-write leaves the previous report or none, never half of one.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

from chunkmem.errors import ConfigError
from chunkmem.ledger import Ledger
from chunkmem.report.html_page import render_html
from chunkmem.report.memory_trace import SCHEMA, build_memory_trace
from chunkmem.report.snapshot import build_snapshot
from chunkmem.report.summary import RunSummary

# MemoryViz.js (pytorch.org/memory_viz) unpickles protocols 2 to 4 only.
_SNAPSHOT_PICKLE_PROTOCOL = 4


class _Sources:
    """What the formats are rendered from, each built at most once per call."""

    def __init__(self, summary: RunSummary, ledger: Ledger) -> None:
        self.summary = summary
        self.ledger = ledger

    @cached_property
    def memory_trace(self) -> dict[str, Any]:
        return build_memory_trace(self.summary, self.ledger)


def _json_bytes(sources: _Sources) -> bytes:
    return json.dumps(sources.memory_trace, separators=(",", ":")).encode()


def _html_bytes(sources: _Sources) -> bytes:
    return render_html(sources.memory_trace).encode()


def _snapshot_bytes(sources: _Sources) -> bytes:
    snapshot = build_snapshot(sources.ledger)
    return pickle.dumps(snapshot, protocol=_SNAPSHOT_PICKLE_PROTOCOL)


FORMATS: dict[str, tuple[str, Callable[[_Sources], bytes]]] = {
    "json": ("memory_trace.json", _json_bytes),
    "html": ("memory_trace.html", _html_bytes),
    "snapshot": ("memory_snapshot.pickle", _snapshot_bytes),
}


def write_report(
    summary: RunSummary, ledger: Ledger, directory: Path, formats: Iterable[str]
) -> dict[str, Path]:
    """Write each format in ``formats`` into ``directory`` (created if missing).

    Returns format -> path of the written file. Every format is checked before any file is
    written, so a typo does not leave a partial set.
    """
    formats = list(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ConfigError(
            f"unknown report format(s) {unknown}; choose from {sorted(FORMATS)} "
            f"(config key 'report.formats')"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sources = _Sources(summary, ledger)
    written = {}
    for name in formats:
        filename, render = FORMATS[name]
        written[name] = _write_atomically(directory / filename, render(sources))
    return written


def rerender_html(trace_json: Path) -> Path:
    """Render ``memory_trace.json`` again into the ``memory_trace.html`` beside it (a run's
    report after a chunkmem upgrade, or one copied from another machine); returns its path.
    The page is rendered from the document alone, so nothing of the run is needed."""
    document = read_memory_trace(trace_json)
    return _write_atomically(
        trace_json.with_name(FORMATS["html"][0]), render_html(document).encode()
    )


def read_memory_trace(path: Path) -> dict[str, Any]:
    """A ``memory_trace.json`` document; a file of another schema raises, naming it."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read the memory trace {str(path)!r}: {error}") from None
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema != SCHEMA:
        raise ConfigError(
            f"{str(path)!r} is not a chunkmem memory trace of schema {SCHEMA!r} (it says "
            f"{schema!r}); re-render it with the chunkmem version that wrote it"
        )
    return document


def _write_atomically(path: Path, data: bytes) -> Path:
    # Not tempfile.mkstemp: its files are private (0600); this one gets the umask's mode.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path
