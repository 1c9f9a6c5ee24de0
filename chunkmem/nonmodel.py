"""The device's non-model bytes (activations, gradients in flight, operators' outputs): what
the device's meter counts beyond the ledger's chunks and workspaces, recorded in the ledger and
the trace, with the peak between samples (see [Note: non-model peaks between samples])."""

from __future__ import annotations

from chunkmem.devices import ComputeDevice
from chunkmem.ledger import Ledger
from chunkmem.tracer import Tracer


class NonModelBytes:
    """Reads the device's meter against the ledger's device bytes; one per residency."""

    def __init__(self, device: ComputeDevice, ledger: Ledger, tracer: Tracer) -> None:
        self.device = device
        self.ledger = ledger
        self.tracer = tracer

    def accounted_device_bytes(self) -> int:
        """Device bytes the ledger holds (chunks and workspaces): the rest is non-model."""
        return self.ledger.device.model_bytes + self.ledger.device.workspace_bytes

    def trace_peak(self) -> None:
        """Trace the highest non-model bytes since the last restart at the current moment.

        [Note: non-model peaks between samples] The hooks sample non-model bytes at moments,
        saved tensors and gradients. What lives only inside an operator (an output before it
        is saved, the gradient of the logits, an attention workspace) falls between samples;
        on CUDA the allocator's peak covers it, and a trace without it budgets too many chunks
        at that moment. The peak is the allocator's minus the ledger's device bytes, so it is
        read before and restarted after every change of those (a chunk allocated, freed or
        moved, a workspace), when the allocator and the ledger agree, and at every moment.
        The simulated device's default meter counts only what the hooks sample, so this adds
        nothing there; with ``device.count_temporaries`` it counts operators' outputs too. The
        ledger's device peak takes such a meter's peak as well: the peak the report gives is
        the one the memory reached.
        """
        meter = self.device.meter
        peak = meter.peak(self.accounted_device_bytes())
        self.tracer.on_nonmodel(peak)
        if meter.measures_between_samples:
            self.ledger.note_nonmodel_peak(peak)

    def restart_peak(self) -> None:
        self.device.meter.reset_peak(self.accounted_device_bytes())

    def account(self, measured: int | None = None) -> int:
        """Record the device's current non-model bytes in the ledger and the trace: ``measured``
        when the caller has just read the meter and nothing changed since, else a new read."""
        nonmodel = (
            self.device.meter.current(self.accounted_device_bytes()) if measured is None
            else measured
        )  # fmt: skip
        self.ledger.set_nonmodel(nonmodel)
        self.tracer.on_nonmodel(nonmodel)
        return nonmodel
