"""End to end: a GPT whose model states exceed the device trains exactly like plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.models.gpt import GPT, GPTConfig
from tests.reference import max_relative_diff, token_batches, train_engine, train_reference

STEPS = 20
CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
STATE_BYTES_PER_PARAM = {"fp32": 16, "bf16": 14, "fp16": 14}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt_larger_than_device_matches_plain_pytorch(precision: str) -> None:
    model = GPT(CONFIG)
    state_bytes = STATE_BYTES_PER_PARAM[precision] * CONFIG.num_parameters()
    capacity = int(state_bytes * 0.45)
    data = token_batches(STEPS, batch=2, seq=32, vocab=256)
    reference = train_reference(model, data, precision=precision, lr=1e-3)

    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": precision,
            "device": {"type": "simulated", "capacity": capacity},
            "optimizer": {"lr": 1e-3},
        },
    )
    losses = train_engine(engine, data)

    assert sum(engine.model_state_bytes().values()) > 2 * capacity
    assert engine.ledger.device.peak <= capacity
    assert engine.ledger.bytes_moved(STEPS - 1) > 0, "the model must not fit: chunks must move"
    assert losses == pytest.approx(reference.losses, rel=TOLERANCE[precision])
    ours = {k: v for k, v in engine.state_dict().items() if k in reference.masters}
    assert max_relative_diff(ours, reference.masters) <= TOLERANCE[precision]
    assert engine.scaler.skipped_steps == reference.skipped_steps


class RMSNormStack(torch.nn.Module):
    """Blocks whose norm reads its input twice, beside a residual that reads it a third time:
    autograd sums the three contributions to that input in one buffer, in its own order."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.norms = torch.nn.ModuleList(RMSNorm(width) for _ in range(depth))
        self.mlps = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            h = h + torch.tanh(mlp(norm(h)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_module_reading_its_input_twice_trains_bit_for_bit() -> None:
    """The engine learns that a module's backward is done without adding an autograd node of
    its own, so the order in which autograd sums gradient contributions stays torch's."""
    model = RMSNormStack()
    data = token_batches(10, batch=2, seq=16, vocab=64)
    reference = train_reference(model, data, lr=1e-3)
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "device": {"type": "simulated", "capacity": "8MiB"},
            "placement": {"unit_elements": 1},  # every norm is a hooked unit
        },
    )
    losses = train_engine(engine, data)
    assert losses == reference.losses
    state = engine.state_dict()
    for name, expected in reference.masters.items():
        assert torch.equal(state[name], expected), name
