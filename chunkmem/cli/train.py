"""``chunkmem train``: a training run from a config, with progress, checkpoints and reports.

The run reads top to bottom in :meth:`TrainingRun.run`: build, resume if asked, train step
by step (progress, metrics, checkpoints every K steps), then evaluate, sample, save and
report. Everything it writes goes under one run directory::

    OUT/settings.json       what the run was given (model, train and engine sections)
    OUT/metrics.jsonl       one line per optimizer step (loss, tokens/s, bytes)
    OUT/checkpoints/step_000250/    engine.save_checkpoint directories, the last K kept
    OUT/report/             the memory-trace report (one process; report/rank<r>/ per rank)

[Note: stopping on a signal]
SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice) only set a flag. After every optimizer
step the ranks sum their flags (with the loss, one all-reduce of two numbers), so a signal
that reached one rank stops all of them after the same step, where each saves its part of
one checkpoint and writes its report: no rank is left waiting in a collective its peers
never join. A second signal stops at once, without saving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import chunkmem
from chunkmem.checkpoint.commit import incomplete
from chunkmem.cli.data import batches, read_text, sample
from chunkmem.cli.exit_codes import ExitCode
from chunkmem.cli.models import build_model, describe
from chunkmem.cli.progress import Progress, StepStats, mib
from chunkmem.cli.settings import RunSettings, settings_document
from chunkmem.config import Config
from chunkmem.errors import CheckpointError, ConfigError
from chunkmem.machine import GpuMemory, gpu_memory, rss_bytes

CHECKPOINT_PREFIX = "step_"
LATEST = "latest"


def world_position() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (or ``--nproc``'s, which is the same)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named by :func:`checkpoint_name`, else None."""
    digits = path.name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if path.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def checkpoints_in(directory: Path) -> list[Path]:
    """The committed checkpoints in ``directory``, oldest first (killed saves are skipped:
    the commit protocol leaves them as temporaries, never under a step name)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_step(p) is not None]
    return sorted((p for p in found if incomplete(p) is None), key=checkpoint_step)  # type: ignore[arg-type]


class StopSignals:
    """SIGINT and SIGTERM set :attr:`received`; a second one raises KeyboardInterrupt."""

    def __init__(self, who: str) -> None:
        self.received: int | None = None
        self._who = who
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"a second signal ({signal.Signals(signum).name})")
        self.received = signum
        print(
            f"{self._who}{signal.Signals(signum).name}: stopping after this step and saving a "
            f"checkpoint (send it again to stop at once, without saving)",
            file=sys.stderr,
            flush=True,
        )


class TrainingRun:
    """One rank's part of a ``chunkmem train`` run."""

    def __init__(
        self, settings: RunSettings, config: Config, out: Path, resume: str | None
    ) -> None:
        self.settings = settings
        self.config = config
        self.out = out
        self.resume = resume
        self.rank, self.world_size = world_position()
        self.engine: chunkmem.Engine | None = None
        self.progress: Progress | None = None
        if self.world_size > 1 and config.zero.stage == 0:
            raise ConfigError(
                f"{self.world_size} ranks need ZeRO: set zero.stage to 1, 2 or 3 (e.g. "
                f"--set zero.stage=2); stage 0 trains in one process"
            )

    # ------------------------------------------------------------------ paths
    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def report_dir(self) -> Path:
        report = self.out / "report"
        return report if self.world_size == 1 else report / f"rank{self.rank}"

    def say(self, text: str) -> None:
        if self.rank != 0:
            return
        if self.progress is not None:
            self.progress.write(text)
        else:
            print(text, flush=True)

    # ------------------------------------------------------------------ the run
    def run(self) -> ExitCode:
        settings, train = self.settings, self.settings.train
        start_from = self._checkpoint_to_resume()
        torch.manual_seed(train.seed)
        data = read_text(train.data, train.data_bytes, settings.model.seq)
        split = int(len(data) * (1 - train.held_out_fraction))
        train_data, held_out = data[:split], data[split:]
        engine = self.engine = chunkmem.initialize(build_model(settings.model), config=self.config)
        generator = torch.Generator().manual_seed(train.seed * 1_000_003 + self.rank)
        earlier: dict[int, float] = {}
        if start_from is not None:
            client_state = engine.load_checkpoint(start_from)
            generator.set_state(client_state["data"])
            earlier = self._continue_metrics(start_from, engine.global_steps)
        elif self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.metrics_path.write_text("")
        if self.rank == 0:
            document = settings_document(settings, self.config)
            (self.out / "settings.json").write_text(json.dumps(document, indent=1) + "\n")
        self._say_what_runs(engine, len(train_data), start_from)

        stream = batches(train_data, train.batch, settings.model.seq, generator)
        first = engine.global_steps
        self.progress = Progress(first, train.steps, train.log_every, enabled=self.rank == 0)
        retrained: list[tuple[int, float, float]] = []
        who = f"[rank {self.rank}] " if self.world_size > 1 else ""
        with StopSignals(who) as signals:
            for step, loss in self._steps(stream, first, train.steps, signals):
                if step in earlier:
                    retrained.append((step, loss, earlier[step]))
                if train.checkpoint_every and step % train.checkpoint_every == 0:
                    self._save(generator)
            self.progress.close()
            self.progress = None
            if signals.received is not None:
                self._save(generator)
                self._write_report()
                self.say(f"stopped at step {engine.global_steps}; continue with --resume")
                return ExitCode.INTERRUPTED
        self._say_retrained(retrained)
        self._save(generator)
        self._evaluate(held_out)
        self._write_report()
        return ExitCode.OK

    def _steps(
        self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]], first: int, last: int,
        signals: StopSignals,
    ) -> Iterator[tuple[int, float]]:  # fmt: skip
        """Train optimizer steps ``first + 1 .. last``; yields (step, loss averaged over the
        micro-batches and ranks) after each, and stops early once any rank got a signal."""
        engine = self.engine
        assert engine is not None and self.progress is not None
        accumulation = self.config.gradient_accumulation_steps
        tokens_per_step = (
            self.settings.train.batch * self.settings.model.seq * accumulation * self.world_size
        )
        started = time.perf_counter()
        for step in range(first + 1, last + 1):
            loss_sum = 0.0
            for _ in range(accumulation):
                loss = engine(*next(stream))
                engine.backward(loss)
                engine.step()
                loss_sum += float(loss.detach())
            # The loss for the bar and the stop flag in one collective (see the note above).
            agreed = torch.tensor(
                [loss_sum / accumulation, float(signals.received is not None)], dtype=torch.float64
            )
            engine.states.sharding.all_reduce_sum(agreed)
            mean_loss = float(agreed[0]) / self.world_size
            stats = self._stats(step, mean_loss, tokens_per_step * (step - first), started)
            self.progress.update(stats)
            self._append_metrics(stats, time.perf_counter() - started)
            yield step, mean_loss
            if agreed[1] > 0:
                signals.received = signals.received or signal.SIGTERM  # a peer's signal
                return

    def _stats(self, step: int, loss: float, tokens: int, started: float) -> StepStats:
        engine = self.engine
        assert engine is not None
        ledger = engine.ledger
        iteration = ledger.iteration - 1  # the step just taken
        comm = getattr(engine.states.sharding, "comm", None)
        return StepStats(
            step=step,
            loss=loss,
            tokens_per_s=tokens / max(time.perf_counter() - started, 1e-9),
            device_peak_bytes=ledger.device.peak,
            device_capacity=ledger.device.capacity,
            host_bytes=ledger.tiers["host"].used,
            moved_bytes=ledger.bytes_moved(iteration),
            wire_bytes=comm.ledger.bytes_sent(tag=iteration) if comm is not None else 0,
        )

    def _gpu(self) -> GpuMemory | None:
        """The GPU this rank computes on, as the driver sees it (None off CUDA)."""
        assert self.engine is not None
        device = self.engine.residency.device.torch_device
        return gpu_memory(device.index or 0) if device.type == "cuda" else None

    def _append_metrics(self, stats: StepStats, elapsed_s: float) -> None:
        if self.rank != 0:
            return
        line = {
            "step": stats.step,
            "loss": stats.loss,
            "tokens_per_s": round(stats.tokens_per_s, 1),
            "device_peak_bytes": stats.device_peak_bytes,
            "host_bytes": stats.host_bytes,
            "moved_bytes": stats.moved_bytes,
            "wire_bytes": stats.wire_bytes,
            "rss_bytes": rss_bytes(),
            "grad_norm": self.engine.last_grad_norm,  # before clipping: above the clip, it fired
            "speculation": self.engine.last_speculation,
            "elapsed_s": round(elapsed_s, 3),
        }
        gpu = self._gpu()
        if gpu is not None:  # the driver's view: every process on the GPU, not the ledger's
            line["gpu_used_bytes"] = gpu.used_bytes
            line["gpu_utilization_percent"] = gpu.utilization_percent
        with open(self.metrics_path, "a") as file:
            file.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------------ resume
    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint ``--resume`` names (``latest``: the newest committed one in this
        run directory); refuses one that later checkpoints here would collide with."""
        if self.resume is None:
            return None
        if self.resume == LATEST:
            found = checkpoints_in(self.checkpoints)
            if not found:
                raise CheckpointError(
                    f"--resume: no committed checkpoint in {self.checkpoints} (a run saves one "
                    f"every train.checkpoint_every steps, at the end and when interrupted)"
                )
            path = found[-1]
        else:
            path = Path(self.resume)
            problem = incomplete(path)
            if problem is not None:
                raise CheckpointError(f"--resume: {problem}")
        step = checkpoint_step(path)
        later = [
            p.name
            for p in checkpoints_in(self.checkpoints)
            if (checkpoint_step(p) or 0) > (step or 0)
        ]
        if later:
            raise CheckpointError(
                f"--resume {path}: {self.checkpoints} already holds later checkpoints "
                f"({', '.join(later)}) that this run would collide with; resume into a new "
                f"run directory (--out) to branch off, or delete them"
            )
        return path

    def _continue_metrics(self, checkpoint: Path, step: int) -> dict[int, float]:
        """Keep the metrics up to ``step`` (from the run the checkpoint belongs to) and return
        the losses an earlier attempt logged after it, to compare the retrained steps with."""
        source = checkpoint.resolve().parent.parent / "metrics.jsonl"
        lines = []
        if source.is_file():
            lines = [json.loads(line) for line in source.read_text().splitlines() if line]
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            kept = "".join(json.dumps(line) + "\n" for line in lines if line["step"] <= step)
            self.metrics_path.write_text(kept)
        return {line["step"]: line["loss"] for line in lines if line["step"] > step}

    # ------------------------------------------------------------------ saving
    def _save(self, generator: torch.Generator) -> None:
        """A checkpoint of this step (every rank writes its part), unless one exists; then
        the oldest beyond ``keep_checkpoints`` go."""
        engine = self.engine
        assert engine is not None
        target = self.checkpoints / checkpoint_name(engine.global_steps)
        if target.exists():
            return
        engine.save_checkpoint(target, client_state={"data": generator.get_state()})
        self.say(f"checkpoint: {target}")
        if self.rank == 0:
            for old in checkpoints_in(self.checkpoints)[: -self.settings.train.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)

    def _write_report(self) -> dict[str, Path]:
        assert self.engine is not None
        paths = self.engine.write_report(self.report_dir)
        for kind, path in paths.items():
            self.say(f"report ({kind}): {path}")
        return paths

    def report_after_failure(self) -> None:
        """The memory-trace report of a run that raised (what it held when it failed)."""
        if self.progress is not None:
            self.progress.close()
        if self.engine is None:
            return
        try:
            self._write_report()
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to show
            print(f"chunkmem train: could not write the report after the failure: {error}")

    # ------------------------------------------------------------------ what it prints
    def _say_what_runs(
        self, engine: chunkmem.Engine, train_bytes: int, resumed: Path | None
    ) -> None:
        config = self.config
        capacity = engine.ledger.device.capacity
        where = f"{engine.residency.device.kind} device of {mib(capacity or 0)}"
        ranks = (
            f"{self.world_size} ranks, ZeRO stage {config.zero.stage}"
            if self.world_size > 1
            else "1 process"
        )
        data = self.settings.train.data or "Python stdlib source"
        self.say(
            f"chunkmem train: {describe(self.settings.model)}, {engine.num_parameters():,} "
            f"parameters, {config.precision}, on a {where}; {ranks}; {train_bytes:,} bytes of "
            f"{data}; run directory {self.out}"
        )
        if resumed is not None:
            self.say(f"resumed from {resumed} at step {engine.global_steps}")

    def _say_retrained(self, retrained: list[tuple[int, float, float]]) -> None:
        """After a resume from an older checkpoint: did the steps an earlier attempt also
        took give the same losses?"""
        if not retrained:
            return
        steps = f"steps {retrained[0][0]}-{retrained[-1][0]}"
        different = [(s, new, old) for s, new, old in retrained if new != old]
        if not different:
            self.say(
                f"{steps} retrained after the resume: losses equal the earlier run's, bit for bit"
            )
        else:
            step, new, old = different[0]
            self.say(
                f"{steps} retrained after the resume: {len(different)} losses differ from the "
                f"earlier run's (first at step {step}: {new!r} vs {old!r})"
            )

    def _evaluate(self, held_out: torch.Tensor) -> None:
        """Held-out loss and a sample, as every rank's engine sees them (ZeRO-3 gathers need
        every rank, so all run them; rank 0 prints)."""
        engine, model, train = self.engine, self.settings.model, self.settings.train
        assert engine is not None
        generator = torch.Generator().manual_seed(train.seed + 1)
        x, y = next(batches(held_out, train.batch, model.seq, generator))
        with torch.no_grad():
            loss = float(engine(x, y))
        uniform = float(torch.log(torch.tensor(256.0)))
        self.say(f"held-out loss {loss:.3f} (a uniform guess scores {uniform:.3f})")
        if model.build == "gpt" and train.sample_tokens:
            text = sample(engine, train.prompt.encode(), train.sample_tokens, model.seq)
            self.say(f"sample: {text!r}")
