"""Chunk-size search and first-use-order packing."""

from __future__ import annotations

import torch

from chunkmem.packing import Packer, padding_for, search_chunk_size


def test_padding_counts_gaps_and_last_tail() -> None:
    # size 10: [6] gap 4 -> [6, 3] gap 1 -> [5] gap 5; the 12 is oversized and wastes nothing
    assert padding_for([6, 6, 3, 12, 5], 10) == 4 + 1 + 5


def test_search_finds_a_size_without_padding_for_uniform_tensors() -> None:
    numels = [4096, 64] * 24  # a weight and its bias, 24 times
    choice = search_chunk_size(numels, max_size=40_000)
    assert choice.padding_elements == padding_for(numels, choice.size) == 0
    assert choice.size % 64 == 0 and choice.size <= 40_000


def test_search_never_beats_exhaustive_minimum() -> None:
    numels = [1000, 3000, 700, 2500, 1200, 90, 4000, 333, 2048]
    choice = search_chunk_size(numels, max_size=8192)
    exhaustive = min(padding_for(numels, size) for size in range(4032, 8193, 64))
    assert choice.padding_elements == exhaustive


def test_search_is_bounded_by_max_size_and_reports_oversized() -> None:
    choice = search_chunk_size([100, 50_000, 200], max_size=4096)
    assert choice.size <= 4096
    assert choice.oversized_tensors == 1


def test_packer_keeps_order_and_gives_oversized_tensors_their_own_chunk() -> None:
    counter = iter(range(100))
    packer = Packer(100, trainable=True, new_layout_index=lambda: next(counter))
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (60, 30, 250, 20, 50)]
    placed = [packer.place(f"p{i}", p) for i, p in enumerate(params)]
    layouts = [layout for _slot, layout, _new in placed]
    # 60 + 30 fill the first chunk to 90; 20 no longer fits, so it opens the next one, where
    # 50 follows; 250 is larger than a chunk and gets one of exactly its size.
    assert [s.offset for s, _l, _n in placed] == [0, 60, 0, 0, 20]
    assert layouts[0] is layouts[1] and layouts[3] is layouts[4] is not layouts[0]
    assert layouts[2].capacity == 250 and len(layouts[2].slots) == 1
    assert layouts[3].capacity == 100
    assert [new for _s, _l, new in placed] == [True, False, True, True, False]
