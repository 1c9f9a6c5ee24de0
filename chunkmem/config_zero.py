"""The ``zero`` section of the config (docs/zero.md, docs/zeropp.md): ZeRO's stage, its
transport and timeouts, the node topology, ZeRO++'s techniques and the step's two-level
gather, with the rules between them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from chunkmem.config_section import Section


class ZeroConfig(Section):
    """ZeRO sharding across data-parallel ranks (launch with torchrun; one process per rank)."""

    stage: Literal[0, 1, 2, 3] = Field(
        0,
        description="0: one process, no sharding. 1: optimizer states sharded. 2: gradients "
        "too, reduce-scattered during backward. 3: parameters too, gathered for compute.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: nccl with CUDA, gloo otherwise."
    )
    transport: Literal["ring", "builtin"] = Field(
        "ring",
        description="How gloo runs all-gathers and reduce-scatters. ring: point-to-point "
        "rings (2-3x faster than gloo's own collectives on one machine); builtin: "
        "torch.distributed's collectives, as FSDP and DeepSpeed use them (an ablation). "
        "NCCL always runs its own.",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Every collective fails after this long, naming the operation and the "
        "group, instead of hanging when a peer rank died or hung.",
    )
    node_size: int | None = Field(
        None,
        ge=1,
        description="Ranks per node (consecutive global ranks share a node). null: torchrun's "
        "LOCAL_WORLD_SIZE, or one node when it is unset. Set it to emulate nodes on one "
        "machine (4 ranks as 2 nodes x 2). The communication ledger splits every "
        "collective's bytes into intra-node and cross-node by it.",
    )
    quantized_weights: bool | Literal["int8", "int4"] = Field(
        False,
        description="ZeRO++ qwZ (stage 3): parameter all-gathers send block-quantized values "
        "plus one fp32 scale per block, dequantized into the gathered chunk. true means int8. "
        "Halves (int8) or quarters (int4) the 16-bit gather bytes; every rank computes on "
        "the same dequantized values, while shards and fp32 masters stay exact "
        "(docs/zeropp.md gives the error bound).",
    )
    quantized_weights_block_size: int = Field(
        256,
        ge=2,
        description="Elements per qwZ block (one fp32 scale each): smaller blocks are more "
        "accurate and send 4 bytes of scale per block more.",
    )
    quantized_weights_two_level: bool = Field(
        True,
        description="qwZ's gather as two all-gathers, across nodes among the ranks of one "
        "local rank, then inside the node, where the world spans several nodes of several "
        "ranks: a node takes in only the pieces its peers hold ((N-1)/N of the layout) where "
        "one ring over the world brings (W-1)/W (3 pieces for 2 on 2 nodes x 2, 15 for 8 on "
        "2 nodes x 8). false: one all-gather over the world (the ablation).",
    )
    step_gather_two_level: bool = Field(
        True,
        description="Stages 1-2: the all-gather of each layout's updated parameter shards "
        "after its update in two levels, across nodes among the ranks of one local rank, then "
        "inside each node, in place, where the world spans several nodes of several ranks and "
        "that cuts what a node takes in by 10% or more (up to 8 nodes of 8): a node takes in "
        "(W-D)/(W-1) of one ring's pieces (2 of 3 on 2 nodes x 2, 8 of 15 on 2 x 8), in "
        "nodes + 1 collectives where a ring is one. The same parameters bit for bit. false: "
        "one all-gather over the world (the ablation).",
    )
    overlap_step_gather: bool = Field(
        False,
        description="Stages 1-2: the step returns with its all-gathers of updated parameter "
        "shards still in flight (issued on every rank, not yet waited for); each layout's "
        "gather is waited for where the next forward first reads the layout, so the last "
        "layouts' gathers overlap the first layouts' forward (Megatron's "
        "overlap_param_gather). Until then a parameter's memory is being written: read "
        "parameters between step() and the next forward through the engine (state_dict, "
        "checkpoints) or after engine.wait_for_parameters(). false: the step waits for "
        "every gather before it returns.",
    )
    hpz_partition_size: int = Field(
        1,
        ge=1,
        description="ZeRO++ hpZ (stage 3): after the forward gather each rank keeps 1/this of "
        "the gathered parameters, so the backward gather runs inside groups of this many "
        "consecutive ranks (a divisor of the node size) and never crosses nodes. 1: off. "
        "Costs 16-bit params / this size per rank until the optimizer step.",
    )
    quantized_gradients: bool | Literal["int4", "int8"] = Field(
        False,
        description="ZeRO++ qgZ: the gradient reduce-scatter becomes a hierarchical "
        "all-to-all of block-quantized gradients (intra-node, then across nodes), summed in "
        "fp32. true means int4, a quarter of 16-bit gradient bytes across nodes.",
    )
    quantized_gradients_block_size: int = Field(
        256,
        ge=2,
        description="Elements per qgZ block (one fp32 scale each).",
    )

    @model_validator(mode="after")
    def _zeropp_needs_its_stage(self) -> ZeroConfig:
        stage3 = {
            "quantized_weights": self.quantized_weights is not False,
            "hpz_partition_size": self.hpz_partition_size > 1,
        }
        for key, on in stage3.items():
            if on and self.stage != 3:
                raise ValueError(
                    f"zero.{key} gathers stage-3 parameters; it needs zero.stage 3, got "
                    f"stage {self.stage}"
                )
        if self.overlap_step_gather and self.stage not in (1, 2):
            raise ValueError(
                "zero.overlap_step_gather carries stages 1-2's gathers of updated shards into "
                f"the next forward; it needs zero.stage 1 or 2, got stage {self.stage} "
                "(stage 3 gathers for compute and already gathers ahead across the step; "
                "stage 0 gathers nothing)"
            )
        if self.quantized_gradients is not False and self.stage == 0:
            raise ValueError(
                "zero.quantized_gradients reduces gradients across ranks; it needs "
                "zero.stage 1, 2 or 3, got stage 0"
            )
        for key in ("quantized_weights_block_size", "quantized_gradients_block_size"):
            if getattr(self, key) % 2:
                raise ValueError(
                    f"zero.{key} must be even (int4 packs two values per byte and every block "
                    f"starts on a byte), got {getattr(self, key)}"
                )
        return self
