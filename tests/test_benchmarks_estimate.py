"""benchmarks/estimate's own measurement of the real allocator: the peak of live bytes it reads
from torch's profiler must be what was allocated (the key it feeds is only as good as this);
and its keys over the cases its completed phases measured."""

from __future__ import annotations

import torch

from benchmarks.estimate import (
    allocator_peak,
    allocator_profiler,
    shape_phase,
    summarize,
    tensor_peak,
)

MIB = 1 << 20


def test_the_allocator_peak_is_the_most_bytes_live_at_once() -> None:
    profiler = allocator_profiler()
    with profiler:
        first = torch.empty(MIB, dtype=torch.uint8)
        second = torch.empty(3 * MIB, dtype=torch.uint8)
        del first, second  # 4 MiB were live together
        third = torch.empty(2 * MIB, dtype=torch.uint8)
        del third
    peak = allocator_peak(profiler)
    assert 4 * MIB <= peak < 4 * MIB + 64 * 1024, peak


def test_bytes_freed_before_more_are_allocated_do_not_add_up() -> None:
    profiler = allocator_profiler()
    with profiler:
        for _ in range(5):
            block = torch.empty(2 * MIB, dtype=torch.uint8)
            del block
    assert 2 * MIB <= allocator_peak(profiler) < 2 * MIB + 64 * 1024


def test_an_operators_own_scratch_is_not_in_the_tensor_peak() -> None:
    """``torch.sort`` sorts in buffers it frees before returning: the allocator sees them, no
    count of operators' outputs can; the tensors that outlive their operator are all the tensor
    peak holds."""
    values = torch.rand(MIB)  # 4 MiB
    profiler = allocator_profiler()
    with profiler:
        kept = torch.empty(4 * MIB, dtype=torch.uint8)
        ordered, order = torch.sort(values)
    raw, tensors = allocator_peak(profiler), tensor_peak(profiler)
    outliving = kept.nbytes + ordered.nbytes + order.nbytes
    assert outliving <= tensors < outliving + 64 * 1024, (tensors, outliving)
    assert raw >= tensors + values.nbytes, (raw, tensors)  # the sort's own buffers


def _row(family: str, device: float, wire: float, deepspeed: float | None = None) -> dict:
    errors = {"device_peak": device, "host_peak": 0.0, "nvme_peak": 0.0, "wire": wire,
              "cross_node": 0.0}  # fmt: skip
    row = {"family": family, "rel_error": errors}
    if deepspeed is not None:
        row["rel_error_deepspeed_model_states"] = deepspeed
        row["ledger_vs_allocator"] = 1.0 - device
        row["ledger_vs_allocator_with_operator_scratch"] = 0.9 - device
    return row


def test_keys_are_none_until_a_phase_measured_cases() -> None:
    keys = summarize({"cases": [], "veth": None})
    assert keys["max_rel_error_estimate_vs_measured"] is None
    assert all(value is None for value in keys.values())


def test_keys_are_the_worst_over_the_cases_measured_so_far() -> None:
    rows = [_row("grid", 0.01, 0.0, deepspeed=0.5), _row("zeropp", 0.002, 0.03)]
    keys = summarize({"cases": rows, "veth": {"failed": "deadline"}})
    assert keys["max_rel_error_estimate_vs_measured"] == 0.03
    assert keys["max_rel_error_estimate_device_peak"] == 0.01
    assert keys["max_rel_error_deepspeed_formula_vs_measured"] == 0.5
    assert keys["ledger_vs_allocator_peak_ratio"] == 0.99
    assert keys["ledger_vs_allocator_peak_ratio_with_operator_scratch"] == 0.89
    assert keys["wire_bytes_ledger_vs_veth_ratio"] is None


def test_a_launch_phase_names_its_world_and_nodes() -> None:
    assert shape_phase(2, 0) == "ranks_2"
    assert shape_phase(4, 2) == "ranks_4_as_2x2"
