"""DeepSpeed JSON configs, translated into chunkmem's config.

Every key DeepSpeed documents has a rule (``chunkmem.deepspeed_rules``, also the table in
docs/config.md): mapped onto a chunkmem key; accepted with one logged line because it has no
meaning for chunks (bucket sizes, diagnostics); or refused with an error that names it and
says whether it is planned or not planned. A key with no rule is an error too. Nothing is
silently ignored. A refused key whose value leaves the feature off (``"enabled": false``,
DeepSpeed's default) is accepted: it asks for nothing.

``chunkmem.initialize`` and :meth:`Config.coerce` recognise a DeepSpeed config by its keys
(:func:`is_deepspeed_config`). Settings DeepSpeed has no key for (the simulated device's
capacity, the chunk size) go in a ``"chunkmem"`` block of native sections beside the
DeepSpeed keys; DeepSpeed itself ignores that block.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from chunkmem.config import Config
from chunkmem.config_errors import describe_validation_error
from chunkmem.deepspeed_rules import RULES, Rule, Status
from chunkmem.errors import ConfigError

_log = logging.getLogger("chunkmem")


_BY_KEY = {rule.key: rule for rule in RULES}
_SECTIONS = {key.rsplit(".", depth)[0] for key in _BY_KEY for depth in range(1, key.count(".") + 1)}
# Sections of a feature DeepSpeed switches on with "enabled" (off by default).
_SWITCHED = {"fp16", "bf16"}
# Top-level keys only DeepSpeed has: one of them makes a config a DeepSpeed config.
_DEEPSPEED_ONLY = {key.split(".")[0] for key in _BY_KEY} - set(Config.model_fields)


def is_deepspeed_config(data: dict[str, Any]) -> bool:
    """Whether ``data`` is written for DeepSpeed: a key only DeepSpeed has, or an optimizer or
    scheduler given as ``{"type": ..., "params": {...}}``."""
    if any(key in _DEEPSPEED_ONLY for key in data):
        return True
    return any(
        isinstance(data.get(s), dict) and "params" in data[s] for s in ("optimizer", "scheduler")
    )


def from_deepspeed(data: dict[str, Any], world_size: int | None = None) -> Config:
    """The chunkmem config a DeepSpeed config asks for (see the module docstring).

    ``world_size``: data-parallel ranks, for DeepSpeed's batch-size rule; None reads
    ``torch.distributed`` when it is initialized, else ``WORLD_SIZE`` (torchrun), else 1.
    """
    data = dict(data)
    native = data.pop("chunkmem", {})
    if not isinstance(native, dict):
        raise ConfigError(
            f"the 'chunkmem' block of a DeepSpeed config must be an object, got {type(native).__name__}"
        )
    try:
        config, translation = _translate(data, native, world_size)
    except ConfigError as error:
        auto = _auto_keys(data)
        if not auto:
            raise
        raise ConfigError(f"{error}\n{_auto_message(auto)}") from None
    if translation.accepted:
        by_note: dict[str, list[str]] = {}
        for key, note in translation.accepted:
            by_note.setdefault(note, []).append(key)
        _log.info(
            "DeepSpeed keys with no meaning for chunkmem, accepted: %s",
            "; ".join(f"{', '.join(keys)} ({note})" for note, keys in by_note.items()),
        )
    return config


def _translate(
    data: dict[str, Any], native: dict[str, Any], world_size: int | None
) -> tuple[Config, _Translation]:
    translation = _Translation(world_size if world_size is not None else _world_size())
    translation.walk(data, "")
    translation.finish(data)
    overlap = sorted(set(_flatten(native)) & set(translation.source))
    if overlap:
        raise ConfigError(
            f"chunkmem key {overlap[0]!r} is set both in the 'chunkmem' block and by DeepSpeed "
            f"key {translation.source[overlap[0]]!r}; keep one"
        )
    merged = _merge(translation.out, native)
    try:
        return Config.model_validate(merged), translation
    except ValidationError as exc:
        raise ConfigError(
            describe_validation_error(exc, Config, lambda key: _name(key, translation.source))
        ) from None


def _name(key: str, source: dict[str, str]) -> str:
    """A chunkmem key in an error, spelled as the DeepSpeed key (or section) that set it, or
    as a key of the ``chunkmem`` block."""
    if key in source:
        return f"DeepSpeed key {source[key]!r} (chunkmem {key!r})"
    if any(target.startswith(f"{key}.") for target in source):
        return f"DeepSpeed key {key!r}"
    return f"key {'chunkmem.' + key!r} of the chunkmem block"


class _Translation:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.out: dict[str, Any] = {}
        self.source: dict[str, str] = {}  # chunkmem key -> the DeepSpeed key that set it
        self.accepted: list[tuple[str, str]] = []

    def set(self, target: str, value: Any, ds_key: str) -> None:
        node = self.out
        *parents, leaf = target.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.source[target] = ds_key

    def walk(self, data: dict[str, Any], prefix: str) -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            rule = _BY_KEY.get(path)
            if rule is not None:
                self.apply(rule, value)
            elif path not in _SECTIONS:
                raise ConfigError(_unknown(path))
            elif value is None or (path in _SWITCHED and value.get("enabled", False) is False):
                continue  # a feature that is off: its settings ask for nothing
            elif isinstance(value, dict):
                self.walk(value, f"{path}.")
            else:
                raise ConfigError(f"DeepSpeed key {path!r} must be an object, got {value!r}")

    def apply(self, rule: Rule, value: Any) -> None:
        if rule.status is Status.MAPPED:
            _CONVERT.get(rule.key, _copy)(self, rule, value)
        elif rule.status is Status.ACCEPTED:
            self.accepted.append((rule.key, rule.note))
        elif not _inert(rule, value):
            raise ConfigError(_refusal(rule, value))

    def finish(self, data: dict[str, Any]) -> None:
        """What several keys decide together: the batch rule, the precision, the optimizer's
        decoupling, stage 0 across ranks."""
        self._batch(data)
        self._optimizer(data.get("optimizer") or {}, (data.get("scheduler") or {}))
        fp16 = _enabled(data.get("fp16"))
        bf16 = _enabled(data.get("bf16"))
        if fp16 and bf16:
            raise ConfigError(
                "DeepSpeed keys 'fp16.enabled' and 'bf16.enabled' are both true; enable one"
            )
        zero = data.get("zero_optimization") or {}
        if self.world_size > 1 and zero.get("stage", 0) == 0:
            raise ConfigError(
                f"DeepSpeed key 'zero_optimization.stage' is 0 on {self.world_size} ranks: data "
                f"parallelism without sharding (DDP), which chunkmem does not run and does not "
                f"plan to. Use stage 1: the same updates, with optimizer states sharded"
            )

    def _optimizer(self, optimizer: dict[str, Any], scheduler: dict[str, Any]) -> None:
        """DeepSpeed's defaults where they differ from chunkmem's: AdamW unless type Adam with
        adam_w_mode false; weight decay 0; WarmupDecayLR's warmup_max_lr 0.001."""
        params = optimizer.get("params") or {}
        if "type" in optimizer:
            decoupled = optimizer["type"].lower() == "adamw" or params.get("adam_w_mode", True)
            self.set("optimizer.type", "adamw" if decoupled else "adam", "optimizer.type")
            if "weight_decay" not in params:
                self.set("optimizer.weight_decay", 0.0, "optimizer.type")
        schedule = scheduler.get("params") or {}
        if scheduler.get("type") == "WarmupDecayLR" and "warmup_max_lr" not in schedule:
            self.set("scheduler.warmup_max_lr", 0.001, "scheduler.type")

    def _batch(self, data: dict[str, Any]) -> None:
        """DeepSpeed's rule: train_batch_size = micro batch x accumulation x ranks; any two
        give the third, all three must agree."""
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        batch, micro, accumulation = (data.get(key) for key in keys)
        for key, value in zip(keys, (batch, micro, accumulation), strict=True):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"DeepSpeed key {key!r} must be a positive integer, got {value!r}"
                )
        world = self.world_size
        if batch is not None and micro is not None and accumulation is not None:
            if batch != micro * accumulation * world:
                raise ConfigError(
                    f"DeepSpeed keys 'train_batch_size' ({batch}), 'train_micro_batch_size_per_gpu' "
                    f"({micro}) and 'gradient_accumulation_steps' ({accumulation}) disagree on "
                    f"{world} data-parallel rank(s): train_batch_size must be {micro} x "
                    f"{accumulation} x {world} = {micro * accumulation * world}"
                )
        elif batch is not None and micro is not None:
            accumulation = batch // micro // world
            if accumulation < 1 or batch != micro * accumulation * world:
                raise ConfigError(
                    f"DeepSpeed key 'train_batch_size' ({batch}) is not a multiple of "
                    f"'train_micro_batch_size_per_gpu' ({micro}) x {world} data-parallel rank(s)"
                )
        elif batch is not None and accumulation is not None:
            if batch % (accumulation * world):
                raise ConfigError(
                    f"DeepSpeed key 'train_batch_size' ({batch}) is not a multiple of "
                    f"'gradient_accumulation_steps' ({accumulation}) x {world} data-parallel rank(s)"
                )
        elif batch is not None and batch % world:
            raise ConfigError(
                f"DeepSpeed key 'train_batch_size' ({batch}) is not a multiple of the {world} "
                f"data-parallel rank(s)"
            )
        if accumulation is not None:
            source = (
                "gradient_accumulation_steps"
                if "gradient_accumulation_steps" in data
                else "train_batch_size"
            )
            self.set("gradient_accumulation_steps", accumulation, source)


def _copy(translation: _Translation, rule: Rule, value: Any) -> None:
    translation.set(rule.target, value, rule.key)


def _batch_key(translation: _Translation, rule: Rule, value: Any) -> None:
    """Decided with other keys in _Translation.finish."""


def _precision(translation: _Translation, rule: Rule, value: Any) -> None:
    if value is True:
        translation.set("precision", rule.note, rule.key)
    elif value is not False:
        raise ConfigError(f"DeepSpeed key {rule.key!r} must be true or false, got {value!r}")


def _optimizer_type(translation: _Translation, rule: Rule, value: Any) -> None:
    """Adam or AdamW; decided in _Translation.finish with params.adam_w_mode."""
    if not isinstance(value, str) or value.lower() not in ("adam", "adamw"):
        raise ConfigError(
            f"DeepSpeed key 'optimizer.type' is {value!r}: chunkmem translates DeepSpeed's Adam "
            f"and AdamW; for SGD set chunkmem's own optimizer.type 'sgd' (or pass a "
            f"torch.optim.SGD to initialize), other optimizers are not planned"
        )


def _scheduler_type(translation: _Translation, rule: Rule, value: Any) -> None:
    if value in ("LRRangeTest", "OneCycle"):
        raise ConfigError(f"DeepSpeed key 'scheduler.type' {value!r} is planned, not built yet")
    translation.set("scheduler.type", value, rule.key)


def _fp16_loss_scale(translation: _Translation, rule: Rule, value: Any) -> None:
    if value not in rule.inert:
        raise ConfigError(
            f"DeepSpeed key 'fp16.loss_scale' is {value!r}: a fixed loss scale is planned; 0 "
            f"(dynamic scaling) runs today"
        )


def _initial_scale_power(translation: _Translation, rule: Rule, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"DeepSpeed key 'fp16.initial_scale_power' must be an integer, got {value!r}"
        )
    translation.set("loss_scale.initial_scale", float(2**value), rule.key)


def _check_overflow(translation: _Translation, rule: Rule, value: Any) -> None:
    if value is True:
        translation.set("nonfinite", "skip", rule.key)
    else:
        translation.accepted.append((rule.key, "chunkmem checks every step and raises (nonfinite)"))


def _offload_optimizer_device(translation: _Translation, rule: Rule, value: Any) -> None:
    if value in ("none", None):
        return
    if value not in ("cpu", "nvme"):
        raise ConfigError(
            f"DeepSpeed key {rule.key!r} must be 'none', 'cpu' or 'nvme', got {value!r}"
        )
    _needs(rule.target, rule.key)
    translation.set(rule.target, "host" if value == "cpu" else "nvme", rule.key)


def _cpu_offload(translation: _Translation, rule: Rule, value: Any) -> None:
    if value:
        _offload_optimizer_device(
            translation, _BY_KEY["zero_optimization.offload_optimizer.device"], "cpu"
        )


def _offload_param_device(translation: _Translation, rule: Rule, value: Any) -> None:
    if value in ("none", None):
        return
    if value == "cpu":
        translation.accepted.append(
            (rule.key, "parameters move between device and host as the device budget requires")
        )
        return
    raise ConfigError(
        f"DeepSpeed key {rule.key!r} is {value!r}: parameters on NVMe are planned; 'cpu' runs "
        f"today (parameter chunks are evicted to the host as the device budget requires)"
    )


def _zeropp(translation: _Translation, rule: Rule, value: Any) -> None:
    if value in (False, None) or (rule.key.endswith("partition_size") and value in (0, 1)):
        return
    _needs(rule.target, rule.key)
    translation.set(rule.target, value, rule.key)


def _needs(target: str, ds_key: str) -> None:
    """A mapping onto a key another part of chunkmem adds: refused as planned until then."""
    node: Any = Config
    for part in target.split("."):
        field = node.model_fields.get(part) if isinstance(node, type) else None
        if field is None:
            raise ConfigError(
                f"DeepSpeed key {ds_key!r} maps to chunkmem key {target!r}, which this build "
                f"does not have yet: planned"
            )
        node = field.annotation


_CONVERT: dict[str, Callable[[_Translation, Rule, Any], None]] = {
    "train_batch_size": _batch_key,
    "train_micro_batch_size_per_gpu": _batch_key,
    "gradient_accumulation_steps": _batch_key,
    "fp16.enabled": _precision,
    "bf16.enabled": _precision,
    "optimizer.type": _optimizer_type,
    "optimizer.params.adam_w_mode": _batch_key,
    "scheduler.type": _scheduler_type,
    "fp16.loss_scale": _fp16_loss_scale,
    "fp16.initial_scale_power": _initial_scale_power,
    "bf16.check_overflow": _check_overflow,
    "zero_optimization.offload_optimizer.device": _offload_optimizer_device,
    "zero_optimization.offload_optimizer.nvme_path": lambda t, r, v: (
        _needs(r.target, r.key) or t.set(r.target, v, r.key)
    ),
    "zero_optimization.offload_optimizer.ratio": lambda t, r, v: (
        _needs(r.target, r.key) or t.set(r.target, v, r.key)
    ),
    "zero_optimization.cpu_offload": _cpu_offload,
    "zero_optimization.offload_param.device": _offload_param_device,
    "zero_optimization.zero_quantized_weights": _zeropp,
    "zero_optimization.zero_hpz_partition_size": _zeropp,
    "zero_optimization.zero_quantized_gradients": _zeropp,
}


def _inert(rule: Rule, value: Any) -> bool:
    """Whether ``value`` asks for nothing: a listed value, or a section that is disabled or
    whose settings are all off."""
    if isinstance(value, dict):
        if "enabled" in value:
            return value["enabled"] is False
        return not any(value.values())
    return any(value == off and type(value) is type(off) for off in rule.inert)


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) is True


def _refusal(rule: Rule, value: Any) -> str:
    shown = "enabled" if isinstance(value, dict) else repr(value)
    when = (
        "is planned, not built yet"
        if rule.status is Status.PLANNED
        else "is not supported and not planned"
    )
    note = f" ({rule.note})" if rule.note else ""
    return f"DeepSpeed key {rule.key!r} ({shown}) {when}{note}; remove it to run on chunkmem"


def _auto_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose value is "auto" and matters to chunkmem (an accepted key, such as a bucket
    size, may be "auto" like any other value: it asks for nothing)."""
    keys = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        rule = _BY_KEY.get(path)
        if isinstance(value, dict):
            keys.extend(_auto_keys(value, f"{path}."))
        elif value == "auto" and (rule is None or rule.status is not Status.ACCEPTED):
            keys.append(path)
    return keys


def _auto_message(keys: list[str]) -> str:
    """What follows an error on a config with "auto" values.

    [Note: "auto"] Hugging Face's Trainer fills a DeepSpeed config's "auto" values from its
    TrainingArguments before DeepSpeed reads them; DeepSpeed itself refuses them. chunkmem
    refuses them too when called directly (there are no TrainingArguments to fill them from),
    naming every one, and chunkmem.integrations.hf fills them as the Trainer does."""
    listed = ", ".join(repr(key) for key in keys)
    return (
        f"DeepSpeed key{'s' if len(keys) > 1 else ''} {listed} "
        f'{"are" if len(keys) > 1 else "is"} "auto": Hugging Face\'s Trainer fills "auto" '
        f"values from its TrainingArguments (precision from bf16/fp16, the optimizer's lr, betas, "
        f"eps and weight decay, the scheduler's steps, batch sizes, accumulation and clipping), "
        f"and chunkmem.initialize has no TrainingArguments to fill them from. Set each to its "
        f'value (for example "bf16": {{"enabled": true}}, "optimizer": {{"params": '
        f'{{"lr": 3e-4}}}}), or train through chunkmem.integrations.hf.ChunkmemTrainer, which '
        f"fills them as Hugging Face's DeepSpeed integration does (docs/integrations.md)"
    )


def _unknown(path: str) -> str:
    close = difflib.get_close_matches(path, list(_BY_KEY) + sorted(_SECTIONS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"unknown DeepSpeed key {path!r}: {hint}docs/config.md lists every DeepSpeed key "
        f"chunkmem reads, and what it becomes"
    )


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _flatten(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys.extend(_flatten(value, f"{prefix}{key}."))
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
