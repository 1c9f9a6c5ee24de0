"""What every key DeepSpeed documents becomes in chunkmem: the rule table (:data:`RULES`), one
:class:`Rule` a key (mapped, accepted with one logged line, planned or not planned), and its
rendering as the DeepSpeed section of docs/config.md.

Split from ``chunkmem.deepspeed_config``, which applies these rules to a config: the table is
the one source of truth for both the translation and the docs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


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
