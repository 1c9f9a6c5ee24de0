"""Hooks that turn a model's execution into chunk accesses and moments.

- Module forward pre/post hooks: a module's parameters are accessed before its forward and
  released after it; the pre-forward is a tracer moment.
- Pre-backward: a hook on the module's outputs fires when their gradient arrives, before the
  module's backward runs. Post-backward: hooks on the autograd nodes of the module's forward
  that read its inputs fire once the last of them has run, i.e. after the module's backward
  (see [Note: post-backward without a node of our own]).
- The saved-tensor hooks live in :mod:`chunkmem.saved_tensors`.
- While a trace is being recorded, a torch-function mode catches parameter uses that no
  module hook arranged (a parent reading ``self.child.weight``); they are served on demand and
  added to that module's accesses from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr as _next_sequence_nr
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from chunkmem.manager import ChunkManager
from chunkmem.states import TensorState
from chunkmem.tracer import Moment, Phase


class _Internal(threading.local):
    """Marks chunkmem's own work so the torch-function mode does not intercept it; per
    thread, as torch's mode stack is (engines of an in-process world run on threads)."""

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


internal = _Internal()


@dataclass(eq=False)
class _Call:
    """One call of a module: its backward hooks fire at most once each.

    [Note: post-backward without a node of our own] The module's backward is done when every
    autograd node its forward created that reads one of its inputs has run: those nodes
    (``readers``) get a post-hook each, and the last to run releases the module. An identity
    autograd function wrapped around the inputs would tell the same moment, but it changes
    the graph: a module that reads its input twice (RMSNorm's ``x * rsqrt(mean(x * x))``)
    would sum its two gradient contributions inside the identity and then add the residual
    path's, where plain PyTorch adds all three in one buffer, in another order; a tiny Llama
    drifted 6.7e-5 from PyTorch in 10 steps. Hooks on the graph's own nodes change nothing.
    A hook on the inputs' gradients (``register_multi_grad_hook``) would not change the
    graph either, but fires only when an input's whole gradient is summed, i.e. after every
    other reader of it too: T5's position bias and encoder output are read by every layer,
    so every layer would stay on the device until the stack's backward ended. Neither the
    call nor a hook holds a node: a hook that did would keep the graph (and a checkpointed
    block's recomputed activations) alive in a cycle until the garbage collector ran.
    """

    module: torch.nn.Module
    moment: Moment  # its pre-backward moment
    params: list[torch.nn.Parameter]
    readers_pending: int = 0  # reader nodes that have not run yet
    pre_backward_done: bool = False
    post_backward_done: bool = False


@dataclass(eq=False)
class _Frame:
    """One running forward of a hooked module: what its pre-hook acquired, for its post-hook.

    [Note: forwards that stop early] The post-hook is registered with ``always_call=True``,
    so it runs when the forward raises too: an exception in the model, or the early stop of
    non-reentrant activation checkpointing, whose recomputation in backward is interrupted
    once the last saved tensor it needs is rebuilt. Without it, the interrupted units keep
    their parameters in COMPUTE (their chunks unevictable) until backward ends, and whether
    a model fits then depends on how those units fall into chunks: depth L could train while
    L-1 ran out of memory.
    """

    module: torch.nn.Module
    acquired: list[torch.nn.Parameter] | None = None
    call: _Call | None = None
    # Where the call's inputs get their gradients, and the first autograd sequence number
    # its forward can create: what tells its reader nodes (see _Call).
    input_edges: list[tuple[Any, int]] = field(default_factory=list)
    first_node: int = 0


@dataclass
class ModuleHooks:
    """Registers and runs the module hooks of one model."""

    manager: ChunkManager
    labels: dict[torch.nn.Module, str] = field(default_factory=dict)
    moments: dict[torch.nn.Module, tuple[Moment, Moment]] = field(default_factory=dict)
    accesses: dict[torch.nn.Module, list[torch.nn.Parameter]] = field(default_factory=dict)
    stack: list[_Frame] = field(default_factory=list)
    open_calls: dict[int, _Call] = field(default_factory=dict)
    # A forward while backward runs recomputes a checkpointed unit: its moment belongs to the
    # backward phase (its own label), so the gatherer keeps what it gathers for the unit's
    # backward (zero/gather.py, [Note: one gather per unit per backward]).
    in_backward: bool = False
    recompute_moments: dict[torch.nn.Module, Moment] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)

    def attach(self, model: torch.nn.Module, max_unit_elements: int) -> None:
        """Hook the model's units (see :func:`plan_units`) and its root."""
        units = plan_units(model, max_unit_elements)
        names = {module: name for name, module in model.named_modules(remove_duplicate=True)}
        for module in [model, *(m for m in units if m is not model)]:
            label = names[module] or "<root>"
            self.labels[module] = label
            self.moments[module] = (Moment(Phase.FORWARD, label), Moment(Phase.BACKWARD, label))
            self.recompute_moments[module] = Moment(Phase.BACKWARD, f"{label} (recompute)")
            self.accesses[module] = [
                p for p in units.get(module, []) if self.manager.params.is_managed(p)
            ]
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def learn_access(self, param: torch.nn.Parameter) -> None:
        """Record that the module now running uses ``param`` without owning it."""
        module = self.stack[-1].module if self.stack else next(iter(self.labels))
        if not any(p is param for p in self.accesses[module]):
            self.accesses[module].append(param)

    def reset(self) -> None:
        self.stack.clear()
        self.open_calls.clear()

    # forward
    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        with internal:
            return self._pre_forward_inner(module, args, kwargs)

    def _post_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        with internal:
            self._post_forward_inner(module, output)

    def _pre_forward_inner(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        frame = _Frame(module)
        self.stack.append(frame)  # first: the post-hook pops it whatever happens next
        params = self.accesses[module]
        if not params:
            return None
        forward, backward = self.moments[module]
        self.manager.enter_moment(self.recompute_moments[module] if self.in_backward else forward)
        self.manager.access(params)
        frame.acquired = params
        self.manager.after_access()
        if not torch.is_grad_enabled():
            return None
        frame.call = _Call(module, backward, params)
        simple = not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args)
        flat = args if simple else tree_flatten((args, kwargs))[0]
        for x in flat:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                edge = get_gradient_edge(x)
                frame.input_edges.append((edge.node, edge.output_nr))
        frame.first_node = _next_sequence_nr()
        return None

    def _post_forward_inner(self, module: torch.nn.Module, output: Any) -> None:
        if not self.stack or self.stack[-1].module is not module:
            return  # an earlier pre-hook raised before ours ran: nothing of ours to undo
        frame = self.stack.pop()
        if frame.acquired is not None:
            self.manager.release(frame.acquired, TensorState.HOLD_AFTER_FWD)
        call = frame.call
        if call is None or output is None:
            return  # no grad, or the forward stopped early: no backward will come through it

        def on_output_grad(grad: torch.Tensor) -> None:
            with internal:
                self.pre_backward(call)

        outputs = [
            tensor
            for tensor in ((output,) if isinstance(output, torch.Tensor) else _tensors(output))
            if tensor.requires_grad
        ]
        for tensor in outputs:
            tensor.register_hook(on_output_grad)
        if not frame.input_edges:
            return  # nothing to tell its backward's end by: finish_backward closes it

        def on_reader_done(grad_inputs: Any, grad_outputs: Any) -> None:
            call.readers_pending -= 1
            if call.readers_pending == 0:
                with internal:
                    self.post_backward(call)

        readers = _reader_nodes(outputs, frame.input_edges, frame.first_node)
        call.readers_pending = len(readers)
        for node in readers:
            node.register_hook(on_reader_done)

    # backward
    def pre_backward(self, call: _Call) -> None:
        if call.pre_backward_done:
            return
        call.pre_backward_done = True
        self.manager.enter_moment(call.moment)
        self.manager.access(call.params)
        self.manager.after_access()
        self.open_calls[id(call)] = call

    def post_backward(self, call: _Call) -> None:
        if call.post_backward_done or not call.pre_backward_done:
            return
        call.post_backward_done = True
        self.manager.release(call.params, TensorState.HOLD_AFTER_BWD)
        del self.open_calls[id(call)]

    def finish_backward(self) -> None:
        """Close calls whose inputs needed no gradient (their post-backward never fires)."""
        for call in list(self.open_calls.values()):
            self.post_backward(call)


def plan_units(
    model: torch.nn.Module, max_elements: int
) -> dict[torch.nn.Module, list[torch.nn.Parameter]]:
    """Split the model into units: the largest subtrees with at most ``max_elements`` parameter
    elements, plus, for a module too large to be one unit, its own direct parameters.

    A unit's parameters are accessed together in its pre-forward and pre-backward, so one pair
    of moments covers what would otherwise be a moment per leaf module (a transformer block is
    typically one unit). Units no larger than a chunk keep one moment's chunks to about two.
    """
    units: dict[torch.nn.Module, list[torch.nn.Parameter]] = {}

    def visit(module: torch.nn.Module) -> None:
        subtree = list(dict.fromkeys(module.parameters()))
        if not subtree:
            return
        if sum(p.numel() for p in subtree) <= max_elements:
            units[module] = subtree
            return
        direct = list(dict.fromkeys(module.parameters(recurse=False)))
        if direct:
            units[module] = direct
        for child in module.children():
            visit(child)

    visit(model)
    return units


def _reader_nodes(
    outputs: list[torch.Tensor], input_edges: list[tuple[Any, int]], first_node: int
) -> list[Any]:
    """The autograd nodes created since sequence number ``first_node`` on the way from
    ``outputs`` back to ``input_edges`` that read an input directly.

    Nodes created before the call are not entered: a tensor the module captured from outside
    would otherwise lead the walk through the whole graph before it.
    """
    inputs = {(id(node), nr) for node, nr in input_edges}
    readers: list[Any] = []
    seen: dict[int, Any] = {}  # holds the nodes: a freed wrapper's id could come back
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or node._sequence_nr() < first_node:
            continue
        seen[id(node)] = node
        reads_input = False
        for child, nr in node.next_functions:
            if child is None:
                continue
            if (id(child), nr) in inputs:
                reads_input = True
            else:
                stack.append(child)
        if reads_input:
            readers.append(node)
    return readers


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    flat, _ = tree_flatten(output)
    return (x for x in flat if isinstance(x, torch.Tensor))


class UnhookedAccessMode(TorchFunctionMode):
    """While recording: serve and learn parameter uses that no module hook arranged."""

    def __init__(self, manager: ChunkManager, hooks: ModuleHooks) -> None:
        super().__init__()
        self._manager = manager
        self._hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not internal.depth:
            flat, _ = tree_flatten((args, kwargs))
            for value in flat:
                if isinstance(value, torch.nn.Parameter) and self._manager.params.is_managed(value):
                    slot = self._manager.params.slot_of(value)
                    if slot is None or slot.state is not TensorState.COMPUTE:
                        with internal:
                            self._manager.materialize(value)
                            self._hooks.learn_access(value)
        return func(*args, **kwargs)


def cast_floating(tree: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Move tensors to ``device`` and floating-point ones to ``dtype`` (model inputs)."""

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point() and x.dtype != dtype:
            return x.to(device=device, dtype=dtype)
        return x.to(device=device)

    return tree_map(convert, tree)
