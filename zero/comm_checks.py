"""The communicator's checks of what a collective is given: flat, contiguous buffers of one dtype
and device, sized for the group, in a dtype the transport can send. Split from ``zero.comm``
(which runs the collectives) so that each bad input gets its message in one place."""

from __future__ import annotations

from torch import Tensor

from zero.process_group import Group
from zero.transport import Transport


def check_flat(transport: Transport, op: str, name: str, tensor: Tensor, group: Group) -> None:
    """``tensor`` is a contiguous 1-D tensor that ``transport`` can send on ``group``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(
            f"{op}: {name} must be a flat 1-D buffer (gloo rejects stacked shapes), "
            f"got shape {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous, got stride {tensor.stride()} "
            f"for shape {tuple(tensor.shape)}"
        )
    transport.check_sendable(op, name, tensor, group)


def check_shard_and_full(
    transport: Transport, op: str, group: Group, shard: Tensor, full: Tensor
) -> None:
    """``shard`` and ``full`` are flat buffers of one dtype and device, ``full`` holding one
    shard per member of ``group``."""
    check_flat(transport, op, "shard", shard, group)
    check_flat(transport, op, "full", full, group)
    if full.dtype != shard.dtype:
        raise TypeError(
            f"{op}: full has dtype {full.dtype} but shard has {shard.dtype}; they must match"
        )
    if full.device != shard.device:
        raise ValueError(
            f"{op}: full is on {full.device} but shard is on {shard.device}; they must match"
        )
    expected = shard.numel() * group.size
    if full.numel() != expected:
        raise ValueError(
            f"{op}: full must have shard.numel() * size of {group.describe()} = "
            f"{shard.numel()} * {group.size} = {expected} elements, got {full.numel()}; "
            f"pad the buffer to padded_numel(numel, {group.size})"
        )
