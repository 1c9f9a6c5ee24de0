"""benchmarks.staleness (`make bench-check`): which results are older than the code they
measure, on small throwaway git repositories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.staleness import (
    benchmark_imports,
    benchmark_name,
    check,
    main,
    measured_paths,
    uncommitted_measured_changes,
)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _commit(root: Path, files: dict[str, str], message: str = "change") -> str:
    _write(root, files)
    _git(root, "add", "--all")
    _git(root, "commit", "--quiet", "-m", message)
    return _git(root, "rev-parse", "HEAD")


def _result(
    root: Path,
    name: str,
    commit: str | None,
    dirty: bool | None = False,
    cuda: str | None = None,
    loaded: list[str] | None = None,
) -> Path:
    environment = {
        "commit": commit, "commit_dirty": dirty, "date": "2026-11-26T00:00:00+00:00", "cuda": cuda,
    }  # fmt: skip
    if loaded is not None:
        environment["measured_code"] = loaded
    path = root / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": 1.0, "environment": environment}))
    return path


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository with a library, two benchmarks (one using a helper) and the shared
    helpers; returns it and its first commit."""
    _git(tmp_path, "init", "--quiet")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    first = _commit(
        tmp_path,
        {
            "chunkmem/engine.py": "x = 1\n",
            "zero/ring.py": "y = 1\n",
            "benchmarks/__init__.py": "",
            "benchmarks/_common.py": "z = 1\n",
            "benchmarks/_timing.py": "t = 1\n",
            "benchmarks/helper.py": "from benchmarks._timing import t\n",
            "benchmarks/fast.py": "from benchmarks._common import z\n"
            "def main():\n    from benchmarks import helper\n",
            "benchmarks/other.py": "from benchmarks._common import z\n",
            "docs/benchmarks.md": "docs\n",
        },
    )
    return tmp_path, first


def test_benchmark_imports_finds_module_level_nested_and_package_imports() -> None:
    source = (
        "import os\nimport benchmarks._common\nfrom benchmarks.traffic_optimum import A\n"
        "from benchmarks import _timing, helper\nfrom chunkmem import x\n"
        "def f():\n    from benchmarks.zero_vs_peers import deepspeed_config\n"
    )
    assert benchmark_imports(source) == {
        "_common", "traffic_optimum", "_timing", "helper", "zero_vs_peers",
    }  # fmt: skip


def test_quick_and_variant_results_belong_to_their_benchmark() -> None:
    assert benchmark_name(Path("zeropp.json")) == "zeropp"
    assert benchmark_name(Path("zeropp.quick.json")) == "zeropp"
    assert benchmark_name(Path("zeropp.avx2.json")) == "zeropp"


def test_measured_paths_follow_imports_through_helpers(repo: tuple[Path, str]) -> None:
    root, _ = repo
    assert measured_paths(root, "fast") == [
        "chunkmem", "zero", "offload", "kernels",
        "benchmarks/_common.py", "benchmarks/_timing.py", "benchmarks/fast.py",
        "benchmarks/helper.py",
    ]  # fmt: skip
    assert measured_paths(root, "missing") is None


def test_fresh_when_only_results_docs_and_other_benchmarks_changed(repo: tuple[Path, str]) -> None:
    root, first = repo
    _commit(root, {"docs/benchmarks.md": "new\n", "benchmarks/other.py": "z = 2\n"})
    finding = check(root, _result(root, "fast.json", first))
    assert not finding.stale, finding.reasons


@pytest.mark.parametrize(
    "changed", ["chunkmem/engine.py", "zero/new.py", "benchmarks/fast.py", "benchmarks/_timing.py"]
)
def test_stale_when_measured_code_changed_since_its_commit(
    repo: tuple[Path, str], changed: str
) -> None:
    root, first = repo
    _commit(root, {changed: "changed = True\n"})
    finding = check(root, _result(root, "fast.quick.json", first))
    assert finding.stale
    assert changed in finding.reasons[0]


def test_cuda_sources_stale_only_results_measured_on_a_cuda_device(
    repo: tuple[Path, str],
) -> None:
    root, first = repo
    _commit(root, {"kernels/csrc/quant_cuda.cu": "// faster\n", "kernels/csrc/x.cuh": "//\n"})
    assert not check(root, _result(root, "fast.json", first)).stale
    on_gpu = check(root, _result(root, "fast.gpu.json", first, cuda="NVIDIA H200"))
    assert on_gpu.stale
    assert "kernels/csrc/quant_cuda.cu" in on_gpu.reasons[0]
    _commit(root, {"kernels/csrc/quant_cpu.cpp": "// faster\n"})
    assert check(root, _result(root, "fast.json", first)).stale


def test_a_change_undone_since_is_not_stale(repo: tuple[Path, str]) -> None:
    root, first = repo
    _commit(root, {"chunkmem/engine.py": "x = 2\n"})
    _commit(root, {"chunkmem/engine.py": "x = 1\n"})
    assert not check(root, _result(root, "fast.json", first)).stale


def test_dirty_measurement_is_stale_with_a_note(repo: tuple[Path, str]) -> None:
    root, first = repo
    finding = check(root, _result(root, "fast.json", first, dirty=True))
    assert finding.stale
    assert "uncommitted changes (commit_dirty)" in finding.reasons[0]


def test_unknown_or_missing_commit_is_stale(repo: tuple[Path, str]) -> None:
    root, _ = repo
    assert "not in this repository" in check(root, _result(root, "fast.json", "0" * 40)).reasons[0]
    assert check(root, _result(root, "fast.json", None)).reasons == ["no commit recorded"]


def test_results_without_a_benchmark_are_stale(repo: tuple[Path, str]) -> None:
    root, first = repo
    finding = check(root, _result(root, "gone.json", first))
    assert finding.reasons == ["no benchmarks/gone.py measures it"]


def test_main_lists_stale_results_and_exits_1_only_when_some_are(
    repo: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    root, first = repo
    _result(root, "fast.json", first)
    _result(root, "other.json", first)
    assert main(["--root", str(root)]) == 0
    _commit(root, {"benchmarks/fast.py": "z = 3\n"})
    assert main(["--root", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3].startswith("STALE  benchmarks/results/fast.json")
    assert out[-2].startswith("fresh  benchmarks/results/other.json")
    assert out[-1] == "1 of 2 results older than the code they measure"


def test_main_says_why_outside_a_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, {"benchmarks/fast.py": ""})
    _result(tmp_path, "fast.json", "abc")
    assert main(["--root", str(tmp_path)]) == 2
    assert "git rev-parse" in capsys.readouterr().err


def test_uncommitted_changes_count_only_measured_code(repo: tuple[Path, str]) -> None:
    root, _ = repo
    _write(root, {"docs/benchmarks.md": "edited during a run\n"})
    _result(root, "fast.json", None)  # an untracked result
    assert uncommitted_measured_changes(root) == []
    _write(root, {"zero/ring.py": "y = 2\n", "benchmarks/helper.py": "h = 2\n"})
    assert uncommitted_measured_changes(root) == ["benchmarks/helper.py", "zero/ring.py"]


def test_a_library_module_the_run_did_not_load_leaves_it_fresh(repo: tuple[Path, str]) -> None:
    root, first = repo
    _commit(root, {"zero/ring.py": "y = 2\n"})
    loaded_engine_only = ["chunkmem/engine.py", "benchmarks/fast.py"]
    assert not check(root, _result(root, "fast.json", first, loaded=loaded_engine_only)).stale
    loaded_ring_too = [*loaded_engine_only, "zero/ring.py"]
    finding = check(root, _result(root, "fast.json", first, loaded=loaded_ring_too))
    assert finding.stale and "zero/ring.py" in finding.reasons[0]
    # Without a record, the whole library counts (results from before the record began).
    assert check(root, _result(root, "fast.json", first)).stale


def test_library_sources_other_than_python_count_whatever_was_loaded(
    repo: tuple[Path, str],
) -> None:
    root, first = repo
    _commit(root, {"kernels/csrc/quant.cpp": "// faster\n"})
    finding = check(root, _result(root, "fast.json", first, loaded=["chunkmem/engine.py"]))
    assert finding.stale and "kernels/csrc/quant.cpp" in finding.reasons[0]


def test_a_loaded_benchmark_module_outside_the_static_imports_counts(
    repo: tuple[Path, str],
) -> None:
    root, first = repo
    _commit(root, {"benchmarks/other.py": "z = 2\n"})
    assert not check(root, _result(root, "fast.json", first, loaded=[])).stale
    finding = check(root, _result(root, "fast.json", first, loaded=["benchmarks/other.py"]))
    assert finding.stale and "benchmarks/other.py" in finding.reasons[0]
