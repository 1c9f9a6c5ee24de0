"""Storage tiers: the places a chunk's payload can live, as data the residency iterates over.

A tier allocates and frees payloads, starts an asynchronous copy of a payload held elsewhere
into a new payload of its own, and makes the reader wait for such a copy. Residency moves a
chunk from any tier to any other through this interface alone, and the ledger keeps one
account per tier name, so a new tier (NVMe, a second host pool) is a new class here and a
line where the engine builds its :class:`TierSet`; nothing in residency or the ledger changes.

[Note: compute and addressable] ``compute`` marks the one tier operators run on (the
device): parameters bind to views there and placement budgets it. ``addressable`` says a
payload is a tensor the engine may read and write in place (device and host pools). A tier
whose payloads are not (files on NVMe, ``offload.nvme``) exchanges them with the spill tier
only: it writes in ``copy_in`` (from a spill-tier tensor) and reads in ``copy_out`` (into
one), and the residency routes every other move through the spill tier.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import torch

from chunkmem.devices import ComputeDevice, DeferredCopy
from chunkmem.sharding import Waitable


class StorageTier(abc.ABC):
    """One place payloads live, with its own capacity in the ledger."""

    name: str
    compute: bool = False
    addressable: bool = True
    capacity: int | None = None
    # Host memory the tier keeps for itself (staging buffers), counted in the ledger as a
    # workspace of the spill tier for the engine's life.
    staging_bytes: int = 0

    @abc.abstractmethod
    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised payload (accounting is the caller's job, through the ledger)."""

    @abc.abstractmethod
    def free(self, payload: torch.Tensor) -> None:
        """``payload`` (from ``allocate`` or ``copy_in``) is no longer needed."""

    @abc.abstractmethod
    def copy_in(
        self, source: torch.Tensor, reader_copies: bool = False
    ) -> tuple[torch.Tensor, object | None]:
        """Start copying ``source`` (a payload of another tier) into a new payload here;
        returns it and an event the reader waits for (None when the copy is done).
        ``reader_copies``: a copy this tier would make on the caller's thread may be left to
        the reader's wait instead (chunkmem/devices.py, [Note: copies a reader runs]); tiers
        whose copies are asynchronous already ignore it."""

    @abc.abstractmethod
    def wait(self, event: object | None) -> None:
        """Before a payload of this tier is used: wait for the copy ``event`` stands for."""

    def completed(self, event: object | None) -> bool:
        """Whether the copy ``event`` stands for is over, without waiting."""
        return event is None or event.is_completed()  # type: ignore[attr-defined]

    def copy_out(self, payload: object, into: torch.Tensor) -> Waitable:
        """Non-addressable tiers: start copying ``payload`` into ``into`` (a tensor of the
        spill tier); returns what its reader waits for. An addressable tier's payloads are
        read by the destination's ``copy_in``."""
        raise NotImplementedError(f"{self!r} is addressable: the destination's copy_in reads it")

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing outside the ledger
        """The engine is done: release what the tier holds outside the ledger (files,
        threads). Payloads must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class DeviceTier(StorageTier):
    """The compute device: payloads operators run on; copies in on the device's side stream."""

    compute = True

    def __init__(self, device: ComputeDevice, capacity: int | None, name: str = "device") -> None:
        self.device = device
        self.capacity = capacity
        self.name = name

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.device.empty(numel, dtype)

    def free(self, payload: torch.Tensor) -> None:
        self.device.release(payload)

    def copy_in(
        self, source: torch.Tensor, reader_copies: bool = False
    ) -> tuple[torch.Tensor, object | None]:
        return self.device.to_device(source)

    def wait(self, event: object | None) -> None:
        self.device.wait(event)

    def completed(self, event: object | None) -> bool:
        return self.device.completed(event)


class HostTier(StorageTier):
    """A pool of host memory (pinned where the device copies from it)."""

    def __init__(self, device: ComputeDevice, capacity: int | None, name: str = "host") -> None:
        self.device = device
        self.capacity = capacity
        self.name = name

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.device.host_empty(numel, dtype)

    def free(self, payload: torch.Tensor) -> None:
        self.device.release(payload)

    def copy_in(
        self, source: torch.Tensor, reader_copies: bool = False
    ) -> tuple[torch.Tensor, object | None]:
        payload = self.allocate(source.numel(), source.dtype)
        if source.device == self.device.torch_device:
            if source.device.type != "cpu":
                return payload, self.device.to_host(source, payload)
            if reader_copies:  # the simulated device: its "copy engine" is the reader
                return payload, DeferredCopy(payload, source)
        payload.copy_(source)  # host to host (another pool), or the simulated device's
        return payload, None

    def wait(self, event: object | None) -> None:
        self.device.wait_host(event)

    def completed(self, event: object | None) -> bool:
        return self.device.completed(event)


class TierCopy:
    """A copy into a payload of ``tier`` as a Waitable, for a reader on another thread (the
    chunk's ``pending_event`` stays for its owner's thread to clear at its next ``ready``)."""

    def __init__(self, tier: StorageTier, event: object) -> None:
        self.tier = tier
        self.event = event

    def wait(self) -> None:
        self.tier.wait(self.event)

    def is_completed(self) -> bool:
        return self.tier.completed(self.event)


class TierSet:
    """The engine's tiers: the compute device first, then the tier chunks spill to, then any
    others (by name)."""

    def __init__(self, compute: StorageTier, spill: StorageTier, *others: StorageTier) -> None:
        tiers = (compute, spill, *others)
        if not compute.compute or any(t.compute for t in tiers[1:]):
            raise ValueError("a TierSet has exactly one compute tier, given first")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if not spill.addressable:
            raise ValueError(f"the spill tier {spill.name!r} must be addressable")
        self.compute = compute
        self.spill = spill
        self._by_name = {t.name: t for t in tiers}

    def __iter__(self) -> Iterator[StorageTier]:
        return iter(self._by_name.values())

    def __getitem__(self, name: str) -> StorageTier:
        tier = self._by_name.get(name)
        if tier is None:
            raise KeyError(f"no tier named {name!r}; the tiers are {sorted(self._by_name)}")
        return tier

    def capacities(self) -> dict[str, int | None]:
        return {t.name: t.capacity for t in self}

    def close(self) -> None:
        """Close every tier (each one, even if another raises; the first error is raised)."""
        error: BaseException | None = None
        for tier in self:
            try:
                tier.close()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest
                error = error or exc
        if error is not None:
            raise error
