"""Deep Gradient Compression (Lin et al., 2018): block top-k with local accumulation, momentum
correction, momentum factor masking, local clipping and a sparsity warm-up.

One implementation of :class:`zero.reduce.GradientReduction`. For ``W`` ranks and a layout
whose shard is ``n`` elements, each compressed step on each rank:

1. **Local clipping.** This rank's gradient ``g`` of the layout is scaled to an L2 norm of at
   most ``gradient_clipping * sqrt(W) * sqrt(used / total)``, split over layouts by their share
   of the trainable elements (the squares of the thresholds add up to the whole one). The
   paper clips each node at ``N^(-1/2)`` of a threshold on the *summed* gradient: ``N``
   independent gradients of norm ``a`` sum to a norm of about ``a sqrt(N)``. The engine clips
   the *mean* (norm about ``a / sqrt(N)``), so the same reasoning puts each rank at
   ``sqrt(N)`` times it ([Note: the local threshold]). The engine then does not clip
   the reduced sums again (:class:`LocalClipping`).
2. **Momentum correction.** With it, the velocity (a ``DGC_VELOCITY`` chunk) is what
   accumulates: ``v += u``; without it ``v += g``. ``v`` is the residual chunk. Under Adam the
   velocity is its first moment's average, ``u = m u + (1 - m) g``; under SGD it is torch's
   momentum buffer, ``u = m u + g`` (the paper's), and SGD applies the sums without momentum of
   its own.
3. **Coarse-grained top-k.** Slice ``j`` of ``v`` (rank ``j``'s ``n`` elements, zero-padded to
   ``s = ceil(n / G) * G``) is cut into blocks of ``G``; the ``k = ceil(d n / G)`` blocks with
   the largest sum of squares are sent (``d`` the density of this step), as ``k`` int32 block
   indices and ``k G`` values in the gradient's dtype. Every rank sends the same count to
   every rank: one all-to-all of fixed sizes, nothing turns dense in a ring.
4. **Masking.** The sent blocks of ``v`` keep only what rounding to the wire dtype left out
   (zero in fp32); the same blocks of ``u`` are zeroed (momentum factor masking).
5. **Sum.** Rank ``j`` adds every rank's blocks into a zeroed fp32 slice in rank order and
   rounds once into the shard.

With momentum correction the shard holds momentum sums, so the optimizer must not add momentum
again: under Adam the configuration requires ``freeze_variance`` and the frozen step takes them
as its first moment (:class:`zero.compression.state.VarianceFreeze`); under SGD it requires
``optimizer.momentum`` 0 (``chunkmem.config_compression``).

Bytes each rank sends: ``(W - 1) k (4 + G b)`` for ``b``-byte gradients, against
``(W - 1) n b`` for the exact reduce-scatter: about ``d`` of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chunkmem.chunk import Chunk, ChunkLayout
from chunkmem.costs import Traffic
from chunkmem.params import ParamStore
from kernels import compression as codes_ops
from zero.comm import Communicator
from zero.comm_ledger import collective_traffic
from zero.compression.exchange import PooledExchange
from zero.compression.residuals import Residuals
from zero.compression.state import StepCounter
from zero.kinds import DGC_VELOCITY, EF_RESIDUAL
from zero.topology import Topology
from zero.wire import WireBuffers, aligned, carve

WARMUP_START_DENSITY = 0.25  # the paper's first warm-up epoch keeps 25%


@dataclass(frozen=True)
class TopKSettings:
    """DGC's settings: block size ``G``, final ``density``, the compressed steps over which the
    density falls to it, the exact ``warmup_steps`` before, the velocity's ``momentum`` (None:
    no momentum correction), the global ``gradient_clipping`` (0: no local clipping) and
    whether the velocity averages (``u = m u + (1 - m) g``, Adam's first moment) or sums
    (``u = m u + g``, SGD's momentum buffer)."""

    block: int
    density: float
    sparsity_warmup_steps: int
    warmup_steps: int
    momentum: float | None
    gradient_clipping: float
    velocity_averages: bool = True

    def density_at(self, step: int) -> float:
        """The density of the compressor's step ``step`` (1-based, warm-up included): from 0.25
        on the first compressed step, falling exponentially to ``density`` after
        ``sparsity_warmup_steps`` of them."""
        compressed = step - self.warmup_steps
        ramp = self.sparsity_warmup_steps
        if ramp == 0 or compressed > ramp or self.density >= WARMUP_START_DENSITY:
            return self.density
        fraction = (max(compressed, 1) - 1) / ramp
        return WARMUP_START_DENSITY * (self.density / WARMUP_START_DENSITY) ** fraction

    @property
    def largest_density(self) -> float:
        if self.sparsity_warmup_steps:
            return max(self.density, WARMUP_START_DENSITY)
        return self.density

    def slice_numel(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def blocks_sent(self, n: int, density: float) -> int:
        """``k``: the blocks of a slice of ``n`` elements sent at ``density`` (at least one)."""
        blocks = self.slice_numel(n) // self.block
        return min(blocks, max(1, math.ceil(density * n / self.block)))


def buffer_parts(settings: TopKSettings, world: int, n: int, k: int, itemsize: int) -> list[int]:
    """Byte sizes of one reduction's buffers: the padded fp32 staging (when ``s != n``), the
    block norms, the gathered fp32 blocks, values and indices sent and received, the fp32
    result slice, and the mask of sent blocks (for the velocity)."""
    s = settings.slice_numel(n)
    g = settings.block
    values, index = world * k * g * itemsize, world * k * 4
    staged = world * s * 4 if s != n else 0
    mask = world * s if settings.momentum is not None else 0
    return [
        staged,
        world * (s // g) * 4,
        world * k * g * 4,
        values,
        index,
        values,
        index,
        s * 4,
        mask,
    ]


class LocalClipping:
    """A :class:`chunkmem.sharding.ClippingSchedule`: DGC clips each rank's gradients before
    accumulating them, so on its compressed steps the engine must not clip the reduced sums."""

    def __init__(self, counter: StepCounter, settings: TopKSettings) -> None:
        self.counter = counter
        self.settings = settings

    def clips_locally(self) -> bool:
        settings = self.settings
        return settings.gradient_clipping > 0 and self.counter.steps > settings.warmup_steps


class TopKReduceScatter:
    """DGC's reduction on ``comm``'s world, recorded under ``phase``."""

    def __init__(
        self,
        comm: Communicator,
        wire: WireBuffers,
        residuals: Residuals,
        velocity: Residuals | None,
        settings: TopKSettings,
        phase: str,
        counter: StepCounter,
        params: ParamStore,
    ) -> None:
        if (velocity is None) != (settings.momentum is None):
            raise ValueError("a velocity store goes with momentum correction, and only with it")
        self.comm = comm
        self.wire = wire
        self.residuals = residuals
        self.velocity = velocity
        self.settings = settings
        self.phase = phase
        self.counter = counter
        self.params = params
        self._trainable_used: int | None = None

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> _TopKWork:
        return _TopKWork(self, layout, full, shard)

    def clip_coefficient(self, layout: ChunkLayout, full: torch.Tensor) -> float:
        """The factor that brings this rank's gradient of ``layout`` within its local
        threshold (``clip_grad_norm_``'s formula; 1.0 without clipping)."""
        clipping = self.settings.gradient_clipping
        if not clipping:
            return 1.0
        if self._trainable_used is None:
            self._trainable_used = sum(lay.used for lay in self.params.trainable_layouts())
        # [Note: the local threshold] the mean's threshold times sqrt(W), the layout's share
        share = math.sqrt(layout.used / self._trainable_used * self.comm.size)
        norm = float(torch.linalg.vector_norm(full, dtype=torch.float32))
        return min(1.0, clipping * share / (norm + 1e-6))


class _TopKWork(PooledExchange):
    """One reduction in flight: accumulated, selected and sent at launch; summed in ``wait``."""

    def __init__(
        self, owner: TopKReduceScatter, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor
    ) -> None:
        settings, world = owner.settings, owner.comm.size
        n, g = shard.numel(), settings.block
        s = settings.slice_numel(n)
        k = settings.blocks_sent(n, settings.density_at(owner.counter.steps))
        self._owner, self._shard, self._n, self._k = owner, shard, n, k
        sizes = buffer_parts(settings, world, n, k, full.element_size())
        super().__init__(owner.wire, sum(aligned(size) for size in sizes))
        assert self._buffer is not None
        held: list[Chunk] = []
        try:
            parts = carve(self._buffer, sizes)
            residual = owner.residuals.carry(layout)
            held.append(residual)
            accumulated = residual.payload
            coefficient = owner.clip_coefficient(layout, full)
            velocity = None
            if owner.velocity is not None:
                velocity_chunk = owner.velocity.carry(layout)
                held.append(velocity_chunk)
                velocity = velocity_chunk.payload
                momentum = settings.momentum
                assert momentum is not None
                weight = (1 - momentum) if settings.velocity_averages else 1.0
                velocity.mul_(momentum).add_(full, alpha=weight * coefficient)
                accumulated.add_(velocity)
            else:
                accumulated.add_(full, alpha=coefficient)
            staged = accumulated.view(world, n)
            if s != n:
                staged = parts[0].view(torch.float32).view(world, s)
                staged[:, :n].copy_(accumulated.view(world, n))
                staged[:, n:].zero_()
            norms = parts[1].view(torch.float32)
            codes_ops.block_sq_norms(staged.view(-1), block=g, out=norms)
            index = codes_ops.top_blocks(norms.view(world, s // g), k)
            gathered = parts[2].view(torch.float32)
            codes_ops.gather_blocks(staged, index, g, gathered)
            sent_values = parts[3].view(full.dtype)
            sent_values.copy_(gathered)
            sent_index = parts[4].view(torch.int32)
            sent_index.copy_(index.view(-1))
            # what the wire's rounding left out stays owed; the rest of each sent block is paid
            gathered.sub_(sent_values.float())
            blocks = staged.view(world, s // g, g)
            blocks.scatter_(1, index.unsqueeze(2).expand(world, k, g), gathered.view(world, k, g))
            if s != n:
                accumulated.view(world, n).copy_(staged[:, :n])
            if velocity is not None:  # momentum factor masking
                mask = parts[8].view(torch.bool).view(world, s)
                mask.zero_()
                mask.view(world, s // g, g).scatter_(
                    1, index.unsqueeze(2).expand(world, k, g), True
                )
                velocity.view(world, n).masked_fill_(mask[:, :n], 0.0)
                _reset_nonfinite(velocity, layout)
            _reset_nonfinite(accumulated, layout)
            self._received = (parts[5].view(full.dtype), parts[6].view(torch.int32))
            self._result = parts[7].view(torch.float32)
            self._padding_from = max(0, min(n, layout.used - owner.comm.rank * n))
            with owner.comm.serving(owner.phase):
                self._handle = owner.comm.all_to_all(
                    [sent_values.view(torch.uint8), sent_index.view(torch.uint8)],
                    [self._received[0].view(torch.uint8), self._received[1].view(torch.uint8)],
                    async_op=True,
                )
        except BaseException:
            self._release()
            raise
        finally:
            for chunk in held:
                Residuals.release(chunk)

    def _finish(self) -> None:
        world, k, g = self._owner.comm.size, self._k, self._owner.settings.block
        values = self._received[0].view(world, k * g)
        index = self._received[1].view(world, k).long()
        self._result.zero_()
        for rank in range(world):  # in rank order: the same sum on every backend
            codes_ops.add_blocks(values[rank], index[rank], g, self._result)
        self._shard.copy_(self._result[: self._n])
        self._shard[self._padding_from :].zero_()


def _reset_nonfinite(state: torch.Tensor, layout: ChunkLayout) -> None:
    """A non-finite gradient reaches the shard (the step raises); what stays behind is reset
    to zero instead of carrying NaN into every later step. The layout's padding keeps nothing."""
    state.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    state[layout.used :].zero_()


class TopKReduceScatterCosts:
    """:class:`TopKReduceScatter`'s costs: one all-to-all of indices and values on the world at
    the final density (the warm-up's larger ones last ``sparsity_warmup_steps``), a pooled
    buffer sized for the largest density, and whole fp32 residual and velocity chunks."""

    def __init__(
        self, topology: Topology, settings: TopKSettings, itemsize: int, phase: str
    ) -> None:
        self.topology = topology
        self.settings = settings
        self.itemsize = itemsize
        self.phase = phase

    def _shard(self, layout: ChunkLayout) -> int:
        return layout.capacity // self.topology.world_size

    def traffic(self, layout: ChunkLayout) -> list[Traffic]:
        topology, settings = self.topology, self.settings
        world, n = topology.world_size, self._shard(layout)
        k = settings.blocks_sent(n, settings.density)
        sent = world * k * (4 + settings.block * self.itemsize)
        return [collective_traffic("all_to_all", sent, 1, topology, topology.world, self.phase)]

    def buffer_bytes(self, layout: ChunkLayout) -> int:
        settings, n = self.settings, self._shard(layout)
        k = settings.blocks_sent(n, settings.largest_density)
        parts = buffer_parts(settings, self.topology.world_size, n, k, self.itemsize)
        return sum(aligned(size) for size in parts)

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]:
        out = {EF_RESIDUAL.value: 4 * layout.capacity}
        if self.settings.momentum is not None:
            out[DGC_VELOCITY.value] = 4 * layout.capacity
        return out
