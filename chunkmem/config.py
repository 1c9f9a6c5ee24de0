"""The engine's typed configuration: every section, its defaults and the rules between keys.

Every section is a frozen pydantic model with ``extra="forbid"``. The sections that grew their
own rules live apart: ``compression`` in ``chunkmem.config_compression``, ``zero`` in
``chunkmem.config_zero``. Loading (from a dict, a JSON file or a
DeepSpeed config) is ``chunkmem.config_loading``: it turns validation errors into one
:class:`ConfigError` whose lines name the key path, the bad value and the reason, and for an
unknown key the closest valid one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from chunkmem.byte_sizes import parse_byte_size
from chunkmem.config_compression import CompressionConfig, check_compression
from chunkmem.config_loading import coerce_config, config_from_dict, config_from_json
from chunkmem.config_section import Section
from chunkmem.config_zero import ZeroConfig

ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=0)]


class OptimizerConfig(Section):
    """The optimizer's hyper-parameters (Adam, AdamW or SGD); used when ``initialize`` is not
    given a torch optimizer."""

    type: Literal["adam", "adamw", "sgd"] = Field(
        "adamw",
        description="adamw decouples weight decay; sgd is torch.optim.SGD (momentum, nesterov, "
        "L2 weight decay), one fp32 moment per element where momentum > 0, none without.",
    )
    lr: float = Field(1e-3, gt=0, description="Learning rate (schedulers may change it per step).")
    # strict=False on sequences: JSON has no tuples, so a list must be accepted.
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), strict=False, description="adam/adamw: decay rates of the two moments."
    )
    eps: float = Field(1e-8, gt=0, description="adam/adamw: added to the denominator.")
    weight_decay: float = Field(
        0.01,
        ge=0,
        description="L2 penalty (adam, sgd) or decoupled decay (adamw); the default is every "
        "type's (torch.optim.SGD's own is 0).",
    )
    momentum: float = Field(0.0, ge=0, description="sgd: the momentum factor (0: plain SGD).")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum (needs momentum > 0).")

    @model_validator(mode="after")
    def _keys_of_the_type(self) -> OptimizerConfig:
        """A key of the other optimizer is an error, not ignored (a dumped config states
        every default, so only values other than the default count)."""
        other = ("betas", "eps") if self.type == "sgd" else ("momentum", "nesterov")
        owner = "adam/adamw" if self.type == "sgd" else "sgd"
        for key in other:
            if getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"optimizer.{key} is a setting of optimizer.type {owner}, got type "
                    f"{self.type!r}; remove it or change the type"
                )
        if self.nesterov and self.momentum == 0:
            raise ValueError("optimizer.nesterov needs optimizer.momentum > 0")
        return self


_SCHEDULE_KEYS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": (
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
    ),
    "WarmupCosineLR": (
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "total_num_steps",
    ),
}


class SchedulerConfig(Section):
    """Learning-rate schedule, as DeepSpeed defines it, stepped after every update taken."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] | None = Field(
        None,
        description="null: the learning rate stays (or follows a scheduler passed to "
        "initialize). WarmupLR: warm up, then constant. WarmupDecayLR: then linear decay to 0 "
        "at total_num_steps. WarmupCosineLR: then a cosine to cos_min_ratio times the rate.",
    )
    warmup_min_lr: float = Field(0.0, ge=0, description="WarmupLR/WarmupDecayLR: first rate.")
    warmup_max_lr: float | None = Field(
        None,
        gt=0,
        description="WarmupLR/WarmupDecayLR: rate at the end of warm-up; null: optimizer.lr "
        "(or the torch optimizer's first group).",
    )
    warmup_num_steps: int = Field(1000, ge=1, description="Updates the warm-up takes.")
    warmup_type: Literal["log", "linear"] = Field(
        "log", description="log: the rate rises as log(step + 1) / log(warmup_num_steps)."
    )
    total_num_steps: int | None = Field(
        None, ge=1, description="WarmupDecayLR/WarmupCosineLR (required): where decay ends."
    )
    warmup_min_ratio: float = Field(
        0.0, ge=0, le=1, description="WarmupCosineLR: first rate as a fraction of the rate."
    )
    cos_min_ratio: float = Field(
        0.0001, ge=0, le=1, description="WarmupCosineLR: final rate as a fraction of the rate."
    )

    @model_validator(mode="after")
    def _keys_fit_the_type(self) -> SchedulerConfig:
        used = _SCHEDULE_KEYS.get(self.type, ()) if self.type else ()
        # A key of another schedule may be present at its default (a dumped config reloads).
        for key in sorted(self.model_fields_set - {"type", *used}):
            if getattr(self, key) == type(self).model_fields[key].default:
                continue
            owners = [name for name, keys in _SCHEDULE_KEYS.items() if key in keys]
            raise ValueError(
                f"scheduler.{key} is a setting of {' and '.join(owners)}, not of "
                f"scheduler.type {self.type!r}"
            )
        if self.type in ("WarmupDecayLR", "WarmupCosineLR") and self.total_num_steps is None:
            raise ValueError(f"scheduler.type {self.type!r} needs scheduler.total_num_steps")
        return self

    def schedule_params(self) -> dict[str, Any]:
        """The keyword arguments of the schedule ``type`` names."""
        return {key: getattr(self, key) for key in _SCHEDULE_KEYS[self.type]} if self.type else {}


class LossScaleConfig(Section):
    """Dynamic loss scaling for fp16: an overflow skips the step and lowers the scale."""

    initial_scale: float = Field(2.0**16, gt=0, description="Loss scale of the first step.")
    growth_factor: float = Field(2.0, gt=1, description="Scale multiplier after a good run.")
    backoff_factor: float = Field(
        0.5, gt=0, lt=1, description="Scale multiplier after an overflow."
    )
    growth_interval: int = Field(1000, ge=1, description="Overflow-free steps before growing.")
    min_scale: float = Field(1.0, gt=0, description="The scale never backs off below this.")
    max_skips_at_min_scale: int = Field(
        10,
        ge=1,
        description="Consecutive overflowing steps at min_scale after which training stops "
        "with an error: the run cannot make progress, and skipping forever would hide it.",
    )


class DeviceConfig(Section):
    """The compute device and how much of it chunks and activations may use."""

    type: Literal["auto", "cuda", "simulated"] = Field(
        "auto",
        description="auto: cuda when available, else a simulated device (a capacity-limited "
        "pool in host memory with exact accounting, running the same placement code).",
    )
    capacity: ByteSize | None = Field(
        None,
        description="Bytes the engine may use on the device. Required for the simulated device; "
        "on CUDA defaults to 90% of the memory free at initialize.",
    )
    count_temporaries: bool = Field(
        False,
        description="Simulated device: count every operator output of a forward and backward "
        "while it lives, as CUDA's allocator does (an output before it is saved, the logits' "
        "gradient, backward's intermediates), not only the tensors saved for backward and "
        "the gradients being stored. Costs a Python call per operator. Ignored on CUDA, "
        "where the allocator counts them always.",
    )


class HostConfig(Section):
    """Host memory for chunks that are not on the device."""

    capacity: ByteSize | None = Field(
        None, description="Bytes of host memory the engine may use; None means unlimited."
    )


class ChunkConfig(Section):
    """Chunk geometry."""

    size: int | Literal["auto"] = Field(
        "auto",
        description="Elements per chunk. auto searches the size that wastes the least padding "
        "while a chunk stays a small fraction of the device capacity.",
    )
    max_fraction_of_capacity: float = Field(
        0.125,
        gt=0,
        le=0.5,
        description="Upper bound on one 16/32-bit parameter chunk as a fraction of device "
        "capacity, so that several chunks and the activations fit at once.",
    )


class PlacementConfig(Section):
    """How chunks are placed and moved between device and host."""

    policy: Literal["belady", "lru"] = Field(
        "belady",
        description="belady evicts the chunk whose next traced use is farthest; lru the least "
        "recently used one (a baseline).",
    )
    prefetch: bool = Field(True, description="Fetch the next traced chunks while budget allows.")
    nonmodel_margin: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Head-room added to the traced non-model peak when budgeting chunks; "
        "raise it on CUDA where allocator fragmentation adds to the traced bytes.",
    )
    unit_elements: int | Literal["chunk"] = Field(
        "chunk",
        description="Largest number of parameter elements whose modules are hooked as one "
        "unit (accessed together, one moment). chunk: the chunk size, so a transformer block "
        "is typically one unit; 1 hooks every module that owns parameters.",
    )


class NvmeConfig(Section):
    """The NVMe tier: optimizer-state chunks stored as files (``offload.optimizer: nvme``)."""

    path: str | None = Field(
        None,
        description="Directory for the chunk files, on the fast disk. The engine creates a "
        "private subdirectory in it and removes it on close, on exit and after an error; one "
        "left by a killed process is removed by the next engine using the directory.",
    )
    block_size: ByteSize = Field(
        4 * 2**20,
        ge=4096,
        description="Bytes per read or write request, a multiple of 4096. Each I/O thread owns "
        "one staging buffer of this size and writes share four more, all counted as host "
        "workspace: larger blocks mean fewer requests, smaller ones less host memory.",
    )
    io_threads: int = Field(
        2,
        ge=1,
        description="Threads running reads and writes; while one waits on the disk, another "
        "copies between staging buffers and chunks.",
    )


class OffloadConfig(Section):
    """Where optimizer states live and how the host updates them (docs/offload.md)."""

    optimizer: Literal["auto", "device", "host", "nvme"] = Field(
        "auto",
        description="Where fp32 masters and optimizer moments live and are updated. auto puts "
        "as many chunk groups on the device as the traced margin allows, the rest on the "
        "host. host and nvme take the fraction optimizer_ratio of the groups there (the host "
        "updates them, streaming gradients in and 16-bit values out), the rest as auto. "
        "Parameters and gradients stay on the device and are evicted to the host.",
    )
    optimizer_ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Fraction of the optimizer-state elements offloaded to offload.optimizer "
        "(host or nvme), in whole chunk groups, as DeepSpeed's ratio. The groups whose "
        "gradients are final first in backward go first.",
    )
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="dtype of the Adam moments of groups updated on the host. bf16 halves "
        "their memory and traffic and rounds each moment to 8 significant bits per step "
        "(masters stay fp32). Needs the native host optimizer.",
    )
    overlap: bool = Field(
        False,
        description="Start a chunk group's host update as soon as its gradients are final (after "
        "its reduce-scatter under ZeRO-2/3), on a host thread while backward continues. "
        "With gradient clipping, fp16 or nonfinite: skip the update is speculative: it "
        "assumes the step will neither clip, overflow nor meet a non-finite gradient, and is "
        "rolled back exactly when it does (docs/offload.md). The update then happens in "
        "backward: engine.step() must follow.",
    )
    speculation_bytes: ByteSize | None = Field(
        None,
        description="Host bytes the buffers that make speculative updates undoable may hold "
        "(shadows the new states are written to, swapped in at commit: 12 bytes an element of "
        "a group's state chunks in bf16/fp16 with fp32 states; copies of what an update still "
        "overwrites in place). When they are full, the remaining groups wait for the step's "
        "norm. null: as much as the host budget has room for.",
    )
    optimizer_threads: int | Literal["auto"] = Field(
        "auto",
        description="OpenMP threads of the host optimizer; auto: torch.get_num_threads(). "
        "With overlap, leave cores for the compute.",
    )
    nvme: NvmeConfig = NvmeConfig()


class ReportConfig(Section):
    """Memory-trace report written by ``engine.write_report()``."""

    formats: tuple[Literal["json", "html", "snapshot"], ...] = Field(
        ("json", "html", "snapshot"), strict=False
    )
    max_move_events: int = Field(
        20_000,
        ge=0,
        description="Chunk moves, allocations and moment samples kept for the report, each "
        "(the first ones of the run: warm-up and the first steady iterations); later ones "
        "are only counted, so a long run holds a bounded report (about 25 MB at most).",
    )


class Config(Section):
    """Everything ``chunkmem.initialize`` reads. Load with :meth:`from_dict` or :meth:`from_json`."""

    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Compute precision of parameters. bf16/fp16 keep fp32 master weights in "
        "chunks and let gradients reuse the 16-bit parameter slot.",
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step; engine.backward divides the loss by it "
        "and gradients accumulate in chunks until the step.",
    )
    gradient_clipping: float = Field(
        0.0, ge=0, description="Max global L2 norm of all gradients; 0 disables clipping."
    )
    nonfinite: Literal["raise", "skip"] = Field(
        "raise",
        description="What a step does when a gradient is NaN or infinite (fp32/bf16; fp16 "
        "overflows are the loss scaler's). raise: engine.step() raises FloatingPointError "
        "naming the step, after discarding the gradients (the parameters are untouched, and "
        "the next batch may train). skip: the step is skipped, logged and counted in the "
        "report.",
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    loss_scale: LossScaleConfig = LossScaleConfig()
    device: DeviceConfig = DeviceConfig()
    host: HostConfig = HostConfig()
    chunk: ChunkConfig = ChunkConfig()
    placement: PlacementConfig = PlacementConfig()
    zero: ZeroConfig = ZeroConfig()
    offload: OffloadConfig = OffloadConfig()
    compression: CompressionConfig = CompressionConfig()
    report: ReportConfig = ReportConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return _move_optimizer_states_key(data)

    @model_validator(mode="after")
    def _offload_consistent(self) -> Config:
        offload = self.offload
        if offload.optimizer_ratio < 1 and offload.optimizer not in ("host", "nvme"):
            raise ValueError(
                f"offload.optimizer_ratio {offload.optimizer_ratio} offloads part of the "
                f"optimizer states, so offload.optimizer must be 'host' or 'nvme', not "
                f"{offload.optimizer!r}"
            )
        if offload.optimizer == "nvme" and not offload.nvme.path:
            raise ValueError(
                "offload.optimizer is 'nvme' but offload.nvme.path is not set: give the "
                "directory (on the fast disk) for the chunk files"
            )
        check_compression(self)
        if offload.nvme.block_size % 4096:
            raise ValueError(
                f"offload.nvme.block_size {offload.nvme.block_size} is not a multiple of 4096 "
                f"(direct I/O needs whole pages)"
            )
        return self

    @model_validator(mode="after")
    def _sgd_updates_in_place(self) -> Config:
        check_overlap_updates(self, self.optimizer.type, out_of_place=self.optimizer.type != "sgd")
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return config_from_dict(cls, data)

    @classmethod
    def from_json(cls, path: str | Path) -> Config:
        return config_from_json(cls, path)

    @classmethod
    def coerce(cls, config: Config | dict[str, Any] | str | Path | None) -> Config:
        """Accept what users pass to ``initialize``: a Config, a dict, a JSON path or None."""
        return coerce_config(cls, config)


def _move_optimizer_states_key(data: Any) -> Any:
    """``placement.optimizer_states`` (before offload existed) is ``offload.optimizer`` now: the
    old key keeps working, with a warning, unless both are given."""
    placement = data.get("placement") if isinstance(data, dict) else None
    if not isinstance(placement, dict) or "optimizer_states" not in placement:
        return data
    data = dict(data)
    placement = dict(placement)
    value = placement.pop("optimizer_states")
    offload = dict(data.get("offload") or {})
    if "optimizer" in offload and offload["optimizer"] != value:
        raise ValueError(
            f"placement.optimizer_states ({value!r}) moved to offload.optimizer, which is also "
            f"set ({offload['optimizer']!r}); keep only offload.optimizer"
        )
    warnings.warn(
        "config key 'placement.optimizer_states' is now 'offload.optimizer' (same values, plus "
        "'nvme'); the old key still works",
        DeprecationWarning,
        stacklevel=4,
    )
    offload["optimizer"] = value
    data["placement"], data["offload"] = placement, offload
    return data


def check_overlap_updates(config: Config, optimizer: str, out_of_place: bool) -> None:
    """The speculative overlap writes an early update's new states out of place (to undo it);
    an optimizer whose kernel updates in place only cannot take part."""
    reasons = speculative_reasons(config)
    if config.offload.overlap and reasons and not out_of_place:
        raise ValueError(
            f"offload.overlap starts host updates in backward speculatively here "
            f"({'; '.join(reasons)}), which needs an update written out of place; the "
            f"{optimizer} kernel updates in place only. Set offload.overlap false, or use "
            f"adam/adamw"
        )


def speculative_reasons(config: Config) -> list[str]:
    """Why this config's early host updates (``offload.overlap``) must be undoable (empty:
    they are final)."""
    reasons = []
    if config.gradient_clipping > 0:
        reasons.append("gradient clipping needs the norm of every gradient")
    if config.precision == "fp16":
        reasons.append("fp16's overflow check needs every gradient")
    if config.nonfinite == "skip":
        reasons.append("nonfinite: skip needs every gradient checked")
    return reasons
