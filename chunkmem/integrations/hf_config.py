"""The engine's config under Hugging Face's Trainer: a DeepSpeed JSON's ``"auto"`` values filled
from ``TrainingArguments`` as Hugging Face's DeepSpeed integration fills them, and what the
arguments set (precision, accumulation, clipping) made the engine's.

[Note: "auto" under the Trainer] ``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``
replaces each ``"auto"`` with the argument below, and refuses a value that is given and
differs from it, listing every such key; :data:`_FROM_ARGUMENTS` and :data:`_FROM_STEPS` are
its table. The schedule's step counts are known only when training starts, so the schedule is
filled then (:meth:`TrainerConfig.schedule`). Keys that chunkmem accepts whatever their value
(bucket sizes, persistence thresholds) may stay ``"auto"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkmem.config import Config, SchedulerConfig
from chunkmem.deepspeed_config import from_deepspeed, is_deepspeed_config
from chunkmem.errors import ConfigError

# (DeepSpeed key, what fills it from TrainingArguments, the arguments named in a mismatch;
# None: filled only, never compared), as HfTrainerDeepSpeedConfig.trainer_config_process.
_FROM_ARGUMENTS: tuple[tuple[str, Callable[[Any, int], Any], str | None], ...] = (
    (
        "train_micro_batch_size_per_gpu",
        lambda args, world: args.per_device_train_batch_size,
        "per_device_train_batch_size",
    ),
    (
        "gradient_accumulation_steps",
        lambda args, world: args.gradient_accumulation_steps,
        "gradient_accumulation_steps",
    ),
    (
        "train_batch_size",
        lambda args, world: world * args.per_device_train_batch_size
        * args.gradient_accumulation_steps,
        "train_batch_size (world size x per_device_train_batch_size x gradient_accumulation_steps)",
    ),
    ("gradient_clipping", lambda args, world: args.max_grad_norm, "max_grad_norm"),
    ("optimizer.params.lr", lambda args, world: args.learning_rate, "learning_rate"),
    (
        "optimizer.params.betas",
        lambda args, world: [args.adam_beta1, args.adam_beta2],
        "adam_beta1, adam_beta2",
    ),
    ("optimizer.params.eps", lambda args, world: args.adam_epsilon, "adam_epsilon"),
    ("optimizer.params.weight_decay", lambda args, world: args.weight_decay, "weight_decay"),
    ("scheduler.params.warmup_min_lr", lambda args, world: 0, None),
    ("scheduler.params.warmup_max_lr", lambda args, world: args.learning_rate, "learning_rate"),
    ("fp16.enabled", lambda args, world: args.fp16 or args.fp16_full_eval, "fp16, fp16_full_eval"),
    ("bf16.enabled", lambda args, world: args.bf16 or args.bf16_full_eval, "bf16, bf16_full_eval"),
)  # fmt: skip
# ... and trainer_config_finalize, once the number of optimizer steps is known.
_FROM_STEPS: tuple[tuple[str, Callable[[Any, int], Any], str | None], ...] = (
    ("scheduler.params.total_num_steps", lambda args, steps: steps, "num_training_steps"),
    (
        "scheduler.params.warmup_num_steps",
        lambda args, steps: max(1, args.get_warmup_steps(steps)),
        "warmup_steps, warmup_ratio",
    ),
)


def fill_auto(
    data: dict[str, Any],
    args: Any,
    world_size: int,
    num_training_steps: int | None = None,
) -> dict[str, Any]:
    """A copy of the DeepSpeed config ``data`` with its ``"auto"`` values filled from
    ``args`` (``TrainingArguments``); with ``num_training_steps``, the schedule's too. A value
    that is given and differs from the argument raises, naming every such key."""
    filled = json.loads(json.dumps(data))
    rules = [(key, fill(args, world_size), names) for key, fill, names in _FROM_ARGUMENTS]
    if num_training_steps is not None:
        rules += [(key, fill(args, num_training_steps), names) for key, fill, names in _FROM_STEPS]
    mismatches = []
    for key, wanted, names in rules:
        *parents, leaf = key.split(".")
        node: Any = filled
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        if node[leaf] == "auto":
            node[leaf] = wanted
        elif names is not None and node[leaf] is not None and node[leaf] != wanted:
            mismatches.append(
                f"DeepSpeed key {key!r} is {node[leaf]!r}, TrainingArguments' {names} {wanted!r}"
            )
    if mismatches:
        raise ConfigError(
            "the DeepSpeed config disagrees with TrainingArguments (as Hugging Face's DeepSpeed "
            'integration, ChunkmemTrainer refuses that; set these keys to "auto" or to the '
            "arguments' values):\n  " + "\n  ".join(mismatches)
        )
    return filled


@dataclass(frozen=True)
class TrainerConfig:
    """The engine's config and, apart, the config's schedule: the Trainer steps the schedule
    (after each optimizer step, as it steps its own), so the engine must not."""

    engine: Config
    deepspeed_schedule: dict[str, Any] | None
    native_schedule: SchedulerConfig | None

    def schedule(self, args: Any, num_training_steps: int) -> SchedulerConfig | None:
        """The schedule the config names, its DeepSpeed step counts filled; None: none."""
        if self.deepspeed_schedule is not None:
            section = fill_auto({"scheduler": self.deepspeed_schedule}, args, 1, num_training_steps)
            return from_deepspeed(section, world_size=1).scheduler  # the schedule alone
        return self.native_schedule


def trainer_config(source: Config | dict[str, Any] | str | Path | None, args: Any) -> TrainerConfig:
    """``source`` (what ``chunkmem.initialize`` takes) under ``args``: Trainer arguments set
    precision, accumulation and clipping; the config may repeat them, not contradict them."""
    if isinstance(source, (str, Path)):
        source = _read_json(Path(source))
    deepspeed_schedule = None
    if isinstance(source, dict) and is_deepspeed_config(source):
        data = fill_auto(source, args, args.world_size)
        deepspeed_schedule = data.pop("scheduler", None)
        config = from_deepspeed(data, world_size=args.world_size)
    else:
        config = Config.coerce(source)
    native_schedule = config.scheduler if config.scheduler.type is not None else None
    return TrainerConfig(
        engine=_aligned(config, args).model_copy(update={"scheduler": SchedulerConfig()}),
        deepspeed_schedule=deepspeed_schedule,
        native_schedule=native_schedule,
    )


def _aligned(config: Config, args: Any) -> Config:
    given = config.model_fields_set
    updates: dict[str, Any] = {}
    if args.bf16:
        if "precision" in given and config.precision != "bf16":
            raise ConfigError(
                f"TrainingArguments(bf16=True) and the chunkmem config's precision "
                f"{config.precision!r} differ; set one of the two"
            )
        updates["precision"] = "bf16"
    accumulation = args.gradient_accumulation_steps
    if config.gradient_accumulation_steps not in (1, accumulation):
        raise ConfigError(
            f"the config's gradient_accumulation_steps is {config.gradient_accumulation_steps} "
            f"and TrainingArguments' is {accumulation}: the Trainer counts micro-batches by its "
            f"own, so set TrainingArguments(gradient_accumulation_steps=...) alone"
        )
    updates["gradient_accumulation_steps"] = accumulation
    if "gradient_clipping" in given and config.gradient_clipping != args.max_grad_norm:
        raise ConfigError(
            f"the config's gradient_clipping {config.gradient_clipping} and TrainingArguments' "
            f"max_grad_norm {args.max_grad_norm} differ; set one of the two"
        )
    updates["gradient_clipping"] = float(args.max_grad_norm)
    return config.model_copy(update=updates)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from None
