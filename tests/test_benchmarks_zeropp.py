"""The pure parts of benchmarks.zeropp and benchmarks._common: the stated regime, the link
penalty, the bf16 decision, the launch watchdog, phases that fail without losing results,
and the environment block. No benchmark runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import zeropp
from benchmarks._common import cpu_flags, cpu_isa_overrides, environment


def test_round_down_keeps_two_significant_digits_and_never_rounds_up() -> None:
    assert zeropp.round_down(604_700_000) == 600_000_000
    assert zeropp.round_down(85_999) == 85_000
    assert zeropp.round_down(3.0e8) == 3.0e8


def test_stated_regime_makes_zero3_link_time_at_least_the_factor_of_its_compute() -> None:
    # 151 MB across the node boundary per step, half each way; 0.5 s of compute-only step.
    regime = zeropp.stated_regime(151_179_600, 0.5, 2.0)
    exact = 151_179_600 / 2 * 8 / (2.0 * 0.5)  # 604.7 Mbit/s would give exactly 2x
    assert regime["rate"] == "600000kbit"
    assert regime["rate_mbit_s"] == 600.0
    assert zeropp.rate_bits(regime["rate"]) == 600e6 <= exact
    assert regime["zero3_link_s"] == pytest.approx(151_179_600 / 2 * 8 / 600e6)
    assert 2.0 <= regime["zero3_link_over_compute"] < 2.02


def test_rate_bits_reads_tc_units_and_names_a_bad_one() -> None:
    assert zeropp.rate_bits("1gbit") == 1e9
    assert zeropp.rate_bits("10gbit") == 1e10
    assert zeropp.rate_bits("85000kbit") == 85e6
    with pytest.raises(ValueError, match="'1gbps' is not a number followed by one of"):
        zeropp.rate_bits("1gbps")


def test_link_penalty_removed_is_the_share_of_zero3s_link_penalty_a_config_avoids() -> None:
    # zero3: 1.0 s compute-only, 3.0 s over the link.
    assert zeropp.link_penalty_removed(3.0, 1.0, 1.0) == 1.0
    assert zeropp.link_penalty_removed(3.0, 3.0, 1.0) == 0.0
    assert zeropp.link_penalty_removed(3.0, 1.4, 1.0) == pytest.approx(0.8)
    assert zeropp.link_penalty_removed(1.0, 0.9, 1.0) is None  # no penalty to remove


def test_bf16_convergence_runs_in_full_at_speed_and_what_the_time_affords_otherwise() -> None:
    assert zeropp.bf16_steps(1.4, 300, 2.0, affordable_steps=7, min_steps=40) == (300, None)
    steps, why = zeropp.bf16_steps(16.1, 300, 2.0, affordable_steps=117, min_steps=40)
    assert steps == 110
    assert "16.1x an fp32 step" in why and "emulated" in why and "110 steps" in why
    assert zeropp.bf16_steps(16.1, 300, 2.0, affordable_steps=900, min_steps=40)[0] == 300
    with pytest.raises(zeropp.Skipped, match="affords 39 steps"):
        zeropp.bf16_steps(16.1, 300, 2.0, affordable_steps=39, min_steps=40)


def test_affordable_bf16_steps_add_the_bf16_compute_of_every_rank_sharing_a_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zeropp.os, "cpu_count", lambda: 2)  # 4 ranks: 2 per core
    # each step: 1.0 s measured in fp32 + 3 configs x 2 ranks per core x 0.5 s more compute
    assert zeropp.affordable_bf16_steps(400.0, 1.0, 0.5, 3) == 100
    assert zeropp.affordable_bf16_steps(-5.0, 1.0, 0.5, 3) == 0
    monkeypatch.setattr(zeropp.os, "cpu_count", lambda: 16)  # a core each
    assert zeropp.affordable_bf16_steps(400.0, 1.0, 0.5, 3) == 160


def test_first_report_deadline_grows_with_every_measured_time() -> None:
    base = zeropp.first_report_seconds(3.0, 1.0, 0.5, 0.0)
    assert base == zeropp.SLACK * zeropp.WORLD * 4.5
    assert zeropp.first_report_seconds(3.0, 1.0, 0.5, 2.0) == base + zeropp.SLACK * 2.0


def test_watchdog_allows_slack_times_the_longest_gap_between_reports() -> None:
    watchdog = zeropp.Watchdog(first_report_s=60.0, started=100.0)
    assert watchdog.deadline() == 160.0
    assert "no step reported within 60 s" in watchdog.why(161.0)
    watchdog.update(1, now=120.0)  # start to first step: 20 s
    assert watchdog.deadline() == 120.0 + zeropp.SLACK * 20.0
    watchdog.update(1, now=150.0)  # no new report: nothing changes
    watchdog.update(3, now=121.0)
    assert watchdog.deadline() == 121.0 + zeropp.SLACK * 20.0
    assert "after 3 steps" in watchdog.why(300.0)


def _processes(tmp_path: Path, code: str) -> list[subprocess.Popen]:
    processes = []
    for rank in range(2):
        with (tmp_path / f"rank{rank}.log").open("w") as log:
            command = [sys.executable, "-c", code.format(rank=rank)]
            processes.append(subprocess.Popen(command, stdout=log, stderr=log))
    return processes


def _watch(processes: list[subprocess.Popen], tmp_path: Path, first_report_s: float) -> None:
    try:
        zeropp._watch(processes, tmp_path, zeropp.Watchdog(first_report_s, zeropp.time.monotonic()))
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_a_rank_that_exits_with_an_error_fails_the_launch_with_its_output(tmp_path: Path) -> None:
    code = "import sys, time\nif {rank} == 1: print('out of memory'); sys.exit(3)\ntime.sleep(30)"
    with pytest.raises(zeropp.LaunchFailed, match="rank 1 exited with code 3") as failed:
        _watch(_processes(tmp_path, code), tmp_path, first_report_s=30.0)
    assert "out of memory" in str(failed.value)


def test_a_launch_that_reports_no_step_fails_at_its_deadline(tmp_path: Path) -> None:
    with pytest.raises(zeropp.LaunchFailed, match="no step reported within"):
        _watch(_processes(tmp_path, "import time; time.sleep(30)"), tmp_path, first_report_s=0.5)


def test_ranks_that_all_exit_cleanly_end_the_watch(tmp_path: Path) -> None:
    _watch(_processes(tmp_path, "pass"), tmp_path, first_report_s=30.0)


def _run(tmp_path: Path) -> zeropp.Run:
    return zeropp.Run(tmp_path / "zeropp.json", True, {"phases": {}})


def test_each_phase_writes_the_results_and_a_failure_keeps_earlier_ones(tmp_path: Path) -> None:
    run = _run(tmp_path)
    with run.phase("first"):
        run.details["measured"] = 1.0
    assert json.loads(run.path.read_text())["details"]["phases"]["first"]["status"] == "done"
    with run.phase("second"):
        raise RuntimeError("the link went away")
    with run.phase("third"):
        raise zeropp.Skipped("not root")
    document = json.loads(run.path.read_text())
    phases = document["details"]["phases"]
    assert document["details"]["measured"] == 1.0
    assert phases["second"]["status"] == "failed"
    assert phases["second"]["reason"] == "RuntimeError: the link went away"
    assert phases["third"] == {"status": "skipped", "reason": "not root", "wall_s": 0.0}
    assert not run.succeeded()
    assert document["emulated_speedup_vs_zero3_at_stated_regime"] is None


def test_an_interrupted_phase_is_recorded_then_raised(tmp_path: Path) -> None:
    run = _run(tmp_path)
    with pytest.raises(KeyboardInterrupt), run.phase("loopback"):
        raise KeyboardInterrupt
    phase = json.loads(run.path.read_text())["details"]["phases"]["loopback"]
    assert phase["status"] == "interrupted"


def test_a_phase_needing_an_incomplete_one_is_skipped_and_says_which() -> None:
    with pytest.raises(zeropp.Skipped, match="needs the loopback phase"):
        zeropp._needs({"loopback": None}, "loopback")


def test_cpu_flags_reports_the_bf16_relevant_flags_from_cpuinfo() -> None:
    cpuinfo = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nbugs\t: x\n"
    assert cpu_flags(cpuinfo) == {
        "avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False,
    }  # fmt: skip
    assert cpu_flags("processor\t: 0\n") is None


def test_cpu_isa_overrides_lists_only_the_caps_that_are_set() -> None:
    env = {"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/bin"}
    assert cpu_isa_overrides(env) == {"ATEN_CPU_CAPABILITY": "avx2"}


def test_environment_records_load_at_start_and_end_and_the_cpu() -> None:
    env = environment(quick=True)
    assert len(env["load_average_at_start_1_5_15_min"]) == 3
    assert len(env["load_average_at_end_1_5_15_min"]) == 3
    assert env["wall_s"] >= 0
    assert set(env["machine"]["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert env["machine"]["torch_cpu_capability"]
