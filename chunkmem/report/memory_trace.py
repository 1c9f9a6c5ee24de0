"""The memory-trace document: the run's bytes as plain JSON data, schema ``chunkmem.memory_trace/1``.

Every number comes from the ledger or the run summary the engine fills in, so the JSON file
and the HTML page (rendered from this same document) cannot disagree. Bytes are ints; the
keys are described in ``docs/reports.md``. A change that renames or removes a key, or
changes a meaning, bumps the version after the slash; adding a key does not.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from chunkmem.chunk import ChunkKind
from chunkmem.ledger import WORKSPACE, Ledger
from chunkmem.report.summary import RunSummary

SCHEMA = "chunkmem.memory_trace/1"


def direction(tier: str) -> str:
    """How moves into ``tier`` are labelled (``to_device``, ``to_host``, ``to_nvme``...)."""
    return f"to_{tier}"


def build_memory_trace(summary: RunSummary, ledger: Ledger) -> dict[str, Any]:
    """The whole document for a run so far."""
    kinds = kinds_seen(ledger)
    compute = ledger.device.name
    return {
        "schema": SCHEMA,
        "kinds": kinds,
        "summary": _summary(summary, ledger),
        "moments": [
            {
                "iteration": sample.iteration,
                "index": sample.index,
                "label": sample.label,
                **{
                    tier: {
                        "by_kind": {kind: by_kind.get(kind, 0) for kind in kinds},
                        **({"nonmodel": sample.nonmodel} if tier == compute else {}),
                    }
                    for tier, by_kind in sample.by_tier.items()
                },
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
                "direction": direction(move.dst),
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
                **{direction(tier): ledger.bytes_into(tier, iteration) for tier in ledger.tiers},
            }
            for iteration in ledger.iterations_with_moves()
        ],
        "config": summary.config,
    }


def kinds_seen(ledger: Ledger) -> list[str]:
    """Chunk kinds in a fixed order (then any other kind the ledger saw), for stable columns."""
    known = [kind.value for kind in ChunkKind.all()] + [WORKSPACE]
    seen = {kind for tier in ledger.tiers.values() for kind in tier.by_kind}
    for sample in ledger.moment_samples:
        for by_kind in sample.by_tier.values():
            seen.update(by_kind)
    seen.update(move.kind for move in ledger.moves)
    return known + sorted(seen - set(known))


def _summary(summary: RunSummary, ledger: Ledger) -> dict[str, Any]:
    run = asdict(summary)
    del run["config"]
    cycles, divergences = run.pop("cycles_recorded"), run.pop("divergences")
    homes = run["optimizer_state_homes"]
    if homes is not None:  # every tier listed, in the ledger's order
        run["optimizer_state_homes"] = {tier: homes.get(tier, 0) for tier in ledger.tiers}
    return {
        **run,
        "iterations": ledger.iteration,
        "tracer": {"cycles_recorded": cycles, "divergences": divergences},
        "tiers": {
            name: {
                "capacity": account.capacity,
                "peak": account.peak,
                "peak_model": account.peak_model,
                "used_now": account.used,
            }
            for name, account in ledger.tiers.items()
        },
    }
