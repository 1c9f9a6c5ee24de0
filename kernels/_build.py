"""Compiles a native library from kernels/csrc into a per-user cache, once per input.

[Note: build cache] The library lands in `<cache>/kernels/<name>-<key>/lib<name>.so`, where key
hashes the sources, the compiler's identity, the flags and anything else the caller names
(the CPU model for -march=native builds). A cache hit costs a stat. Builds write to a private
temporary name and rename it into place, so processes that build at the same time (the ranks
of a distributed test) each get a complete file and the last rename wins with identical bytes.
`CHUNKMEM_CACHE_DIR` overrides the cache root (default `$XDG_CACHE_HOME/chunkmem` or
`~/.cache/chunkmem`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class BuildError(RuntimeError):
    """A native library could not be built or loaded; the message says why."""


def cache_root() -> Path:
    explicit = os.environ.get("CHUNKMEM_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "chunkmem" / "kernels"


def find_tool(env_var: str, default: str) -> str:
    """Absolute path of the tool named by $env_var (or `default`) on PATH; BuildError if absent."""
    name = os.environ.get(env_var) or default
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"{name} not found on PATH (set {env_var} to a compiler)")
    return path


def _tool_identity(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{tool} --version failed: {e}") from e
    return out.stdout


def _local_headers(source: Path) -> list[Path]:
    """The headers of CSRC that `source` includes with `#include "..."`, directly or not, so
    that a library's cache key changes with its own headers only."""
    found: set[Path] = set()
    pending = [source]
    while pending:
        for name in _INCLUDE.findall(pending.pop().read_text()):
            header = CSRC / name
            if header not in found and header.is_file():
                found.add(header)
                pending.append(header)
    return sorted(found)


def build(name: str, tool: str, source: Path, flags: list[str], extra_key: str = "") -> Path:
    """Path of lib<name>.so compiled from `source` (and the CSRC headers it includes), building it
    on a cache miss. Raises BuildError with the compiler's output when the build fails."""
    digest = hashlib.sha256()
    for part in (_tool_identity(tool), " ".join(flags), extra_key):
        digest.update(part.encode() + b"\0")
    for path in [*_local_headers(source), source]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    target = cache_root() / f"{name}-{digest.hexdigest()[:16]}" / f"lib{name}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the build cache {target.parent}: {e}") from e
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    cmd = [tool, *flags, str(source), "-o", str(tmp)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd)} failed: {e}") from e
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        output = (result.stderr or result.stdout).strip()[-2000:]
        raise BuildError(f"{' '.join(cmd)} exited {result.returncode}:\n{output}")
    os.replace(tmp, target)
    return target
