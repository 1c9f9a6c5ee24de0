"""What an optimizer's update is, for the chunked engine: an :class:`UpdateRule` names the
update (recorded in checkpoints), the moment chunks it keeps per element, a parameter group's
hyper-parameters as the fused kernels take them, and its two kernels over aligned lists:
torch's (states on the device, or no native library) and the native host one. Adam/AdamW
(with 1-bit Adam's frozen-variance second stage) and SGD with momentum are the rules; the
update builders (``chunkmem.update_builder``, ``chunkmem.torch_update``) call them through
:class:`ParamGroups` and never ask which one runs."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from chunkmem.chunk import ChunkKind, TensorSlot
from chunkmem.errors import ConfigError
from chunkmem.frozen_adam import frozen_variance_adam_
from chunkmem.grads import GradStore

if TYPE_CHECKING:
    from chunkmem.config import OptimizerConfig

# A kernel over one parameter group's aligned lists: (params, grads, moments, steps, **kw),
# ``moments`` one list per kind of ``UpdateRule.moments``, in that order.
Kernel = Callable[..., None]


class UpdateRule(ABC):
    """One optimizer's update over flat pieces (elementwise, so any cut of a parameter
    updates the same as the whole)."""

    name: str  # recorded in checkpoints: a checkpoint loads only into the same rule
    moments: tuple[ChunkKind, ...]  # state chunks per trainable element, besides the master
    hyper_parameter_keys: tuple[str, ...]  # a group's keys checkpoints save and restore
    # Whether the native kernel can write new states out of place and save the gradients it
    # reads (a speculative early update, offload/speculation.py), and measure their norms as
    # it reads them.
    out_of_place: bool

    @abstractmethod
    def hyper_parameters(self, group: dict[str, Any]) -> dict[str, Any]:
        """A parameter group's hyper-parameters as the fused kernels' keyword arguments."""

    @abstractmethod
    def torch_kernel(self, grads: GradStore) -> Kernel:
        """torch's fused kernel of this step (read once per layout update)."""

    @abstractmethod
    def host_kernel(self, kernels: ModuleType, grads: GradStore) -> Kernel:
        """The native host kernel of this step (``kernels.host_optim``)."""

    def host_rows_kernel(self, kernels: ModuleType, grads: GradStore) -> Kernel | None:
        """The native host kernel of this step over rows by address (``AdamRows``, no tensor
        view a row), or None where this step's kernel takes tensors (:meth:`host_kernel`)."""
        return None


class AdamRule(UpdateRule):
    """Adam, or AdamW (``decoupled``), and 1-bit Adam's frozen-variance step once the
    reducer's schedule freezes the variance (``chunkmem.frozen_adam``)."""

    moments = (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
    hyper_parameter_keys = ("lr", "betas", "eps", "weight_decay")
    out_of_place = True

    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.name = "adamw" if decoupled else "adam"

    def hyper_parameters(self, group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
        }

    def _kernel(self, grads: GradStore, adam: Kernel, adamw: Kernel) -> Kernel:
        variance = grads.reducer.variance
        frozen = None if variance is None else variance.steps_frozen()
        if frozen is None:
            return adamw if self.decoupled else adam
        return functools.partial(
            frozen_variance_adam_,
            decoupled=self.decoupled,
            steps_frozen=frozen,
            momentum_in_gradients=variance.momentum_in_gradients,
        )

    def torch_kernel(self, grads: GradStore) -> Kernel:
        kernel = self._kernel(grads, torch._fused_adam_, torch._fused_adamw_)

        def call(params, grad_list, moments, steps, grad_scale, **hyper) -> None:
            exp_avgs, exp_avg_sqs = moments
            kernel(params, grad_list, exp_avgs, exp_avg_sqs, [], steps, **hyper,
                   amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)  # fmt: skip

        return call

    def host_kernel(self, kernels: ModuleType, grads: GradStore) -> Kernel:
        kernel = self._kernel(grads, kernels.fused_adam_, kernels.fused_adamw_)

        def call(params, grad_list, moments, steps, **options) -> None:
            exp_avgs, exp_avg_sqs = moments
            kernel(params, grad_list, exp_avgs, exp_avg_sqs, [], steps, **options)

        return call

    def host_rows_kernel(self, kernels: ModuleType, grads: GradStore) -> Kernel | None:
        """Adam or AdamW over rows by address; None while 1-bit Adam's variance is frozen
        (its step, ``chunkmem.frozen_adam``, composes tensor kernels)."""
        if self._kernel(grads, kernels.fused_adam_, kernels.fused_adamw_) not in (
            kernels.fused_adam_,
            kernels.fused_adamw_,
        ):
            return None
        return functools.partial(kernels.adam_rows_, decoupled=self.decoupled)


class SgdRule(UpdateRule):
    """SGD with momentum, Nesterov and L2 weight decay: ``torch.optim.SGD``'s update, the
    momentum buffer one fp32 moment (none where no group has momentum).

    A buffer starts at zero, where torch's starts as the first gradient: with dampening 0,
    ``momentum * 0 + grad`` is the gradient bit for bit, so the first step is torch's
    without a first-step flag; dampening other than 0 is refused (:func:`check_sgd_group`).
    """

    name = "sgd"
    hyper_parameter_keys = ("lr", "momentum", "dampening", "nesterov", "weight_decay")
    out_of_place = False  # the native SGD kernel updates in place only

    def __init__(self, with_momentum: bool) -> None:
        self.moments = (ChunkKind.MOMENTUM_BUFFER,) if with_momentum else ()

    def hyper_parameters(self, group: dict[str, Any]) -> dict[str, Any]:
        momentum = float(group["momentum"])
        if momentum != 0 and not self.moments:
            raise ConfigError(
                f"an SGD param group has momentum {momentum}, but no group had momentum at "
                f"initialize, so the engine keeps no momentum buffer (a scheduler that cycles "
                f"momentum, or a checkpoint's, sets it later). Build the optimizer with the "
                f"momentum it will have (> 0), or keep it 0"
            )
        return {
            "lr": float(group["lr"]),
            "momentum": momentum,
            "dampening": float(group["dampening"]),
            "nesterov": bool(group["nesterov"]),
            "weight_decay": float(group["weight_decay"]),
        }

    def torch_kernel(self, grads: GradStore) -> Kernel:
        def call(params, grad_list, moments, steps, grad_scale, **hyper) -> None:
            buffers = moments[0] if hyper["momentum"] != 0 else []
            torch._fused_sgd_(params, grad_list, buffers, **hyper, maximize=False,
                              is_first_step=False, grad_scale=grad_scale, found_inf=None)  # fmt: skip

        return call

    def host_kernel(self, kernels: ModuleType, grads: GradStore) -> Kernel:
        def call(params, grad_list, moments, steps, *, new_states=None, grads_saved=None,
                 grad_norms=None, **options) -> None:  # fmt: skip
            if new_states is not None or grads_saved is not None or grad_norms is not None:
                raise ValueError(
                    "the native SGD kernel updates in place only: no new states out of place, "
                    "saved gradients or measured norms (a speculative early update needs them)"
                )
            buffers = moments[0] if options["momentum"] != 0 else []
            kernels.fused_sgd_(params, grad_list, buffers, is_first_step=False, **options)

        return call


def check_sgd_group(index: int, group: dict[str, Any]) -> None:
    """Refuse, by name, what chunkmem's SGD does not do."""
    if group.get("dampening", 0):
        raise ConfigError(
            f"optimizer param group {index} sets dampening={group['dampening']}: chunkmem's "
            f"SGD starts each momentum buffer at zero, which is torch's first step only "
            f"without dampening; set dampening to 0"
        )
    if group.get("nesterov") and not group.get("momentum"):
        raise ConfigError(
            f"optimizer param group {index} sets nesterov=True with momentum 0; Nesterov "
            f"momentum needs momentum > 0"
        )


class ParamGroups:
    """The optimizer's parameter groups as the kernels take them. ``param_groups`` is the
    optimizer's list, read at every step (a scheduler may change it); ``group_of`` maps
    ``id(parameter)`` to its group's index."""

    def __init__(
        self,
        rule: UpdateRule,
        param_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        grads: GradStore,
    ) -> None:
        self.rule = rule
        self.param_groups = param_groups
        self.group_of = group_of
        self.grads = grads

    def by_group(self, slots: Sequence[TensorSlot]) -> dict[int, list[int]]:
        """Positions in ``slots`` by parameter group (slots may repeat: pieces)."""
        by_group: dict[int, list[int]] = {}
        for position, slot in enumerate(slots):
            by_group.setdefault(self.group_of[id(slot.param)], []).append(position)
        return by_group

    def hyper_parameters(self, group_index: int) -> dict[str, Any]:
        return self.rule.hyper_parameters(self.param_groups[group_index])

    def torch_kernel(self) -> Kernel:
        return self.rule.torch_kernel(self.grads)

    def host_kernel(self, kernels: ModuleType) -> Kernel:
        return self.rule.host_kernel(kernels, self.grads)

    def host_rows_kernel(self, kernels: ModuleType) -> Kernel | None:
        return self.rule.host_rows_kernel(kernels, self.grads)


def config_param_group(config: OptimizerConfig) -> tuple[dict[str, Any], UpdateRule]:
    """The one parameter group ``config.optimizer`` describes, and its rule."""
    if config.type == "sgd":
        group = {"lr": config.lr, "momentum": config.momentum, "dampening": 0.0,
                 "nesterov": config.nesterov, "weight_decay": config.weight_decay}  # fmt: skip
        return group, SgdRule(config.momentum != 0)
    group = {"lr": config.lr, "betas": config.betas, "eps": config.eps,
             "weight_decay": config.weight_decay}  # fmt: skip
    return group, AdamRule(config.type == "adamw")


def moment_count(config: OptimizerConfig) -> int:
    """Moment chunks per trainable element the configured optimizer keeps."""
    return len(config_param_group(config)[1].moments)
