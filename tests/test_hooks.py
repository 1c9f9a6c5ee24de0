"""Module hooks: when a unit's backward is over, told without changing autograd's graph."""

from __future__ import annotations

import torch
from torch import nn

import chunkmem
from tests.reference import train_engine


class SharedBias(nn.Module):
    """T5's shape: the first block makes a bias every later block reads, so the bias's whole
    gradient is summed only after the last of them (the first in backward) is done."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.bias_source = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        bias = self.bias_source(x)
        h = x
        for block in self.blocks:
            h = torch.tanh(block(h) + bias)
        return nn.functional.mse_loss(h, y)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h) + bias)


class SharedBiasBlocks(SharedBias):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__(width, depth)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        bias = self.bias_source(x)
        h = x
        for block in self.blocks:
            h = block(h, bias)
        return nn.functional.mse_loss(h, y)


def test_a_block_is_released_after_its_own_backward_not_after_its_inputs_whole_gradient(
    monkeypatch,
) -> None:
    engine = chunkmem.initialize(
        SharedBiasBlocks(),
        config={
            "device": {"type": "simulated", "capacity": "1MiB"},
            "placement": {"unit_elements": 1},
        },
    )
    open_at_backward_moments = []
    enter = engine.manager.enter_moment

    def counting_enter(moment) -> None:
        if moment.name.startswith("bwd:"):
            open_at_backward_moments.append(len(engine.hooks.open_calls))
        enter(moment)

    monkeypatch.setattr(engine.manager, "enter_moment", counting_enter)
    data = [(torch.randn(4, 16), torch.randn(4, 16)) for _ in range(2)]
    train_engine(engine, data)
    assert len(open_at_backward_moments) == 2 * 7
    # Each block's backward ends before the next one begins: the bias it also reads does
    # not keep it open until the bias's gradient is complete.
    assert max(open_at_backward_moments) <= 1
