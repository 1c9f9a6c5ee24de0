"""The native host optimizer chooses, by measured time, how an update out of place stores the
rows it writes elsewhere ([Note: streamed or cached row stores] in kernels/csrc/row_stores.h);
the bits of either kind are tests/test_host_optim.py's."""

from __future__ import annotations

import pytest
import torch

from kernels import host_optim
from kernels.row_stores import row_stores, set_row_stores

TIMED_NUMEL = 1 << 18  # RowStoreChooser::kTimedMinNumel
TRIAL_CALLS = 6  # RowStoreChooser::kTrialCalls
ADAMW = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


@pytest.fixture(autouse=True)
def measured_anew():
    set_row_stores("measure")
    try:
        yield
    finally:
        set_row_stores("measure")


class Rows:
    """One fp32 group of ``numel`` elements with bf16 gradients and two sets of new rows, which
    alternate as a speculative update's shadows and payloads do."""

    def __init__(self, numel: int) -> None:
        self.params, self.exp_avgs, self.exp_avg_sqs = (torch.rand(numel) for _ in range(3))
        self.grads = torch.rand(numel).bfloat16()
        self.new = [host_optim.NewStates(*([torch.empty(numel)] for _ in range(3))) for _ in "ab"]
        self.saved = torch.empty(numel, dtype=torch.bfloat16)
        self.calls = 0

    def update(self) -> None:
        new = self.new[self.calls % 2]
        self.calls += 1
        host_optim.fused_adamw_(
            [self.params], [self.grads], [self.exp_avgs], [self.exp_avg_sqs], [],
            [torch.tensor(float(self.calls))], new_states=new, grads_saved=[self.saved],
            num_threads=1, **ADAMW,
        )  # fmt: skip


def test_rows_written_for_the_first_time_are_not_timed():
    rows = Rows(TIMED_NUMEL)
    rows.update()
    rows.update()  # the second set of rows, first written too
    assert row_stores().timed_calls == {"streamed": 0, "cached": 0}
    rows.update()
    assert row_stores().timed_calls == {"streamed": 0, "cached": 1}
    rows.update()
    assert row_stores().timed_calls == {"streamed": 1, "cached": 1}


def test_small_calls_and_updates_in_place_are_not_timed():
    small = Rows(TIMED_NUMEL - 8)
    for _ in range(4):
        small.update()
    big = Rows(TIMED_NUMEL)
    for step in range(4):  # in place
        host_optim.fused_adamw_(
            [big.params], [big.grads], [big.exp_avgs], [big.exp_avg_sqs], [],
            [torch.tensor(float(step + 1))], num_threads=1, **ADAMW,
        )  # fmt: skip
    assert row_stores().timed_calls == {"streamed": 0, "cached": 0}
    assert row_stores().chosen is None


def test_the_kind_with_the_lower_median_time_is_chosen_after_the_trials():
    rows = Rows(TIMED_NUMEL)
    for _ in range(2 + 2 * TRIAL_CALLS - 1):
        rows.update()
    assert row_stores().chosen is None  # one trial call short
    rows.update()
    choice = row_stores()
    assert choice.timed_calls == {"streamed": TRIAL_CALLS, "cached": TRIAL_CALLS}
    times = choice.ns_per_element
    assert times["streamed"] > 0 and times["cached"] > 0
    assert choice.chosen == min(times, key=times.__getitem__)
    rows.update()  # chosen: no more timing
    assert row_stores().timed_calls == choice.timed_calls


def test_a_forced_kind_is_used_and_not_measured():
    set_row_stores("cached")
    rows = Rows(TIMED_NUMEL)
    for _ in range(4):
        rows.update()
    assert row_stores().chosen == "cached"
    assert row_stores().timed_calls == {"streamed": 0, "cached": 0}


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'fast' is not one of measure, streamed, cached"):
        set_row_stores("fast")  # type: ignore[arg-type]
