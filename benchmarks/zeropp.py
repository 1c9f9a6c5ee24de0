"""ZeRO++ against plain stage 3 on 4 ranks as 2 nodes x 2: cross-node bytes, step time on an
emulated cluster in a stated regime, and convergence.

0. **Calibration.** One process, one thread, this run: how long a rank takes to start, to build
   its engine and to train one step of each model and precision the launches run. Every
   deadline derives from these and from the steps the ranks report, none from constants.
1. **Bytes and compute-only step time.** The same GPT trains with plain stage 3, each technique
   alone (qwZ, hpZ, qgZ), all three, and all three with qwZ over one ring on the world (the
   ablation of qwZ's two-level gather, zero/quantized_gather.py), in one launch of 4 ranks on
   this machine's loopback.
   Cross-node bytes per step come from the communication ledger, all ranks together.
2. **The emulated cluster.** Two network namespaces, each one "node" of 2 ranks, joined by a
   veth pair whose two ends are rate-limited with ``tc`` (tbf). Addresses exist only inside
   the namespaces; gloo binds to the veth (``GLOO_SOCKET_IFNAME``), so traffic between ranks of
   one node never leaves its namespace and traffic between nodes crosses the limited link.
   First at the *stated regime*: the rate at which plain stage 3's cross-node bytes take
   ``link_over_compute`` (2) times its compute-only step, so that stage 3 is bound by the link
   on any CPU and the speedup measures ZeRO++ and not the CPU; then at 1 and 10 Gbit/s. The
   benchmark creates and removes the namespaces itself, on every exit path; without root,
   ``ip`` or ``tc`` it says so.
3. **Convergence.** A GPT on Python's own standard library text, 300 steps in fp32 and bf16,
   plain stage 3 against full ZeRO++ and a control: final loss (mean of the last 20 steps,
   over ranks) and the largest loss after step 50 relative to the running minimum. Where the
   calibration finds bf16 more than 2x slower than fp32 (emulated: no AVX-512 BF16 or AMX, a
   bf16 step there takes ~10x an fp32 one), bf16 runs the whole tens of steps that fit the
   benchmark's 23-minute budget, predicted from the fp32 phase's measured step and the
   calibrated bf16 compute; ``details.convergence.bf16`` states the steps and why.

Each phase writes the results file as it completes, so a later failure keeps what was
measured; a phase that fails or cannot run says why (``details.phases``) and the exit status
is 1. Step times are medians over the measured steps of each round, timed between barriers on
rank 0; configurations alternate within a round and rounds repeat, so drifting load hits all
alike. Speedups and ``link_penalty_removed_fraction`` are formed per round and reported as
the median and range over rounds.

    python -m benchmarks.zeropp            # writes benchmarks/results/zeropp.json
    python -m benchmarks.zeropp --quick    # under a minute, results/zeropp.quick.json
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, median, parse_args, print_table, write_results
from benchmarks._timing import paired_ratios

WORLD, PER_NODE = 4, 2
REPO = Path(__file__).resolve().parent.parent
CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz_partition_size": 2},
    "qgz": {"quantized_gradients": True},
    "zeropp": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True},
    # The ablation of the two-level weight gather: ZeRO++ with qwZ over one ring on the world.
    "zeropp_one_ring": {"quantized_weights": True, "hpz_partition_size": 2,
                        "quantized_gradients": True, "quantized_weights_two_level": False},
}  # fmt: skip
# A GPT whose parameters outweigh its compute per step (8 tokens per rank), the regime ZeRO++
# is for: communication-bound data parallelism over a slow network (docs/zeropp.md).
FULL = {
    "model": {"vocab_size": 8192, "block_size": 8, "n_layer": 4, "n_embd": 512, "n_head": 8},
    "local_batch": 1, "warmup": 2, "steps": 4, "rounds": 3,
    "link_over_compute": 2.0, "regime_configs": list(CONFIGS),
    "rates": ["1gbit", "10gbit"], "rate_configs": ["zero3", "zeropp"],
    "converge": {"steps": 300, "precisions": ["fp32", "bf16"], "local_batch": 8, "seq": 64,
                 "lr": 1e-3, "bf16_at_speed_max_ratio": 2.0, "bf16_min_steps": 40,
                 "benchmark_budget_s": 1380,
                 "model": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_embd": 128,
                           "n_head": 2}},
}  # fmt: skip
QUICK = {
    "model": {"vocab_size": 2048, "block_size": 32, "n_layer": 2, "n_embd": 256, "n_head": 4},
    "local_batch": 1, "warmup": 2, "steps": 2, "rounds": 1,
    "link_over_compute": 2.0, "regime_configs": ["zero3", "zeropp"],
    "rates": [], "rate_configs": [],
    "converge": None,
}  # fmt: skip
# A launch fails when rank 0 reports no step for SLACK times the longest gap between its
# reports so far (its start included), or before its first report, SLACK times the first step
# the calibration predicts: room for a busy machine, never for a hang.
SLACK = 4.0
# Plain stage 3 from initial weights changed by about 1e-6 relative: how far two runs that
# differ by far less than any quantization drift apart (the convergence benchmark's control).
CONTROL = "zero3_nudged"
CONVERGENCE_CONFIGS = ("zero3", "zeropp", CONTROL)
OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


# ---------------------------------------------------------------- one rank
def _worker(spec_path: str) -> None:
    """One rank of a launch: every configuration of the spec in turn, then its results.
    Rank 0 appends a line to ``progress`` after every step, which the launcher's watchdog
    reads."""
    import torch
    import torch.distributed as dist

    from chunkmem.models.gpt import GPT, GPTConfig

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)  # four ranks share the machine's cores
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    model_config = GPTConfig(**spec["model"], bias=False)
    parameters = sum(p.numel() for p in GPT(model_config).parameters())
    results: dict[str, Any] = {}
    if spec["mode"] == "steps":
        batches = _random_batches(spec, model_config, rank)
    else:
        batches = _text_batches(spec, rank)
    progress = Path(spec["out"]) / "progress"
    for round_ in range(spec["rounds"]):
        for name in spec["configs"]:
            torch.manual_seed(0)
            model = GPT(model_config)
            if name == CONTROL:
                _nudge(model)
            engine = _engine(model, spec["precision"], spec["lr"], name)
            ledger = engine.states.sharding.comm.ledger
            times, losses, cross, phases = [], [], [], {}
            for step in range(spec["warmup"] + spec["steps"]):
                x, y = batches(step)
                dist.barrier()
                started = time.perf_counter()
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                dist.barrier()
                elapsed = time.perf_counter() - started
                if rank == 0:
                    with progress.open("a") as f:
                        f.write(f"{name} round {round_} step {step} {elapsed:.4f} s\n")
                losses.append(float(loss.detach()))
                if step >= spec["warmup"]:
                    times.append(elapsed)
                    cross.append({op: ledger.cross_node_bytes(op=op, tag=step) for op in OPS})
                    phases = {
                        f"{op}/{phase}": row for (op, phase), row in ledger.by_phase(step).items()
                    }
            engine.close()
            entry = results.setdefault(name, {"rounds": []})
            entry["rounds"].append({"step_s": times, "cross_node_bytes": cross, "losses": losses})
            entry["phases"] = phases
            entry["parameters"] = parameters
            entry["capacities"] = [layout.capacity for layout in engine.params.trainable_layouts()]
    out = Path(spec["out"]) / f"rank{rank}.json"
    out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _engine(model, precision: str, lr: float, name: str | None):
    """The engine every launch and the calibration train: stage 3 over 2 nodes x 2 with the
    configuration ``name``'s ZeRO++ settings, or one process without ZeRO (``name`` None)."""
    import chunkmem

    config: dict[str, Any] = {
        "precision": precision,
        "device": {"type": "simulated", "capacity": "8GiB"},
        "optimizer": {"lr": lr, "weight_decay": 0.1},
        "gradient_clipping": 1.0,
    }
    if name is not None:
        config["zero"] = {"stage": 3, "timeout_s": 600, "node_size": PER_NODE,
                          **CONFIGS[name if name != CONTROL else "zero3"]}  # fmt: skip
    return chunkmem.initialize(model, config=config)


def _nudge(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 1e-6 * torch.randn(param.shape, generator=generator))


def _random_batches(spec: dict, config, rank: int):
    import torch

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 + step)
        rows = torch.randint(
            0, config.vocab_size, (WORLD * spec["local_batch"], config.block_size + 1), generator=g
        )
        rows = rows[rank * spec["local_batch"] : (rank + 1) * spec["local_batch"]]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    return batch


def _text_batches(spec: dict, rank: int):
    """Each rank's slice of a global batch of the stdlib text (chunkmem train's loader)."""
    import torch

    from chunkmem.cli.data import stdlib_text

    data = torch.tensor(list(stdlib_text(4_000_000)), dtype=torch.long)
    seq, local = spec["seq"], spec["local_batch"]

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - seq - 1, (WORLD * local,), generator=g)
        mine = starts[rank * local : (rank + 1) * local].tolist()
        rows = torch.stack([data[s : s + seq + 1] for s in mine])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    return batch


# ---------------------------------------------------------------- calibration
@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def startup_seconds() -> float:
    """Wall time of a fresh interpreter importing what a rank imports before its first step."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import benchmarks._common, chunkmem.models.gpt"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
    )  # fmt: skip
    return time.perf_counter() - started


def engine_step_seconds(
    model: dict, precisions: Sequence[str], batch: int, seq: int, repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Per precision: seconds to build one process's engine of ``model`` and ``repeats``
    training steps on ``batch`` x ``seq`` tokens (their median and each), one thread, as a
    rank runs. The precisions' steps alternate, so a change in load hits them alike and a
    round's steps can be compared pairwise."""
    import torch

    from benchmarks._timing import sample_seconds
    from chunkmem.models.gpt import GPT, GPTConfig

    builds, steps, engines = {}, {}, []
    with _torch_threads(1):
        x = torch.randint(0, model["vocab_size"], (batch, seq + 1))
        for precision in precisions:
            torch.manual_seed(0)
            started = time.perf_counter()
            engine = _engine(GPT(GPTConfig(**model, bias=False)), precision, 1e-3, None)
            builds[precision] = time.perf_counter() - started
            engines.append(engine)

            def step(engine=engine) -> None:
                engine.backward(engine(x[:, :-1], x[:, 1:]))
                engine.step()

            steps[precision] = step
        samples = sample_seconds(steps, repeats=repeats, warmup=1, alternate=True)
    for engine in engines:
        engine.close()
    return {
        p: {"build_s": builds[p], "step_s": median(samples[p]), "step_s_samples": samples[p]}
        for p in precisions
    }


def calibrate(setup: dict) -> dict[str, Any]:
    """What the deadlines and the bf16 decision derive from, measured in this run."""
    out: dict[str, Any] = {"startup_s": startup_seconds()}
    model = setup["model"]
    out["steps_bf16"] = engine_step_seconds(
        model, ["bf16"], setup["local_batch"], model["block_size"]
    )["bf16"]
    converge = setup["converge"]
    if converge:
        times = engine_step_seconds(
            converge["model"], ["fp32", "bf16"], converge["local_batch"], converge["seq"]
        )
        out["converge"] = times
        out["converge_bf16_over_fp32"] = median(
            paired_ratios(times["bf16"]["step_s_samples"], times["fp32"]["step_s_samples"])
        )
    return out


def first_report_seconds(startup_s: float, build_s: float, step_s: float, link_s: float) -> float:
    """How long a launch may take to its first reported step: SLACK times 4 ranks starting,
    building and stepping on the cores they share, plus one step's transfer on the link."""
    return SLACK * (WORLD * (startup_s + build_s + step_s) + link_s)


def bf16_steps(
    bf16_over_fp32: float, steps: int, max_ratio: float, affordable_steps: int, min_steps: int
) -> tuple[int, str | None]:
    """How many steps bf16 convergence runs, and why it was shortened (None: not shortened).
    Where bf16 trains more than ``max_ratio`` times slower than fp32 in this run's calibration
    (bf16 emulated: no AVX-512 BF16 or AMX), it runs the steps the time left affords (whole
    tens, at most ``steps``); fewer than ``min_steps`` would say nothing and raise Skipped."""
    if bf16_over_fp32 <= max_ratio:
        return steps, None
    why = (
        f"a bf16 step took {bf16_over_fp32:.1f}x an fp32 step in this run's calibration (at "
        f"speed: at most {max_ratio:g}x): bf16 arithmetic is emulated on this CPU"
    )
    shortened = min(steps, affordable_steps // 10 * 10)
    if shortened < min_steps:
        raise Skipped(f"{why}, and the time left affords {affordable_steps} steps "
                      f"(fewer than {min_steps})")  # fmt: skip
    return shortened, f"{why}; {shortened} steps are what the time left affords"


def affordable_bf16_steps(
    budget_left_s: float, fp32_step_s: float, compute_growth_s: float, configs: int
) -> int:
    """Steps of bf16 convergence that fit ``budget_left_s``: each takes what an fp32 step of
    the fp32 phase took (this run, all configurations, communication included) plus what bf16
    adds to the compute of every configuration's ranks on the cores they share."""
    ranks_per_core = max(1.0, WORLD / (os.cpu_count() or 1))
    per_step = fp32_step_s + configs * ranks_per_core * compute_growth_s
    return max(0, math.floor(budget_left_s / per_step))


# ---------------------------------------------------------------- the emulated cluster
class Cluster:
    """Two network namespaces joined by a rate-limited veth pair; removed on every exit path
    (``close`` runs from ``with``, from ``atexit`` and from SIGTERM/SIGINT)."""

    SUBNET = "10.77.{}.{}"

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.namespaces = [f"cmzpp{tag}n0", f"cmzpp{tag}n1"]
        self.links = [f"cmz{tag}a", f"cmz{tag}b"]
        self.addresses = [self.SUBNET.format(0, 1), self.SUBNET.format(0, 2)]
        self._created: list[str] = []
        self.rate: str | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "not root: network namespaces and tc need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"`{tool}` not found (apt-get install -y iproute2)"
        return None

    def __enter__(self) -> Cluster:
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
            a, b = self.links
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            for ns, link, address in zip(self.namespaces, self.links, self.addresses, strict=True):
                _run(["ip", "link", "set", link, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", link])
                _run(["ip", "-n", ns, "link", "set", link, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def limit(self, rate: str) -> None:
        """Rate-limit both directions of the link (tbf on each end's egress)."""
        bits = rate_bits(rate)
        burst = max(64 * 1024, int(bits / 8 * 0.002))  # 2 ms of traffic at the rate
        for ns, link in zip(self.namespaces, self.links, strict=True):
            verb = "change" if self.rate else "add"
            _run(["tc", "-n", ns, "qdisc", verb, "dev", link, "root", "tbf", "rate", rate,
                  "burst", str(burst), "latency", "50ms"])  # fmt: skip
        self.rate = rate

    def _on_signal(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def close(self) -> None:
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``300mbit`` or ``4500kbit``."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale
    raise ValueError(f"rate {rate!r} is not a number followed by one of {', '.join(units)}")


def _run(command: Sequence[str]) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the stated regime
def round_down(value: float, digits: int = 2) -> float:
    """``value`` rounded down to ``digits`` significant digits (a rate no faster than asked)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return math.floor(value / scale + 1e-9) * scale


def stated_regime(
    cross_node_bytes_per_step: float, compute_s: float, link_over_compute: float
) -> dict[str, Any]:
    """The link rate at which plain stage 3's cross-node bytes take at least
    ``link_over_compute`` times its compute-only step (loopback) to cross the link.

    The bytes cross half in each direction (the rings and all-to-alls between the 2 nodes are
    symmetric) and each direction has the full rate, so the link time is half the bytes over
    the rate. The rate is rounded down to 2 significant digits, so the factor holds."""
    per_direction = cross_node_bytes_per_step / 2
    bits = round_down(per_direction * 8 / (link_over_compute * compute_s))
    link_s = per_direction * 8 / bits
    return {
        "rate": f"{round(bits / 1e3)}kbit",
        "rate_mbit_s": bits / 1e6,
        "zero3_compute_s": compute_s,
        "zero3_cross_node_bytes_per_direction": per_direction,
        "zero3_link_s": link_s,
        "zero3_link_over_compute": link_s / compute_s,
        "link_over_compute_asked": link_over_compute,
    }


def link_penalty_removed(
    zero3_link_s: float, config_link_s: float, zero3_loopback_s: float
) -> float | None:
    """The share of plain stage 3's link penalty (its step over the link less its
    compute-only step) that a configuration removes: 1 when it steps over the link as fast
    as stage 3 computes, 0 when as slow as stage 3 over the link. None without a penalty."""
    penalty = zero3_link_s - zero3_loopback_s
    if penalty <= 0:
        return None
    return (zero3_link_s - config_link_s) / penalty


def _spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": median(present), "range": [min(present), max(present)]}


# ---------------------------------------------------------------- launching ranks
@dataclass
class Watchdog:
    """When a launch has gone quiet for too long, from rank 0's step reports.

    Before the first report the launch may take ``first_report_s``; after it, SLACK times the
    longest gap between reports seen so far (the start included), so the limit follows the
    steps this run actually takes on this machine."""

    first_report_s: float
    started: float
    reports: int = 0
    last: float = field(init=False)
    longest_gap: float = 0.0

    def __post_init__(self) -> None:
        self.last = self.started

    def update(self, reports: int, now: float) -> None:
        if reports > self.reports:
            self.longest_gap = max(self.longest_gap, now - self.last)
            self.reports, self.last = reports, now

    def deadline(self) -> float:
        if self.reports == 0:
            return self.started + self.first_report_s
        return self.last + SLACK * self.longest_gap

    def why(self, now: float) -> str:
        if self.reports == 0:
            return (f"no step reported within {self.first_report_s:.0f} s of the launch "
                    f"(SLACK x the calibrated start and first step)")  # fmt: skip
        return (f"no step reported for {now - self.last:.0f} s after {self.reports} steps "
                f"(limit: {SLACK:g} x the longest gap so far, {self.longest_gap:.1f} s)")  # fmt: skip


class LaunchFailed(RuntimeError):
    """A launch's ranks did not all finish: the message says which and why."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _watch(processes: list[subprocess.Popen], out: Path, watchdog: Watchdog) -> None:
    """Wait for every rank to exit 0; raise LaunchFailed (with the rank's last output) when
    one exits otherwise or when the watchdog's deadline passes."""
    while True:
        for rank, process in enumerate(processes):
            code = process.poll()
            if code not in (None, 0):
                raise LaunchFailed(f"rank {rank} exited with code {code}; its last output:\n"
                                   f"{_tail(out / f'rank{rank}.log')}")  # fmt: skip
        if all(process.poll() == 0 for process in processes):
            return
        now = time.monotonic()
        watchdog.update(_count_lines(out / "progress"), now)
        if now > watchdog.deadline():
            last = _tail(out / "progress", 1) or "none"
            raise LaunchFailed(f"{watchdog.why(now)}; last step: {last}")
        time.sleep(0.2)


def launch(
    spec: dict, cluster: Cluster | None, first_report_s: float, module: str = "benchmarks.zeropp"
) -> dict[str, Any]:
    """Run ``spec`` on 4 ranks (in the cluster's namespaces if given), each ``python -m
    module --worker SPEC``; rank 0's results with every rank's cross-node bytes summed per
    step and losses averaged over ranks."""
    with tempfile.TemporaryDirectory(prefix="zeropp-") as directory:
        out = Path(directory)
        spec = {**spec, "out": directory}
        spec_path = out / "spec.json"
        spec_path.write_text(json.dumps(spec))
        port = 29500 + os.getpid() % 1000 if cluster else _free_port()
        processes = []
        try:
            for rank in range(WORLD):
                node = rank // PER_NODE
                env = {
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(WORLD),
                    "LOCAL_RANK": str(rank % PER_NODE),
                    "LOCAL_WORLD_SIZE": str(PER_NODE),
                    "MASTER_ADDR": cluster.addresses[0] if cluster else "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO),
                }
                command = [sys.executable, "-m", module, "--worker", str(spec_path)]
                if cluster:
                    env["GLOO_SOCKET_IFNAME"] = cluster.links[node]
                    command = ["ip", "netns", "exec", cluster.namespaces[node], *command]
                with (out / f"rank{rank}.log").open("w") as log:
                    processes.append(
                        subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log)
                    )
            _watch(processes, out, Watchdog(first_report_s, time.monotonic()))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return _combine(ranks)


def _combine(ranks: list[dict]) -> dict[str, Any]:
    results = ranks[0]
    for name, entry in results.items():
        for index, round_ in enumerate(entry["rounds"]):
            steps = zip(*(r[name]["rounds"][index]["cross_node_bytes"] for r in ranks), strict=True)
            round_["cross_node_bytes"] = [
                {op: sum(rank_step[op] for rank_step in step) for op in OPS} for step in steps
            ]
            round_["losses"] = [
                sum(per_rank) / WORLD
                for per_rank in zip(
                    *(r[name]["rounds"][index]["losses"] for r in ranks), strict=True
                )
            ]
    return results


def _step_spec(setup: dict, configs: list[str]) -> dict:
    return {
        "mode": "steps", "configs": configs, "model": setup["model"], "precision": "bf16",
        "lr": 1e-3, "local_batch": setup["local_batch"], "warmup": setup["warmup"],
        "steps": setup["steps"], "rounds": setup["rounds"],
    }  # fmt: skip


def _summary(name: str, entry: dict) -> dict:
    times = [t for round_ in entry["rounds"] for t in round_["step_s"]]
    steps = [step for round_ in entry["rounds"] for step in round_["cross_node_bytes"]]
    cross = [sum(step.values()) for step in steps]
    return {
        "step_s_median": median(times),
        "step_s_range": [min(times), max(times)],
        "round_step_s_medians": [median(round_["step_s"]) for round_ in entry["rounds"]],
        "cross_node_bytes_per_step": median(cross),
        "cross_node_bytes_range": [min(cross), max(cross)],
        "cross_node_bytes_by_op": {op: median([step[op] for step in steps]) for op in OPS},
        "cross_node_bytes_formula": formula(entry["capacities"], CONFIGS[name]),
        "parameters": entry["parameters"],
        "layout_capacities": entry["capacities"],
        "rank0_bytes_by_op_phase": entry["phases"],
    }


def formula(capacities: list[int], zero: dict, itemsize: int = 2, block: int = 256) -> dict:
    """Cross-node bytes per step, all ranks together, by docs/zeropp.md (2 nodes x 2, bf16,
    the default blocks): a ring on the world sends 3 of its 4 shards to the next rank, across
    nodes from 2 of the 4 ranks; qwZ in two levels sends 1 shard across nodes from each rank
    (zero/quantized_gather.py); qgZ's inter-node all-to-all sends half of each rank's node
    sums to the other node; hpZ's backward gathers stay inside the node. The step's two small
    all-reduces are measured, not modelled (``all_reduce``)."""
    from kernels.quantized import data_nbytes, num_groups
    from zero.wire import packed_nbytes

    gathers = reductions = 0
    for c in capacities:
        n = c // WORLD
        shard = packed_nbytes(n, 8, block) if zero.get("quantized_weights") else n * itemsize
        hpz = zero.get("hpz_partition_size", 1) > 1
        two_level = zero.get("quantized_weights") and zero.get("quantized_weights_two_level", True)
        gathers += (WORLD if two_level else 2 * 3) * shard * (1 if hpz else 2)
        if zero.get("quantized_gradients"):
            s = -(-n // block) * block
            reductions += WORLD * (data_nbytes(2 * s, 4) + 4 * num_groups(2 * s, block)) // 2
        else:
            reductions += 2 * 3 * n * itemsize
    return {"all_gather": gathers, "reduce_scatter_or_all_to_all": reductions}


def emulated_summary(results: dict, loopback: dict[str, dict]) -> dict[str, Any]:
    """One rate's step times against plain stage 3 in the same launch (per round: the ratio
    of the rounds' medians) and against the compute-only steps of the loopback launch."""
    configs = {name: _summary(name, entry) for name, entry in results.items()}
    zero3 = configs["zero3"]["round_step_s_medians"]
    zero3_loopback = loopback["zero3"]["step_s_median"]
    out: dict[str, Any] = {"configs": configs, "speedup_vs_zero3": {},
                           "link_penalty_removed_fraction": {}}  # fmt: skip
    for name, summary in configs.items():
        if name in loopback:
            summary["link_penalty_s"] = summary["step_s_median"] - loopback[name]["step_s_median"]
        if name == "zero3":
            continue
        ours = summary["round_step_s_medians"]
        out["speedup_vs_zero3"][name] = _spread([a / b for a, b in zip(zero3, ours, strict=True)])
        out["link_penalty_removed_fraction"][name] = _spread(
            [link_penalty_removed(a, b, zero3_loopback) for a, b in zip(zero3, ours, strict=True)]
        )
    out["zero3_link_penalty_s"] = configs["zero3"]["step_s_median"] - zero3_loopback
    out["zero3_link_penalty_over_compute"] = out["zero3_link_penalty_s"] / zero3_loopback
    return out


# ---------------------------------------------------------------- convergence
def convergence(setup: dict, precision: str, steps: int, first_report_s: float) -> dict:
    """Plain stage 3, full ZeRO++ and the control on the same batches; the final loss is the
    mean of the last 20 steps' losses (each the mean over ranks)."""
    names = CONVERGENCE_CONFIGS
    spec = {
        "mode": "converge", "configs": list(names), "model": setup["model"],
        "precision": precision, "lr": setup["lr"], "local_batch": setup["local_batch"],
        "seq": setup["seq"], "warmup": 0, "steps": steps, "rounds": 1,
    }  # fmt: skip
    results = launch(spec, None, first_report_s)
    curves = {name: results[name]["rounds"][0]["losses"] for name in names}
    final = {name: sum(c[-20:]) / len(c[-20:]) for name, c in curves.items()}
    return {
        "steps": steps,
        "final_loss": final,
        "final_loss_rel_diff": abs(final["zeropp"] - final["zero3"]) / final["zero3"],
        "final_loss_rel_change": (final["zeropp"] - final["zero3"]) / final["zero3"],
        "control_final_loss_rel_diff": abs(final[CONTROL] - final["zero3"]) / final["zero3"],
        "max_loss_over_running_min_after_50": {
            name: _spike(curve, after=50) for name, curve in curves.items()
        },
        "losses_every_10_steps": {name: c[::10] for name, c in curves.items()},
    }


def _spike(curve: list[float], after: int) -> float:
    lowest, worst = float("inf"), 0.0
    for step, loss in enumerate(curve):
        if step >= after:
            worst = max(worst, loss / lowest)
        lowest = min(lowest, loss)
    return worst


# ---------------------------------------------------------------- phases and the results file
class Skipped(Exception):
    """A phase that cannot run here (no root, or a phase it needs did not complete)."""


@dataclass
class Run:
    """The results file, rewritten after every phase, so that a failure later keeps what
    was measured; ``details.phases`` says how each phase ended and why."""

    path: Path
    quick: bool
    details: dict[str, Any]
    summarize: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # default: metrics

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run the body as phase ``name``: an exception ends the phase (failed, or skipped
        for Skipped) but not the benchmark; an interrupt is recorded, then re-raised."""
        record: dict[str, Any] = {"status": "running"}
        self.details["phases"][name] = record
        started = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            yield
            record["status"] = "done"
        except Skipped as why:
            record.update(status="skipped", reason=str(why))
        except Exception as error:
            record.update(status="failed", reason=f"{type(error).__name__}: {error}")
        except BaseException as error:
            record.update(status="interrupted", reason=f"{type(error).__name__}: {error}")
            raise
        finally:
            record["wall_s"] = round(time.perf_counter() - started, 1)
            reason = f": {record['reason']}" if "reason" in record else ""
            print(f"{name}: {record['status']} in {record['wall_s']:.0f} s{reason}", flush=True)
            summarize = self.summarize or metrics
            write_results(self.path, summarize(self.details), self.details, self.quick)

    def succeeded(self) -> bool:
        return all(phase["status"] == "done" for phase in self.details["phases"].values())


def _needs(details: dict[str, Any], key: str) -> Any:
    if details.get(key) is None:
        raise Skipped(f"needs the {key} phase, which did not complete")
    return details[key]


def _loopback_summary(results: dict[str, Any]) -> dict[str, Any]:
    summaries = {name: _summary(name, entry) for name, entry in results.items()}
    plain = summaries["zero3"]["cross_node_bytes_per_step"]
    for summary in summaries.values():
        summary["cross_node_bytes_ratio_vs_zero3"] = summary["cross_node_bytes_per_step"] / plain
    return summaries


def _step_deadline(details: dict[str, Any], link_s: float) -> float:
    calibration = _needs(details, "calibration")
    steps = calibration["steps_bf16"]
    return first_report_seconds(calibration["startup_s"], steps["build_s"], steps["step_s"], link_s)


def run_loopback(run: Run, setup: dict) -> None:
    with run.phase("loopback"):
        deadline = _step_deadline(run.details, 0.0)
        results = launch(_step_spec(setup, setup["regime_configs"]), None, deadline)
        run.details["loopback"] = _loopback_summary(results)


def run_emulated(run: Run, setup: dict) -> None:
    """The stated regime, then the fixed rates, each a phase, in one emulated cluster."""
    details = run.details
    details["emulated"] = {}
    plan = [("regime", setup["regime_configs"])]
    plan += [(rate, setup["rate_configs"]) for rate in setup["rates"]]
    with contextlib.ExitStack() as stack:
        cluster = None
        with run.phase("cluster"):
            why = Cluster.unavailable()
            if why:
                raise Skipped(why)
            cluster = stack.enter_context(Cluster())
        for label, configs in plan:
            with run.phase(f"emulated_{label}"):
                if cluster is None:
                    raise Skipped("no emulated cluster (phases.cluster says why)")
                loopback = _needs(details, "loopback")
                if label == "regime":
                    zero3 = loopback["zero3"]
                    details["regime"] = stated_regime(
                        zero3["cross_node_bytes_per_step"], zero3["step_s_median"],
                        setup["link_over_compute"],
                    )  # fmt: skip
                rate = _needs(details, "regime")["rate"] if label == "regime" else label
                cluster.limit(rate)
                per_direction = loopback["zero3"]["cross_node_bytes_per_step"] / 2
                deadline = _step_deadline(details, per_direction * 8 / rate_bits(rate))
                results = launch(_step_spec(setup, configs), cluster, deadline)
                details["emulated"][label] = {"rate": rate,
                                              **emulated_summary(results, loopback)}  # fmt: skip


def run_convergence(run: Run, setup: dict) -> None:
    """fp32 then bf16, each a phase; bf16 shortened where the calibration found it slow."""
    details = run.details
    details["convergence"] = {}
    for precision in setup["precisions"]:
        with run.phase(f"convergence_{precision}"):
            calibration = _needs(details, "calibration")
            steps, why = setup["steps"], None
            if precision == "bf16":
                steps, why = bf16_steps(
                    calibration["converge_bf16_over_fp32"], setup["steps"],
                    setup["bf16_at_speed_max_ratio"], _affordable_bf16_steps(run, setup),
                    setup["bf16_min_steps"],
                )  # fmt: skip
            times = calibration["converge"][precision]
            deadline = first_report_seconds(
                calibration["startup_s"], times["build_s"], times["step_s"], 0.0
            )
            result = convergence(setup, precision, steps, deadline)
            result["shortened_from_steps"] = setup["steps"] if why else None
            result["why_shortened"] = why
            details["convergence"][precision] = result


def _affordable_bf16_steps(run: Run, setup: dict) -> int:
    """The bf16 steps that fit ``benchmark_budget_s`` after the phases before this one."""
    phases = run.details["phases"]
    fp32 = phases.get("convergence_fp32", {})
    if fp32.get("status") != "done":
        raise Skipped("the bf16 step count derives from the fp32 convergence phase, which did "
                      "not complete")  # fmt: skip
    spent = sum(phase.get("wall_s", 0.0) for phase in phases.values())
    times = run.details["calibration"]["converge"]
    fp32_step_s = fp32["wall_s"] / run.details["convergence"]["fp32"]["steps"]
    return affordable_bf16_steps(
        setup["benchmark_budget_s"] - spent, fp32_step_s,
        times["bf16"]["step_s"] - times["fp32"]["step_s"], len(CONVERGENCE_CONFIGS),
    )  # fmt: skip


def metrics(details: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys, from whatever phases have completed (None for the others)."""
    loopback = details.get("loopback")
    emulated = details.get("emulated") or {}
    regime = emulated.get("regime")
    converge = details.get("convergence") or {}

    def median_of(label: str, key: str, name: str) -> float | None:
        spread = (emulated.get(label) or {}).get(key, {}).get(name)
        return spread["median"] if spread else None

    return {
        "cross_node_bytes_ratio_vs_zero3": loopback["zeropp"]["cross_node_bytes_ratio_vs_zero3"]
        if loopback else None,
        "final_loss_rel_diff_vs_zero3": max(c["final_loss_rel_diff"] for c in converge.values())
        if converge else None,
        "emulated_speedup_vs_zero3_at_stated_regime": median_of(
            "regime", "speedup_vs_zero3", "zeropp"
        ),
        **{
            f"link_penalty_removed_fraction_{name}": median_of(
                "regime", "link_penalty_removed_fraction", name
            )
            for name in CONFIGS if name != "zero3"
        },
        "stated_regime_rate_mbit_s": (details.get("regime") or {}).get("rate_mbit_s"),
        "stated_regime_zero3_link_over_compute": (details.get("regime") or {}).get(
            "zero3_link_over_compute"
        ),
        "stated_regime_zero3_link_penalty_over_compute": regime["zero3_link_penalty_over_compute"]
        if regime else None,
        "emulated_1gbit_speedup_vs_zero3": median_of("1gbit", "speedup_vs_zero3", "zeropp"),
        "emulated_10gbit_speedup_vs_zero3": median_of("10gbit", "speedup_vs_zero3", "zeropp"),
    }  # fmt: skip


def _print_table(details: dict[str, Any]) -> None:
    emulated = details.get("emulated") or {}
    labels = list(emulated)

    def at(label: str, name: str) -> Any:
        configs = emulated[label]["configs"]
        return configs[name]["step_s_median"] if name in configs else "-"

    rows = [
        [name, s["cross_node_bytes_per_step"], s["cross_node_bytes_ratio_vs_zero3"],
         s["step_s_median"], *(at(label, name) for label in labels)]
        for name, s in (details.get("loopback") or {}).items()
    ]  # fmt: skip
    headers = ["config", "cross-node B/step", "vs zero3", "loopback s"]
    headers += [f"{emulated[label]['rate']} s" for label in labels]
    print_table("ZeRO++ vs plain stage 3, 4 ranks as 2 nodes x 2 (bf16)", headers, rows)


# ---------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    args = parse_args("zeropp", __doc__.splitlines()[0], argv)
    if args.quick and args.json == RESULTS / "zeropp.json":
        args.json = RESULTS / "zeropp.quick.json"  # a quick run never replaces a full one
    setup = QUICK if args.quick else FULL
    details: dict[str, Any] = {
        "setup": setup, "world": WORLD, "ranks_per_node": PER_NODE, "phases": {},
    }  # fmt: skip
    run = Run(args.json, args.quick, details)
    with run.phase("calibration"):
        details["calibration"] = calibrate(setup)
    run_loopback(run, setup)
    run_emulated(run, setup)
    if setup["converge"]:
        run_convergence(run, setup["converge"])
    _print_table(details)
    print(json.dumps(metrics(details), indent=2))
    failed = [f"{name} ({p['status']})" for name, p in details["phases"].items()
              if p["status"] != "done"]  # fmt: skip
    print(f"results: {args.json}" + (f"; did not complete: {', '.join(failed)}" if failed else ""))
    return 0 if run.succeeded() else 1


if __name__ == "__main__":
    sys.exit(main())
