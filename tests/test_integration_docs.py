"""The examples of docs/integrations.md run as written, each in a fresh process in an empty
directory: the blocks marked ``<!-- file: NAME -->`` are written out under their names and the
scripts run with this interpreter, the repository importable. The Lightning example starts
its second process through Lightning's own launcher (ZeRO-2 on 2 gloo ranks); the Trainer's
runs Hugging Face's ZeRO-3 config, "auto" values and all, then loads what save_model wrote.

The engine itself imports none of the frameworks: every module of chunkmem/, zero/, offload/
and kernels/ is read for their names, but for chunkmem/integrations/ and the command line
(chunkmem/cli/, which builds an ``hf:`` model for ``chunkmem estimate`` when asked to).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.thread_count import ROOT, child_env

DOC = ROOT / "docs" / "integrations.md"
FRAMEWORKS = {"lightning", "pytorch_lightning", "transformers", "accelerate", "trl", "peft"}


def doc_files() -> dict[str, str]:
    """Each ``<!-- file: NAME -->`` block of the doc: name -> contents."""
    pattern = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)\n```", re.DOTALL)
    return {name: body + "\n" for name, body in pattern.findall(DOC.read_text())}


@pytest.mark.parametrize(
    ("script", "framework", "printed"),
    [
        ("train_lightning.py", "lightning", r"rank 0: 8 steps, loss \d"),
        ("train_hf.py", "transformers", r"8 steps, loss \d.*, 656,512 parameters"),
    ],
)
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_docs_example_runs(tmp_path: Path, script: str, framework: str, printed: str) -> None:
    pytest.importorskip(framework)
    files = doc_files()
    assert {"train_lightning.py", "train_hf.py", "ds_config_zero3.json"} <= set(files)
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    result = subprocess.run(
        [sys.executable, script], cwd=tmp_path, env=child_env(), capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert re.search(printed, result.stdout), result.stdout[-3000:]


def test_the_engine_never_imports_a_training_framework() -> None:
    offending = []
    for package in ("chunkmem", "zero", "offload", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if {"integrations", "cli"} & set(path.relative_to(ROOT).parts):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                offending += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                    for name in names
                    if name.split(".")[0] in FRAMEWORKS
                ]
    assert offending == []
