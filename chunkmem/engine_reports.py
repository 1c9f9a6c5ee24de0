"""What an engine tells its report about a run besides the ledger: the run summary, the
chunk layouts, model-state bytes. Read-only views of the engine's parts, kept out of the
training cycle's module."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

from chunkmem.chunk import ChunkKind
from chunkmem.machine import gpu_memory, peak_rss_bytes
from chunkmem.report import RunSummary

if TYPE_CHECKING:
    from chunkmem.engine import Engine


def model_state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of chunks by kind, over both tiers (padding included)."""
    totals: dict[str, int] = {}
    for chunk in engine.residency.chunks.values():
        totals[chunk.kind.value] = totals.get(chunk.kind.value, 0) + chunk.nbytes
    return totals


def run_summary(engine: Engine) -> RunSummary:
    """What a report needs to know about ``engine``'s run besides the ledger."""
    homes = engine.states.homes
    speculation = engine.optimizer.speculation
    device = engine.residency.device.torch_device
    gpu = gpu_memory(device.index or 0) if device.type == "cuda" else None
    return RunSummary(
        device_kind=engine.residency.device.kind,
        precision=engine.config.precision,
        global_steps=engine.global_steps,
        loss_scale=engine.loss_scale,
        model_state_bytes=model_state_bytes(engine),
        chunks=chunk_summary(engine),
        padding_bytes=sum(
            c.layout.padding * c.dtype.itemsize for c in engine.residency.chunks.values()
        ),
        optimizer_state_homes=None
        if homes is None
        else dict(Counter(tier.name for tier in homes.values())),
        repaired_grad_slots=list(engine.grads.repaired_grad_slots),
        cycles_recorded=engine.tracer.cycles_recorded,
        divergences=engine.tracer.divergences,
        config=engine.config.model_dump(mode="json"),
        skipped_steps=engine.scaler.skipped_steps,
        peak_rss_bytes=peak_rss_bytes(),
        speculative_commits=speculation.commits if speculation else 0,
        speculative_rollbacks=speculation.rollbacks if speculation else 0,
        gpu=None if gpu is None else dataclasses.asdict(gpu),
        compression=_compression_summary(engine),
    )


def _compression_summary(engine: Engine) -> dict[str, Any] | None:
    state = engine.reducer.state
    if state is None:
        return None
    described = state.describe()
    return {key: described.get(key) for key in ("method", "steps", "auto")}


def chunk_summary(engine: Engine) -> dict[str, Any]:
    """The chunk layouts and the size search that chose them."""
    layouts = engine.params.layouts
    choice = engine.chunk_choice
    return {
        "chunk_size_elements": choice.trainable.size,
        "frozen_chunk_size_elements": choice.frozen.size,
        "layouts": len(layouts),
        "chunks_by_kind": {
            kind.value: sum(1 for c in engine.residency.chunks.values() if c.kind is kind)
            for kind in ChunkKind.all()
        },
        "padding_elements": sum(layout.padding for layout in layouts),
        "used_elements": sum(layout.used for layout in layouts),
        "search": {
            "padding_elements": choice.padding_elements,
            "waste_fraction": choice.waste_fraction,
            "oversized_tensors": choice.oversized_tensors,
            "candidates_tried": choice.candidates_tried,
        },
    }
