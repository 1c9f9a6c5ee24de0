"""benchmarks._measured_code: the repository files a run loaded, its children's included.

Each case starts a fresh interpreter running a script as the run's first process (no record
inherited from the test's own), as ``python -m benchmarks.<name>`` does, so what the record
holds beyond its own can only have come from the child it launched."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import _recorded_child
from benchmarks._measured_code import REPOSITORY, VARIABLE, loaded_files

_RUN = """
import json, multiprocessing, subprocess, sys
from benchmarks import _measured_code

def child():
    import zero.ring

if __name__ == "__main__":
    how = sys.argv[1]
    if how == "command":
        subprocess.run(_measured_code.python_command("-c", "import sys, zero.ring; print(sys.argv)",
                                                     "x"), check=True)
    else:
        process = multiprocessing.get_context(how).Process(target=child)
        process.start()
        process.join()
        assert process.exitcode == 0
    own = _measured_code.loaded_files()
    print(json.dumps({"own": sorted(own), "record": _measured_code.measured_code()}))
"""


def _run(how: str, directory: Path) -> dict[str, list[str]]:
    script = directory / "probe_run.py"
    script.write_text(_RUN)
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    env["PYTHONPATH"] = str(REPOSITORY)
    done = subprocess.run(
        [sys.executable, str(script), how], env=env, cwd=REPOSITORY,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def test_loaded_files_keeps_only_this_repositorys_python_files() -> None:
    modules = [
        types.SimpleNamespace(__file__=str(REPOSITORY / "zero" / "ring.py")),
        types.SimpleNamespace(__file__=str(REPOSITORY / "tests" / "conftest.py")),
        types.SimpleNamespace(__file__=str(REPOSITORY / "kernels" / "_native.so")),
        types.SimpleNamespace(__file__=multiprocessing.__file__),
        types.SimpleNamespace(__file__=None),
    ]
    assert loaded_files(modules) == {"zero/ring.py"}


@pytest.mark.parametrize("how", ["spawn", "forkserver", "fork", "command"])
def test_a_childs_imports_join_the_run_record(how: str, tmp_path: Path) -> None:
    """Multiprocessing children (which leave through os._exit) and a python child run through
    python_command record what they loaded; the first process never loaded it itself."""
    result = _run(how, tmp_path)
    assert "zero/ring.py" not in result["own"]
    assert "zero/ring.py" in result["record"]
    assert set(result["own"]) <= set(result["record"])


def test_python_command_refuses_what_it_cannot_run() -> None:
    with pytest.raises(SystemExit, match="usage"):
        _recorded_child.main(["script.py"])
