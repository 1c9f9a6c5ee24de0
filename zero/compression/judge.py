"""``compression: auto``: a judge that picks a method, or none, from what it measures.

Three measurements, each agreed by all ranks (the slowest rank's value, one all-reduce), so
every rank picks alike:

- **the link**: a short probe at initialize, a timed all-reduce of ``PROBE_ELEMENTS`` fp32
  (median of three after one untimed); bandwidth = the bytes each rank sends / its time; and
  the same for an all-reduce of one element: each collective's latency;
- **the step**: the median time between the starts of the warm-up's exact steps (the first
  step of the process, which builds and allocates, left out);
- **the codec**: each candidate's encode and decode timed on scratch data on the gradients'
  device, scaled to this rank's gradient elements (PowerSGD: its three products per matrix,
  plus the same work on a tiny matrix once per matrix, for its fixed cost per matrix).

Wire bytes and collectives per step are the estimate's cost models (``traffic`` per layout:
one entry per collective). The prediction is

    link(m) = wire(m) / bandwidth + collectives(m) * latency
    T(none) = the measured exact step
    T(m)    = T(none) - link(none) + link(m) + codec(m)

(``T(none) - link(none)`` floored at 0), and the judge picks the fastest candidate only if it beats ``T(none)`` by ``min_gain``:
compression costs convergence too (Agarwal et al. found it rarely pays against a tuned exact
baseline), so a small predicted gain keeps the exact reduction. The model takes the exact
reduction as not overlapped with compute; where it is, the real gain is smaller, and
``min_gain`` is the margin for that. The decision (inputs, predictions, reason) is logged, kept
in checkpoints (a resumed run keeps it) and shown in the report.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from chunkmem.chunk import ChunkLayout
from chunkmem.costs import Traffic
from chunkmem.errors import EngineUsageError
from chunkmem.params import ParamStore
from chunkmem.sharding import Waitable
from kernels import compression as codes_ops
from zero.comm import Communicator
from zero.comm_ledger import elements_sent_per_rank
from zero.compression.blockwise import BlockCode
from zero.compression.powersgd import LayoutPlan, PowerSGDSettings, orthogonalize
from zero.compression.state import StepCounter
from zero.cycle_clock import CycleClock
from zero.reduce import ExactReduceScatterCosts, GradientReduction, GradientReductionCosts

PROBE_ELEMENTS = 1 << 20  # 4 MiB of fp32: long enough to see the link, short at initialize
REPEATS = 3
CODEC_SAMPLE_ELEMENTS = 1 << 20
MATRIX_SAMPLE_SIDE = 1024
STEP_SAMPLES = 2  # exact steps timed before deciding, after the process's first

_log = logging.getLogger("chunkmem")


@dataclass(frozen=True)
class LinkProbe:
    """The probe's all-reduce: bytes each rank sent, its median time (the slowest rank's),
    the whole probe's wall time, and the median time of a one-element all-reduce (the
    latency every collective pays)."""

    bytes_sent: int
    seconds: float
    total_s: float
    latency_s: float = 0.0

    @property
    def bandwidth(self) -> float:
        return self.bytes_sent / self.seconds


def probe_link(comm: Communicator, device: torch.device) -> LinkProbe:
    """Time an all-reduce on ``comm``'s world (every rank calls this at the same point)."""
    started = time.perf_counter()
    with comm.serving("link_probe"):
        medians = []
        for elements in (PROBE_ELEMENTS, 1):
            buffer = torch.zeros(elements, device=device)
            comm.all_reduce(buffer)  # untimed: connections and first-touch
            times = []
            for _ in range(REPEATS):
                began = time.perf_counter()
                comm.all_reduce(buffer)
                times.append(time.perf_counter() - began)
            medians.append(statistics.median(times))
        slowest = torch.tensor(medians, device=device)
        comm.all_reduce(slowest, op="max")
    sent = 4 * elements_sent_per_rank("all_reduce", PROBE_ELEMENTS, comm.size)
    seconds, latency = (float(v) for v in slowest)
    return LinkProbe(sent, seconds, time.perf_counter() - started, latency)


@dataclass(frozen=True)
class Candidate:
    """A method the judge may pick: its reduction, its cost model and how to time its codec
    on ``layouts`` (seconds per step on this rank)."""

    reduction: GradientReduction
    costs: GradientReductionCosts
    codec_seconds: Callable[[Sequence[ChunkLayout], torch.device], float]


@dataclass(frozen=True)
class Decision:
    """What the judge picked, from which step count on, why, and the numbers it used."""

    chosen: str
    from_step: int
    reason: str
    bandwidth_bytes_per_s: float
    step_s: float
    predicted_s: dict[str, float]
    wire_bytes: dict[str, int]
    codec_s: dict[str, float]
    probe_s: float
    latency_s: float = 0.0
    collectives: dict[str, int] | None = None


class Judge:
    """Decides once, at the first launch after the warm-up with enough timed steps."""

    def __init__(
        self,
        comm: Communicator,
        params: ParamStore,
        counter: StepCounter,
        clock: CycleClock,
        probe: LinkProbe,
        candidates: dict[str, Candidate],
        min_gain: float,
        phase: str,
    ) -> None:
        self.comm = comm
        self.params = params
        self.counter = counter
        self.clock = clock
        self.probe = probe
        self.candidates = candidates
        self.min_gain = min_gain
        self.phase = phase
        self.decision: Decision | None = None

    def ready(self) -> bool:
        return len(self._step_samples()) >= STEP_SAMPLES

    def _step_samples(self) -> list[float]:
        """The engine's time for each step this process completed but its first (which
        builds the trace and warms the caches), not the loop's period (zero.cycle_clock)."""
        return list(self.clock.durations)[1:]

    def decide(self, device: torch.device, itemsize: int) -> Decision:
        """Measure, agree with the other ranks, pick; logs the decision. A rank whose
        measurement fails still joins the agreement (with a flag), so every rank raises
        instead of the others waiting for it until the timeout."""
        step_s = statistics.median(self._step_samples())
        if self.comm.size == 1:
            return self._decided(
                "none", "a world of one reduces nothing across ranks", 0.0, step_s, {}, {}, {}
            )
        layouts = self.params.trainable_layouts()
        names = list(self.candidates)
        failure: Exception | None = None
        try:
            codec_local = [self.candidates[m].codec_seconds(layouts, device) for m in names]
        except Exception as error:  # re-raised below, after the other ranks heard of it
            failure, codec_local = error, [0.0] * len(names)
        agreed = torch.tensor(
            [step_s, *codec_local, float(failure is not None)], dtype=torch.float32, device=device
        )
        self.comm.all_reduce(agreed, op="max")
        step_s, *codec, failed = (float(v) for v in agreed)
        if failed:
            raise EngineUsageError(
                "compression 'auto' could not time the candidates' codecs "
                + (f"on this rank: {failure!r}" if failure else "on another rank (see its log)")
                + "; choose compression.type explicitly"
            ) from failure
        assert self.comm.topology is not None  # the strategy sets it
        exact = ExactReduceScatterCosts(self.comm.topology, itemsize, self.phase)
        traffic = {"none": exact.traffic} | {m: self.candidates[m].costs.traffic for m in names}
        wire = {m: _bytes_sent(t, layouts) for m, t in traffic.items()}
        collectives = {m: sum(len(t(layout)) for layout in layouts) for m, t in traffic.items()}
        bandwidth, latency = self.probe.bandwidth, self.probe.latency_s

        def link(m: str) -> float:
            return wire[m] / bandwidth + collectives[m] * latency

        # what the step spends besides the exact reduction's link time (at least nothing: a
        # probe slower than the step implies means the reduction overlapped compute)
        compute = max(0.0, step_s - link("none"))
        predicted = {"none": step_s}
        codec_s = dict(zip(names, codec, strict=True))
        for m in names:
            predicted[m] = compute + link(m) + codec_s[m]
        best = min(names, key=lambda m: (predicted[m], m))
        gain = 1 - predicted[best] / step_s
        if gain >= self.min_gain:
            chosen = best
            reason = (
                f"{best} predicts {predicted[best]:.4g} s per step against {step_s:.4g} s "
                f"exact, {gain:.1%} faster (min_gain {self.min_gain:.0%})"
            )
        else:
            chosen = "none"
            change = f"{gain:.1%} faster" if gain >= 0 else f"{-gain:.1%} slower"
            reason = (
                f"the fastest method, {best}, predicts {change} than the exact "
                f"{step_s:.4g} s per step, below min_gain {self.min_gain:.0%}: the link "
                f"({bandwidth / 1e6:.4g} MB/s) is not the bottleneck"
            )
        return self._decided(
            chosen, reason, bandwidth, step_s, predicted, wire, codec_s, collectives
        )

    def _decided(
        self,
        chosen: str,
        reason: str,
        bandwidth: float,
        step_s: float,
        predicted: dict[str, float],
        wire: dict[str, int],
        codec_s: dict[str, float],
        collectives: dict[str, int] | None = None,
    ) -> Decision:
        self.decision = Decision(
            chosen, self.counter.steps, reason, bandwidth, step_s, predicted, wire, codec_s,
            self.probe.total_s, self.probe.latency_s, collectives,
        )  # fmt: skip
        _log.info("compression auto: %s (%s)", chosen, reason)
        return self.decision

    def compressed_from(self) -> int | None:
        """The first step count reduced by a compressed method (None: none yet, or never)."""
        d = self.decision
        return None if d is None or d.chosen == "none" else d.from_step

    def saved(self) -> dict[str, Any] | None:
        return None if self.decision is None else asdict(self.decision)

    def restore(self, saved: dict[str, Any] | None) -> None:
        self.decision = None if saved is None else Decision(**saved)


class AutoReduction:
    """The :class:`zero.reduce.GradientReduction` of ``auto``: exact until the judge has
    decided (it decides at its first launch with enough timed steps), then the choice."""

    def __init__(self, judge: Judge, exact: GradientReduction) -> None:
        self.judge = judge
        self.exact = exact

    def launch(self, layout: ChunkLayout, full: torch.Tensor, shard: torch.Tensor) -> Waitable:
        judge = self.judge
        if judge.decision is None and judge.ready():
            judge.decide(full.device, full.element_size())
        chosen = "none" if judge.decision is None else judge.decision.chosen
        if chosen == "none":
            return self.exact.launch(layout, full, shard)
        return judge.candidates[chosen].reduction.launch(layout, full, shard)


class AutoCosts:
    """``auto`` in the estimate: the exact reduction's traffic (what it sends until it
    decides, and after, if it picks none) and the largest candidate's buffers and state."""

    def __init__(self, exact: GradientReductionCosts, candidates: list[GradientReductionCosts]):
        self.exact = exact
        self.candidates = candidates

    def traffic(self, layout: ChunkLayout) -> list[Traffic]:
        return self.exact.traffic(layout)

    def buffer_bytes(self, layout: ChunkLayout) -> int:
        return max(c.buffer_bytes(layout) for c in self.candidates)

    def state_bytes(self, layout: ChunkLayout) -> dict[str, int]:
        largest: dict[str, int] = {}
        for costs in self.candidates:
            for kind, nbytes in costs.state_bytes(layout).items():
                largest[kind] = max(largest.get(kind, 0), nbytes)
        return largest


def block_codec_seconds(code: BlockCode) -> Callable[[Sequence[ChunkLayout], torch.device], float]:
    """Encode and decode-sum of a sample, scaled to every gradient element of the layouts
    (each rank encodes its whole gradient chunks and decodes as many elements)."""

    def seconds(layouts: Sequence[ChunkLayout], device: torch.device) -> float:
        total = sum(layout.capacity for layout in layouts)
        block = code.block
        sample = max(block, min(total, CODEC_SAMPLE_ELEMENTS) // block * block)
        x = torch.randn(sample, generator=torch.Generator().manual_seed(0)).to(device)
        codes = torch.empty(
            codes_ops.code_nbytes(sample, code.code), dtype=torch.uint8, device=device
        )
        scales = torch.empty(sample // block, device=device)
        out = torch.empty(sample, device=device)

        def once() -> None:
            if code.code == "onebit":
                codes_ops.onebit_compress(x, block=block, codes=codes, scales=scales)
            else:
                codes_ops.ternary_compress(x, block=block, seed=0, codes=codes, scales=scales)
            codes_ops.decompress_sum([codes], [scales], code=code.code, block=block, out=out)

        return _median_seconds(once, device) * total / sample

    return seconds


def powersgd_codec_seconds(
    settings: PowerSGDSettings,
) -> Callable[[Sequence[ChunkLayout], torch.device], float]:
    """P = M Q, orthogonalize, Q = M^T P and the residual M - P Q^T on a sample matrix, scaled
    by the elements of every matrix PowerSGD compresses."""

    def seconds(layouts: Sequence[ChunkLayout], device: torch.device) -> float:
        matrices = [m for layout in layouts for m in LayoutPlan.of(layout, settings).matrices]
        if not matrices:
            return 0.0
        largest = max(matrices, key=lambda m: m.rows * m.cols)
        rows, cols = min(largest.rows, MATRIX_SAMPLE_SIDE), min(largest.cols, MATRIX_SAMPLE_SIDE)
        generator = torch.Generator().manual_seed(0)
        m = torch.randn(rows, cols, generator=generator).to(device)
        q = torch.randn(cols, settings.rank, generator=generator).to(device)

        def step_on(m: torch.Tensor, q: torch.Tensor) -> Callable[[], None]:
            def once() -> None:
                p = m @ q
                orthogonalize(p)
                new_q = m.T @ p
                torch.sub(m, p @ new_q.T)

            return once

        side = settings.rank
        tiny_m = torch.randn(side, side, generator=generator).to(device)
        tiny_q = torch.randn(side, settings.rank, generator=generator).to(device)
        per_matrix = _median_seconds(step_on(tiny_m, tiny_q), device)  # the fixed cost
        work = sum(x.rows * x.cols for x in matrices)
        scaled = _median_seconds(step_on(m, q), device) * work / (rows * cols)
        return scaled + per_matrix * len(matrices)

    return seconds


def _median_seconds(fn: Callable[[], None], device: torch.device) -> float:
    fn()  # untimed: first-touch, kernel loads
    times = []
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _bytes_sent(traffic: Callable[[ChunkLayout], list[Traffic]], layouts) -> int:
    return sum(t.sent for layout in layouts for t in traffic(layout))
