"""The interpreter's switch interval while host updates run beside backward.

[Note: why the switch interval] Backward runs on the engine's thread in torch's C++, which
drops the GIL for each op and takes it again for each Python hook (a gradient stored, a
saved tensor unpacked: a few hundred a step). The host update's thread holds the GIL while it
builds a group's kernel calls, a stretch of a millisecond or more. CPython lets a thread that
wants the GIL wait up to ``sys.getswitchinterval()`` (5 ms by default) before the holder must
drop it, so each of backward's hooks that lands in such a stretch waits for the stretch to
end: the engine's thread, the critical path, queues behind the host's Python. Measured on the
overlap benchmark's clipped step (docs/offload.md#the-switch-interval): backward took 68 ms
beside the host updates at 5 ms and 57 ms at 0.2 ms, against 55 ms with no host updates.

So while at least one early update is in flight, the interval is the smallest one any engine
asked for; when the last one is done it is what it was before. The count is the process's,
not an engine's: two engines overlapping at once share the interpreter.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

Submit = Callable[[Callable[[], None]], Future]

_lock = threading.Lock()
_held: Counter[float] = Counter()  # interval -> runs in flight that asked for it
_before: float | None = None  # the interval when the first run started


def _take(interval: float) -> None:
    global _before
    with _lock:
        if not _held:
            _before = sys.getswitchinterval()
        _held[interval] += 1
        sys.setswitchinterval(min(_held))


def _give_back(interval: float) -> None:
    global _before
    with _lock:
        _held[interval] -= 1
        if _held[interval] == 0:
            del _held[interval]
        if _held:
            sys.setswitchinterval(min(_held))
        else:
            assert _before is not None
            sys.setswitchinterval(_before)
            _before = None


def sliced(submit: Submit, interval: float | None) -> Submit:
    """``submit``, with the switch interval at most ``interval`` seconds from each run's
    submission until it is done, however it ends (None: ``submit`` itself)."""
    if interval is None:
        return submit

    def submit_sliced(fn: Callable[[], None]) -> Future:
        _take(interval)
        try:
            future = submit(fn)
        except BaseException:
            _give_back(interval)
            raise
        future.add_done_callback(lambda _future: _give_back(interval))
        return future

    return submit_sliced
