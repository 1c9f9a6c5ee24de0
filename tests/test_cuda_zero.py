"""ZeRO stages 1-3 with CUDA tensors: 2 ranks sharing one GPU over gloo (whose rings run on
host copies, zero/ring.py), and over NCCL where there is a GPU per rank.

The training checks are tests/test_zero.py's own (``train_rank`` and ``check``): every rank's
parameters equal single-process plain PyTorch on the global batch, now trained on the same
GPU, within 1e-5 (fp32) / 1e-2 (bf16); per-rank model-state bytes equal the ZeRO formulas; the
all-gather and reduce-scatter volume per step equals theory.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_helpers import run_ranks
from tests.test_zero import check, train_rank

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

CUDA_DEVICE = {"type": "cuda", "capacity": "1GiB"}


def _collectives_on_cuda(comm) -> dict[str, dict[str, torch.Tensor]]:
    """reduce_scatter (blocking and async), all_gather (out of place and in place) and
    all_reduce of CUDA tensors; small integers, so every order of summation is exact."""
    rank, size = comm.rank, comm.size
    generator = torch.Generator().manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = size * 1000 + size * 7
        full = torch.randint(-8, 8, (n,), generator=generator).to(dtype).cuda()
        shard = torch.empty(n // size, dtype=dtype, device="cuda")
        comm.reduce_scatter(full, shard)
        again = torch.empty_like(shard)
        comm.reduce_scatter(full, again, async_op=True).wait()
        gathered = torch.empty(n, dtype=dtype, device="cuda")
        comm.all_gather(shard, gathered)
        in_place = torch.zeros(n, dtype=dtype, device="cuda")
        mine = in_place[rank * (n // size) : (rank + 1) * (n // size)]
        mine.copy_(shard)
        comm.all_gather(mine, in_place, async_op=True).wait()
        # gloo's own all_reduce (the engine's gradient norm and presence counts: fp32/fp64)
        summed = torch.full((5,), float(rank + 1), device="cuda")
        comm.all_reduce(summed)
        results[str(dtype)] = {
            "full": full.cpu(),
            "shard": shard.cpu(),
            "again": again.cpu(),
            "gathered": gathered.cpu(),
            "in_place": in_place.cpu(),
            "summed": summed.cpu(),
        }
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_move_cuda_tensors_on_one_gpu(world: int) -> None:
    """tests/test_comm.py's collectives with CUDA tensors: gloo's point-to-point ring cannot
    send device memory, so these exercise the host staging (3 ranks: the accumulating ring)."""
    results = run_ranks(_collectives_on_cuda, world, timeout_s=60, deadline_s=150)
    for dtype in results[0]:
        total = sum(r[dtype]["full"].float() for r in results)
        shards = total.chunk(world)
        for rank, result in enumerate(results):
            got = result[dtype]
            assert torch.equal(got["shard"].float(), shards[rank]), (dtype, rank)
            assert torch.equal(got["again"], got["shard"]), (dtype, rank)
            assert torch.equal(got["gathered"].float(), total), (dtype, rank)
            assert torch.equal(got["in_place"].float(), total), (dtype, rank)
            expected = world * (world + 1) / 2
            assert got["summed"].eq(expected).all(), (dtype, rank)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_stages_on_one_gpu_over_gloo_match_plain_pytorch(precision: str) -> None:
    """test_zero_stages_match_single_process_fp32/_bf16 on 2 ranks sharing one GPU
    (bf16 without gradient accumulation, to keep gpu-check short)."""
    for stage in (1, 2, 3):
        for accumulation in (1, 2) if precision == "fp32" else (1,):
            results = run_ranks(
                train_rank, 2, stage, precision, accumulation, CUDA_DEVICE,
                timeout_s=60, deadline_s=300,
            )  # fmt: skip
            check(results, stage, precision, 2, accumulation, device="cuda")


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL needs a GPU per rank; this machine has {torch.cuda.device_count()}",
)
def test_zero_stages_over_nccl_match_plain_pytorch() -> None:
    """test_zero_stages_match_single_process_fp32 with NCCL's own collectives, a GPU per rank."""
    for stage in (1, 2, 3):
        for accumulation in (1, 2):
            results = run_ranks(
                train_rank, 2, stage, "fp32", accumulation, CUDA_DEVICE,
                timeout_s=60, deadline_s=300, backend="nccl",
            )  # fmt: skip
            check(results, stage, "fp32", 2, accumulation, device="cuda")
