"""benchmarks/_gpu_overlap.py (the overlap keys of ``benchmarks.gpu``) runs its whole path on a
simulated device here: the regime chosen from the measured shares, both pairs bit-identical to
the serial engine, a forced clipping step rolled back, every key a number."""

from __future__ import annotations

import json

from benchmarks._gpu_overlap import MIN_HOST_SHARE, measure_overlap
from benchmarks.gpu import OVERLAP_KEYS, print_overlap
from chunkmem.models.gpt import GPTConfig


def test_the_gpu_overlap_runs_both_pairs_bit_identical_on_a_simulated_device(capsys) -> None:
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32,
                       checkpoint=True)  # fmt: skip
    result = measure_overlap(config, {"type": "simulated", "capacity": "1GiB"}, (1, 2),
                             steps=7, warmup=1, share_steps=1, sync=lambda: None)  # fmt: skip
    assert result["identical"] and all(result["identical_by_pair"].values())
    assert result["regime"]
    assert "unhidden_s" not in result["clipped"]  # not a measurement on a GPU
    # Nor the emulation's vCPUs' steal: a device run reads none, and has no ablation without it.
    assert result["clipped"]["hypervisor_steal_s_per_step"] is None
    assert result["clipped"]["without_hypervisor_steal"] is None
    shares = result["host_update_share_by_rows"]
    fitting = [rows for rows, share in shares.items() if share >= MIN_HOST_SHARE]
    assert result["rows"] == (max(fitting) if fitting else min(shares))
    assert result["tokens_per_step"] == result["rows"] * config.block_size
    # Step 6 of 8 is forced to clip: its speculative updates were undone, the others stood.
    assert result["speculation"]["rollbacks"] == 1
    assert result["speculation"]["commits"] >= 1
    assert result["clipped"]["steps_clipped"] == 1
    for key in ("update_hidden_fraction", "update_hidden_fraction_clipped",
                "step_time_ratio_overlapped_vs_serial_clipped",
                "rollback_step_time_ratio_vs_serial"):  # fmt: skip
        assert isinstance(result[key], float), key
    # What benchmarks.gpu prints and writes of it.
    print_overlap(result, "simulated")
    assert "clip 1.0" in capsys.readouterr().out
    assert json.loads(json.dumps(result))["rows"] == result["rows"]
    assert all(isinstance(result[key.removeprefix("gpu_")], float) for key in OVERLAP_KEYS)
