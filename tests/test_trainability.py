"""Whether a model trains must not depend on accidents of packing: if depth L trains under
given limits, L-1 trains too.

The cause of the one counter-example found (GPT width 128, checkpointing, bf16, 8 MiB device:
31 and 33 layers failed where 32 and 34 trained) was non-reentrant activation checkpointing:
its recomputation in backward stops early, by an exception, once the last saved tensor it
needs is rebuilt, so the post-forward hooks of the block's last units never ran and their
parameters stayed in COMPUTE, unevictable, until backward ended.
"""

from __future__ import annotations

import pytest
import torch

import chunkmem
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.states import TensorState
from tests.reference import token_batches, train_engine


def held_outside_backward_calls(engine: chunkmem.Engine) -> set[str]:
    """At a backward moment: parameters in COMPUTE that no module in backward holds, and
    modules still counted as running forward (a recomputation that stopped early)."""
    held = {id(p) for call in engine.hooks.open_calls.values() for p in call.params}
    stray = {
        slot.name
        for slot in engine.params.slots.values()
        if slot.state is TensorState.COMPUTE
        and id(slot.param) not in held
        and not engine.manager.waits_for_gradient(slot)  # a tied weight, until its gradient
    }
    return stray | {f"forward of {engine.hooks.labels[f.module]}" for f in engine.hooks.stack}


def test_checkpoint_recomputation_that_stops_early_releases_its_units(monkeypatch) -> None:
    config = GPTConfig(
        vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, checkpoint=True
    )
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(config),
        config={
            "device": {"type": "simulated", "capacity": "4MiB"},
            "placement": {"unit_elements": 1},
        },
    )
    stray: list[tuple[str, set[str]]] = []
    enter = engine.manager.enter_moment

    def checked_enter(moment) -> None:
        # A unit's pre-backward, not a recomputation's pre-forward (a block's units run
        # inside it then, by design).
        if moment.name.startswith("bwd:") and not moment.name.endswith("(recompute)"):
            stray.append((moment.name, held_outside_backward_calls(engine)))
        enter(moment)

    monkeypatch.setattr(engine.manager, "enter_moment", checked_enter)
    train_engine(engine, token_batches(2, batch=2, seq=16, vocab=64))
    assert stray, "no backward moment was seen"
    assert [(name, names) for name, names in stray if names] == []


@pytest.mark.slow
def test_depths_around_the_old_counter_example_all_train() -> None:
    for layers in range(30, 36):
        config = GPTConfig(
            vocab_size=256, block_size=32, n_layer=layers, n_head=4, n_embd=128, checkpoint=True
        )
        torch.manual_seed(0)
        engine = chunkmem.initialize(
            GPT(config),
            config={
                "precision": "bf16",
                "device": {"type": "simulated", "capacity": 8 * 2**20},
                "host": {"capacity": 128 * 2**20},
            },
        )
        train_engine(engine, token_batches(3, batch=1, seq=32, vocab=256))
