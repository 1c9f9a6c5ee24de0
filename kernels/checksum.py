"""Checksums of host buffers in a native library: CRC32C (Castagnoli) with the SSE4.2
instruction, three streams at a time (kernels/csrc/checksum_cpu.cpp, [Note: three streams]).

:func:`crc32c_3` returns the CRC32Cs of a buffer's three parts: the checksum is the triple.
``zlib.crc32`` (table-driven) ran at about a third of the disk's speed on the shared
2-core machine, so the NVMe tier's reads and writes waited on it; this runs several times
faster on one core. ctypes drops the GIL during the call.

[Note: no fallback] If the library cannot be built or loaded, :func:`load_library` raises
:class:`kernels._build.BuildError`; a caller that can use another checksum decides (and says
so).
"""

from __future__ import annotations

import ctypes

from kernels._native import CPU_FLAGS, build_and_load_cpu


class ChecksumLibrary:
    """The loaded library (``cmk_*`` functions of kernels/csrc/checksum_cpu.cpp)."""

    def __init__(self, lib: ctypes.CDLL, path) -> None:
        self.path = path
        self.has_sse42 = bool(lib.cmk_checksum_has_sse42())
        self._crc = lib.cmk_crc32c_3
        self._crc.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_uint32)]
        self._crc.restype = ctypes.c_int

    def crc32c_3(self, address: int, nbytes: int) -> tuple[int, int, int]:
        """The CRC32Cs of the three parts of the ``nbytes`` bytes at ``address``."""
        out = (ctypes.c_uint32 * 3)()
        if self._crc(address, nbytes, out) != 0:
            raise ValueError(f"cmk_crc32c_3: invalid buffer ({nbytes} bytes at {address:#x})")
        return out[0], out[1], out[2]


def load_library(extra_flags: tuple[str, ...] = ()) -> ChecksumLibrary:
    """Build (on a cache miss) and load the library; BuildError says why it cannot.
    ``extra_flags`` follow the CPU flags (the tests pass ``-mno-sse4.2`` for the table)."""
    lib, path = build_and_load_cpu(
        "chunkmem_checksum", "checksum_cpu.cpp", [*CPU_FLAGS, *extra_flags]
    )
    return ChecksumLibrary(lib, path)
