"""Per-rank bytes on the device, the host and NVMe, from a model trace and the engine's rules.

The chunk size, the units, the packing and the optimizer-state homes come from the engine's
own functions, so they are the ones a run would get. Bytes over time follow what the engine
does with them in a steady iteration (every chunk resident, nothing evicted):

- static on the device: parameter chunks (whole, or this rank's shard at ZeRO-3) and the
  optimizer states homed there (fp32 master in bf16/fp16, two fp32 moments);
- gradient chunks: in the 16-bit parameter slot (bf16/fp16, one process, no accumulation:
  nothing extra), else a chunk per layout from its first gradient until the step; under
  ZeRO-1 reduced before the step, under ZeRO-2/3 reduce-scattered as each layout's gradients
  are in (two reductions in flight), keeping this rank's shard;
- gathered copies (ZeRO-3): a layout's whole parameters from its first use in a phase until
  its last, plus the next moment's, prefetched; a copy gathered to recompute a checkpointed
  unit in backward stays until that unit's backward has run (one gather per unit per
  backward);
- activations: the trace's saved tensors, plus each gradient while it is stored;
- the step: a 1 MiB fp32 workspace per update on the device in bf16/fp16;
- the first cycle, which records the trace: it keeps chunks on the device as the steady
  ones do (``Placement.recording_budget``) and reduces each gradient chunk as its slots are
  all in, so its device peak is at most the steady one (it has no Adam moments yet); the fp32
  masters wait for their home on the host unless this rank's states fit in half the device.

The peak is the largest sum at any event; the formulas of tests/test_zero.py (model states
per rank) are what it reduces to at the end of backward.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from chunkmem.config import Config
from chunkmem.costs import StrategyCosts, Traffic, WireTally
from chunkmem.estimate.host import host_bytes, state_bytes_per_element
from chunkmem.estimate.layouts import Layouts
from chunkmem.estimate.trace import ModelTrace
from chunkmem.ledger import WORKSPACE
from chunkmem.placement import offloaded_group_count, optimizer_state_device_groups
from chunkmem.sizing import COMPUTE_DTYPES, separate_grads
from chunkmem.torch_update import WORKSPACE_ELEMENTS
from chunkmem.update_rules import moment_count

ACTIVATIONS = "activations"


@dataclass
class _Device:
    """Bytes on the device by kind, and the largest total seen, with what made it."""

    by_kind: Counter[str] = field(default_factory=Counter)
    peak: int = 0
    peak_at: str = ""
    peak_by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, label: str) -> None:
        self.by_kind[kind] += nbytes
        self.consider(self.by_kind, label)

    def consider(self, by_kind: Counter[str], label: str) -> None:
        total = sum(by_kind.values())
        if total > self.peak:
            self.peak = total
            self.peak_at = label
            self.peak_by_kind = {k: v for k, v in by_kind.items() if v}


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes (see the module docstring for what each counts)."""

    peak_device_bytes: int
    peak_device_at: str  # the moment of the peak, as the report names moments
    first_cycle_peak_device_bytes: int  # the first iteration's (it records the trace)
    device_bytes_at_peak: dict[str, int]  # by chunk kind, plus activations
    activation_peak_bytes: int
    min_device_bytes: int  # the smallest device that trains (chunks moving every step)
    host_bytes: int  # the steady iterations' peak
    first_cycle_host_bytes: int
    nvme_bytes: int
    state_homes: dict[str, int]  # chunk groups per tier
    chunk_size: int
    layouts: int
    padding_elements: int
    elements_per_rank: int

    @property
    def peak_host_bytes(self) -> int:
        """The most the host holds at any time of the run."""
        return max(self.host_bytes, self.first_cycle_host_bytes)


class _Simulation:
    """The device over one optimizer step of a steady iteration (accumulation included),
    the strategy's seams played by their cost models (``chunkmem.costs``)."""

    def __init__(
        self,
        trace: ModelTrace,
        packed: Layouts,
        config: Config,
        costs: StrategyCosts,
        states_on_device: bool = True,
    ) -> None:
        self.trace = trace
        self.states_on_device = states_on_device
        self.packed = packed
        self.config = config
        self.costs = costs
        self.sharding, self.gatherer, self.reducer = costs.sharding, costs.gatherer, costs.reducer
        self.mixed = config.precision != "fp32"
        self.itemsize = COMPUTE_DTYPES[config.precision].itemsize
        self.accumulation = config.gradient_accumulation_steps
        self.separate_grads = separate_grads(
            config.precision, self.accumulation, self.sharding.sharded
        )
        self.device = _Device()
        self.wire: WireTally | None = None  # where the steady step's collectives are counted
        # ZeRO-3 gathers the first moment's layouts in the step, after their update, from the
        # second cycle on (zero/gather.py, [Note: gathering ahead across the step]): the
        # steady cycle starts with them gathered and gathers them again in its step.
        self.carries = False
        self.carried: set[int] = set()
        self.unit_layouts = [
            sorted({packed.layout_of[p] for p in params}) for params in trace.unit_params
        ]
        self.moments = [(e[1], e[2]) for e in trace.events if e[0] == "moment"]
        self.expected = Counter(packed.layout_of[e[1]] for e in trace.events if e[0] == "grad")

    # sizes
    def capacity(self, layout: int) -> int:
        return self.packed.layouts[layout].capacity

    def shard(self, layout: int) -> int:
        """Elements of this rank's reduced gradient shard."""
        return self.reducer.shard_elements(self.capacity(layout))

    def state_elements(self, layout: int) -> int:
        return self.sharding.state_elements(self.capacity(layout))

    @property
    def masters_bytes(self) -> int:
        """This rank's fp32 masters (bf16/fp16 only)."""
        if not self.mixed:
            return 0
        return sum(self.state_elements(i) for i in self.packed.trainable) * 4

    def param_bytes(self) -> int:
        return sum(
            self.sharding.param_elements(self.capacity(i)) * self.itemsize
            for i in range(len(self.packed.layouts))
        )

    def label(self, moment: int) -> str:
        if moment < 0:
            return "start"
        phase, unit = self.moments[moment]
        return f"{phase}:{self.trace.unit_labels[unit]}"

    # the iteration
    def run(self, state_bytes_on_device: int, until_step: int | None = None) -> None:
        """One step's cycle; ``until_step``: the state bytes on the device before its step
        (the first cycle: its masters, if they start there; the step places the rest)."""
        before = state_bytes_on_device if until_step is None else until_step
        grads = self.backward_cycle(before)
        self.device.add("optimizer states", state_bytes_on_device - before, "step")
        self._step(grads)

    def backward_cycle(self, state_bytes_on_device: int) -> set[int]:
        """Every micro-batch of the step; the layouts whose whole gradient chunks remain."""
        device = self.device
        device.add("param", self.param_bytes(), "start")
        device.add(WORKSPACE, self.costs.held_bytes(), "start")
        for kind, nbytes in self.reducer.held_state().items():
            device.add(kind, nbytes, "start")
        device.add("optimizer states", state_bytes_on_device, "start")
        grads: set[int] = set()
        if self.carries:  # gathered in the step before (its traffic is counted in this one's)
            for layout in self.first_moment_layouts():
                self.gatherer.carry(layout, self.capacity(layout), device, "start")
            self.carried = self.first_moment_layouts()
        for micro in range(self.accumulation):
            self._micro_batch(grads, final=micro == self.accumulation - 1)
        return grads

    def first_moment_layouts(self) -> set[int]:
        """The trainable layouts the first moment computes on, gathered ahead across steps."""
        if not self.gatherer.gathers_for_compute or not self.moments:
            return set()
        return set(self.unit_layouts[self.moments[0][1]]) & set(self.packed.trainable)

    def dynamic_at_step(self) -> int:
        """What placement counts beside the optimizer states when the first step chooses
        their homes (``OptimizerStates.place``): the dynamic chunks that exist, and two of the
        largest in flight if some kind exists only around its use."""
        kept = sum(
            nbytes
            for kind, nbytes in self.device.by_kind.items()
            if kind not in (ACTIVATIONS, WORKSPACE, "optimizer states")
        )
        if self.gatherer.transient or self.reducer.transient:
            largest = max(layout.capacity for layout in self.packed.layouts)
            kept += 2 * largest * self.itemsize
        return kept

    def _micro_batch(self, grads: set[int], final: bool) -> None:
        device, trace = self.device, self.trace
        gathered, self.carried = set(self.carried), set()
        deferred: set[int] = set()
        awaiting: dict[int, set[int]] = {}  # layout -> units recomputed, backward not run yet
        arrived: Counter[int] = Counter()
        launched: list[int] = []  # reductions in flight, oldest first
        reduced: set[int] = set()
        overlap = self.reducer.in_backward and final
        gathers = self.gatherer.gathers_for_compute
        moment = -1
        for event in trace.events:
            kind = event[0]
            label = self.label(moment)
            if kind == "act":
                device.add(ACTIVATIONS, event[1], label)
            elif kind == "moment":
                for layout in sorted(deferred):
                    if not self._needed_again(moment, layout):
                        self._drop(gathered, layout, label)
                deferred.clear()
                moment += 1
                label = self.label(moment)
                if gathers:
                    self._gather_for(moment, event[2], gathered, label)
            elif kind == "release" and gathers:
                unit = event[2]
                for layout in self.unit_layouts[unit]:
                    if event[1] == "recompute":
                        awaiting.setdefault(layout, set()).add(unit)
                        continue
                    if event[1] == "bwd" and layout in awaiting:
                        awaiting[layout].discard(unit)
                        if awaiting[layout]:
                            continue
                        del awaiting[layout]
                    if event[1] == "bwd":
                        deferred.add(layout)  # pinned by unpacked saved views until the next moment
                    elif not self._needed_again(moment, layout):
                        self._drop(gathered, layout, label)
            elif kind == "grad":
                layout = self.packed.layout_of[event[1]]
                in_flight = event[2]
                device.add(ACTIVATIONS, in_flight, label)
                if self.separate_grads and layout not in grads:
                    grads.add(layout)
                    device.add("grad", self.capacity(layout) * self.itemsize, label)
                device.add(ACTIVATIONS, -in_flight, label)
                arrived[layout] += 1
                if overlap:
                    self._launch_complete(grads, arrived, launched, reduced, label)
            elif kind == "end":
                for layout in sorted(deferred | set(awaiting)):
                    self._drop(gathered, layout, label)
                if overlap:
                    self._reduce_remaining(grads, launched, reduced, label)
        if gathers:
            self.gatherer.arrived(device, "step")
        for layout in sorted(gathered):
            self._drop(gathered, layout, "step")

    def _gather_for(self, moment: int, unit: int, gathered: set[int], label: str) -> None:
        """A moment's gathers: its own where not prefetched, then the next moment's. When all
        of its own were prefetched the next ones launch before its own arrive (zero/gather.py,
        [Note: the next gather before this one's wait]): both wire buffers are held."""
        device, gatherer = self.device, self.gatherer
        following = (
            self.unit_layouts[self.moments[moment + 1][1]] if moment + 1 < len(self.moments) else []
        )
        if all(layout in gathered for layout in self.unit_layouts[unit]):
            before = gatherer.in_flight()
            for layout in following:
                self._gather(gathered, layout, label)
            gatherer.arrived(device, label, keep=gatherer.in_flight() - before)
            return
        gatherer.arrived(device, label)  # what was prefetched is read now
        for layout in self.unit_layouts[unit]:
            self._gather(gathered, layout, label)
        gatherer.arrived(device, label)
        for layout in following:
            self._gather(gathered, layout, label)

    def _send(self, traffic: list[Traffic]) -> None:
        if self.wire is not None:
            self.wire.add(traffic)

    def _needed_again(self, moment: int, layout: int) -> bool:
        """Whether a later moment of the same phase run uses ``layout`` (the tracer's rule)."""
        phase = self.moments[moment][0]
        for later in range(moment + 1, len(self.moments)):
            if self.moments[later][0] != phase:
                return False
            if layout in self.unit_layouts[self.moments[later][1]]:
                return True
        return False

    def _gather(self, gathered: set[int], layout: int, label: str) -> None:
        if layout not in gathered:
            gathered.add(layout)
            self._send(self.gatherer.gather(layout, self.capacity(layout), self.device, label))

    def _drop(self, gathered: set[int], layout: int, label: str) -> None:
        if layout in gathered:
            gathered.discard(layout)
            self.gatherer.dropped(layout, self.capacity(layout), self.device, label)

    def _launch_complete(self, grads, arrived, launched, reduced, label: str) -> None:
        """Reductions in backward: the layouts whose gradients are all in, last packed first."""
        for layout in reversed(self.packed.trainable):
            if layout in reduced:
                continue
            if arrived[layout] < self.expected[layout]:
                return
            self._launch(grads, launched, reduced, layout, label)
            while len(launched) > self.reducer.max_in_flight:
                self._complete(grads, launched.pop(0), label)

    def _launch(self, grads, launched, reduced, layout: int, label: str) -> None:
        if layout not in grads:  # reduced without gradients: zeros, from a fresh chunk
            grads.add(layout)
            self.device.add("grad", self.capacity(layout) * self.itemsize, label)
        self.device.add("grad_shard", self.shard(layout) * self.itemsize, label)
        self._send(self.reducer.launch(self.packed.layouts[layout], self.device, label))
        launched.append(layout)
        reduced.add(layout)

    def _reduce_remaining(self, grads, launched, reduced, label: str) -> None:
        """Reduce every layout not reduced yet, last packed first, at most the reducer's
        ``max_in_flight`` at once, then wait for all (``reduce_remaining``)."""
        for layout in reversed(self.packed.trainable):
            if layout not in reduced:
                self._launch(grads, launched, reduced, layout, label)
                while len(launched) > self.reducer.max_in_flight:
                    self._complete(grads, launched.pop(0), label)
        while launched:
            self._complete(grads, launched.pop(0), label)

    def _complete(self, grads: set[int], layout: int, label: str) -> None:
        grads.discard(layout)
        self.device.add("grad", -self.capacity(layout) * self.itemsize, label)
        self.reducer.complete(self.packed.layouts[layout], self.device, label)

    def _step(self, grads: set[int]) -> None:
        device, reducer = self.device, self.reducer
        if reducer.reduces and not reducer.in_backward:  # every layout before the step
            self._reduce_remaining(grads, [], set(), "step")
        num_params = len(self.trace.numels)
        self._send(self.sharding.step_traffic(reducer.presence_votes(num_params)))
        if self.carries:  # updated first, then gathered while the other layouts update
            for layout in sorted(self.first_moment_layouts()):
                self._send(self.gatherer.carry(layout, self.capacity(layout), device, "step"))
        if self.mixed and self.states_on_device:
            largest = max(self.state_elements(i) for i in self.packed.trainable)
            workspace = min(largest, WORKSPACE_ELEMENTS) * 4
            device.add(WORKSPACE, workspace, "step")
            device.add(WORKSPACE, -workspace, "step")
        for layout in self.packed.trainable:
            self._send(self.gatherer.after_update(self.capacity(layout)))
        self.gatherer.end_cycle(device, "step")


def activation_peak(trace: ModelTrace) -> int:
    """The largest non-model bytes of the cycle: saved tensors plus a gradient being stored."""
    saved, peak = 0, 0
    for event in trace.events:
        if event[0] == "act":
            saved += event[1]
            peak = max(peak, saved)
        elif event[0] == "grad":
            peak = max(peak, saved + event[2])
    return peak


def estimate_memory(
    trace: ModelTrace,
    packed: Layouts,
    config: Config,
    new_costs: Callable[[], StrategyCosts],
    capacity: int,
    gpu: bool,
    masters_on_device: bool,
    wire: WireTally,
) -> MemoryEstimate:
    """One rank's bytes; the steady step's collectives are added to ``wire``. ``new_costs``
    gives fresh cost models of the strategy's seams for each simulated run; ``capacity`` is
    the device's; ``gpu`` whether updates on the host stage gradients through host buffers (a
    real device) or read them in place (the simulated one)."""
    probe = _Simulation(trace, packed, config, new_costs())
    trainable = packed.trainable
    elements = [probe.state_elements(i) for i in trainable]
    probe.backward_cycle(0)
    homes = _state_homes(probe, config, capacity, elements)
    on_device = [i for i, home in zip(trainable, homes, strict=True) if home == "device"]
    costs = new_costs()  # the first cycle's pooled buffers are there in the steady one
    first = _Simulation(trace, packed, config, costs, states_on_device=bool(on_device))
    sim = _Simulation(trace, packed, config, costs, states_on_device=bool(on_device))
    sim.wire = wire
    sim.carries = True
    device_state = sum(sim.state_elements(i) for i in on_device) * state_bytes_per_element(
        config, on_device=True
    )
    first.run(device_state, until_step=sim.masters_bytes if masters_on_device else 0)
    sim.run(device_state)
    host = host_bytes(config, sim, elements, homes, gpu, masters_on_device)
    device = sim.device
    return MemoryEstimate(
        peak_device_bytes=device.peak,
        peak_device_at=device.peak_at,
        first_cycle_peak_device_bytes=first.device.peak,
        device_bytes_at_peak=device.peak_by_kind,
        activation_peak_bytes=activation_peak(trace),
        min_device_bytes=_min_device(sim),
        host_bytes=host.steady,
        first_cycle_host_bytes=host.first_cycle,
        nvme_bytes=host.nvme,
        state_homes=dict(Counter(homes)),
        chunk_size=packed.sizes.trainable.size,
        layouts=len(packed.layouts),
        padding_elements=sum(layout.padding for layout in packed.layouts),
        elements_per_rank=sum(elements),
    )


def _state_homes(
    probe: _Simulation, config: Config, capacity: int, elements: list[int]
) -> list[str]:
    """Each trainable layout's optimizer-state home, by ``OptimizerStates.place``'s rule;
    ``probe`` has run the first cycle's micro-batches, up to the step that places them."""
    offload = config.offload
    offloaded = 0
    if offload.optimizer in ("host", "nvme"):
        offloaded = offloaded_group_count(elements, offload.optimizer_ratio)
    rest = len(elements) - offloaded
    # What placement counts beside the states: the first (recording) cycle's non-model peak
    # (activations and a gradient being stored), and the dynamic chunks that exist then.
    per_element = 4 * moment_count(config.optimizer) + (4 if probe.mixed else 0)
    on_device = optimizer_state_device_groups(
        capacity,
        activation_peak(probe.trace),
        probe.dynamic_at_step(),
        [n * per_element for n in elements[:rest]],
        "device" if offload.optimizer == "device" else "auto",
    )
    offloaded_home = offload.optimizer if offload.optimizer in ("host", "nvme") else "host"
    return [
        offloaded_home if position >= rest else "device" if position < on_device else "host"
        for position in range(len(elements))
    ]


def _min_device(sim: _Simulation) -> int:
    """The smallest device a run trains on with chunks moving: at each moment its own chunks
    (whole, and their gradient chunks in backward), the next moment's gathered copies at
    ZeRO-3, and the activations then (before any optimizer state is on the device)."""
    activations = 0
    worst = 0
    moment_chunks = 0
    moment = -1
    for event in sim.trace.events:
        if event[0] == "act":
            activations += event[1]
        elif event[0] == "moment":
            moment += 1
            layouts = set(sim.unit_layouts[event[2]])
            if sim.gatherer.gathers_for_compute and moment + 1 < len(sim.moments):
                layouts |= set(sim.unit_layouts[sim.moments[moment + 1][1]])
            moment_chunks = sum(sim.capacity(i) for i in layouts) * sim.itemsize
            if event[1] == "bwd" and sim.separate_grads:
                moment_chunks *= 2
        worst = max(worst, moment_chunks + activations)
    return math.ceil(worst)
