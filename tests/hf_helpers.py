"""Small Hugging Face models and batches shared by tests/test_hf_models.py and the torchrun
worker of tests/test_hf_torchrun.py. Built from configs; no weights are downloaded."""

from __future__ import annotations

import warnings

import torch
import transformers

VOCAB = 128
STATE_BYTES_PER_PARAM = {"fp32": 16, "bf16": 14}


def gpt2(checkpointing: bool = False) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        with warnings.catch_warnings():  # transformers 5 renamed it; the old name still works
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    return model.train()


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def batches(count: int = 10, batch: int = 2, seq: int = 16, seed: int = 1) -> list[tuple]:
    """(input_ids, attention_mask, labels): the first row is left-padded by 3 tokens, whose
    labels are -100, so the attention mask matters."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(2, VOCAB, (batch, seq), generator=generator)
        mask = torch.ones(batch, seq, dtype=torch.long)
        ids[0, :3] = 1
        mask[0, :3] = 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def causal_lm_loss(model, ids, mask, labels) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def state_bytes(model: torch.nn.Module, precision: str) -> int:
    """Parameters, gradients, masters and Adam moments (fp32: 16 bytes a parameter)."""
    return STATE_BYTES_PER_PARAM[precision] * sum(p.numel() for p in model.parameters())
