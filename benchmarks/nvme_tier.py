"""NVMe tier: chunk write and read throughput against dd moving the same bytes in the same
directory, same run.

    python -m benchmarks.nvme_tier [--quick] [--json PATH]

The tier (offload/nvme.py, the engine's settings: 4 MiB blocks, 2 I/O threads, a CRC32C on
every block, verified on every read) writes CHUNKS host tensors into its files and reads them
back into host tensors, all chunks in flight at once as the step's write-back and read-ahead
would have them. The baseline is a plain sequential copy of the same bytes by dd, with the
same request size: from a file holding exactly the chunks' data (in the page cache, as the
chunks are in memory) into a preallocated file (``conv=notrunc``), then that file to
/dev/null, with ``oflag=direct``/``iflag=direct`` when the tier uses O_DIRECT there (so no
read is served by the page cache), else buffered for both. Not from /dev/zero: a virtual disk
may turn blocks of zeros into cheaper operations. The tier's files are preallocated too (a
warm-up round), as after a training run's first step.

The directory is ``$CHUNKMEM_NVME_DIR`` or the system's temporary directory. Each round times
the tier's writes, its reads, dd's write and dd's read; the key is the ratio of dd's time for
both to the tier's per round (a throughput ratio, above 1 when the tier is faster), with the
median and range over rounds.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks._common import parse_args, print_table, write_results
from offload.nvme import NvmeTier

BLOCK = 4 * 2**20
IO_THREADS = 2


def dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - start


def tier_round(tier: NvmeTier, sources: list[torch.Tensor], targets: list[torch.Tensor]):
    """(write seconds, read seconds, whether the data came back equal)."""
    start = time.perf_counter()
    written = [tier.copy_in(source) for source in sources]
    for _extent, transfer in written:
        transfer.wait()
    middle = time.perf_counter()
    reads = [
        tier.copy_out(extent, target) for (extent, _w), target in zip(written, targets, strict=True)
    ]
    for transfer in reads:
        transfer.wait()
    end = time.perf_counter()
    equal = all(torch.equal(s, t) for s, t in zip(sources, targets, strict=True))
    for extent, _transfer in written:
        tier.free(extent)  # kept for the next round, as a run reuses its files
    return middle - start, end - middle, equal


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("nvme_tier", __doc__.splitlines()[0], argv)
    chunks, chunk_mib, rounds = (8, 16, 3) if args.quick else (8, 64, 7)
    chunk_bytes = chunk_mib * 2**20
    total = chunks * chunk_bytes
    base = Path(
        tempfile.mkdtemp(prefix="chunkmem-nvme-bench-", dir=os.environ.get("CHUNKMEM_NVME_DIR"))
    )
    try:
        tier = NvmeTier(base / "tier", BLOCK, IO_THREADS)
        generator = torch.Generator().manual_seed(0)
        sources = [torch.randn(chunk_bytes // 4, generator=generator) for _ in range(chunks)]
        targets = [torch.empty_like(s) for s in sources]
        tier_round(tier, sources, targets)  # warm-up: files created and preallocated
        dd_source, dd_file = base / "chunks.bin", base / "dd.bin"
        with open(dd_source, "wb") as f:
            for source in sources:
                f.write(source.numpy().tobytes())
        with open(dd_file, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, total)
        direct_out = ["oflag=direct"] if tier.direct else []
        direct_in = ["iflag=direct"] if tier.direct else []
        count = f"count={total // BLOCK}"
        samples: dict[str, list[float]] = {
            k: [] for k in ("tier_write", "tier_read", "dd_write", "dd_read")
        }
        all_equal = True
        for index in range(rounds):

            def ours() -> None:
                write, read, equal = tier_round(tier, sources, targets)
                samples["tier_write"].append(write)
                samples["tier_read"].append(read)
                nonlocal all_equal
                all_equal = all_equal and equal

            def theirs() -> None:
                samples["dd_write"].append(
                    dd(
                        [
                            f"if={dd_source}",
                            f"of={dd_file}",
                            f"bs={BLOCK}",
                            count,
                            "conv=notrunc",
                            *direct_out,
                        ]
                    )
                )
                samples["dd_read"].append(
                    dd([f"if={dd_file}", "of=/dev/null", f"bs={BLOCK}", count, *direct_in])
                )

            for run in (ours, theirs) if index % 2 == 0 else (theirs, ours):
                run()
        direct = tier.direct
        tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    both = [
        (dw + dr) / (tw + tr)
        for tw, tr, dw, dr in zip(
            samples["tier_write"],
            samples["tier_read"],
            samples["dd_write"],
            samples["dd_read"],
            strict=True,
        )
    ]
    writes = [d / t for t, d in zip(samples["tier_write"], samples["dd_write"], strict=True)]
    reads = [d / t for t, d in zip(samples["tier_read"], samples["dd_read"], strict=True)]
    mib_s = {name: spread([total / 2**20 / t for t in times]) for name, times in samples.items()}
    print(
        f"{chunks} chunks of {chunk_mib} MiB ({total // 2**20} MiB) per round, {rounds} rounds, "
        f"in {base.parent} ({'O_DIRECT' if direct else 'buffered: O_DIRECT refused'}); tier: "
        f"{BLOCK // 2**20} MiB blocks, {IO_THREADS} I/O threads, CRC32C checked; dd: bs={BLOCK // 2**20}M"
    )
    print_table(
        "throughput, MiB/s (median, range over rounds)",
        ["transfer", "median", "min", "max"],
        [[name, v["median"], v["min"], v["max"]] for name, v in mib_s.items()],
    )
    ratio = spread(both)
    print(
        f"\nnvme_throughput_ratio_vs_sequential_copy: {ratio['median']:.3f} (range "
        f"{ratio['min']:.3f}-{ratio['max']:.3f}; goal >= 0.8); writes "
        f"{statistics.median(writes):.3f}, reads {statistics.median(reads):.3f}. Data read back "
        f"equal: {all_equal}."
    )
    metrics = {"nvme_throughput_ratio_vs_sequential_copy": ratio["median"]}
    details = {
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "rounds": rounds,
        "block_bytes": BLOCK,
        "io_threads": IO_THREADS,
        "o_direct": direct,
        "ratio": ratio,
        "write_ratio": spread(writes),
        "read_ratio": spread(reads),
        "mib_per_s": mib_s,
        "samples_s": samples,
        "data_equal": all_equal,
        "load_average": os.getloadavg(),
    }
    write_results(args.json, metrics, details, args.quick)
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
