"""How one layout is updated where its optimizer states live: :class:`UpdateBuilder` pins
the chunks, advances the step counts and builds the kernel calls of a
:class:`~chunkmem.layout_update.LayoutUpdate` (see [Note: an update in three parts] in
``chunkmem.optimizer``; ``ChunkAdam`` orders the layouts and owns the step)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import chunkmem.update_kernels as update_kernels
from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.frozen_adam import frozen_variance_adam_
from chunkmem.layout_update import LayoutUpdate
from chunkmem.manager import ChunkManager
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.pieces import Piece, cut, spans
from chunkmem.sharding import Waitable
from chunkmem.tiers import StorageTier

# A layout's kernel calls and the gradients they read (LayoutUpdate.run builds them).
KernelCalls = tuple[list[Callable[[], None]], list[torch.Tensor]]


@dataclass
class Staged:
    """What a host update's preparation left for building its calls: each piece's gradient
    (a host buffer's copy of a GPU's), and host buffers standing for a GPU's 16-bit values.
    The gradients are sliced on the engine's thread: their chunk may be the reducer's, which
    the update does not pin."""

    grads: list[torch.Tensor]
    outs: list[torch.Tensor] | None = None


def _only(call: Callable[[], None]) -> KernelCalls:
    """One call that reads its gradients itself (torch's kernel, on the engine's thread)."""
    return [call], []


# fp32 elements of gradient cast at once in bf16/fp16 training (the fused kernel needs fp32
# gradients for fp32 masters): 1 MiB of workspace whatever the chunk size, so a large chunk
# does not need a large transient buffer on a nearly full tier.
WORKSPACE_ELEMENTS = 1 << 18


class UpdateBuilder:
    """Builds one layout's update where its optimizer states live: the chunks ready and
    pinned on the work tier, step counts advanced, and the kernel calls (the native host
    optimizer in host memory, torch's fused kernel on the device or without the native
    library). ``param_groups`` is the optimizer's list, read at every build: a scheduler may
    change it. ``host_threads``: OpenMP threads of the native host kernels (None: torch's
    thread count)."""

    def __init__(
        self,
        manager: ChunkManager,
        states: OptimizerStates,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        decoupled_weight_decay: bool,
        host_threads: int | None,
    ) -> None:
        self.manager = manager
        self.states = states
        self.grads = manager.grads
        self.residency = manager.residency
        self.param_groups = param_groups
        self.group_of = group_of
        self.decoupled = decoupled_weight_decay
        self.host_threads = host_threads
        self.step_counts: dict[TensorSlot, torch.Tensor] = {}

    def _step_tensor(self, slot: TensorSlot, device: torch.device) -> torch.Tensor:
        counter = self.step_counts.get(slot)
        if counter is None or counter.device != device:
            previous = 0.0 if counter is None else float(counter)
            counter = torch.tensor(previous, dtype=torch.float32, device=device)
            self.step_counts[slot] = counter
        return counter

    def host_kernels(self) -> ModuleType | None:
        """The native host optimizer, or None where it cannot be built (torch's kernel)."""
        return update_kernels.native_host_optimizer()

    def prepare(
        self,
        layout: ChunkLayout,
        pieces: list[Piece],
        divisor: float,
        defer_reads: bool = False,
        into: dict[ChunkKind, torch.Tensor] | None = None,
        grads_saved: list[torch.Tensor | None] | None = None,
    ) -> LayoutUpdate:
        """Chunks ready and pinned on the work tier, step counts advanced, gradients staged;
        the kernel calls are built by ``run``, on its thread. ``defer_reads``: states still being read from their home are waited for in
        ``run`` (on its thread), not here. ``into``: host tensors laid out like the payloads
        of those chunk kinds, which receive their new values (the chunks are only read: an
        update out of place, which only the native host kernels take). ``grads_saved``: for
        each piece, None or a host tensor that receives its gradient as the kernel reads it
        (native host kernels only)."""
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
            if (into or grads_saved) and kernels is None:
                raise ValueError(
                    "an update out of place, or one that saves the gradients it reads, needs "
                    "the native host optimizer on host memory"
                )
            if kernels is None:
                torch_call = functools.partial(
                    self._torch_update, chunks, pieces, slots, step_of, grad_scale, work
                )
                build: Callable[[], KernelCalls] = functools.partial(_only, torch_call)
                after: list[Callable[[], None]] = []
            else:
                staged, after = self._stage(chunks, pieces, work, stack)
                build = functools.partial(
                    self._host_calls,
                    self._host_kernel(kernels),
                    kernels.NewStates,
                    chunks,
                    pieces,
                    step_of,
                    grad_scale,
                    into or {},
                    grads_saved,
                    staged,
                )
        except BaseException:
            stack.close()
            raise
        return LayoutUpdate(self, layout, slots, stack, build, after, reads, chunks, pieces, steps)

    def run_calls(self, calls: list[Callable[[], None]]) -> None:
        """Run one layout's kernel calls."""
        for call in calls:
            call()

    def _stage(
        self,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        work: StorageTier,
        stack: contextlib.ExitStack,
    ) -> tuple[Staged, list[Callable[[], None]]]:
        """The part of a host update's preparation that needs the engine's thread: each
        piece's gradient, host buffers for a GPU's gradients (copied down now) and 16-bit
        values (copied up by ``finish``), and what ``finish`` does after the kernels."""
        grad_source = self.grads.reducer.grad_source
        sources = [grad_source(s) for s, _lo, _hi in pieces]
        sizes = [hi - lo for _s, lo, hi in pieces]
        protect = {c.id for c in chunks.values()}
        mixed = ChunkKind.MASTER in chunks
        grads = [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, pieces, strict=True)]
        staged = Staged(grads)
        after: list[Callable[[], None]] = []
        if grads[0].device.type != "cpu":  # a GPU's gradients, copied down
            staged.grads = self._host_buffers(stack, sizes, grads[0].dtype, work, protect)
            torch._foreach_copy_(staged.grads, grads)
        param = chunks[ChunkKind.PARAM]
        if mixed and param.payload is not None and param.payload.device.type != "cpu":
            # values copied up after
            staged.outs = self._host_buffers(stack, sizes, param.dtype, work, protect)
            after.append(functools.partial(torch._foreach_copy_, spans(param, pieces), staged.outs))
        if mixed:  # fp32 training moved its chunks to the host: the residency accounted it
            after.append(functools.partial(self._account_stream, sources, sizes, work, True))
            after.append(
                functools.partial(self._account_stream, [param] * len(pieces), sizes, work, False)
            )
        return staged, after

    def _host_kernel(self, kernels: ModuleType) -> Callable[..., None]:
        """The kernel of this step's host updates, with each group's hyper-parameters read
        now (on the engine's thread: a scheduler may change them between steps)."""
        kernel = self._frozen_variance_kernel() or (
            kernels.fused_adamw_ if self.decoupled else kernels.fused_adam_
        )
        hyper = [self._hyper_parameters(g) for g in range(len(self.param_groups))]

        def call(group_index: int, *args: Any, **kwargs: Any) -> None:
            kernel(*args, **hyper[group_index], **kwargs)

        return call

    def _host_calls(
        self,
        kernel: Callable[..., None],
        new_states: type,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        step_of: dict[int, torch.Tensor],
        grad_scale: torch.Tensor | None,
        into: dict[ChunkKind, torch.Tensor],
        grads_saved: list[torch.Tensor | None] | None,
        staged: Staged,
    ) -> KernelCalls:
        """The native kernel calls of a layout updated in host memory, one per parameter
        group, and the gradients they read; built on the thread that runs them (slicing a
        few hundred views a step is the engine thread's largest cost of an early update).
        With fp32 masters it is one pass from the 16-bit gradients to the 16-bit parameters,
        through host buffers where those live on a GPU (``staged``); pieces are passed whole,
        so the bits are torch's fused kernel's on them. The kinds of ``into`` are written
        there, and the gradients saved to ``grads_saved`` (see :meth:`prepare`)."""
        grads = staged.grads
        mixed = ChunkKind.MASTER in chunks
        params = spans(chunks[ChunkKind.MASTER if mixed else ChunkKind.PARAM], pieces)
        outs = (staged.outs or spans(chunks[ChunkKind.PARAM], pieces)) if mixed else None
        exp_avgs = spans(chunks[ChunkKind.EXP_AVG], pieces)
        exp_avg_sqs = spans(chunks[ChunkKind.EXP_AVG_SQ], pieces)
        new = None
        if into:
            value = ChunkKind.MASTER if mixed else ChunkKind.PARAM
            new = [
                spans(chunks[kind], pieces, into[kind]) if kind in into else read
                for kind, read in (
                    (value, params),
                    (ChunkKind.EXP_AVG, exp_avgs),
                    (ChunkKind.EXP_AVG_SQ, exp_avg_sqs),
                )
            ]
        calls: list[Callable[[], None]] = []
        for group_index, positions in self._by_group([s for s, _lo, _hi in pieces]).items():
            calls.append(
                functools.partial(
                    kernel,
                    group_index,
                    [params[i] for i in positions],
                    [grads[i] for i in positions],
                    [exp_avgs[i] for i in positions],
                    [exp_avg_sqs[i] for i in positions],
                    [],
                    [step_of[id(pieces[i][0])] for i in positions],
                    grad_scale=grad_scale,
                    params_out=None if outs is None else [outs[i] for i in positions],
                    new_states=None
                    if new is None
                    else new_states(*([t[i] for i in positions] for t in new)),
                    grads_saved=None
                    if grads_saved is None
                    else [grads_saved[i] for i in positions],
                    num_threads=self.host_threads,
                )
            )
        return calls, grads

    def _host_buffers(
        self,
        stack: contextlib.ExitStack,
        sizes: list[int],
        dtype: torch.dtype,
        work: StorageTier,
        protect: set[int],
    ) -> list[torch.Tensor]:
        buffer = stack.enter_context(
            self.residency.workspaces.scoped(sum(sizes), dtype, work, protect, within="capacity")
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
        with self.residency.workspaces.scoped(
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
        kernel = self._frozen_variance_kernel() or (
            torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        )
        for group_index, positions in self._by_group(slots).items():
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

    def _frozen_variance_kernel(self) -> Callable[..., None] | None:
        """The update that keeps Adam's second moment, once the reducer's schedule says it
        is frozen (1-bit Adam's second stage); None for the usual one."""
        variance = self.grads.reducer.variance
        frozen = None if variance is None else variance.steps_frozen()
        if frozen is None:
            return None
        return functools.partial(
            frozen_variance_adam_,
            decoupled=self.decoupled,
            steps_frozen=frozen,
            momentum_in_gradients=variance.momentum_in_gradients,
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
