"""Forwards under no grad as evaluation cycles of their own.

Any call of the wrapped model under ``torch.no_grad()`` (``engine(...)``, ``model.generate``,
a framework's validation loop) runs as a cycle of its own under one shared trace, which never
touches gradients or optimizer states: hooks on the root module open the cycle before the
forward and close it after, whoever calls the model. The engine owns one
:class:`EvalCycles`; this module holds what the evaluation cycle needs and nothing of
training.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from chunkmem import engine_aborts
from chunkmem.errors import EngineUsageError
from chunkmem.hooks import UnhookedAccessMode

if TYPE_CHECKING:
    from chunkmem.engine import Engine

# The trace key every forward under no grad shares. A greedy decode calls the model once per
# sequence length; a trace per input signature would record one per call (and record with a
# zero chunk budget each time). The moments do not depend on the sequence length, and the
# trace keeps the highest non-model peak it has seen at each moment.
EVAL_TRACE = ("eval",)


class EvalCycles:
    """The engine's evaluation cycles and the root-module hooks that open and close them.

    The hooks hold the engine weakly: the model must not keep a dropped engine (and its
    chunks) alive.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self._mode: contextlib.ExitStack | None = None  # an open cycle's mode
        self._handles = [
            engine.module.register_forward_pre_hook(self._before, prepend=True),
            engine.module.register_forward_hook(self._after, always_call=True),
        ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def abandon_interrupted(self) -> None:
        """A no-grad forward stopped by a ``BaseException`` (KeyboardInterrupt), which module
        hooks do not see, leaves its cycle open."""
        if self._mode is not None:
            self._end(EngineUsageError("interrupted"))

    def _before(self, module: torch.nn.Module, args: tuple) -> None:
        engine = self._engine()
        if engine is not None and not torch.is_grad_enabled() and not engine.closed:
            self._begin(engine)

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._mode is not None:
            # always_call: runs when the forward raised too, inside its except block
            self._end(sys.exc_info()[1])

    def _begin(self, engine: Engine) -> None:
        """Before a forward of the model under no grad: a cycle of its own under the shared
        evaluation trace."""
        engine._check_not_stopped()
        self.abandon_interrupted()
        if engine.tracer.in_cycle:
            raise EngineUsageError(
                "a forward under no grad in the middle of a training cycle (a training "
                "forward is waiting for engine.backward(), or gradient accumulation for "
                "engine.step()); finish the cycle first, or call engine.discard()"
            )
        engine._begin_cycle(EVAL_TRACE)
        self._mode = contextlib.ExitStack()
        if not engine.tracer.replaying:
            self._mode.enter_context(UnhookedAccessMode(engine.manager, engine.hooks))

    def _end(self, error: BaseException | None) -> None:
        engine = self._engine()
        mode, self._mode = self._mode, None
        if engine is None or mode is None:
            return
        try:
            mode.close()
            if error is None and not engine.params.all_packed:
                engine.params.pack_remaining(engine.residency.tiers.spill)
        except BaseException as close_error:
            error = close_error
        if error is not None:
            engine_aborts.abort_cycle(engine, error)
            return
        engine.manager.reset_states()
        engine.residency.nonmodel.trace_peak()
        engine.tracer.end_cycle()
