"""How big chunks are and what must fit: the rules ``chunkmem.initialize`` applies and
``chunkmem estimate`` predicts with (one module, so the two cannot disagree).

- the compute and optimizer-state dtypes a precision name stands for, and the alignment of
  every chunk;
- whether gradients need chunks of their own, and whether chunks will move;
- the chunk size of each parameter list, trainable and frozen, searched apart: a frozen
  embedding of a LoRA model must not set the size of the adapters' chunks, whose padding
  would otherwise be allocated for gradients and Adam moments too;
- the floor: the device bytes one moment's chunks can need.

[Note: the bounds of the chunk-size search] A chunk is the unit of eviction, gathering and
overlapped reduction, so where chunks move it is at most about 1/16 of its list and at most
``MAX_CHUNK_ELEMENTS``, with room for a few of the largest ordinary tensors. Tensors above
the size get a layout of their own (exact, no padding), so the search only has to fit the
tensors below it. Its floor is the largest ordinary tensor (outliers such as an embedding
are not ordinary and take layouts of their own), unless that is above the bound: then the
largest tensor under the bound. Before, the floor was the ordinary tensor even above the
bound, which left the bound as the only candidate: GPT 32x4096 (whose MLP matrices of 67M
elements are ordinary) packed its 16.8M-element attention projections one per 33.5M-element
chunk, 8.3% of the model as padding.

[Note: a collective's worth of chunk] Where chunks move only between ranks (ZeRO 1-2, nothing
offloaded, the states fit; at ZeRO-3 a chunk is gathered for compute and its size is a peak), every chunk costs its own collectives each step (a reduce-scatter
and an all-gather at ZeRO-2, a ring of n - 1 rounds each on gloo), so a chunk smaller than
the bytes a collective moves in its latency pays latency, not bytes. There the search runs
from half of MIN_COLLECTIVE_BYTES up to at least all of it (the whole list when that is
smaller), within the capacity's bound: a 0.8M-parameter GPT on 4 gloo ranks went from 13 chunks (1.03 s a step, DDP 0.34-0.40 s) to
one (0.44 s). Above about 16M parameters the 1/16 bound is larger, so nothing changes there.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunkmem.config import Config
from chunkmem.errors import ConfigError
from chunkmem.packing import ChunkSizeChoice, padding_for, search_chunk_size

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # offload.state_dtype
ALIGNMENT_ELEMENTS = 64  # every chunk is a whole number of cache lines in any dtype
MIN_CHUNKS = 16  # where chunks move, a list is cut into at least about this many
MAX_CHUNK_ELEMENTS = 1 << 25  # 32 Mi elements, PatrickStar's default chunk
MIN_COLLECTIVE_BYTES = 4 << 20  # the least a chunk moved only by ZeRO's collectives holds


def separate_grads(precision: str, accumulation_steps: int, sharded: bool) -> bool:
    """Whether gradients need chunks of their own. Without, a 16-bit gradient overwrites its
    parameter's slot once final (the fp32 master keeps the value): that needs 16-bit training,
    one micro-batch per step and no reduction across ranks."""
    return precision == "fp32" or accumulation_steps > 1 or sharded


def states_fit(
    capacity: int,
    dtype: torch.dtype,
    trainable: Sequence[int],
    frozen: Sequence[int],
    world_size: int = 1,
    stage: int = 0,
) -> bool:
    """Whether this rank's model states fit in half the device, leaving the rest for
    activations.

    Per trainable element: the parameter and its gradient in ``dtype``, an fp32 master when
    ``dtype`` is 16-bit, and Adam's two fp32 moments; a frozen element is its parameter only.
    ZeRO shards the optimizer states (stage 1), the gradients (2) and the parameters (3).
    """
    trainable_elements, frozen_elements = sum(trainable), sum(frozen)
    params = dtype.itemsize * (trainable_elements + frozen_elements)
    grads = dtype.itemsize * trainable_elements
    states = ((4 if dtype.itemsize < 4 else 0) + 8) * trainable_elements
    state_bytes = (
        params / (world_size if stage >= 3 else 1)
        + grads / (world_size if stage >= 2 else 1)
        + states / (world_size if stage >= 1 else 1)
    )
    return 2 * state_bytes <= capacity


class Movement(enum.Enum):
    """How chunks will move, which bounds their size (the module note)."""

    STAYS = "stays"  # one process, everything fits on the device
    BETWEEN_RANKS = "between ranks"  # ZeRO 1-2's collectives only: every tier has room
    FOR_COMPUTE = "for compute"  # ZeRO-3: gathered to compute on, its size a memory peak
    BETWEEN_TIERS = "between tiers"  # offloaded states, or states that do not fit the device


def chunks_move(
    config: Config,
    sharded: bool,
    capacity: int,
    dtype: torch.dtype,
    trainable: Sequence[int],
    frozen: Sequence[int],
) -> Movement:
    """Whether chunks will move between tiers (offloaded optimizer states, updated a chunk
    group at a time, or states that do not fit the device), else be gathered for compute
    (ZeRO-3) or move between ranks only (ZeRO 1-2)."""
    if config.offload.optimizer in ("host", "nvme") or not states_fit(
        capacity, dtype, trainable, frozen
    ):
        return Movement.BETWEEN_TIERS
    if not sharded:
        return Movement.STAYS
    return Movement.FOR_COMPUTE if config.zero.stage >= 3 else Movement.BETWEEN_RANKS


def masters_start_on_device(
    config: Config,
    capacity: int,
    dtype: torch.dtype,
    trainable: Sequence[int],
    frozen: Sequence[int],
    world_size: int,
) -> bool:
    """[Note: masters start where they will live] The fp32 masters are written at packing,
    before the first step chooses the optimizer states' homes. Where this rank's model states
    fit in half the device and nothing is offloaded by config, that home is the device: the
    masters start there, and the first cycle holds nothing on the host the steady ones do
    not. Elsewhere they wait on the host."""
    return config.offload.optimizer not in ("host", "nvme") and states_fit(
        capacity, dtype, trainable, frozen, world_size, config.zero.stage
    )


@dataclass(frozen=True)
class ChunkSizes:
    """The chunk size of each parameter list, and the padding each leaves."""

    trainable: ChunkSizeChoice
    frozen: ChunkSizeChoice

    def size(self, trainable: bool) -> int:
        return (self.trainable if trainable else self.frozen).size

    @property
    def largest(self) -> int:
        """The larger of the two sizes (units are planned by it: fewer moments)."""
        return max(self.trainable.size, self.frozen.size)

    @property
    def padding_elements(self) -> int:
        return self.trainable.padding_elements + self.frozen.padding_elements

    @property
    def total_elements(self) -> int:
        return self.trainable.total_elements + self.frozen.total_elements

    @property
    def oversized_tensors(self) -> int:
        return self.trainable.oversized_tensors + self.frozen.oversized_tensors

    @property
    def candidates_tried(self) -> int:
        return self.trainable.candidates_tried + self.frozen.candidates_tried

    @property
    def waste_fraction(self) -> float:
        padding = self.padding_elements
        return padding / max(1, padding + self.total_elements)


def choose_chunk_sizes(
    config: Config,
    capacity: int,
    dtype: torch.dtype,
    trainable: Sequence[int],
    frozen: Sequence[int],
    alignment: int,
    movement: Movement,
) -> ChunkSizes:
    """Each list's chunk size (``config.chunk.size``, or searched: the module note), a multiple
    of ``alignment`` so that layouts shard evenly. ``movement``: :func:`chunks_move`'s."""
    return ChunkSizes(
        _list_size(config, capacity, dtype, trainable, alignment, movement),
        _list_size(config, capacity, dtype, frozen, alignment, movement),
    )


def _list_size(
    config: Config,
    capacity: int,
    dtype: torch.dtype,
    numels: Sequence[int],
    alignment: int,
    movement: Movement,
) -> ChunkSizeChoice:
    if config.chunk.size != "auto":
        size = config.chunk.size
        if size < 1:
            raise ConfigError(f"config key 'chunk.size' must be >= 1 or 'auto', got {size}")
        size = -(-size // alignment) * alignment
        oversized = sum(1 for n in numels if n > size)
        return ChunkSizeChoice(size, padding_for(numels, size), sum(numels), oversized, 1)
    if not numels:
        return ChunkSizeChoice(alignment, 0, 0, 0, 0)
    # Where nothing moves, small chunks buy nothing: each is a hook unit whose moments cost
    # Python time (benchmarks/overhead: 1.12 times plain PyTorch's step time with the bound,
    # 1.04-1.08 without).
    bound = min(
        int(capacity * config.chunk.max_fraction_of_capacity) // dtype.itemsize,
        MAX_CHUNK_ELEMENTS,
    )
    ordinary = largest_ordinary(numels)
    capacity_bound = max(bound, alignment)
    if movement is not Movement.STAYS:
        bound = min(bound, max(sum(numels) // MIN_CHUNKS, 4 * ordinary))
    bound = max(bound, alignment)
    floor = ordinary if ordinary <= bound else max((n for n in numels if n <= bound), default=1)
    if movement is Movement.BETWEEN_RANKS:
        # [Note: a collective's worth of chunk] Each chunk costs its own collectives every
        # step, so a small one pays their latency rather than its bytes: within the capacity's
        # bound, the search reaches MIN_COLLECTIVE_BYTES (or the whole list) and starts at
        # half of that, so that it can still pick a size the list divides into evenly.
        whole = -(-sum(numels) // alignment) * alignment
        least = min(whole, MIN_COLLECTIVE_BYTES // dtype.itemsize, capacity_bound)
        bound = max(bound, least)
        floor = max(floor, least if least == whole else least // 2)
    return search_chunk_size(numels, bound, alignment, min_size=floor)


def largest_ordinary(numels: Sequence[int]) -> int:
    """The largest tensor within three standard deviations of the mean size."""
    if not numels:
        return 1
    mean = sum(numels) / len(numels)
    spread = (sum((n - mean) ** 2 for n in numels) / len(numels)) ** 0.5
    return max(n for n in numels if n <= mean + 3 * spread)


def moment_floor_bytes(
    sizes: ChunkSizes,
    trainable: Sequence[int],
    frozen: Sequence[int],
    dtype: torch.dtype,
    grads_apart: bool,
) -> int:
    """Device bytes the chunks of one moment can need, before any activations: a module's
    parameters may straddle two chunks of each list it draws from; with separate gradients,
    the trainable chunks' gradient chunks are on the device in backward too. (``initialize``
    checks it; ``chunkmem estimate`` reports it.)"""
    trainable_chunk = max(max(trainable, default=0), sizes.trainable.size) if trainable else 0
    frozen_chunk = max(max(frozen, default=0), sizes.frozen.size) if frozen else 0
    return 2 * dtype.itemsize * (trainable_chunk * (2 if grads_apart else 1) + frozen_chunk)
