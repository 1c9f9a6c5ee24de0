"""The memory-trace document: the run's bytes as plain JSON data, schema ``chunkmem.memory_trace/1``.

Every number comes from the ledger, the tracer, the manager or the config, so the JSON file
and the HTML page (rendered from this same document) cannot disagree. Bytes are ints; the
keys are described in ``docs/reports.md``. A change that renames or removes a key, or
changes a meaning, bumps the version after the slash; adding a key does not.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from chunkmem.chunk import ChunkKind, Tier
from chunkmem.ledger import WORKSPACE, Ledger

if TYPE_CHECKING:
    from chunkmem.engine import Engine

SCHEMA = "chunkmem.memory_trace/1"

DIRECTIONS = {"device": "to_device", "host": "to_host"}  # destination tier -> direction


def build_memory_trace(engine: Engine) -> dict[str, Any]:
    """The whole document for ``engine``'s run so far."""
    ledger = engine.ledger
    kinds = kinds_seen(ledger)
    return {
        "schema": SCHEMA,
        "kinds": kinds,
        "summary": _summary(engine),
        "moments": [
            {
                "iteration": sample.iteration,
                "index": sample.index,
                "label": sample.label,
                "device": {
                    "by_kind": {kind: sample.device_by_kind.get(kind, 0) for kind in kinds},
                    "nonmodel": sample.device_nonmodel,
                },
                "host": {"by_kind": {kind: sample.host_by_kind.get(kind, 0) for kind in kinds}},
            }
            for sample in ledger.moment_samples
        ],
        "moves": [
            {
                "seq": move.seq,
                "iteration": move.iteration,
                "moment": move.moment,
                "chunk_id": move.chunk_id,
                "kind": move.kind,
                "src": move.src,
                "dst": move.dst,
                "direction": DIRECTIONS[move.dst],
                "nbytes": move.nbytes,
                "reason": move.reason,
            }
            for move in ledger.moves
        ],
        "moves_dropped": ledger.moves_dropped,
        "allocations_recorded": len(ledger.allocations),
        "allocations_dropped": ledger.allocations_dropped,
        "moment_samples_dropped": ledger.moment_samples_dropped,
        "bytes_moved": [
            {
                "iteration": iteration,
                "to_device": ledger.bytes_to_device[iteration],
                "to_host": ledger.bytes_to_host[iteration],
            }
            for iteration in sorted(set(ledger.bytes_to_device) | set(ledger.bytes_to_host))
        ],
        "config": engine.config.model_dump(mode="json"),
    }


def kinds_seen(ledger: Ledger) -> list[str]:
    """Chunk kinds in a fixed order (then any other kind the ledger saw), for stable columns."""
    known = [kind.value for kind in ChunkKind] + [WORKSPACE]
    seen = {kind for tier in ledger.tiers.values() for kind in tier.by_kind}
    for sample in ledger.moment_samples:
        seen.update(sample.device_by_kind)
        seen.update(sample.host_by_kind)
    seen.update(move.kind for move in ledger.moves)
    return known + sorted(seen - set(known))


def _summary(engine: Engine) -> dict[str, Any]:
    ledger = engine.ledger
    homes = engine.manager.optimizer_homes
    return {
        "device_kind": engine.manager.device.kind,
        "precision": engine.config.precision,
        "global_steps": engine.global_steps,
        "iterations": ledger.iteration,
        "loss_scale": engine.loss_scale,
        "tiers": {
            name: {
                "capacity": account.capacity,
                "peak": account.peak,
                "peak_model": account.peak_model,
                "used_now": account.used,
            }
            for name, account in ledger.tiers.items()
        },
        "model_state_bytes": engine.model_state_bytes(),
        "chunks": engine.chunk_summary(),
        "padding_bytes": sum(
            chunk.layout.padding * chunk.dtype.itemsize for chunk in engine.manager.chunks.values()
        ),
        # None until the first optimizer step chooses where the states live.
        "optimizer_state_homes": None
        if homes is None
        else {tier.value: Counter(homes.values())[tier] for tier in Tier},
        "repaired_grad_slots": list(engine.manager.repaired_grad_slots),
        "tracer": {
            "cycles_recorded": engine.tracer.cycles_recorded,
            "divergences": engine.tracer.divergences,
        },
    }
