"""Chunks: fixed-size flat buffers whose tensors are views at offsets.

A :class:`ChunkLayout` says which parameter sits at which offset. The parameter chunk (the
compute copy) and its mirrors (gradients, fp32 masters, optimizer moments) share one layout, so
slot ``i`` of every chunk in the group belongs to the same parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from chunkmem.states import MOVABLE_STATES, TensorState, check_transition

if TYPE_CHECKING:
    from chunkmem.tiers import StorageTier


class ChunkKind:
    """What a chunk holds; the ledger accounts bytes per kind.

    A kind is a value with the properties the core acts on, not a name it branches on: the
    core defines its own kinds here, and ``zero/`` defines the kinds of sharding
    (``zero.kinds``: gathered copies, gradient shards, hpZ secondaries) without the core
    ever naming them. Kinds are singletons, compared and hashed by identity (they key hot
    dictionaries), and registered by value in the order they are made (reports list them so).

    - ``dynamic``: placed on the fly by the placement policy (else a fixed home: optimizer
      states);
    - ``derived``: its content is built from other chunks by the materializer registered for
      the kind (``Residency.materializers``); never evicted, only dropped by its owner, the
      same way on every rank;
    - ``binds_params``: parameters compute on it, so their tensor states decide whether it
      may move;
    - ``gradient``: holds gradients, which are dead after the step;
    - ``written_before_read``: allocated without zeroing (its first writer writes it all).
    """

    _registry: ClassVar[dict[str, ChunkKind]] = {}
    PARAM: ClassVar[ChunkKind]
    GRAD: ClassVar[ChunkKind]
    MASTER: ClassVar[ChunkKind]
    EXP_AVG: ClassVar[ChunkKind]
    EXP_AVG_SQ: ClassVar[ChunkKind]
    MOMENTUM_BUFFER: ClassVar[ChunkKind]

    __slots__ = ("value", "dynamic", "derived", "binds_params", "gradient", "written_before_read")

    def __init__(
        self,
        value: str,
        *,
        dynamic: bool,
        derived: bool = False,
        binds_params: bool = False,
        gradient: bool = False,
        written_before_read: bool = False,
    ) -> None:
        if value in ChunkKind._registry:
            raise ValueError(f"a chunk kind {value!r} exists already")
        self.value = value
        self.dynamic = dynamic
        self.derived = derived
        self.binds_params = binds_params
        self.gradient = gradient
        self.written_before_read = written_before_read
        ChunkKind._registry[value] = self

    @classmethod
    def all(cls) -> list[ChunkKind]:
        """Every kind made so far, in the order made."""
        return list(cls._registry.values())

    @classmethod
    def named(cls, value: str) -> ChunkKind:
        return cls._registry[value]

    def __reduce__(self) -> tuple:
        return ChunkKind.named, (self.value,)  # one object per kind, across processes too

    def __repr__(self) -> str:
        return f"ChunkKind({self.value!r})"


ChunkKind.PARAM = ChunkKind("param", dynamic=True, binds_params=True)  # this process's copy
ChunkKind.GRAD = ChunkKind(  # a layout's gradients, when they cannot reuse the parameter slot
    "grad", dynamic=True, gradient=True, written_before_read=True
)
ChunkKind.MASTER = ChunkKind("master", dynamic=False)  # fp32 masters (bf16/fp16 training)
ChunkKind.EXP_AVG = ChunkKind("exp_avg", dynamic=False)
ChunkKind.EXP_AVG_SQ = ChunkKind("exp_avg_sq", dynamic=False)
ChunkKind.MOMENTUM_BUFFER = ChunkKind("momentum_buffer", dynamic=False)  # SGD's


@dataclass(eq=False)
class TensorSlot:
    """One parameter's place in a layout, its state and its gradient bookkeeping."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE
    users: int = 0  # how many module calls currently hold it in COMPUTE
    grad_in_param_slot: bool = False  # the 16-bit slot holds this iteration's gradient
    needs_grad_chunk: bool = False  # learned: the slot cannot be reused for this parameter
    grad_contributions: int = 0  # gradient contributions stored since the last step
    grad_reduced: int = 0  # of those, how many are already reduce-scattered (ZeRO)
    bound: bool = False  # ``param.data`` is its view in the device chunk
    layout: ChunkLayout | None = field(default=None, repr=False)

    def set_state(self, new: TensorState) -> None:
        check_transition(self.name, self.state, new)
        self.state = new

    @property
    def has_grad(self) -> bool:
        return self.grad_contributions > 0


@dataclass(eq=False)
class ChunkLayout:
    """Offsets of parameters inside a group of mirrored chunks."""

    index: int
    capacity: int  # elements
    trainable: bool
    slots: list[TensorSlot] = field(default_factory=list)
    used: int = 0
    chunks: dict[ChunkKind, Chunk] = field(default_factory=dict, repr=False)  # the group

    def fits(self, numel: int) -> bool:
        return self.used + numel <= self.capacity

    def add(self, name: str, param: torch.nn.Parameter) -> TensorSlot:
        numel = param.numel()
        if not self.fits(numel):
            raise ValueError(
                f"parameter {name!r} ({numel} elements) does not fit in chunk layout "
                f"{self.index} ({self.capacity - self.used} of {self.capacity} elements free)"
            )
        slot = TensorSlot(name, param, self.used, numel, param.shape, layout=self)
        self.slots.append(slot)
        self.used += numel
        return slot

    @property
    def padding(self) -> int:
        return self.capacity - self.used


class Chunk:
    """A flat buffer of one kind and dtype following a layout; it is on one tier at a time.

    It covers elements ``[start, start + numel)`` of its layout: the whole layout, or one
    rank's shard of it under ZeRO.
    """

    def __init__(
        self,
        chunk_id: int,
        layout: ChunkLayout,
        kind: ChunkKind,
        dtype: torch.dtype,
        start: int = 0,
        numel: int | None = None,
    ):
        self.id = chunk_id
        self.layout = layout
        self.kind = kind
        self.dtype = dtype
        self.start = start
        self.numel = layout.capacity if numel is None else numel
        self.tier: StorageTier | None = None  # None: no payload allocated
        self._payload: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}
        self._all_views: list[torch.Tensor] | None = None
        self.pins = 0  # holds outside the tensor-state machine; see ``pin``
        self.pending_event: object | None = None  # an async copy the payload waits for
        self.arriving: object | None = (
            None  # a collective or a read filling the payload (``wait()``)
        )

    def __repr__(self) -> str:
        tier = self.tier.name if self.tier else "unallocated"
        return f"Chunk(id={self.id}, {self.kind.value}, layout={self.layout.index}, {tier})"

    @property
    def on_device(self) -> bool:
        """Whether the payload is on the compute tier."""
        return self.tier is not None and self.tier.compute

    def pin(self) -> None:
        """Keep the chunk where it is. Every pin has one owner that unpins it on every exit
        path: ``Residency.pinned`` for short holds, the in-flight collective objects of
        ``zero/`` (their ``complete`` and ``cancel`` share one release), and the residency's
        pins that last until the next moment."""
        self.pins += 1

    def unpin(self) -> None:
        if self.pins <= 0:
            raise AssertionError(f"{self!r} unpinned more often than pinned")
        self.pins -= 1

    @property
    def payload(self) -> torch.Tensor | None:
        return self._payload

    @payload.setter
    def payload(self, value: torch.Tensor | None) -> None:
        self._payload = value
        self._views = {}
        self._all_views = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.numel == self.layout.capacity

    def view(self, slot: TensorSlot) -> torch.Tensor:
        """The slot's tensor in this chunk (cached until the payload changes); whole chunks."""
        view = self._views.get(slot.offset)
        if view is None:
            if self._payload is None:
                raise RuntimeError(f"{self!r} has no payload; it must be fetched before use")
            view = self._payload[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self._views[slot.offset] = view
        return view

    def views(self, slots: list[TensorSlot]) -> list[torch.Tensor]:
        """Views of ``slots``; the list for all of the layout's slots is cached."""
        if len(slots) != len(self.layout.slots):
            return [self.view(slot) for slot in slots]
        if self._all_views is None:
            self._all_views = [self.view(slot) for slot in self.layout.slots]
        return self._all_views

    def span(
        self, slot: TensorSlot, lo: int, hi: int, within: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flat elements ``lo:hi`` of ``slot`` (slot coordinates), which this chunk covers; of
        ``within`` instead of the payload where given (a tensor laid out like it)."""
        payload = self._payload if within is None else within
        if payload is None:
            raise RuntimeError(f"{self!r} has no payload; it must be fetched before use")
        begin = slot.offset + lo - self.start
        return payload[begin : begin + hi - lo]

    def movable(self) -> bool:
        """Only chunks whose tensors are all in a HOLD state (or FREE) and that no one pins.

        The tensor states belong to the chunk parameters are bound to (the parameter chunk,
        or the gathered one under ZeRO-3).
        """
        if self.pins:
            return False
        if self.kind.binds_params:
            return all(slot.state in MOVABLE_STATES for slot in self.layout.slots)
        return True
