"""The one ledger of bytes: what each tier holds by kind, every chunk move, per-moment samples.

Tests, benchmarks and reports read numbers from here and nowhere else. Capacities are
enforced here: an allocation that would exceed a tier's capacity raises, so "device bytes
never exceeded capacity" is a fact the ledger can state, not an estimate. Accounts are keyed
by tier name and built from the tiers it is given, so a new tier needs no change here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from chunkmem.errors import OutOfMemoryError

WORKSPACE = "workspace"  # transient buffers the engine allocates (e.g. fp32 gradient casts)
# Device payloads of chunks that left the device while an asynchronous copy still reads them
# (chunkmem/drains.py): no chunk's bytes, but the device holds them until the copy is done.
DRAINING = "draining"
NOT_MODEL_KINDS = frozenset({WORKSPACE, DRAINING})
MOVED_ITERATIONS_KEPT = 1024


@dataclass
class TierAccount:
    """Bytes one tier holds, split by kind, plus non-model bytes (compute tier only).

    Totals are kept as running sums: they are read at every moment and every saved tensor.
    """

    name: str
    capacity: int | None
    by_kind: Counter[str] = field(default_factory=Counter)
    nonmodel: int = 0
    peak: int = 0
    peak_model: int = 0
    iteration_peak: int = 0  # the peak since the current iteration began
    model_bytes: int = 0  # chunks of every kind, workspaces excluded
    workspace_bytes: int = 0  # workspaces and draining payloads (NOT_MODEL_KINDS)

    @property
    def used(self) -> int:
        return self.model_bytes + self.workspace_bytes + self.nonmodel

    @property
    def available(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used

    def add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes
        if kind in NOT_MODEL_KINDS:
            self.workspace_bytes += nbytes
        else:
            self.model_bytes += nbytes
        self._update_peak()

    def _update_peak(self) -> None:
        used = self.used
        if used > self.iteration_peak:
            self.iteration_peak = used
        if used > self.peak:
            self.peak = used
        if self.model_bytes > self.peak_model:
            self.peak_model = self.model_bytes


@dataclass(frozen=True)
class MoveEvent:
    """One chunk crossing between tiers."""

    seq: int
    iteration: int
    moment: str
    chunk_id: int
    kind: str
    src: str
    dst: str
    nbytes: int
    reason: str


@dataclass(frozen=True)
class AllocationEvent:
    """One allocation or free on a tier; ``owner`` identifies the buffer (e.g. ``chunk 7``)."""

    seq: int
    iteration: int
    moment: str
    tier: str
    action: str  # "alloc" | "free"
    kind: str
    nbytes: int
    owner: str


@dataclass(frozen=True)
class MomentSample:
    """Bytes per tier at the start of a moment, and the compute tier's non-model bytes."""

    iteration: int
    index: int
    label: str
    by_tier: dict[str, dict[str, int]]  # tier name -> kind -> bytes
    nonmodel: int
    allocations_before: int  # allocation events (recorded or dropped) before this sample


class Ledger:
    """Accounts allocations, non-model bytes and moves, one account per tier.

    ``capacities`` maps tier names to capacities (None: unlimited) in the order reports list
    them; ``compute`` names the tier non-model bytes are counted on (the device).
    """

    def __init__(
        self,
        capacities: dict[str, int | None],
        max_move_events: int = 20_000,
        compute: str = "device",
    ) -> None:
        if compute not in capacities:
            raise ValueError(f"the compute tier {compute!r} is not among {list(capacities)}")
        self.tiers = {name: TierAccount(name, capacity) for name, capacity in capacities.items()}
        self.device = self.tiers[compute]  # the compute tier, read on every hot path
        self.max_move_events = max_move_events
        self.moves: list[MoveEvent] = []
        self.moves_dropped = 0
        self.allocations: list[AllocationEvent] = []
        self.allocations_dropped = 0
        self.moment_samples: list[MomentSample] = []
        self.moment_samples_dropped = 0
        self.iteration = 0
        self.moment_label = "init"
        # Bytes moved into each tier: per iteration for the last ``MOVED_ITERATIONS_KEPT``
        # iterations (a long run must not grow), and in total.
        self._moved: OrderedDict[int, Counter[str]] = OrderedDict()
        self.moved_total: Counter[str] = Counter()
        # Each tier's peak per iteration, for the same window of iterations.
        self._peaks: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._seq = 0

    def next_iteration(self) -> None:
        """The iteration (an optimizer step's cycle) ended: keep each tier's peak in it, and
        start the next one's from what the tiers hold now."""
        self._peaks[self.iteration] = {name: t.iteration_peak for name, t in self.tiers.items()}
        while len(self._peaks) > MOVED_ITERATIONS_KEPT:
            self._peaks.popitem(last=False)
        for account in self.tiers.values():
            account.iteration_peak = account.used
        self.iteration += 1

    def peak_in(self, tier: str, iteration: int) -> int:
        """The highest bytes ``tier`` held during ``iteration`` (one of the last kept)."""
        peaks = self._peaks.get(iteration)
        if peaks is None:
            raise KeyError(
                f"iteration {iteration} is not among the ended iterations kept "
                f"({list(self._peaks)[:1]}..{list(self._peaks)[-1:]})"
            )
        return peaks[tier]

    def would_fit(self, tier: str, nbytes: int) -> bool:
        available = self.tiers[tier].available
        return available is None or nbytes <= available

    def allocate(self, tier: str, kind: str, nbytes: int, what: str, owner: str) -> None:
        account = self.tiers[tier]
        if not self.would_fit(tier, nbytes):
            raise OutOfMemoryError(
                tier,
                nbytes,
                max(0, account.available or 0),
                f"while allocating {what} at moment {self.moment_label!r} "
                f"({self.describe(tier)}). Raise the {tier} capacity in the config, lower the "
                f"batch size or sequence length, or use a smaller chunk size.",
            )
        account.add(kind, nbytes)
        self._record_allocation(tier, "alloc", kind, nbytes, owner)

    def free(self, tier: str, kind: str, nbytes: int, owner: str) -> None:
        account = self.tiers[tier]
        if account.by_kind[kind] < nbytes:
            raise AssertionError(
                f"ledger underflow freeing {nbytes} bytes of {kind} on {tier} "
                f"(holds {account.by_kind[kind]})"
            )
        account.add(kind, -nbytes)
        self._record_allocation(tier, "free", kind, nbytes, owner)

    def hand_over(self, tier: str, kind: str, to_kind: str, nbytes: int, owner: str) -> None:
        """Bytes ``tier`` holds change kind (a chunk's payload that stays while a copy of it
        drains): a free and an allocation, with no capacity check, since nothing grows."""
        self.free(tier, kind, nbytes, owner)
        self.tiers[tier].add(to_kind, nbytes)
        self._record_allocation(tier, "alloc", to_kind, nbytes, owner)

    def _record_allocation(
        self, tier: str, action: str, kind: str, nbytes: int, owner: str
    ) -> None:
        self._seq += 1
        if len(self.allocations) < self.max_move_events:
            self.allocations.append(
                AllocationEvent(
                    self._seq, self.iteration, self.moment_label, tier, action, kind, nbytes, owner
                )
            )
        else:
            self.allocations_dropped += 1

    def set_nonmodel(self, nbytes: int) -> None:
        """Record the device's current non-model bytes (activations, transient gradients)."""
        self.device.nonmodel = nbytes
        self.device._update_peak()

    def note_nonmodel_peak(self, nbytes: int) -> None:
        """The meter's highest non-model bytes since the last sample, reached beside the
        chunks and workspaces held now (the residency reads it before any of them changes):
        an operator's output that came and went between samples still raises the peak."""
        account = self.device
        reached = account.model_bytes + account.workspace_bytes + nbytes
        account.peak = max(account.peak, reached)
        account.iteration_peak = max(account.iteration_peak, reached)

    def overflow(self, tier: str = "device") -> int:
        """Bytes by which the tier is over capacity right now (0 if within)."""
        available = self.tiers[tier].available
        return 0 if available is None else max(0, -available)

    def record_move(
        self, chunk_id: int, kind: str, src: str, dst: str, nbytes: int, reason: str
    ) -> None:
        self._seq += 1
        moved = self._moved.get(self.iteration)
        if moved is None:
            moved = self._moved[self.iteration] = Counter()
            while len(self._moved) > MOVED_ITERATIONS_KEPT:
                self._moved.popitem(last=False)
        moved[dst] += nbytes
        self.moved_total[dst] += nbytes
        if len(self.moves) < self.max_move_events:
            self.moves.append(
                MoveEvent(
                    self._seq,
                    self.iteration,
                    self.moment_label,
                    chunk_id,
                    kind,
                    src,
                    dst,
                    nbytes,
                    reason,
                )
            )
        else:
            self.moves_dropped += 1

    def sample_moment(self, index: int, label: str) -> None:
        """Remember the tiers at a moment (the first ``max_move_events`` are kept, then counted)."""
        self.moment_label = label
        if len(self.moment_samples) >= self.max_move_events:
            self.moment_samples_dropped += 1
            return
        self.moment_samples.append(
            MomentSample(
                self.iteration,
                index,
                label,
                {name: dict(account.by_kind) for name, account in self.tiers.items()},
                self.device.nonmodel,
                len(self.allocations) + self.allocations_dropped,
            )
        )

    def bytes_into(self, tier: str, iteration: int) -> int:
        """Bytes moved into ``tier`` in ``iteration`` (one of the last iterations kept)."""
        return self._moved_in(iteration)[tier]

    def bytes_moved(self, iteration: int) -> int:
        """Bytes that crossed between any two tiers in ``iteration``."""
        return sum(self._moved_in(iteration).values())

    def _moved_in(self, iteration: int) -> Counter[str]:
        moved = self._moved.get(iteration)
        if moved is not None:
            return moved
        if self._moved and iteration < next(iter(self._moved)):
            raise KeyError(
                f"iteration {iteration} left the ledger's window of the last "
                f"{MOVED_ITERATIONS_KEPT} iterations; moved_total has the run's totals"
            )
        return Counter()

    def iterations_with_moves(self) -> list[int]:
        """The iterations kept (see ``bytes_into``) in which bytes moved."""
        return [i for i, moved in self._moved.items() if any(moved.values())]

    def describe(self, tier: str) -> str:
        account = self.tiers[tier]
        parts = ", ".join(f"{k} {v:,}" for k, v in sorted(account.by_kind.items()) if v)
        capacity = "unlimited" if account.capacity is None else f"{account.capacity:,}"
        return f"{tier} holds {parts or 'nothing'}; non-model {account.nonmodel:,}; capacity {capacity}"
