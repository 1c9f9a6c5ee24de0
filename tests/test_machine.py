"""What the machine has, read from the operating system and the driver: host memory budgets,
the process's RSS in reports, and the GPU's memory for ``chunkmem estimate``."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem import machine
from chunkmem.cli import main
from chunkmem.errors import CapacityError
from chunkmem.machine import GpuMemory

GiB = 1 << 30


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


@pytest.fixture
def ten_gib_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        machine.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=10 * GiB)
    )


def test_the_host_budget_defaults_to_a_share_of_available_memory_per_local_rank(
    ten_gib_available, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = {"type": "simulated", "capacity": "1MiB"}
    engine = chunkmem.initialize(_model(), config={"device": device})
    assert engine.ledger.tiers["host"].capacity == int(10 * GiB * machine.HOST_SHARE)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks share the machine's memory
    engine = chunkmem.initialize(_model(), config={"device": device})
    assert engine.ledger.tiers["host"].capacity == int(10 * GiB * machine.HOST_SHARE) // 4


def test_a_host_budget_beyond_the_memory_available_is_refused_with_the_numbers(
    ten_gib_available,
) -> None:
    config = {"device": {"type": "simulated", "capacity": "1MiB"}, "host": {"capacity": "12GiB"}}
    with pytest.raises(CapacityError, match=r"host.capacity is 12,884,901,888 bytes but .*"
                       r"10,737,418,240 bytes of host memory available"):  # fmt: skip
        chunkmem.initialize(_model(), config=config)
    config["host"]["capacity"] = "9GiB"
    assert chunkmem.initialize(_model(), config=config).ledger.tiers["host"].capacity == 9 * GiB


def test_the_report_carries_the_process_peak_rss() -> None:
    engine = chunkmem.initialize(
        _model(), config={"device": {"type": "simulated", "capacity": "1MiB"}}
    )
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    rss = machine.rss_bytes()
    summary = engine.run_summary()
    assert summary.peak_rss_bytes >= rss > 50 << 20
    assert summary.gpu is None  # no CUDA device computes here


class _FakeNvml(types.ModuleType):
    """pynvml's calls the engine makes, answering for one 80 GiB GPU."""

    def __init__(self) -> None:
        super().__init__("pynvml")

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        return None

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if index != 0:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int):  # noqa: N802
        return types.SimpleNamespace(total=80 * GiB, free=70 * GiB, used=10 * GiB)

    def nvmlDeviceGetUtilizationRates(self, handle: int):  # noqa: N802
        return types.SimpleNamespace(gpu=37)

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA H100 80GB HBM3"


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _FakeNvml())
    machine._nvml.cache_clear()
    yield
    machine._nvml.cache_clear()


def test_gpu_memory_reads_the_driver_and_is_none_without_one(one_gpu) -> None:
    assert machine.gpu_memory(0) == GpuMemory(0, "NVIDIA H100 80GB HBM3", 80 * GiB, 70 * GiB,
                                              10 * GiB, 37)  # fmt: skip
    assert machine.gpu_memory(3) is None


def test_no_driver_means_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.ModuleType("pynvml")
    broken.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("NVML Shared Library Not Found"))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", broken)
    machine._nvml.cache_clear()
    try:
        assert machine.gpu_memory(0) is None
    finally:
        machine._nvml.cache_clear()


def test_estimate_takes_the_device_memory_of_the_gpu_present(one_gpu, capsys) -> None:
    argv = ["estimate", "--set", "model.layers=2", "--set", "model.width=64", "--json"]
    assert main([*argv, "--set", "device.type=cuda"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device_capacity"] == 80 * GiB
    assert main(["estimate", "--set", "model.layers=2", "--set", "device.type=cuda"]) == 0
    assert "device memory: 80.0 GiB of GPU 0 (NVIDIA H100 80GB HBM3)" in capsys.readouterr().out
    assert main([*argv, "--set", "device.type=cuda", "--device-memory", "40GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["device_capacity"] == 40 * GiB
