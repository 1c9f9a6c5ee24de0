"""One training cycle of a model on the meta device, recorded as the engine would see it.

The model runs forward and backward on meta tensors (shapes and dtypes, no memory, no
arithmetic), with the hooks the engine puts on it (chunkmem/hooks.py) reduced to what they
observe: a moment at each unit's pre-forward and pre-backward, a release at its post-forward
and post-backward, the tensors autograd saves for backward counted once per storage while
they live (as ``chunkmem.saved_tensors`` counts them on the simulated device; views of a
parameter are not counted, the engine stores those as tokens), and each parameter's
gradient as autograd finishes it. The order parameters are first accessed in is the order
the engine packs them into chunks.

With ``temporaries`` (a CUDA target, whose allocator sees them, or a simulated device with
``device.count_temporaries``) every operator output also counts while it lives, by the same
rule as the engine's meter (chunkmem/temporaries.py): an output before it is saved, the
logits' gradient, backward's intermediates. Without, only what the hooks count, as the
default simulated device does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from chunkmem.hooks import plan_units
from chunkmem.temporaries import LiveStorages, OutputCounting

# Events, in the order they happen:
#   ("moment", phase, unit)  a unit's pre-forward ("fwd") or pre-backward ("bwd"); a
#                            pre-forward in backward (activation checkpointing recomputing
#                            the unit) is a "bwd" moment, as the engine's hooks make it
#   ("release", phase, unit) its post-forward ("fwd"; "recompute" in backward) or
#                            post-backward ("bwd"): its parameters are let go
#   ("act", delta_bytes)     bytes saved for backward changed
#   ("grad", param, nbytes)  autograd finished a parameter's gradient (nbytes in flight)
#   ("end",)                 backward ended: calls whose post-backward never fired close
Event = tuple[Any, ...]


@dataclass
class ModelTrace:
    """Parameters (registration order, tied ones once), units, and the cycle's events."""

    names: list[str]
    numels: list[int]
    trainable: list[bool]
    pack_order: list[int]  # parameter indices in the order the engine packs them
    unit_params: list[list[int]]  # per unit, the parameters its moments access
    unit_labels: list[str]
    events: list[Event] = field(default_factory=list)

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)


class _FusedAttention(TorchFunctionMode):
    """Attention as the fused kernels run it.

    On the meta device ``scaled_dot_product_attention`` takes the math path, which saves
    the attention matrix (batch x heads x seq^2 per layer) for backward; the fused kernels
    that CPUs and GPUs run keep only the output and a logsumexp per row. The CPU flash
    kernel's meta function saves what they save, so calls go there where the target runs a
    fused kernel: always on a GPU, on a CPU only without dropout (torch's CPU choice). Where
    it does not apply (grouped-query attention) the math path stays.
    """

    def __init__(self, gpu: bool) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        fused = self.gpu or not dropout
        if fused and not kwargs.get("enable_gqa"):
            try:
                return _flash(*args, **kwargs)
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        return func(*args, **kwargs)


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the torch-function mode still active.

    ``Tensor.backward`` is itself a torch function, and a mode is switched off while it
    handles one: the blocks that activation checkpointing recomputes in backward would take
    the math path, and checkpointing refuses recomputed tensors that differ from the saved
    ones. So the autograd engine is called directly (torch's private entry point, present
    since 2.3; the public one is the fallback, without the fused-attention routing in
    recomputed blocks).
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        loss.backward()
        return
    run(
        (loss,),
        (torch.ones_like(loss),),
        False,
        False,
        (),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class _Call:
    __slots__ = ("unit", "pre_done", "post_done")

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.pre_done = False
        self.post_done = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the unit's backward done (as the
    engine's, chunkmem/hooks.py)."""

    @staticmethod
    def forward(ctx, recorder: _Recorder, call: _Call, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.recorder = recorder
        ctx.call = call
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.recorder.post_backward(ctx.call)
        return (None, None, *grads)


class _Saved:
    """What autograd keeps for a counted saved tensor; dropping it uncounts the tensor."""

    __slots__ = ("key", "recorder")

    def __init__(self, key: int, recorder: _Recorder) -> None:
        self.key = key
        self.recorder = recorder

    def __del__(self) -> None:
        self.recorder.drop(self.key)


class _Recorder:
    def __init__(self, trace: ModelTrace, params: Sequence[torch.nn.Parameter]) -> None:
        self.trace = trace
        self.events = trace.events
        self.outputs = LiveStorages(lambda delta: self.events.append(("act", delta)))
        self.param_storages = {p.untyped_storage()._cdata for p in params}
        self.tensors: dict[int, torch.Tensor] = {}
        self.storages: dict[int, list[int]] = {}  # storage -> [references, nbytes]
        self.next_key = 0
        self.open_calls: dict[int, _Call] = {}
        self.in_backward = False

    # saved tensors
    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.layout is not torch.strided:
            return tensor
        storage = tensor.untyped_storage()
        storage_key = storage._cdata
        if storage_key in self.param_storages or storage.nbytes() == 0:
            return tensor
        key = self.next_key
        self.next_key += 1
        self.tensors[key] = tensor
        entry = self.storages.get(storage_key)
        if entry is None:
            nbytes = 0 if storage in self.outputs else storage.nbytes()  # counted while it lives
            self.storages[storage_key] = [1, nbytes]
            if nbytes:
                self.events.append(("act", nbytes))
        else:
            entry[0] += 1
        return _Saved(key, self)

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.tensors[packed.key] if isinstance(packed, _Saved) else packed

    def drop(self, key: int) -> None:
        tensor = self.tensors.pop(key, None)
        if tensor is None:
            return
        storage_key = tensor.untyped_storage()._cdata
        entry = self.storages[storage_key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.storages[storage_key]
            if entry[1]:
                self.events.append(("act", -entry[1]))

    # backward
    def pre_backward(self, call: _Call) -> None:
        if call.pre_done:
            return
        call.pre_done = True
        self.events.append(("moment", "bwd", call.unit))
        self.open_calls[id(call)] = call

    def post_backward(self, call: _Call) -> None:
        if call.post_done or not call.pre_done:
            return
        call.post_done = True
        self.events.append(("release", "bwd", call.unit))
        del self.open_calls[id(call)]

    def finish_backward(self) -> None:
        for call in list(self.open_calls.values()):
            self.post_backward(call)


def trace_model(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    max_unit_elements: int,
    gpu: bool = True,
    temporaries: bool = False,
) -> ModelTrace:
    """Run ``model(*inputs)`` (the loss) and its backward on the meta device under the
    engine's units of at most ``max_unit_elements`` parameter elements; ``gpu``: attention
    as a GPU runs it (else as a CPU does, for the simulated device); ``temporaries``: every
    operator output counts while it lives."""
    named = list(model.named_parameters())
    params = list(dict.fromkeys(p for _n, p in named))
    names = {}
    for name, param in named:
        names.setdefault(param, name)
    index = {id(p): i for i, p in enumerate(params)}
    units = plan_units(model, max_unit_elements)
    hooked = [model, *(m for m in units if m is not model)]
    module_names = {m: n for n, m in model.named_modules(remove_duplicate=True)}
    accesses = [[index[id(p)] for p in units.get(m, [])] for m in hooked]
    trace = ModelTrace(
        names=[names[p] for p in params],
        numels=[p.numel() for p in params],
        trainable=[p.requires_grad for p in params],
        pack_order=[],
        unit_params=accesses,
        unit_labels=[module_names[m] or "<root>" for m in hooked],
    )
    recorder = _Recorder(trace, params)
    packed: set[int] = set()
    stack: list[tuple[int, _Call | None, bool]] = []
    unit_of = {m: k for k, m in enumerate(hooked)}

    def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        unit = unit_of[module]
        if not accesses[unit]:
            stack.append((unit, None, False))
            return None
        trace.events.append(("moment", "bwd" if recorder.in_backward else "fwd", unit))
        for i in accesses[unit]:
            if i not in packed:
                packed.add(i)
                trace.pack_order.append(i)
        if not torch.is_grad_enabled():
            stack.append((unit, None, True))
            return None
        call = _Call(unit)
        stack.append((unit, call, True))
        flat, spec = tree_flatten((args, kwargs))
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if not positions:
            return None
        wrapped = _PostBackward.apply(recorder, call, *(flat[i] for i in positions))
        for position, tensor in zip(
            positions, wrapped if len(positions) > 1 else (wrapped,), strict=True
        ):
            flat[position] = tensor
        return spec.unflatten(flat)

    def post_forward(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not stack or stack[-1][0] != unit_of[module]:
            return
        unit, call, acquired = stack.pop()
        if acquired:
            trace.events.append(("release", "recompute" if recorder.in_backward else "fwd", unit))
        if call is None or output is None:
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, call=call: recorder.pre_backward(call))

    def grad_done(param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is not None:
            counted = grad.untyped_storage() in recorder.outputs  # while it lives
            in_flight = 0 if counted else grad.nelement() * grad.element_size()
            trace.events.append(("grad", index[id(param)], in_flight))
            param.grad = None

    handles = []
    for module in hooked:
        handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(module.register_forward_hook(post_forward, always_call=True))
    handles.extend(
        p.register_post_accumulate_grad_hook(grad_done) for p in params if p.requires_grad
    )
    try:
        with (
            _FusedAttention(gpu),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack),
            OutputCounting(recorder.outputs) if temporaries else contextlib.nullcontext(),
        ):
            loss = model(*inputs)
            recorder.in_backward = True
            _backward(loss)
        recorder.finish_backward()
        trace.events.append(("end",))
    finally:
        for handle in handles:
            handle.remove()
    trace.pack_order.extend(i for i in range(len(params)) if i not in packed)
    return trace
