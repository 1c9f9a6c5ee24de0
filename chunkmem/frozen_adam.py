"""Adam with its second moment frozen: 1-bit Adam's second stage (Tang et al., 2021).

After the exact warm-up, gradients compressed to signs would make Adam's variance track the
codes, not the gradients; 1-bit Adam keeps the variance the warm-up built and lets only the
first moment move. With the variance fixed the update is linear in the first moment, which is
linear in the gradients, so the error feedback's guarantee (the compressed gradients sum to the
exact ones up to a bounded residual) carries through to the parameters.

:func:`frozen_variance_adam_` takes the arguments of :func:`kernels.host_optim.fused_adamw_`
(so the update builder swaps it in for torch's or the native kernel) and computes what they do
with the second-moment line dropped and its bias correction held at ``frozen_steps``. It runs
torch's elementwise ops a slice at a time, so its temporaries stay within ``SLICE_ELEMENTS``
whatever the tensor's size.

An element whose frozen second moment is 0 (no warm-up gradient reached it: the row of a token
the warm-up never saw) has no scale for its steps, and takes none. A frozen 0 would step it by
``lr * m / eps``, some 10^5 ``lr``; an estimate from its first compressed gradient (which may be
a near-cancelled sum of sign codes) was measured to step it by 22 ``lr`` a step later. The
first frozen step warns with the count.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from kernels import host_optim
from kernels.host_optim import NewStates

SLICE_ELEMENTS = 1 << 18  # fp32 temporaries of 1 MiB each

_log = logging.getLogger("chunkmem")


def frozen_variance_adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    decoupled: bool,
    steps_frozen: int,
    momentum_in_gradients: float | None = None,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_out: Sequence[torch.Tensor] | None = None,
    new_states: NewStates | None = None,
    grads_saved: Sequence[torch.Tensor | None] | None = None,
    grad_norms: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam (``decoupled``: AdamW) step in place that reads ``exp_avg_sqs`` and leaves them
    as they are, with the bias correction of the step that last moved them: each parameter's
    own ``1 - beta2 ** (step - steps_frozen)``, ``steps_frozen`` counting this step and the
    earlier frozen ones (a parameter's step count, not the compressor's, so a run resumed from
    a checkpoint without the compressor's count still corrects by its own last exact step). Gradients are divided
    by ``grad_scale`` (not in place) and widened to fp32; 16-bit states and ``params_out`` are
    rounded to nearest-even when stored. ``num_threads``: the norms' (torch's for the rest).

    Elements whose second moment is 0 take no step from their moments (the module's note).

    ``momentum_in_gradients`` (DGC's momentum correction): the gradients already are a momentum
    of that decay, started when the variance froze, so they become the first moment as they
    are, bias-corrected by ``1 - momentum ** steps_frozen`` instead of Adam's.

    ``new_states`` (an update out of place, as the host kernels take it): the inputs are
    copied there and updated, and stay as they were. ``grads_saved``: for each gradient, None or
    a tensor that receives it as it is before the update; ``grad_norms``: each gradient's norm
    before the update, the bits of :func:`kernels.host_optim.norms` (the host kernels'
    arguments)."""
    if amsgrad or maximize or max_exp_avg_sqs or found_inf is not None:
        raise ValueError(
            "the frozen-variance update supports neither amsgrad, maximize nor found_inf"
        )
    if steps_frozen < 1:
        raise ValueError(f"steps_frozen must be >= 1 (this step is frozen), got {steps_frozen}")
    if grad_norms is not None:
        host_optim.norms(grads, num_threads, out=grad_norms)
    if grads_saved is not None:
        saves = [(t, g) for t, g in zip(grads_saved, grads, strict=True) if t is not None]
        torch._foreach_copy_([t for t, _g in saves], [g for _t, g in saves])
    if new_states is not None:
        torch._foreach_copy_(
            [*new_states.params, *new_states.exp_avgs, *new_states.exp_avg_sqs],
            [*params, *exp_avgs, *exp_avg_sqs],
        )
        params, exp_avgs, exp_avg_sqs = new_states
    scale = None if grad_scale is None else float(grad_scale)
    if steps_frozen == 1:
        _say_what_stays_still(exp_avg_sqs)
    for index, param in enumerate(params):
        step = float(state_steps[index])
        last_exact = step - steps_frozen
        if last_exact < 1:
            raise ValueError(
                f"a parameter at Adam step {step:g} has had no exact step before its variance "
                f"froze {steps_frozen} steps ago: its second moment is all zeros. Give "
                f"compression.warmup_steps >= 1 exact steps after it starts training"
            )
        bias_correction2_sqrt = math.sqrt(1 - beta2**last_exact)
        if momentum_in_gradients is None:
            step_size = lr / (1 - beta1**step)
        else:
            step_size = lr / (1 - momentum_in_gradients**steps_frozen)
        out = None if params_out is None else params_out[index]
        for start in range(0, param.numel(), SLICE_ELEMENTS):
            part = slice(start, start + SLICE_ELEMENTS)
            _update_slice(
                param.view(-1)[part],
                grads[index].view(-1)[part],
                exp_avgs[index].view(-1)[part],
                exp_avg_sqs[index].view(-1)[part],
                None if out is None else out.view(-1)[part],
                scale,
                lr,
                beta1,
                weight_decay,
                eps,
                decoupled,
                step_size,
                bias_correction2_sqrt,
                momentum_in_gradients is not None,
            )


def _say_what_stays_still(exp_avg_sqs: Sequence[torch.Tensor]) -> None:
    """A warning, at the first frozen step, when elements had no gradient in the warm-up: they
    take no step while the variance stays frozen."""
    unseen = sum(int((v == 0).sum()) for v in exp_avg_sqs)
    if unseen:
        total = sum(v.numel() for v in exp_avg_sqs)
        _log.warning(
            "compression.freeze_variance: %d of the %d parameter elements updated here had no "
            "gradient in the exact warm-up (second moment 0); with no scale for their steps "
            "they take none while the variance is frozen. Give compression.warmup_steps enough "
            "exact steps for every parameter to see a gradient",
            unseen,
            total,
        )


def _update_slice(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    scale: float | None,
    lr: float,
    beta1: float,
    weight_decay: float,
    eps: float,
    decoupled: bool,
    step_size: float,
    bias_correction2_sqrt: float,
    gradients_are_momentum: bool,
) -> None:
    """The step on aligned 1-D slices, in the order of torch's fused kernel."""
    grad = grad.float() if scale is None else grad.float() / scale
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
    first = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    if gradients_are_momentum:
        first.copy_(grad)
    else:
        first.lerp_(grad, 1 - beta1)
    if first is not exp_avg:
        exp_avg.copy_(first)
    second = exp_avg_sq.float()
    denom = second.sqrt().div_(bias_correction2_sqrt).add_(eps)
    if float(second.amin()) == 0:  # none is negative: the min tells, at a tenth of a mask's cost
        first = first.masked_fill(second == 0, 0)
    param.addcdiv_(first, denom, value=-step_size)
    if out is not None:
        out.copy_(param)
