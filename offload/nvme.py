"""The NVMe tier: chunk payloads stored as files in a directory, moved by background threads.

A payload is an :class:`NvmeExtent`, one preallocated file, not a tensor: the tier is not
addressable (:mod:`chunkmem.tiers`). ``copy_in`` writes a spill-tier (host) tensor into a
new extent and ``copy_out`` reads an extent into one, both asynchronously; the residency
routes every other move through the host.

[Note: how a transfer runs] A transfer is cut into blocks of ``block_bytes``. Each block is
one job of a thread pool, and each job owns a page-aligned staging buffer (``mmap``) for the
length of its copy and its I/O, so files can be opened with ``O_DIRECT`` (no page cache) and
while one thread waits on the disk the other copies: double buffering. A write copies its
blocks from the source into the four shared write buffers on the calling thread (waiting
only while all four are in flight), so the source may be freed when ``copy_in`` returns and
the host holds nothing the ledger does not count: the staging buffers are counted as a host
workspace (:attr:`NvmeTier.staging_bytes`). Reads copy into their target on the I/O threads.
Copies are ``ctypes.memmove`` calls: single-threaded and without the GIL, so they take no
core from the compute.

[Note: failures] Every file is preallocated (``posix_fallocate``) before it is written, so a
full disk shows at allocation as :class:`TierFullError` with nothing lost and the partial
file removed. Extents are kept for reuse when freed, so the space reserved by the first step
stays reserved and later steps allocate nothing. Each block's checksum (CRC32C, three streams,
:mod:`kernels.checksum`; ``zlib.crc32`` where that library cannot be built, said once) is
kept in memory and checked on every read; a mismatch, a read that returns fewer bytes than were written, or a
failed write raises :class:`TierDataError` (the chunk's content is lost). Nothing is ever
read back as silent zeros.

[Note: cleanup] The tier works in a private directory ``<path>/chunkmem-<pid>-<random>``.
It is removed by ``close()``, at interpreter exit, or when the tier is collected, whichever
comes first (one ``weakref.finalize`` owns it), so also after an exception ends the program.
A process killed outside Python (SIGKILL, SIGTERM without a handler) leaves it behind; the
next tier created on the same path removes directories whose process is gone.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import queue
import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from chunkmem.errors import TierDataError, TierFullError, TierSetupError
from chunkmem.tiers import StorageTier
from kernels import checksum
from kernels._build import BuildError
from offload.nvme_io import (
    NO_SPACE,
    PAGE,
    NvmeExtent,
    RunResources,
    StagingBuffer,
    Transfer,
    make_run_dir,
    read_all,
    remove_stale_run_dirs,
    round_up,
    supports_direct_io,
    write_all,
)

_log = logging.getLogger("chunkmem.offload")

WRITE_BUFFERS = 4  # staging buffers writes share: the write-behind window, in blocks


def staging_bytes(block_bytes: int, io_threads: int) -> int:
    """Host bytes of the tier's staging buffers: one block per reading thread and the write
    window (``chunkmem estimate`` counts them with this)."""
    return (io_threads + WRITE_BUFFERS) * block_bytes


class NvmeTier(StorageTier):
    """Chunk payloads as files in ``directory`` (see the module's notes)."""

    addressable = False

    def __init__(
        self, directory: str | Path, block_bytes: int, io_threads: int, name: str = "nvme"
    ) -> None:
        if block_bytes % PAGE or block_bytes <= 0:
            raise ValueError(
                f"block_bytes must be a positive multiple of {PAGE}, got {block_bytes}"
            )
        self.name = name
        self.capacity = None  # bounded by the disk, checked at initialize (check_room)
        self.block_bytes = block_bytes
        self.base = Path(directory)
        remove_stale_run_dirs(self.base)
        root = make_run_dir(self.base)
        self._resources = RunResources(root)
        self._finalizer = weakref.finalize(self, self._resources.release)
        try:
            self.direct = supports_direct_io(root, self.base)
        except BaseException:
            self._finalizer()
            raise
        self.root = root
        self._resources.executor = ThreadPoolExecutor(
            io_threads, thread_name_prefix="chunkmem-nvme"
        )
        self._executor = self._resources.executor
        self._read_buffers: queue.Queue[StagingBuffer] = queue.Queue()
        self._write_buffers: queue.Queue[StagingBuffer] = queue.Queue()
        for _ in range(io_threads):
            self._read_buffers.put(StagingBuffer(block_bytes))
        for _ in range(WRITE_BUFFERS):
            self._write_buffers.put(StagingBuffer(block_bytes))
        self.staging_bytes = staging_bytes(block_bytes, io_threads)
        self._checksum = block_checksum()
        self._free: dict[int, list[NvmeExtent]] = {}
        self._free_lock = threading.Lock()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ setup checks
    def check_room(self, nbytes: int, what: str) -> None:
        """Raise :class:`TierSetupError` unless the disk has ``nbytes`` free for ``what``."""
        stats = os.statvfs(self.root)
        available = stats.f_bavail * stats.f_frsize
        if available < nbytes:
            raise TierSetupError(
                f"the NVMe directory {str(self.base)!r} has {available:,} bytes free but "
                f"{what} need {nbytes:,} bytes there: free space on that disk, choose another "
                f"offload.nvme.path, or lower offload.optimizer_ratio"
            )

    # ------------------------------------------------------------------ StorageTier
    def allocate(self, numel: int, dtype: torch.dtype) -> NvmeExtent:  # type: ignore[override]
        """A file of ``numel`` elements with its space reserved (a freed one if it fits)."""
        file_bytes = round_up(max(1, numel * dtype.itemsize), PAGE)
        with self._free_lock:
            free = self._free.get(file_bytes)
            if free:
                return free.pop().reuse(numel, dtype)
        path = self.root / f"chunk-{next(self._ids)}.bin"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, file_bytes)
            except OSError as exc:
                if exc.errno not in NO_SPACE or not self._delete_idle_extents():
                    raise
                os.posix_fallocate(fd, 0, file_bytes)  # with the idle files' space back
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in NO_SPACE:
                raise TierFullError(
                    f"no room for {file_bytes:,} more bytes in {str(self.base)!r} "
                    f"({os.strerror(exc.errno)}); the chunk stays where it was"
                ) from exc
            raise TierDataError(f"cannot reserve {file_bytes:,} bytes for {path}: {exc}") from exc
        self._resources.fds.add(fd)
        return NvmeExtent(path, fd, file_bytes).reuse(numel, dtype)

    def _delete_idle_extents(self) -> bool:
        """Delete the files kept for reuse (when the disk is full); whether there were any."""
        with self._free_lock:
            idle = [extent for extents in self._free.values() for extent in extents]
            self._free.clear()
        for extent in idle:
            self._resources.fds.discard(extent.fd)
            os.close(extent.fd)
            extent.path.unlink(missing_ok=True)
        return bool(idle)

    def free(self, payload: NvmeExtent) -> None:  # type: ignore[override]
        """Keep the file for reuse (its space stays reserved) once its transfers are done."""

        def recycle() -> None:
            with self._free_lock:
                self._free.setdefault(payload.file_bytes, []).append(payload)

        if payload.last is None:
            recycle()
        else:
            payload.last.when_done(recycle)

    def copy_in(  # type: ignore[override]
        self, source: torch.Tensor, reader_copies: bool = False
    ) -> tuple[NvmeExtent, Transfer]:
        """Write ``source`` (a contiguous CPU tensor) into a new extent. Blocks are copied into
        staging buffers here, so ``source`` may be freed on return; the disk writes finish in
        the background (wait on the returned transfer)."""
        if source.device.type != "cpu" or not source.is_contiguous():
            raise ValueError(f"the NVMe tier writes contiguous CPU tensors, got {source.device}")
        extent = self.allocate(source.numel(), source.dtype)
        nbytes = extent.nbytes
        crcs: list[object] = [None] * max(1, -(-nbytes // self.block_bytes))
        futures = []
        address = source.data_ptr()
        for index, offset in enumerate(range(0, nbytes, self.block_bytes)):
            length = min(self.block_bytes, nbytes - offset)
            buffer = self._write_buffers.get()
            ctypes.memmove(buffer.address, address + offset, length)
            futures.append(
                self._executor.submit(
                    self._write_block, extent, buffer, index, offset, length, crcs
                )
            )
        transfer = Transfer(futures)
        extent.crcs = crcs
        extent.last = transfer
        return extent, transfer

    def copy_out(self, payload: NvmeExtent, into: torch.Tensor) -> Transfer:  # type: ignore[override]
        """Read ``payload`` into ``into`` (a contiguous CPU tensor of its size) in the
        background; the transfer raises :class:`TierDataError` on a short read or a checksum
        mismatch."""
        if payload.last is not None:
            payload.last.wait()  # a write still in flight: read what it wrote
        if payload.crcs is None:
            raise TierDataError(f"{payload!r} was never written; it has no content to read")
        nbytes = payload.nbytes
        if into.numel() * into.element_size() != nbytes or not into.is_contiguous():
            raise ValueError(f"cannot read {payload!r} into a tensor of {into.nbytes:,} bytes")
        futures = [
            self._executor.submit(
                self._read_block,
                payload,
                into,
                index,
                offset,
                min(self.block_bytes, nbytes - offset),
            )
            for index, offset in enumerate(range(0, nbytes, self.block_bytes))
        ]
        transfer = Transfer(futures)
        payload.last = transfer
        return transfer

    def wait(self, event: object | None) -> None:
        if event is not None:
            event.wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Wait for the I/O threads, close every file and remove the directory."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ------------------------------------------------------------------ I/O threads
    def _write_block(
        self,
        extent: NvmeExtent,
        buffer: StagingBuffer,
        index: int,
        offset: int,
        length: int,
        crcs: list[object],
    ) -> None:
        try:
            crcs[index] = self._checksum(buffer, length)
            aligned = round_up(length, PAGE)
            if aligned > length:  # the file's last page: zeros past the data, for O_DIRECT
                ctypes.memset(buffer.address + length, 0, aligned - length)
            try:
                write_all(extent.fd, buffer.view[:aligned], offset)
            except OSError as exc:
                raise TierDataError(
                    f"writing {aligned:,} bytes at offset {offset:,} of {extent.path} failed "
                    f"({exc.strerror}); the chunk's content is lost"
                ) from exc
        finally:
            self._write_buffers.put(buffer)

    def _read_block(
        self, extent: NvmeExtent, into: torch.Tensor, index: int, offset: int, length: int
    ) -> None:
        buffer = self._read_buffers.get()
        try:
            aligned = round_up(length, PAGE)
            try:
                got = read_all(extent.fd, buffer.view[:aligned], offset)
            except OSError as exc:
                raise TierDataError(
                    f"reading {aligned:,} bytes at offset {offset:,} of {extent.path} failed "
                    f"({exc.strerror}); the chunk's content is lost"
                ) from exc
            if got < length:
                raise TierDataError(
                    f"short read: {extent.path} gave {got:,} of {length:,} bytes at offset "
                    f"{offset:,} (was the file truncated?); the chunk's content is lost"
                )
            assert extent.crcs is not None
            if self._checksum(buffer, length) != extent.crcs[index]:
                raise TierDataError(
                    f"checksum mismatch reading {extent.path} (bytes {offset:,}-"
                    f"{offset + length:,}): the file changed on disk or the disk returned bad "
                    f"data; the chunk's content is lost"
                )
            ctypes.memmove(into.data_ptr() + offset, buffer.address, length)
        finally:
            self._read_buffers.put(buffer)


@functools.cache
def block_checksum() -> Callable[[StagingBuffer, int], object]:
    """The checksum of a staging buffer's first ``length`` bytes: three CRC32Cs from the
    native library, else ``zlib.crc32`` (slower; one logged line says why)."""
    try:
        library = checksum.load_library()
    except BuildError as error:
        _log.warning(
            "the native checksum library cannot be used (%s); the NVMe tier checks its blocks "
            "with zlib.crc32, which is slower",
            error,
        )
        return lambda buffer, length: zlib.crc32(buffer.view[:length])
    return lambda buffer, length: library.crc32c_3(buffer.address, length)
