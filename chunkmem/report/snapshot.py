"""A PyTorch memory snapshot of the device tier, synthesised from the ledger.

The result has the shape of ``torch.cuda.memory._snapshot()`` (``segments`` and
``device_traces``), so ``torch.cuda._memory_viz`` and pytorch.org/memory_viz read it: for
people who already look at memory that way. It describes the device only.

[Note: synthetic snapshot]
* Each ledger allocation on the device becomes ``segment_alloc`` + ``alloc``; each free
  becomes ``free_requested`` + ``free_completed`` + ``segment_free``. There is no caching
  allocator behind chunkmem's accounting, so every block is its own segment and reserved
  bytes equal allocated bytes.
* Every owner (``chunk 7``, ``workspace``, the activations block) has its own address region,
  so a chunk has the same address each time it is on the device: search for it in the
  event list to see all its stays (memory_viz numbers them ``_0``, ``_1``, ...).
* Non-model bytes (saved activations, gradients in flight) are known at each moment's start;
  they appear as one "activations" block freed and allocated anew at each moment. Between
  two moments it keeps the earlier moment's size, so peaks inside a moment are not shown.
* ``category`` is the chunk kind, which memory_viz uses for colours and a legend. Segment
  events carry the category ``unknown``: MemoryViz.js throws when categories are present but
  ``unknown`` is not (it pushes onto a misspelt ``snapshot.categores``).
* The extra top-level key ``chunkmem`` says where each moment starts in the trace.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkmem.ledger import AllocationEvent, Ledger
from chunkmem.report.timeline import place_moments

SCHEMA = "chunkmem.memory_snapshot/1"
ACTIVATIONS = "activations"
_BASE_ADDRESS = 0x7F0000000000  # looks like a device address; well below 2**53 for JavaScript
_ALIGNMENT = 512  # the CUDA caching allocator's block granularity
_LARGE_SEGMENT = 1 << 20  # the allocator's boundary between "small" and "large" segments
_SEGMENT_CATEGORY = "unknown"


@dataclass(frozen=True)
class _Block:
    addr: int
    size: int
    frames: list[dict[str, Any]]
    category: str


class _AddressRegions:
    """A region per owner, with as many slots as the owner ever held at once."""

    def __init__(self, slot_sizes: dict[str, int], slot_counts: dict[str, int]) -> None:
        self._base: dict[str, int] = {}
        self._slot_size: dict[str, int] = {}
        self._free_slots: dict[str, list[int]] = {}
        address = _BASE_ADDRESS
        for owner, size in slot_sizes.items():
            aligned = -(-size // _ALIGNMENT) * _ALIGNMENT
            self._base[owner], self._slot_size[owner] = address, aligned
            self._free_slots[owner] = list(range(slot_counts[owner]))
            address += aligned * slot_counts[owner]

    def take(self, owner: str) -> int:
        slot = min(self._free_slots[owner])
        self._free_slots[owner].remove(slot)
        return self._base[owner] + slot * self._slot_size[owner]

    def give_back(self, owner: str, addr: int) -> None:
        self._free_slots[owner].append((addr - self._base[owner]) // self._slot_size[owner])


def _drawn(event: AllocationEvent) -> bool:
    # memory_viz cannot draw a zero-byte segment (its segment lookup finds nothing and throws).
    return event.tier == "device" and event.nbytes > 0


def _plan_regions(
    events: Sequence[AllocationEvent], activation_sizes: list[int]
) -> _AddressRegions:
    slot_sizes: dict[str, int] = {}
    slot_counts: Counter[str] = Counter()
    live: Counter[str] = Counter()
    for event in filter(_drawn, events):
        if event.action == "alloc":
            live[event.owner] += 1
            slot_counts[event.owner] = max(slot_counts[event.owner], live[event.owner])
            slot_sizes[event.owner] = max(slot_sizes.get(event.owner, 0), event.nbytes)
        else:
            live[event.owner] -= 1
    slot_sizes[ACTIVATIONS], slot_counts[ACTIVATIONS] = max(activation_sizes, default=0), 1
    return _AddressRegions(slot_sizes, slot_counts)


def _frames(what: str, moment: str, iteration: int) -> list[dict[str, Any]]:
    return [
        {"filename": "chunkmem", "line": 0, "name": f"{what} @ {moment} (iteration {iteration})"}
    ]


class _DeviceTrace:
    """Trace entries in order, and the blocks alive after the last one."""

    def __init__(self, regions: _AddressRegions) -> None:
        self.entries: list[dict[str, Any]] = []
        self.live: dict[str, list[_Block]] = {}
        self._regions = regions

    def alloc(self, owner: str, size: int, frames: list[dict[str, Any]], category: str) -> None:
        block = _Block(self._regions.take(owner), size, frames, category)
        self.live.setdefault(owner, []).append(block)
        self._add("segment_alloc", block, _SEGMENT_CATEGORY)
        self._add("alloc", block, category)

    def free(self, owner: str, size: int) -> None:
        """Free the latest live block of ``owner`` with this size (frees carry its frames)."""
        blocks = self.live.get(owner, [])
        index = next((i for i in reversed(range(len(blocks))) if blocks[i].size == size), None)
        if index is None:
            raise AssertionError(
                f"the ledger frees {size:,} device bytes of {owner!r} that it never allocated"
            )
        block = blocks.pop(index)
        self._regions.give_back(owner, block.addr)
        self._add("free_requested", block, block.category)
        self._add("free_completed", block, block.category)
        self._add("segment_free", block, _SEGMENT_CATEGORY)

    def _add(self, action: str, block: _Block, category: str) -> None:
        self.entries.append(
            {
                "action": action,
                "addr": block.addr,
                "size": block.size,
                "stream": 0,
                "frames": block.frames,
                "category": category,
            }
        )

    def segments(self) -> list[dict[str, Any]]:
        """The state after the last entry, one segment per live block."""
        blocks = sorted((b for owned in self.live.values() for b in owned), key=lambda b: b.addr)
        return [
            {
                "device": 0,
                "address": block.addr,
                "total_size": block.size,
                "allocated_size": block.size,
                "active_size": block.size,
                "requested_size": block.size,
                "stream": 0,
                "segment_type": "large" if block.size >= _LARGE_SEGMENT else "small",
                "blocks": [
                    {
                        "address": block.addr,
                        "size": block.size,
                        "requested_size": block.size,
                        "state": "active_allocated",
                        "frames": block.frames,
                    }
                ],
            }
            for block in blocks
        ]


def build_snapshot(ledger: Ledger) -> dict[str, Any]:
    """The snapshot dict (pickle it with protocol 4 or lower for MemoryViz.js)."""
    events = ledger.allocations
    positions = place_moments(events, ledger.moment_samples)
    samples = ledger.moment_samples[: len(positions)]
    activation_sizes = [s.nonmodel for s in samples] + [ledger.device.nonmodel]
    trace = _DeviceTrace(_plan_regions(events, activation_sizes))
    moments = []
    next_sample = 0
    for position in range(len(events) + 1):
        while next_sample < len(samples) and positions[next_sample] == position:
            sample = samples[next_sample]
            _set_activations(trace, sample.nonmodel, sample.label, sample.iteration)
            moments.append(
                {
                    "iteration": sample.iteration,
                    "index": sample.index,
                    "label": sample.label,
                    "trace_index": len(trace.entries),
                }
            )
            next_sample += 1
        if position < len(events):
            _apply(trace, events[position])
    _set_activations(trace, ledger.device.nonmodel, "end of run", ledger.iteration)
    return {
        "segments": trace.segments(),
        "device_traces": [trace.entries],
        "chunkmem": {
            "schema": SCHEMA,
            "device_capacity": ledger.device.capacity,
            "moments": moments,
            "moments_omitted": len(ledger.moment_samples) - len(samples),
            "allocations_dropped": ledger.allocations_dropped,
        },
    }


def _apply(trace: _DeviceTrace, event: AllocationEvent) -> None:
    if not _drawn(event):
        return
    if event.action == "alloc":
        what = event.kind if event.owner == event.kind else f"{event.kind} {event.owner}"
        trace.alloc(
            event.owner, event.nbytes, _frames(what, event.moment, event.iteration), event.kind
        )
    else:
        trace.free(event.owner, event.nbytes)


def _set_activations(trace: _DeviceTrace, nbytes: int, moment: str, iteration: int) -> None:
    """Replace the activations block by one of ``nbytes`` (none when zero)."""
    current = trace.live.get(ACTIVATIONS)
    if current and current[0].size == nbytes:
        return
    if current:
        trace.free(ACTIVATIONS, current[0].size)
    if nbytes:
        what = "activations and other non-model bytes"
        trace.alloc(ACTIVATIONS, nbytes, _frames(what, moment, iteration), ACTIVATIONS)
