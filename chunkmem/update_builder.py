"""How one layout is updated where its optimizer states live: :class:`UpdateBuilder` pins
the chunks, finds the step counts (which the update's run advances) and builds the kernel calls of a
:class:`~chunkmem.layout_update.LayoutUpdate` (see [Note: an update in three parts] in
``chunkmem.optimizer``; ``ChunkOptimizer`` orders the layouts and owns the step). The native host
kernels' calls are built here; torch's kernel is ``chunkmem.torch_update``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import chunkmem.update_kernels as update_kernels
from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout, TensorSlot
from chunkmem.host_rows import HostRows, RowsCache, written_tensors
from chunkmem.layout_update import LayoutUpdate
from chunkmem.manager import ChunkManager
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.pieces import Piece, spans
from chunkmem.sharding import Waitable
from chunkmem.tiers import StorageTier
from chunkmem.torch_update import TorchUpdate, account_stream
from chunkmem.update_rules import ParamGroups, UpdateRule


@dataclass
class KernelCalls:
    """A layout's kernel calls and the gradients they read (``LayoutUpdate.run`` builds them);
    ``norms``: where the calls measure those gradients' norms in their own pass, each call's
    positions among the gradients and the fp32 tensor it fills (None: they do not)."""

    calls: list[Callable[[], None]]
    grads: list[torch.Tensor]
    norms: list[tuple[list[int], torch.Tensor]] | None = None
    # The gradients' norms measured where they lie before the calls (a GPU's, copied down
    # with them: ``Staged.norms``), in the gradients' order; the calls then measure none.
    staged_norms: torch.Tensor | None = None

    def measured_norms(self) -> list[torch.Tensor]:
        """After the calls ran: each gradient's norm, in the gradients' order (what
        ``fp32_norms`` gives them, bit for bit)."""
        assert self.norms is not None
        if len(self.norms) == 1:  # one parameter group: its positions are all, in order
            return list(self.norms[0][1].unbind())
        ordered = torch.empty(len(self.grads), dtype=torch.float32)
        for positions, norms in self.norms:
            ordered[positions] = norms
        return list(ordered.unbind())


@dataclass
class Staged:
    """What a host update's preparation left for building its calls: each piece's gradient
    (a host buffer's copy of a GPU's), and host buffers standing for a GPU's 16-bit values.
    The gradients are sliced on the engine's thread: their chunk may be the reducer's, which
    the update does not pin."""

    grads: list[torch.Tensor]
    outs: list[torch.Tensor] | None = None
    # fp32, one a gradient: the norms of a GPU's gradients measured on the GPU, as the step
    # measures the gradients no early update saw (``fp32_norms`` on the device views: the
    # host copies would give the native kernel's bits), copied down with them.
    norms: torch.Tensor | None = None


class CopiedDown:
    """A device's gradients being copied into host buffers on its copy stream, as a
    :class:`~chunkmem.sharding.Waitable`: the update waits for it before its kernels read the
    buffers, on whichever thread runs them, so the engine's thread does not block on the copy
    (nor the compute stream behind it) in backward. The device views are held until then:
    their memory must not be reused while the copy still reads it."""

    def __init__(self, tier: StorageTier, events: list[object | None], sources: list[torch.Tensor]):
        self._tier = tier
        self._events = events
        self._sources: list[torch.Tensor] | None = sources

    def wait(self) -> None:
        for event in self._events:
            self._tier.wait(event)
        self._sources = None

    def is_completed(self) -> bool:
        return all(self._tier.completed(event) for event in self._events)


def _only(call: Callable[[], None], _measure: bool) -> KernelCalls:
    """One call that reads its gradients itself (torch's kernel, on the engine's thread). It
    takes ``build``'s argument but measures no norms: the early updates, the only ones that
    ask, run the native kernel."""
    return KernelCalls([call], [])


class UpdateBuilder:
    """Builds one layout's update where its optimizer states live: the chunks ready and
    pinned on the work tier, step counts found (the run advances them), and the kernel calls (the native host
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
        rule: UpdateRule,
        host_threads: int | None,
    ) -> None:
        self.manager = manager
        self.states = states
        self.grads = manager.grads
        self.residency = manager.residency
        self.groups = ParamGroups(rule, param_groups, group_of, self.grads)
        self.torch_update = TorchUpdate(self.grads, self.residency, self.groups)
        self.host_threads = host_threads
        self.step_counts: dict[TensorSlot, torch.Tensor] = {}
        self.rows = RowsCache()  # the native Adam's rows, by layout

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
        grads_saved: Callable[[], list[torch.Tensor | None]] | None = None,
        measure_grad_norms: bool = False,
    ) -> LayoutUpdate:
        """Chunks ready and pinned on the work tier, step counts found (``run`` advances them,
        on its thread), gradients staged;
        the kernel calls are built by ``run``, on its thread. ``defer_reads``: states still being read from their home are waited for in
        ``run`` (on its thread), not here. ``into``: host tensors laid out like the payloads
        of those chunk kinds, which receive their new values (the chunks are only read: an
        update out of place, which only the native host kernels take). ``grads_saved``: gives,
        for each piece, None or a host tensor that receives its gradient as the kernel reads
        it (native host kernels only; called by ``run``, on its thread). ``measure_grad_norms``:
        the run measures the gradients it consumes (``LayoutUpdate.grad_norms``) with the bits
        the step would (an early update: the step's norm check needs them)."""
        stack = contextlib.ExitStack()
        reads: list[Waitable] = []
        try:
            chunks = stack.enter_context(
                self.states.update_chunks(layout, reads if defer_reads else None)
            )
            work = self.states.work_tier(layout)
            value = chunks[ChunkKind.MASTER if ChunkKind.MASTER in chunks else ChunkKind.PARAM]
            device = value.payload.device  # type: ignore[union-attr]
            slots = list(dict.fromkeys(slot for slot, _lo, _hi in pieces))
            steps = [self._step_tensor(s, device) for s in slots]
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
                    self.torch_update, chunks, pieces, slots, step_of, grad_scale, work
                )
                build: Callable[[bool], KernelCalls] = functools.partial(_only, torch_call)
                after: list[Callable[[], None]] = []
            else:
                staged, after = self._stage(
                    chunks, pieces, work, stack, reads if defer_reads else None,
                    measure_grad_norms,
                )  # fmt: skip
                build = functools.partial(
                    self._host_calls,
                    *self._host_kernel(kernels),
                    kernels,
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
        return LayoutUpdate(self, layout, slots, stack, build, after, reads, chunks, pieces, steps,
                            measure_grad_norms)  # fmt: skip

    @staticmethod
    def reads_grads_in_place(source: Chunk) -> bool:
        """Whether the host kernel reads the gradients of ``source`` where they lie (host
        memory), rather than a host buffer's copy (a GPU's, copied down by ``_stage``)."""
        payload = source.payload
        return payload is not None and payload.device.type == "cpu"

    def grads_divided_in_place(self, pieces: list[Piece], divisor: float) -> ChunkKind | None:
        """The kind of the chunk holding ``pieces``' gradients where the host kernel will
        leave them divided by ``divisor`` (fp32 gradients it reads in place, as torch's fused
        kernel leaves them); None where it will not (16-bit gradients are widened, a GPU's
        are copied down first)."""
        if divisor == 1.0:
            return None
        source = self.grads.reducer.grad_source(pieces[0][0])
        if source.dtype != torch.float32 or not self.reads_grads_in_place(source):
            return None
        return source.kind

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
        reads: list[Waitable] | None,
        measure_norms: bool,
    ) -> tuple[Staged, list[Callable[[], None]]]:
        """The part of a host update's preparation that needs the engine's thread: each
        piece's gradient, host buffers for a GPU's gradients and 16-bit values (copied up by
        ``finish``), and what ``finish`` does after the kernels. A GPU's gradients are copied
        down on its copy stream; the copies join ``reads`` (waited for by ``run``), or are
        waited for now where it is None. ``measure_norms``: a GPU's gradients are measured on
        the GPU first (``Staged.norms``)."""
        grad_source = self.grads.reducer.grad_source
        sources = [grad_source(s) for s, _lo, _hi in pieces]
        sizes = [hi - lo for _s, lo, hi in pieces]
        protect = {c.id for c in chunks.values()}
        mixed = ChunkKind.MASTER in chunks
        grads = [c.span(s, lo, hi) for c, (s, lo, hi) in zip(sources, pieces, strict=True)]
        staged = Staged(grads)
        after: list[Callable[[], None]] = []
        if not self.reads_grads_in_place(sources[0]):  # a GPU's gradients, copied down
            staged.grads = self._host_buffers(stack, sizes, grads[0].dtype, work, protect)
            device = self.residency.device
            events = [device.to_host(g, b) for g, b in zip(grads, staged.grads, strict=True)]
            held = list(grads)
            if measure_norms:  # on the compute stream, after backward wrote them
                norms = update_kernels.stacked_fp32_norms(grads, self.host_threads)
                staged.norms = self._host_buffers(stack, [len(grads)], torch.float32, work,
                                                  protect)[0]  # fmt: skip
                events.append(device.to_host(norms, staged.norms))
                held.append(norms)
            copies = CopiedDown(work, events, held)
            stack.callback(copies.wait)  # no exit frees the buffers under a copy
            if reads is None:
                copies.wait()
            else:
                reads.append(copies)
        param = chunks[ChunkKind.PARAM]
        if mixed and param.payload is not None and param.payload.device.type != "cpu":
            # values copied up after
            staged.outs = self._host_buffers(stack, sizes, param.dtype, work, protect)
            after.append(functools.partial(torch._foreach_copy_, spans(param, pieces), staged.outs))
        if mixed:  # fp32 training moved its chunks to the host: the residency accounted it
            residency = self.residency
            after.append(functools.partial(account_stream, residency, sources, sizes, work, True))
            after.append(
                functools.partial(
                    account_stream, residency, [param] * len(pieces), sizes, work, False
                )
            )
        return staged, after

    def _host_kernel(self, kernels: ModuleType) -> tuple[Callable[..., None], bool]:
        """The kernel of this step's host updates, with each group's hyper-parameters read
        now (on the engine's thread: a scheduler may change them between steps), and whether
        it takes rows by address (else tensors)."""
        groups = self.groups
        rows_kernel = groups.host_rows_kernel(kernels)
        kernel = groups.host_kernel(kernels) if rows_kernel is None else rows_kernel
        hyper = [groups.hyper_parameters(g) for g in range(len(groups.param_groups))]

        def call(group_index: int, *args: Any, **kwargs: Any) -> None:
            kernel(*args, **hyper[group_index], **kwargs)

        return call, rows_kernel is not None

    def _host_calls(
        self,
        kernel: Callable[..., None],
        by_address: bool,
        kernels: ModuleType,
        chunks: dict[ChunkKind, Chunk],
        pieces: list[Piece],
        step_of: dict[int, torch.Tensor],
        grad_scale: torch.Tensor | None,
        into: dict[ChunkKind, torch.Tensor],
        grads_saved: Callable[[], list[torch.Tensor | None]] | None,
        staged: Staged,
        measure: bool,
    ) -> KernelCalls:
        """The native kernel calls of a layout updated in host memory, one per parameter
        group, and the gradients they read; built on the thread that runs them. With fp32
        masters it is one pass from the 16-bit gradients to the 16-bit parameters, through
        host buffers where those live on a GPU (``staged``); pieces are passed whole, so the
        bits are torch's fused kernel's on them. The kinds of ``into`` are written there, and
        the gradients saved to ``grads_saved`` (see :meth:`prepare`). ``measure``: the calls
        measure the gradients' norms as they read them, where ``fp32_norms`` would measure
        them with the native kernel (the same bits, one pass fewer).

        [Note: rows by address] Where the kernel takes them (``by_address``: Adam), the
        pieces go to it as addresses in their chunks (``pieces.addresses``), checked once a
        chunk, not as a view a piece checked one by one: the Python that builds the calls
        runs on the host thread beside backward, and every millisecond of it there cost the
        engine's thread about as much or more (the GIL; docs/offload.md, "The regime reached
        at 4 tokens"). They are kept from one update of a layout to the next while their
        buffers stay (``chunkmem.host_rows``, [Note: rows kept across updates])."""
        grads = staged.grads
        rule = self.groups.rule
        fused_norms: list[tuple[list[int], torch.Tensor]] | None = (
            []
            if measure
            and staged.norms is None
            and rule.out_of_place
            and update_kernels.measured_natively(grads)
            else None
        )
        mixed = ChunkKind.MASTER in chunks
        value = ChunkKind.MASTER if mixed else ChunkKind.PARAM
        saves = None if grads_saved is None else grads_saved()
        slots = [s for s, _lo, _hi in pieces]
        steps = [step_of[id(slot)] for slot in slots]
        if by_address:
            written = written_tensors(chunks, value, rule.moments, staged.outs, saves, into)
            if grad_scale is not None:  # the gradients are left divided
                written = [*written, *grads]

            def build() -> HostRows:
                return HostRows(kernels, chunks, value, rule.moments, pieces, grads, staged.outs,
                                saves, into, steps, written, self.groups.by_group(slots))  # fmt: skip

            buffers = [*(chunks[kind].payload for kind in (value, *rule.moments)), *written]
            rows = self.rows.rows(
                chunks[value].layout.index, build, buffers, pieces, grads, saves, steps
            )
            group_positions = rows.positions
        else:
            group_positions = self.groups.by_group(slots)
            params = spans(chunks[value], pieces)
            outs = (staged.outs or spans(chunks[ChunkKind.PARAM], pieces)) if mixed else None
            moments = [spans(chunks[kind], pieces) for kind in rule.moments]
            new = None
            if into:
                new = [
                    spans(chunks[kind], pieces, into[kind]) if kind in into else read
                    for kind, read in ((value, params), *zip(rule.moments, moments, strict=True))
                ]
        calls: list[Callable[[], None]] = []
        for group_index, positions in group_positions.items():
            norms = None
            if fused_norms is not None:
                norms = torch.empty(len(positions), dtype=torch.float32)
                fused_norms.append((positions, norms))
            if by_address:
                call = functools.partial(
                    kernel, group_index, rows.by_group[group_index], rows.types,
                    written=written, grad_scale=grad_scale, grad_norms=norms,
                    num_threads=self.host_threads,
                )  # fmt: skip
            else:
                call = functools.partial(
                    kernel,
                    group_index,
                    [params[i] for i in positions],
                    [grads[i] for i in positions],
                    [[moment[i] for i in positions] for moment in moments],
                    [steps[i] for i in positions],
                    grad_scale=grad_scale,
                    params_out=None if outs is None else [outs[i] for i in positions],
                    new_states=None
                    if new is None
                    else kernels.NewStates(*([t[i] for i in positions] for t in new)),
                    grads_saved=None if saves is None else [saves[i] for i in positions],
                    grad_norms=norms,
                    num_threads=self.host_threads,
                )
            calls.append(call)
        return KernelCalls(calls, grads, fused_norms, staged.norms)

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
