"""Forwards under no grad are evaluation cycles: whoever calls the model (``engine(...)``, a
generation loop, the bare model), they share one trace, touch no gradient or optimizer state,
and a failure in one leaves the engine ready to train."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.models.gpt import GPT, GPTConfig
from tests.reference import token_batches, train_engine

SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


def engine_for(model: nn.Module) -> chunkmem.Engine:
    return chunkmem.initialize(model, config={"device": {"type": "simulated", "capacity": "1MiB"}})


def test_no_grad_forwards_of_every_length_share_one_trace() -> None:
    torch.manual_seed(0)
    engine = engine_for(GPT(SMALL))
    train_engine(engine, token_batches(2, batch=2, seq=16, vocab=64))
    recorded = engine.tracer.cycles_recorded
    tokens = token_batches(1, batch=1, seq=24, vocab=64)[0][0]
    with torch.no_grad():
        for length in range(1, 25):  # a greedy decode without a cache, through both doors
            (engine if length % 2 else engine.module)(tokens[:, :length])
    assert engine.tracer.cycles_recorded - recorded == 1
    assert engine.tracer.signature is None, "every evaluation cycle ended"
    train_engine(engine, token_batches(1, batch=2, seq=16, vocab=64))


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.fail: type[BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.fail is not None:
            raise self.fail("injected")
        return self.b(h).square().mean()


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failed_no_grad_forward_leaves_the_engine_ready(failure: type[BaseException]) -> None:
    """An Exception reaches the root's always-called hook; a KeyboardInterrupt does not, and
    the open cycle is abandoned by the next call."""
    engine = engine_for(Failing())
    x = torch.randn(4, 8)
    train_engine(engine, [(x,)])
    engine.module.fail = failure
    with torch.no_grad(), pytest.raises(failure):
        engine(x)
    engine.module.fail = None
    with torch.no_grad():
        assert torch.isfinite(engine(x))
    train_engine(engine, [(x,)])
    assert engine.global_steps == 2
