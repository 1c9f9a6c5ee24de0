"""Where each moment sample falls among the ledger's allocation events.

[Note: placing moments] A :class:`~chunkmem.ledger.MomentSample` records the bytes at the
start of a moment but not how many allocation events came before it, and the memory snapshot
needs both on one time line. What the ledger does record fixes the answer:

* every event between sample ``k-1`` and sample ``k`` carries sample ``k-1``'s label (the
  ledger's moment label changes only when a moment is sampled), and an iteration between the
  two samples' iterations;
* the bytes per tier and kind after the events before sample ``k`` equal sample ``k``'s.

Labels alone are ambiguous when a module runs twice (or a moment allocates nothing), so the
search keeps every position that satisfies both rules and follows one chain through all
samples. Any such chain reproduces each sample's bytes exactly; where several exist they
differ only in which of two same-labelled moments a zero-sum run of events (an alloc and its
free) is drawn under.
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkmem.ledger import AllocationEvent, MomentSample

_Key = tuple[str, str]  # (tier, kind)


def _keys(events: Sequence[AllocationEvent], samples: Sequence[MomentSample]) -> list[_Key]:
    keys = {(event.tier, event.kind) for event in events}
    for sample in samples:
        keys.update(("device", kind) for kind in sample.device_by_kind)
        keys.update(("host", kind) for kind in sample.host_by_kind)
    return sorted(keys)


def _sample_state(sample: MomentSample, keys: list[_Key]) -> tuple[int, ...]:
    by_tier = {"device": sample.device_by_kind, "host": sample.host_by_kind}
    return tuple(by_tier[tier].get(kind, 0) for tier, kind in keys)


def _states_after_each_event(
    events: Sequence[AllocationEvent], keys: list[_Key]
) -> list[tuple[int, ...]]:
    """``states[p]``: bytes per key after the first ``p`` events.

    Tuples over a fixed key order stay small for long runs: consecutive states share all
    but one of their int objects.
    """
    column = {key: i for i, key in enumerate(keys)}
    counts = [0] * len(keys)
    states = [tuple(counts)]
    for event in events:
        sign = 1 if event.action == "alloc" else -1
        counts[column[event.tier, event.kind]] += sign * event.nbytes
        states.append(tuple(counts))
    return states


def place_moments(events: Sequence[AllocationEvent], samples: Sequence[MomentSample]) -> list[int]:
    """``positions[k]``: how many of ``events`` happened before ``samples[k]``.

    The list stops at the first sample no position fits, which happens only when the ledger
    dropped events: callers then draw only what the recorded events support.
    """
    keys = _keys(events, samples)
    states = _states_after_each_event(events, keys)
    # Before the first sample every event carries the ledger's initial label, whatever it is.
    label = events[0].moment if events else ""
    low_iteration = events[0].iteration if events else 0
    reachable: dict[int, int] = {0: 0}  # position -> the position it was reached from
    chains: list[dict[int, int]] = []
    for sample in samples:
        target = _sample_state(sample, keys)
        found: dict[int, int] = {}
        scanned_to = -1
        for start in sorted(reachable):
            if start <= scanned_to:
                continue  # inside a run already scanned from an earlier start
            position = start
            while True:
                if states[position] == target:
                    found.setdefault(position, start)
                if position == len(events):
                    break
                event = events[position]
                if event.moment != label or not (
                    low_iteration <= event.iteration <= sample.iteration
                ):
                    break
                position += 1
            scanned_to = position
        if not found:
            break
        chains.append(found)
        reachable = found
        label, low_iteration = sample.label, sample.iteration
    return _follow_back(chains)


def _follow_back(chains: list[dict[int, int]]) -> list[int]:
    """One chain of positions through every placed sample, ending as late as possible."""
    if not chains:
        return []
    positions = [max(chains[-1])]
    for found in reversed(chains[1:]):
        positions.append(found[positions[-1]])
    positions.reverse()
    return positions
