"""ZeRO++ against plain stage 3 on 4 ranks as 2 nodes x 2: cross-node bytes, step time on an
emulated cluster, and convergence.

1. **Bytes and step time, unlimited.** The same GPT trains with plain stage 3, each technique
   alone (qwZ, hpZ, qgZ) and all three, in one launch of 4 ranks on this machine's loopback.
   Cross-node bytes per step come from the communication ledger, all ranks together.
2. **The emulated cluster.** Two network namespaces, each one "node" of 2 ranks, joined by a
   veth pair whose two ends are rate-limited with ``tc`` (tbf) to 1 Gbit/s, then 10 Gbit/s.
   Addresses exist only inside the namespaces; gloo binds to the veth (``GLOO_SOCKET_IFNAME``),
   so traffic between ranks of one node never leaves its namespace (a packet to an address of
   its own namespace goes through that namespace's loopback) and traffic between nodes crosses
   the limited link. The benchmark creates and removes the namespaces itself, on every exit
   path. Without root, ``ip`` or ``tc`` it says so and runs parts 1 and 3 only.
3. **Convergence.** A GPT on Python's own standard library text, 300 steps in fp32 and bf16,
   plain stage 3 against full ZeRO++: final loss (mean of the last 20 steps, over ranks) and
   the largest loss after step 50 relative to the running minimum.

Step times are medians over the measured steps of each round, timed between barriers on rank
0; configurations alternate within a round and rounds repeat, so drifting load hits all alike.
Speedups are ratios of a round's medians, reported as the median and range over rounds.

    python -m benchmarks.zeropp            # writes benchmarks/results/zeropp.json
    python -m benchmarks.zeropp --quick    # under a minute, results/zeropp.quick.json
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, median, parse_args, print_table, write_results

WORLD, PER_NODE = 4, 2
REPO = Path(__file__).resolve().parent.parent
CONFIGS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz_partition_size": 2},
    "qgz": {"quantized_gradients": True},
    "zeropp": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True},
}
# A GPT whose parameters outweigh its compute per step (8 tokens per rank), the regime ZeRO++
# is for: communication-bound data parallelism over a slow network (docs/zeropp.md).
FULL = {
    "model": {"vocab_size": 8192, "block_size": 8, "n_layer": 4, "n_embd": 512, "n_head": 8},
    "local_batch": 1, "warmup": 2, "steps": 4, "rounds": 3,
    "rates": ["1gbit", "10gbit"], "emulated": list(CONFIGS),
    "converge": {"steps": 300, "precisions": ["fp32", "bf16"], "local_batch": 8, "seq": 64,
                 "lr": 1e-3,
                 "model": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_embd": 128,
                           "n_head": 2}},
}  # fmt: skip
QUICK = {
    "model": {"vocab_size": 2048, "block_size": 32, "n_layer": 2, "n_embd": 256, "n_head": 4},
    "local_batch": 1, "warmup": 2, "steps": 2, "rounds": 1,
    "rates": ["1gbit"], "emulated": ["zero3", "zeropp"],
    "converge": None,
}  # fmt: skip
WORKER_TIMEOUT_S = 900
# Plain stage 3 from initial weights changed by about 1e-6 relative: how far two runs that
# differ by far less than any quantization drift apart (the convergence benchmark's control).
CONTROL = "zero3_nudged"
OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


# ---------------------------------------------------------------- one rank
def _worker(spec_path: str) -> None:
    """One rank of a launch: every configuration of the spec in turn, then its results."""
    import torch
    import torch.distributed as dist

    import chunkmem
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
    for _round in range(spec["rounds"]):
        for name in spec["configs"]:
            torch.manual_seed(0)
            model = GPT(model_config)
            if name == CONTROL:
                _nudge(model)
            engine = chunkmem.initialize(
                model,
                config={
                    "precision": spec["precision"],
                    "device": {"type": "simulated", "capacity": "8GiB"},
                    "optimizer": {"lr": spec["lr"], "weight_decay": 0.1},
                    "gradient_clipping": 1.0,
                    "zero": {"stage": 3, "timeout_s": 600, "node_size": PER_NODE,
                             **CONFIGS[name if name != CONTROL else "zero3"]},
                },
            )  # fmt: skip
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
        bits = _rate_bits(rate)
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


def _rate_bits(rate: str) -> float:
    number = rate.rstrip("bit").rstrip("gmk")
    unit = {"g": 1e9, "m": 1e6, "k": 1e3}[rate.removesuffix("bit")[-1]]
    return float(number) * unit


def _run(command: Sequence[str]) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- launching ranks
def launch(spec: dict, cluster: Cluster | None) -> dict[str, Any]:
    """Run ``spec`` on 4 ranks (in the cluster's namespaces if given); rank 0's results with
    every rank's cross-node bytes summed per step."""
    with tempfile.TemporaryDirectory(prefix="zeropp-") as out:
        spec = {**spec, "out": out}
        spec_path = Path(out) / "spec.json"
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
                command = [sys.executable, "-m", "benchmarks.zeropp", "--worker", str(spec_path)]
                if cluster:
                    env["GLOO_SOCKET_IFNAME"] = cluster.links[node]
                    command = ["ip", "netns", "exec", cluster.namespaces[node], *command]
                processes.append(subprocess.Popen(command, env=env, cwd=REPO))
            deadline = time.monotonic() + WORKER_TIMEOUT_S
            for process in processes:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code:
                    raise RuntimeError(f"a rank exited with code {code}")
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]
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
    nodes from 2 of the 4 ranks; qgZ's inter-node all-to-all sends half of each rank's node
    sums to the other node; hpZ's backward gathers stay inside the node. The step's two small
    all-reduces are measured, not modelled (``all_reduce``)."""
    from kernels.quantized import data_nbytes, num_groups
    from zero.wire import packed_nbytes

    gathers = reductions = 0
    for c in capacities:
        n = c // WORLD
        shard = packed_nbytes(n, 8, block) if zero.get("quantized_weights") else n * itemsize
        hpz = zero.get("hpz_partition_size", 1) > 1
        gathers += 2 * 3 * shard * (1 if hpz else 2)
        if zero.get("quantized_gradients"):
            s = -(-n // block) * block
            reductions += WORLD * (data_nbytes(2 * s, 4) + 4 * num_groups(2 * s, block)) // 2
        else:
            reductions += 2 * 3 * n * itemsize
    return {"all_gather": gathers, "reduce_scatter_or_all_to_all": reductions}


def _speedups(results: dict, name: str) -> dict:
    """Per round: median plain step time / median ``name`` step time."""
    ratios = [
        median(base["step_s"]) / median(ours["step_s"])
        for base, ours in zip(results["zero3"]["rounds"], results[name]["rounds"], strict=True)
    ]
    return {"median": median(ratios), "range": [min(ratios), max(ratios)]}


@contextlib.contextmanager
def _timed(what: str) -> Iterator[None]:
    started = time.perf_counter()
    print(f"{what} ...", flush=True)
    yield
    print(f"{what}: {time.perf_counter() - started:.0f} s", flush=True)


# ---------------------------------------------------------------- convergence
def convergence(setup: dict) -> dict:
    """Plain stage 3, full ZeRO++ and the control on the same batches; the final loss is the
    mean of the last 20 steps' losses (each the mean over ranks)."""
    names = ("zero3", "zeropp", CONTROL)
    out = {}
    for precision in setup["precisions"]:
        spec = {
            "mode": "converge", "configs": list(names), "model": setup["model"],
            "precision": precision, "lr": setup["lr"], "local_batch": setup["local_batch"],
            "seq": setup["seq"], "warmup": 0, "steps": setup["steps"], "rounds": 1,
        }  # fmt: skip
        with _timed(f"convergence {precision}"):
            results = launch(spec, None)
        curves = {name: results[name]["rounds"][0]["losses"] for name in names}
        final = {name: sum(c[-20:]) / len(c[-20:]) for name, c in curves.items()}
        out[precision] = {
            "final_loss": final,
            "final_loss_rel_diff": abs(final["zeropp"] - final["zero3"]) / final["zero3"],
            "final_loss_rel_change": (final["zeropp"] - final["zero3"]) / final["zero3"],
            "control_final_loss_rel_diff": abs(final[CONTROL] - final["zero3"]) / final["zero3"],
            "max_loss_over_running_min_after_50": {
                name: _spike(curve, after=50) for name, curve in curves.items()
            },
            "losses_every_10_steps": {name: c[::10] for name, c in curves.items()},
        }
    return out


def _spike(curve: list[float], after: int) -> float:
    lowest, worst = float("inf"), 0.0
    for step, loss in enumerate(curve):
        if step >= after:
            worst = max(worst, loss / lowest)
        lowest = min(lowest, loss)
    return worst


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
    details: dict[str, Any] = {"setup": setup, "world": WORLD, "ranks_per_node": PER_NODE}

    with _timed("bytes and step time on loopback"):
        loopback = launch(_step_spec(setup, list(CONFIGS)), None)
    details["loopback"] = {name: _summary(name, entry) for name, entry in loopback.items()}
    plain_bytes = details["loopback"]["zero3"]["cross_node_bytes_per_step"]
    ratio = details["loopback"]["zeropp"]["cross_node_bytes_per_step"] / plain_bytes
    for summary in details["loopback"].values():
        summary["cross_node_bytes_ratio_vs_zero3"] = (
            summary["cross_node_bytes_per_step"] / plain_bytes
        )

    emulated: dict[str, Any] = {}
    reason = Cluster.unavailable()
    if reason is None:
        try:
            with Cluster() as cluster:
                for rate in setup["rates"]:
                    cluster.limit(rate)
                    with _timed(f"emulated cluster at {rate}/s"):
                        results = launch(_step_spec(setup, setup["emulated"]), cluster)
                    emulated[rate] = {
                        "configs": {name: _summary(name, entry) for name, entry in results.items()},
                        "speedup_vs_zero3": {
                            name: _speedups(results, name) for name in results if name != "zero3"
                        },
                    }
        except RuntimeError as error:
            reason = f"the emulated cluster failed: {error}"
    if reason is not None:
        print(f"NO EMULATED CLUSTER: {reason}; ran the byte part only", flush=True)
    details["emulated"] = emulated or {"skipped": reason}

    converge = convergence(setup["converge"]) if setup["converge"] else None
    details["convergence"] = converge

    def speedup(rate: str) -> float | None:
        return emulated[rate]["speedup_vs_zero3"]["zeropp"]["median"] if rate in emulated else None

    metrics = {
        "cross_node_bytes_ratio_vs_zero3": ratio,
        "final_loss_rel_diff_vs_zero3": None
        if converge is None
        else max(c["final_loss_rel_diff"] for c in converge.values()),
        "emulated_1gbit_speedup_vs_zero3": speedup("1gbit"),
        "emulated_10gbit_speedup_vs_zero3": speedup("10gbit"),
    }
    rows = [
        [name, s["cross_node_bytes_per_step"], s["cross_node_bytes_ratio_vs_zero3"],
         s["step_s_median"], *(
             emulated[rate]["configs"][name]["step_s_median"]
             if rate in emulated and name in emulated[rate]["configs"] else "-"
             for rate in ("1gbit", "10gbit")
         )]
        for name, s in details["loopback"].items()
    ]  # fmt: skip
    print_table(
        "ZeRO++ vs plain stage 3, 4 ranks as 2 nodes x 2 (bf16)",
        ["config", "cross-node B/step", "vs zero3", "loopback s", "1 Gbit/s s", "10 Gbit/s s"],
        rows,
    )
    print(json.dumps(metrics, indent=2))
    path = write_results(args.json, metrics, details, args.quick)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
