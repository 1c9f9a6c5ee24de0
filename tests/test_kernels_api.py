"""Argument errors, backend selection, the one-time fallback warning, the build cache and the
CUDA library loader's checks."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels import QuantizedTensor
from kernels._build import CSRC, BuildError, build

REPO = Path(__file__).resolve().parents[1]


def _q(numel=128, bits=8, group_size=64, symmetric=True, seed=0):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return kernels.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)


@pytest.mark.parametrize(
    "x, error, words",
    [
        (torch.arange(8), TypeError, "torch.int64"),
        (torch.randn(8, dtype=torch.float64), TypeError, "torch.float64"),
        (torch.randn(8, 4).t(), ValueError, "contiguous"),
        ([1.0, 2.0], TypeError, "list"),
    ],
)
def test_bad_inputs_are_named(x, error, words):
    with pytest.raises(error, match=words):
        kernels.quantize(x, bits=8, group_size=4, symmetric=True)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(bits=3, group_size=4), "bits must be 4 or 8, got 3"),
        (dict(bits=8, group_size=0), "group_size must be an int >= 1, got 0"),
        (dict(bits=8, group_size=2.0), "group_size must be an int"),
        (dict(bits=4, group_size=5), "must be even for bits=4"),
    ],
)
def test_bad_formats_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        kernels.quantize(torch.randn(8), symmetric=True, **kwargs)


def test_swizzle_needs_a_topology():
    with pytest.raises(ValueError, match="nodes must be an int >= 1, got 0"):
        kernels.swizzled_quantize(
            torch.randn(8), nodes=0, devices_per_node=2, bits=8, group_size=4, symmetric=True
        )


@pytest.mark.parametrize(
    "field, other",
    [
        ("numel", _q(numel=192)),
        ("bits", _q(bits=4)),
        ("group_size", _q(group_size=32)),
        ("symmetric", _q(symmetric=False)),
    ],
)
def test_mismatched_reduce_inputs_are_named(field, other):
    with pytest.raises(ValueError, match=f"inputs\\[1\\].{field}="):
        kernels.dequant_reduce_requant([_q(), other])
    with pytest.raises(ValueError, match=f"inputs\\[1\\].{field}="):
        kernels.dequant_reduce([_q(), other])


def test_reduce_input_errors():
    with pytest.raises(ValueError, match="non-empty list"):
        kernels.dequant_reduce([])
    with pytest.raises(TypeError, match="inputs\\[1\\] is a Tensor"):
        kernels.dequant_reduce([_q(), torch.zeros(3)])
    with pytest.raises(TypeError, match="out_dtype"):
        kernels.dequant_reduce([_q()], out_dtype=torch.int32)
    q = _q()
    meta = QuantizedTensor(
        q.data.to("meta"), q.scales.to("meta"), None, q.numel, 8, 64, True, torch.float32
    )
    with pytest.raises(ValueError, match="inputs\\[1\\] is on meta but inputs\\[0\\] is on cpu"):
        kernels.dequant_reduce([q, meta])


def test_quantized_tensor_checks_its_parts():
    q = _q()
    with pytest.raises(ValueError, match="scales holds 3 values, but numel=128"):
        QuantizedTensor(q.data, torch.ones(3), None, 128, 8, 64, True, torch.float32)
    with pytest.raises(TypeError, match="data must be a 1-D torch.uint8 tensor"):
        QuantizedTensor(q.data.to(torch.int8), q.scales, None, 128, 8, 64, True, torch.float32)
    with pytest.raises(ValueError, match="offsets must be a float32 tensor when symmetric=False"):
        QuantizedTensor(q.data, q.scales, None, 128, 8, 64, False, torch.float32)


def test_split_gives_views_of_whole_groups():
    q = _q(numel=256, bits=4, group_size=32, symmetric=False)
    parts = q.split(4)
    assert [p.numel for p in parts] == [64] * 4
    assert torch.equal(torch.cat([kernels.dequantize(p) for p in parts]), kernels.dequantize(q))
    assert parts[1].data.data_ptr() == q.data.data_ptr() + 32
    with pytest.raises(ValueError, match="multiple of parts \\* group_size"):
        q.split(3)


def test_backend_argument_errors():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="backend='cuda' cannot run tensors on cpu"):
        kernels.quantize(x, bits=8, group_size=4, symmetric=True, backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        kernels.quantize(x, bits=8, group_size=4, symmetric=True, backend="gpu")


def test_backend_for_names_the_choice_and_the_reason(monkeypatch):
    choice = kernels.backend_for("cpu")
    assert choice.name == "cpu" and "libchunkmem_quant_cpu.so" in choice.reason
    cuda = kernels.backend_for("cuda")
    if not torch.cuda.is_available():
        assert cuda.name == "reference" and "sees no CUDA device" in cuda.reason
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels.backend_for("cpu") == kernels.BackendChoice(
        "reference", "CHUNKMEM_KERNELS_BACKEND=reference"
    )
    monkeypatch.setenv(kernels.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="CHUNKMEM_KERNELS_BACKEND='fast'"):
        kernels.backend_for("cpu")


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_a_compiler_the_reference_runs_and_one_warning_says_why(tmp_path):
    result = _run_python(
        """
        import warnings, torch, kernels
        from kernels import reference
        warnings.simplefilter("always")
        x = torch.randn(1000)
        with warnings.catch_warnings(record=True) as caught:
            q = kernels.quantize(x, bits=4, group_size=64, symmetric=True)
            y = kernels.dequantize(q)
            kernels.dequant_reduce([q, q])
        assert torch.equal(y, reference.dequantize(reference.quantize(x, bits=4, group_size=64, symmetric=True)))
        assert kernels.backend_for("cpu").name == "reference"
        try:
            kernels.quantize(x, bits=8, group_size=64, symmetric=True, backend="cpu")
        except RuntimeError as e:
            print("forced:", e)
        for w in caught:
            print("warning:", w.category.__name__, w.message)
        """,
        {"CXX": "no-such-compiler", "CHUNKMEM_CACHE_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    warnings_ = [ln for ln in result.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings_) == 1, result.stdout
    assert "RuntimeWarning" in warnings_[0] and "no-such-compiler not found on PATH" in warnings_[0]
    assert "forced: backend='cpu' is unavailable: no-such-compiler not found" in result.stdout


def test_concurrent_first_builds_share_one_cache_entry(tmp_path):
    """Two processes miss the cache at once (the ranks of a distributed run); a tiny source
    through the same ``build`` as the kernels (the real library takes 15 s to compile)."""
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int answer() { return 42; }\n')
    code = (
        "import shutil, sys; from pathlib import Path; from kernels._build import build; "
        "print(build('tiny', shutil.which('g++') or 'g++', Path(sys.argv[1]), "
        "['-shared', '-fPIC']))"
    )
    cache = tmp_path / "cache"
    env = {**os.environ, "CHUNKMEM_CACHE_DIR": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(source)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    files = [p for p in sorted(cache.rglob("*")) if p.is_file()]
    assert len(paths) == 1 and files == [Path(paths.pop())]
    assert ctypes.CDLL(str(files[0])).answer() == 42


def test_a_failed_build_shows_the_compiler_output(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKMEM_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(BuildError, match="exited 1"):
        build("broken", shutil.which("g++") or "g++", bad, ["-shared", "-fPIC"])
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_loader_rejects_a_library_for_another_cuda_or_device(tmp_path, monkeypatch):
    """Built here with nvcc; without a GPU every call must fail with a readable error, not crash."""
    from kernels._cuda import NVCC_FLAGS, check_library

    monkeypatch.setenv("CHUNKMEM_CACHE_DIR", str(tmp_path))
    path = build(
        "chunkmem_quant_cuda",
        shutil.which("nvcc"),
        CSRC / "quant_cuda.cu",
        [*NVCC_FLAGS, "-arch=sm_80"],
    )
    lib = ctypes.CDLL(str(path))
    version = lib.cmq_cuda_runtime_version()
    built = f"{version // 1000}.{version % 1000 // 10}"
    with pytest.raises(BuildError, match=f"built for CUDA {built} but torch uses CUDA 1.0"):
        check_library(lib, path, "1.0")
    with pytest.raises(BuildError, match="is a CPU build"):
        check_library(lib, path, None)
    if not torch.cuda.is_available():
        with pytest.raises(BuildError, match="cannot run on this device: probe: "):
            check_library(lib, path, built)
