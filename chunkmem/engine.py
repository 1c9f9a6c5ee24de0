"""The training engine users drive: ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

An explicit phase machine keeps the three calls in order; a call out of order raises
:class:`EngineUsageError` saying what to call instead. An exception inside forward, backward
or step aborts the cycle: tensor states are reset, gradients of the cycle are discarded and
any parameter slot that held a gradient gets its value back from the fp32 master, so the
engine can carry on with the next batch.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
import weakref
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chunkmem import engine_aborts, engine_reports, engine_state
from chunkmem.config import Config
from chunkmem.errors import EngineUsageError
from chunkmem.eval_cycles import EvalCycles
from chunkmem.hooks import ModuleHooks, UnhookedAccessMode, cast_floating, internal
from chunkmem.ledger import Ledger
from chunkmem.loss_scaler import DynamicLossScaler, StaticLossScale
from chunkmem.manager import ChunkManager
from chunkmem.optimizer import ChunkOptimizer
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.report import RunSummary, write_report
from chunkmem.saved_tensors import ActivationCounter, make_saved_tensor_hooks
from chunkmem.sizing import ChunkSizes
from chunkmem.states import TensorState
from chunkmem.step_gate import StepGate
from chunkmem.tracer import Tracer

# The engine wrapping each model: a second engine on the same model would fight the first
# over every parameter's ``.data`` (see ``chunkmem.initialize``).
_ENGINE_OF: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Engine]] = (
    weakref.WeakKeyDictionary()
)


def engine_of(model: torch.nn.Module) -> Engine | None:
    """The open engine wrapping ``model``, if any."""
    ref = _ENGINE_OF.get(model)
    return None if ref is None else ref()


class EnginePhase(enum.Enum):
    """Where the engine is within a micro-step.

    IDLE: no graph pending; a forward may start.
    FORWARD_DONE: a training forward ran; ``backward`` must follow.
    BACKWARD_DONE: gradients are stored in chunks; ``step`` must follow.
    STOPPED: an exception left a state the engine cannot train on (a collective failed, so
    the process group may be unusable; or a step failed after updating some parameters, so
    they no longer match one another). Every call raises, saying why; restore a checkpoint.
    """

    IDLE = "idle"
    FORWARD_DONE = "forward_done"
    BACKWARD_DONE = "backward_done"
    STOPPED = "stopped"


def input_signature(args: tuple, kwargs: dict) -> Hashable:
    """Shapes and dtypes of the batch: traces are kept per signature."""
    flat, _ = tree_flatten((args, kwargs))
    parts: list[Hashable] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            parts.append((tuple(value.shape), str(value.dtype)))
        elif isinstance(value, (int, float, str, bool, type(None))):
            parts.append(value)
        else:
            parts.append(type(value).__name__)
    return tuple(parts)


class Engine:
    """Wraps a model whose parameters and optimizer states live in chunks."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: Config,
        manager: ChunkManager,
        states: OptimizerStates,
        hooks: ModuleHooks,
        activations: ActivationCounter,
        optimizer: ChunkOptimizer,
        chunk_choice: ChunkSizes,
        grad_hook_handles: list[Any],
        lr_scheduler: Any = None,
    ) -> None:
        self.module = module
        self.config = config
        self.manager = manager
        self.params = manager.params
        self.grads = manager.grads
        self.gatherer = manager.gatherer
        self.reducer = manager.grads.reducer
        self.residency = manager.residency
        self.states = states
        self.hooks = hooks
        self.activations = activations
        self.optimizer = optimizer
        self.chunk_choice = chunk_choice
        self._grad_hook_handles = grad_hook_handles
        self.scaler = (
            DynamicLossScaler(config.loss_scale)
            if config.precision == "fp16"
            else StaticLossScale()
        )
        self.phase = EnginePhase.IDLE
        self.micro_steps = 0
        self.global_steps = 0
        self.gate = StepGate(config, optimizer, self.reducer, self.scaler)
        self.stopped_because: str | None = None
        self.cycles_started = 0  # aborted cycles included: collectives carry the number
        self._closed = False
        # Stepped after every optimizer update that was taken (``torch.optim.lr_scheduler`` or
        # one from ``chunkmem.schedulers``); its ``state_dict`` belongs in a checkpoint.
        self.lr_scheduler = lr_scheduler
        _ENGINE_OF[module] = weakref.ref(self)
        self._pack, self._unpack = make_saved_tensor_hooks(manager, activations, internal)
        self.eval_cycles = EvalCycles(self)

    # ---------------------------------------------------------------- accessors
    @property
    def ledger(self) -> Ledger:
        return self.residency.ledger

    @property
    def tracer(self) -> Tracer:
        return self.residency.tracer

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.params.compute_dtype

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm, before clipping (above the clip, it fired)."""
        return self.gate.last_grad_norm

    @property
    def last_speculation(self) -> str | None:
        """What became of the last step's speculative early updates: "commit", "rollback",
        or None where none were taken."""
        return self.gate.last_speculation

    @property
    def closed(self) -> bool:
        """Whether ``close`` gave the model back."""
        return self._closed

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> Engine:
        """``module.train(mode)``: dropout and the like; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """``module.eval()``; returns the engine. Run evaluation under ``torch.no_grad()``."""
        return self.train(False)

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as the next update will use it."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    # ---------------------------------------------------------------- the three calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_not_stopped()
        self.eval_cycles.abandon_interrupted()
        if self.phase is EnginePhase.FORWARD_DONE:
            raise EngineUsageError(
                "forward called again before backward; call engine.backward(loss) first, or "
                "engine.discard() to drop that batch (an evaluation forward under no grad "
                "waits for the training cycle to end too)"
            )
        if self.phase is EnginePhase.BACKWARD_DONE:
            raise EngineUsageError(
                "call engine.step() after engine.backward() before the next forward"
            )
        args, kwargs = cast_floating(
            (args, kwargs), self.compute_dtype, self.residency.device.torch_device
        )
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # the root's hooks run a no-grad cycle
        if not self.tracer.in_cycle:
            self._begin_cycle(("train", input_signature(args, kwargs)))
        recording = not self.tracer.replaying
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                mode = (
                    UnhookedAccessMode(self.manager, self.hooks)
                    if recording
                    else contextlib.nullcontext()
                )
                with mode, self.residency.device.meter.counting():
                    output = self.module(*args, **kwargs)
            if not self.params.all_packed:
                self.params.pack_remaining(self.residency.tiers.spill)
        except BaseException as error:
            engine_aborts.abort_cycle(self, error)
            raise
        self.phase = EnginePhase.FORWARD_DONE
        return output

    def _begin_cycle(self, key: Hashable) -> None:
        self._forget_calls_outside_the_engine()
        self.tracer.begin_cycle(key)
        self.cycles_started += 1
        self.states.sharding.begin_cycle(self.cycles_started)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (scaled for fp16, divided by the accumulation steps)."""
        self._check_not_stopped()
        if self.phase is not EnginePhase.FORWARD_DONE:
            raise EngineUsageError(
                f"engine.backward() needs a training forward first (the engine is {self.phase.value})"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise EngineUsageError(
                "engine.backward() takes the scalar loss tensor returned from the forward "
                "(it must require grad)"
            )
        factor = self.scaler.scale / self.config.gradient_accumulation_steps
        final = self.micro_steps + 1 == self.config.gradient_accumulation_steps
        self.optimizer.loss_scale = self.scaler.scale  # what an early update divides by
        try:
            self.gatherer.settle()  # no gather of the last step outlives its forward
            self.reducer.begin_backward(final_micro_batch=final)
            self.grads.accepting = True
            self.grads.stored_in_backward = 0
            self.manager.begin_backward()
            self.hooks.in_backward = True
            try:
                with (
                    torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack),
                    self.residency.device.meter.counting(),
                ):
                    (loss * factor if factor != 1.0 else loss).backward()
            finally:
                self.grads.accepting = False
                self.hooks.in_backward = False
            if not self.grads.stored_in_backward and self.params.trainable_layouts():
                raise EngineUsageError(
                    "engine.backward(loss) reached none of the model's trainable parameters: "
                    "the loss does not come from the engine's forward (a detach(), a clone "
                    "made to require grad, or a tensor computed apart from the model). "
                    "Nothing was updated and this batch's activations and gradients were "
                    "dropped; pass the loss computed from engine(...)'s output"
                )
            self.hooks.finish_backward()
            self.manager.release_all(TensorState.HOLD_AFTER_BWD)
            self.reducer.finish_backward()
            self.optimizer.check_early_reads()
        except BaseException as error:
            engine_aborts.abort_update(self, error, "engine.backward()")
            raise
        self.phase = EnginePhase.BACKWARD_DONE

    def step(self) -> bool:
        """Count a micro-step; at the accumulation boundary update the parameters.

        Returns True when the parameters were updated, False when only a micro-step was
        counted or an fp16 overflow skipped the update.
        """
        self._check_not_stopped()
        if self.phase is not EnginePhase.BACKWARD_DONE:
            raise EngineUsageError(
                f"engine.step() needs engine.backward() first (the engine is {self.phase.value})"
            )
        self.gate.begin_step()
        self.micro_steps += 1
        if self.micro_steps < self.config.gradient_accumulation_steps:
            self.phase = EnginePhase.IDLE
            return False
        try:
            if self.states.homes is None:
                peak = max(self.tracer.observed.nonmodel_peak, default=0)
                self.states.place(peak)
            self.reducer.before_step()
            found_inf, divisor = self.gate.decide(self.global_steps + 1)
            if found_inf:
                self.optimizer.restore_from_masters()
            else:
                self.optimizer.step(divisor)
            self.scaler.update(found_inf)
        except BaseException as error:
            engine_aborts.abort_update(self, error, "engine.step()")
            raise
        self._end_cycle()
        self.global_steps += 1
        if not found_inf:
            self._step_lr_scheduler()  # after the cycle: a scheduler that raises stops nothing
        return not found_inf

    # ---------------------------------------------------------------- internals
    def _step_lr_scheduler(self) -> None:
        """After an update that was taken (as DeepSpeed does: a skipped step does not advance
        the schedule). The engine runs the update itself, so torch's check that
        ``optimizer.step()`` came first cannot see it: its warning is wrong here."""
        if self.lr_scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before"
            )
            self.lr_scheduler.step()

    def _end_cycle(self) -> None:
        if self.reducer.state is not None:
            self.reducer.state.window_stepped()
        self.grads.clear()
        self.gatherer.end_cycle()
        self.manager.reset_states()
        self.residency.nonmodel.trace_peak()
        self.tracer.end_cycle()
        self.ledger.next_iteration()
        self.states.sharding.set_tag(self.ledger.iteration)
        self.end_window()

    def end_window(self) -> None:
        """The accumulation window is over (stepped, or aborted): the next forward starts one."""
        self.micro_steps = 0
        self.phase = EnginePhase.IDLE

    def _forget_calls_outside_the_engine(self) -> None:
        """A forward or backward of the bare model with grad (a refused stray backward) may
        leave hook frames and parameters in COMPUTE; no cycle runs, so nothing is in use."""
        if self.hooks.stack or self.hooks.open_calls or not self.params.states_hold():
            self.hooks.reset()
            self.manager.reset_states()

    def discard(self) -> None:
        """Drop everything since the last optimizer step: the pending forward's graph and
        activations, and the gradients of this accumulation window. The parameters and
        optimizer states are untouched, and the next forward starts a fresh cycle (e.g. after
        a loss that is not finite, or a batch the caller decides to skip)."""
        self._check_not_stopped()
        engine_aborts.discard(self)

    def _stop(self, reason: str) -> None:
        self.stopped_because = reason
        self.phase = EnginePhase.STOPPED

    def _check_not_stopped(self) -> None:
        if self.phase is EnginePhase.STOPPED:
            raise EngineUsageError(
                f"the engine stopped and cannot train on: {self.stopped_because}. Restore "
                f"the last checkpoint in a new engine (and a new process group)."
            )

    # ---------------------------------------------------------------- state
    def wait_for_parameters(self) -> None:
        """Wait until every parameter holds the last step's value. Only needed with
        ``zero.overlap_step_gather``, to read the module's parameter tensors themselves
        between ``step()`` and the next forward (the engine's own readers wait already)."""
        with engine_aborts.stopping_on_collective_failure(self):
            self.gatherer.settle()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict on the CPU: fp32 values of trainable parameters, buffers.

        Keys are those of ``module.state_dict()`` (tied parameters appear under each name).
        Under ZeRO the shards are gathered, so every rank must call it.
        """
        self.wait_for_parameters()
        return engine_state.state_dict(self)

    def save_checkpoint(self, directory: str | Path, client_state: Any = None) -> Path:
        """Write everything training needs to continue into the new directory ``directory``:
        parameter values (fp32 masters), Adam moments and step counts per parameter, the
        loss scaler, ``self.lr_scheduler`` if set, the global step, each rank's RNG states,
        ``client_state`` (e.g. the data position), the config and the world size. Every
        rank calls it between optimizer steps and writes only its own shard. Atomic: the
        directory appears complete or not at all. Returns its path (docs/checkpoints.md)."""
        return engine_state.save_checkpoint(self, directory, client_state)

    def load_checkpoint(self, directory: str | Path) -> Any:
        """Continue from a checkpoint written by :meth:`save_checkpoint`, at any world size,
        ZeRO stage or chunk size; returns its ``client_state``. Every rank calls it between
        optimizer steps, usually right after ``initialize``. A checkpoint that is incomplete
        or does not fit this model and config raises :class:`CheckpointError`, naming each
        difference, and changes nothing; a failure while reading stops the engine."""
        return engine_state.load_checkpoint(self, directory)

    def _check_between_steps(self, what: str) -> None:
        self._check_not_stopped()
        if self.phase is not EnginePhase.IDLE or self.micro_steps:
            raise EngineUsageError(
                f"engine.{what}() runs between optimizer steps, but the engine is "
                f"{self.phase.value} with {self.micro_steps} of "
                f"{self.config.gradient_accumulation_steps} micro-steps accumulated: finish "
                f"with engine.step() (or drop them with engine.discard()) first"
            )

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of chunks by kind, over both tiers (padding included)."""
        return engine_reports.model_state_bytes(self)

    def num_parameters(self) -> int:
        """Elements of the model's parameters (tied ones once), packed or not yet."""
        return self.params.num_parameters()

    def write_report(self, directory: str | Path) -> dict[str, Path]:
        """Write the memory-trace report (formats from the config); returns the paths."""
        return write_report(
            self.run_summary(), self.ledger, Path(directory), self.config.report.formats
        )

    def run_summary(self) -> RunSummary:
        """What a report needs to know about this run besides the ledger."""
        return engine_reports.run_summary(self)

    def close(self) -> None:
        """Give the model back: its parameters become ordinary tensors again, holding their
        current values (fp32 masters where there are any) in their original dtype and on
        their original device, every hook this engine put on the model is removed, and the
        tiers are closed (the NVMe tier's files are removed). The model may then be wrapped
        by a new engine. Under ZeRO every rank must call it (the shards are gathered).
        Closing twice does nothing."""
        if self._closed:
            return
        try:
            if self.phase is not EnginePhase.STOPPED:
                self.wait_for_parameters()
                engine_state.restore_parameters(self)
        finally:
            self._closed = True
            self.hooks.detach()
            for handle in self._grad_hook_handles:
                handle.remove()
            self._grad_hook_handles.clear()
            self.eval_cycles.remove_hooks()
            _ENGINE_OF.pop(self.module, None)
            self.residency.settle_drains()  # no copy off the device outlives the engine
            self.residency.tiers.close()  # after the values were read from them

    def chunk_summary(self) -> dict[str, Any]:
        """The chunk layouts and the size search that chose them."""
        return engine_reports.chunk_summary(self)
