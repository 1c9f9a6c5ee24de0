"""Collectives in flight, composed: what follows one (:class:`Then`), one issued once another
completed (:class:`Chained`), several as one (:class:`AllOf`), several waited for in issue
order whichever is asked for first (:class:`InIssueOrder`). Each is a
:class:`chunkmem.sharding.Waitable`, so a chunk's ``arriving`` holds any of them alike.
"""

from __future__ import annotations

from collections.abc import Callable

from chunkmem.sharding import Waitable


class Then:
    """A launched collective and what follows it: ``finish`` once it completed (dequantize what
    arrived), ``release`` whatever happened (give back or unpin what it used). Each runs at most
    once, at the first ``wait``."""

    def __init__(
        self,
        handle: Waitable,
        *,
        finish: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._handle = handle
        self._finish = finish
        self._release = release

    def wait(self) -> None:
        try:
            self._handle.wait()
            finish, self._finish = self._finish, None
            if finish is not None:
                finish()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()

    def is_completed(self) -> bool:
        return self._handle.is_completed()


class Chained:
    """A collective, then the one ``then`` issues once the first completed, at ``advance`` or
    ``wait`` and never when a poll happens to see the first done (see [Note: the two-level
    weight gather] in zero.quantized_gather): every rank issues the second at the same point
    of its program. Not completed before it is advanced. ``then`` names the first's layout in
    the second's identity itself (``Communicator.about``): it may be issued inside another
    layout's block (an eviction waiting for it), whose name it must not take."""

    def __init__(self, first: Waitable, then: Callable[[], Waitable]) -> None:
        self._first: Waitable | None = first
        self._then = then
        self._second: Waitable | None = None

    def advance(self) -> None:
        """Wait for the first collective and issue the second (once)."""
        if self._first is not None:
            self._first.wait()
            self._first = None
            self._second = self._then()

    def wait(self) -> None:
        self.advance()
        assert self._second is not None
        self._second.wait()

    def is_completed(self) -> bool:
        return self._second is not None and self._second.is_completed()


class AllOf:
    """Several launched collectives as one: waited for in the order given."""

    def __init__(self, handles: list[Waitable]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self._handles)


class InIssueOrder:
    """Collectives waited for in the order they were issued, whichever is asked for first.

    A ring on gloo moves its steps after the first only inside ``wait`` (zero/ring.py). Ranks
    whose next forward reads the carried layouts in different orders (a branch one skips, an
    eviction one makes) would each block in one ring on a peer blocked in another: waiting
    for one here first waits for every one issued before it, so every rank waits in one
    order."""

    def __init__(self, handles: list[Waitable]) -> None:
        self._handles = handles
        self._waited = 0  # handles[:_waited] are waited for

    def through(self, index: int) -> Waitable:
        """The ``index``-th collective, whose wait waits for those before it first."""
        return _Through(self, index)

    def wait_through(self, index: int) -> None:
        while self._waited <= index:
            self._handles[self._waited].wait()
            self._waited += 1

    def is_completed(self, index: int) -> bool:
        return all(handle.is_completed() for handle in self._handles[: index + 1])


class _Through:
    def __init__(self, order: InIssueOrder, index: int) -> None:
        self._order = order
        self._index = index

    def wait(self) -> None:
        self._order.wait_through(self._index)

    def is_completed(self) -> bool:
        return self._order.is_completed(self._index)
