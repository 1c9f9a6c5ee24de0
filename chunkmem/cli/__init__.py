"""The ``chunkmem`` command: ``train``, ``estimate``, ``report`` and ``consolidate``.

Installed as a console script (setup.cfg) and runnable as ``python -m chunkmem``. Each
subcommand lives in its own module; this one parses arguments and turns exceptions into
the exit codes of :mod:`chunkmem.cli.exit_codes` (docs/cli.md), printing the error's
message, and the traceback only for an unexpected one.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from chunkmem.cli.exit_codes import ExitCode, exit_code_for
from chunkmem.errors import ConfigError

_EPILOG = (
    "exit codes: 0 ok, 1 internal error, 2 usage or config error, 3 out of memory, "
    "4 collective failure, 5 diverged (non-finite), 6 checkpoint problem, 7 storage tier "
    "failure, 8 interrupted after saving a checkpoint (docs/cli.md)"
)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a JSON run file: engine config keys (docs/config.md) plus 'model' and 'train' "
        "sections (docs/cli.md); default: the demo's settings",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one key, dotted (zero.stage=2, model.layers=8, train.steps=100); "
        "the value is JSON if it parses as JSON, else a string; repeatable",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkmem",
        description="Train with chunk-based memory management and ZeRO; estimate memory "
        "before renting a machine; re-render reports; consolidate checkpoints.",
        epilog=_EPILOG,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model from a config (GPT on Python's stdlib sources by default)",
        description="Train a model from a config file plus --set overrides: progress bar, "
        "checkpoints every K steps, --resume, the memory-trace report at the end and on "
        "failure. SIGINT/SIGTERM save a checkpoint on every rank, then exit with code 8.",
        epilog=_EPILOG,
    )
    _add_config_arguments(train)
    train.add_argument("--data", metavar="FILE", help="train on this text file (train.data)")
    train.add_argument(
        "--out", metavar="DIR", type=Path, default=Path("runs/train"),
        help="run directory: settings, metrics, checkpoints, report (default runs/train)",
    )  # fmt: skip
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="CHECKPOINT",
        help="continue from CHECKPOINT, or with no value from the newest complete "
        "checkpoint in OUT/checkpoints",
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="start N local ranks (gloo on CPU, one GPU each on CUDA); needs zero.stage >= 1. "
        "Under torchrun, leave it out: each rank is one process",
    )
    train.set_defaults(run=_train)

    estimate = commands.add_parser(
        "estimate",
        help="per-rank device, host and NVMe bytes and wire bytes per step, without training",
        description="Estimate per-rank peak device bytes, host and NVMe bytes, and bytes "
        "sent per step (intra- and cross-node) for a model and config, from a trace of the "
        "model on the meta device plus the engine's own chunk packing and the ZeRO formulas.",
        epilog=_EPILOG,
    )
    _add_config_arguments(estimate)
    estimate.add_argument(
        "--model",
        metavar="SPEC",
        help="gpt (sizes from model.* keys), pkg.module:function, or hf:NAME (a Hugging "
        "Face config); sets model.build",
    )
    estimate.add_argument(
        "--world-size", type=int, metavar="N", help="data-parallel ranks (default: 1 at "
        "ZeRO stage 0, else WORLD_SIZE or 8)",
    )  # fmt: skip
    estimate.add_argument(
        "--node-size", type=int, metavar="N",
        help="ranks per node, for the cross-node bytes (default: all ranks on one node)",
    )  # fmt: skip
    estimate.add_argument(
        "--device-memory", metavar="BYTES",
        help="device memory per rank, e.g. 80GiB (default: device.capacity from --config or "
        "--set, else the memory of the GPU present, else the embedded demo's capacity)",
    )  # fmt: skip
    estimate.add_argument(
        "--host-memory", metavar="BYTES",
        help="host memory per rank for the verdict (default: host.capacity, else unlimited)",
    )  # fmt: skip
    estimate.add_argument(
        "--max-model",
        metavar="KEY",
        help="instead: the largest integer value of this model key (e.g. layers, or a "
        "kwargs.NAME of a constructor) whose model fits the memory given",
    )
    estimate.add_argument("--json", action="store_true", help="print JSON instead of a table")
    estimate.set_defaults(run=_estimate)

    report = commands.add_parser(
        "report",
        help="re-render a run's memory-trace report and print its headline numbers",
        description="Re-render every memory_trace.json under RUN_DIR into its HTML page and "
        "print the headline numbers (peaks, bytes moved, steps; loss from metrics.jsonl).",
        epilog=_EPILOG,
    )
    report.add_argument("run_dir", metavar="RUN_DIR", type=Path)
    report.add_argument("--json", action="store_true", help="print JSON instead of text")
    report.set_defaults(run=_report)

    consolidate = commands.add_parser(
        "consolidate",
        help="write a checkpoint's model weights as one state dict (.safetensors or .pt)",
        description="Stream a (sharded) checkpoint's model weights into one file that plain "
        "PyTorch or Hugging Face loads; no GPU and no process group needed.",
        epilog=_EPILOG,
    )
    consolidate.add_argument("checkpoint", metavar="CKPT", type=Path)
    consolidate.add_argument("out", metavar="OUT", type=Path, help="*.safetensors or *.pt")
    consolidate.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16", "saved"),
        default="fp32",
        help="floating-point dtype written (saved: as in the checkpoint); default fp32",
    )
    consolidate.set_defaults(run=_consolidate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error (2, message printed)
        return int(done.code or 0)
    try:
        return int(args.run(args, argv))
    except KeyboardInterrupt:
        print(f"chunkmem {args.command}: interrupted", file=sys.stderr)
        return 128 + 2
    except Exception as error:  # noqa: BLE001 - every failure becomes an exit code
        code = exit_code_for(error)
        rank = os.environ.get("RANK")
        who = f"chunkmem {args.command}" + (f" [rank {rank}]" if rank is not None else "")
        if code is ExitCode.INTERNAL:
            traceback.print_exc()
        print(f"{who}: error: {error}", file=sys.stderr)
        return int(code)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from chunkmem.cli import settings
    from chunkmem.cli.launch import spawn
    from chunkmem.cli.train import TrainingRun

    overrides = list(args.overrides)
    if args.data is not None:
        overrides.append(f"train.data={args.data}")
    world_size = args.nproc if args.nproc > 1 else int(os.environ.get("WORLD_SIZE", 1))
    run_settings, config = settings.load(args.config, overrides, world_size)
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc > 1:
        if "RANK" in os.environ:
            raise ConfigError(
                "--nproc starts ranks itself; under torchrun (RANK is set) leave it out"
            )
        if config.zero.stage == 0:
            raise ConfigError(
                f"--nproc {args.nproc} needs ZeRO: set zero.stage to 1, 2 or 3 (e.g. "
                f"--set zero.stage=2); stage 0 trains in one process"
            )
        return spawn(argv, args.nproc)
    run = TrainingRun(run_settings, config, args.out, args.resume)
    try:
        return run.run()
    except BaseException:
        run.report_after_failure()
        raise


def _estimate(args: argparse.Namespace, argv: list[str]) -> int:
    from chunkmem.cli.estimate import run_estimate

    return run_estimate(args)


def _report(args: argparse.Namespace, argv: list[str]) -> int:
    from chunkmem.cli.report import run_report

    return run_report(args.run_dir, as_json=args.json)


def _consolidate(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    import chunkmem

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "saved": None}
    path = chunkmem.consolidate(args.checkpoint, args.out, dtype=dtypes[args.dtype])
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return int(ExitCode.OK)
