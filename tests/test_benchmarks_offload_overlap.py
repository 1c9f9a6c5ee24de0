"""benchmarks/offload_overlap's arithmetic over its runs: the keys are medians over repeated
runs, the table shows the median run, the host-side bound is min(1, B / (r U)), and the
dependency bound leaves out the chunk group whose gradients are final last."""

from __future__ import annotations

import pytest

from benchmarks.offload_overlap import (
    build,
    combined_bound,
    host_bound,
    last_final_share,
    median_repeat,
    model_for,
    over_repeats,
    text_batches,
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


def test_the_dependency_bound_leaves_out_the_group_final_last(tmp_path) -> None:
    engine = build(model_for(16, n_layer=2), True, False, 0.0, "host", str(tmp_path), "fp32")
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
