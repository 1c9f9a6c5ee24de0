"""qgZ end to end on 4 gloo ranks emulating 2 nodes x 2 devices: swizzled quantize ->
intra-node all-to-all -> dequant_reduce_requant -> inter-node all-to-all -> dequant_reduce
gives every rank its slice of the sum of all ranks' tensors, within the derived error bound."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
from kernels import QuantizedTensor, reference, slice_numel
from tests.kernels_helpers import U, assert_same_bits, per_element
from tests.thread_count import threads_per_process

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
NUMEL = 3001  # not a multiple of the world size or of any group size below
CONFIGS = [  # bits, group_size, symmetric, dtype
    (4, 32, True, torch.bfloat16),
    (8, 16, False, torch.float32),
    (4, 8, False, torch.float16),
]


def _input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(NUMEL, generator=g) * (rank + 1)).to(dtype)


def _all_to_all(q: QuantizedTensor, group: dist.ProcessGroup) -> QuantizedTensor:
    """Exchange equal blocks of data, scales and offsets; returns what this rank received."""

    def exchange(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        return out

    return QuantizedTensor(
        exchange(q.data),
        exchange(q.scales),
        exchange(q.offsets),
        q.numel,
        q.bits,
        q.group_size,
        q.symmetric,
        q.dtype,
    )


def _qgz(x, bits, group_size, symmetric, intra, inter, backend):
    """The three qgZ steps; returns this rank's slice and the inputs of the last step."""
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric, backend=backend)
    sent = kernels.swizzled_quantize(x, nodes=NODES, devices_per_node=PER_NODE, **kw)
    received = _all_to_all(sent, intra).split(PER_NODE)
    partial = kernels.dequant_reduce_requant(received, backend=backend)
    last = _all_to_all(partial, inter).split(NODES)
    return kernels.dequant_reduce(last, out_dtype=torch.float32, backend=backend), last


def _bound(rank, bits, group_size, symmetric, dtype, last):
    """Largest error the spec allows for this rank's slice, per element (fp64).

    Each of the WORLD inputs loses at most one quantization step bound (kernels_helpers.
    roundtrip_bound, with the sender's step for this slice); each node's partial sum loses
    another when requantized (with the step the receiver got); fp32 sums of k terms add at most
    (k - 1) u sum|term| each. The magnitude terms use sum|x| + (the quantization errors), which
    bounds every |x_hat| and |partial| that occurs.
    """
    levels = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1
    per_step = 0.5 + 4 * U * levels
    s = slice_numel(NUMEL, WORLD, group_size)
    position = (rank % PER_NODE) * NODES + rank // PER_NODE  # where slice `rank` sits when swizzled
    steps1 = torch.zeros(s, dtype=torch.float64)
    magnitude = torch.zeros(s, dtype=torch.float64)
    for r in range(WORLD):
        padded = torch.zeros(WORLD * s, dtype=torch.float64)
        padded[:NUMEL] = _input(r, dtype).double()
        magnitude += padded[rank * s : (rank + 1) * s].abs()
        q = reference.swizzled_quantize(
            _input(r, dtype),
            nodes=NODES,
            devices_per_node=PER_NODE,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
        )
        steps1 += q.split(WORLD)[position].scales.double().repeat_interleave(group_size)
    steps2 = sum(per_element(q, q.scales).double() for q in last)
    quant_error = (steps1 + steps2) * per_step
    magnitude += quant_error
    rounding = (2 * U) * 2 * magnitude + U * ((PER_NODE - 1) + (NODES - 1)) * magnitude
    return quant_error + rounding, magnitude


def _expected(rank: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    s = slice_numel(NUMEL, WORLD, group_size)
    total = torch.zeros(WORLD * s, dtype=torch.float64)
    for r in range(WORLD):
        total[:NUMEL] += _input(r, dtype).double()
    return total[rank * s : (rank + 1) * s]


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    torch.set_num_threads(threads_per_process())
    node, local = divmod(rank, PER_NODE)
    # Every rank creates every group, in the same order.
    intra_groups = [
        dist.new_group([n * PER_NODE + i for i in range(PER_NODE)]) for n in range(NODES)
    ]
    inter_groups = [
        dist.new_group([n * PER_NODE + i for n in range(NODES)]) for i in range(PER_NODE)
    ]
    intra, inter = intra_groups[node], inter_groups[local]
    try:
        for bits, group_size, symmetric, dtype in CONFIGS:
            what = f"rank {rank}, int{bits} group {group_size} {'sym' if symmetric else 'asym'} {dtype}"
            x = _input(rank, dtype)
            mine, last = _qgz(x, bits, group_size, symmetric, intra, inter, backend="cpu")
            mine_ref, _ = _qgz(x, bits, group_size, symmetric, intra, inter, backend="reference")
            assert_same_bits(mine, mine_ref, f"{what}: native vs reference")
            error = (mine.double() - _expected(rank, group_size, dtype)).abs()
            bound, magnitude = _bound(rank, bits, group_size, symmetric, dtype, last)
            assert bool((error <= bound).all()), (
                f"{what}: error {float(error.max())} exceeds the bound at {int((error - bound).argmax())}"
            )
            # Not a vacuous bound: well below the values it bounds (int4 steps are coarse).
            assert float(bound.sum()) < 0.5 * float(magnitude.sum()), what
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_swizzle_and_all_to_all_reproduce_the_reduce_scatter(tmp_path):
    kernels.backend_for("cpu")  # build once here, not in four ranks at the same time
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
