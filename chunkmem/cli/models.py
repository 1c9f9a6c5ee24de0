"""Building the model a ``model`` section names: the built-in GPT, a constructor given as
``pkg.module:function``, or a Hugging Face config.

Every model is called as ``model(tokens, targets)`` and returns the loss; a constructor whose
model returns logits, or a Hugging Face model, is wrapped to do so. The same builders serve
``chunkmem train`` (on the CPU) and ``chunkmem estimate`` (on the meta device).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chunkmem.cli.settings import ModelSettings
from chunkmem.errors import ConfigError
from chunkmem.models.gpt import GPT, GPTConfig

BYTE_VOCAB = 256


def gpt_config(model: ModelSettings) -> GPTConfig:
    return GPTConfig(
        vocab_size=BYTE_VOCAB,
        block_size=model.seq,
        n_layer=model.layers,
        n_head=model.heads or max(1, model.width // 64),
        n_embd=model.width,
        checkpoint=model.checkpointing,
    )


def describe(model: ModelSettings) -> str:
    if model.build == "gpt":
        config = gpt_config(model)
        return (
            f"GPT {config.n_layer}x{config.n_embd} ({config.n_head} heads, seq {config.block_size})"
        )
    return model.build


class LossOf(nn.Module):
    """``inner(tokens, targets)`` as a loss: a scalar is the loss, logits [batch, seq, vocab]
    get a cross-entropy, an output with a ``loss`` attribute (Hugging Face) gives it."""

    def __init__(self, inner: nn.Module, hugging_face: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.hugging_face = hugging_face

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.hugging_face:
            # Hugging Face shifts the labels itself: the inputs are the labels.
            return self.inner(input_ids=tokens, labels=tokens).loss
        out = self.inner(tokens, targets)
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return out
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            return F.cross_entropy(out.float().flatten(0, 1), targets.flatten())
        raise ConfigError(
            f"model.build {type(self.inner).__name__}(tokens, targets) returned "
            f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}; "
            f"it must return the loss (a scalar) or logits [batch, seq, vocab]"
        )


def import_builder(path: str) -> Callable[..., Any]:
    """The function ``pkg.module:function`` names."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(
            f"model.build {path!r}: expected 'gpt', 'hf:NAME' or 'pkg.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"model.build {path!r}: cannot import {module_name!r} ({error})"
        ) from None
    builder = getattr(module, attribute, None)
    if not callable(builder):
        raise ConfigError(f"model.build {path!r}: {module_name} has no function {attribute!r}")
    return builder


def hugging_face_model(name: str) -> nn.Module:
    """A causal LM from a Hugging Face config (a hub name in the local cache, or a directory),
    with freshly initialized weights: the estimate needs shapes, not a checkpoint."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model.build 'hf:{name}' needs the transformers package, which is not installed "
            f"(pip install transformers)"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"model.build 'hf:{name}': no Hugging Face config found ({error}). Give a "
            f"directory holding config.json, or a hub name already in the local cache"
        ) from None
    return transformers.AutoModelForCausalLM.from_config(config)


def build_model(model: ModelSettings) -> nn.Module:
    """The model, built on the current default device (``with torch.device("meta")`` for
    the estimate), called as ``model(tokens, targets) -> loss``."""
    if model.build == "gpt":
        return GPT(gpt_config(model))
    if model.build.startswith("hf:"):
        return LossOf(hugging_face_model(model.build.removeprefix("hf:")), hugging_face=True)
    built = import_builder(model.build)(**model.kwargs)
    if not isinstance(built, nn.Module):
        raise ConfigError(
            f"model.build {model.build!r} returned a {type(built).__name__}, not a torch.nn.Module"
        )
    return LossOf(built)
