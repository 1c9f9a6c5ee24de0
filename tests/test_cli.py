"""The ``chunkmem`` command: help, exit codes on bad input, train / resume / report /
consolidate in one process, and 2 ranks stopped by SIGTERM then resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from chunkmem.cli import main
from chunkmem.cli.exit_codes import ExitCode, combine_rank_codes, exit_code_for
from chunkmem.cli.launch import without_nproc
from chunkmem.cli.settings import apply_overrides, load, parse_override
from chunkmem.errors import (
    CapacityError,
    CheckpointError,
    CollectiveError,
    ConfigError,
    NonFiniteError,
    OutOfMemoryError,
    TierFullError,
)
from tests.thread_count import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--set", "model.layers=1", "--set", "model.width=32", "--set", "model.seq=16",
    "--set", "train.batch=2", "--set", "train.data_bytes=100000",
    "--set", "device.capacity=16MiB", "--set", "train.sample_tokens=4",
]  # fmt: skip


@pytest.mark.parametrize("command", [[], ["train"], ["estimate"], ["report"], ["consolidate"]])
def test_every_subcommand_has_help(command: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: chunkmem")
    assert "exit codes: 0 ok" in out


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["fly"], ExitCode.USAGE, "invalid choice"),
        (["train", "--set", "zero.stag=2"], ExitCode.USAGE, "did you mean 'stage'"),
        (["train", "--set", "model.layrs=3"], ExitCode.USAGE, "did you mean 'layers'"),
        (["train", "--set", "train.steps=-1"], ExitCode.USAGE, "train.steps"),
        (["train", "--set", "nokeyvalue"], ExitCode.USAGE, "expected KEY=VALUE"),
        (["train", "--config", "/nonexistent/run.json"], ExitCode.USAGE, "does not exist"),
        (["train", "--data", "/nonexistent/text"], ExitCode.USAGE, "train.data"),
        (["train", "--nproc", "2"], ExitCode.USAGE, "zero.stage"),
        (["train", "--set", "device.capacity=64KiB"], ExitCode.OUT_OF_MEMORY, "capacity"),
        (["estimate", "--model", "nosuch.module:build"], ExitCode.USAGE, "cannot import"),
        (["estimate", "--model", "hf:/nonexistent-config"], ExitCode.USAGE, "hf:"),
        (
            ["estimate", "--max-model", "layers", "--set", "device.capacity=null"],
            ExitCode.USAGE,
            "needs the device memory",
        ),
        (
            ["estimate", "--max-model", "layrs", "--device-memory", "1GiB"],
            ExitCode.USAGE,
            "not an integer model key",
        ),
        (["estimate", "--device-memory", "64KiB"], ExitCode.OUT_OF_MEMORY, "does not fit"),
        (["estimate", "--device-memory", "lots"], ExitCode.USAGE, "--device-memory"),
        (["report", "/nonexistent/run"], ExitCode.USAGE, "does not exist"),
        (
            ["consolidate", "/nonexistent/ckpt", "out.safetensors"],
            ExitCode.CHECKPOINT,
            "no checkpoint",
        ),
    ],
)
def test_bad_input_exits_with_its_code(
    argv: list[str], code: ExitCode, says: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if argv[0] == "train":
        argv = [*argv, *TINY[:6], "--out", str(tmp_path / "run")]
    assert main(argv) == code
    captured = capsys.readouterr()
    assert says in captured.err + captured.out
    assert "Traceback" not in captured.err


def test_resume_with_nothing_to_resume_is_a_checkpoint_error(tmp_path: Path) -> None:
    assert main(["train", *TINY, "--out", str(tmp_path), "--resume"]) == ExitCode.CHECKPOINT


def test_exit_codes_follow_the_exception_type() -> None:
    assert exit_code_for(ConfigError("x")) is ExitCode.USAGE
    assert exit_code_for(CapacityError("x")) is ExitCode.OUT_OF_MEMORY
    assert exit_code_for(OutOfMemoryError("device", 2, 1, "x")) is ExitCode.OUT_OF_MEMORY
    assert exit_code_for(CollectiveError("all_gather", "world", (0, 1), 1.0, 1.0, "x")) is (
        ExitCode.COLLECTIVE
    )
    assert exit_code_for(FloatingPointError("norm is nan")) is ExitCode.DIVERGED
    assert exit_code_for(NonFiniteError("fp16 overflowed")) is ExitCode.DIVERGED
    assert exit_code_for(CheckpointError("x")) is ExitCode.CHECKPOINT
    assert exit_code_for(TierFullError("x")) is ExitCode.STORAGE
    assert exit_code_for(RuntimeError("x")) is ExitCode.INTERNAL
    # A rank's own failure wins over the collective failures it caused in its peers.
    assert combine_rank_codes([4, 3]) == 3
    assert combine_rank_codes([4, 4]) == 4
    assert combine_rank_codes([8, 8]) == 8
    assert combine_rank_codes([0, 137]) == 137


def test_overrides_parse_json_and_fall_back_to_strings() -> None:
    assert parse_override("zero.stage=2") == (["zero", "stage"], 2)
    assert parse_override("precision=bf16") == (["precision"], "bf16")
    assert parse_override("optimizer.betas=[0.9, 0.95]") == (["optimizer", "betas"], [0.9, 0.95])
    data = apply_overrides({"device": {"capacity": 1}}, ["device.capacity=2MiB", "a.b.c=true"])
    assert data == {"device": {"capacity": "2MiB"}, "a": {"b": {"c": True}}}
    with pytest.raises(ConfigError, match="'device.capacity' is 1, not a section"):
        apply_overrides({"device": {"capacity": 1}}, ["device.capacity.x=2"])
    assert without_nproc(["train", "--nproc", "2", "--nproc=3", "--out", "x"]) == [
        "train", "--out", "x",
    ]  # fmt: skip


def test_a_deepspeed_config_is_a_run_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": 2,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2},
                "chunkmem": {"device": {"type": "simulated", "capacity": "64MiB"}},
                "model": {"layers": 2},
            }
        )
    )
    settings, config = load(path, [], world_size=2)
    assert settings.train.batch == 3 and settings.model.layers == 2
    assert (config.precision, config.zero.stage, config.gradient_accumulation_steps) == (
        "bf16", 2, 2,
    )  # fmt: skip


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_checkpoints_resumes_reports_and_consolidates(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    argv = ["train", *TINY, "--out", str(run), "--set", "train.checkpoint_every=3"]
    argv += ["--set", "train.keep_checkpoints=3"]
    assert main([*argv, "--set", "train.steps=6"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "held-out loss" in out and "sample: " in out and "report (html)" in out
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3, 4, 5, 6]
    rss = [m["rss_bytes"] for m in _metrics(run)]  # the operating system's, per step
    assert all(100 << 20 < value < psutil.Process().memory_info().rss * 2 for value in rss)
    trace = json.loads((run / "report" / "memory_trace.json").read_text())
    assert trace["summary"]["peak_rss_bytes"] >= max(rss)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    assert (run / "report" / "memory_trace.html").is_file()

    # Continue the same run to step 8 from its newest checkpoint.
    assert main([*argv, "--set", "train.steps=8", "--resume"]) == ExitCode.OK
    assert "resumed from" in capsys.readouterr().out
    assert [m["step"] for m in _metrics(run)] == list(range(1, 9))

    # Branch off step 3 into a new directory: steps 4-6 are retrained bit for bit.
    branch = tmp_path / "branch"
    assert (
        main(
            [
                "train",
                *TINY,
                "--out",
                str(branch),
                "--set",
                "train.steps=6",
                "--resume",
                str(run / "checkpoints" / "step_000003"),
            ]
        )  # fmt: skip
        == ExitCode.OK
    )
    assert "steps 4-6 retrained after the resume: losses equal the earlier run's, bit for bit" in (
        capsys.readouterr().out
    )
    assert [m["loss"] for m in _metrics(branch)] == [m["loss"] for m in _metrics(run)[:6]]
    # Resuming there again would collide with the later checkpoints it left.
    assert main([*argv, "--resume", str(run / "checkpoints" / "step_000006")]) == (
        ExitCode.CHECKPOINT
    )
    assert "already holds later checkpoints" in capsys.readouterr().err

    (run / "report" / "memory_trace.html").unlink()
    assert main(["report", str(run), "--json"]) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert (run / "report" / "memory_trace.html").is_file()
    png = run / "report" / "memory_trace.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["reports"][0]["png"] == str(png)
    assert report["reports"][0]["global_steps"] == 8
    assert report["training"]["steps"] == 8

    assert (
        main([*argv, "--set", "train.steps=9", "--set", "train.keep_checkpoints=1", "--resume"])
        == 0
    )
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000009"]  # the rest go

    out_file = tmp_path / "model.safetensors"
    checkpoint = run / "checkpoints" / "step_000009"
    assert main(["consolidate", str(checkpoint), str(out_file)]) == ExitCode.OK
    assert out_file.stat().st_size > 0


def test_estimate_prints_a_table_and_json(capsys: pytest.CaptureFixture) -> None:
    argv = ["estimate", "--set", "zero.stage=3", "--world-size", "4", "--node-size", "2"]
    assert main([*argv, "--device-memory", "1GiB"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "device peak" in out and "cross-node" in out and "fits" in out
    assert main([*argv, "--json", "--set", "device.capacity=null"]) == ExitCode.OK
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 4 and result["wire"]["cross_node_bytes_per_rank"] > 0
    assert result["fits_on_device"] is None  # no device memory given
    assert main([*argv, "--device-memory", "16MiB", "--max-model", "layers", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert 1 <= found["largest_on_device"] <= found["largest_that_trains"]


def _spawn_train(run: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "chunkmem", "train", *TINY, "--out", str(run), *extra]
    env = child_env()
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.distributed
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_ranks_stop_together_on_a_signal_to_one_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ranks = ["--nproc", "2", "--set", "zero.stage=2", "--set", "train.steps=500"]
    launcher = _spawn_train(run, *ranks)
    deadline = time.monotonic() + 200
    while not (run / "metrics.jsonl").is_file() or len(_metrics(run)) < 3:
        assert launcher.poll() is None, launcher.communicate()[0]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    # The signal reaches rank 1 only; rank 0 hears of it in the per-step agreement.
    rank1 = next(
        p for p in psutil.Process(launcher.pid).children() if p.environ().get("RANK") == "1"
    )
    rank1.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=200)
    assert launcher.returncode == ExitCode.INTERRUPTED, out
    stopped = _metrics(run)[-1]["step"]
    assert stopped < 500
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{stopped:06d}"]
    assert (run / "report" / "rank0" / "memory_trace.json").is_file()
    assert (run / "report" / "rank1" / "memory_trace.json").is_file()

    resumed = _spawn_train(run, *ranks[:-2], "--set", f"train.steps={stopped + 2}", "--resume")
    out, _ = resumed.communicate(timeout=200)
    assert resumed.returncode == ExitCode.OK, out
    assert f"at step {stopped}" in out
    assert [m["step"] for m in _metrics(run)] == list(range(1, stopped + 3))
