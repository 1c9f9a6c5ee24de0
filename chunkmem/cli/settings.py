"""What ``chunkmem train`` reads: a config file plus ``--set key=value`` overrides.

A run file is an engine config (ours, every key in docs/config.md, or a DeepSpeed JSON
config) with two more sections the command owns: ``model`` (what to build) and ``train`` (steps, batch, data,
checkpoints). Without ``--config`` the engine config is :data:`DEFAULT_ENGINE_CONFIG`, the
demo's. Overrides are applied to the raw file before anything is validated, so a bad value
fails with the key's name whichever way it came in.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from chunkmem.config import Config
from chunkmem.config_errors import describe_validation_error
from chunkmem.config_section import Section
from chunkmem.deepspeed_config import from_deepspeed, is_deepspeed_config
from chunkmem.errors import ConfigError

# A GPT 4x128 (0.83M parameters, 13 MiB of fp32 model states) on a device of 5 MiB: the
# model does not fit, so chunks move every step and the progress bar has bytes to show.
DEFAULT_ENGINE_CONFIG: dict[str, Any] = {
    "precision": "fp32",
    "device": {"type": "auto", "capacity": "5MiB"},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
    "gradient_clipping": 1.0,
}


class ModelSettings(Section):
    """The model ``chunkmem train`` builds (``chunkmem estimate`` reads the same section)."""

    build: str = Field(
        "gpt",
        description="gpt: the built-in GPT (chunkmem/models/gpt.py) with the sizes below. "
        "'pkg.module:function': function(**kwargs) returns an nn.Module whose forward takes "
        "(tokens, targets), two int64 [batch, seq] tensors of byte values, and returns the "
        "loss (or logits, which get a cross-entropy). 'hf:NAME' (estimate only): a Hugging "
        "Face config name or directory, built with AutoModelForCausalLM.from_config.",
    )
    layers: int = Field(4, ge=1, description="gpt: transformer blocks.")
    width: int = Field(128, ge=1, description="gpt: embedding width.")
    heads: int | None = Field(None, ge=1, description="gpt: attention heads; null: width // 64.")
    seq: int = Field(64, ge=1, description="Tokens per sequence (the GPT's block size).")
    checkpointing: bool = Field(
        True, description="gpt: recompute each block in backward (activation checkpointing)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of a 'pkg.module:function' build."
    )


class TrainSettings(Section):
    """The training run."""

    steps: int = Field(300, ge=0, description="Optimizer steps the run ends at.")
    batch: int = Field(8, ge=1, description="Sequences per micro-batch, per rank.")
    seed: int = Field(0, description="Seeds the model's initial weights and the data order.")
    data: str | None = Field(
        None, description="A text file to train on; null: Python's standard library sources."
    )
    data_bytes: int = Field(4_000_000, ge=1, description="Bytes of the text read (from its start).")
    held_out_fraction: float = Field(
        0.05, gt=0, lt=1, description="The end of the text, kept out of training."
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Save a checkpoint every K steps (0: only at the end)."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Checkpoints kept in the run directory; older ones are deleted."
    )
    log_every: int = Field(
        50, ge=1, description="Steps between progress lines when output is not a terminal."
    )
    sample_tokens: int = Field(
        80, ge=0, description="Bytes sampled from the trained model at the end (0: none)."
    )
    prompt: str = Field("def ", description="What the sample continues.")


class RunSettings(Section):
    """A run file's own sections; every other key is the engine config."""

    model: ModelSettings = ModelSettings()
    train: TrainSettings = TrainSettings()


OWN_SECTIONS = tuple(RunSettings.model_fields)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"zero.stage=2"`` -> (["zero", "stage"], 2). The value is read as JSON when it is
    JSON (numbers, true/false/null, lists, quoted strings), else as a plain string, so
    ``precision=bf16`` and ``device.capacity=64MiB`` need no quotes."""
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(
            f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. --set zero.stage=2"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``KEY=VALUE`` set (sections are created as needed)."""
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(
                    f"--set {text!r}: {where!r} is {child!r}, not a section with keys"
                )
            node = child
        node[path[-1]] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} holds a {type(data).__name__}, not an object")
    return data


def load(
    config_file: str | Path | None, overrides: list[str], world_size: int | None = None
) -> tuple[RunSettings, Config]:
    """The run's own settings and the engine config, validated; errors name the key.

    A DeepSpeed config (recognised by its keys, chunkmem/deepspeed_config.py) is translated
    for ``world_size`` ranks (DeepSpeed's batch-size rule needs it; None: the environment's),
    and its ``train_micro_batch_size_per_gpu`` is the micro-batch unless ``train.batch`` is set.
    """
    data = read_config_file(config_file) if config_file else copy.deepcopy(DEFAULT_ENGINE_CONFIG)
    data = apply_overrides(data, overrides)
    own = {key: data.pop(key) for key in OWN_SECTIONS if key in data}
    deepspeed = is_deepspeed_config(data)
    micro = data.get("train_micro_batch_size_per_gpu")
    if deepspeed and isinstance(own.get("train", {}), dict) and micro is not None:
        own["train"] = {"batch": micro, **own.get("train", {})}
    try:
        settings = RunSettings.model_validate(own)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, root=RunSettings)) from None
    if deepspeed:
        return settings, from_deepspeed(data, world_size)
    return settings, Config.from_dict(data)


def settings_document(settings: RunSettings, config: Config) -> dict[str, Any]:
    """Everything the run was given, as one JSON-able dict (written into the run directory)."""
    return {**settings.model_dump(mode="json"), **config.model_dump(mode="json")}
