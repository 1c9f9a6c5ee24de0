"""Chunk sizes where ZeRO 1-2 moves chunks only between ranks: at least a collective's worth
(chunkmem/sizing.py, [Note: a collective's worth of chunk]), and unchanged at scale."""

from __future__ import annotations

import math

import torch

from chunkmem.config import Config
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.packing import padding_for
from chunkmem.sizing import (
    ALIGNMENT_ELEMENTS,
    MIN_COLLECTIVE_BYTES,
    Movement,
    choose_chunk_sizes,
    chunks_move,
)

WORLD = 4
ALIGNMENT = math.lcm(ALIGNMENT_ELEMENTS, WORLD)
CAPACITY = 8 << 30


def _sizes(numels: list[int], stage: int, dtype: torch.dtype = torch.float32):
    config = Config.from_dict({"zero": {"stage": stage}})
    movement = chunks_move(config, True, CAPACITY, dtype, numels, [])
    return movement, choose_chunk_sizes(config, CAPACITY, dtype, numels, [], ALIGNMENT, movement)


def _demo_numels() -> list[int]:
    """The compression benchmark's GPT (0.8M parameters), each tensor's size."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_embd=128, n_head=2,
                              bias=False))  # fmt: skip
    return [p.numel() for p in dict.fromkeys(model.parameters())]


def test_a_small_model_at_zero_2_is_one_chunk_without_padding() -> None:
    """13 chunks of 65,664 elements before: 78 ring rounds a step on 4 gloo ranks."""
    numels = _demo_numels()
    movement, sizes = _sizes(numels, stage=2)
    assert movement is Movement.BETWEEN_RANKS
    total = sum(numels)
    assert sizes.trainable.size == -(-total // ALIGNMENT) * ALIGNMENT
    assert padding_for(numels, sizes.trainable.size) == sizes.trainable.size - total


def test_zero_3_keeps_gathering_granularity() -> None:
    """At ZeRO-3 a chunk is gathered for compute: the 1/16 rule stands."""
    numels = _demo_numels()
    movement, sizes = _sizes(numels, stage=3)
    assert movement is Movement.FOR_COMPUTE
    assert sizes.trainable.size < sum(numels) // 4


def test_a_list_above_the_floor_holds_at_least_half_of_it_per_chunk() -> None:
    numels = [3 * 1024 * 1024 // 7 + 64] * 40  # 40 tensors of ~0.43M elements, 17M in all
    for dtype in (torch.float32, torch.bfloat16):
        _movement, sizes = _sizes(numels, stage=2, dtype=dtype)
        assert sizes.trainable.size * dtype.itemsize >= MIN_COLLECTIVE_BYTES // 2


def test_large_models_are_cut_as_before() -> None:
    """From ~16M parameters the 1/16 bound is above the floor: a 7B-like list is unchanged."""
    numels = [4096 * 4096] * 4 * 32 + [4096 * 11008] * 3 * 32
    _m2, stage2 = _sizes(numels, stage=2, dtype=torch.bfloat16)
    _m3, stage3 = _sizes(numels, stage=3, dtype=torch.bfloat16)
    assert stage2.trainable.size == stage3.trainable.size
