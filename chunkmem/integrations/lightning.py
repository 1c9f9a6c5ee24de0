"""``ChunkmemStrategy``: Lightning's ``Trainer`` training a ``LightningModule`` with chunkmem.

    trainer = lightning.Trainer(strategy=ChunkmemStrategy(config={...}), devices=2)
    trainer.fit(module)                        # one process, Lightning's launcher or torchrun
    trainer.fit(module, ckpt_path="ckpt/...")  # resumes from a chunkmem (DCP) checkpoint

The strategy keeps Lightning's contract (the one its DeepSpeed and FSDP strategies keep): it
builds the engine in ``setup`` from the module and the one optimizer ``configure_optimizers``
returns, runs every ``*_step`` through the engine, turns the closure's backward and the
optimizer step into ``engine.backward`` and ``engine.step``, handles gradient accumulation and
clipping itself, and saves and loads checkpoints as chunkmem's DCP directories with
Lightning's own state (loops, callbacks, schedulers) as their client state
(``chunkmem.integrations.lightning_checkpoints``). What cannot work is refused by name in
``setup`` (docs/integrations.md lists it).

[Note: the root the engine wraps] The engine wraps ``_StepRoot``, a module that shares the
LightningModule's parameter, buffer and child dicts (so every name, in state dicts and
checkpoints, is the LightningModule's own) and whose forward runs the step the strategy asks
for. The LightningModule itself stays outside the engine's hooks: a ``validation_step`` that
calls ``self(x)`` or ``self.model(x)`` runs inside one evaluation cycle, never a nested one.
The step's batch is the root's only input, so the trace is keyed by the batch's shapes and not
by ``batch_idx``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import chunkmem
from chunkmem.config import Config
from chunkmem.engine import Engine
from chunkmem.errors import ConfigError
from chunkmem.integrations._shared import join_world_of_one, tell_schedules_the_engine_stepped
from chunkmem.integrations.lightning_checkpoints import (
    load_checkpoint_directory,
    save_checkpoint_directory,
)

# Lightning's precision flags that mean "the engine's precision": chunkmem computes in one
# dtype with fp32 masters, which is what DeepSpeed calls bf16/fp16 too.
_PRECISIONS = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


class _StepRoot(torch.nn.Module):
    """What the engine wraps: the LightningModule's parameters, buffers and children under
    their own names, and a forward that runs ``step`` (see [Note: the root the engine
    wraps])."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self.step: Callable[[Any], Any] | None = None

    def forward(self, batch: Any) -> Any:
        assert self.step is not None, "a step runs only through ChunkmemStrategy"
        return self.step(batch)


class _EnginePrecision(Precision):
    """Lightning's backward and optimizer step, done by the engine: the loss is scaled and the
    gradients clipped there, so this plugin's clipping does nothing."""

    def __init__(self, strategy: ChunkmemStrategy, precision: str) -> None:
        super().__init__()
        self._strategy = strategy
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, *args, **kwargs) -> None:
        self._strategy.engine.backward(self._strategy.take_step_loss())

    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs
    ) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if result is None:  # training_step returned None: skip the batch
            return self._strategy.skip_batch()
        updated = self._strategy.engine.step()
        if updated:
            tell_schedules_the_engine_stepped(optimizer)
        return updated

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """The engine clips by the global norm at its step (``Trainer(gradient_clip_val)``)."""


class ChunkmemStrategy(ParallelStrategy):
    """Train a LightningModule with chunkmem, in one process or one per device.

    ``config``: what ``chunkmem.initialize`` takes (a dict, a JSON path, a DeepSpeed JSON or a
    ``chunkmem.Config``). Lightning's own flags fill what it sets: ``Trainer(precision=
    'bf16-mixed')`` is ``precision: bf16``, ``accumulate_grad_batches`` is
    ``gradient_accumulation_steps`` and ``gradient_clip_val`` is ``gradient_clipping``; the
    config may repeat them but not contradict them. Several devices need ``zero.stage`` 1-3.
    The engine is ``strategy.engine`` between ``setup`` and ``teardown``; at teardown it is
    closed and the LightningModule holds the trained values as ordinary tensors.
    """

    def __init__(
        self,
        config: Config | dict[str, Any] | str | Path | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
        )
        self._config_source = config
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.config: Config | None = None
        self.engine: Engine | None = None
        self._root: _StepRoot | None = None
        self._step_loss: torch.Tensor | None = None

    # ------------------------------------------------------------- processes and devices
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning adds a DistributedSampler to the loaders when this is true."""
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        """Lightning's launcher starts the other processes (and sets LOCAL_RANK, which
        chunkmem.initialize picks the GPU by, as torchrun does); one process needs none."""
        assert self.cluster_environment is not None
        several = self.num_processes * self.num_nodes > 1
        if several and not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        """Join the process group, then read the config (a DeepSpeed config's batch rule
        reads the world size); a single process asking for ZeRO gets a group of one."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self.world_size > 1:
            assert self.cluster_environment is not None
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(
                self.root_device
            )
            _init_dist_connection(self.cluster_environment, backend)
        self.config = Config.coerce(self._config_source)
        join_world_of_one(self.config)

    def model_to_device(self) -> None:
        """Nothing to move: the engine places every parameter in its chunks."""

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------- setup and teardown
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.config is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        optimizer = None
        if fitting:
            self.setup_optimizers(trainer)
            optimizer = self._the_optimizer()
        _refuse_what_cannot_work(trainer, module, self, fitting)
        precision = self.precision_plugin.precision
        self.precision_plugin = _EnginePrecision(self, precision)
        config = self._engine_config(trainer, precision, optimizer is not None)
        self._root = _StepRoot(module)
        self.engine = chunkmem.initialize(self._root, optimizer=optimizer, config=config)

    def _the_optimizer(self) -> torch.optim.Optimizer | None:
        """The one optimizer configure_optimizers returned (None: the config's optimizer)."""
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; "
                f"ChunkmemStrategy trains with one (a second optimizer is not supported): "
                f"return one torch.optim.Adam or AdamW, with any number of param groups"
            )
        optimizer = self.optimizers[0]
        return None if isinstance(optimizer, _MockOptimizer) else optimizer

    def _engine_config(self, trainer: pl.Trainer, precision: str, has_optimizer: bool) -> Config:
        """The config with what Lightning's flags set; a contradiction is refused."""
        config = self.config
        assert config is not None
        given = config.model_fields_set
        updates: dict[str, Any] = {}
        wanted = _PRECISIONS[precision]
        if wanted is not None:
            if "precision" in given and config.precision != wanted:
                raise ConfigError(
                    f"Trainer(precision={precision!r}) asks for {wanted} but the chunkmem "
                    f"config's precision is {config.precision!r}; set one of the two"
                )
            updates["precision"] = wanted
        accumulation = trainer.accumulate_grad_batches
        if config.gradient_accumulation_steps not in (1, accumulation):
            raise ConfigError(
                f"the chunkmem config's gradient_accumulation_steps is "
                f"{config.gradient_accumulation_steps} and Trainer(accumulate_grad_batches="
                f"{accumulation}): set Trainer(accumulate_grad_batches=...) (Lightning counts "
                f"optimizer steps and steps schedulers by it) and leave it out of the config"
            )
        updates["gradient_accumulation_steps"] = accumulation
        clip = trainer.gradient_clip_val
        if clip:
            if config.gradient_clipping and config.gradient_clipping != clip:
                raise ConfigError(
                    f"Trainer(gradient_clip_val={clip}) and the chunkmem config's "
                    f"gradient_clipping {config.gradient_clipping} differ; set one of the two"
                )
            updates["gradient_clipping"] = float(clip)
        if has_optimizer and "optimizer" in given:
            raise ConfigError(
                "configure_optimizers returned an optimizer and the chunkmem config sets "
                "'optimizer' too; keep one (return None from configure_optimizers to train "
                "with the config's)"
            )
        if self.world_size > 1 and not config.zero.stage:
            raise ConfigError(
                f"ChunkmemStrategy on {self.world_size} processes needs config key "
                f"'zero.stage' 1, 2 or 3 (it is 0: every rank would train alone)"
            )
        updates["device"] = config.device.model_copy(
            update={"type": _device_type(config, self.root_device)}
        )
        return config.model_copy(update=updates)

    def teardown(self) -> None:
        """Close the engine (every rank: under ZeRO the shards are gathered): the module's
        parameters become ordinary tensors holding the trained values."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self._root = None
        super().teardown()

    def on_train_start(self) -> None:
        """An epoch must end on an optimizer step: the engine's accumulation window does not
        restart with Lightning's epoch, so the two would disagree on when steps happen."""
        trainer = self.lightning_module.trainer
        batches, accumulation = trainer.num_training_batches, trainer.accumulate_grad_batches
        if batches != float("inf") and batches % accumulation:
            raise ConfigError(
                f"{batches} training batches per epoch is not a multiple of "
                f"accumulate_grad_batches={accumulation}: ChunkmemStrategy updates on whole "
                f"accumulation windows only. Make the epoch a multiple (limit_train_batches, "
                f"the loader's drop_last) or change accumulate_grad_batches"
            )

    # ------------------------------------------------------------- steps
    @property
    def handles_gradient_accumulation(self) -> bool:
        """The engine counts micro-batches; Lightning calls the optimizer step every batch."""
        return True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._run("training_step", args, kwargs)
        self._step_loss = output if isinstance(output, torch.Tensor) else None
        if isinstance(output, Mapping):
            self._step_loss = output.get("loss")
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with _evaluation():
            return self._run("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with _evaluation():
            return self._run("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with _evaluation():
            return self._run("predict_step", args, kwargs)

    def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
        """``module.<name>(batch, *rest)`` inside ``engine(batch)``: one cycle of the engine."""
        assert self.engine is not None and self._root is not None
        method = getattr(self.lightning_module, name)
        batch, rest = args[0], args[1:]
        self._root.step = lambda cast_batch: method(cast_batch, *rest, **kwargs)
        try:
            return self.engine(batch)
        finally:
            self._root.step = None

    def take_step_loss(self) -> torch.Tensor:
        """The loss ``training_step`` returned, for ``engine.backward``.

        Lightning's closure divides the loss by ``accumulate_grad_batches`` before backward;
        the engine divides by its accumulation steps itself, so it gets the loss as the step
        returned it (the same bits as a loop that calls ``engine.backward(loss)``)."""
        loss, self._step_loss = self._step_loss, None
        if loss is None:
            raise ConfigError(
                "ChunkmemStrategy runs the backward of the loss training_step returns (a "
                "tensor, or a dict's 'loss'); this training_step returned neither"
            )
        return loss

    def skip_batch(self) -> None:
        """``training_step`` returned None: drop this batch's forward (only a whole
        accumulation window can be dropped, so with accumulation it is refused)."""
        assert self.engine is not None
        if self.engine.config.gradient_accumulation_steps > 1:
            raise ConfigError(
                "training_step returned None (skip this batch) while accumulating gradients: "
                "the engine can only drop a whole accumulation window. Return a loss, or "
                "train with accumulate_grad_batches=1"
            )
        self._step_loss = None
        self.engine.discard()

    # ------------------------------------------------------------- checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The engine must exist before it can load."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """Masters, moments and step counts come back with the engine's checkpoint."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the DCP checkpoint holds the weights (``chunkmem.consolidate`` writes them
        as one file); gathering them here would cost a full copy per save."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Every rank: the engine's checkpoint directory at ``filepath``, with the rest of
        Lightning's checkpoint as its client state. A directory already there (``last.ckpt``)
        is replaced once the new one is complete."""
        save_checkpoint_directory(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Every rank: load the engine's checkpoint; its client state is Lightning's dict."""
        return load_checkpoint_directory(self, checkpoint_path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Done by ``load_checkpoint``."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Done by ``load_checkpoint``."""


def _refuse_what_cannot_work(
    trainer: pl.Trainer, module: pl.LightningModule, strategy: ChunkmemStrategy, fitting: bool
) -> None:
    """Lightning features the engine cannot serve, each refused by name before training."""
    precision = strategy.precision_plugin
    if type(precision) not in (Precision, MixedPrecision) or precision.precision not in _PRECISIONS:
        raise ConfigError(
            f"Trainer(precision={precision.precision!r}) ({type(precision).__name__}) does not "
            f"work with ChunkmemStrategy: chunkmem computes in one dtype with fp32 masters. "
            f"Use precision '32-true' (and the chunkmem config's 'precision'), 'bf16-mixed' "
            f"or '16-mixed'"
        )
    if not fitting:
        return
    if not module.automatic_optimization:
        raise ConfigError(
            "manual optimization (automatic_optimization = False) does not work with "
            "ChunkmemStrategy: manual_backward would run inside the engine's forward. Use "
            "automatic optimization, or drive chunkmem.initialize's engine yourself"
        )
    for hook, why in (
        ("backward", "the engine runs the backward (loss scaling, gradients into chunks)"),
        ("configure_gradient_clipping", "gradients live in chunks; set gradient_clip_val"),
    ):
        if is_overridden(hook, module, pl.LightningModule):
            raise ConfigError(
                f"{type(module).__name__}.{hook} is overridden, which ChunkmemStrategy cannot "
                f"honour: {why}"
            )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise ConfigError(
            f"Trainer(gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}): "
            f"ChunkmemStrategy clips by the global norm only ('norm')"
        )
    if strategy._layer_sync is not None:
        raise ConfigError(
            "Trainer(sync_batchnorm=True) does not work with ChunkmemStrategy (it would "
            "replace modules after the engine took their parameters)"
        )


def _device_type(config: Config, root: torch.device) -> str:
    """The engine's device follows Lightning's: CUDA for a GPU, the simulated device (which
    needs a capacity) for the CPU."""
    wanted = "cuda" if root.type == "cuda" else "simulated"
    if config.device.type not in ("auto", wanted):
        raise ConfigError(
            f"the chunkmem config's device.type is {config.device.type!r} but Lightning runs "
            f"on {root}; use device.type {wanted!r} or 'auto'"
        )
    return wanted


@contextlib.contextmanager
def _evaluation() -> Iterator[None]:
    """No grad, and no inference mode: chunks that move during an evaluation must stay
    usable for training (a tensor made under inference mode cannot be written outside it)."""
    with torch.inference_mode(False), torch.no_grad():
        yield
