"""A compressor's state in checkpoints: each rank's error-feedback residual, DGC's local
momentum, and PowerSGD's warm-started ``Q`` (a :class:`chunkmem.sharding.ReducerState`).

Keys: ``ef_residual.rank{r}.{parameter}`` (rank ``r``'s residual of that parameter, fp32),
``dgc_velocity.rank{r}.{parameter}`` (the same for DGC's momentum) and ``powersgd_q.{parameter}``
(the same on every rank, saved by rank 0).

[Note: resharding residuals] A residual is what one rank's gradients still owe the sum, so what
must survive a change of world size is the sum over ranks, not each rank's part. Loaded on
``W'`` ranks from ``W``, rank ``r'`` takes the sum of the saved residuals of ranks ``r`` with
``r % W' == r'`` (ranks beyond the saved world take none): every saved residual lands on exactly
one rank, so the sum is kept exactly (2 -> 1: rank 0 gets both). On the same world size each
rank gets its own back, and the run continues bit for bit. DGC's momentum is the decayed sum of
one rank's gradients, so the same rule keeps the momentum of their sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from chunkmem.params import ParamStore
from zero.compression.powersgd import new_q_buffer
from zero.compression.residuals import Residuals

Q_KEY = "powersgd_q.{name}"


class StepCounter:
    """The steps a compressor has reduced in: one more on each new communicator tag (the
    engine sets a new one every cycle). Warm-up and TernGrad's draws follow it, and a
    checkpoint keeps it, so a resumed run continues the count instead of restarting it."""

    def __init__(self) -> None:
        self.steps = 0
        self._tag: int | None = None

    def observe(self, tag: int) -> None:
        if tag != self._tag:
            self._tag = tag
            self.steps += 1

    def restore(self, steps: int) -> None:
        self.steps, self._tag = steps, None


class VarianceFreeze:
    """1-bit Adam's second stage (a :class:`chunkmem.sharding.VarianceSchedule`): from the
    first compressed step on (``compressed_from``: a step count, or None while there is none),
    Adam keeps the second moment of the last exact step. It follows the checkpointed count, so
    a resumed run freezes where the first one did. ``momentum_in_gradients`` (DGC's momentum
    correction): the reduced gradients are already momentum sums of that decay, so the frozen
    steps take ``(1 - momentum) * gradient`` as Adam's first moment instead of averaging it in
    again."""

    def __init__(
        self,
        counter: StepCounter,
        compressed_from: Callable[[], int | None],
        momentum_in_gradients: float | None = None,
    ) -> None:
        self.counter = counter
        self.compressed_from = compressed_from
        self.momentum_in_gradients = momentum_in_gradients

    def steps_frozen(self) -> int | None:
        first = self.compressed_from()
        return (
            None if first is None or self.counter.steps < first else self.counter.steps - first + 1
        )


class KeptDecision(Protocol):
    """A decision a checkpoint keeps (``compression: auto``'s judge), as plain values."""

    def saved(self) -> dict[str, Any] | None: ...

    def restore(self, saved: dict[str, Any] | None) -> None: ...


class CompressionState:
    """The state of ``method`` on this rank: its per-rank ``stores`` (residuals, none for
    TernGrad; DGC's momentum), ``warm_q`` (PowerSGD's, by parameter name), the step
    ``counter`` and ``auto``'s ``decision``."""

    def __init__(
        self,
        method: str,
        params: ParamStore,
        stores: list[Residuals],
        rank: int,
        warm_q: dict[str, torch.Tensor],
        counter: StepCounter,
        decision: KeptDecision | None = None,
    ) -> None:
        self.method = method
        self.params = params
        self.stores = stores
        self.rank = rank
        self.warm_q = warm_q
        self.counter = counter
        self.decision = decision

    def carries_window(self) -> bool:
        """Whether a reduction since the last step changed a store (error feedback, DGC's
        momentum; PowerSGD's ``Q`` changes with its residual)."""
        return any(store.carried for store in self.stores)

    def window_stepped(self) -> None:
        for store in self.stores:
            store.carried = False

    @staticmethod
    def _key(store: Residuals, rank: int, name: str) -> str:
        return f"{store.kind.value}.rank{rank}.{name}"

    def _holding(self, store: Residuals):
        return [layout for layout in self.params.trainable_layouts() if store.kind in layout.chunks]

    def describe(self) -> dict[str, Any]:
        """For the manifest: the method, each store's parameters (numel, by chunk kind), each
        ``Q``'s shape, the step count and ``auto``'s decision."""
        return {
            "method": self.method,
            "stores": {
                store.kind.value: {
                    slot.name: slot.numel
                    for layout in self._holding(store)
                    for slot in layout.slots
                }
                for store in self.stores
            },
            "warm_q": {name: list(q.shape) for name, q in sorted(self.warm_q.items())},
            "steps": self.counter.steps,
            "auto": None if self.decision is None else self.decision.saved(),
        }

    def saved(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for store in self.stores:
            for layout in self._holding(store):
                chunk = store.acquire(layout)
                try:
                    for slot in layout.slots:
                        values = chunk.payload[slot.offset : slot.offset + slot.numel]
                        out[self._key(store, self.rank, slot.name)] = values.to("cpu", copy=True)
                finally:
                    Residuals.release(chunk)
        if self.rank == 0:
            for name, q in self.warm_q.items():
                out[Q_KEY.format(name=name)] = q.to("cpu", copy=True)
        return out

    def _sources(self, saved_world: int) -> list[int]:
        """The saved ranks whose stores this rank takes (see the note)."""
        world = self.params.sharding.world_size
        return [r for r in range(saved_world) if r % world == self.rank]

    def _saved_stores(self, saved: dict[str, Any]) -> dict[str, dict[str, int]]:
        """The saved stores by kind; a store this engine does not keep is refused by name."""
        stores = saved["stores"]
        kept = {store.kind.value for store in self.stores}
        extra = sorted(kind for kind, names in stores.items() if names and kind not in kept)
        if extra:
            raise ValueError(
                f"the checkpoint's compression state holds {', '.join(extra)}, which "
                f"compression.type {self.method!r} does not keep (saved with another "
                f"compression setting); load it with the setting it was saved with"
            )
        return stores

    def requested(self, saved: dict[str, Any], saved_world: int) -> dict[str, torch.Tensor]:
        out = {
            self._key(store, r, name): torch.empty(numel)
            for store in self.stores
            for r in self._sources(saved_world)
            for name, numel in self._saved_stores(saved).get(store.kind.value, {}).items()
        }
        for name, shape in saved["warm_q"].items():
            out[Q_KEY.format(name=name)] = torch.empty(shape)
        return out

    def restore(
        self, loaded: dict[str, torch.Tensor], saved: dict[str, Any], saved_world: int
    ) -> None:
        sources = self._sources(saved_world)
        stores = self._saved_stores(saved)
        for store in self.stores:
            self._restore_store(store, stores.get(store.kind.value, {}), loaded, sources)
        for name, shape in saved["warm_q"].items():
            if name not in self.warm_q:
                self.warm_q[name] = new_q_buffer(self.stores[0], shape)
            self.warm_q[name].copy_(loaded[Q_KEY.format(name=name)])
        self.counter.restore(saved["steps"])
        if self.decision is not None:
            self.decision.restore(saved.get("auto"))

    def _restore_store(
        self,
        store: Residuals,
        names: dict[str, int],
        loaded: dict[str, torch.Tensor],
        sources: list[int],
    ) -> None:
        for layout in self.params.trainable_layouts():
            if not any(slot.name in names for slot in layout.slots):
                continue
            chunk = store.acquire(layout)
            try:
                chunk.payload.zero_()
                for slot in layout.slots:
                    if slot.name not in names:
                        continue
                    span = chunk.payload[slot.offset : slot.offset + slot.numel]
                    parts = [loaded[self._key(store, r, slot.name)] for r in sources]
                    if parts:
                        span.copy_(parts[0])  # one source: its own, bit for bit
                    for part in parts[1:]:
                        span.add_(part.to(span.device))
            finally:
                Residuals.release(chunk)
