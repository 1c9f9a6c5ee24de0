"""The ``compression`` section of the config (docs/compression.md): its keys, its own rules,
and the combinations with the rest of the config it refuses by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from chunkmem.config_section import Section

if TYPE_CHECKING:
    from chunkmem.config import Config

# Compression methods that carry state from step to step (residuals, warm starts).
ERROR_FEEDBACK_METHODS = ("onebit", "powersgd", "dgc", "auto")  # auto may pick either

# Methods of the lecture's list that a user may ask for by name, and why they are not offered.
_NOT_OFFERED = {
    "dga": "Delayed Gradient Averaging updates every parameter on every rank with its local "
    "gradient before the average arrives, which needs the whole optimizer state on every "
    "rank; ZeRO 1-3 shard it (and compression needs ZeRO 1-3). Use onebit, terngrad, powersgd, "
    "dgc or auto",
}


class CompressionConfig(Section):
    """Gradient compression on the reduce-scatter of ZeRO stages 1-3 (docs/compression.md)."""

    type: Literal["none", "onebit", "terngrad", "powersgd", "dgc", "auto"] = Field(
        "none",
        description="none: exact reduce-scatter. onebit: sign plus one fp32 scale per block "
        "with error feedback (1-bit SGD). terngrad: stochastic {-1, 0, +1} times each block's "
        "max, unbiased, no state. powersgd: rank-r approximation of every large matrix with "
        "error feedback and a warm-started Q; vectors and small tensors are reduced exactly. "
        "dgc: Deep Gradient Compression, the largest blocks of the locally accumulated "
        "gradients (or momentum), with local clipping and a sparsity warm-up. "
        "auto: after the warm-up, one of the three or none, whichever a judge predicts fastest "
        "from a link probe at initialize, the measured exact step and timed codecs (logged and "
        "in the report).",
    )
    block_size: int = Field(
        256,
        ge=32,
        le=4096,
        description="onebit/terngrad: elements per fp32 scale; dgc: elements per block its "
        "top-k keeps or drops whole. A power of two (32 to 4096): smaller blocks follow the "
        "gradient more closely and send 4 bytes per block more.",
    )
    density: float = Field(
        0.001,
        gt=0,
        le=1,
        description="dgc: the share of each rank's slice of a layout sent per step, in whole "
        "blocks (at least one); the paper's 99.9% sparsity is 0.001.",
    )
    sparsity_warmup_steps: int = Field(
        0,
        ge=0,
        description="dgc: compressed steps over which the density falls exponentially from "
        "0.25 to density (the paper's warm-up: 75%, 93.75%, ... 99.9% sparsity).",
    )
    momentum_correction: bool = Field(
        False,
        description="dgc: accumulate the momentum u instead of the gradient and zero the sent "
        "blocks of u (momentum factor masking). Adam: u = m u + (1 - m) g, and the "
        "frozen-variance step takes the reduced sums as its first moment (needs "
        "freeze_variance). SGD: u = m u + g, the paper's, applied as it is (needs "
        "optimizer.momentum 0).",
    )
    momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="dgc with momentum_correction: the decay m of the local momentum (on "
        "compressed steps it replaces Adam's beta1, or SGD's momentum).",
    )
    rank: int = Field(4, ge=1, description="powersgd: the approximation's rank r.")
    min_compression_rate: float = Field(
        2.0,
        ge=1,
        description="powersgd: a matrix of n x m is compressed only when n*m >= this times "
        "r*(n+m); the others travel exactly.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Optimizer steps whose gradients are reduced exactly before compression "
        "starts (PowerSGD's start iteration, 1-bit Adam's warm-up).",
    )
    clip_sigma: float = Field(
        2.5,
        ge=0,
        description="terngrad: each parameter's gradient is clipped to this many standard "
        "deviations before ternarizing, as in the paper (0: off).",
    )
    seed: int = Field(0, ge=0, description="terngrad's stochastic rounding and powersgd's first Q.")
    auto_min_gain: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="auto: the share of the exact step time a method must be predicted to save "
        "before it is picked (compression also costs convergence; below it, none).",
    )
    freeze_variance: bool = Field(
        False,
        description="1-bit Adam's second stage: Adam's second moment stops updating when the "
        "warm-up ends and keeps the value the exact gradients gave it, so compressed gradients "
        "move only the first moment. Needs warmup_steps >= 1 (the 1-bit Adam paper warms up "
        "for 15-25% of training).",
    )

    @model_validator(mode="after")
    def _block_is_power_of_two(self) -> CompressionConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"compression.block_size must be a power of two (its scale is a pairwise sum "
                f"every backend computes in one order), got {self.block_size}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _methods_not_offered(cls, data: Any) -> Any:
        method = data.get("type") if isinstance(data, dict) else None
        if method in _NOT_OFFERED:
            raise ValueError(f"compression.type {method!r}: {_NOT_OFFERED[method]}")
        return data

    @model_validator(mode="after")
    def _dgc_keys(self) -> CompressionConfig:
        if self.type != "dgc":
            # a value other than the default (a dumped config states every default)
            asked = [
                key
                for key in ("density", "sparsity_warmup_steps", "momentum_correction", "momentum")
                if getattr(self, key) != type(self).model_fields[key].default
            ]
            if asked:
                raise ValueError(
                    f"compression.{asked[0]} is a setting of compression.type 'dgc', got "
                    f"type {self.type!r}"
                )
        return self

    @model_validator(mode="after")
    def _auto_needs_timed_steps(self) -> CompressionConfig:
        if self.type == "auto" and self.warmup_steps < 3:
            raise ValueError(
                f"compression.type 'auto' times the exact warm-up steps (the first, which "
                f"builds and allocates, is left out) before it decides; it needs "
                f"compression.warmup_steps >= 3, got {self.warmup_steps}"
            )
        return self

    @model_validator(mode="after")
    def _freeze_needs_warmup(self) -> CompressionConfig:
        if self.freeze_variance and (self.type == "none" or self.warmup_steps < 1):
            what = (
                "a compressed reduction (compression.type is 'none')"
                if self.type == "none"
                else "compression.warmup_steps >= 1 (the variance it freezes is the one the "
                "exact warm-up steps built; with 0 it would be all zeros)"
            )
            raise ValueError(f"compression.freeze_variance needs {what}")
        return self


def check_compression(config: Config) -> None:
    """Refuse, by name, the combinations compression cannot serve."""
    method = config.compression.type
    if method == "none":
        return
    if config.zero.stage == 0:
        raise ValueError(
            f"compression.type {method!r} compresses the gradient reduction across ranks; it "
            f"needs zero.stage 1, 2 or 3, got stage 0"
        )
    if config.zero.quantized_gradients is not False:
        raise ValueError(
            f"compression.type {method!r} and zero.quantized_gradients both replace the "
            f"gradient reduce-scatter; choose one"
        )
    check_optimizer(config.compression, config.optimizer.type, config.optimizer.momentum)
    skips = config.precision == "fp16" or config.nonfinite == "skip"
    if config.compression.freeze_variance and skips:
        why = "precision fp16" if config.precision == "fp16" else "nonfinite 'skip'"
        raise ValueError(
            f"compression.freeze_variance corrects each frozen step by the parameter's last "
            f"exact step, counted back from the compressor's steps; {why} skips optimizer "
            f"steps the compressor counts, so the count back would be wrong. Use bf16 or fp32 "
            f"with nonfinite 'raise', or leave freeze_variance off"
        )
    if method in ERROR_FEEDBACK_METHODS and skips:
        why = "precision fp16" if config.precision == "fp16" else "nonfinite 'skip'"
        raise ValueError(
            f"compression.type {method!r} keeps error-feedback state built from every step's "
            f"gradients, and {why} discards steps after their gradients were reduced: the "
            f"state would carry a discarded (or loss-scaled) step into the next. Use bf16 or "
            f"fp32 with nonfinite 'raise', or compression.type 'terngrad' (no state)"
        )


def check_optimizer(compression: CompressionConfig, optimizer: str, momentum: float) -> None:
    """What the optimizer (``optimizer``: adam, adamw or sgd, the largest group ``momentum``)
    must be beside ``compression``: momentum correction sends momentum sums, so the optimizer
    must not add momentum again (Adam takes them as its first moment with the variance
    frozen, SGD applies them as they are), and SGD has no variance to freeze. The config
    checks its own optimizer; ``initialize`` the one it is given."""
    if optimizer != "sgd":
        if compression.momentum_correction and not compression.freeze_variance:
            raise ValueError(
                "compression.momentum_correction sends momentum sums, which Adam must take as "
                "its first moment with a fixed second moment; it needs "
                "compression.freeze_variance true (and warmup_steps >= 1 exact steps to build "
                "the variance it keeps)"
            )
        return
    if compression.freeze_variance:
        raise ValueError(
            "compression.freeze_variance freezes Adam's second moment; the optimizer is SGD, "
            "which has none. Leave it off (or use adam/adamw)"
        )
    if compression.momentum_correction and momentum != 0:
        raise ValueError(
            f"compression.momentum_correction is the momentum under SGD: each rank keeps "
            f"u = m u + g (m = compression.momentum) and SGD applies the summed u as it is; "
            f"optimizer momentum {momentum} would add momentum twice. Set the optimizer's "
            f"momentum to 0"
        )
