"""Host AdamW step: the native host optimizer (kernels.host_optim) against torch's fastest CPU
paths, on one large flat buffer, measured in one run.

    python -m benchmarks.host_adam [--quick] [--json PATH]

Jobs, each one AdamW step over N elements (100M; --quick: 10M):

- (a) mixed precision, what offload does: bf16 gradients in, fp32 masters and moments updated,
  bf16 parameters out. Native: one pass (kernels.host_optim.fused_adamw_ with params_out).
  torch has no fused op for it, so its baseline is the composition: widen the gradients to fp32,
  ``torch._fused_adamw_`` (``AdamW(fused=True)``'s kernel) on the masters, copy the masters to
  bf16. Two compositions are timed and the faster is the baseline: over the whole buffer, and
  in 1M-element pieces through a reused fp32 workspace (the way chunkmem's engine does it,
  which keeps the widened gradients in cache).
- (b) fp32: fp32 gradients, params and moments, native against ``torch._fused_adamw_``.
- the physical anchor: the mixed job moves the same 28 bytes per element as fused fp32 AdamW
  (reads grad, master, two moments; writes master, two moments, the bf16 param), so its
  elements/s is compared with fused fp32 AdamW's, same N, same run.

[Note: shared machine] Every callable runs once per round, round-robin, with the order reversed
every other round, and ratios are taken within a round between calls that run back to back
(the whole-buffer composition and the native mixed step; the native mixed step and fused fp32;
fused fp32 and the native fp32 step), then the median, quartiles and range over rounds are
reported. The workspace composition only competes for the baseline by its median. GB/s are "effective": the bytes each job must move per
element (28 for the fused jobs, 40 for the composition, which writes and reads the widened
gradient and reads the masters once more) times elements per second.

Two states take turns (see alternating): each round the native jobs update one and torch's
jobs the other, so both see the same steps in the same order and must be bit-identical at the
end (the check fails the run if not).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks._common import parse_args, print_table, write_results
from benchmarks._timing import sample_seconds
from kernels import host_optim

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8}
WORKSPACE_ELEMENTS = 1 << 20
BYTES_PER_ELEMENT = {"native_mixed": 28, "torch_mixed": 40, "torch_mixed_workspace": 40}
BYTES_PER_ELEMENT |= {"native_fp32": 28, "torch_fp32": 28}


class AdamState:
    """fp32 masters and moments, a step counter, a bf16 copy of the masters and an fp32
    gradient buffer (the composition widens into it; the fp32 jobs read it)."""

    def __init__(self, params: torch.Tensor, grads_bf16: torch.Tensor) -> None:
        self.params = params.clone()
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.step = torch.zeros((), dtype=torch.float32)
        self.params_bf16 = params.to(torch.bfloat16)
        self.grads_fp32 = grads_bf16.float()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "params": self.params,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "params_bf16": self.params_bf16,
        }


def torch_fused(state: AdamState, grads: torch.Tensor, lo: int = 0, hi: int | None = None):
    s = slice(lo, hi)
    torch._fused_adamw_(
        [state.params[s]],
        [grads],
        [state.exp_avg[s]],
        [state.exp_avg_sq[s]],
        [],
        [state.step],
        amsgrad=False,
        maximize=False,
        **HYPER,
    )


def alternating(states: list[AdamState], first: int) -> Callable[[], AdamState]:
    """The state a job updates on each call: states[first], then the other one, and so on.

    [Note: swapped buffers] On this VM, buffers allocated at different times were measured to
    run at different speeds (the first-allocated state ~5-10% slower, whichever kernel ran on
    it). So the native and the torch jobs swap the two states every round: each kernel runs on
    each state's memory half of the time. Both sides apply the same steps in the same order, so
    the two states stay equal, and must be bit-identical at the end.
    """
    calls = [first]

    def next_state() -> AdamState:
        calls[0] += 1
        return states[(calls[0] - 1) % 2]

    return next_state


def jobs(n: int) -> tuple[dict[str, Callable[[], None]], list[AdamState]]:
    generator = torch.Generator().manual_seed(0)
    params = torch.randn(n, generator=generator) * 0.02
    grads_bf16 = (torch.randn(n, generator=generator) * 1e-3).to(torch.bfloat16)
    states = [AdamState(params, grads_bf16), AdamState(params, grads_bf16)]
    piecewise = AdamState(params, grads_bf16[:0])
    del params
    workspace = torch.empty(WORKSPACE_ELEMENTS)
    native_state, native_fp32_state = alternating(states, 0), alternating(states, 0)
    torch_state, torch_fp32_state = alternating(states, 1), alternating(states, 1)

    def native_mixed() -> None:
        state = native_state()
        state.step += 1
        host_optim.fused_adamw_(
            [state.params],
            [grads_bf16],
            [state.exp_avg],
            [state.exp_avg_sq],
            [],
            [state.step],
            params_out=[state.params_bf16],
            **HYPER,
        )

    def torch_mixed() -> None:
        state = torch_state()
        state.step += 1
        state.grads_fp32.copy_(grads_bf16)
        torch_fused(state, state.grads_fp32)
        state.params_bf16.copy_(state.params)

    def torch_mixed_workspace() -> None:
        piecewise.step += 1
        for lo in range(0, n, WORKSPACE_ELEMENTS):
            hi = min(lo + WORKSPACE_ELEMENTS, n)
            piece = workspace[: hi - lo]
            piece.copy_(grads_bf16[lo:hi])
            torch_fused(piecewise, piece, lo, hi)
            piecewise.params_bf16[lo:hi].copy_(piecewise.params[lo:hi])

    def native_fp32() -> None:
        state = native_fp32_state()
        state.step += 1
        host_optim.fused_adamw_(
            [state.params],
            [state.grads_fp32],
            [state.exp_avg],
            [state.exp_avg_sq],
            [],
            [state.step],
            **HYPER,
        )

    def torch_fp32() -> None:
        state = torch_fp32_state()
        state.step += 1
        torch_fused(state, state.grads_fp32)

    # Each pair that a ratio compares runs back to back in every round, whichever the order.
    fns = {
        "torch_mixed_workspace": torch_mixed_workspace,
        "torch_mixed": torch_mixed,
        "native_mixed": native_mixed,
        "torch_fp32": torch_fp32,
        "native_fp32": native_fp32,
    }
    return fns, states


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """numerator[i] / denominator[i] per round: median, quartiles and range."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "median": statistics.median(ratios),
        "p25": quartiles[0],
        "p75": quartiles[2],
        "min": ratios[0],
        "max": ratios[-1],
    }


def machine() -> dict[str, object]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    meminfo = {
        ln.split(":")[0]: ln.split(":")[1].strip()
        for ln in read("/proc/meminfo").splitlines()
        if ":" in ln
    }
    return {
        "cpu_model": model,
        "logical_cores": os.cpu_count(),
        "memory_total": meminfo.get("MemTotal"),
        "transparent_hugepages": read("/sys/kernel/mm/transparent_hugepage/enabled").strip(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("host_adam", __doc__.splitlines()[0], argv)
    n, rounds = (10_000_000, 9) if args.quick else (100_000_000, 21)
    library = host_optim._library()  # raises if the native library cannot be built
    fns, states = jobs(n)
    samples = sample_seconds(fns, repeats=rounds, warmup=1, alternate=True)
    identical = all(
        torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )
        for a, b in zip(states[0].tensors().values(), states[1].tensors().values(), strict=True)
    )

    medians = {name: statistics.median(times) for name, times in samples.items()}
    baseline = min(("torch_mixed", "torch_mixed_workspace"), key=medians.__getitem__)
    mixed_speedup = paired_ratio(samples[baseline], samples["native_mixed"])
    fp32_ratio = paired_ratio(samples["torch_fp32"], samples["native_fp32"])
    anchor = paired_ratio(samples["torch_fp32"], samples["native_mixed"])
    metrics = {
        "mixed_step_speedup_vs_torch": mixed_speedup["median"],
        "elements_per_s_ratio_vs_torch_fused": fp32_ratio["median"],
        "mixed_elements_per_s_ratio_vs_fp32_fused": anchor["median"],
    }
    per_job = {
        name: {
            "median_s": medians[name],
            "min_s": min(times),
            "max_s": max(times),
            "elements_per_s": n / medians[name],
            "effective_GBps": BYTES_PER_ELEMENT[name] * n / medians[name] / 1e9,
            "bytes_per_element": BYTES_PER_ELEMENT[name],
            "samples_s": times,
        }
        for name, times in samples.items()
    }
    details = {
        "elements": n,
        "rounds": rounds,
        "hyper_parameters": HYPER,
        "torch_threads": torch.get_num_threads(),
        "native_threads": torch.get_num_threads(),
        "native_library": str(library.path),
        "native_avx2": library.has_avx2,
        "mixed_baseline": baseline,
        "mixed_step_speedup_vs_torch": mixed_speedup,
        "mixed_step_speedup_vs_each_composition": {
            name: paired_ratio(samples[name], samples["native_mixed"])["median"]
            for name in ("torch_mixed", "torch_mixed_workspace")
        },
        "elements_per_s_ratio_vs_torch_fused": fp32_ratio,
        "mixed_elements_per_s_ratio_vs_fp32_fused": anchor,
        "states_bit_identical_after_alternating_native_and_torch_steps": identical,
        "jobs": per_job,
        "machine": machine(),
    }
    print_table(
        f"one AdamW step over {n:,} elements, {rounds} rounds, {torch.get_num_threads()} threads "
        f"(medians; range over rounds)",
        ["job", "median ms", "min ms", "max ms", "G elem/s", "GB/s eff."],
        [
            [
                name,
                j["median_s"] * 1e3,
                j["min_s"] * 1e3,
                j["max_s"] * 1e3,
                j["elements_per_s"] / 1e9,
                j["effective_GBps"],
            ]
            for name, j in per_job.items()
        ],
    )
    print_table(
        "ratios within a round (median over rounds; quartiles; range)",
        ["key", "median", "p25", "p75", "min", "max", "goal"],
        [
            [f"mixed_step_speedup_vs_torch ({baseline})", *mixed_speedup.values(), ">= 1.3"],
            ["elements_per_s_ratio_vs_torch_fused", *fp32_ratio.values(), ">= 1.0"],
            ["mixed_elements_per_s_ratio_vs_fp32_fused", *anchor.values(), ">= 0.9"],
        ],
    )
    print(f"\nthe two states bit-identical after {rounds + 1} rounds: {identical}")
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nwritten to {path}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
