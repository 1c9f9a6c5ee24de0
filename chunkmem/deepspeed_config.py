"""DeepSpeed JSON configs, translated into chunkmem's config.

Every key DeepSpeed documents has a rule here (:data:`RULES`, also the table in
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
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from chunkmem.config import Config
from chunkmem.config_errors import describe_validation_error
from chunkmem.errors import ConfigError

_log = logging.getLogger("chunkmem")


class Status(enum.Enum):
    MAPPED = "mapped"
    ACCEPTED = "accepted"  # no meaning for chunks: one logged line
    PLANNED = "planned"
    NOT_PLANNED = "not planned"


@dataclass(frozen=True)
class Rule:
    """What a DeepSpeed key becomes. ``inert``: values that ask for nothing (the feature
    off), accepted whatever the status; a section's ``enabled`` is checked the same way."""

    key: str
    status: Status
    target: str = ""
    note: str = ""
    inert: tuple[Any, ...] = ()


def _r(key: str, status: Status, target: str = "", note: str = "", inert=()) -> Rule:
    return Rule(key, status, target, note, tuple(inert))


M, A, P, N = Status.MAPPED, Status.ACCEPTED, Status.PLANNED, Status.NOT_PLANNED
_BUCKETS = "chunks are the unit of gathering, reduction, prefetch and update (chunk.size)"
_DIAGNOSTIC = "diagnostics only; engine.write_report() writes chunkmem's memory trace"
_OFF = (False, None)

RULES: tuple[Rule, ...] = (
    # batch
    _r(
        "train_batch_size",
        M,
        "gradient_accumulation_steps",
        "with DeepSpeed's rule: train_batch_size = micro batch x accumulation x data-parallel ranks",
    ),
    _r(
        "train_micro_batch_size_per_gpu",
        M,
        "gradient_accumulation_steps",
        "the same rule; the engine takes the micro-batches you pass",
    ),
    _r("gradient_accumulation_steps", M, "gradient_accumulation_steps"),
    _r("gradient_clipping", M, "gradient_clipping"),
    # optimizer and schedule
    _r(
        "optimizer.type",
        M,
        "optimizer.type",
        "Adam and AdamW (case-insensitive); as in DeepSpeed, Adam decouples weight decay (AdamW) unless params.adam_w_mode is false. Others: not planned",
    ),
    _r("optimizer.params.lr", M, "optimizer.lr"),
    _r("optimizer.params.betas", M, "optimizer.betas"),
    _r("optimizer.params.eps", M, "optimizer.eps"),
    _r(
        "optimizer.params.weight_decay",
        M,
        "optimizer.weight_decay",
        "DeepSpeed's default 0 when absent",
    ),
    _r("optimizer.params.adam_w_mode", M, "optimizer.type"),
    _r("optimizer.params.torch_adam", A, note="chunkmem always runs torch's fused Adam kernel"),
    _r(
        "optimizer.params.bias_correction",
        N,
        note="torch's Adam always corrects bias",
        inert=(True,),
    ),
    _r("optimizer.params.amsgrad", N, inert=(False,)),
    _r(
        "optimizer.params.max_grad_norm",
        N,
        note="DeepSpeed refuses it too: use gradient_clipping",
        inert=(None,),
    ),
    _r("optimizer.legacy_fusion", A, note="no fused-optimizer variants to choose from"),
    _r(
        "scheduler.type",
        M,
        "scheduler.type",
        "WarmupLR, WarmupDecayLR, WarmupCosineLR; LRRangeTest and OneCycle: planned",
    ),
    *(
        _r(f"scheduler.params.{key}", M, f"scheduler.{key}")
        for key in (
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "warmup_min_ratio",
            "cos_min_ratio",
        )
    ),  # fmt: skip
    _r(
        "scheduler.params.last_batch_iteration",
        P,
        note="resume a schedule from a checkpoint instead",
        inert=(-1,),
    ),
    # precision
    _r("fp16.enabled", M, "precision", "fp16"),
    _r(
        "fp16.auto_cast", A, note="chunkmem casts floating-point inputs to the compute dtype always"
    ),
    _r("fp16.loss_scale", M, "loss_scale", "0: dynamic; a fixed scale is planned", inert=(0, 0.0)),
    _r("fp16.initial_scale_power", M, "loss_scale.initial_scale", "2 ** power"),
    _r("fp16.loss_scale_window", M, "loss_scale.growth_interval"),
    _r("fp16.min_loss_scale", M, "loss_scale.min_scale"),
    _r(
        "fp16.hysteresis",
        P,
        note="chunkmem's scaler backs off at every overflow, as hysteresis 1 (torch's GradScaler)",
        inert=(1,),
    ),
    _r("fp16.consecutive_hysteresis", P, inert=(False,)),
    _r("fp16.fp16_master_weights_and_grads", N, inert=_OFF),
    _r("bf16.enabled", M, "precision", "bf16"),
    _r(
        "bf16.check_overflow",
        M,
        "nonfinite",
        "true: skip; false: chunkmem still checks and raises (nonfinite: raise)",
    ),
    _r(
        "bf16.immediate_grad_update",
        A,
        note="gradients move into chunks as soon as autograd has accumulated them",
    ),
    _r("bf16.bf16_master_weights_and_grads", N, inert=_OFF),
    _r("bf16.bf16_optimizer_states", P, inert=_OFF),
    _r("amp", N, note="use bf16 or fp16"),
    _r("torch_autocast", N, note="chunkmem trains in one compute dtype (precision)"),
    _r("data_types.grad_accum_dtype", P, inert=(None,)),
    _r("communication_data_type", P, inert=(None,)),
    _r("prescale_gradients", P, inert=(False,)),
    _r("gradient_predivide_factor", P, inert=(1, 1.0)),
    _r("gradient_allreduce_op", P, inert=("mean",)),
    _r("sparse_gradients", N, inert=(False,)),
    # ZeRO
    _r(
        "zero_optimization.stage",
        M,
        "zero.stage",
        "stage 0 on several ranks (DeepSpeed's data parallelism without sharding) is not planned: use stage 1",
    ),
    *(
        _r(f"zero_optimization.{key}", A, note=_BUCKETS)
        for key in (
            "allgather_bucket_size",
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_max_live_parameters",
            "max_live_parameters",
            "stage3_max_reuse_distance",
            "max_reuse_distance",
            "sub_group_size",
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "allgather_partitions",
            "use_multi_rank_bucket_allreduce",
            "round_robin_gradients",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            "memory_efficient_linear",
        )
    ),  # fmt: skip
    *(
        _r(
            f"zero_optimization.{key}",
            A,
            note="checkpoints are per parameter and reshard; chunkmem.consolidate writes full weights",
        )
        for key in (
            "elastic_checkpoint",
            "load_from_fp32_weights",
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        )
    ),  # fmt: skip
    _r(
        "zero_optimization.ignore_unused_parameters",
        A,
        note="parameters without a gradient are skipped, as torch's Adam does",
    ),
    *(
        _r(f"zero_optimization.{key}", A, note="DeepSpeed-internal checks and hooks")
        for key in (
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "override_module_apply",
            "pipeline_loading_checkpoint",
            "legacy_stage1",
        )
    ),  # fmt: skip
    _r(
        "zero_optimization.offload_optimizer.device",
        M,
        "offload.optimizer",
        "cpu: host, nvme: nvme (with nvme_path), none: off",
    ),
    _r("zero_optimization.offload_optimizer.nvme_path", M, "offload.nvme.path"),
    _r("zero_optimization.offload_optimizer.ratio", M, "offload.optimizer_ratio"),
    *(
        _r(
            f"zero_optimization.offload_optimizer.{key}",
            A,
            note="chunkmem's host and NVMe tiers size their own buffers",
        )
        for key in (
            "pin_memory",
            "buffer_count",
            "fast_init",
            "pipeline_read",
            "pipeline_write",
            "cpuadam_cores_perc",
        )
    ),  # fmt: skip
    _r("zero_optimization.offload_optimizer.super_offload", N, inert=_OFF),
    _r(
        "zero_optimization.offload_param.device",
        M,
        "",
        "cpu: parameters already move between device and host as the device budget requires (accepted, logged); nvme: planned",
    ),
    *(
        _r(
            f"zero_optimization.offload_param.{key}",
            A,
            note="parameters are evicted to the host a chunk at a time",
        )
        for key in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "nvme_path")
    ),  # fmt: skip
    _r(
        "zero_optimization.cpu_offload",
        M,
        "offload.optimizer",
        "deprecated form of offload_optimizer.device cpu",
    ),
    _r("zero_optimization.cpu_offload_param", A, note="as offload_param.device cpu"),
    _r(
        "zero_optimization.cpu_offload_use_pin_memory",
        A,
        note="chunkmem pins its host staging buffers itself",
    ),
    _r(
        "zero_optimization.zero_quantized_weights", M, "zero.quantized_weights", "ZeRO++ qwZ (int8)"
    ),
    _r("zero_optimization.zero_hpz_partition_size", M, "zero.hpz_partition_size", "ZeRO++ hpZ"),
    _r(
        "zero_optimization.zero_quantized_gradients",
        M,
        "zero.quantized_gradients",
        "ZeRO++ qgZ (int4)",
    ),
    _r("zero_optimization.zero_quantized_nontrainable_weights", P, inert=_OFF),
    _r("zero_optimization.zeropp_loco_param", N, inert=(None,)),
    _r("zero_optimization.mics_shard_size", N, inert=(-1,)),
    _r("zero_optimization.mics_hierarchical_params_gather", N, inert=_OFF),
    _r("zero_optimization.zenflow", N, inert=(None,)),
    _r(
        "zero_optimization.leaf_module",
        N,
        note="chunkmem hooks units of at most a chunk (placement.unit_elements)",
    ),
    _r("zero_optimization.save_muon_momentum_buffer_in_memory", N, inert=_OFF),
    _r("zero_allow_untested_optimizer", A, note="chunkmem runs Adam/AdamW only"),
    _r("zero_force_ds_cpu_optimizer", A, note="the host update is chunkmem's own"),
    # diagnostics and bookkeeping
    *(
        _r(key, A, note=_DIAGNOSTIC)
        for key in (
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "log_level",
            "timers",
        )
    ),  # fmt: skip
    _r("dataloader_drop_last", A, note="chunkmem builds no data loader"),
    _r("vocabulary_size", A, note="read by DeepSpeed's sparse embedding code only"),
    _r("managed_gradient_accumulation", A, note="the engine always counts micro-steps itself"),
    _r("checkpoint", A, note="chunkmem's checkpoints are DCP, per parameter, and reshard"),
    _r("aio", A, note="DeepSpeed's async I/O library; chunkmem's NVMe tier has offload.nvme.*"),
    _r("disable_allgather", N, inert=_OFF),
    _r("graph_harvesting", N, inert=_OFF),
    _r("use_data_before_expert_parallelism", N, inert=_OFF),
    _r("seq_parallel_communication_data_type", N, inert=("fp32",)),
    _r("compile", P, note="torch.compile around hooked modules"),
    _r("sequence_parallel_size", N, inert=(1,)),
    *(
        _r(key, N)  # features: accepted only while disabled
        for key in (
            "flops_profiler",
            "comms_logger",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "activation_checkpointing",
            "sparse_attention",
            "curriculum_learning",
            "data_efficiency",
            "compression_training",
            "progressive_layer_drop",
            "eigenvalue",
            "quantize_training",
            "weight_quantization",
            "pipeline",
            "tensor_parallel",
            "elasticity",
            "autotuning",
            "hybrid_engine",
            "nebula",
        )
    ),  # fmt: skip
)
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
            f"DeepSpeed key 'optimizer.type' is {value!r}: chunkmem runs Adam and AdamW on its "
            f"chunks, and other optimizers are not planned"
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


def mapping_markdown() -> str:
    """The table of every DeepSpeed key and what it becomes (a section of docs/config.md)."""
    lines = [
        "## DeepSpeed keys",
        "",
        "A DeepSpeed JSON config runs unchanged (`chunkmem/deepspeed_config.py`): each key is",
        "mapped, accepted with one logged line (no meaning for chunks), or refused with an error",
        "naming it. A refused key is accepted while it asks for nothing (its feature disabled,",
        "or the value listed). Any other key is an error. Settings DeepSpeed has no key for go",
        'in a `"chunkmem"` block of the sections above.',
        "",
        'A value `"auto"` is a placeholder that Hugging Face\'s Trainer fills from its',
        "`TrainingArguments` before DeepSpeed reads the config. `chunkmem.initialize` refuses",
        "it, listing every such key, except on keys that are accepted whatever their value",
        "(bucket sizes, persistence thresholds): set the values, or train through",
        "`chunkmem.integrations.hf.ChunkmemTrainer`, which fills them as the Trainer does",
        "([integrations.md](integrations.md#deepspeed-json-and-auto) lists which argument fills",
        "which key).",
        "",
        "| DeepSpeed key | chunkmem | note |",
        "|---|---|---|",
    ]
    for rule in RULES:
        if rule.status is Status.MAPPED:
            what = f"`{rule.target}`" if rule.target else "mapped"
        elif rule.status is Status.ACCEPTED:
            what = "accepted, logged"
        else:
            what = rule.status.value
        extra = [rule.note] if rule.note else []
        if rule.inert and rule.status is not Status.MAPPED:
            extra.append("accepted when " + " or ".join(_json(v) for v in rule.inert))
        elif rule.status in (Status.PLANNED, Status.NOT_PLANNED):
            extra.append("accepted while disabled (`enabled` false, or every setting off)")
        note = "; ".join(extra).replace("|", "\\|")
        lines.append(f"| `{rule.key}` | {what} | {note} |")
    return "\n".join(lines) + "\n"


def _json(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"
