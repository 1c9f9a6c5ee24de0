"""The ledger's cross-node bytes against the bytes a network interface transmitted.

4 gloo ranks as 2 nodes x 2 run in the two network namespaces of ``benchmarks.zeropp``'s
emulated cluster (a veth pair, no rate limit); gloo binds to the veth, so cross-node traffic,
and only it, crosses the pair. Local rank 0 of each node reads its end's transmit counters
(``/sys/class/net/<veth>/statistics``) around the third step, between barriers, and around a
barrier alone (what a barrier sends is subtracted). The two ends' transmitted bytes together
are compared with the sum of every rank's cross-node bytes in its communication ledger.

The interface counts what the ledger does not: each packet's Ethernet, IP and TCP headers
(14 + 20 + 32 bytes with timestamps; a GSO packet of up to 64 KiB is one packet here), the
acknowledgements flowing back, and gloo's own framing of each message. The ratio is reported
with the packet count, so the headers' share can be taken out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD, PER_NODE, STEPS = 4, 2, 3
HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with the timestamp option
REPO = Path(__file__).resolve().parent.parent


def _counters(link: str) -> tuple[int, int]:
    statistics = Path("/sys/class/net", link, "statistics")
    return (
        int((statistics / "tx_bytes").read_text()),
        int((statistics / "tx_packets").read_text()),
    )


def _worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    import chunkmem
    from benchmarks.estimate import engine_config
    from chunkmem.cli.models import build_model
    from chunkmem.cli.settings import ModelSettings

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    rank, link = int(os.environ["RANK"]), os.environ["GLOO_SOCKET_IFNAME"]
    reads = rank % PER_NODE == 0
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        build_model(ModelSettings(**spec["model"])), config=engine_config(spec["case"])
    )
    generator = torch.Generator().manual_seed(1)
    seq = spec["model"]["seq"]

    def between_barriers(work) -> tuple[int, int]:
        dist.barrier()
        before = _counters(link) if reads else (0, 0)
        work()
        dist.barrier()
        after = _counters(link) if reads else (0, 0)
        return after[0] - before[0], after[1] - before[1]

    def step() -> None:
        rows = torch.randint(0, 256, (spec["batch"], seq + 1), generator=generator)
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()

    for _ in range(STEPS - 1):
        step()
    barrier_alone = between_barriers(lambda: None)
    with_step = between_barriers(step)
    ledger = engine.states.sharding.comm.ledger
    result = {
        "ledger_cross_node_bytes": ledger.cross_node_bytes(tag=STEPS - 1),
        "veth_tx_bytes": with_step[0] - barrier_alone[0] if reads else None,
        "veth_tx_packets": with_step[1] - barrier_alone[1] if reads else None,
    }
    engine.close()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure_cluster(
    zero: dict[str, Any], model: dict[str, Any], batch: int, loopback_launch_s: float
) -> dict[str, Any]:
    """Run the case on the emulated cluster; the ledger's and the veth pair's bytes, or why it
    was skipped or failed. The ranks may take ``benchmarks.zeropp.SLACK`` times
    ``loopback_launch_s``: what this run's loopback launch of the same world took for its cases
    (this one among them; the veth pair is not rate-limited)."""
    from benchmarks.zeropp import SLACK, Cluster

    reason = Cluster.unavailable()
    if reason is not None:
        return {"skipped": reason}
    case = {"family": "zeropp", "stage": 3, "offload": "auto", "model": model, "batch": batch,
            "world": WORLD, "node": PER_NODE, "zero": zero}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="wire-counters-") as out, Cluster() as cluster:
        spec_path = Path(out, "spec.json")
        spec_path.write_text(json.dumps({"case": case, "model": model, "batch": batch, "out": out}))
        deadline_s = SLACK * loopback_launch_s
        failure = _launch(cluster, spec_path, Path(out), deadline_s)
        if failure is not None:
            return {"failed": failure, "deadline_s": deadline_s}
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    ledger = sum(r["ledger_cross_node_bytes"] for r in ranks)
    tx_bytes = sum(r["veth_tx_bytes"] for r in ranks if r["veth_tx_bytes"] is not None)
    packets = sum(r["veth_tx_packets"] for r in ranks if r["veth_tx_packets"] is not None)
    payload = tx_bytes - HEADER_BYTES * packets
    return {
        "case": case,
        "deadline_s": deadline_s,
        "ledger_cross_node_bytes_all_ranks": ledger,
        "veth_tx_bytes": tx_bytes,
        "veth_tx_packets": packets,
        "veth_header_bytes": HEADER_BYTES * packets,
        "ledger_vs_veth_ratio": ledger / tx_bytes,
        "ledger_vs_veth_payload_ratio": ledger / payload,
    }


def _launch(cluster: Any, spec_path: Path, out: Path, deadline_s: float) -> str | None:
    processes = []
    started = time.monotonic()
    try:
        for rank in range(WORLD):
            node = rank // PER_NODE
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(rank % PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE),
                "MASTER_ADDR": cluster.addresses[0], "MASTER_PORT": str(29700 + os.getpid() % 200),
                "GLOO_SOCKET_IFNAME": cluster.links[node], "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO),
            }  # fmt: skip
            command = ["ip", "netns", "exec", cluster.namespaces[node], sys.executable, "-m",
                       "benchmarks._wire_counters", str(spec_path)]  # fmt: skip
            with (out / f"rank{rank}.log").open("w") as log:
                processes.append(
                    subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=log)
                )
        for rank, process in enumerate(processes):
            if process.wait(timeout=max(0.0, started + deadline_s - time.monotonic())):
                tail = (out / f"rank{rank}.log").read_text()[-2000:]
                return f"rank {rank} exited with {process.returncode}: {tail}"
    except subprocess.TimeoutExpired:
        return f"the ranks did not finish within {deadline_s:.0f} s"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return None


if __name__ == "__main__":
    _worker(sys.argv[1])
