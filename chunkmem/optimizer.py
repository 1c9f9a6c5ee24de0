"""Adam/AdamW over chunks: one fused kernel call per chunk and parameter group.

The update runs where a chunk's optimizer states live. On the device that is torch's fused
kernel. On the host it is the native host optimizer (:mod:`kernels.host_optim`): the same bits
as torch's fused kernel, and in bf16/fp16 training one pass that reads the 16-bit gradients,
updates the fp32 masters and moments and writes the 16-bit parameters, with no fp32 copy of
the gradients. If the native library cannot be built, one logged warning says why and
torch's kernel runs there instead (bf16 moments then cannot be had; ``initialize`` says so).

Per-parameter semantics follow ``torch.optim.Adam``: a parameter that got no gradient is
skipped and its step count does not advance; each parameter group keeps its own
hyper-parameters, which a learning-rate scheduler may change between steps through
:attr:`ChunkAdam.param_groups`.

[Note: an update in three parts] Each layout's update is a :class:`LayoutUpdate`: prepared on
the engine's thread (chunks ready and pinned, step counts, the kernel calls), run anywhere (the
kernels only: they touch the tensors they were given and nothing of the engine), finished on
the engine's thread (values copied back, pins released, parameters rebound). ``step`` does
the three in order for each layout. With ``offload.overlap``, ``offload/overlap.py`` starts a
layout's update in backward, as soon as its gradients are final (:meth:`ChunkAdam.start_early`),
and runs it on a host thread; ``step`` finishes those and updates the others.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import ModuleType
from typing import Any

import torch

from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.errors import ConfigError
from chunkmem.manager import ChunkManager
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.sharding import Waitable
from chunkmem.tiers import StorageTier
from chunkmem.tracer import Moment, Phase
from kernels import host_optim
from kernels._build import BuildError

_log = logging.getLogger("chunkmem")

# fp32 elements of gradient cast at once in bf16/fp16 training (the fused kernel needs fp32
# gradients for fp32 masters): 1 MiB of workspace whatever the chunk size, so a large chunk
# does not need a large transient buffer on a nearly full tier.
WORKSPACE_ELEMENTS = 1 << 18
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


@functools.cache
def native_host_optimizer() -> ModuleType | None:
    """:mod:`kernels.host_optim` once its library is built and loaded, else None: the reason
    is logged once, and host updates run torch's fused kernel."""
    try:
        host_optim.load_library()
    except BuildError as error:
        _log.warning(
            "the native host optimizer cannot be used (%s): optimizer states on the host are "
            "updated with torch's fused kernel, and bf16/fp16 steps there take three passes "
            "over memory instead of one",
            error,
        )
        return None
    return host_optim


def groups_from_torch_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[dict[str, Any]], list[list[torch.nn.Parameter]], bool]:
    """Hyper-parameter groups, their parameters and whether decay is decoupled (AdamW).

    The groups are the optimizer's own dicts, so an LR scheduler built on ``optimizer`` sets
    the learning rate the chunked update reads."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(
            f"chunkmem runs Adam/AdamW on its chunks; got {type(optimizer).__name__}. Pass a "
            f"torch.optim.Adam or AdamW (or none, and set optimizer in the config)"
        )
    if optimizer.state:
        raise ConfigError(
            "the optimizer already has state (it has stepped); pass a freshly built optimizer "
            "so no moments are lost"
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
    groups, params = [], []
    for index, group in enumerate(optimizer.param_groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ConfigError(
                    f"optimizer param group {index} sets {flag}=True, which chunkmem does not "
                    f"support; set it to False"
                )
        for key in ("betas", "eps", "weight_decay"):
            values = group[key] if key == "betas" else (group[key],)
            if any(isinstance(v, torch.Tensor) for v in values):
                raise ConfigError(
                    f"optimizer param group {index} holds {key} as a tensor; chunkmem reads "
                    f"{key} as a number (a tensor learning rate is fine)"
                )
        groups.append(group)
        params.append(list(group["params"]))
    return groups, params, decoupled


class LayoutUpdate:
    """One layout's update, prepared and finished on the engine's thread; ``run`` may be
    called on any thread (see [Note: an update in three parts])."""

    def __init__(
        self,
        adam: ChunkAdam,
        layout: ChunkLayout,
        slots: list[TensorSlot],
        stack: contextlib.ExitStack,
        calls: list[Callable[[], None]],
        after: list[Callable[[], None]],
        reads: list[Waitable],
    ) -> None:
        self.layout = layout
        self.slot_ids = {id(slot) for slot in slots}
        self.pending: Future | None = None  # the run, when another thread does it
        self.finished = False
        self.grad_norms: list[torch.Tensor] = []  # of an early update, for the step's check
        self._adam = adam
        self._stack = stack
        self._calls = calls
        self._after = after
        self._reads = reads

    def run(self) -> None:
        for read in self._reads:
            read.wait()
        self._adam._update(self._calls)

    def wait(self) -> None:
        """Until a run on another thread is done; raises what it raised."""
        if self.pending is not None:
            self.pending.result()

    def finish(self, completed: bool = True) -> None:
        """After a completed run, copy new values where they live; release the chunks
        (writing states back to their home); rebind the parameters."""
        if self.finished:
            return
        self.finished = True
        if completed:
            for after in self._after:
                after()
        self._stack.close()
        if completed:
            for slot in self.layout.slots:
                if id(slot) in self.slot_ids:
                    slot.grad_in_param_slot = False
            self._adam.manager.binder.bind_layout(self.layout)


class ChunkAdam:
    """Adam/AdamW whose parameters, masters and moments live in chunks.

    Each layout updates the elements whose optimizer states this rank holds (all of them, or
    its ZeRO shard), as flat pieces of the slots that intersect that span. Gradients are
    divided by ``grad_divisor`` (loss scale over clip coefficient) and, under ZeRO, by the
    world size: the reduce-scatter sums, the update averages. ``host_threads``: OpenMP threads
    of the native host kernels (None: torch's thread count).
    """

    def __init__(
        self,
        manager: ChunkManager,
        states: OptimizerStates,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        decoupled_weight_decay: bool,
        host_threads: int | None = None,
    ) -> None:
        self.manager = manager
        self.states = states
        self.params = manager.params
        self.grads = manager.grads
        self.residency = manager.residency
        self.gatherer = manager.gatherer
        self.sharding = states.sharding
        self.param_groups = param_groups
        self.group_of = group_of
        self.decoupled = decoupled_weight_decay
        self.host_threads = host_threads
        self.step_counts: dict[TensorSlot, torch.Tensor] = {}
        # Layouts whose update began in this cycle (in backward too), counted first so that
        # a half update counts; reset when the step ends, and by an abort's cancel.
        self.layouts_updated = 0
        self.launched: dict[int, LayoutUpdate] = {}  # layout index -> update begun early

    def _step_tensor(self, slot: TensorSlot, device: torch.device) -> torch.Tensor:
        counter = self.step_counts.get(slot)
        if counter is None or counter.device != device:
            previous = 0.0 if counter is None else float(counter)
            counter = torch.tensor(previous, dtype=torch.float32, device=device)
            self.step_counts[slot] = counter
        return counter

    def host_kernels(self) -> ModuleType | None:
        """The native host optimizer, or None where it cannot be built (torch's kernel)."""
        return native_host_optimizer()

    def step(self, grad_divisor: float) -> None:
        """Update every parameter that has a gradient, finishing the updates begun in
        backward; the gatherer makes each updated layout whole again where ranks compute on
        it (ZeRO 1-2) and ``finish_step`` waits for that."""
        divisor = grad_divisor * self.sharding.world_size
        layouts = self.params.trainable_layouts()
        try:
            for position, layout in enumerate(layouts):
                pieces = owned_pieces(layout, self.states.state_span(layout))
                early = self.launched.get(layout.index)
                if early is not None:
                    early.wait()
                    early.finish()
                    del self.launched[layout.index]
                    # Gradients that arrived after the early start (a parameter that had none
                    # in the cycle before) are updated now: Adam is elementwise.
                    pieces = [p for p in pieces if id(p[0]) not in early.slot_ids]
                if pieces or early is not None:  # the same moments as a serial step
                    self.manager.enter_moment(Moment(Phase.STEP, f"chunk {layout.index}"))
                if pieces:
                    if early is None:
                        self.layouts_updated += 1
                    update = self.prepare(layout, pieces, divisor)
                    if position + 1 < len(layouts):
                        self.states.prefetch(layouts[position + 1])
                    try:
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

    # ------------------------------------------------------------------ early updates
    def start_early(
        self, layout: ChunkLayout, submit: Callable[[Callable[[], None]], Future]
    ) -> bool:
        """``layout``'s gradients are final: prepare its update now and hand its run to
        ``submit`` (another thread); ``step`` finishes it. False, with nothing done, where
        the update is not a native host one: the step does it in order."""
        if self.states.homes is None or layout.index in self.launched:
            return False
        if self.states.work_tier(layout).compute or self.host_kernels() is None:
            return False
        pieces = owned_pieces(layout, self.states.state_span(layout))
        if not pieces:
            return False
        # The step's norm check needs these gradients, which the early update consumes.
        norms = self._piece_norms(pieces)
        update = self.prepare(layout, pieces, float(self.sharding.world_size), defer_reads=True)
        update.grad_norms = norms
        self.layouts_updated += 1
        self.launched[layout.index] = update
        update.pending = submit(update.run)
        return True

    def wait_early(self, layout: ChunkLayout) -> None:
        """Before anything writes ``layout``'s gradient chunks again: its early run is over."""
        update = self.launched.get(layout.index)
        if update is not None:
            update.wait()

    def retire_early(self) -> None:
        """Finish the early updates whose run is over, releasing their chunks now."""
        for update in self.launched.values():
            if not update.finished and update.pending is not None and update.pending.done():
                update.wait()
                update.finish()

    def cancel(self) -> None:
        """An aborted cycle: wait for every early update's run, then release what each one
        holds; the first error is raised after all are released."""
        launched, self.launched = self.launched, {}
        self.layouts_updated = 0
        error: BaseException | None = None
        for update in launched.values():
            try:
                update.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        for update in launched.values():
            try:
                update.finish(completed=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        if error is not None:
            raise error

    # ------------------------------------------------------------------ one layout
    def prepare(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        divisor: float,
        defer_reads: bool = False,
    ) -> LayoutUpdate:
        """Chunks ready and pinned on the work tier, step counts advanced, kernel calls
        built. ``defer_reads``: states still being read from their home are waited for in
        ``run`` (on its thread), not here."""
        stack = contextlib.ExitStack()
        reads: list[Waitable] = []
        try:
            chunks = stack.enter_context(
                self.states.update_chunks(layout, reads if defer_reads else None)
            )
            work = self.states.work_tier(layout)
            device = chunks[ChunkKind.EXP_AVG].payload.device  # type: ignore[union-attr]
            slots = list(dict.fromkeys(slot for slot, _lo, _hi in pieces))
            steps = [self._step_tensor(s, device) for s in slots]
            torch._foreach_add_(steps, 1)
            step_of = dict(zip(map(id, slots), steps, strict=True))
            grad_scale = (
                None
                if divisor == 1.0
                else torch.tensor(divisor, dtype=torch.float32, device=device)
            )
            kernels = None if work.compute else self.host_kernels()
            if kernels is None:
                calls = [
                    functools.partial(
                        self._torch_update, chunks, pieces, slots, step_of, grad_scale, work
                    )
                ]
                after = []
            else:
                calls, after = self._host_calls(
                    kernels, chunks, pieces, step_of, grad_scale, work, stack
                )
        except BaseException:
            stack.close()
            raise
        return LayoutUpdate(self, layout, slots, stack, calls, after, reads)

    def _update(self, calls: list[Callable[[], None]]) -> None:
        """Run one layout's kernel calls."""
        for call in calls:
            call()

    def _host_calls(
        self,
        kernels: ModuleType,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        step_of: dict[int, torch.Tensor],
        grad_scale: torch.Tensor | None,
        work: StorageTier,
        stack: contextlib.ExitStack,
    ) -> tuple[list[Callable[[], None]], list[Callable[[], None]]]:
        """The native kernel calls of a layout updated in host memory, one per parameter
        group, and what ``finish`` does after them. With fp32 masters it is one pass from the
        16-bit gradients to the 16-bit parameters, through host buffers where those live on a
        GPU; pieces are passed whole, so the bits are torch's fused kernel's on them."""
        grad_source = self.grads.reducer.grad_source
        sources = [grad_source(s) for s, _lo, _hi in pieces]
        grads = [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, pieces, strict=True)]
        mixed = ChunkKind.MASTER in chunks
        params = spans(chunks[ChunkKind.MASTER if mixed else ChunkKind.PARAM], pieces)
        outs = spans(chunks[ChunkKind.PARAM], pieces) if mixed else None
        sizes = [hi - lo for _s, lo, hi in pieces]
        protect = {c.id for c in chunks.values()}
        after: list[Callable[[], None]] = []
        if grads[0].device.type != "cpu":  # a GPU's gradients, copied down
            staged = self._host_buffers(stack, sizes, grads[0].dtype, work, protect)
            torch._foreach_copy_(staged, grads)
            grads = staged
        if outs is not None and outs[0].device.type != "cpu":  # values copied up after
            host_outs = self._host_buffers(stack, sizes, outs[0].dtype, work, protect)
            after.append(functools.partial(torch._foreach_copy_, outs, host_outs))
            outs = host_outs
        if mixed:  # fp32 training moved its chunks to the host: the residency accounted it
            param = chunks[ChunkKind.PARAM]
            after.append(functools.partial(self._account_stream, sources, sizes, work, True))
            after.append(
                functools.partial(self._account_stream, [param] * len(pieces), sizes, work, False)
            )
        exp_avgs = spans(chunks[ChunkKind.EXP_AVG], pieces)
        exp_avg_sqs = spans(chunks[ChunkKind.EXP_AVG_SQ], pieces)
        kernel = kernels.fused_adamw_ if self.decoupled else kernels.fused_adam_
        calls: list[Callable[[], None]] = []
        for group_index, positions in self._by_group([s for s, _lo, _hi in pieces]).items():
            calls.append(
                functools.partial(
                    kernel,
                    [params[i] for i in positions],
                    [grads[i] for i in positions],
                    [exp_avgs[i] for i in positions],
                    [exp_avg_sqs[i] for i in positions],
                    [],
                    [step_of[id(pieces[i][0])] for i in positions],
                    **self._hyper_parameters(group_index),
                    grad_scale=grad_scale,
                    params_out=None if outs is None else [outs[i] for i in positions],
                    num_threads=self.host_threads,
                )
            )
        return calls, after

    def _host_buffers(
        self,
        stack: contextlib.ExitStack,
        sizes: list[int],
        dtype: torch.dtype,
        work: StorageTier,
        protect: set[int],
    ) -> list[torch.Tensor]:
        buffer = stack.enter_context(
            self.residency.workspace(sum(sizes), dtype, work, protect, within="capacity")
        )
        return list(torch.split(buffer, sizes))

    def _torch_update(
        self,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        slots: list[TensorSlot],
        step_of: dict[int, torch.Tensor],
        grad_scale: torch.Tensor | None,
        home: StorageTier,
    ) -> None:
        """torch's fused kernel where the states live: on the device, or on the host when the
        native library is missing. Runs on the engine's thread (it takes workspaces)."""
        if ChunkKind.MASTER in chunks:
            self._step_mixed(chunks, pieces, step_of, grad_scale, home)
        elif all(hi - lo == s.numel for s, lo, hi in pieces) and chunks[ChunkKind.EXP_AVG].is_whole:
            self._fused(  # whole slots of whole chunks: cached views, no slicing
                slots,
                chunks[ChunkKind.PARAM].views(slots),
                self.grads.views(slots),
                chunks[ChunkKind.EXP_AVG].views(slots),
                chunks[ChunkKind.EXP_AVG_SQ].views(slots),
                [step_of[id(s)] for s in slots],
                grad_scale,
            )
        else:
            self._fused(
                [slot for slot, _lo, _hi in pieces],
                spans(chunks[ChunkKind.PARAM], pieces),
                [self.grads.reducer.grad_source(s).span(s, lo, hi) for s, lo, hi in pieces],
                spans(chunks[ChunkKind.EXP_AVG], pieces),
                spans(chunks[ChunkKind.EXP_AVG_SQ], pieces),
                [step_of[id(s)] for s, _lo, _hi in pieces],
                grad_scale,
            )

    def _step_mixed(self, chunks, pieces, step_of, grad_scale, home: StorageTier) -> None:
        """fp32 masters: cast gradients to fp32 a workspace at a time, update, write back."""
        total = sum(hi - lo for _slot, lo, hi in pieces)
        grad_source = self.grads.reducer.grad_source
        with self.residency.workspace(
            min(total, WORKSPACE_ELEMENTS),
            torch.float32,
            home,
            {c.id for c in chunks.values()},
            within="capacity",
        ) as workspace:
            for batch in cut(pieces, WORKSPACE_ELEMENTS):
                sizes = [hi - lo for _slot, lo, hi in batch]
                grads = list(torch.split(workspace[: sum(sizes)], sizes))
                sources = [grad_source(s) for s, _lo, _hi in batch]
                torch._foreach_copy_(
                    grads,
                    [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, batch, strict=True)],
                )
                self._account_stream(sources, sizes, home, to_home=True)
                masters = spans(chunks[ChunkKind.MASTER], batch)
                self._fused(
                    [slot for slot, _lo, _hi in batch],
                    masters,
                    grads,
                    spans(chunks[ChunkKind.EXP_AVG], batch),
                    spans(chunks[ChunkKind.EXP_AVG_SQ], batch),
                    [step_of[id(slot)] for slot, _lo, _hi in batch],
                    grad_scale,
                )
                param = chunks[ChunkKind.PARAM]
                torch._foreach_copy_(spans(param, batch), masters)
                self._account_stream([param] * len(batch), sizes, home, to_home=False)

    def _account_stream(
        self, sources: list[Chunk], sizes: list[int], home: StorageTier, to_home: bool
    ) -> None:
        """Bytes crossing tiers: gradients read into the home tier, or values written back."""
        by_chunk: dict[int, list] = {}
        for chunk, size in zip(sources, sizes, strict=True):
            entry = by_chunk.setdefault(chunk.id, [chunk, 0])
            entry[1] += size * chunk.dtype.itemsize
        for chunk, nbytes in by_chunk.values():
            if to_home:
                self.residency.transfer(chunk, chunk.tier, home, nbytes, "step gradients")
            else:
                self.residency.transfer(chunk, home, chunk.tier, nbytes, "step values")

    def _by_group(self, slots: Sequence[TensorSlot]) -> dict[int, list[int]]:
        """Positions in ``slots`` by parameter group (slots may repeat: pieces)."""
        by_group: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
        return by_group

    def _fused(self, slots, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale) -> None:
        """torch's fused kernel, one call per parameter group over aligned lists."""
        for group_index, positions in self._by_group(slots).items():
            kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            kernel(
                [params[i] for i in positions],
                [grads[i] for i in positions],
                [exp_avgs[i] for i in positions],
                [exp_avg_sqs[i] for i in positions],
                [],
                [steps[i] for i in positions],
                **self._hyper_parameters(group_index),
                amsgrad=False,
                maximize=False,
                grad_scale=grad_scale,
                found_inf=None,
            )

    def _hyper_parameters(self, group_index: int) -> dict[str, float]:
        """A parameter group's hyper-parameters as the fused kernels' keyword arguments (read
        at every step: a scheduler may change them)."""
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
        }

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

    def grad_norm(self) -> float:
        """L2 norm of the gradients the update will use (averaged over ranks under ZeRO),
        before loss-scale division; computed where each gradient lives, no chunk moves.

        Like ``clip_grad_norm_``: the fp32 norm of per-tensor norms (here per piece); ranks
        add the squares of their local norms.
        """
        norms = []
        for layout in self.params.trainable_layouts():
            early = self.launched.get(layout.index)
            if early is not None:  # taken before its update consumed the gradients
                norms.extend(early.grad_norms)
                continue
            norms.extend(self._piece_norms(owned_pieces(layout, self.states.state_span(layout))))
        local = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        sharding = self.sharding
        if sharding.world_size == 1:
            return float(local)
        squares = local.double().square().reshape(1)
        sharding.all_reduce_sum(squares)
        return math.sqrt(float(squares)) / sharding.world_size

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
        return [n.cpu() for n in torch._foreach_norm(views, 2, dtype=torch.float32)]


Piece = tuple[TensorSlot, int, int]  # a slot and a range of its flat elements


def owned_pieces(layout: ChunkLayout, span: tuple[int, int]) -> list[Piece]:
    """The parts of slots with gradients that fall in ``span`` = (start, numel)."""
    start, numel = span
    pieces = []
    for slot in layout.slots:
        if not slot.has_grad:
            continue
        lo = max(0, start - slot.offset)
        hi = min(slot.numel, start + numel - slot.offset)
        if lo < hi:
            pieces.append((slot, lo, hi))
    return pieces


def spans(chunk: Chunk, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    return [chunk.span(slot, lo, hi) for slot, lo, hi in pieces]


def cut(pieces: Sequence[Piece], limit: int) -> list[list[Piece]]:
    """``pieces`` in batches of at most ``limit`` elements; a longer piece is cut (Adam is
    elementwise, so any cut is exact)."""
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for slot, lo, hi in pieces:
        while lo < hi:
            take = min(hi - lo, limit - size)
            current.append((slot, lo, lo + take))
            size += take
            lo += take
            if size == limit:
                batches.append(current)
                current, size = [], 0
    if current:
        batches.append(current)
    return batches


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``clip_grad_norm_``'s factor: shrink only when the norm exceeds ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
