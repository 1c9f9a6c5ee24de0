"""Which benchmark results are older than the code they measure (`make bench-check`).

A results file ``benchmarks/results/<name>.json`` (or ``<name>.quick.json``, or any
``<name>.<variant>.json``) measures the library (``chunkmem/``, ``zero/``, ``offload/``,
``kernels/``), its benchmark module ``benchmarks/<name>.py`` and every ``benchmarks`` module
that module imports, directly or through another (``_common``, ``_timing``,
``traffic_optimum``, ...). Where the result records the Python files its run loaded
(``environment.measured_code``, written since that record began: :mod:`benchmarks._measured_code`),
only those of the library's Python files count: a module the run never imported cannot have
changed what it measured, so a change to the NVMe tier leaves a stage-2 timing fresh. The
library's other files (C++ sources) always count. It is stale when that code differs between the commit recorded in
its ``environment`` block and ``HEAD``, when it was measured with uncommitted changes
(``commit_dirty``: the commit does not say which code ran), or when its commit is unknown
here. Results files themselves, docs, tests and uncommitted edits in the work tree are not
compared. CUDA sources (``*.cu``, ``*.cuh``) count only for results measured on a CUDA device
(``environment.cuda`` set): a run without one never builds or loads them.

Cheap by design: git and the standard library only (no torch, no benchmark runs), so it can
run in CI on every change. Exit status 1 when a result is stale, 0 when all are fresh.

    python -m benchmarks.staleness
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LIBRARY = ("chunkmem", "zero", "offload", "kernels")
# Code only a CUDA device builds and runs (kernels/_cuda.py loads it only when one is present).
DEVICE_ONLY = (":(exclude,glob)**/*.cu", ":(exclude,glob)**/*.cuh")
BENCHMARKS = "benchmarks"
RESULTS = f"{BENCHMARKS}/results"
# What a benchmark run measures, as git pathspecs: the library and the benchmarks, not results.
MEASURED = (*(f":(top){path}" for path in (*LIBRARY, BENCHMARKS)), f":(top,exclude){RESULTS}")


@dataclass
class Finding:
    """One results file against the code it measures."""

    result: str
    commit: str | None
    date: str | None
    stale: bool = False
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def mark_stale(self, reason: str) -> None:
        self.stale = True
        self.reasons.append(reason)


def benchmark_name(result: Path) -> str:
    """``zeropp.quick.json`` -> ``zeropp``: quick runs and variants (``<name>.<variant>.json``)
    measure the same module."""
    return result.name.split(".", 1)[0]


def benchmark_imports(source: str) -> set[str]:
    """The ``benchmarks`` modules a module's source imports anywhere (also inside functions),
    by module name: ``from benchmarks._timing import x`` and ``from benchmarks import
    _timing`` both give ``_timing``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == BENCHMARKS:
                modules = [f"{BENCHMARKS}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == BENCHMARKS and len(parts) > 1:
                names.add(parts[1])
    return names


def _module_path(root: Path, name: str) -> Path | None:
    for candidate in (root / BENCHMARKS / f"{name}.py", root / BENCHMARKS / name):
        if candidate.exists():
            return candidate
    return None


def measured_paths(root: Path, name: str) -> list[str] | None:
    """Paths (relative to ``root``) of the code that results of benchmark ``name`` measure:
    the library and the benchmark's modules, followed through their imports as they are in
    the work tree. None when ``benchmarks/<name>`` does not exist."""
    if _module_path(root, name) is None:
        return None
    seen: set[str] = set()
    todo = [name]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_path(root, module)
        if path is None:
            continue  # imported but absent: python would fail; the diff still covers it
        sources = [path] if path.is_file() else sorted(path.rglob("*.py"))
        for source in sources:
            todo.extend(benchmark_imports(source.read_text()))
    modules = []
    for module in sorted(seen):
        path = _module_path(root, module)
        modules.append(str(path.relative_to(root)) if path else f"{BENCHMARKS}/{module}.py")
    return [*LIBRARY, *modules]


def loaded_or_not_python(changed: Sequence[str], loaded: Sequence[str]) -> list[str]:
    """``changed`` less the library's Python files the run did not load
    (``environment.measured_code``): a module it never imported cannot have changed what it
    measured. The library's other files (the C++ sources its extensions build from) and the
    benchmark modules still count."""
    kept = set(loaded)
    return [
        path
        for path in changed
        if path in kept or not path.endswith(".py") or path.split("/", 1)[0] not in LIBRARY
    ]


def _git(root: Path, *args: str) -> str:
    """git's output; a failure raises with git's own message."""
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def uncommitted_measured_changes(root: Path) -> list[str]:
    """Tracked files under ``root`` whose uncommitted changes a benchmark run would measure:
    the library and ``benchmarks/`` (not its results). Docs, tests and the README run no
    benchmark code, so editing them during a run leaves its commit telling the truth."""
    return _git(root, "diff", "--name-only", "HEAD", "--", *MEASURED).splitlines()


def _resolve(root: Path, commit: str) -> str | None:
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except RuntimeError:
        return None


def check(root: Path, result: Path) -> Finding:
    """Is ``result`` (a results JSON under ``root``) as new as the code it measures at HEAD?"""
    relative = str(result.relative_to(root))
    try:
        environment = json.loads(result.read_text()).get("environment") or {}
    except (OSError, ValueError) as error:
        finding = Finding(relative, None, None)
        finding.mark_stale(f"unreadable: {error}")
        return finding
    commit = environment.get("commit")
    finding = Finding(relative, commit, environment.get("date"))
    paths = measured_paths(root, benchmark_name(result))
    if paths is None:
        finding.mark_stale(f"no {BENCHMARKS}/{benchmark_name(result)}.py measures it")
        return finding
    full = _resolve(root, commit) if commit and commit != "unknown" else None
    if full is None:
        finding.mark_stale(
            "no commit recorded" if not commit or commit == "unknown"
            else f"commit {commit} is not in this repository (history rewritten, or a shallow clone)"
        )  # fmt: skip
    else:
        if not environment.get("cuda"):
            paths = [*paths, *DEVICE_ONLY]
        loaded = environment.get("measured_code")
        if loaded is not None:
            paths = [*paths, *(p for p in loaded if p.split("/", 1)[0] == BENCHMARKS)]
        changed = _git(root, "diff", "--name-only", full, "HEAD", "--", *paths).splitlines()
        if loaded is not None:
            changed = loaded_or_not_python(changed, loaded)
        if changed:
            last = _git(root, "log", "-1", "--format=%h %cs", "HEAD", "--", *changed)
            shown = ", ".join(changed[:3]) + (
                f" and {len(changed) - 3} more" if changed[3:] else ""
            )
            finding.mark_stale(
                f"{len(changed)} measured file(s) changed since (last change {last}): {shown}"
            )
    dirty = environment.get("commit_dirty")
    if dirty:
        finding.mark_stale("measured with uncommitted changes (commit_dirty): the commit does "
                           "not say which code ran")  # fmt: skip
    elif dirty is None:
        finding.notes.append("commit_dirty not recorded")
    return finding


def check_all(root: Path) -> list[Finding]:
    """Every results file under ``root``; raises when ``root`` is no git work tree."""
    _git(root, "rev-parse", "--verify", "HEAD")
    return [check(root, result) for result in sorted((root / RESULTS).glob("*.json"))]


def report(findings: Sequence[Finding]) -> str:
    """One line per results file, stale ones first, then a count."""
    lines = []
    for finding in sorted(findings, key=lambda f: (not f.stale, f.result)):
        where = f"{(finding.commit or '?')[:8]} {(finding.date or '?')[:10]}"
        status = "STALE" if finding.stale else "fresh"
        why = "; ".join(finding.reasons + [f"note: {n}" for n in finding.notes])
        lines.append(
            f"{status}  {finding.result}  (measured at {where})" + (f": {why}" if why else "")
        )
    stale = sum(f.stale for f in findings)
    lines.append(f"{stale} of {len(findings)} results older than the code they measure")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.staleness", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parent.parent,
        help="the repository (default: this checkout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        findings = check_all(args.root.resolve())
    except RuntimeError as error:
        print(f"bench-check: {error}", file=sys.stderr)
        return 2
    print(report(findings))
    return 1 if any(f.stale for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
