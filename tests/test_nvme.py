"""The NVMe tier's failure semantics (docs/offload.md, "Failures"): each fault is a clear error
naming the path and the bytes, and leaves the engine and the files as documented.

Disks are small tmpfs mounts where this process may mount them (root), else those tests
skip; file-size limits (``RLIMIT_FSIZE``, in a subprocess) need nothing special.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from chunkmem.engine import EnginePhase
from chunkmem.errors import EngineUsageError, TierDataError, TierFullError, TierSetupError
from kernels import checksum
from kernels._build import BuildError
from offload import nvme
from offload.nvme import NvmeTier
from tests.offload_helpers import batches, initialize, make_model, train_engine

ROOT = Path(__file__).resolve().parents[1]
DEVICE = {"type": "simulated", "capacity": "8MiB"}


def nvme_config(path: Path) -> dict:
    return {"optimizer": "nvme", "nvme": {"path": str(path), "block_size": 4096}}


def chunk_files(path: Path) -> list[Path]:
    return sorted(path.glob("chunkmem-*/chunk-*.bin"))


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size, read_only=False)``: a fresh tmpfs of ``size`` (mount(8) syntax)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); run as root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Write a file until the disk is full."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\0" * 65536
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


# ---------------------------------------------------------------- the tier alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 1023, 4096 * 3 + 5])
def test_a_round_trip_is_exact_and_close_removes_the_directory(tmp_path, dtype, numel) -> None:
    tier = NvmeTier(tmp_path, block_bytes=8192, io_threads=2)
    source = torch.randn(numel).to(dtype)
    extent, write = tier.copy_in(source)
    source_copy = source.clone()
    source.zero_()  # copy_in returned: the source may be reused at once
    write.wait()
    back = torch.empty(numel, dtype=dtype)
    tier.copy_out(extent, back).wait()
    assert torch.equal(back, source_copy)
    with pytest.raises(TypeError, match="not a tensor"):
        extent[0]
    root = tier.root
    tier.close()
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_without_o_direct_the_tier_uses_buffered_io_and_says_so(
    tmp_path, monkeypatch, caplog
) -> None:
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="chunkmem.offload"):
        tier = NvmeTier(tmp_path, block_bytes=4096, io_threads=1)
    assert not tier.direct
    assert f"{tmp_path} does not support O_DIRECT" in caplog.text
    source = torch.randn(5000)
    extent, write = tier.copy_in(source)
    write.wait()
    back = torch.empty(5000)
    tier.copy_out(extent, back).wait()
    assert torch.equal(back, source)
    tier.close()


def test_block_checksums_are_crc32c_of_three_parts_and_the_table_build_agrees() -> None:
    library = checksum.load_library()
    table = checksum.load_library(("-mno-sse4.2",))
    assert not table.has_sse42
    check = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    # Under 24 bytes the first two parts are empty: the last is the whole buffer's CRC32C.
    assert library.crc32c_3(check.data_ptr(), 9) == (0, 0, 0xE3069283)  # RFC 3720's check
    for n in (0, 1, 8, 23, 24, 25, 4096 * 3 + 5):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        got = library.crc32c_3(data.data_ptr(), n)
        assert got == table.crc32c_3(data.data_ptr(), n), n
        if n:
            data[n // 2] ^= 1
            assert library.crc32c_3(data.data_ptr(), n) != got, n


def test_without_the_checksum_library_the_tier_uses_zlib_and_says_so(
    tmp_path, monkeypatch, caplog
) -> None:
    def no_compiler(*_args, **_kwargs):
        raise BuildError("no C++ compiler (g++) found")

    monkeypatch.setattr(checksum, "load_library", no_compiler)
    with caplog.at_level(logging.WARNING, logger="chunkmem.offload"):
        fallback = nvme.block_checksum.__wrapped__()
    assert "the NVMe tier checks its blocks with zlib.crc32" in caplog.text
    monkeypatch.setattr(nvme, "block_checksum", lambda: fallback)
    tier = NvmeTier(tmp_path, block_bytes=4096, io_threads=1)
    extent, write = tier.copy_in(torch.randn(3000))
    write.wait()
    assert all(isinstance(crc, int) for crc in extent.crcs)
    os.truncate(extent.path, 4096)
    with pytest.raises(TierDataError, match="short read"):
        tier.copy_out(extent, torch.empty(3000)).wait()
    tier.close()


def test_a_changed_file_fails_its_checksum_and_a_truncated_one_reads_short(tmp_path) -> None:
    tier = NvmeTier(tmp_path, block_bytes=4096, io_threads=2)
    changed, write = tier.copy_in(torch.randn(3000))
    write.wait()
    truncated, write = tier.copy_in(torch.randn(3000))
    write.wait()
    fd = os.open(changed.path, os.O_WRONLY)
    os.pwrite(fd, b"\x01", 5000)
    os.close(fd)
    os.truncate(truncated.path, 4096)
    into = torch.empty(3000)
    with pytest.raises(TierDataError, match=rf"checksum mismatch reading {changed.path}"):
        tier.copy_out(changed, into).wait()
    with pytest.raises(
        TierDataError, match=rf"short read: {truncated.path} gave 0 of 4,096 bytes at offset 4,096"
    ):
        tier.copy_out(truncated, into).wait()
    tier.close()


def test_directories_left_by_dead_processes_are_removed(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"chunkmem-{dead.pid}-abc"
    stale.mkdir()
    (stale / "chunk-0.bin").write_bytes(b"x")
    alive = tmp_path / f"chunkmem-{os.getpid()}-def"
    alive.mkdir()
    tier = NvmeTier(tmp_path, block_bytes=4096, io_threads=1)
    assert not stale.exists() and alive.exists()
    tier.close()


def test_files_are_removed_when_the_program_ends_with_an_error(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from tests.offload_helpers import batches, initialize, make_model
        engine = initialize(make_model(), device={DEVICE!r}, offload={nvme_config(tmp_path)!r})
        for x, y in batches(2, rows=8):
            engine.backward(engine(x, y))
            engine.step()
        assert list(Path({str(tmp_path)!r}).glob("*/chunk-*.bin"))
        raise SystemExit("an error ends the program")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 1 and "an error ends the program" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- at initialize
def test_an_unwritable_directory_fails_at_initialize_naming_it(small_disk) -> None:
    disk = small_disk("1m", read_only=True)
    with pytest.raises(TierSetupError, match=rf"NVMe directory '{disk}' .*not writable"):
        initialize(make_model(), device=DEVICE, offload=nvme_config(disk))


def test_a_full_disk_fails_at_initialize_naming_it(small_disk) -> None:
    disk = small_disk("256k")
    fill(disk)
    with pytest.raises(
        TierSetupError, match=rf"the disk holding the NVMe directory '{disk}' is full"
    ):
        initialize(make_model(), device=DEVICE, offload=nvme_config(disk))
    assert [p.name for p in disk.iterdir()] == ["filler"]


def test_too_little_free_space_fails_at_initialize_with_the_bytes(small_disk) -> None:
    disk = small_disk("256k")
    with pytest.raises(
        TierSetupError,
        match=rf"'{disk}' has 262,144 bytes free but the optimizer states \(masters and "
        rf"moments of [\d,]+ elements\) need [\d,]+ bytes there",
    ):
        initialize(make_model(), device=DEVICE, offload=nvme_config(disk))
    assert list(disk.iterdir()) == [], "nothing is left behind"


# ---------------------------------------------------------------- while training
def test_a_disk_that_fills_before_the_first_step_fails_it_and_the_engine_trains_on(
    small_disk,
) -> None:
    """The states are placed at the first step. A full disk there fails the step before
    anything is updated: the batch is dropped, and once there is room again the engine
    trains on exactly as if that batch had been skipped."""
    data = batches(6, rows=8)
    disk = small_disk("2m")
    engine = initialize(make_model(), device=DEVICE, offload=nvme_config(disk))
    engine.backward(engine(*data[0]))
    filler = fill(disk)
    with pytest.raises(TierFullError, match=rf"no room for [\d,]+ more bytes in '{disk}'"):
        engine.step()
    assert engine.phase is EnginePhase.IDLE and engine.stopped_because is None
    assert engine.states.homes is None and chunk_files(disk) == []
    filler.unlink()
    train_engine(engine, data[1:])
    skipped = initialize(make_model(), device=DEVICE, offload={"optimizer": "host"})
    train_engine(skipped, data[1:])
    expected = skipped.state_dict()
    for name, value in engine.state_dict().items():
        assert torch.equal(value, expected[name]), name
    engine.close()
    assert list(disk.iterdir()) == []


RLIMIT_RUN = """
import resource, torch
from chunkmem.errors import TierDataError, TierFullError
from tests.offload_helpers import batches, initialize, make_model
engine = initialize(make_model(), device={device!r}, offload={offload!r})
data = batches(4, rows=8)
for x, y in data[:{steps_before}]:
    engine.backward(engine(x, y))
    engine.step()
engine.backward(engine(*data[{steps_before}]))
# Every file is 4 pages or more: writes past the first page now fail with EFBIG.
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    engine.step()
except (TierDataError, TierFullError) as error:
    print("RAISED", type(error).__name__, error)
print("PHASE", engine.phase.value)
print("STOPPED", engine.stopped_because)
"""


def run_with_file_size_limit(tmp_path: Path, steps_before: int) -> str:
    script = RLIMIT_RUN.format(
        device=DEVICE, offload=nvme_config(tmp_path), steps_before=steps_before
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == [], "the files are removed at exit"
    return result.stdout


def test_a_file_size_limit_at_the_first_step_fails_it_with_nothing_lost(tmp_path) -> None:
    out = run_with_file_size_limit(tmp_path, steps_before=0)
    assert "RAISED TierFullError no room for" in out and "(File too large)" in out
    assert "PHASE idle" in out and "STOPPED None" in out


def test_a_write_that_fails_after_the_update_stops_the_engine(tmp_path) -> None:
    out = run_with_file_size_limit(tmp_path, steps_before=2)
    assert "RAISED TierDataError writing 4,096 bytes at offset 4,096 of " in out
    assert "(File too large); the chunk's content is lost" in out
    assert "PHASE stopped" in out and "failed after it began updating" in out


def test_a_corrupted_chunk_file_stops_the_engine_naming_the_file(tmp_path) -> None:
    data = batches(3, rows=8)
    engine = initialize(make_model(), device=DEVICE, offload=nvme_config(tmp_path))
    train_engine(engine, data[:2])
    victim = chunk_files(tmp_path)[0]
    fd = os.open(victim, os.O_WRONLY)
    os.pwrite(fd, b"\xff\xff", 100)
    os.close(fd)
    engine.backward(engine(*data[2]))
    with pytest.raises(TierDataError, match=rf"checksum mismatch reading {victim}"):
        engine.step()
    assert engine.phase is EnginePhase.STOPPED
    with pytest.raises(EngineUsageError, match="the engine stopped and cannot train on: "):
        engine(*data[0])
    assert victim.exists(), "the files stay until close (or exit)"
    engine.close()
    assert list(tmp_path.iterdir()) == []
