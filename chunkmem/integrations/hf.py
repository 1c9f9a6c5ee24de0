"""``ChunkmemTrainer``: Hugging Face's ``Trainer`` (or a subclass, TRL's ``SFTTrainer``) training
with chunkmem's engine.

    trainer = ChunkmemTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                              chunkmem_config="ds_config_zero3.json")
    trainer.train()                                  # or train(resume_from_checkpoint=...)
    trainer.save_model("out")                        # model.safetensors: from_pretrained loads it

    class ChunkmemSFTTrainer(ChunkmemTrainerMixin, trl.SFTTrainer): ...

The Trainer keeps its loop, data, logging, evaluation and callbacks; the mixin changes what
touches parameters, gradients and optimizer states:

- the engine is built with the Trainer (``trainer.engine``), from the Trainer's optimizer
  (``TrainingArguments.optim``, an Adam/AdamW) or the config's, and the config (a DeepSpeed
  JSON's ``"auto"`` values filled as the Trainer fills them: chunkmem.integrations.hf_config);
- the model the Trainer calls is ``engine(**inputs)`` (``_EngineModel``), so evaluation,
  ``compute_loss`` overrides and prediction run through the engine;
- ``training_step`` runs ``engine.backward`` and ``engine.step`` (which counts micro-batches
  and updates at the accumulation boundary, clipping by the global norm); the Trainer's
  ``optimizer.step()`` then has nothing left to do, and its schedule steps the group dicts the
  engine reads;
- checkpoints: ``checkpoint-N/chunkmem`` is the engine's DCP checkpoint (masters, moments,
  RNG; the schedule in its client state), which ``resume_from_checkpoint`` loads; ``save_model``
  writes the consolidated weights with ``save_pretrained`` (safetensors).

The Trainer has no public hook for where the model is wrapped, how gradients are clipped or
how optimizer state is saved, so the mixin overrides the private methods that do that
(``_wrap_model``, ``_clip_grad_norm``, ``_get_grad_norm``, ``_save_optimizer_and_scheduler``,
``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``_move_model_to_device``); setup.cfg
pins the transformers versions this was tested with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

import chunkmem
from chunkmem.config import Config
from chunkmem.engine import Engine
from chunkmem.errors import CheckpointError, ConfigError
from chunkmem.integrations._shared import join_world_of_one, tell_schedules_the_engine_stepped
from chunkmem.integrations.hf_config import trainer_config
from chunkmem.schedulers import build_scheduler

# The engine's checkpoint inside the Trainer's checkpoint-N directory.
ENGINE_CHECKPOINT = "chunkmem"


class _EngineModel(torch.nn.Module):
    """What the Trainer calls as its model: ``engine(...)``, a training cycle (or, under no
    grad, an evaluation cycle); ``train()``/``eval()`` reach the wrapped model."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        count = kwargs.get("num_items_in_batch")
        if isinstance(count, torch.Tensor) and count.is_floating_point() and count == count.trunc():
            # The Trainer's token count arrives as a float; the engine casts floating inputs to
            # the compute dtype, and bf16 would round a count above 256.
            kwargs["num_items_in_batch"] = count.long()
        return self.engine(*args, **kwargs)


class _EngineOptimizer:
    """The Trainer's optimizer: the torch optimizer's param groups (the engine reads those
    dicts, and the schedule writes them), and nothing to step or zero, because
    ``training_step`` already ran ``engine.step()`` and the engine holds the gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """The groups' hyper-parameters (masters and moments are in the engine's checkpoint)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self, closure: Any = None) -> None:
        """Done in ``training_step``."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears its gradient chunks at each update."""


class _WindowLoss(torch.autograd.Function):
    """[Note: a loss normalized over the accumulation window] With ``num_items_in_batch`` the
    Trainer divides each micro-batch's summed token loss by the whole window's token count, so
    the window's loss is the sum of the micro-batch losses and reaches backward undivided (as
    DeepSpeed's ``backward(scale_wrt_gas=False)``). The engine multiplies every loss by
    ``loss_scale / gradient_accumulation_steps``; this identity hands exactly ``loss_scale`` on
    to the loss's own graph instead. (Multiplying the loss by the steps first would round the
    gradient's seed for some step counts: 41 is the first in fp32.)"""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.full_like(grad, ctx.scale), None


class ChunkmemTrainerMixin:
    """Put before a ``transformers.Trainer`` class: ``class T(ChunkmemTrainerMixin, SFTTrainer)``.

    ``chunkmem_config``: what ``chunkmem.initialize`` takes (a dict, a JSON path, a DeepSpeed
    JSON with ``"auto"`` values, a ``chunkmem.Config``); TrainingArguments set precision
    (``bf16``), ``gradient_accumulation_steps`` and ``max_grad_norm``, which the config may
    repeat but not contradict. The mixin's ``training_step`` replaces the Trainer's (a subclass
    below it in the order of bases keeps its ``compute_loss``, not its ``training_step``).
    """

    engine: Engine

    def __init__(
        self,
        *args: Any,
        chunkmem_config: Config | dict[str, Any] | str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        _refuse_what_cannot_work(self.args)
        self._chunkmem = trainer_config(chunkmem_config, self.args)
        config = self._chunkmem.engine
        if self.optimizer is not None and "optimizer" in config.model_fields_set:
            raise ConfigError(
                "the Trainer got an optimizer (optimizers=...) and the chunkmem config sets "
                "'optimizer' too; keep one"
            )
        if self.optimizer is None and "optimizer" in config.model_fields_set:
            self.optimizer = _optimizer_from(config, self.model)
        torch_optimizer = super().create_optimizer()
        join_world_of_one(config)
        self.engine = chunkmem.initialize(self.model, optimizer=torch_optimizer, config=config)
        self._torch_optimizer = torch_optimizer
        self.optimizer = _EngineOptimizer(torch_optimizer)
        self.callback_handler.optimizer = self.optimizer
        self._engine_model = _EngineModel(self.engine)

    # ------------------------------------------------------------- optimizer and schedule
    def create_optimizer(self, model: Any = None) -> Any:
        """Built with the engine, in ``__init__``."""
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The config's schedule (its DeepSpeed step counts filled now), else the Trainer's
        (``lr_scheduler_type``), over the torch optimizer's groups the engine reads."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        schedule = self._chunkmem.schedule(self.args, num_training_steps)
        if schedule is None:
            return super().create_scheduler(num_training_steps, optimizer=self._torch_optimizer)
        self.lr_scheduler = build_scheduler(schedule, self._torch_optimizer)
        self._created_lr_scheduler = True  # the Trainer rebuilds it at the next train()
        return self.lr_scheduler

    # ------------------------------------------------------------- the step
    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward through the engine, ``engine.backward``, ``engine.step``; returns the loss
        as the Trainer's ``training_step`` does (a window's share, for its logs)."""
        accumulation = self.engine.config.gradient_accumulation_steps
        if self.current_gradient_accumulation_steps != accumulation:
            raise ConfigError(
                f"this accumulation window has {self.current_gradient_accumulation_steps} of "
                f"{accumulation} micro-batches (the last of an epoch whose batches are not a "
                f"multiple of gradient_accumulation_steps): the engine updates on whole "
                f"windows only. Make the batches per epoch a multiple (dataset size, "
                f"dataloader_drop_last), or set max_steps to end before it"
            )
        model.train()
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # the Trainer's rule
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        self.engine.backward(_WindowLoss.apply(loss, self.engine.loss_scale) if scaled else loss)
        if self.engine.step():
            tell_schedules_the_engine_stepped(self._torch_optimizer)
        return (loss if scaled else loss / accumulation).detach()

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The engine is the wrapper (not DDP, not accelerate's autocast)."""
        return self._engine_model

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """The engine places every parameter in its chunks."""

    def _clip_grad_norm(self, model: Any) -> float | None:
        """The engine clipped at its step; this is the norm before clipping."""
        return self.engine.last_grad_norm

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self.engine.last_grad_norm

    # ------------------------------------------------------------- saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank (under ZeRO the shards are gathered): the consolidated weights, fp32
        where the engine keeps masters, written with ``save_pretrained`` (safetensors, the
        config, the processing class) for ``from_pretrained``; PEFT writes the adapters.
        Every rank returns once the files are written, so any rank may load them."""
        state = self.engine.state_dict()
        self._save(output_dir or self.args.output_dir, state_dict=state)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank: the engine's checkpoint, with the schedule's state as client state."""
        self.engine.save_checkpoint(
            Path(output_dir) / ENGINE_CHECKPOINT,
            client_state={"lr_scheduler": self.lr_scheduler.state_dict()},
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights come with the engine's checkpoint (``_load_optimizer_and_scheduler``)."""
        _engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        client_state = self.engine.load_checkpoint(_engine_checkpoint(checkpoint))
        self.lr_scheduler.load_state_dict(client_state["lr_scheduler"])


class ChunkmemTrainer(ChunkmemTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with chunkmem (see :class:`ChunkmemTrainerMixin`)."""


def _engine_checkpoint(checkpoint: str | Path) -> Path:
    path = Path(checkpoint) / ENGINE_CHECKPOINT
    if not path.is_dir():
        raise CheckpointError(
            f"{checkpoint} holds no chunkmem checkpoint ({path} is missing): "
            f"resume_from_checkpoint takes a checkpoint-N directory a ChunkmemTrainer saved"
        )
    return path


def _optimizer_from(config: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The config's optimizer, over every trainable parameter (DeepSpeed's one group)."""
    settings = config.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    if settings.type == "sgd":
        return torch.optim.SGD(
            trainable,
            lr=settings.lr,
            momentum=settings.momentum,
            nesterov=settings.nesterov,
            weight_decay=settings.weight_decay,
        )
    optimizer_class = torch.optim.AdamW if settings.type == "adamw" else torch.optim.Adam
    return optimizer_class(
        trainable,
        lr=settings.lr,
        betas=tuple(settings.betas),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


def _refuse_what_cannot_work(args: Any) -> None:
    """TrainingArguments the engine cannot serve, each refused by name before training."""
    refusals = {
        "deepspeed": "pass the DeepSpeed JSON as chunkmem_config instead",
        "fsdp": "chunkmem shards with its own ZeRO stages (zero.stage)",
        "fp16": "accelerate would add its GradScaler beside chunkmem's loss scaler; use bf16, "
        "or drive chunkmem.initialize with precision fp16 yourself",
        "fp16_full_eval": "the engine computes in one dtype in training and evaluation",
        "bf16_full_eval": "the engine computes in one dtype in training and evaluation",
        "torch_compile": "torch.compile around the engine's hooks is planned, not built",
        "auto_find_batch_size": "the engine is sized once, when the Trainer is built",
        "label_smoothing_factor": "the label smoother looks for the model's class under the "
        "engine's wrapper and would not shift a causal LM's labels",
        "load_best_model_at_end": "resume_from_checkpoint the best checkpoint-N instead",
        "activation_offloading": "the engine counts the saved activations it keeps (TRL's "
        "offloading would move them behind its back)",
    }
    for name, why in refusals.items():
        if getattr(args, name, None):
            raise ConfigError(
                f"TrainingArguments({name}={getattr(args, name)!r}) does not work with "
                f"ChunkmemTrainer: {why}"
            )
    if args.n_gpu > 1:
        raise ConfigError(
            f"the Trainer sees {args.n_gpu} GPUs in one process and would use DataParallel; "
            f"launch one process per GPU with torchrun and set zero.stage 1-3"
        )
