"""Frozen weights at their weight bytes: a Hugging Face Llama with PEFT LoRA adapters.

The adapters and the frozen base weights pack into chunk lists of their own, each with its own
chunk size: before, the frozen list set one size for both, so the adapters' single layout was
as large as a frozen chunk, and its gradient, master and Adam moments were allocated for 8.6
times as many elements as there are adapters (the engine held 19.8 MB where 14.5 MB are
needed, 1.37x).
"""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.chunk import ChunkKind
from chunkmem.errors import CapacityError
from tests.reference import train_reference

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from tests.hf_helpers import batches, causal_lm_loss  # noqa: E402

# What a model state costs per element: a trainable fp32 parameter, its gradient and two Adam
# moments (no master in fp32); a frozen one is its weight only.
TRAINABLE_BYTES, FROZEN_BYTES = 16, 4


def lora_llama(layers: int = 2, width: int = 64, vocab: int = 128) -> torch.nn.Module:
    """An HF Llama (GQA) with r=8 LoRA adapters on q/k/v/o; only the adapters train."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    adapters = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = peft.get_peft_model(base, adapters)
    with torch.no_grad():  # B starts at zero; give it values so the adapters change the output
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model.train()


def split(model: torch.nn.Module) -> tuple[int, int]:
    params = list(dict.fromkeys(model.parameters()))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params) - trainable


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_trains_bit_for_bit_like_torch_and_leaves_the_frozen_weights_alone(precision) -> None:
    model = lora_llama()
    data = batches(count=6)
    reference = train_reference(model, data, precision=precision, loss_fn=causal_lm_loss)
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={"precision": precision, "device": {"type": "simulated", "capacity": "64MiB"}},
    )
    losses = []
    for batch in data:
        loss = causal_lm_loss(engine, *batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses == reference.losses
    state = engine.state_dict()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == len(reference.masters) > 0
    for name, value in zip(trained, reference.masters.values(), strict=True):
        assert torch.equal(state[name], value), name
    dtype = engine.compute_dtype
    for name, param in model.named_parameters():
        if not param.requires_grad:  # frozen: the original weight, in the compute dtype
            assert torch.equal(state[name].to(dtype), param.detach().to(dtype)), name


def test_lora_model_states_cost_their_weight_bytes() -> None:
    """The issue's shape (4 layers, width 256): frozen weights at 4 bytes, adapters at 16."""
    model = lora_llama(layers=4, width=256)
    trainable, frozen = split(model)
    ideal = TRAINABLE_BYTES * trainable + FROZEN_BYTES * frozen
    engine = chunkmem.initialize(
        model, config={"device": {"type": "simulated", "capacity": "64MiB"}}
    )
    ids, mask, labels = batches(count=1)[0]
    engine.backward(causal_lm_loss(engine, ids, mask, labels))  # every gradient chunk exists
    held = engine.model_state_bytes()
    engine.step()
    held = engine.model_state_bytes() | {ChunkKind.GRAD.value: held.get(ChunkKind.GRAD.value, 0)}
    total = sum(held.values())
    assert total <= 1.02 * ideal, (total, ideal, held)
    moments = engine.model_state_bytes()[ChunkKind.EXP_AVG.value] // 4
    assert trainable <= moments <= 1.02 * trainable, "moments for the adapters only"


def test_the_capacity_floor_counts_no_gradient_chunk_for_a_frozen_embedding() -> None:
    """The floor is two chunks of each list a moment draws from, with gradient chunks for the
    trainable ones only. A LoRA model whose largest tensor is a frozen embedding of 2.1M
    elements trains on 24 MiB, which the old floor (gradient chunks for the embedding too,
    33.6 MB) refused."""
    model = lora_llama(layers=2, width=256, vocab=8192)
    embedding = model.get_input_embeddings().weight
    assert not embedding.requires_grad and embedding.numel() == 8192 * 256
    old_floor = 2 * 4 * 2 * embedding.numel()
    capacity = 24 << 20
    assert old_floor > capacity
    engine = chunkmem.initialize(
        copy.deepcopy(model), config={"device": {"type": "simulated", "capacity": capacity}}
    )
    ids, mask, labels = batches(count=1)[0]
    engine.backward(causal_lm_loss(engine, ids, mask, labels))
    engine.step()
    assert engine.ledger.device.peak <= capacity
    with pytest.raises(CapacityError, match="chunks of one moment can need"):
        chunkmem.initialize(
            copy.deepcopy(model), config={"device": {"type": "simulated", "capacity": 8 << 20}}
        )
