"""The tiny Llama at ZeRO-3 on 2 ranks launched by a real ``torchrun``: bit for bit what one
process computes when it sums the ranks' micro-batch gradients as the reduce-scatter does,
and within 1e-5 of training on the global batch (lr 1e-4; see the note on the data in
tests/hf_zero3_worker.py)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from tests.hf_helpers import causal_lm_loss, llama  # noqa: E402
from tests.hf_zero3_worker import LR, STEPS, rank_batches  # noqa: E402
from tests.reference import max_relative_diff  # noqa: E402
from tests.thread_count import child_env  # noqa: E402

WORLD = 2
ROOT = Path(__file__).resolve().parent.parent


def summed_rank_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One process: per step, each rank's micro-batch backward in turn (autograd adds the
    second gradient to the first, as the 2-rank reduce-scatter adds its two parts), then
    fused AdamW dividing by the world size (the engine's update averages the sum)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    per_rank = [rank_batches(rank, WORLD) for rank in range(WORLD)]
    for step in range(STEPS):
        for rank in range(WORLD):
            causal_lm_loss(model, *per_rank[rank][step]).backward()
        optimizer.grad_scale = torch.tensor(float(WORLD))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def global_batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One process trains on the concatenated global batch."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    per_rank = [rank_batches(rank, WORLD) for rank in range(WORLD)]
    for step in range(STEPS):
        parts = [per_rank[rank][step] for rank in range(WORLD)]
        batch = [torch.cat(tensors) for tensors in zip(*parts, strict=True)]
        causal_lm_loss(model, *batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_llama_at_zero3_under_torchrun_matches_the_summed_reference_bit_for_bit(tmp_path) -> None:
    env = child_env()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "-m", "tests.hf_zero3_worker", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = torch.load(tmp_path / "rank0.pt")
    assert result["world"] == WORLD
    model = llama()
    expected = summed_rank_gradients(model)
    state = result["state"]
    differ = [name for name, value in expected.items() if not torch.equal(state[name], value)]
    assert differ == [], f"{len(differ)} of {len(expected)} tensors differ: {differ[:5]}"
    ours = {name: state[name] for name in expected}
    assert max_relative_diff(ours, global_batch(model)) <= 1e-5
