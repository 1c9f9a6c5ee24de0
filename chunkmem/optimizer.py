"""The optimizer over chunks (Adam, AdamW or SGD: ``chunkmem.update_rules``): one fused kernel
call per chunk and parameter group.

The update runs where a chunk's optimizer states live. On the device that is torch's fused
kernel. On the host it is the native host optimizer (:mod:`kernels.host_optim`): the same bits
as torch's fused kernel, and in bf16/fp16 training one pass that reads the 16-bit gradients,
updates the fp32 masters and moments and writes the 16-bit parameters, with no fp32 copy of
the gradients. If the native library cannot be built, one logged warning says why and
torch's kernel runs there instead (bf16 moments then cannot be had; ``initialize`` says so).

Per-parameter semantics follow ``torch.optim.Adam`` (``SGD``): a parameter that got no gradient is
skipped and its step count does not advance; each parameter group keeps its own
hyper-parameters, which a learning-rate scheduler may change between steps through
:attr:`ChunkOptimizer.param_groups`.

[Note: an update in three parts] Each layout's update is a :class:`LayoutUpdate`: prepared on
the engine's thread (chunks ready and pinned, step counts, the kernel calls), run anywhere (the
kernels only: they touch the tensors they were given and nothing of the engine), finished on
the engine's thread (values copied back, pins released, parameters rebound). ``step`` does
the three in order for each layout. With ``offload.overlap``, ``offload/overlap.py`` starts a
layout's update in backward, as soon as its gradients are final (:meth:`ChunkOptimizer.start_early`),
and runs it on a host thread; ``step`` finishes those and updates the others.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from chunkmem.chunk import ChunkKind, ChunkLayout, TensorSlot
from chunkmem.errors import ConfigError, EngineUsageError
from chunkmem.layout_update import LayoutUpdate
from chunkmem.pieces import Piece, owned_pieces
from chunkmem.tiers import StorageTier
from chunkmem.tracer import Moment, Phase
from chunkmem.update_builder import UpdateBuilder
from chunkmem.update_kernels import fp32_norms
from chunkmem.update_rules import AdamRule, SgdRule, UpdateRule, check_sgd_group

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


class SpeculationLike(Protocol):
    """What the optimizer asks of ``offload.speculation.Speculation``."""

    @property
    def active(self) -> bool: ...

    def reserve(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        home: StorageTier,
        divided_grads: ChunkKind | None = None,
    ) -> Any: ...

    def commit(self) -> None: ...

    def roll_back(self) -> list[Any]: ...

    def cancel(self) -> None: ...


def groups_from_torch_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[dict[str, Any]], list[list[torch.nn.Parameter]], UpdateRule]:
    """Hyper-parameter groups, their parameters and the update they ask for (Adam, AdamW or
    SGD).

    The groups are the optimizer's own dicts, so an LR scheduler built on ``optimizer`` sets
    the learning rate the chunked update reads."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise ConfigError(
            f"chunkmem runs Adam, AdamW and SGD on its chunks; got {type(optimizer).__name__}. "
            f"Pass a torch.optim.Adam, AdamW or SGD (or none, and set optimizer in the config)"
        )
    if optimizer.state:
        raise ConfigError(
            "the optimizer already has state (it has stepped); pass a freshly built optimizer "
            "so no moments are lost"
        )
    sgd = isinstance(optimizer, torch.optim.SGD)
    numbers = ("momentum", "dampening", "weight_decay") if sgd else ("betas", "eps", "weight_decay")
    groups, params = [], []
    for index, group in enumerate(optimizer.param_groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ConfigError(
                    f"optimizer param group {index} sets {flag}=True, which chunkmem does not "
                    f"support; set it to False"
                )
        for key in numbers:
            values = group[key] if key == "betas" else (group[key],)
            if any(isinstance(v, torch.Tensor) for v in values):
                raise ConfigError(
                    f"optimizer param group {index} holds {key} as a tensor; chunkmem reads "
                    f"{key} as a number (a tensor learning rate is fine)"
                )
        if sgd:
            check_sgd_group(index, group)
        groups.append(group)
        params.append(list(group["params"]))
    if sgd:
        return groups, params, SgdRule(any(g["momentum"] for g in groups))
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
    return groups, params, AdamRule(decoupled)


class ChunkOptimizer:
    """An optimizer (its update: ``updates.groups.rule``) whose parameters, masters and
    moments live in chunks.

    Each layout updates the elements whose optimizer states this rank holds (all of them, or
    its ZeRO shard), as flat pieces of the slots that intersect that span. Gradients are
    divided by ``grad_divisor`` (loss scale over clip coefficient) and, under ZeRO, by the
    world size: the reduce-scatter sums, the update averages. ``updates`` builds each layout's
    update (``chunkmem.update_builder``).
    """

    def __init__(self, updates: UpdateBuilder) -> None:
        self.updates = updates
        self.manager = manager = updates.manager
        self.states = states = updates.states
        self.params = manager.params
        self.grads = manager.grads
        self.residency = manager.residency
        self.gatherer = manager.gatherer
        self.sharding = states.sharding
        self.param_groups = updates.groups.param_groups
        self.group_of = updates.groups.group_of
        self.rule = updates.groups.rule  # its name is recorded in checkpoints
        # Layouts whose update began in this cycle (in backward too), counted first so that
        # a half update counts; reset when the step ends, and by an abort's cancel.
        self.layouts_updated = 0
        self.launched: dict[int, LayoutUpdate] = {}  # layout index -> update begun early
        # Early updates whose run is over, appended by the thread that ran them, so that
        # retiring them (at every gradient backward stores) does not poll every launched one.
        self._ran: collections.deque[LayoutUpdate] = collections.deque()
        # Where early updates are speculative (offload/speculation.py sets it): what makes
        # them undoable. The loss scale of the backward running, which they divide by.
        self.speculation: SpeculationLike | None = None
        self.loss_scale = 1.0

    @property
    def step_counts(self) -> dict[TensorSlot, torch.Tensor]:
        """Each parameter's step count (checkpoints read and restore them)."""
        return self.updates.step_counts

    def step(self, grad_divisor: float) -> None:
        """Update every parameter that has a gradient, finishing the updates begun in
        backward; the gatherer makes each updated layout whole again where ranks compute on
        it (ZeRO 1-2) and ``finish_step`` waits for that."""
        divisor = grad_divisor * self.sharding.world_size
        layouts = self.params.trainable_layouts()
        try:
            self._finish_staged_early()
            for position, layout in enumerate(layouts):
                pieces = owned_pieces(layout, self.states.state_span(layout))
                early = self.launched.get(layout.index)
                if early is not None:
                    early.wait()
                    early.finish()
                    early.stand()
                    del self.launched[layout.index]
                    # Gradients that arrived after the early start (a parameter that had none
                    # in the cycle before) are updated now: the update is elementwise.
                    pieces = [p for p in pieces if id(p[0]) not in early.slot_ids]
                if pieces or early is not None:  # the same moments as a serial step
                    self.manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
                if pieces:
                    if early is None:
                        self.layouts_updated += 1
                    update = self.updates.prepare(layout, pieces, divisor)
                    try:
                        if position + 1 < len(layouts):
                            self.states.prefetch(layouts[position + 1])
                        update.run()
                    except BaseException:
                        update.finish(completed=False)
                        raise
                    update.finish()
                self.gatherer.after_update(layout)
            self.states.flush()
        finally:
            self.gatherer.finish_step()
        self.layouts_updated = 0
        self._ran.clear()  # every early update finished above

    # ------------------------------------------------------------------ early updates
    def start_early(
        self, layout: ChunkLayout, submit: Callable[[Callable[[], None]], Future]
    ) -> bool:
        """``layout``'s gradients are final: prepare its update now and hand its run to
        ``submit`` (another thread); ``step`` finishes it. False, with nothing done, where
        the update is not a native host one: the step does it in order."""
        if self.states.homes is None or layout.index in self.launched:
            return False
        if self.states.work_tier(layout).compute or self.updates.host_kernels() is None:
            return False
        pieces = owned_pieces(layout, self.states.state_span(layout))
        if not pieces:
            return False
        divisor = self.loss_scale * self.sharding.world_size
        snapshot = None
        if self.speculation is not None:
            snapshot = self.speculation.reserve(
                layout,
                pieces,
                self.states.home(layout),
                self.updates.grads_divided_in_place(pieces, divisor),
            )
            if snapshot is None:
                return False  # no room to make it undoable: it waits for the step's norm
        update = self.updates.prepare(
            layout,
            pieces,
            divisor,
            defer_reads=True,
            into=None if snapshot is None else snapshot.shadows,
            grads_saved=None
            if snapshot is None or not snapshot.saves_grads
            else snapshot.grad_saves,
            # The step's norm check needs these gradients, which the run consumes: the run
            # measures them as it reads them, on its own thread (``_grad_norms`` waits for it).
            measure_grad_norms=True,
        )
        if snapshot is not None:
            snapshot.attach(update)
        self.layouts_updated += 1
        self.launched[layout.index] = update
        update.pending = submit(update.run)
        update.pending.add_done_callback(lambda _run: self._ran.append(update))
        return True

    def _finish_staged_early(self) -> None:
        """Finish the early update whose states were read in from NVMe (offload/overlap.py
        starts one at a time) before the step reads any: two groups' states in host memory
        at most, the one updating and the next read ahead."""
        for update in self.launched.values():
            if not self.states.home(update.layout).addressable:
                update.wait()
                update.finish()

    def check_early_reads(self) -> None:
        """After backward: no gradient an early update read got another contribution later.
        The step would skip it (the early update took that parameter), so it would be lost;
        this raises instead (the engine then stops, or undoes speculative updates)."""
        late = [
            slot.name for update in self.launched.values() for slot in update.grown_since_read()
        ]
        if late:
            raise EngineUsageError(
                f"{len(late)} parameter(s) got another gradient contribution after their "
                f"update began in backward (offload.overlap): {', '.join(late[:3])}"
                f"{', ...' if len(late) > 3 else ''}. Their gradients arrived in more parts "
                f"than in the previous step (a data-dependent path, or a reentrant activation "
                f"checkpoint whose parameters are also used outside it). Use "
                f"torch.utils.checkpoint(..., use_reentrant=False), or set offload.overlap: false"
            )

    def finish_early(self, layout: ChunkLayout) -> None:
        """``layout``'s early update, if one began, runs to its end and releases its chunks."""
        update = self.launched.get(layout.index)
        if update is not None and not update.finished:
            update.wait()
            update.finish()

    def wait_early(self, layout: ChunkLayout) -> None:
        """Before anything writes ``layout``'s gradient chunks again: its early run is over."""
        update = self.launched.get(layout.index)
        if update is not None:
            update.wait()

    def retire_early(self) -> None:
        """Finish the early updates whose run is over, releasing their chunks now."""
        while self._ran:
            update = self._ran.popleft()
            if not update.finished:
                update.wait()
                update.finish()

    @property
    def speculating(self) -> bool:
        """Whether early updates of this cycle were taken speculatively (undoable)."""
        return self.speculation is not None and self.speculation.active

    def settle_speculation(self, held: bool) -> None:
        """The norm is known: keep the speculative early updates (``held``: the step neither
        clips, overflows nor meets a non-finite value), or undo them all exactly, so that
        the step updates every layout itself (offload/speculation.py)."""
        if self.speculation is None:
            return
        if held or not self.speculation.active:
            self.speculation.commit()
            return
        launched, self.launched = self.launched, {}
        error: BaseException | None = None
        for update in launched.values():
            try:
                update.wait()
                update.finish()
            except BaseException as exc:  # noqa: BLE001 - raised below, every group restored
                error = error or exc
                update.finish(completed=False)
        undone = [s for s in self.speculation.roll_back() if s.update is not None]
        self.layouts_updated -= len(undone)  # those whose update was prepared were counted
        for snapshot in undone:
            for slot in snapshot.grad_slots:  # the slot holds its gradient again
                self.manager.binder.unbind(slot)
        if error is not None:
            raise error

    def cancel(self) -> None:
        """An aborted cycle: wait for every early update's run, then release what each one
        holds; the first error is raised after all are released."""
        launched, self.launched = self.launched, {}
        self.layouts_updated = 0
        self._ran.clear()  # finished below, whether they ran or not
        error: BaseException | None = None
        for update in launched.values():
            try:
                update.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        if self.speculation is not None:
            self.speculation.cancel()  # after the runs that write the copies
        for update in launched.values():
            try:
                update.finish(completed=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        if error is not None:
            raise error

    def restore_from_masters(self) -> None:
        """After a skipped step: every slot that holds a gradient gets its value back."""
        for layout in self.params.trainable_layouts():
            slots = [s for s in layout.slots if s.grad_in_param_slot]
            if not slots:
                continue
            self.manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
            with self.states.update_chunks(layout) as chunks:
                param_chunk, master = chunks[ChunkKind.PARAM], chunks[ChunkKind.MASTER]
                torch._foreach_copy_(param_chunk.views(slots), master.views(slots))
                nbytes = sum(s.numel for s in slots) * param_chunk.dtype.itemsize
                self.residency.transfer(
                    param_chunk, master.tier, param_chunk.tier, nbytes, "restore"
                )
            for slot in slots:
                slot.grad_in_param_slot = False
            self.manager.binder.bind_layout(layout)

    def local_grad_norm(self) -> torch.Tensor:
        """The fp32 L2 norm of the gradients this rank's update will use, before loss-scale
        division; computed where each gradient lives, no chunk moves. Like
        ``clip_grad_norm_``: the norm of per-tensor norms (here per piece)."""
        norms = [norm for _slot, norm in self._grad_norms(every_slot=False)]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())

    def grad_squares_by_parameter(self) -> torch.Tensor:
        """Per parameter (``params.slots`` order), fp64: the squared norm of its gradient's
        pieces on this rank, every parameter's, before ranks agree which have a gradient.

        Ranks sum these with their presence votes (``chunkmem.step_gate``), and the norm
        counts only the parameters some rank gave a gradient: the update skips the others,
        though a reduction with error feedback may leave values in their reduced shard."""
        index = {id(slot): i for i, slot in enumerate(self.params.slots.values())}
        squares = torch.zeros(len(index), dtype=torch.float64)
        measured = self._grad_norms(every_slot=True)
        if measured:
            positions = torch.tensor([index[id(slot)] for slot, _norm in measured])
            norms = torch.stack([norm for _slot, norm in measured]).double()
            squares.index_add_(0, positions, norms.square())
        return squares

    def _grad_norms(self, every_slot: bool) -> list[tuple[TensorSlot, torch.Tensor]]:
        """(parameter, fp32 norm) of each piece of a gradient this rank's update reads: of
        parameters with a gradient here, or ``every_slot``; in the pieces' order, as a serial
        step measures them, where an early update measured some."""
        measured: list[tuple[TensorSlot, torch.Tensor]] = []
        for layout in self.params.trainable_layouts():
            pieces = owned_pieces(
                layout, self.states.state_span(layout), with_grads_only=not every_slot
            )
            early = self.launched.get(layout.index)
            taken: dict[int, torch.Tensor] = {}
            if early is not None:  # taken before its update consumed the gradients
                early.wait()
                taken = dict(zip((id(s) for s, _lo, _hi in early.pieces), early.grad_norms,
                                 strict=True))  # fmt: skip
            # Gradients that arrived after the early start are measured now.
            rest = iter(self._piece_norms([p for p in pieces if id(p[0]) not in taken]))
            measured.extend(
                (s, taken[id(s)] if id(s) in taken else next(rest)) for s, _lo, _hi in pieces
            )
        return measured

    def _piece_norms(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """fp32 L2 norms of the pieces' gradients, on the CPU."""
        if not pieces:
            return []
        grad_source = self.grads.reducer.grad_source
        sources = [grad_source(s) for s, _lo, _hi in pieces]
        # A gradient chunk evicted in backward may still be copying to the host (or one
        # fetched back, to the device): wait for it, as every other reader does.
        for chunk in dict.fromkeys(sources):
            self.residency.ready(chunk)
        views = [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, pieces, strict=True)]
        return fp32_norms(views, self.updates.host_threads)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor: shrink only when the norm exceeds ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
