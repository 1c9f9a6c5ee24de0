"""How an engine's cycle ends after an exception: every owner releases what it holds and the
next batch trains as if the failed one had never been seen, or the engine stops and says why.

Kept out of the training cycle's module. Two failures cannot be undone and stop the engine: a
failed collective (the group may be unusable, see [Note: a failed collective is final] in
zero.collective_failures), and a call that began updating some chunk groups (the parameters
are no longer one consistent state); so does a tier that lost chunk content.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from chunkmem.errors import CollectiveError, EngineUsageError, TierDataError

if TYPE_CHECKING:
    from chunkmem.engine import Engine


def abort_cycle(engine: Engine, error: BaseException) -> None:
    """Undo the cycle after ``error``: every owner releases what it holds (hook frames,
    transient pins, reductions and gathers in flight, gradients, parameter slots that held
    one), even if one of them raises. A failed collective stops the engine."""
    try:
        engine.hooks.reset()
        engine.manager.reset_states()
        engine.activations.release_all()
        with contextlib.ExitStack() as releases:
            releases.callback(engine.gatherer.cancel)
            releases.callback(engine.grads.discard)
            releases.callback(engine.optimizer.cancel)  # runs first: it reads gradients
    except CollectiveError as cancel_error:
        error = cancel_error
    finally:
        engine.tracer.abandon_cycle()
        engine.end_window()
        if isinstance(error, CollectiveError):
            engine._stop(f"a collective failed ({error})")


def abort_update(engine: Engine, error: BaseException, call: str) -> None:
    """Abort after ``error`` in a call that may have begun updating parameters (the step;
    backward with ``offload.overlap``): if it did, or a tier lost chunk content, the engine
    stops. Speculative early updates are undone first, exactly."""
    optimizer = engine.optimizer
    if optimizer.speculating:
        with contextlib.suppress(BaseException):  # if undoing fails, the engine stops
            optimizer.settle_speculation(held=False)
    updated = optimizer.layouts_updated
    carried = carried_by_compression(engine)
    try:
        abort_cycle(engine, error)  # may raise again what an early update's run raised
    finally:
        if engine.stopped_because is None and updated:
            engine._stop(
                f"{call} failed after it began updating {updated} chunk group(s) of "
                f"parameters ({type(error).__name__}: {error}); the others were not "
                f"updated, so the model is no longer one consistent state"
            )
        elif engine.stopped_because is None and carried:
            engine._stop(
                f"{call} failed ({type(error).__name__}: {error}) after {carried}; load "
                f"the last checkpoint to go on"
            )
        elif engine.stopped_because is None and isinstance(error, TierDataError):
            engine._stop(f"optimizer states were lost ({error})")


def carried_by_compression(engine: Engine) -> str | None:
    """Why the window's gradients cannot be dropped, if they cannot: gradient compression
    already carried part of them into its state for the next steps."""
    state = engine.reducer.state
    if state is None or not state.carries_window():
        return None
    return (
        "gradient compression's error feedback already holds part of this window's "
        "gradients for the next steps, and cannot give it back"
    )


def discard(engine: Engine) -> None:
    """Drop everything since the last optimizer step (see ``Engine.discard``)."""
    engine.optimizer.settle_speculation(held=False)  # speculative early updates are undone
    if engine.optimizer.layouts_updated:
        raise EngineUsageError(
            f"engine.discard(): the update of {engine.optimizer.layouts_updated} chunk "
            f"group(s) already ran in backward (offload.overlap) and cannot be undone; "
            f"call engine.step() to complete it"
        )
    carried = carried_by_compression(engine)
    if carried:
        raise EngineUsageError(
            f"engine.discard(): {carried}; call engine.step() to take the window, or load "
            f"the last checkpoint"
        )
    abort_cycle(engine, EngineUsageError("discarded"))


@contextlib.contextmanager
def stopping_on_collective_failure(engine: Engine) -> Iterator[None]:
    """Run the block; a collective failing in it stops ``engine``."""
    try:
        yield
    except CollectiveError as error:
        engine._stop(f"a collective failed ({error})")
        raise
