"""The chunk kinds of sharding: the core acts on their properties and never names them.

- ``GATHERED``: a layout's parameters all-gathered for compute (ZeRO-3); derived from every
  rank's shard by the gatherer's layout lives (``zero.layout_life``), dropped by the rule
  every rank applies alike, never evicted.
- ``GRAD_SHARD``: this rank's reduced gradient shard (ZeRO); written whole by its first
  reduce-scatter.
- ``HPZ_SECONDARY``: ZeRO++ hpZ, this rank's part of a forward-gathered copy, kept inside its
  node group until the step so that the backward gather does not cross nodes; placement may
  move it to the host like any dynamic chunk.
- ``EF_RESIDUAL``: a gradient compressor's error-feedback residual of a layout on this rank
  (``zero.compression``): what compression left out of its gradients so far, fp32, whole
  layout; kept across steps, placed like any dynamic chunk.
- ``DGC_VELOCITY``: Deep Gradient Compression's local momentum of a layout on this rank (its
  momentum correction), fp32, whole layout; kept and placed like ``EF_RESIDUAL``.
"""

from __future__ import annotations

from chunkmem.chunk import ChunkKind

GATHERED = ChunkKind(
    "gathered", dynamic=True, derived=True, binds_params=True, written_before_read=True
)
GRAD_SHARD = ChunkKind("grad_shard", dynamic=True, gradient=True, written_before_read=True)
HPZ_SECONDARY = ChunkKind("hpz_secondary", dynamic=True)
EF_RESIDUAL = ChunkKind("ef_residual", dynamic=True)
DGC_VELOCITY = ChunkKind("dgc_velocity", dynamic=True)
