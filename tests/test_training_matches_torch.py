"""End to end: a GPT whose model states exceed the device trains exactly like plain PyTorch."""

from __future__ import annotations

import copy

import pytest

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
