"""Chunk sizes for the shapes people train: at most 2% padding, each list sized apart.

GPT 32x4096 packed its 16.8M-element attention projections one per 33.5M-element chunk before
(8.3% of the model was padding): the search's floor was the MLP matrices (67M), above its
bound, which left the bound as the only candidate (chunkmem/sizing.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from chunkmem.cli.settings import ModelSettings
from chunkmem.config import Config
from chunkmem.estimate import estimate
from chunkmem.packing import Packer
from chunkmem.sizing import ALIGNMENT_ELEMENTS, choose_chunk_sizes, chunks_move

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize(
    ("layers", "width", "heads", "world"), [(32, 4096, 32, 64), (80, 8192, 64, 512)]
)
def test_gpt_shapes_pack_with_at_most_two_percent_padding(layers, width, heads, world) -> None:
    """The estimator packs as the engine does (first-use order from a meta-device trace)."""
    model = ModelSettings(layers=layers, width=width, heads=heads, seq=2048, checkpointing=True)
    config = Config.from_dict({"precision": "bf16", "zero": {"stage": 3}})
    result = estimate(model, config, batch=1, world_size=world, node_size=8,
                      device_capacity=80 << 30)  # fmt: skip
    memory = result.memory
    padding = memory.padding_elements / (memory.padding_elements + result.parameters)
    assert padding <= 0.02, padding


def _llama(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _lora(model):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))


SHAPES = {
    "llama-3-8b (GQA)": lambda: _llama(32, 4096, 14336, 32, 8, 128256),
    "llama-2-70b (GQA)": lambda: _llama(80, 8192, 28672, 64, 8, 32000),
    "lora on llama-3-8b": lambda: _lora(_llama(32, 4096, 14336, 32, 8, 128256)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_llama_shapes_pack_with_at_most_two_percent_padding(shape: str) -> None:
    model, world = SHAPES[shape](), 8
    params = list(dict.fromkeys(model.parameters()))
    trainable = [p.numel() for p in params if p.requires_grad]
    frozen = [p.numel() for p in params if not p.requires_grad]
    config = Config.from_dict({"precision": "bf16", "zero": {"stage": 3}})
    alignment = math.lcm(ALIGNMENT_ELEMENTS, world)
    capacity = 80 << 30
    moving = chunks_move(config, True, capacity, torch.bfloat16, trainable, frozen)
    sizes = choose_chunk_sizes(
        config, capacity, torch.bfloat16, trainable, frozen, alignment, moving
    )
    ids = iter(range(1 << 30))
    packers = {t: Packer(sizes.size(t), t, lambda: next(ids), alignment) for t in (True, False)}
    for index, param in enumerate(params):
        packers[param.requires_grad].place(str(index), param)
    for trainable_list, packer in packers.items():
        capacity_elements = sum(layout.capacity for layout in packer.layouts)
        padding = sum(layout.padding for layout in packer.layouts)
        assert padding <= 0.02 * max(1, capacity_elements), (shape, trainable_list, padding)
    if frozen:  # LoRA: the adapters' chunks are sized by the adapters, not the base weights
        assert sizes.trainable.size < sizes.frozen.size / 10
