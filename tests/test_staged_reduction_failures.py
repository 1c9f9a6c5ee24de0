"""A staged reduction (qgZ, PowerSGD) whose middle stage raises: its ``wait`` raises that
error again, named, and returns its wire buffer, instead of waiting on a collective that was
never issued or writing a half-computed shard."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from tests.test_zeropp_collectives import _HostWorkspaces
from zero.compression.powersgd import PowerSGDReduceScatter, PowerSGDSettings
from zero.quantized_reduce import HierarchicalQuantizedReduceScatter
from zero.stage_guard import StageFailed
from zero.topology import Topology
from zero.wire import WireBuffers

WORLD, PER_NODE = 4, 2


class _Lost(RuntimeError):
    """What the first collective's wait raises: a peer is gone."""


class _Handle:
    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def wait(self) -> None:
        if self.fails:
            raise _Lost("peer 3 is gone")

    def is_completed(self) -> bool:
        return True


class _Comm:
    """Rank 0 of a world where either the first collective's wait fails (``"first wait"``) or
    issuing the second collective fails (``"second issue"``); counts the collectives issued."""

    rank, size = 0, WORLD

    def __init__(self, fails_at: str) -> None:
        self.fails_at = fails_at
        self.issued = 0

    @contextlib.contextmanager
    def serving(self, phase: str):
        yield

    def _issue(self) -> _Handle:
        if self.issued == 1 and self.fails_at == "second issue":
            raise _Lost("peer 3 is gone")
        self.issued += 1
        return _Handle(fails=self.fails_at == "first wait")

    def all_to_all(self, *args, **kwargs) -> _Handle:
        return self._issue()

    def all_reduce(self, *args, **kwargs) -> _Handle:
        return self._issue()


class _CountingWire(WireBuffers):
    """The pool, counting the buffers lent and not given back."""

    out = 0

    def take(self, nbytes: int) -> torch.Tensor:
        self.out += 1
        return super().take(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        self.out -= 1
        super().give(buffer)


def _qgz(comm: _Comm, wire: WireBuffers):
    groups = SimpleNamespace(topology=Topology(WORLD, PER_NODE), intra=None, inter=None)
    reduction = HierarchicalQuantizedReduceScatter(comm, groups, wire, 4, 32, "bwd")
    n = 64
    return reduction.launch(None, torch.randn(WORLD * n), torch.zeros(n)), n


def _powersgd(comm: _Comm, wire: WireBuffers, workspaces: _HostWorkspaces):
    slot = SimpleNamespace(name="w", shape=torch.Size([32, 16]), numel=512, offset=0)
    layout = SimpleNamespace(index=0, slots=[slot])
    residual = SimpleNamespace(payload=torch.zeros(512), unpinned=0)
    residual.unpin = lambda: setattr(residual, "unpinned", residual.unpinned + 1)
    residuals = SimpleNamespace(
        residency=workspaces, acquire=lambda layout: residual, carry=lambda layout: residual
    )
    settings = PowerSGDSettings(rank=2, min_compression_rate=1.0, seed=0)
    reduction = PowerSGDReduceScatter(comm, wire, residuals, settings, "bwd")
    return reduction.launch(layout, torch.randn(512), torch.zeros(128)), residual


@pytest.mark.parametrize("fails_at", ["first wait", "second issue"])
@pytest.mark.parametrize("method", ["qgz", "powersgd"])
def test_a_failed_stage_is_raised_again_by_wait_and_the_buffers_go_back(
    method: str, fails_at: str
) -> None:
    comm, workspaces = _Comm(fails_at), _HostWorkspaces()
    wire = _CountingWire(workspaces)
    if method == "qgz":
        work, _ = _qgz(comm, wire)
    else:
        work, residual = _powersgd(comm, wire, workspaces)
    assert wire.out > 0
    with pytest.raises(_Lost):
        work.advance()  # the middle stage: wait for the first collective, issue the second
    assert comm.issued == 1, "the second collective must not be issued after a failure"
    work.is_completed()  # a poll after the failure neither raises nor issues anything
    assert comm.issued == 1
    with pytest.raises(StageFailed, match="raised earlier .*peer 3 is gone") as raised:
        work.wait()
    assert isinstance(raised.value.__cause__, _Lost)
    assert wire.out == 0
    if method == "powersgd":
        assert residual.unpinned == 1
    work.wait()  # released: a second wait (a cancel after the error) is a no-op
