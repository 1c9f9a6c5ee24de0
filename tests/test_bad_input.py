"""Bad input fails early with a clear error, and leaves the engine usable."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.errors import CapacityError, ConfigError, EngineUsageError, OutOfMemoryError
from chunkmem.models.gpt import GPT, GPTConfig
from tests.reference import token_batches, train_engine

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def simulated(capacity, **extra):
    return {"device": {"type": "simulated", "capacity": capacity}, **extra}


def test_capacity_below_one_moments_chunks_fails_before_training() -> None:
    model = GPT(SMALL)
    with pytest.raises(
        CapacityError, match=r"device capacity 10,000 bytes is below the [\d,]+ bytes"
    ) as error:
        chunkmem.initialize(model, config=simulated(10_000))
    assert "Raise device.capacity" in str(error.value)


def test_activations_that_cannot_fit_fail_in_the_first_forward_before_any_update() -> None:
    model = GPT(SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = chunkmem.initialize(model, config=simulated(100_000, chunk={"size": 2048}))
    ((x, y),) = token_batches(1, batch=16, seq=16, vocab=64)
    with pytest.raises(OutOfMemoryError, match=r"Non-model memory .* does not fit") as error:
        engine(x, y)
    assert "lower the batch size" in str(error.value)
    del error  # its traceback holds the half-built graph, whose activations are still counted
    gc.collect()
    assert engine.ledger.device.nonmodel == 0
    assert engine.global_steps == 0
    assert engine.ledger.device.model_bytes <= 100_000
    state = engine.state_dict()
    assert all(torch.equal(state[k], before[k]) for k in before)
    small = token_batches(2, batch=1, seq=4, vocab=64)
    train_engine(engine, small)  # a batch that fits trains afterwards


def test_simulated_device_requires_a_capacity_and_cuda_requires_a_gpu() -> None:
    with pytest.raises(CapacityError, match="needs a capacity"):
        chunkmem.initialize(GPT(SMALL), config={"device": {"type": "simulated"}})
    if not torch.cuda.is_available():
        with pytest.raises(CapacityError, match="torch sees no CUDA device"):
            chunkmem.initialize(GPT(SMALL), config={"device": {"type": "cuda"}})


def test_tensor_larger_than_chunk_gets_its_own_chunk() -> None:
    model = GPT(SMALL)
    engine = chunkmem.initialize(model, config=simulated(10**7, chunk={"size": 1024}))
    train_engine(engine, token_batches(1, batch=2, seq=16, vocab=64))
    wte = engine.params.slot_of(engine.module.wte.weight)
    layout = wte.layout
    assert wte.numel > 1024 and layout.capacity == wte.numel and len(layout.slots) == 1


def test_calls_out_of_order_say_what_to_call() -> None:
    engine = chunkmem.initialize(GPT(SMALL), config=simulated(10**7))
    ((x, y),) = token_batches(1, batch=2, seq=16, vocab=64)
    with pytest.raises(EngineUsageError, match="needs a training forward first"):
        engine.backward(torch.tensor(1.0, requires_grad=True))
    with pytest.raises(EngineUsageError, match=r"needs engine.backward\(\) first"):
        engine.step()
    loss = engine(x, y)
    with pytest.raises(EngineUsageError, match="forward called again before backward"):
        engine(x, y)
    with pytest.raises(EngineUsageError, match="scalar loss tensor"):
        engine.backward(loss.detach())
    engine.backward(loss)
    with pytest.raises(EngineUsageError, match=r"call engine.step\(\)"):
        engine(x, y)
    assert engine.step()


def test_unsupported_optimizers_and_groups() -> None:
    model = GPT(SMALL)
    config = simulated(10**7)
    with pytest.raises(ConfigError, match="got RMSprop"):
        chunkmem.initialize(model, torch.optim.RMSprop(model.parameters(), lr=0.1), config)
    with pytest.raises(ConfigError, match="amsgrad=True"):
        chunkmem.initialize(model, torch.optim.Adam(model.parameters(), amsgrad=True), config)
    partial = torch.optim.AdamW(list(model.parameters())[:2])
    with pytest.raises(ConfigError, match="requires grad but is in no optimizer param group"):
        chunkmem.initialize(model, partial, config)
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    stepped.step()
    with pytest.raises(ConfigError, match="already has state"):
        chunkmem.initialize(model, stepped, config)


def test_models_chunkmem_cannot_manage() -> None:
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="meta device"):
        chunkmem.initialize(meta, config=simulated(10**6))
    with pytest.raises(ConfigError, match="no parameters"):
        chunkmem.initialize(nn.ReLU(), config=simulated(10**6))
    odd = nn.Linear(4, 4)
    odd.steps = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    with pytest.raises(TypeError, match="'steps' has dtype torch.int64"):
        chunkmem.initialize(odd, config=simulated(10**6))
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        chunkmem.initialize(lambda x: x, config=simulated(10**6))


def test_num_parameters_counts_before_the_first_forward_and_after() -> None:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    expected = sum(p.numel() for p in model.parameters())  # tied weights once
    engine = chunkmem.initialize(
        model, config={"device": {"type": "simulated", "capacity": "4MiB"}}
    )
    assert engine.num_parameters() == expected  # nothing packed yet
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    assert engine.num_parameters() == expected
