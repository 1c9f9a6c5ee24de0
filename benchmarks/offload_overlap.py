"""Offload step overlapped with backward against the serial step, same model, same run: plain,
under gradient clipping (speculative, with rollbacks), and with states on NVMe.

    python -m benchmarks.offload_overlap [--quick] [--json PATH]

A GPT trains in bf16 (fp32 where this CPU emulates bf16, see the note on precision) on
Python's standard-library text (``chunkmem train``'s data) with its
fp32 masters and Adam moments on the host (``offload.optimizer: host``), where the native host
optimizer updates them. Two engines on the same model and data differ only in
``offload.overlap``: the serial one updates every chunk group in ``engine.step()``; the
overlapped one starts a group's update on a host thread as soon as its gradients are final.
With ``gradient_clipping: 1.0`` the overlapped updates are speculative (offload/speculation.py)
and undone when clipping fires; every step of both engines must stay bit-identical.

[Note: emulating a GPU and its host on a CPU] Without a GPU the split is emulated: forward and
backward run on core 0 (torch threads = 1, the main thread pinned there), as a GPU would run
them, and the host optimizer runs with 1 thread on core 1, as the host would. The serial
engine's ``step()`` moves the main thread to core 1 for the update and back, so both engines
update on the same core with the same thread count. Every other thread the engines start is
host work too (the host optimizer's, the NVMe tier's I/O threads) and runs on core 1: a thread
starts on the cores of the thread that starts it, and the library starts these when they are
first needed, in backward for the overlapped engine, so the benchmark moves every thread but
the main one to core 1 before each step (:func:`keep_host_threads_on_host_core`). Until it
did, the overlapped engine's NVMe threads ran on the compute core (started in its backward)
and the serial engine's on the host core (started in its ``step()``): in a probe interleaving
the serial engine and two overlapped ones step by step (30 steps, twice), the overlapped NVMe
step took 918 and 813 ms with its I/O threads on the compute core and 703 and 611 with them
on the host core, the serial one 655 and 602. The two cores share memory bandwidth and
caches, which a GPU and its host do not.

The emulation's limit: the two cores are not a GPU and a host. On a 2-vCPU VM they may share
a physical core's execution units (an AVX2 EPYC VM: a 512x512 matrix product took 1.8x as long
beside another on the second vCPU, 1.2x beside a Python loop), so any work on the host core,
the overlapped update included, slows the forward and backward it overlaps. The benchmark
measures that slowdown (``details.emulation.compute_slowdown_beside_host_load``: forward and
backward in plain torch in the engines' precision, alone and beside an Adam loop in another
process on the host core; in fp32 whatever the engines' precision through ``1558937``) so that a
reader can tell the overlap's cost from the machine's.

[Note: steal] A hypervisor may run something else on a vCPU at any time; the guest counts
that time per CPU (``benchmarks/_steal.py``, from /proc/stat, outside the engine). On the Ice
Lake VM the compute vCPU lost 2-18 ms a step to it in the serial engine's forward and backward
and 9-75 ms in the overlapped engine's, in the same interleaved minutes: while both vCPUs are
busy, which the overlap is by design, the machine takes more. So the keys move with the hour
on such a VM. Each run reports the mean steal a step by engine, phase and core
(``hypervisor_steal_s_per_step``), the compute core's steal beyond the serial engine's within
the waiting time it attributes (``unhidden_s.engine_thread_waiting_hypervisor_steal``), and
the hidden fraction and step-time ratio without it (``without_hypervisor_steal``, the
ablation, medians over the repeats in ``details.without_hypervisor_steal``), and the most any
overlap could have hidden beside that steal (``details.bounds_at_the_hours_steal``: the
combined bound less the steal beyond the serial engine's as a share of the update, per repeat,
with the step-time ratio it allows): whether the hour let a goal be met at all. The interference
probes record it too (``steal_s_alone`` / ``steal_s_beside``): the machine bound's windows,
plain torch beside another process, have not met the steal the engines' pairs meet. The keys
themselves are wall times, steal included, as a user of this machine would see them.

[Note: the regime is measured] How much an overlap can hide depends on the host update's share
of the serial step, which depends on the CPU (bf16 compute is emulated without AVX-512 BF16)
and on the tokens per step. The benchmark measures that share for micro-batches of 2 to 256
tokens, fewest first, and takes the most tokens at which the host update is still at least 30%
of the serial step (as when a GPU computes and the host updates: DeepSpeed issue 6834, 0.2 s ->
~10 s with offload). The keys are then about the overlap, not the CPU. Sizes under 16 are for
CPUs whose bf16 forward and backward are slow but within the precision rule below: on an Ice
Lake Xeon without AVX-512 BF16 (1.16-1.28x fp32) the update was 0.21 of the serial step at 16
tokens, 0.29 at 8, 0.31 at 4 and 0.39 at 2, so the runs until this note measured below the
regime there. At a few tokens forward and backward mostly read weights, as a GPU's do at a
small micro-batch.

[Note: a chunk is a block] An update is prepared on the engine's thread (chunks pinned, step
counts advanced, the kernel's arguments built: about 1 ms of Python per group here) and its
kernels run on the host thread. At scale a chunk holds a transformer block or more (auto sizes
chunks as a fraction of the device: a 7B block is 200M parameters), so that Python is a
thousandth of the group's update. At this toy width auto picks ~1M-element chunks, three
groups a block: the engine thread's share of the update is then a quarter, a cost of the toy
shape and not of the overlap. The engines here use one block's parameters per chunk
(``chunk.size``), and the full run reports the plain pair at auto chunk size beside it
(``details.plain_auto_chunks``, the ablation).

[Note: precision by measurement] A CPU without AVX-512 BF16 or AMX emulates bf16 arithmetic
through fp32: forward and backward then take several times an fp32 one, and on an AVX2-only
EPYC the host update was 5% of the serial step even at 16 tokens, nowhere near the regime. So
a calibration (the serial engine at CALIBRATION_TOKENS, bf16 and fp32 steps alternating)
decides: bf16, the recipe, where a bf16 forward and backward take at most
BF16_AT_SPEED_MAX_RATIO times an fp32 one; fp32 otherwise, with the measured ratio and the
reason in ``details.precision``. A GPU computes bf16 at speed, so fp32 on such a CPU is the
closer emulation of the split.

The keys:

- ``update_hidden_fraction``: (T_serial - T_overlapped) / (T_serial - T_serial,fwd+bwd), the
  share of the serial optimizer time the overlap hides (medians over the measured steps);
- ``update_hidden_fraction_clipped``: the same at ``gradient_clipping: 1.0``, over the steps
  where clipping did not fire (the speculative updates stood); the loss is scaled by
  LOSS_SCALE there (see its note);
- ``step_time_ratio_overlapped_vs_serial_clipped``: the clipped runs' step-time ratio: each
  run's is the median over its blocks of BLOCK step pairs (with the range), and the key is the
  median over REPEATS runs on fresh engines (plain and clipped runs alternate; each run's
  value is in ``details.repeats``), as are the other plain and clipped keys;
- ``rollback_step_time_ratio_vs_serial``: on steps where clipping is forced (the loss scaled
  up every ROLLBACK_EVERY steps), the overlapped step (speculate, undo, update serially) over
  the serial one;
- ``nvme_update_hidden_fraction_clipped``: states on the NVMe tier (at its default block
  size), clipped;
- ``clipped_step_fraction``: how often clipping fires in practice: the 300-step
  ``chunkmem train`` demo run at clip 1.0 (and 0.5 beside it);
- ``step_time_ratio_overlapped_vs_serial``: the plain runs' ratio, at the stated regime;
- ``update_hidden_fraction_machine_bound``: 1 / the compute slowdown beside a busy host core
  (measured in plain torch, not by the engine): the most any overlap can hide on this machine.
  While the host updates for U seconds, forward and backward slowed s-fold progress only U / s,
  so the step is at least T_fwd+bwd + U (1 - 1/s) and the hidden share at most 1/s. On a GPU
  and its host s is 1 and the bound is 1; null where the run is not pinned to two cores.
- ``update_hidden_fraction_host_bound``: the other direction, min(1, B / (r U)), where r is
  the host core's slowdown beside a busy compute core (torch's fused AdamW over the model's
  elements, alone and beside the GPT's forward and backward looping in another process: not
  the engine), B the serial engine's backward and U its update (T_serial - T_serial,fwd+bwd).
  An update starts in backward at the earliest, and while backward runs the host core does
  1/r of the work it does alone in the same time, so at most B / r of the update's
  alone-time is done by backward's end and the rest, at least U - B / r, follows it: the
  overlapped step is at least T_serial - B / r long. The plain runs' bound (the clipped ones'
  is in ``details.emulation``); null where not pinned. A GPU does not slow its host: there r is 1.
- ``update_hidden_fraction_dependency_bound``: 1 minus the share of the update's elements in
  the chunk group that holds the token embedding. Its gradient (tied to the head's) completes
  in the embedding's backward, backward's last operation, so that group's update starts only
  when backward ends, on any machine: the most an overlap at this chunk size can hide. The
  model's structure and the chunk size decide it; no timing does.
- ``update_hidden_fraction_bound``: the three together, min(D M, H) for the dependency bound D,
  the machine bound M = 1/s and the host bound H, the most any overlap can hide here. The share
  1 - D of the update waits for backward's end whatever the machine; the rest, D U, runs beside
  forward and backward at best, which beside it lose D U (1 - 1/s): the overlapped step is at
  least T_fwd+bwd + (1 - D) U + D U (1 - 1/s), and the hidden share at most D / s (assuming the
  embedding's group updates as fast an element as the others). Null where M is. Where it is under
  a goal, no engine meets that goal on this machine at this regime; the step-time ratio it
  allows is 1 - share * bound (``details.step_time_ratio_bound``, with the plain runs' share).

[Note: depth] Each chunk group's update costs the engine's thread the same Python whatever
its size, and the embedding's group is about 1/N_LAYER of the update, so a deeper model of the
same width hides more (GPT-2 small has 12 blocks, a 7B 32, a 70B 80). The full run also pairs
the engines on DEEPER_N_LAYER blocks, plain and clipped, once each, at the same tokens per step
(``details.deeper_model``), to show how much of the unhidden update is that share.

[Note: width] Each group's update also costs the engine's thread about 0.2 ms of Python in
backward (pinning, preparing, retiring: 1.4-1.7 ms a step for 9 groups with no host work
beside it, twice that beside it) and the host thread 0.1-0.3 ms (building the kernel's
arguments, holding the GIL the engine thread's hooks then wait for), whatever its size; the
kernels' work grows with the width squared. At 512 wide a group's update took about 2 ms, so
that fixed Python was a large share of it; at 1024 about 8 ms; at a 7B's 4096 (a block of 200M
elements) a thousandth.
Until this note the GPT was 512 wide. In throwaway probes (2026-12-02, an AMD EPYC with
AVX-512 BF16, 32 tokens a step, 40 step pairs a run) the clipped ratio was 0.779-0.789 at 1024
(three runs) against 0.873 at 512 in the same minutes; the engine thread's callbacks and
waits went from 4.1 ms a step of the 11 left unhidden at 512 to 5.0-5.8 of 25-34 at 1024, where
the compute core's slowdown beside the host kernels (the machine's, 13-17 ms) became the
largest part.
So the GPT is N_EMBD wide, and the full run pairs the engines at NARROWER_N_EMBD too, plain and
clipped, once each, at the same tokens per step (``details.narrower_model``): the ablation
without the width.

[Note: NVMe] Each block of a transfer is one job of the tier's I/O threads (on the host core,
see the note on emulation), and a write copies its blocks into four shared buffers on the
calling thread: the engine's, which in an overlapped step writes each group's states back in
backward (the copies and the waits for a free buffer lengthen backward), so at any block size
the overlapped NVMe step has not been faster than the serial one here. The NVMe runs use the
tier's default block (``offload.nvme.block_size``, 4 MiB: what a user gets). Runs until this
note used 64 KiB blocks, about 11,600 jobs a step and steps about four times as long (2.4 s
against 0.64 s); the full run keeps that setting as the ablation
(``details.nvme_clipped_small_blocks``, NVME_SMALL_BLOCK_STEPS steps).

[Note: row stores] A speculative update writes its new states elsewhere (and saves the
gradients it overwrites), and the native kernel stores those rows streamed (non-temporal) or
through the cache, whichever its first large calls measured faster on this machine
(``kernels/row_stores.py``): on an AMD EPYC VM streaming was faster, on an Ice Lake VM it
made the speculative update 2.4 times as long and the clipped overlap hid nothing. The
choice is in ``details.row_stores``, and the full run pairs the clipped engines once more with
the other kind forced (``details.row_stores.clipped_with_the_other_kind``, the ablation).

[Note: does the host thread keep up] Each group's update runs on the host thread once its
gradients are final, one group about every block's backward. Where a run takes longer than
that, the host thread runs back to back and ends behind backward, and ``step()`` waits for the
rest. Each analysis says which (``host_thread``, medians over the step pairs, from each early
update's run timed on its thread): the share of backward the host thread spent running them
(``busy_fraction_of_backward``; near 1: saturated) and how long its runs lasted past backward's
end (``runs_after_backward_s``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

import chunkmem
from benchmarks._common import parse_args, print_table, write_results
from benchmarks._measured_code import python_command
from benchmarks._steal import steal_between, steal_s
from benchmarks._timing import median_seconds
from chunkmem.cli.data import stdlib_text
from chunkmem.config import NvmeConfig
from chunkmem.models.gpt import GPT, GPTConfig
from kernels.row_stores import row_stores, set_row_stores

COMPUTE_CORE, HOST_CORE = 0, 1
CORES = (COMPUTE_CORE, HOST_CORE)
BLOCK = 8  # step pairs per ratio
REPEATS = 3  # plain and clipped pairs in a full run, each on fresh engines
ROLLBACK_EVERY = 6  # a step whose loss is scaled up so that clipping fires
# A layout's update starts when its gradients are final: the embedding's chunk group (with
# the first block's first parameters) is final only when backward ends, so its update is never
# hidden and about 1/N_LAYER of the update bounds the hidden fraction (the key
# update_hidden_fraction_dependency_bound). 8 layers (GPT-2 small has 12, a 7B 32, a 70B 80);
# with 4 the plain overlap hid 0.58 of the update on the same machine. See the note on depth.
N_LAYER = 8
DEEPER_N_LAYER = 16
# The GPT's width (GPT-2 medium's; a 7B's is 4096) and the full run's ablation at the width
# this benchmark used until the note on width (``details.narrower_model``).
N_EMBD = 1024
NARROWER_N_EMBD = 512
HEAD_WIDTH = 128
# The NVMe tier's block size in the full run's ablation (see the note on NVMe); the keyed run
# uses the tier's default.
NVME_SMALL_BLOCK = 64 << 10
NVME_SMALL_BLOCK_STEPS = 12
TOKENS = (2, 4, 8, 16, 32, 64, 128, 256)
QUICK_TOKENS = (4, 8)  # two sizes, short steps: a quick run's regime is only indicative
CALIBRATION_TOKENS = 16  # the precision calibration's micro-batch (see its note)
MIN_HOST_SHARE = 0.3
CLIP = 1.0
PRECISIONS = ("fp32", "bf16")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}  # torch's, by the config's precision
BF16_AT_SPEED_MAX_RATIO = 2.0
# The loss is scaled by this much in the clipped runs: a micro-batch of a few hundred tokens
# has gradient norms of 2-18 where a settled large-batch run sits below 1, and Adam's update
# does not depend on the gradients' scale (up to eps), so the run trains the same while
# clipping fires only where the benchmark forces it (and where the norm truly spikes).
LOSS_SCALE = 0.02
REPO = Path(__file__).resolve().parent.parent


def quartiles(values: Sequence[float]) -> dict[str, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def block_elements(model: GPT) -> int:
    """Parameters of one transformer block: the chunk size (see the note on chunks)."""
    return sum(p.numel() for p in model.blocks[0].parameters())


def build(model, overlap: bool, clip: float, where: str, path: str, precision: str,
          chunk_size: int | str | None = None, nvme_block: int | None = None):  # fmt: skip
    """An engine on a copy of ``model``; ``chunk_size`` None: one block per chunk;
    ``nvme_block`` None: the NVMe tier's default block size (see the note on NVMe)."""
    nvme = {"path": path} if nvme_block is None else {"path": path, "block_size": nvme_block}
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": precision,
            "device": {"type": "simulated", "capacity": "4GiB"},
            "chunk": {"size": block_elements(model) if chunk_size is None else chunk_size},
            "optimizer": {"lr": 1e-4},
            "gradient_clipping": clip,
            "offload": {"optimizer": where, "overlap": overlap, "optimizer_threads": 1,
                        "nvme": nvme},
        },
    )  # fmt: skip
    if overlap:
        time_listener(engine)
        time_host_runs(engine)
    return engine


def keep_host_threads_on_host_core() -> None:
    """Every thread but the main one on the host core (see the note on emulation): the host
    optimizer's and the NVMe tier's I/O threads, which the library starts when first needed and
    which start on the cores of the thread that starts them (the compute core, in backward)."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is main or thread.native_id is None:
            continue
        with contextlib.suppress(ProcessLookupError):  # it ended since it was listed
            os.sched_setaffinity(thread.native_id, {HOST_CORE})


def time_listener(engine) -> None:
    """Sum, in ``engine.listener_cpu_s``, the engine thread's CPU seconds in the overlapped
    step's callbacks during backward (starting and retiring early updates): the part of the
    unhidden time that is the engine's own Python on the compute core."""
    listener = engine.reducer.listener
    engine.listener_cpu_s = 0.0

    def timed(callback):
        def call(layout) -> None:
            start = time.thread_time()
            try:
                callback(layout)
            finally:
                engine.listener_cpu_s += time.thread_time() - start

        return call

    listener.final = timed(listener.final)
    listener.writing = timed(listener.writing)


def time_host_runs(engine) -> None:
    """Record, in ``engine.host_runs``, each early update's run on the host thread as (start,
    end) on ``time.perf_counter``'s clock: whether the host thread keeps up with backward, or
    runs back to back and leaves work past backward's end (``host_thread_split``)."""
    optimizer = engine.optimizer
    start_early = optimizer.start_early
    engine.host_runs = []

    def timed(run: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            start = time.perf_counter()
            try:
                run()
            finally:
                engine.host_runs.append((start, time.perf_counter()))

        return call

    def start(layout, submit) -> bool:
        return start_early(layout, lambda run: submit(timed(run)))

    optimizer.start_early = start


def host_thread_split(
    runs: list[tuple[float, float]], backward_start: float, backward_end: float
) -> tuple[float, float]:
    """(seconds the host thread ran early updates within backward, seconds its runs lasted
    past backward's end): the first over backward's length says how busy it kept the host
    core; the second is what ``step()`` waits for at least."""
    busy = sum(max(0.0, min(end, backward_end) - max(start, backward_start)) for start, end in runs)
    after = max((end for _start, end in runs), default=backward_end) - backward_end
    return busy, max(0.0, after)


class StepSample(NamedTuple):
    """One engine step as the benchmark times it (seconds)."""

    step_s: float
    forward_backward_s: float
    step_call_s: float  # engine.step()
    grad_norm: float
    cpu_s: float  # the main thread's CPU in forward and backward
    listener_cpu_s: float  # of which in the overlap's callbacks
    backward_s: float
    # Hypervisor steal (compute core, host core) in forward and backward and in step(): the
    # machine's, not the engine's (see the note on steal); None where not counted.
    steal_forward_backward_s: tuple[float, ...] | None = None
    steal_step_call_s: tuple[float, ...] | None = None
    # The host thread's early-update runs (``host_thread_split``); None where not timed.
    host_busy_in_backward_s: float | None = None
    host_after_backward_s: float | None = None


def one_step(
    engine, x, y, scale: float, serial_on_host_core: bool, sync: Callable[[], None] | None = None
) -> StepSample:
    """One step of ``engine``, timed (a serial engine's ``step()`` moved to the host core).
    ``sync``: a device's, called before the step, at backward's end and at the step's end;
    such a run reads no steal (a GPU's host is not the emulation's pair of vCPUs)."""
    engine.listener_cpu_s = 0.0
    runs = getattr(engine, "host_runs", None)
    if runs is not None:
        runs.clear()
    wait = sync or (lambda: None)
    read_steal = (lambda: None) if sync else functools.partial(steal_s, CORES)
    wait()
    steal_start = read_steal()
    start = time.perf_counter()
    cpu_start = time.thread_time()
    loss = engine(x, y) * scale
    forward_done = time.perf_counter()
    engine.backward(loss)
    wait()
    backward_done = time.perf_counter()
    cpu = time.thread_time() - cpu_start
    steal_backward_done = read_steal()
    if serial_on_host_core:
        os.sched_setaffinity(0, {HOST_CORE})
    engine.step()
    if serial_on_host_core:
        os.sched_setaffinity(0, {COMPUTE_CORE})
    wait()
    end = time.perf_counter()
    busy, after = (
        (None, None) if runs is None else host_thread_split(runs, forward_done, backward_done)
    )
    return StepSample(
        step_s=end - start,
        forward_backward_s=backward_done - start,
        step_call_s=end - backward_done,
        grad_norm=engine.last_grad_norm,
        cpu_s=cpu,
        listener_cpu_s=engine.listener_cpu_s,
        backward_s=backward_done - forward_done,
        steal_forward_backward_s=steal_between(steal_start, steal_backward_done),
        steal_step_call_s=steal_between(steal_backward_done, read_steal()),
        host_busy_in_backward_s=busy,
        host_after_backward_s=after,
    )


class AdamLoad:
    """torch's fused AdamW over ``elements`` fp32 elements: the stand-in for the host update,
    both where it is timed and where it loads the host core."""

    def __init__(self, elements: int) -> None:
        self.param, self.grad, self.exp_avg, self.exp_avg_sq = (
            [torch.rand(elements)] for _ in range(4)
        )
        self.step_count = [torch.zeros(())]

    def step(self) -> None:
        torch._fused_adamw_(self.param, self.grad, self.exp_avg, self.exp_avg_sq, [],
                            self.step_count, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip


def load_loop(kind: str, core: str, *args: str) -> None:
    """A load process's body (see ``slowdowns_beside``; its arguments are strings): pinned to
    ``core``, one thread, one iteration, a line saying it runs, then forever.
    ``adam ELEMENTS``: the host core's stand-in load; ``compute TOKENS DTYPE``: forward and
    backward of the benchmark's GPT (fresh weights: the time does not depend on them)."""
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {int(core)})
    if kind == "adam":
        iteration = AdamLoad(int(args[0])).step
    else:
        tokens, dtype = int(args[0]), getattr(torch, args[1])
        model = GPT(gpt_config(tokens)).to(dtype)
        x = torch.randint(0, 256, (1, tokens))

        def iteration() -> None:
            model(x, x).backward()

    iteration()
    print("running", flush=True)
    while True:
        iteration()


_LOAD = "import sys; from benchmarks.offload_overlap import load_loop; load_loop(*sys.argv[1:])"


class Slowdowns(NamedTuple):
    """``slowdowns_beside``'s rounds: the ratios beside / alone, and each window's hypervisor
    steal (compute core, host core; None where not counted): whether the probe met the steal
    the engines' pairs meet (see the note on steal)."""

    ratios: list[float]
    steal_alone_s: list[tuple[float, ...] | None]
    steal_beside_s: list[tuple[float, ...] | None]


def slowdowns_beside(measure_s: Callable[[], float], load: Sequence[str], rounds: int) -> Slowdowns:
    """``measure_s()`` alone and beside a load process (``load_loop``'s arguments), alternating
    ``rounds`` times after a warm-up. The load runs in a process of its own, so it holds no GIL
    of the benchmark's."""
    command = [sys.executable, "-c", _LOAD, *load]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    measure_s()  # warm
    result = Slowdowns([], [], [])
    for _ in range(rounds):
        alone, steal_alone = _with_steal(measure_s)
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None
            if process.stdout.readline() != "running\n":  # its first iteration is done
                raise RuntimeError(
                    f"the load {' '.join(load)} exited ({process.wait()}) before its loop ran: "
                    f"nothing to measure beside; its error is above"
                )
            beside, steal_beside = _with_steal(measure_s)
        finally:
            process.kill()
            process.wait()
        result.ratios.append(beside / alone)
        result.steal_alone_s.append(steal_alone)
        result.steal_beside_s.append(steal_beside)
    return result


def _with_steal(measure_s: Callable[[], float]) -> tuple[float, tuple[float, ...] | None]:
    """``measure_s()`` and the hypervisor's steal on both cores while it ran."""
    before = steal_s(CORES)
    seconds = measure_s()
    return seconds, steal_between(before, steal_s(CORES))


def in_precision(model: GPT, precision: str) -> GPT:
    """A copy of ``model`` in the engines' ``precision``: what a plain-torch probe computes
    with, so that the bound it gives is measured on the forward and backward it bounds."""
    return copy.deepcopy(model).to(getattr(torch, DTYPE_NAMES[precision]))


def compute_slowdown_beside_host_load(
    model: GPT, tokens: int, precision: str, rounds: int, steps: int
) -> dict:
    """How much a busy host core slows the compute core on this machine: forward and backward
    of ``model`` in plain torch in the engines' ``precision`` on the compute core, alone and
    beside an Adam loop on the host core, alternating ``rounds`` times; the median of the
    paired ratios. A GPU and its host do not share execution units or a memory bus; two vCPUs
    may (see the note on emulation)."""
    model = in_precision(model, precision)
    batches = text_batches(tokens, steps)

    def forward_backward_s() -> float:
        seconds = []
        for x, y in batches:
            start = time.perf_counter()
            model(x, y).backward()
            seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        return statistics.median(seconds)

    elements = sum(p.numel() for p in model.parameters())
    rounds_run = slowdowns_beside(
        forward_backward_s, ["adam", str(HOST_CORE), str(elements)], rounds
    )
    return {"ratio": statistics.median(rounds_run.ratios), "ratios": rounds_run.ratios,
            "steal_s_alone": rounds_run.steal_alone_s, "steal_s_beside": rounds_run.steal_beside_s,
            "tokens": tokens, "precision": precision,
            "host_load": "torch._fused_adamw_ over the model's elements, looping, host core"}  # fmt: skip


def probe_steal(probe: dict) -> str:
    """The compute core's steal over an interference probe's windows alone and beside, for its
    line of the table ("" where not counted)."""
    windows = (probe["steal_s_alone"], probe["steal_s_beside"])
    if any(steal is None for readings in windows for steal in readings):
        return ""
    alone, beside = (1e3 * sum(steal[0] for steal in readings) for readings in windows)
    return (
        f" (the compute core's steal over its windows: {alone:.0f} ms alone, {beside:.0f} beside)"
    )


def host_slowdown_beside_compute(
    model: GPT, tokens: int, precision: str, rounds: int, iterations: int
) -> dict:
    """The other half of the emulation's interference: how much a busy compute core slows the
    host core. torch's fused AdamW over the model's elements on the host core, alone and
    beside forward and backward looping on the compute core in another process, alternating
    ``rounds`` times; the median of the paired ratios. The overlapped update runs beside
    backward; a GPU's backward does not slow its host's update."""
    adam = AdamLoad(sum(p.numel() for p in model.parameters()))

    def adam_s() -> float:  # slowdowns_beside warms it once
        return median_seconds({"adam": adam.step}, repeats=iterations, warmup=0)["adam"]

    dtype = DTYPE_NAMES[precision]
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {HOST_CORE})
    try:
        rounds_run = slowdowns_beside(
            adam_s, ["compute", str(COMPUTE_CORE), str(tokens), dtype], rounds
        )
    finally:
        os.sched_setaffinity(0, affinity)
    return {"ratio": statistics.median(rounds_run.ratios), "ratios": rounds_run.ratios,
            "steal_s_alone": rounds_run.steal_alone_s, "steal_s_beside": rounds_run.steal_beside_s,
            "tokens": tokens, "precision": precision,
            "compute_load": f"the GPT's forward and backward ({precision}), looping, compute core"}  # fmt: skip


@functools.cache
def _text() -> torch.Tensor:
    """The training text as token ids (read once: every run and probe draws from it)."""
    return torch.tensor(list(stdlib_text(2_000_000)), dtype=torch.long)


def text_batches(tokens: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = _text()
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - tokens - 1, (count,), generator=generator).tolist()
    rows = [data[s : s + tokens + 1][None] for s in starts]
    return [(row[:, :-1], row[:, 1:]) for row in rows]


def gpt_config(tokens: int, n_layer: int = N_LAYER, n_embd: int = N_EMBD) -> GPTConfig:
    """The benchmark's GPT: byte vocabulary, ``n_layer`` blocks ``n_embd`` wide, heads
    HEAD_WIDTH wide."""
    return GPTConfig(vocab_size=256, block_size=tokens, n_layer=n_layer,
                     n_head=n_embd // HEAD_WIDTH, n_embd=n_embd)  # fmt: skip


def model_for(
    tokens: int, pretrain_steps: int = 0, n_layer: int = N_LAYER, n_embd: int = N_EMBD
) -> GPT:
    """The GPT, trained ``pretrain_steps`` steps first in plain PyTorch (past the first
    steps' large gradients, as a run that has settled: see the module note on clipping)."""
    torch.manual_seed(0)
    model = GPT(gpt_config(tokens, n_layer, n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for x, y in text_batches(tokens, pretrain_steps):
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def choose_precision(pinned: bool, path: str, steps: int, n_embd: int) -> dict[str, Any]:
    """bf16 where this CPU computes it at speed, else fp32 (the module's note on precision):
    forward and backward of the serial engine at CALIBRATION_TOKENS (the host update is the
    same work in both), ``steps`` steps after two, the precisions alternating so that a
    change in load hits both; the median of the paired ratios."""
    tokens, model = CALIBRATION_TOKENS, model_for(CALIBRATION_TOKENS, n_embd=n_embd)
    seconds: dict[str, list[float]] = {precision: [] for precision in PRECISIONS}
    engines = {}
    try:
        for precision in PRECISIONS:
            engines[precision] = build(model, False, 0.0, "host", f"{path}/{precision}", precision)
        for index, (x, y) in enumerate(text_batches(tokens, 2 + steps)):
            for precision in PRECISIONS if index % 2 else PRECISIONS[::-1]:
                sample = one_step(engines[precision], x, y, 1.0, pinned)
                if index >= 2:
                    seconds[precision].append(sample.forward_backward_s)
    finally:
        for engine in engines.values():
            engine.close()
    ratio = statistics.median(b / f for b, f in zip(seconds["bf16"], seconds["fp32"], strict=True))
    at_speed = ratio <= BF16_AT_SPEED_MAX_RATIO
    why = (
        None if at_speed
        else f"a bf16 forward and backward took {ratio:.1f}x an fp32 one here (at speed: at most "
        f"{BF16_AT_SPEED_MAX_RATIO:g}x): bf16 arithmetic is emulated on this CPU, so the runs "
        f"train in fp32"
    )  # fmt: skip
    return {"precision": "bf16" if at_speed else "fp32", "bf16_over_fp32": ratio,
            "forward_backward_s_samples": seconds, "why_precision": why}  # fmt: skip


def choose_tokens(
    pinned: bool, path: str, steps: int, precision: str, n_embd: int, sizes: Sequence[int]
) -> tuple[int, dict[int, float]]:
    """The most tokens per step of ``sizes`` at which the host update is still MIN_HOST_SHARE
    of the serial step (measured over ``steps`` steps after two), and the share at each."""
    shares: dict[int, float] = {}
    for tokens in sizes:
        engine = build(model_for(tokens, n_embd=n_embd), False, 0.0, "host", path, precision)
        samples = [
            one_step(engine, x, y, 1.0, pinned) for x, y in text_batches(tokens, 2 + steps)
        ][2:]  # fmt: skip
        engine.close()
        shares[tokens] = statistics.median(s.step_call_s for s in samples) / statistics.median(
            s.step_s for s in samples
        )
        if shares[tokens] < MIN_HOST_SHARE:
            break
    fitting = [t for t, share in shares.items() if share >= MIN_HOST_SHARE]
    return (max(fitting) if fitting else min(shares)), shares


def run_pair(model: GPT, tokens: int, steps: int, warmup: int, pinned: bool, clip: float,
             where: str, path: str, forced: bool, precision: str,
             chunk_size: int | str | None = None, nvme_block: int | None = None) -> dict:  # fmt: skip
    """Both engines, step by step in alternating order; per-step samples and bit-identity."""
    engines = {
        name: build(
            model, overlap, clip, where, f"{path}/{name}", precision, chunk_size, nvme_block
        )
        for name, overlap in (("serial", False), ("overlapped", True))
    }
    samples: dict[str, list[StepSample]] = {name: [] for name in engines}
    forced_steps: list[int] = []
    for index, (x, y) in enumerate(text_batches(tokens, warmup + steps)):
        scale = LOSS_SCALE if clip else 1.0
        if forced and index >= warmup and index % ROLLBACK_EVERY == 0:
            scale = 1e4  # clipping fires
        order = ("serial", "overlapped") if index % 2 else ("overlapped", "serial")
        for name in order:
            if pinned:
                keep_host_threads_on_host_core()
            sample = one_step(engines[name], x, y, scale, pinned and name == "serial")
            if index >= warmup:
                samples[name].append(sample)
        if index >= warmup and scale == 1e4:
            forced_steps.append(index - warmup)
    serial, overlapped = (engines[n].state_dict() for n in ("serial", "overlapped"))
    summary = engines["overlapped"].run_summary()
    result = {
        "update_hidden_fraction_dependency_bound": 1.0 - last_final_share(engines["serial"]),
        "samples": samples,
        "forced_steps": forced_steps,
        "identical": all(torch.equal(serial[k], overlapped[k]) for k in serial),
        "started_in_backward": engines["overlapped"].reducer.listener.started,
        "commits": summary.speculative_commits,
        "rollbacks": summary.speculative_rollbacks,
    }
    for engine in engines.values():
        engine.close()
    return result


OTHER_ROW_STORES = {"streamed": "cached", "cached": "streamed"}


def clipped_with_row_stores(kind: str, chosen: str, model: GPT, tokens: int, steps: int,
                            warmup: int, pinned: bool, nvme: str, precision: str) -> dict:  # fmt: skip
    """The clipped pair with the speculative updates' rows stored ``kind``, the other way than
    this machine chose (see the note on row stores): what the choice is worth here."""
    set_row_stores(kind)
    try:
        return run_pair(model, tokens, steps, warmup, pinned, CLIP, "host", nvme, True, precision)
    finally:
        set_row_stores(chosen)


def last_final_share(engine) -> float:
    """The share of the update that waits for backward's last operation: the chunk group
    holding the token embedding, whose gradient (tied to the head's) completes in the
    embedding's backward, at the very end. No overlap at chunk granularity hides it, so at
    most 1 minus this share of the update can be hidden (the model's structure and the chunk
    size decide it; no timing of the engine does)."""
    layouts = engine.manager.params.trainable_layouts()
    total = sum(slot.numel for layout in layouts for slot in layout.slots)
    last = next(
        layout for layout in layouts if any(slot.name == "wte.weight" for slot in layout.slots)
    )
    return sum(slot.numel for slot in last.slots) / total


def analyse(run: dict, clip: float) -> dict:
    """Hidden fraction and block ratios over the steps where clipping did not fire; the
    rollback ratio over the steps where it did."""
    pairs = list(zip(run["samples"]["overlapped"], run["samples"]["serial"], strict=True))
    clipped = [clip > 0 and s.grad_norm > clip for _o, s in pairs]
    kept = [pair for pair, fired in zip(pairs, clipped, strict=True) if not fired]
    fired = [pair for pair, did in zip(pairs, clipped, strict=True) if did]
    if not kept:
        return {"update_hidden_fraction": None, "steps_measured": 0, "steps_clipped": len(fired),
                "step_time_ratio": {"median": None}, "rollback_step_time_ratio": None,
                "median_step_s": None,
                "update_hidden_fraction_dependency_bound":
                    run["update_hidden_fraction_dependency_bound"]}  # fmt: skip
    t_over = statistics.median(o.step_s for o, _s in kept)
    t_serial = statistics.median(s.step_s for _o, s in kept)
    t_serial_fwd_bwd = statistics.median(s.forward_backward_s for _o, s in kept)
    t_over_fwd_bwd = statistics.median(o.forward_backward_s for o, _s in kept)
    steal = steal_per_step(kept)
    blocks = [kept[i : i + BLOCK] for i in range(0, len(kept) - BLOCK + 1, BLOCK)]
    ratios = [
        statistics.median(o.step_s for o, _s in b) / statistics.median(s.step_s for _o, s in b)
        for b in blocks
    ]
    return {
        "update_hidden_fraction": (t_serial - t_over) / (t_serial - t_serial_fwd_bwd),
        "host_update_share_of_serial_step": (t_serial - t_serial_fwd_bwd) / t_serial,
        "step_time_ratio": quartiles(ratios) if len(ratios) > 1 else {"median": t_over / t_serial},
        "median_step_s": {
            "overlapped": t_over,
            "serial": t_serial,
            "serial_forward_backward": t_serial_fwd_bwd,
            "serial_backward": statistics.median(s.backward_s for _o, s in kept),
            # Where the unhidden time is: forward and backward lengthened by the engine
            # thread's share of the early updates, and what ``step()`` still does.
            "overlapped_forward_backward": t_over_fwd_bwd,
            "overlapped_step_call": statistics.median(o.step_call_s for o, _s in kept),
        },  # fmt: skip
        "unhidden_s": unhidden(kept, steal),
        "host_thread": host_thread(kept),
        "hypervisor_steal_s_per_step": steal,
        "without_hypervisor_steal": without_steal(kept, steal),
        "steps_measured": len(kept),
        "steps_clipped": len(fired),
        "update_hidden_fraction_dependency_bound": run["update_hidden_fraction_dependency_bound"],
        "rollback_step_time_ratio": statistics.median(o.step_s for o, _s in fired)
        / statistics.median(s.step_s for _o, s in fired)
        if fired
        else None,
    }


REPEATED_KEYS = ("ratio", "update_hidden_fraction", "rollback_step_time_ratio")


def repeat_value(analysis: dict, key: str) -> float | None:
    """One repeat's value of ``key`` (``ratio``: its median step-time ratio)."""
    return analysis["step_time_ratio"]["median"] if key == "ratio" else analysis[key]


def over_repeats(analyses: list[dict], key: str) -> float | None:
    """The median of ``key`` over the repeats (None where no repeat has it)."""
    values = [v for v in (repeat_value(a, key) for a in analyses) if v is not None]
    return statistics.median(values) if values else None


def median_repeat(analyses: list[dict]) -> dict:
    """The repeat whose step-time ratio is the median (the lower middle one of an even count):
    its details stand for the run in the table and the JSON."""
    ordered = sorted(analyses, key=lambda a: a["step_time_ratio"]["median"])
    return ordered[(len(ordered) - 1) // 2]


def ablation_over_repeats(analyses: list[dict]) -> dict[str, float] | None:
    """Each ``without_hypervisor_steal`` value's median over the repeats (None where a repeat
    has none: steal not counted)."""
    ablations = [a.get("without_hypervisor_steal") for a in analyses]
    if not ablations or any(ablation is None for ablation in ablations):
        return None
    return {key: statistics.median(a[key] for a in ablations) for key in ablations[0]}


def host_bound(analysis: dict, host_interference: dict | None) -> float | None:
    """The most of the update an overlap can hide while the host core runs r-fold slower
    beside backward (see ``update_hidden_fraction_host_bound``): min(1, B / (r U))."""
    steps = analysis["median_step_s"]
    if host_interference is None or not steps:
        return None
    return min(1.0, steps["serial_backward"] / (host_interference["ratio"] * update_s(steps)))


def update_s(steps: dict[str, float]) -> float:
    """The serial update U of an analysis' median step times: the serial step less its
    forward and backward."""
    return steps["serial"] - steps["serial_forward_backward"]


def combined_bound(dependency: float, machine: float | None, host: float | None) -> float | None:
    """``update_hidden_fraction_bound``: min(D M, H) (the module's list of keys); None where
    the machine bound was not measured (a quick run, or not pinned)."""
    if machine is None:
        return None
    bound = dependency * machine
    return bound if host is None else min(bound, host)


def bound_at_steal(
    analysis: dict, machine: float | None, host_interference: dict | None
) -> dict[str, float] | None:
    """The most any overlap could have hidden in this repeat's hour, and the step-time ratio
    that allows: the combined bound (dependency, machine, host: :func:`combined_bound`) less
    the compute core's hypervisor steal in forward and backward beyond the serial engine's
    (``unhidden_s.engine_thread_waiting_hypervisor_steal``), as a share of the update (see the
    note on steal). None of it is the overlapped engine's own measure: the model's structure,
    plain torch beside a load, the serial engine's times, /proc/stat. The steal's window is the
    overlapped engine's forward and backward, on the assumption that any overlap keeps the host
    core busy through a backward as long as this one's, and so meets the steal it met (a mean
    over the steps: the counter moves in ticks). Where the serial engine met more, the bound
    rises, as the measured share does. None where a bound or the steal was not measured (a
    quick run, not pinned, no steal counter) or no step was kept (clipping fired on all)."""
    steps = analysis.get("median_step_s")
    if not steps:
        return None
    beyond = analysis["unhidden_s"]["engine_thread_waiting_hypervisor_steal"]
    bound = combined_bound(
        analysis["update_hidden_fraction_dependency_bound"],
        machine,
        host_bound(analysis, host_interference),
    )
    if beyond is None or bound is None:
        return None
    hidden = bound - beyond / update_s(steps)
    return {
        "update_hidden_fraction": hidden,
        "step_time_ratio": 1.0 - hidden * analysis["host_update_share_of_serial_step"],
    }


def bounds_at_steal_over_repeats(
    analyses: list[dict], machine: float | None, host_interference: dict | None
) -> dict[str, dict[str, Any]] | None:
    """:func:`bound_at_steal` of each repeat, and each key's median over the repeats on its
    own (the two medians may come from different repeats); None where a repeat has none."""
    bounds = [bound_at_steal(a, machine, host_interference) for a in analyses]
    measured = [bound for bound in bounds if bound is not None]
    if not bounds or len(measured) < len(bounds):
        return None
    return {
        key: {
            "repeats": [bound[key] for bound in measured],
            "median": statistics.median(bound[key] for bound in measured),
        }
        for key in ("update_hidden_fraction", "step_time_ratio")
    }


def unhidden(
    kept: list[tuple[StepSample, StepSample]], steal: dict[str, Any] | None
) -> dict[str, float | None]:
    """Where the overlapped step's unhidden time goes (medians over step pairs, seconds):
    the engine thread's Python starting early updates in backward; the rest of its extra CPU
    time in forward and backward (the same work slowed by the host core beside it: shared
    memory bandwidth and caches); the time it did not run (it waited: the GIL, a collective, an
    update it needs; or the hypervisor ran something else), and of that the hypervisor's steal
    on the compute core beyond the serial engine's (a difference of means: the counter moves in
    ticks; see the note on steal); and what ``step()`` still does (the last group's update,
    never hidden). ``steal``: the pairs' :func:`steal_per_step`."""
    return {
        "engine_thread_early_updates": statistics.median(o.listener_cpu_s for o, _s in kept),
        "compute_slowdown": statistics.median(
            (o.cpu_s - o.listener_cpu_s) - s.cpu_s for o, s in kept
        ),
        "engine_thread_waiting": statistics.median(
            (o.forward_backward_s - o.cpu_s) - (s.forward_backward_s - s.cpu_s) for o, s in kept
        ),
        "engine_thread_waiting_hypervisor_steal": None
        if steal is None
        else steal["overlapped"]["forward_backward"]["compute_core"]
        - steal["serial"]["forward_backward"]["compute_core"],
        "step_call": statistics.median(o.step_call_s for o, _s in kept),
    }


def host_thread(kept: list[tuple[StepSample, StepSample]]) -> dict[str, float] | None:
    """How the overlapped engine's host thread kept up (medians over step pairs): the share of
    backward it spent running early updates, and the seconds its runs lasted past backward's
    end. None where the runs were not timed."""
    timed = [
        (o.host_busy_in_backward_s / o.backward_s, o.host_after_backward_s)
        for o, _s in kept
        if o.host_busy_in_backward_s is not None and o.host_after_backward_s is not None
    ]
    if not timed:
        return None
    return {
        "busy_fraction_of_backward": statistics.median(busy for busy, _after in timed),
        "runs_after_backward_s": statistics.median(after for _busy, after in timed),
    }


def steal_per_step(kept: list[tuple[StepSample, StepSample]]) -> dict[str, Any] | None:
    """Each engine's mean hypervisor steal a step (seconds), by phase and core: how much of the
    steps the machine took (see the note on steal); None where it is not counted."""
    phases = {"forward_backward": "steal_forward_backward_s", "step_call": "steal_step_call_s"}
    per_engine = {}
    for name, position in (("overlapped", 0), ("serial", 1)):
        per_phase = {}
        for phase, field in phases.items():
            readings = [getattr(pair[position], field) for pair in kept]
            if any(reading is None for reading in readings):
                return None
            per_phase[phase] = {
                core: statistics.mean(reading[index] for reading in readings)
                for index, core in enumerate(("compute_core", "host_core"))
            }
        per_engine[name] = per_phase
    return per_engine


def without_steal(
    kept: list[tuple[StepSample, StepSample]], steal: dict[str, Any] | None
) -> dict[str, float] | None:
    """The ablation without the machine's disadvantage (see the note on steal): the hidden
    fraction and step-time ratio from median step times less the mean steal on the core the
    engine thread ran on: the compute core in forward and backward (both engines), the host
    core in the serial ``step()``. Nothing is taken off the overlapped ``step()`` nor the host
    thread's steal in backward (both can delay the overlapped step), so the ablation leans
    toward the serial engine. ``steal``: the pairs' :func:`steal_per_step`; None where steal is
    not counted (then this is None too)."""
    if steal is None:
        return None
    serial, overlapped = steal["serial"], steal["overlapped"]
    serial_fwd_bwd = (
        statistics.median(s.forward_backward_s for _o, s in kept)
        - serial["forward_backward"]["compute_core"]
    )
    serial_step = statistics.median(s.step_s for _o, s in kept) - (
        serial["forward_backward"]["compute_core"] + serial["step_call"]["host_core"]
    )
    overlapped_step = (
        statistics.median(o.step_s for o, _s in kept)
        - overlapped["forward_backward"]["compute_core"]
    )
    return {
        "update_hidden_fraction": (serial_step - overlapped_step) / (serial_step - serial_fwd_bwd),
        "step_time_ratio": overlapped_step / serial_step,
    }


def clipped_fraction(steps: int, clip: float) -> float:
    """How often clipping fires over ``chunkmem train``'s demo run (its grad norms)."""
    with tempfile.TemporaryDirectory() as out:
        command = python_command("-m", "chunkmem", "train", "--out", out, "--set",
                                 f"train.steps={steps}", "--set", f"gradient_clipping={clip}")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
        lines = Path(out, "metrics.jsonl").read_text().splitlines()
        norms = [json.loads(line)["grad_norm"] for line in lines]
    return sum(norm > clip for norm in norms) / len(norms)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("offload_overlap", __doc__.splitlines()[0], argv)
    # The NVMe runs read and write every state each step (about 0.6 s a step here): fewer.
    steps, warmup, demo_steps = (6, 2, 10) if args.quick else (96, 8, 300)
    nvme_steps, nvme_warmup = (1, 1) if args.quick else (48, warmup)
    share_steps = 1 if args.quick else 4
    repeats = 1 if args.quick else REPEATS
    pretrain_steps = 4 if args.quick else 80
    # Each interference round starts a load process (torch's import, a model): a quick run
    # has no minute left for them, and reports the two bounds they give as null.
    probe_rounds = 0 if args.quick else 5
    # A quick run's engines are narrower: at N_EMBD their builds and closes alone (10 engines
    # of 100M parameters) take most of its minute. Its keys are only indicative.
    width = NARROWER_N_EMBD if args.quick else N_EMBD
    pinned = len(os.sched_getaffinity(0)) >= 2
    torch.set_num_threads(1)
    if pinned:
        os.sched_setaffinity(0, {COMPUTE_CORE})
    with tempfile.TemporaryDirectory() as nvme:
        calibration = choose_precision(pinned, nvme, share_steps, width)
        precision = calibration["precision"]
        tokens, shares = choose_tokens(
            pinned, nvme, share_steps, precision, width, QUICK_TOKENS if args.quick else TOKENS
        )
        model = model_for(tokens, pretrain_steps, n_embd=width)
        # Plain and clipped pairs alternate, each repeat on fresh engines: the keys are the
        # medians over the repeats (a run's own ratio is the median over its blocks).
        repeated: dict[str, list[dict]] = {"plain": [], "clipped": []}
        for _ in range(repeats):
            repeated["plain"].append(
                run_pair(model, tokens, steps, warmup, pinned, 0.0, "host", nvme, False, precision)
            )
            repeated["clipped"].append(
                run_pair(model, tokens, steps, warmup, pinned, CLIP, "host", nvme, True, precision)
            )
        runs = {
            "nvme": run_pair(
                model, tokens, nvme_steps, nvme_warmup, pinned, CLIP, "nvme", nvme, False,
                precision,
            ),
        }  # fmt: skip
        probing = pinned and probe_rounds > 0
        interference = (
            compute_slowdown_beside_host_load(model, tokens, precision, probe_rounds, 6)
            if probing
            else None
        )
        host_interference = (
            host_slowdown_beside_compute(model, tokens, precision, probe_rounds, 10)
            if probing
            else None
        )
        row_store_choice = row_stores()  # made by the first runs' speculative updates
        if not args.quick:  # the ablations (see the notes on chunks, depth, NVMe, row stores)
            if row_store_choice.chosen is not None:
                runs["clipped_other_row_stores"] = clipped_with_row_stores(
                    OTHER_ROW_STORES[row_store_choice.chosen], row_store_choice.chosen,
                    model, tokens, steps, warmup, pinned, nvme, precision,
                )  # fmt: skip
            runs["nvme_small_blocks"] = run_pair(
                model, tokens, NVME_SMALL_BLOCK_STEPS, nvme_warmup, pinned, CLIP, "nvme", nvme,
                False, precision, nvme_block=NVME_SMALL_BLOCK,
            )  # fmt: skip
            runs["plain_auto_chunks"] = run_pair(
                model, tokens, steps, warmup, pinned, 0.0, "host", nvme, False, precision, "auto"
            )
            shapes = {
                "deeper": model_for(tokens, pretrain_steps, DEEPER_N_LAYER),
                "narrower": model_for(tokens, pretrain_steps, n_embd=NARROWER_N_EMBD),
            }
            for shape, shaped in shapes.items():
                for name, clip in ((f"plain_{shape}", 0.0), (f"clipped_{shape}", CLIP)):
                    runs[name] = run_pair(
                        shaped, tokens, steps, warmup, pinned, clip, "host", nvme, bool(clip),
                        precision,
                    )  # fmt: skip
    plain_repeats = [analyse(run, 0.0) for run in repeated["plain"]]
    clipped_repeats = [analyse(run, CLIP) for run in repeated["clipped"]]
    plain = median_repeat(plain_repeats)
    clipped = median_repeat(clipped_repeats)
    on_nvme = analyse(runs["nvme"], CLIP)
    small_blocks = analyse(runs["nvme_small_blocks"], CLIP) if "nvme_small_blocks" in runs else None
    auto_chunks = analyse(runs["plain_auto_chunks"], 0.0) if "plain_auto_chunks" in runs else None
    other_rows = (
        analyse(runs["clipped_other_row_stores"], CLIP)
        if "clipped_other_row_stores" in runs
        else None
    )
    deeper_runs, narrower_runs = (
        {
            name: analyse(runs[f"{name}_{shape}"], clip)
            for name, clip in (("plain", 0.0), ("clipped", CLIP))
            if f"{name}_{shape}" in runs
        }
        for shape in ("deeper", "narrower")
    )
    clipped_run = repeated["clipped"][clipped_repeats.index(clipped)]
    demo_clips = (1.0,) if args.quick else (1.0, 0.5)  # 0.5 is reported beside the key
    demo = {clip: clipped_fraction(demo_steps, clip) for clip in demo_clips}
    identical = all(
        run["identical"] for run in [*runs.values(), *repeated["plain"], *repeated["clipped"]]
    )
    metrics = {
        "update_hidden_fraction": over_repeats(plain_repeats, "update_hidden_fraction"),
        "update_hidden_fraction_clipped": over_repeats(clipped_repeats, "update_hidden_fraction"),
        "step_time_ratio_overlapped_vs_serial_clipped": over_repeats(clipped_repeats, "ratio"),
        "rollback_step_time_ratio_vs_serial": over_repeats(
            clipped_repeats, "rollback_step_time_ratio"
        ),
        "nvme_update_hidden_fraction_clipped": on_nvme["update_hidden_fraction"],
        "clipped_step_fraction": demo[1.0],
        "step_time_ratio_overlapped_vs_serial": over_repeats(plain_repeats, "ratio"),
        "update_hidden_fraction_machine_bound": (
            1.0 / interference["ratio"] if interference is not None else None
        ),
        "update_hidden_fraction_host_bound": host_bound(plain, host_interference),
        "update_hidden_fraction_dependency_bound": plain["update_hidden_fraction_dependency_bound"],
    }
    metrics["update_hidden_fraction_bound"] = combined_bound(
        metrics["update_hidden_fraction_dependency_bound"],
        metrics["update_hidden_fraction_machine_bound"],
        metrics["update_hidden_fraction_host_bound"],
    )
    at_steal = {
        name: bounds_at_steal_over_repeats(
            analyses, metrics["update_hidden_fraction_machine_bound"], host_interference
        )
        for name, analyses in (("plain", plain_repeats), ("clipped", clipped_repeats))
    }
    print(
        f"GPT {N_LAYER}x{width}, {precision}, {block_elements(model):,} elements a chunk (a block), {tokens} tokens per step (host update {shares[tokens]:.0%} of the "
        f"serial step; shares measured: {', '.join(f'{t}: {s:.2f}' for t, s in shares.items())})"
        + ("" if pinned else "; NOT pinned (fewer than 2 cores): the ratios are not meaningful")
        + (f"\n{calibration['why_precision']}" if calibration["why_precision"] else "")
    )
    print_table(
        "overlapped vs serial (median step ms over the steps where clipping did not fire)",
        [
            "run",
            "serial",
            "serial fwd+bwd",
            "overlapped",
            "hidden",
            "of at most",
            "ratio",
            "clipped",
        ],
        [
            [
                name,
                *(
                    1e3 * r["median_step_s"][k] if r["median_step_s"] else "-"
                    for k in ("serial", "serial_forward_backward", "overlapped")
                ),
                r["update_hidden_fraction"],
                r["update_hidden_fraction_dependency_bound"],
                r["step_time_ratio"]["median"],
                r["steps_clipped"],
            ]
            for name, r in (
                ("plain", plain),
                ("clip 1.0", clipped),
                ("clip 1.0, NVMe", on_nvme),
                *(
                    ((f"clip 1.0, NVMe, {NVME_SMALL_BLOCK >> 10} KiB blocks", small_blocks),)
                    if small_blocks
                    else ()
                ),
                *((("plain, auto chunks", auto_chunks),) if auto_chunks else ()),
                *(
                    ((f"clip 1.0, rows {OTHER_ROW_STORES[row_store_choice.chosen]}", other_rows),)
                    if other_rows and row_store_choice.chosen
                    else ()
                ),
                *((f"{name}, {DEEPER_N_LAYER} layers", r) for name, r in deeper_runs.items()),
                *((f"{name}, {NARROWER_N_EMBD} wide", r) for name, r in narrower_runs.items()),
            )
        ],  # fmt: skip
    )
    kept_up = {name: r["host_thread"] for name, r in (("plain", plain), ("clip 1.0", clipped))
               if r.get("host_thread")}  # fmt: skip
    if kept_up:
        print(
            "\nthe host thread (medians): "
            + "; ".join(
                f"{name} busy {split['busy_fraction_of_backward']:.0%} of backward, its runs "
                f"{1e3 * split['runs_after_backward_s']:.1f} ms past backward's end"
                for name, split in kept_up.items()
            )
        )
    steal = clipped["hypervisor_steal_s_per_step"]
    if steal is not None:
        ms = {name: {phase: {core: 1e3 * seconds for core, seconds in cores.items()}
                     for phase, cores in phases.items()}
              for name, phases in steal.items()}  # fmt: skip
        print(
            "\nhypervisor steal a step (clip 1.0, means; /proc/stat), compute core / host core: "
            + "; ".join(
                f"{name} forward+backward {ms[name]['forward_backward']['compute_core']:.1f} / "
                f"{ms[name]['forward_backward']['host_core']:.1f} ms, step() "
                f"{ms[name]['step_call']['compute_core']:.1f} / "
                f"{ms[name]['step_call']['host_core']:.1f} ms"
                for name in ("overlapped", "serial")
            )
        )
    without = {
        name: ablation_over_repeats(analyses)
        for name, analyses in (("plain", plain_repeats), ("clipped", clipped_repeats))
    }
    if without["plain"] is not None and without["clipped"] is not None:
        print(
            "the ablation without that steal (medians over the repeats; it leans toward the serial "
            "engine): hidden "
            f"{without['plain']['update_hidden_fraction']:.2f} plain, "
            f"{without['clipped']['update_hidden_fraction']:.2f} clipped; step-time ratio "
            f"{without['plain']['step_time_ratio']:.3f} plain, "
            f"{without['clipped']['step_time_ratio']:.3f} clipped"
        )
    if not probing:
        print("\nno interference probes (a quick run, or not pinned): the machine and host bounds "
              "are null")  # fmt: skip
    if interference is not None:
        print(
            f"\nthe compute core's forward and backward beside a busy host core: "
            f"{interference['ratio']:.2f}x alone (a GPU does not slow down so): no overlap "
            f"can hide more than {1.0 / interference['ratio']:.2f} of the update here"
            + probe_steal(interference)
        )
    if host_interference is not None:
        print(
            f"the host core's Adam beside a busy compute core: {host_interference['ratio']:.2f}x "
            f"alone (a GPU's host does not slow down so): no overlap can hide more than "
            f"{metrics['update_hidden_fraction_host_bound']:.2f} of the update here (plain)"
        )
    bound = metrics["update_hidden_fraction_bound"]
    share = plain.get("host_update_share_of_serial_step")
    ratio_bound = None if bound is None or share is None else 1.0 - share * bound
    if ratio_bound is not None:
        print(
            f"with the dependency bound {metrics['update_hidden_fraction_dependency_bound']:.3f}: "
            f"no overlap can hide more than {bound:.2f} of the update here, nor bring the step "
            f"under {ratio_bound:.3f} of the serial one (host update {share:.2f} of it, plain)"
        )
    if at_steal["plain"] is not None and at_steal["clipped"] is not None:
        print(
            "with the compute core's steal beyond the serial engine's (the hour's: see the note "
            "on steal), no overlap could have hidden more than "
            + " / ".join(
                f"{at_steal[name]['update_hidden_fraction']['median']:.2f}" for name in at_steal
            )
            + " of the update (plain / clipped), nor brought the step under "
            + " / ".join(f"{at_steal[name]['step_time_ratio']['median']:.3f}" for name in at_steal)
            + " of the serial one (each the median over the repeats on its own)"
        )
    print(f"\n{json.dumps(metrics, indent=1)}\nbit-identical: {identical}")
    details = {
        "precision": calibration,
        "tokens_per_step": tokens,
        "host_update_share_by_tokens": shares,
        "min_host_share": MIN_HOST_SHARE,
        "step_time_ratio_bound": ratio_bound,
        "plain": plain,
        "clipped": clipped,
        "repeats": {
            name: {key: [repeat_value(r, key) for r in repeats_of] for key in REPEATED_KEYS}
            for name, repeats_of in (("plain", plain_repeats), ("clipped", clipped_repeats))
        },  # fmt: skip
        "without_hypervisor_steal": without,
        "bounds_at_the_hours_steal": at_steal,
        "nvme_clipped": on_nvme,
        "nvme_block_bytes": NvmeConfig.model_fields["block_size"].default,
        "nvme_clipped_small_blocks": (
            {"block_bytes": NVME_SMALL_BLOCK, **small_blocks} if small_blocks else None
        ),
        "chunk_size_elements": block_elements(model),
        "plain_auto_chunks": auto_chunks,
        "row_stores": {
            **row_store_choice.as_json(),
            "clipped_with_the_other_kind": other_rows,
        },
        "n_layer": N_LAYER,
        "n_embd": width,
        "deeper_model": {"n_layer": DEEPER_N_LAYER, **deeper_runs} if deeper_runs else None,
        "narrower_model": {"n_embd": NARROWER_N_EMBD, **narrower_runs} if narrower_runs else None,
        "speculation": {
            k: clipped_run[k]
            for k in ("commits", "rollbacks", "started_in_backward", "forced_steps")
        },  # fmt: skip
        "clipped_step_fraction_demo": {str(k): v for k, v in demo.items()},
        "demo_steps": demo_steps,
        "rollback_every": ROLLBACK_EVERY,
        "clipped_runs_loss_scale": LOSS_SCALE,
        "emulation": {
            "pinned": pinned,
            "compute_core": COMPUTE_CORE,
            "host_core": HOST_CORE,
            "torch_threads": 1,
            "optimizer_threads": 1,
            "compute_slowdown_beside_host_load": interference,
            "host_slowdown_beside_compute": host_interference,
            "update_hidden_fraction_host_bound_clipped": host_bound(clipped, host_interference),
        },  # fmt: skip
        "parameters_bit_identical": identical,
    }
    write_results(args.json, metrics, details, args.quick)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
