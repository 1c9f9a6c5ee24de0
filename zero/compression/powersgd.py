"""PowerSGD (Vogels et al., 2019) as a reduce-scatter: rank-r approximations of the layout's
matrices with error feedback and a warm-started Q.

One implementation of :class:`zero.reduce.GradientReduction`. Per layout, each parameter whose
gradient is a matrix of ``n x m`` (its first dimension by the rest) with ``n * m >=
min_compression_rate * r * (n + m)`` is compressed; the others (vectors, small matrices) travel
exactly. For each compressed matrix, on every rank ``w``:

1. ``M_w = G_w + E_w`` (the gradient plus this rank's residual, fp32, in the residual chunk);
2. ``P = M_w Q`` with last step's ``Q`` (the warm start; a seeded normal matrix the first
   time, the same on every rank); all-reduce the ``P`` of every matrix and the exact
   parameters' gradients in one buffer;
3. orthogonalize ``P`` (Gram-Schmidt, column by column); ``Q_w = M_w^T P``; all-reduce the
   ``Q`` of every matrix;
4. the residual becomes ``E_w = M_w - P Q_w^T`` (what this rank's approximation left out), and
   this rank's shard of the sum is its slice of ``P Q^T`` (``Q`` summed over ranks), computed
   for the rows the shard covers. ``Q`` is kept as the next step's warm start.

Since ``sum_w P Q_w^T = P Q^T``, the reduced sum plus every rank's residual equals the exact
sum of ``M_w``: error feedback loses nothing, it only delays. Bytes each rank sends: two
all-reduces of ``sum r (n + m)`` plus the exact elements, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkmem.chunk import Chunk, ChunkLayout, TensorSlot
from chunkmem.costs import Traffic
from zero.comm import Communicator, Handle
from zero.comm_ledger import collective_traffic
from zero.compression.residuals import Residuals
from zero.kinds import EF_RESIDUAL
from zero.stage_guard import StageGuard
from zero.topology import Topology
from zero.wire import WireBuffers, aligned

Q_KIND = "powersgd_q"  # the ledger's name for the warm starts' bytes
# Added to a column's norm before dividing, so a zero gradient orthogonalizes to zeros.
_EPS = 1e-8


@dataclass(frozen=True)
class PowerSGDSettings:
    rank: int
    min_compression_rate: float
    seed: int

    def compresses(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        rows = shape[0]
        cols = shape.numel() // rows
        return rows * cols >= self.min_compression_rate * self.rank * (rows + cols)


@dataclass(frozen=True)
class Matrix:
    slot: TensorSlot
    rows: int
    cols: int


@dataclass(frozen=True)
class LayoutPlan:
    """Which of a layout's parameters are compressed, and the buffer sizes in elements."""

    matrices: tuple[Matrix, ...]
    exact: tuple[TensorSlot, ...]
    rank: int

    @classmethod
    def of(cls, layout: ChunkLayout, settings: PowerSGDSettings) -> LayoutPlan:
        matrices, exact = [], []
        for slot in layout.slots:
            if settings.compresses(slot.shape):
                matrices.append(Matrix(slot, slot.shape[0], slot.numel // slot.shape[0]))
            else:
                exact.append(slot)
        # One height's P's side by side in the buffer: they orthogonalize as one batch.
        matrices.sort(key=lambda matrix: matrix.rows)
        return cls(tuple(matrices), tuple(exact), settings.rank)

    def batches(self) -> list[tuple[int, int]]:
        """(first matrix, how many) per run of matrices of one height."""
        runs: list[tuple[int, int]] = []
        for index, matrix in enumerate(self.matrices):
            if runs and self.matrices[runs[-1][0]].rows == matrix.rows:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))
        return runs

    @property
    def p_numel(self) -> int:
        return sum(m.rows for m in self.matrices) * self.rank

    @property
    def q_numel(self) -> int:
        return sum(m.cols for m in self.matrices) * self.rank

    @property
    def exact_numel(self) -> int:
        return sum(slot.numel for slot in self.exact)


def orthogonalize(p: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``p`` in place: each normalized, then removed from the
    columns after it. ``p`` is one matrix (rows x r) or a batch of them (k x rows x r), each
    orthogonalized on its own: a layout's matrices of one height go in one batch, r column
    passes for all of them instead of r per matrix (fewer, larger ops)."""
    for i in range(p.shape[-1]):
        column = p[..., i : i + 1]
        column.div_(column.norm(dim=-2, keepdim=True) + _EPS)
        if i + 1 < p.shape[-1]:
            rest = p[..., i + 1 :]
            rest.sub_(column * (column * rest).sum(dim=-2, keepdim=True))


class PowerSGDReduceScatter:
    """PowerSGD on ``comm``'s world; ``phase`` is what its collectives are recorded under."""

    def __init__(
        self,
        comm: Communicator,
        wire: WireBuffers,
        residuals: Residuals,
        settings: PowerSGDSettings,
        phase: str,
    ) -> None:
        self.comm = comm
        self.wire = wire
        self.residuals = residuals
        self.settings = settings
        self.phase = phase
        self._plans: dict[int, LayoutPlan] = {}
        self.warm_q: dict[str, torch.Tensor] = {}  # per compressed parameter: last step's Q

    def plan(self, layout: ChunkLayout) -> LayoutPlan:
        if layout.index not in self._plans:
            self._plans[layout.index] = LayoutPlan.of(layout, self.settings)
        return self._plans[layout.index]

    def q_for(self, matrix: Matrix) -> torch.Tensor:
        """The warm start of ``matrix``: last step's ``Q``, or a normal matrix every rank draws
        alike from the seed and the parameter's name (also after a non-finite one)."""
        name = matrix.slot.name
        q = self.warm_q.get(name)
        if q is None:
            q = self.warm_q[name] = new_q_buffer(self.residuals, [matrix.cols, self.settings.rank])
            q.fill_(float("nan"))
        if not bool(torch.isfinite(q).all()):
            generator = torch.Generator().manual_seed(self.settings.seed + _stable_hash(name))
            q.copy_(torch.randn(matrix.cols, self.settings.rank, generator=generator))
        return q

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> _PowerSGDWork:
        return _PowerSGDWork(self, layout, full, shard)


class _PowerSGDWork:
    """One reduction in flight: the ``P`` all-reduce launched at launch, the ``Q`` all-reduce
    in ``advance`` (when the next layout's reduction has launched) or else in ``wait``.

    Never when a poll sees ``P`` arrive: when a rank sees it depends on timing, so launching
    ``Q`` then would let one rank issue layout A's ``Q`` before layout B's ``P`` and another
    after it, and a transport that runs a collective when it is waited for (or two groups
    that share the peers' links) hangs. :class:`zero.reduce.ReduceScatterGrads` advances and
    retires reductions at points every rank reaches in launch order, and ``is_completed``
    says False until ``wait``."""

    def __init__(
        self,
        owner: PowerSGDReduceScatter,
        layout: ChunkLayout,
        full: torch.Tensor,
        shard: torch.Tensor,
    ) -> None:
        self._owner, self._layout, self._full, self._shard = owner, layout, full, shard
        plan = self._plan = owner.plan(layout)
        p_bytes = 4 * (plan.p_numel + plan.exact_numel)
        self._buffer: torch.Tensor | None = owner.wire.take(aligned(p_bytes) + 4 * plan.q_numel)
        self._residual: Chunk | None = None
        self._second: Handle | None = None
        self._guard = StageGuard("a PowerSGD reduce-scatter")
        try:
            self._first_values = self._buffer[:p_bytes].view(torch.float32)
            self._q_values = self._buffer[aligned(p_bytes) : aligned(p_bytes) + 4 * plan.q_numel]
            self._q_values = self._q_values.view(torch.float32)
            self._residual = owner.residuals.carry(layout)
            self._ps, self._qs, self._ms = [], [], []
            p_at, q_at = 0, 0
            for matrix in plan.matrices:
                slot = matrix.slot
                m = self._residual.payload[slot.offset : slot.offset + slot.numel]
                m.add_(full[slot.offset : slot.offset + slot.numel])
                m = m.view(matrix.rows, matrix.cols)
                p = self._first_values[p_at : p_at + matrix.rows * plan.rank].view(
                    matrix.rows, plan.rank
                )
                torch.matmul(m, owner.q_for(matrix), out=p)
                q = self._q_values[q_at : q_at + matrix.cols * plan.rank].view(
                    matrix.cols, plan.rank
                )
                self._ms.append(m)
                self._ps.append(p)
                self._qs.append(q)
                p_at += matrix.rows * plan.rank
                q_at += matrix.cols * plan.rank
            at = plan.p_numel
            for slot in plan.exact:
                self._first_values[at : at + slot.numel].copy_(
                    full[slot.offset : slot.offset + slot.numel]
                )
                at += slot.numel
            self._first: Handle | None = self._all_reduce(self._first_values)
        except BaseException:
            self._release()
            raise

    def _all_reduce(self, values: torch.Tensor) -> Handle:
        owner = self._owner
        with owner.comm.serving(owner.phase):
            return owner.comm.all_reduce(values, op="sum", async_op=True)

    def _launch_second(self) -> None:
        """Step 3 and the residual of step 4, then the ``Q`` all-reduce (once: a failure is
        kept for ``wait``)."""
        first, self._first = self._first, None
        assert first is not None
        with self._guard.stage("P all-reduce and orthogonalization"):
            first.wait()
            self._orthogonalize_ps()
            for m, p, q in zip(self._ms, self._ps, self._qs, strict=True):
                torch.matmul(m.t(), p, out=q)
                m.addmm_(p, q.t(), alpha=-1)  # this rank's residual: what P Q^T left out
                m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            if self._qs:
                self._second = self._all_reduce(self._q_values)

    def _orthogonalize_ps(self) -> None:
        """Each run of same-height P's, adjacent in the buffer, as one batch."""
        plan, at = self._plan, 0
        for first, count in plan.batches():
            rows = plan.matrices[first].rows
            numel = count * rows * plan.rank
            orthogonalize(self._first_values[at : at + numel].view(count, rows, plan.rank))
            at += numel

    def advance(self) -> None:
        """Steps 3-4 now (:class:`zero.reduce.Staged`): the ``Q`` all-reduce overlaps what
        backward computes next."""
        if self._buffer is not None and self._first is not None:
            self._launch_second()

    def is_completed(self) -> bool:
        return self._buffer is None

    def wait(self) -> None:
        """Finish into the shard; the buffer and the residual go back whatever happens."""
        if self._buffer is None:
            return
        try:
            if self._first is not None:
                self._launch_second()
            self._guard.check()
            if self._second is not None:
                self._second.wait()
            self._write_shard()
        finally:
            self._release()

    def _write_shard(self) -> None:
        owner, plan, shard = self._owner, self._plan, self._shard
        n = shard.numel()
        lo = owner.comm.rank * n
        hi = lo + n
        shard.zero_()
        for matrix, p, q in zip(plan.matrices, self._ps, self._qs, strict=True):
            owner.warm_q[matrix.slot.name].copy_(q)
            a, b = max(lo, matrix.slot.offset), min(hi, matrix.slot.offset + matrix.slot.numel)
            if a >= b:
                continue
            first_row = (a - matrix.slot.offset) // matrix.cols
            last_row = (b - 1 - matrix.slot.offset) // matrix.cols
            rows = (p[first_row : last_row + 1] @ q.t()).view(-1)
            start = a - matrix.slot.offset - first_row * matrix.cols
            shard[a - lo : b - lo].copy_(rows[start : start + b - a])
        at = plan.p_numel
        for slot in plan.exact:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                values = self._first_values[at + a - slot.offset : at + b - slot.offset]
                shard[a - lo : b - lo].copy_(values)
            at += slot.numel

    def _release(self) -> None:
        residual, self._residual = self._residual, None
        if residual is not None:
            Residuals.release(residual)
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._owner.wire.give(buffer)


def new_q_buffer(residuals: Residuals, shape: list[int]) -> torch.Tensor:
    """A ``Q`` on the compute device, in the ledger as ``powersgd_q`` (it lives as long as
    the engine: every byte the process holds is accounted)."""
    residency = residuals.residency
    numel = shape[0] * shape[1]
    buffer = residency.workspaces.allocate(
        numel, torch.float32, residency.compute, set(), kind=Q_KIND
    )
    return buffer.view(shape)


def _stable_hash(name: str) -> int:
    """A hash of ``name`` every process computes alike (``hash`` is salted per process)."""
    value = 0
    for byte in name.encode():
        value = (value * 131 + byte) % (2**31)
    return value


class PowerSGDReduceScatterCosts:
    """:class:`PowerSGDReduceScatter`'s costs, from the layout's parameter shapes: the ``P``
    (and exact) all-reduce and the ``Q`` all-reduce in fp32, their one pooled buffer, a whole
    fp32 residual per layout and each compressed matrix's ``Q``."""

    def __init__(self, topology: Topology, settings: PowerSGDSettings, phase: str) -> None:
        self.topology = topology
        self.settings = settings
        self.phase = phase

    def traffic(self, layout: ChunkLayout) -> list[Traffic]:
        topology, plan = self.topology, LayoutPlan.of(layout, self.settings)
        world = topology.world
        first = plan.p_numel + plan.exact_numel
        traffic = [collective_traffic("all_reduce", first, 4, topology, world, self.phase)]
        if plan.q_numel:
            traffic.append(
                collective_traffic("all_reduce", plan.q_numel, 4, topology, world, self.phase)
            )
        return traffic

    def buffer_bytes(self, layout: ChunkLayout) -> int:
        plan = LayoutPlan.of(layout, self.settings)
        return aligned(4 * (plan.p_numel + plan.exact_numel)) + 4 * plan.q_numel

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]:
        plan = LayoutPlan.of(layout, self.settings)
        return {EF_RESIDUAL.value: 4 * layout.capacity, Q_KIND: 4 * plan.q_numel}
