"""The files and buffers the NVMe tier (:mod:`offload.nvme`) moves bytes through: an extent
(one preallocated file per payload), a transfer (its blocks in flight), page-aligned staging
buffers, whole reads and writes, and the tier's private run directory with what it holds
outside Python (files, I/O threads), released exactly once. The tier decides what moves when;
this module only does the I/O and keeps the resources."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from chunkmem.errors import TierSetupError

_log = logging.getLogger("chunkmem.offload")

PAGE = 4096  # direct I/O alignment of buffers, offsets and lengths (a multiple of any device's)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_RUN_DIR = re.compile(r"^chunkmem-(\d+)-")


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class NvmeExtent:
    """A payload of the NVMe tier: one file holding ``numel`` elements of ``dtype``.

    It is not a tensor: slicing it raises. ``crcs`` are the checksums of its blocks as last
    written (None until the first write is under way).
    """

    def __init__(self, path: Path, fd: int, file_bytes: int) -> None:
        self.path = path
        self.fd = fd
        self.file_bytes = file_bytes
        self.dtype = torch.uint8
        self._numel = 0
        self.crcs: list[object] | None = None
        self.last: Transfer | None = None  # the newest transfer touching the file

    def reuse(self, numel: int, dtype: torch.dtype) -> NvmeExtent:
        self._numel, self.dtype, self.crcs = numel, dtype, None
        return self

    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return self._numel * self.dtype.itemsize

    def __getitem__(self, key: object) -> None:
        raise TypeError(
            f"{self!r} is a chunk payload in a file on the NVMe tier, not a tensor: move the "
            f"chunk to the host tier (or read it with Residency.contents) first"
        )

    def __repr__(self) -> str:
        return f"NvmeExtent({str(self.path)!r}, {self.nbytes:,} bytes)"


class Transfer:
    """The blocks of one read or write in flight. ``wait()`` returns when every block is done
    and raises the first failure; ``when_done`` runs a callback then (on some thread)."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures
        self._lock = threading.Lock()
        self._remaining = len(futures)
        self._callbacks: list[Callable[[], None]] = []
        for future in futures:
            future.add_done_callback(self._one_done)

    def _one_done(self, _future: Future) -> None:
        with self._lock:
            self._remaining -= 1
            callbacks = self._callbacks if self._remaining == 0 else []
        for callback in callbacks:
            callback()

    def when_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._remaining:
                self._callbacks.append(callback)
                return
        callback()

    def is_completed(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        error: BaseException | None = None
        for future in self._futures:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                error = error or exc
        if error is not None:
            raise error


class StagingBuffer:
    """A page-aligned host buffer (anonymous ``mmap``) a block is copied through."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))


class RunResources:
    """What the tier holds outside Python's memory management: its directory, open files and
    I/O threads. The tier's finalizer owns it, so it is released exactly once: on close, at
    exit, or when the tier is collected."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: set[int] = set()
        self.executor: ThreadPoolExecutor | None = None

    def release(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        for fd in list(self.fds):
            os.close(fd)
        self.fds.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        written = os.pwritev(fd, [data[done:]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "the write made no progress")
        done += written


def read_all(fd: int, into: memoryview, offset: int) -> int:
    """Bytes read into ``into`` from ``offset``; fewer than asked only at the end of file."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def make_run_dir(base: Path) -> Path:
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TierSetupError(
            f"cannot create the NVMe directory {str(base)!r}: {exc.strerror}; set "
            f"offload.nvme.path to a writable directory"
        ) from exc
    try:
        return Path(tempfile.mkdtemp(prefix=f"chunkmem-{os.getpid()}-", dir=base))
    except OSError as exc:
        reason = "the disk is full" if exc.errno in NO_SPACE else "it is not writable"
        raise TierSetupError(
            f"the NVMe directory {str(base)!r} cannot hold chunk files: {reason} "
            f"({exc.strerror}); set offload.nvme.path to a writable directory with room"
        ) from exc


def supports_direct_io(root: Path, base: Path) -> bool:
    """Write a page to a probe file with O_DIRECT; False (and one logged line) where the
    filesystem refuses it (tmpfs). A full disk or an unwritable directory raises."""
    probe = root / "probe"
    buffer = StagingBuffer(PAGE)
    for direct in (True, False):
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                continue
            raise TierSetupError(
                f"the NVMe directory {str(base)!r} is not writable ({exc.strerror}); set "
                f"offload.nvme.path to a writable directory"
            ) from exc
        try:
            os.posix_fallocate(fd, 0, PAGE)
            write_all(fd, buffer.view, 0)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                continue
            if exc.errno in NO_SPACE:
                raise TierSetupError(
                    f"the disk holding the NVMe directory {str(base)!r} is full: not even "
                    f"{PAGE:,} bytes could be written ({exc.strerror})"
                ) from exc
            raise TierSetupError(f"cannot write to {str(base)!r}: {exc.strerror}") from exc
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        if not direct:
            _log.warning(
                "%s does not support O_DIRECT (tmpfs?); the NVMe tier uses buffered I/O there, "
                "through the page cache",
                base,
            )
        return direct
    raise AssertionError("unreachable")


def remove_stale_run_dirs(base: Path) -> None:
    """Remove run directories left in ``base`` by processes that no longer exist."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return  # missing or unreadable: make_run_dir says why
    for entry in entries:
        match = _RUN_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _log.warning("removing %s, left by process %s which is gone", entry, match.group(1))
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process
