"""Imports point down the layer stack, read from the real import graph of the source tree.

kernels/ at the bottom imports nothing of ours; the chunkmem core imports only itself and
kernels/; zero/ and offload/ sit on the core; report/ reads core data and never the engine;
the user surface (initialize, the engine, the command) may import everything. Every import
statement counts, those inside functions too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("chunkmem", "zero", "offload", "kernels")
USER_SURFACE = (
    "chunkmem.api",
    "chunkmem.engine",
    "chunkmem.eval_cycles",  # the engine's evaluation cycles
    "chunkmem.config_reference",
    "chunkmem.checkpoint",
    "chunkmem.cli",
    "chunkmem.estimate",
    "chunkmem.strategies",
    "chunkmem.integrations",
    "chunkmem.__main__",
)


def layer(module: str) -> str:
    if module.startswith("chunkmem.report"):
        return "report"
    if (
        module == "chunkmem"
        or module.startswith(USER_SURFACE)
        or module.startswith("chunkmem.models")
    ):
        return "surface"
    if module.startswith("chunkmem."):
        return "core"
    return module.split(".")[0]  # kernels, zero, offload


# Which layers each layer may import from.
ALLOWED = {
    "kernels": {"kernels"},
    "core": {"core", "kernels"},
    "report": {"report", "core"},
    "zero": {"zero", "core", "kernels"},
    "offload": {"offload", "core", "kernels"},
    "surface": {"surface", "report", "core", "zero", "offload", "kernels"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Modules of ours that ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in OURS}


def import_graph() -> dict[str, set[str]]:
    return {
        module_name(path): imports_of(path)
        for package in OURS
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_every_import_points_down_the_layer_stack() -> None:
    graph = import_graph()
    assert {"chunkmem.manager", "zero.comm", "kernels.ops", "chunkmem.report.writer"} <= set(graph)
    violations = [
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in graph.items()
        for target in targets
        if layer(target) not in ALLOWED[layer(module)]
    ]
    assert not violations, "\n".join(violations)


def test_the_layer_rule_catches_an_upward_import() -> None:
    """The check above can fail: the core importing zero/ or the engine is a violation."""
    assert layer("zero.strategy") not in ALLOWED[layer("chunkmem.manager")]
    assert layer("chunkmem.engine") not in ALLOWED[layer("chunkmem.report.writer")]
    assert layer("chunkmem.chunk") not in ALLOWED[layer("kernels.ops")]


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("zero.comm", ("chunkmem.engine", "chunkmem.api", "chunkmem.manager")),
        ("chunkmem.errors", ("chunkmem.engine", "chunkmem.config")),
        ("chunkmem.manager", ("chunkmem.engine", "zero", "chunkmem.report")),
        ("kernels", ("chunkmem", "zero")),
    ],
)
def test_importing_a_lower_layer_loads_nothing_above_it(
    module: str, absent: tuple[str, ...]
) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in sys.modules if m.startswith({absent!r})]\n"
        "print(','.join(loaded))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"import {module} loaded {result.stdout.strip()}"


def test_the_lazy_package_exports_what_it_lists() -> None:
    import chunkmem

    assert sorted(chunkmem.__all__) == sorted(chunkmem._PUBLIC)
    for name in chunkmem.__all__:
        assert getattr(chunkmem, name).__name__ == name


def test_the_core_never_names_the_kinds_of_sharding() -> None:
    """chunkmem/ acts on a chunk kind's properties (derived, gradient, ...); the kinds of
    sharding are zero/'s (zero/kinds.py), made and owned there."""
    names = {"GATHERED", "GRAD_SHARD", "HPZ_SECONDARY"}
    named = []
    for path in sorted((ROOT / "chunkmem").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            identifier = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if identifier in names:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {identifier}")
    assert named == []


def test_the_estimator_never_asks_which_stage_runs() -> None:
    """chunkmem/estimate/ composes the cost models of the seams (chunkmem/costs.py); a ZeRO
    stage, or a ZeRO++ switch, read there would be a second engine falling behind the first."""
    switches = {"stage", "quantized_weights", "quantized_gradients", "hpz_partition_size"}
    read = []
    for path in sorted((ROOT / "chunkmem" / "estimate").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in switches:
                read.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}")
    assert read == []
