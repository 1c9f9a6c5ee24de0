"""The host optimizer's argument checks (kernels/host_optim.py calls them before each native
call): a wrong device, dtype, layout, size or scalar is named here, in Python, because the
native library can only answer "invalid argument".

About a thousand tensors a step are checked on the host update's thread, beside backward, so
each check reads cheap attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)
OUT_DTYPES = (torch.bfloat16, torch.float16)


class NewStates(NamedTuple):
    """Where an update out of place writes: the new fp32 parameters and the new moments, one
    tensor for each input tensor, of its size and dtype (the inputs are only read)."""

    params: Sequence[torch.Tensor]
    exp_avgs: Sequence[torch.Tensor]
    exp_avg_sqs: Sequence[torch.Tensor]


def check_adam(
    *,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    amsgrad: bool,
    maximize: bool,
    found_inf,
    params_out,
    new_states: NewStates | None,
    grads_saved,
    grad_norms,
) -> int:
    """Every argument of an Adam step but the scalars read later (grad_scale, found_inf's
    value); returns the number of tensors."""
    if amsgrad or len(max_exp_avg_sqs):
        raise ValueError("amsgrad is not supported by the host optimizer; use amsgrad=False")
    if maximize:
        raise ValueError("maximize=True is not supported by the host optimizer; negate the loss")
    count = check_params(params, grads, params_out)
    check_states("exp_avgs", exp_avgs, params)
    check_states("exp_avg_sqs", exp_avg_sqs, params)
    if count and exp_avgs[0].dtype != exp_avg_sqs[0].dtype:
        raise TypeError(
            f"exp_avgs are {exp_avgs[0].dtype} but exp_avg_sqs are {exp_avg_sqs[0].dtype}; "
            f"both states must have one dtype"
        )
    _check_steps(state_steps, count)
    if new_states is not None:
        _check_new_states(new_states, params, exp_avgs)
        if found_inf is not None:
            raise ValueError(
                "found_inf with new_states: a skipped step would leave the new states unwritten; "
                "check for infinities before an update out of place"
            )
    if grads_saved is not None:
        _check_saved(grads_saved, grads)
    if grad_norms is not None:
        check_norms_out(grad_norms, count)
    return count


def check_rows(rows, types, count: int) -> None:
    """An Adam call over rows by address (``kernels.host_optim.AdamRows``): its dtypes, and
    one entry per row in every list. The rows themselves are the caller's to vouch for."""
    if types.params != torch.float32:
        raise TypeError(f"params must be float32 (fp32 masters or values), got {types.params}")
    if types.grads not in GRAD_DTYPES:
        raise TypeError(f"grads must be one of {GRAD_DTYPES}, got {types.grads}")
    if types.states not in STATE_DTYPES:
        raise TypeError(
            f"exp_avgs and exp_avg_sqs must be one of {STATE_DTYPES}, got {types.states}"
        )
    if (types.out is None) != (rows.params_out is None):
        raise ValueError("params_out rows and their dtype come together, or neither")
    if types.out is not None and types.out not in OUT_DTYPES:
        raise TypeError(f"params_out must be one of {OUT_DTYPES}, got {types.out}")
    lists = {"params": rows.params, "grads": rows.grads, "exp_avgs": rows.exp_avgs,
             "exp_avg_sqs": rows.exp_avg_sqs, "steps": rows.steps,
             "params_out": rows.params_out, "grads_saved": rows.grads_saved}  # fmt: skip
    for position, name in enumerate(("new params", "new exp_avgs", "new exp_avg_sqs")):
        lists[name] = None if rows.new_states is None else rows.new_states[position]
    for name, addresses in lists.items():
        if addresses is not None and len(addresses) != count:
            raise ValueError(f"{name} has {len(addresses)} rows but numels has {count}")
        if addresses is not None and name != "grads_saved" and None in addresses:
            raise ValueError(f"{name} has a null row; only grads_saved may leave a row out")


def check_sgd(
    params, grads, buffers, params_out, *, momentum, dampening, nesterov, maximize
) -> int:
    """Every argument of an SGD step but the scalars read later; returns the number of
    tensors. ``buffers`` are checked only with momentum (without it they are not used)."""
    if maximize:
        raise ValueError("maximize=True is not supported by the host optimizer; negate the loss")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"Nesterov momentum requires momentum > 0 and dampening 0, got momentum={momentum}, "
            f"dampening={dampening} (as torch.optim.SGD)"
        )
    count = check_params(params, grads, params_out)
    if momentum != 0:
        check_states("momentum_buffer_list", buffers, params)
    return count


def check_norms_in(tensors: Sequence[torch.Tensor]) -> None:
    """What :func:`kernels.host_optim.norms` measures: CPU tensors of one gradient dtype."""
    for i, t in enumerate(tensors):
        check_tensor("tensors", i, t, GRAD_DTYPES)
        if t.dtype != tensors[0].dtype:
            raise TypeError(
                f"tensors[{i}] has dtype {t.dtype} but tensors[0] has {tensors[0].dtype}; one "
                f"call takes one dtype"
            )


def check_norms_out(
    out: object, count: int, *, name: str = "grad_norms", of: str = "grads"
) -> None:
    """Where norms go (argument ``name``): one fp32 element per tensor of ``of``, contiguous,
    on the CPU."""
    check_tensor(name, 0, out, (torch.float32,))
    assert isinstance(out, torch.Tensor)
    if out.numel() != count:
        raise ValueError(f"{name} has {out.numel()} elements but {of} has {count}")


def check_tensor(name: str, index: int, t: object, dtypes: Sequence[torch.dtype]) -> None:
    """One tensor's checks (``is_cpu`` costs a fifth of ``device.type``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}[{index}] is a {type(t).__name__}, not a tensor")
    if not t.is_cpu:
        raise ValueError(
            f"{name}[{index}] is on {t.device}; the host optimizer runs on CPU tensors only "
            f"(use torch's fused kernel for device tensors)"
        )
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}[{index}] has dtype {t.dtype}; expected one of {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{name}[{index}] is not contiguous; pass a contiguous tensor or view")


def check_params(params, grads, params_out) -> int:
    """fp32 parameters, their gradients and (optional) 16-bit copies; returns their count."""
    for i, p in enumerate(params):
        check_tensor("params", i, p, (torch.float32,))
    _check_list("grads", grads, params, GRAD_DTYPES)
    if params_out is not None and len(params_out):
        _check_list("params_out", params_out, params, OUT_DTYPES)
    return len(params)


def check_states(name: str, states: Sequence[torch.Tensor], params) -> None:
    _check_list(name, states, params, STATE_DTYPES)


def thread_count(num_threads: int | None) -> int:
    """The thread count a call runs with: ``torch.get_num_threads()`` unless given."""
    count = torch.get_num_threads() if num_threads is None else num_threads
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    return count


def skipped(grad_scale, found_inf) -> bool:
    """Whether torch's kernel would skip the step (found_inf == 1); checks both scalars."""
    if grad_scale is not None:
        _check_scalar("grad_scale", grad_scale)
    if found_inf is None:
        return False
    _check_scalar("found_inf", found_inf)
    return float(found_inf) == 1.0


def _check_list(
    name: str, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor], dtypes
) -> None:
    """Each tensor is on the CPU, contiguous, of one allowed dtype for the whole list, and has
    the numel of its parameter."""
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but params has {len(params)}")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        check_tensor(name, i, t, dtypes)
        if t.dtype != tensors[0].dtype:
            raise TypeError(
                f"{name}[{i}] has dtype {t.dtype} but {name}[0] has {tensors[0].dtype}; one call "
                f"takes one dtype per list"
            )
        if t.numel() != p.numel():
            raise ValueError(
                f"{name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}"
            )


def _check_new_states(new_states: NewStates, params, exp_avgs) -> None:
    """The outputs of an update out of place: shaped like the inputs, of their dtypes."""
    if not isinstance(new_states, NewStates):
        raise TypeError(f"new_states must be a NewStates, got {type(new_states).__name__}")
    _check_list("new_states.params", new_states.params, params, (torch.float32,))
    dtype = exp_avgs[0].dtype if exp_avgs else torch.float32
    _check_list("new_states.exp_avgs", new_states.exp_avgs, params, (dtype,))
    _check_list("new_states.exp_avg_sqs", new_states.exp_avg_sqs, params, (dtype,))


def _check_saved(grads_saved: Sequence[torch.Tensor | None], grads) -> None:
    """Where gradients are saved: None, or a tensor like the gradient (dtype and size)."""
    if len(grads_saved) != len(grads):
        raise ValueError(f"grads_saved has {len(grads_saved)} entries but grads has {len(grads)}")
    for i, (t, g) in enumerate(zip(grads_saved, grads, strict=True)):
        if t is None:
            continue
        check_tensor("grads_saved", i, t, (g.dtype,))
        if t.numel() != g.numel():
            raise ValueError(
                f"grads_saved[{i}] has {t.numel()} elements but grads[{i}] has {g.numel()}"
            )


def _check_scalar(name: str, t: object) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or not t.is_cpu
        or t.dtype != torch.float32
        or t.numel() != 1
    ):
        what = (
            f"{t.dtype} tensor of {t.numel()} elements on {t.device}"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )
        raise TypeError(f"{name} must be a one-element float32 CPU tensor, got a {what}")


def _check_steps(steps: Sequence[torch.Tensor], count: int) -> None:
    if len(steps) != count:
        raise ValueError(f"state_steps has {len(steps)} tensors but params has {count}")
    for i, s in enumerate(steps):
        _check_scalar(f"state_steps[{i}]", s)
