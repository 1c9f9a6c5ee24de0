"""benchmarks/offload_overlap's arithmetic over its runs: the keys are medians over repeated
runs, the table shows the median run, the host-side bound is min(1, B / (r U)), the
dependency bound leaves out the chunk group whose gradients are final last, and the
hypervisor's steal is read per CPU and attributed per engine."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from benchmarks._steal import steal_between, steal_s
from benchmarks.offload_overlap import (
    COMPUTE_CORE,
    HOST_CORE,
    NARROWER_N_EMBD,
    StepSample,
    ablation_over_repeats,
    bound_at_steal,
    bounds_at_steal_over_repeats,
    build,
    combined_bound,
    host_bound,
    host_thread,
    host_thread_split,
    in_precision,
    keep_host_threads_on_host_core,
    last_final_share,
    median_repeat,
    model_for,
    one_step,
    over_repeats,
    probe_steal,
    steal_per_step,
    text_batches,
    unhidden,
    without_steal,
)


def analysis(ratio: float, hidden: float, rollback: float | None = None) -> dict:
    return {
        "step_time_ratio": {"median": ratio},
        "update_hidden_fraction": hidden,
        "rollback_step_time_ratio": rollback,
        "median_step_s": {"serial": 0.100, "serial_forward_backward": 0.070,
                          "serial_backward": 0.045},
    }  # fmt: skip


def test_keys_are_medians_over_the_repeats() -> None:
    runs = [analysis(0.90, 0.2, 1.2), analysis(0.80, 0.5, None), analysis(0.85, 0.4, 1.1)]
    assert over_repeats(runs, "ratio") == 0.85
    assert over_repeats(runs, "update_hidden_fraction") == 0.4
    # A repeat without a rollback step has no rollback ratio: the others' median.
    assert over_repeats(runs, "rollback_step_time_ratio") == pytest.approx(1.15)
    assert over_repeats([analysis(0.9, 0.1)], "rollback_step_time_ratio") is None


def test_the_median_repeat_is_the_lower_middle_by_ratio() -> None:
    runs = [analysis(0.90, 0.2), analysis(0.80, 0.5), analysis(0.85, 0.4)]
    assert median_repeat(runs) is runs[2]
    even = [analysis(0.90, 0.2), analysis(0.80, 0.5), analysis(0.85, 0.4), analysis(0.95, 0.1)]
    assert median_repeat(even) is even[2]


def test_the_host_bound_is_backward_over_the_slowed_update() -> None:
    run = analysis(0.85, 0.4)  # update U = 30 ms, backward B = 45 ms
    assert host_bound(run, {"ratio": 2.0}) == pytest.approx(0.045 / (2.0 * 0.030))
    assert host_bound(run, {"ratio": 1.2}) == 1.0  # backward outlasts the slowed update
    assert host_bound(run, None) is None  # not pinned: nothing measured
    assert host_bound({"median_step_s": None}, {"ratio": 1.0}) is None


def test_the_combined_bound_is_dependency_times_machine_under_the_host_bound() -> None:
    assert combined_bound(0.9, 0.8, None) == pytest.approx(0.72)
    assert combined_bound(0.9, 0.8, 1.0) == pytest.approx(0.72)
    assert combined_bound(0.9, 0.8, 0.6) == 0.6  # the host core is the tighter limit
    assert combined_bound(0.9, None, 0.6) is None  # the machine bound was not measured


def stolen(overlapped_s: float, serial_s: float, share: float = 0.3) -> dict:
    """An analysis whose overlapped engine met ``overlapped_s - serial_s`` more steal a step on
    the compute core in forward and backward than the serial one (update U = 30 ms, backward
    B = 45 ms, dependency bound 0.9; the update ``share`` of the serial step)."""
    run = analysis(0.85, 0.4)
    run["update_hidden_fraction_dependency_bound"] = 0.9
    run["host_update_share_of_serial_step"] = share
    run["unhidden_s"] = {"engine_thread_waiting_hypervisor_steal": overlapped_s - serial_s}
    return run


def steal_unread() -> dict:
    """An analysis of a run whose steal counter could not be read."""
    run = stolen(0.0, 0.0)
    run["unhidden_s"]["engine_thread_waiting_hypervisor_steal"] = None
    return run


def test_the_bound_at_the_hours_steal_takes_the_steal_beyond_the_serial_engines_off() -> None:
    # Combined bound 0.9 x 0.8 = 0.72 (the host bound min(1, 45 / (1.2 x 30)) = 1); 6 ms of
    # steal beyond the serial engine's is 0.2 of the 30 ms update: 0.52 at most, and the step
    # at least 1 - 0.52 x 0.3 of the serial one.
    bound = bound_at_steal(stolen(0.008, 0.002), 0.8, {"ratio": 1.2})
    assert bound is not None
    assert bound["update_hidden_fraction"] == pytest.approx(0.52)
    assert bound["step_time_ratio"] == pytest.approx(1.0 - 0.52 * 0.3)
    # The host core the tighter limit: min(1, 45 / (2.5 x 30)) = 0.6, less the same 0.2.
    host_limited = bound_at_steal(stolen(0.008, 0.002), 0.8, {"ratio": 2.5})
    assert host_limited is not None
    assert host_limited["update_hidden_fraction"] == pytest.approx(0.4)
    # The serial engine met more steal: its step was longer, so the bound is higher.
    serial_stolen = bound_at_steal(stolen(0.0, 0.003), 0.8, None)
    assert serial_stolen is not None
    assert serial_stolen["update_hidden_fraction"] == pytest.approx(0.82)
    # Not measured: no machine bound (a quick run), no steal counter, no kept steps.
    assert bound_at_steal(stolen(0.008, 0.002), None, None) is None
    assert bound_at_steal(steal_unread(), 0.8, None) is None
    nothing_kept = {"median_step_s": None, "update_hidden_fraction_dependency_bound": 0.9}
    assert bound_at_steal(nothing_kept, 0.8, None) is None  # every step clipped


def test_the_bounds_over_the_repeats_are_each_keys_own_median() -> None:
    # Bounds 0.52, 0.72 and 0.32; the step ratios they allow at shares 0.5, 0.3 and 0.4:
    # 0.74, 0.784 and 0.872. The bound's median is the first repeat's, the ratio's the second's.
    repeats = [stolen(0.008, 0.002, 0.5), stolen(0.002, 0.002, 0.3), stolen(0.014, 0.002, 0.4)]
    over = bounds_at_steal_over_repeats(repeats, 0.8, None)
    assert over is not None
    assert over["update_hidden_fraction"]["repeats"] == pytest.approx([0.52, 0.72, 0.32])
    assert over["update_hidden_fraction"]["median"] == pytest.approx(0.52)
    assert over["step_time_ratio"]["repeats"] == pytest.approx([0.74, 0.784, 0.872])
    assert over["step_time_ratio"]["median"] == pytest.approx(0.784)
    assert bounds_at_steal_over_repeats([*repeats, steal_unread()], 0.8, None) is None
    assert bounds_at_steal_over_repeats([], 0.8, None) is None


def test_the_plain_torch_probes_compute_in_the_engines_precision() -> None:
    model = model_for(2, n_layer=2, n_embd=NARROWER_N_EMBD)
    probed = in_precision(model, "bf16")
    assert {p.dtype for p in probed.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # a copy: the runs' own
    assert {p.dtype for p in in_precision(model, "fp32").parameters()} == {torch.float32}


def test_the_dependency_bound_leaves_out_the_group_final_last(tmp_path) -> None:
    engine = build(
        model_for(16, n_layer=2, n_embd=NARROWER_N_EMBD), True, 0.0, "host", str(tmp_path), "fp32"
    )
    try:
        finals = []
        listener = engine.reducer.listener
        announce = listener.final
        listener.final = lambda layout: (finals.append(layout), announce(layout))
        ((x, y),) = text_batches(16, 1)
        engine.backward(engine(x, y))
        engine.step()
        layouts = engine.manager.params.trainable_layouts()
        assert len(finals) == len(layouts) > 2
        last = finals[-1]  # the embedding's group: final when backward ends
        assert "wte.weight" in [slot.name for slot in last.slots]
        total = sum(slot.numel for layout in layouts for slot in layout.slots)
        share = sum(slot.numel for slot in last.slots) / total
        assert last_final_share(engine) == share
        assert 0 < share < 0.5
    finally:
        engine.close()


STAT = """cpu  100 0 50 900 0 0 0 40 0 0
cpu0 60 0 30 400 0 0 0 25 0 0
cpu1 40 0 20 500 0 0 0 15 0 0
intr 12345
"""


def test_steal_is_read_per_cpu_in_seconds(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    tick = os.sysconf("SC_CLK_TCK")
    assert steal_s((0, 1), str(stat)) == (25 / tick, 15 / tick)
    assert steal_s((1,), str(stat)) == (15 / tick,)
    assert steal_s((0, 2), str(stat)) is None  # a CPU the system does not list
    assert steal_s((0,), str(tmp_path / "missing")) is None  # not Linux
    assert steal_between((1.0, 2.0), (1.5, 2.25)) == (0.5, 0.25)
    assert steal_between(None, (1.0,)) is None


def sample(wall: float, cpu: float, steal: tuple[float, float] | None,
           step_call: float) -> StepSample:  # fmt: skip
    return StepSample(step_s=wall + step_call, forward_backward_s=wall, step_call_s=step_call,
                      grad_norm=0.5, cpu_s=cpu, listener_cpu_s=0.002, backward_s=wall / 2,
                      steal_forward_backward_s=steal,
                      steal_step_call_s=None if steal is None else (0.0, 0.01))  # fmt: skip


def test_the_compute_cores_steal_beyond_the_serial_engines_is_part_of_the_waiting() -> None:
    # Overlapped: 30 ms not running in forward and backward, 20 of them stolen (in ticks of
    # 10 ms: 30 and 10); serial: 5 ms not running, none stolen.
    kept = [
        (sample(0.130, 0.100, (0.030, 0.02), 0.005), sample(0.105, 0.100, (0.0, 0.0), 0.050)),
        (sample(0.130, 0.100, (0.010, 0.00), 0.005), sample(0.105, 0.100, (0.0, 0.01), 0.050)),
    ]
    steal = steal_per_step(kept)
    assert steal is not None
    split = unhidden(kept, steal)
    assert split["engine_thread_waiting"] == pytest.approx(0.025)
    assert split["engine_thread_waiting_hypervisor_steal"] == pytest.approx(0.020)
    assert split["compute_slowdown"] == pytest.approx(-0.002)
    assert steal["overlapped"]["forward_backward"] == pytest.approx(
        {"compute_core": 0.020, "host_core": 0.010}
    )
    assert steal["serial"]["forward_backward"] == pytest.approx(
        {"compute_core": 0.0, "host_core": 0.005}
    )
    assert steal["serial"]["step_call"] == pytest.approx({"compute_core": 0.0, "host_core": 0.01})
    # The ablation takes each engine's mean steal on the core its thread ran on off its median
    # step: overlapped 135 - 20 ms (nothing off its step()); serial 155 - 0 (forward and
    # backward) - 10 (its step() on the host core), its forward and backward 105 - 0.
    ablation = without_steal(kept, steal)
    assert ablation is not None
    assert ablation["step_time_ratio"] == pytest.approx(0.115 / 0.145)
    assert ablation["update_hidden_fraction"] == pytest.approx((0.145 - 0.115) / (0.145 - 0.105))
    # Where the system does not count steal (a GPU's samples carry none): None, not zero.
    unread = [(sample(0.130, 0.100, None, 0.005), sample(0.105, 0.100, None, 0.050))]
    assert steal_per_step(unread) is None
    assert unhidden(unread, None)["engine_thread_waiting_hypervisor_steal"] is None
    assert without_steal(unread, None) is None


def test_the_ablation_without_steal_is_a_median_over_the_repeats() -> None:
    repeats = [{"without_hypervisor_steal": {"step_time_ratio": r, "update_hidden_fraction": h}}
               for r, h in ((0.9, 0.3), (0.7, 0.8), (0.8, 0.5))]  # fmt: skip
    assert ablation_over_repeats(repeats) == {
        "step_time_ratio": 0.8,
        "update_hidden_fraction": 0.5,
    }
    assert ablation_over_repeats([*repeats, {"without_hypervisor_steal": None}]) is None


def test_an_interference_probe_says_how_much_steal_its_windows_met() -> None:
    probe = {"steal_s_alone": [(0.01, 0.0), (0.02, 0.05)],
             "steal_s_beside": [(0.0, 0.01), (0.04, 0.0)]}  # fmt: skip
    assert (
        probe_steal(probe) == " (the compute core's steal over its windows: 30 ms alone, 40 beside)"
    )
    assert probe_steal({"steal_s_alone": [None], "steal_s_beside": [(0.0, 0.0)]}) == ""


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity")
    or not {COMPUTE_CORE, HOST_CORE} <= os.sched_getaffinity(0),
    reason="needs the two cores the emulation pins to",
)
def test_threads_the_library_starts_on_the_compute_core_move_to_the_host_core() -> None:
    # A thread starts on its starter's cores: one started from the pinned main thread in
    # backward (the NVMe tier's I/O threads) would run beside the compute.
    main_cores = os.sched_getaffinity(0)
    # The sweep moves every thread of this process (a test runner's too): each goes back after.
    others = {t.native_id: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
              if t is not threading.main_thread() and t.native_id is not None}  # fmt: skip
    started, release = threading.Event(), threading.Event()
    cores: list[set[int]] = []

    def worker() -> None:
        started.set()
        release.wait()
        cores.append(os.sched_getaffinity(0))

    os.sched_setaffinity(0, {COMPUTE_CORE})
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        assert os.sched_getaffinity(thread.native_id) == {COMPUTE_CORE}
        keep_host_threads_on_host_core()
        assert os.sched_getaffinity(0) == {COMPUTE_CORE}  # the main thread stays where it is
        release.set()
        thread.join()
    finally:
        os.sched_setaffinity(0, main_cores)
        for native_id, affinity in others.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(native_id, affinity)
    assert cores == [{HOST_CORE}]


def test_the_host_threads_runs_split_at_backwards_end() -> None:
    # Backward from 1.0 to 2.0 s: one run inside it, one across its end, one after it.
    runs = [(1.2, 1.5), (1.8, 2.3), (2.3, 2.6)]
    busy, after = host_thread_split(runs, 1.0, 2.0)
    assert busy == pytest.approx(0.3 + 0.2)
    assert after == pytest.approx(0.6)
    # Runs all over before backward ends leave nothing after it; none at all, nothing either.
    assert host_thread_split([(1.2, 1.5)], 1.0, 2.0) == pytest.approx((0.3, 0.0))
    assert host_thread_split([], 1.0, 2.0) == (0.0, 0.0)


def test_the_host_thread_analysis_is_a_median_over_timed_steps() -> None:
    def timed(backward_s: float, busy: float | None, after: float | None) -> StepSample:
        return sample(0.130, 0.100, None, 0.005)._replace(
            backward_s=backward_s, host_busy_in_backward_s=busy, host_after_backward_s=after
        )

    serial = sample(0.105, 0.100, None, 0.050)
    kept = [(timed(0.040, 0.020, 0.001), serial), (timed(0.050, 0.045, 0.004), serial),
            (timed(0.040, 0.036, 0.003), serial)]  # fmt: skip
    split = host_thread(kept)
    assert split == pytest.approx(
        {"busy_fraction_of_backward": 0.9, "runs_after_backward_s": 0.003}
    )
    # A GPU run's engines built elsewhere, or the serial engine: not timed, so no split.
    assert host_thread([(timed(0.040, None, None), serial)]) is None


def test_the_overlapped_engines_early_runs_are_timed_on_their_thread(tmp_path) -> None:
    model = model_for(16, n_layer=2, n_embd=NARROWER_N_EMBD)
    engines = [build(model, overlap, 0.0, "host", str(tmp_path / str(overlap)), "fp32")
               for overlap in (False, True)]  # fmt: skip
    try:
        serial, overlapped = engines
        listener = overlapped.reducer.listener
        for x, y in text_batches(16, 3):  # the first step learns the counts: no early update
            started = listener.started
            late = one_step(overlapped, x, y, 1.0, False)
            plain = one_step(serial, x, y, 1.0, False)
        assert plain.host_busy_in_backward_s is None and plain.host_after_backward_s is None
        runs = overlapped.host_runs
        assert len(runs) == listener.started - started > 0  # each of the step's runs, once
        assert all(start < end for start, end in runs)
        assert 0 < late.host_busy_in_backward_s <= late.backward_s
        assert late.host_after_backward_s >= 0
    finally:
        for engine in engines:
            engine.close()
