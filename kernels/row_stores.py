"""How the native host optimizer's updates out of place store the rows they write elsewhere:
streamed (non-temporal) or through the cache, measured per machine on the first large calls
([Note: streamed or cached row stores] in ``kernels/csrc/row_stores.h``). The bits are the
same either way; this reads the choice for reports and forces a kind for tests and ablations.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

from kernels.host_optim import load_library

RowStoreKind = Literal["streamed", "cached"]
_KINDS: dict[int, RowStoreKind | None] = {-1: None, 0: "streamed", 1: "cached"}
_CODES = {"measure": -1, "streamed": 0, "cached": 1}


@dataclass(frozen=True)
class RowStoreChoice:
    """The kind in use (None while the first large calls still measure), and each kind's
    median nanoseconds per element over its timed calls (None without any)."""

    chosen: RowStoreKind | None
    ns_per_element: dict[RowStoreKind, float | None]
    timed_calls: dict[RowStoreKind, int]

    def as_json(self) -> dict:
        return {
            "chosen": self.chosen,
            "ns_per_element": self.ns_per_element,
            "timed_calls": self.timed_calls,
        }


def _functions() -> ctypes.CDLL:
    """The loaded library's handle (the process's library: the same build, the same state)."""
    lib = ctypes.CDLL(str(load_library().path))
    lib.cmo_cpu_row_stores.argtypes = [ctypes.POINTER(ctypes.c_double)] * 2 + [
        ctypes.POINTER(ctypes.c_int)
    ] * 2
    lib.cmo_cpu_row_stores.restype = ctypes.c_int
    lib.cmo_cpu_set_row_stores.argtypes = [ctypes.c_int]
    lib.cmo_cpu_set_row_stores.restype = ctypes.c_int
    return lib


def row_stores() -> RowStoreChoice:
    """The process's choice so far."""
    streamed, cached = ctypes.c_double(), ctypes.c_double()
    streamed_calls, cached_calls = ctypes.c_int(), ctypes.c_int()
    chosen = _functions().cmo_cpu_row_stores(
        ctypes.byref(streamed), ctypes.byref(cached),
        ctypes.byref(streamed_calls), ctypes.byref(cached_calls),
    )  # fmt: skip
    return RowStoreChoice(
        chosen=_KINDS[chosen],
        ns_per_element={
            "streamed": streamed.value if streamed_calls.value else None,
            "cached": cached.value if cached_calls.value else None,
        },
        timed_calls={"streamed": streamed_calls.value, "cached": cached_calls.value},
    )


def set_row_stores(kind: Literal["measure", "streamed", "cached"]) -> None:
    """Force ``kind`` for every update out of place from now on, or ``measure`` anew."""
    if kind not in _CODES:
        raise ValueError(f"row stores: {kind!r} is not one of {', '.join(_CODES)}")
    if _functions().cmo_cpu_set_row_stores(_CODES[kind]) != 0:
        raise RuntimeError(f"the native host optimizer refused row stores {kind!r}")
