"""Gradient compression (zero.compression): the codes bit for bit against the reference, each
compressor against a reference written from its paper on the in-process world, TernGrad's
unbiasedness over seeds, training at ZeRO 1-3, and the combinations refused by name."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.cli.settings import ModelSettings
from chunkmem.errors import ConfigError, EngineUsageError
from kernels import compression as codes_ops
from kernels import compression_reference as reference
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads
from tests.test_estimate import SMALL, measure, predict
from tests.test_estimate import config as estimate_config
from zero.kinds import DGC_VELOCITY, EF_RESIDUAL

WORLD = 4
# Deep Gradient Compression's recipe at the tests' scale (tests/test_dgc.py has the rest)
DGC_PAPER = {
    "type": "dgc",
    "block_size": 32,
    "density": 0.1,
    "momentum_correction": True,
    "freeze_variance": True,
    "warmup_steps": 2,
    "sparsity_warmup_steps": 2,
}


# ---------------------------------------------------------------- codes


# the CUDA case runs under `pytest -m cuda` (make gpu-check) and is skipped without a GPU
NATIVE_BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_codes_match_the_reference_bit_for_bit(backend: str, block: int) -> None:
    torch.manual_seed(block)
    n = block * 9
    x = torch.randn(n) * torch.rand(n)
    x[3], x[4], x[block + 1] = -0.0, 0.0, float("nan")  # a NaN block and signed zeros
    results = {}
    for name in ("reference", backend):
        device = "cuda" if name == "cuda" else "cpu"
        xd = x.to(device)
        codes = torch.empty(n // 8, dtype=torch.uint8, device=device)
        scales = torch.empty(n // block, device=device)
        residual = torch.empty(n, device=device)
        codes_ops.onebit_compress(
            xd, block=block, codes=codes, scales=scales, residual=residual, backend=name
        )
        tcodes = torch.empty(n // 4, dtype=torch.uint8, device=device)
        tscales = torch.empty(n // block, device=device)
        codes_ops.ternary_compress(
            xd, block=block, seed=2**32 - 7, codes=tcodes, scales=tscales, backend=name
        )
        sums = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.empty(n, dtype=dtype, device=device)
            codes_ops.decompress_sum(
                [codes, codes],
                [scales, scales * 3],
                code="onebit",
                block=block,
                out=out,
                backend=name,
            )
            sums.append(out)
            out = torch.empty(n, dtype=dtype, device=device)
            codes_ops.decompress_sum(
                [tcodes, tcodes, tcodes],
                [tscales] * 3,
                code="ternary",
                block=block,
                out=out,
                backend=name,
            )
            sums.append(out)
        results[name] = [t.cpu() for t in (codes, scales, residual, tcodes, tscales, *sums)]
    for ref, native in zip(results["reference"], results[backend], strict=True):
        assert _same_bits(ref, native)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that a NaN equals any NaN (its sign and payload are unspecified)."""
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_onebit_code_is_the_papers_sign_and_mean_magnitude() -> None:
    """Written from 1-bit SGD: each element becomes sign(x) (0 counts as +) times its block's
    mean |x|, the scale that minimises the squared error; the residual is what is left."""
    x = torch.tensor([1.0, -3.0, 0.0, 2.0] * 8 + [-1.0] * 32)
    codes = torch.empty(8, dtype=torch.uint8)
    scales = torch.empty(2)
    residual = torch.empty(64)
    codes_ops.onebit_compress(x, block=32, codes=codes, scales=scales, residual=residual)
    assert scales.tolist() == [1.5, 1.0]
    decoded = torch.empty(64)
    codes_ops.decompress_sum([codes], [scales], code="onebit", block=32, out=decoded)
    want = torch.tensor([1.5, -1.5, 1.5, 1.5] * 8 + [-1.0] * 32)
    assert torch.equal(decoded, want)
    assert torch.equal(residual, x - want)


def test_terngrad_is_unbiased_over_seeds() -> None:
    """E[decoded] = x: the mean over 2000 seeds is within 4.5 standard errors of x in every
    element (each draw is 0 or +-scale, so its variance is |x| scale - x^2)."""
    torch.manual_seed(0)
    x = torch.randn(1024)
    seeds = 2000
    total = torch.zeros(1024)
    for seed in range(seeds):
        codes = torch.empty(256, dtype=torch.uint8)
        scales = torch.empty(4)
        codes_ops.ternary_compress(x, block=256, seed=seed, codes=codes, scales=scales)
        out = torch.empty(1024)
        codes_ops.decompress_sum([codes], [scales], code="ternary", block=256, out=out)
        assert set(torch.unique(out / scales.repeat_interleave(256)).tolist()) <= {-1.0, 0.0, 1.0}
        total += out
    scale = x.abs().view(4, 256).amax(dim=1).repeat_interleave(256)
    stderr = ((x.abs() * scale - x * x).clamp_min(0) / seeds).sqrt()
    # (a block's maximum is always sent whole: no variance, only the fp32 sum's rounding)
    assert ((total / seeds - x).abs() <= 4.5 * stderr + 1e-4).all()


def test_bad_code_arguments_are_refused() -> None:
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="power of two"):
        codes_ops.onebit_compress(
            x, block=48, codes=torch.empty(8, dtype=torch.uint8), scales=torch.empty(1)
        )
    with pytest.raises(ValueError, match="float32"):
        codes_ops.onebit_compress(
            x.bfloat16(), block=32, codes=torch.empty(8, dtype=torch.uint8), scales=torch.empty(2)
        )
    with pytest.raises(ValueError, match="codes must be"):
        codes_ops.ternary_compress(
            x, block=32, seed=1, codes=torch.empty(8, dtype=torch.uint8), scales=torch.empty(2)
        )


# ---------------------------------------------------------------- reductions


class TwoLayers(nn.Module):
    """A matrix PowerSGD compresses, a vector and a small matrix it sends exactly, and a size
    that leaves padded slices."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.down(torch.tanh(self.up(x))), y)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)


class Recording:
    """Wraps a reduction: what each launch read (the gradient chunk, the residual and DGC's
    velocity before: zeros while none exists) and what its wait left (the shard, both states
    after; a residual that does not exist is None)."""

    def __init__(self, inner: Any, log: list[dict]) -> None:
        self.inner = inner
        self.log = log

    @staticmethod
    def _state(layout, kind, missing):
        chunk = layout.chunks.get(kind)
        return missing if chunk is None else chunk.payload.clone()

    def launch(self, layout, full, shard):
        zeros = torch.zeros(layout.capacity)
        entry = {
            "layout": layout.index,
            "used": layout.used,
            "full": full.float().clone(),
            "before": self._state(layout, EF_RESIDUAL, zeros),
            "velocity": self._state(layout, DGC_VELOCITY, zeros),
        }
        work = self.inner.launch(layout, full, shard)
        log, state = self.log, self._state

        class Waited:
            def is_completed(self) -> bool:
                return work.is_completed()

            def wait(self) -> None:
                work.wait()
                entry["shard"] = shard.float().clone()
                entry["after"] = state(layout, EF_RESIDUAL, None)
                entry["velocity_after"] = state(layout, DGC_VELOCITY, zeros)
                log.append(entry)

        return Waited()


def _engine(comm, compression: dict, stage: int, **config: Any):
    """TwoLayers, initialized alike on every rank, at ``stage`` with ``compression``."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        module = TwoLayers()
    config = {
        "device": {"type": "simulated", "capacity": "16MiB"},
        "zero": {"stage": stage, "timeout_s": 30},
        "compression": compression,
        **config,
    }
    return chunkmem.initialize(module, comm=comm, config=config)


def train_recorded(comm, compression: dict, stage: int, precision: str, steps: int) -> dict:
    engine = _engine(
        comm, compression, stage, precision=precision, gradient_clipping=1.0, chunk={"size": 512}
    )
    log: list[dict] = []
    engine.reducer.reduction = Recording(engine.reducer.reduction, log)
    initial = parameters(engine)
    losses = []
    for step in range(steps):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    slots = {
        layout.index: {slot.name: (slot.offset, tuple(slot.shape)) for slot in layout.slots}
        for layout in engine.params.layouts
    }
    residual_bytes = sum(t.by_kind[EF_RESIDUAL.value] for t in engine.ledger.tiers.values())
    q_bytes = sum(t.by_kind["powersgd_q"] for t in engine.ledger.tiers.values())
    trainable = sum(layout.capacity for layout in engine.params.trainable_layouts())
    return {
        "log": log,
        "losses": losses,
        "moved": moved_since(engine, initial),
        "slots": slots,
        "residual_bytes": residual_bytes,
        "q_bytes": q_bytes,
        "trainable_elements": trainable,
    }


def parameters(engine) -> dict[str, torch.Tensor]:
    return {name: value.float().clone() for name, value in engine.state_dict().items()}


def moved_since(engine, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value - initial[name] for name, value in parameters(engine).items()}


# Measured over 5-6 steps here: cosine 0.68-0.96 and norm ratio 0.80-1.01 for every method and
# composition (TernGrad and DGC lowest); half the learning rate would give a ratio near 0.5.
MIN_UPDATE_COSINE = 0.6
UPDATE_NORM_RATIO = (0.7, 1.4)


def assert_trains_like(ours: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], why) -> None:
    """The parameters moved as exact training moved them: in about the same direction (the
    cosine of the two updates, every parameter flattened) and by about as much. A few steps
    barely move the loss, so a loss band alone passes a run that does not train at all (the
    losses of a run at lr 1e-12 stay within 5% of exact training's here) or one at another
    scale; this does not."""
    names = sorted(exact)
    a = torch.cat([ours[name].flatten() for name in names]).double()
    b = torch.cat([exact[name].flatten() for name in names]).double()
    cosine = float(a @ b / (a.norm() * b.norm()))
    ratio = float(a.norm() / b.norm())
    low, high = UPDATE_NORM_RATIO
    assert cosine >= MIN_UPDATE_COSINE and low <= ratio <= high, (why, cosine, ratio)


def _by_launch(results: list[dict]) -> list[list[dict]]:
    """The k-th reduction of every rank, for every k (ranks launch in one order)."""
    logs = [r["log"] for r in results]
    assert len({len(log) for log in logs}) == 1
    return [list(entries) for entries in zip(*logs, strict=True)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_onebit_reduction_equals_the_papers_reference(stage: int) -> None:
    results = run_threads(
        train_recorded,
        WORLD,
        {"type": "onebit", "block_size": 32},
        stage,
        "fp32",
        3,
        timeout_s=30,
    )
    for entries in _by_launch(results):
        world = len(entries)
        n = entries[0]["full"].numel() // world
        s = -(-n // 32) * 32
        slots = results[0]["slots"][entries[0]["layout"]]
        used = max(offset + math.prod(shape) for offset, shape in slots.values())
        values = []
        for entry in entries:
            e = entry["full"] + entry["before"]
            staged = torch.zeros(world, s)
            staged[:, :n] = e.view(world, n)
            codes, scales, rest = reference.onebit_compress(staged.view(-1), 32)
            values.append(reference.onebit_values(codes, scales, 32).view(world, s)[:, :n])
            want_after = rest.view(world, s)[:, :n].reshape(-1)
            assert torch.equal(entry["after"][:used], want_after[:used])
            assert not entry["after"][used:].any()  # the layout's padding keeps no residual
        for rank, entry in enumerate(entries):
            total = values[0][rank].clone()
            for other in values[1:]:
                total = total + other[rank]
            valid = max(0, min(n, used - rank * n))  # the rest of the shard is padding
            assert torch.equal(entry["shard"][:valid], total[:valid])
            assert not entry["shard"][valid:].any()


def test_error_feedback_loses_nothing() -> None:
    """At every reduction of 3 steps, what the shards received plus what the residuals hold
    after equals the exact sum of every rank's gradients plus what they held before, and each
    residual is the next reduction's before (1-bit and PowerSGD)."""
    for compression in ({"type": "onebit", "block_size": 32}, {"type": "powersgd", "rank": 2}):
        results = run_threads(train_recorded, WORLD, compression, 2, "fp32", 3, timeout_s=30)
        for result in results:  # the ledger counts one whole fp32 residual per layout
            assert result["residual_bytes"] == 4 * result["trainable_elements"]
            # and PowerSGD's Q of up.weight (40 x 24 at rank 2; down.weight, 3 x 40, is exact)
            assert result["q_bytes"] == (24 * 2 * 4 if compression["type"] == "powersgd" else 0)
        last_after: dict[int, list[torch.Tensor]] = {}
        for entries in _by_launch(results):
            world = len(entries)
            n = entries[0]["full"].numel() // world
            exact = sum(e["full"] for e in entries)
            owed_before = sum(e["before"] for e in entries)
            received = torch.cat([e["shard"] for e in entries])
            owed = sum(e["after"] for e in entries)
            used = int(exact.nonzero().max()) + 1
            assert torch.allclose(
                (received + owed)[:used], (exact + owed_before)[:used], atol=1e-5
            ), compression
            assert n * world == exact.numel()
            layout = entries[0]["layout"]
            if layout in last_after:  # carried from the layout's reduction of the step before
                for before, entry in zip(last_after[layout], entries, strict=True):
                    assert torch.equal(entry["before"], before), compression
            last_after[layout] = [e["after"] for e in entries]
        assert len(_by_launch(results)) == 3 * len(last_after)


def test_powersgd_equals_the_papers_reference() -> None:
    """Written from Vogels et al., Algorithm 1 with error feedback, over 3 steps: P = M Q
    (summed), P orthogonalized, Q = M^T P (summed), the sum approximated by P Q^T, each rank's
    residual M_w - P Q_w^T, carried to its next M; the first Q a seeded normal matrix, each
    later one the step before's (the warm start)."""
    results = run_threads(
        train_recorded, WORLD, {"type": "powersgd", "rank": 2}, 2, "fp32", 3, timeout_s=30
    )
    checked = 0
    q_warm: torch.Tensor | None = None
    residuals: list[torch.Tensor] | None = None
    for entries in _by_launch(results):
        slots = results[0]["slots"][entries[0]["layout"]]
        if "up.weight" not in slots:
            continue
        offset, (rows, cols) = slots["up.weight"]
        span = slice(offset, offset + rows * cols)
        if q_warm is None:
            generator = torch.Generator().manual_seed(_stable("up.weight"))
            q_warm = torch.randn(cols, 2, generator=generator)
        if residuals is not None:  # the engine carried each rank's residual as the paper does
            for residual, entry in zip(residuals, entries, strict=True):
                assert torch.allclose(entry["before"][span], residual, rtol=1e-4, atol=1e-6)
        ms = [(e["full"] + e["before"])[span].view(rows, cols) for e in entries]
        p = _gram_schmidt(sum(m @ q_warm for m in ms))
        q = sum(m.t() @ p for m in ms)
        received = torch.cat([e["shard"] for e in entries])[span]
        assert torch.allclose(received, (p @ q.t()).reshape(-1), rtol=1e-4, atol=1e-6)
        residuals = []
        for m, entry in zip(ms, entries, strict=True):
            own = (m - p @ (m.t() @ p).t()).reshape(-1)
            assert torch.allclose(entry["after"][span], own, rtol=1e-4, atol=1e-6)
            residuals.append(own)
        q_warm = q
        # a vector, and a matrix too small to pay (down.weight, 3 x 40), travel exactly: their
        # shards are the plain sums, and they keep no residual
        for name in ("up.bias", "down.weight", "down.bias"):
            if name not in slots:
                continue
            start, shape = slots[name]
            exact_span = slice(start, start + math.prod(shape))
            exact = sum(e["full"][exact_span] for e in entries)
            assert torch.allclose(torch.cat([e["shard"] for e in entries])[exact_span], exact)
            assert all(not e["after"][exact_span].any() for e in entries), name
        checked += 1
    assert checked == 3


def _gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """The paper's orthogonalization, column by column with the library's epsilon: each column
    minus its projections on the ones before, then normalized."""
    columns: list[torch.Tensor] = []
    for i in range(p.shape[1]):
        column = p[:, i].clone()
        for previous in columns:
            column -= (previous @ column) * previous
        columns.append(column / (column.norm() + 1e-8))
    return torch.stack(columns, dim=1)


def test_a_batch_orthogonalizes_each_matrix_as_the_paper_does() -> None:
    """Same-height P's go through Gram-Schmidt as one batch; each comes out as it would alone,
    orthonormal, and a zero column stays zero."""
    from zero.compression.powersgd import orthogonalize

    batch = torch.randn(3, 40, 4, generator=torch.Generator().manual_seed(0))
    batch[1, :, 2] = 0.0
    expected = [_gram_schmidt(p) for p in batch]
    orthogonalize(batch)
    for got, want in zip(batch, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    gram = batch[0].t() @ batch[0]
    assert torch.allclose(gram, torch.eye(4), atol=1e-5)
    assert not batch[1, :, 2].any()


def _stable(name: str) -> int:
    from zero.compression.powersgd import _stable_hash

    return _stable_hash(name)


@pytest.mark.parametrize(
    "compression",
    [
        {"type": "onebit"},
        {"type": "terngrad"},
        {"type": "powersgd", "rank": 4},
        {"type": "onebit", "warmup_steps": 2},
        DGC_PAPER,
    ],
    ids=["onebit", "terngrad", "powersgd", "onebit-warmup", "dgc"],
)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_with_compression_follows_exact_training(compression: dict, stage: int) -> None:
    """bf16, clipping 1.0: the losses of 6 steps stay within 10% of exact ZeRO's (the
    compressed gradients are approximations), and every step trains."""
    exact = run_threads(train_recorded, WORLD, {"type": "none"}, stage, "bf16", 6, timeout_s=60)
    ours = run_threads(train_recorded, WORLD, compression, stage, "bf16", 6, timeout_s=60)
    for rank in range(WORLD):
        for a, b in zip(ours[rank]["losses"], exact[rank]["losses"], strict=True):
            assert math.isfinite(a)
            assert abs(a - b) <= 0.1 * b, (compression, stage, rank)
        assert_trains_like(ours[rank]["moved"], exact[rank]["moved"], (compression, stage, rank))
    if compression.get("warmup_steps"):
        # the warm-up steps reduced exactly: the same losses to the bit for steps 0-2
        assert ours[0]["losses"][:3] == exact[0]["losses"][:3]


def train_composed(comm, compression: dict, composition: dict, steps: int) -> dict[str, Any]:
    """bf16, clipping 1.0, ZeRO with ``composition`` (offload, accumulation, hpZ): the losses
    and how far the parameters moved."""
    accumulation = composition.get("gradient_accumulation_steps", 1)
    config = dict(composition)  # the ranks share ``composition``
    zero = {"timeout_s": 30, **config.pop("zero")}
    engine = _engine(
        comm,
        compression,
        zero["stage"],
        precision="bf16",
        gradient_clipping=1.0,
        chunk={"size": 512},
        zero=zero,
        **config,
    )
    initial = parameters(engine)
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            loss = engine(*_batch(step * accumulation + micro, comm.rank))
            engine.backward(loss)
            losses.append(float(loss.detach()))
            engine.step()  # steps at the end of each accumulation window
    return {"losses": losses, "moved": moved_since(engine, initial)}


COMPOSITIONS = {
    "host-offload": {"zero": {"stage": 2}, "offload": {"optimizer": "host"}},
    "stage3-host-offload": {"zero": {"stage": 3}, "offload": {"optimizer": "host"}},
    "accumulation": {"zero": {"stage": 2}, "gradient_accumulation_steps": 2},
    "hpz": {"zero": {"stage": 3, "node_size": 2, "hpz_partition_size": 2}},
}


@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("method", ["onebit", "terngrad", "powersgd"])
def test_compression_composes_with_offload_accumulation_and_hpz(
    method: str, composition: str
) -> None:
    """Each method with host offload (stages 2 and 3), gradient accumulation and hpZ trains
    within 10% of the same configuration without compression, over 5 steps."""
    exact = run_threads(
        train_composed, WORLD, {"type": "none"}, dict(COMPOSITIONS[composition]), 5, timeout_s=60
    )
    ours = run_threads(
        train_composed, WORLD, {"type": method}, dict(COMPOSITIONS[composition]), 5, timeout_s=60
    )
    for rank in range(WORLD):
        for a, b in zip(ours[rank]["losses"], exact[rank]["losses"], strict=True):
            assert abs(a - b) <= 0.1 * b, (method, composition, rank)
        assert_trains_like(ours[rank]["moved"], exact[rank]["moved"], (method, composition, rank))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"compression": {"type": "onebit"}}, "needs zero.stage 1, 2 or 3"),
        (
            {"zero": {"stage": 2, "quantized_gradients": True}, "compression": {"type": "onebit"}},
            "both replace the gradient reduce-scatter",
        ),
        (
            {"zero": {"stage": 2}, "precision": "fp16", "compression": {"type": "powersgd"}},
            "error-feedback state",
        ),
        (
            {"zero": {"stage": 2}, "nonfinite": "skip", "compression": {"type": "onebit"}},
            "nonfinite 'skip'",
        ),
        ({"zero": {"stage": 2}, "compression": {"type": "topk"}}, "compression.type"),
        ({"zero": {"stage": 2}, "compression": {"type": "dga"}}, "whole optimizer state"),
        (
            {"zero": {"stage": 2}, "compression": {"type": "onebit", "block_size": 96}},
            "power of two",
        ),
        (
            {"zero": {"stage": 2}, "compression": {"type": "onebit", "freeze_variance": True}},
            "warmup_steps >= 1",
        ),
        (
            {"zero": {"stage": 2}, "compression": {"freeze_variance": True, "warmup_steps": 5}},
            "compression.type is 'none'",
        ),
        (
            {
                "zero": {"stage": 2},
                "precision": "fp16",
                "compression": {"type": "terngrad", "warmup_steps": 2, "freeze_variance": True},
            },
            "freeze_variance corrects each frozen step",
        ),
    ],
    ids=[
        "stage0",
        "qgz",
        "fp16",
        "skip",
        "unknown",
        "dga",
        "block",
        "freeze-no-warmup",
        "freeze-none",
        "freeze-fp16",
    ],  # fmt: skip
)
def test_refused_combinations_say_why(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        chunkmem.Config.from_dict(config)


def _measured_rank(comm, compression: dict):
    return measure(
        ModelSettings(**SMALL, checkpointing=True),
        _estimated_config(compression),
        batch=4,
        comm=comm,
    )


def _estimated_config(compression: dict) -> dict:
    return estimate_config(precision="bf16", zero={"stage": 2}, compression=compression)


@pytest.mark.parametrize(
    "compression",
    [
        {"type": "onebit"},
        {"type": "terngrad"},
        {"type": "powersgd", "rank": 2},
        {**DGC_PAPER, "density": 0.01, "warmup_steps": 1, "sparsity_warmup_steps": 0},
    ],
    ids=["onebit", "terngrad", "powersgd", "dgc"],
)
def test_the_estimate_is_the_ledger_with_compression(compression: dict) -> None:
    """On gloo ranks (tests/test_estimate.py says why): the third step's bytes sent to the byte,
    the device peak within 0.5% (residuals, DGC's velocity, PowerSGD's Q and the wire buffers
    counted)."""
    results = run_ranks(_measured_rank, 2, compression, timeout_s=60, deadline_s=240)
    model = ModelSettings(**SMALL, checkpointing=True)
    predicted = predict(model, _estimated_config(compression), batch=4, world=2)
    exact = predict(model, _estimated_config({"type": "none"}), batch=4, world=2)
    assert predicted.wire.bytes_per_rank < exact.wire.bytes_per_rank
    for measured in results:
        assert predicted.wire.bytes_per_rank == measured.wire
        error = abs(predicted.memory.peak_device_bytes - measured.device) / measured.device
        assert error <= 0.005, (predicted.memory.peak_device_bytes, measured.device)


def train_and_checkpoint(
    comm, compression: dict, directory: str, save_at: int | None, resume: bool
) -> dict:
    """6 steps of ZeRO-2 bf16 with ``compression``: saved after ``save_at`` steps, or loaded
    from ``directory`` first and trained from there (``resume``)."""
    engine = _engine(
        comm, compression, 2, precision="bf16", gradient_clipping=1.0, chunk={"size": 512}
    )
    first = 0
    if resume:
        engine.load_checkpoint(directory)
        first = engine.global_steps
    losses = []
    for step in range(first, 6):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if step + 1 == save_at:
            engine.save_checkpoint(directory)
    residuals = {
        layout.index: layout.chunks[EF_RESIDUAL].payload.clone()
        for layout in engine.params.trainable_layouts()
        if EF_RESIDUAL in layout.chunks
    }
    return {
        "losses": losses,
        "residuals": residuals,
        "steps": engine.global_steps,
        "compression": engine.run_summary().compression,
    }


@pytest.mark.parametrize(
    "compression",
    [
        {"type": "onebit"},
        {"type": "powersgd"},
        {"type": "onebit", "warmup_steps": 2, "freeze_variance": True},
    ],
    ids=["onebit", "powersgd", "onebit-frozen-variance"],
)
def test_a_resumed_run_with_error_feedback_equals_the_uninterrupted_one(
    compression: dict, tmp_path
) -> None:
    """Residuals (and PowerSGD's Q) are saved and loaded: the resumed steps are the
    uninterrupted run's to the bit (with a frozen variance: saved after it froze, and the
    resumed run keeps it frozen)."""
    target = str(tmp_path / "ckpt")
    whole = run_ranks(
        train_and_checkpoint, 2, compression, target, 3, False, timeout_s=60, deadline_s=120
    )
    resumed = run_ranks(
        train_and_checkpoint, 2, compression, target, None, True, timeout_s=60, deadline_s=120
    )
    for rank in range(2):
        assert resumed[rank]["losses"] == whole[rank]["losses"][3:]
        for index, residual in whole[rank]["residuals"].items():
            assert torch.equal(resumed[rank]["residuals"][index], residual)


def saved_residuals(comm, directory: str) -> dict:
    engine = _engine(comm, {"type": "onebit"}, 2, precision="bf16", chunk={"size": 512})
    for step in range(2):
        engine.backward(engine(*_batch(step, comm.rank)))
        engine.step()
    engine.save_checkpoint(directory)
    return _residuals_by_parameter(engine)


def _residuals_by_parameter(engine) -> dict[str, torch.Tensor]:
    return {
        slot.name: layout.chunks[EF_RESIDUAL]
        .payload[slot.offset : slot.offset + slot.numel]
        .clone()
        for layout in engine.params.trainable_layouts()
        if EF_RESIDUAL in layout.chunks
        for slot in layout.slots
    }


def test_residuals_reshard_from_two_ranks_to_one_keeping_their_sum(tmp_path) -> None:
    """What the gradients owe is the sum of the ranks' residuals: one rank loading two ranks'
    checkpoint holds exactly their sum."""
    target = str(tmp_path / "ckpt")
    saved = run_ranks(saved_residuals, 2, target, timeout_s=60, deadline_s=120)
    loaded = run_ranks(load_residuals, 1, target, timeout_s=60, deadline_s=120)[0]
    assert loaded.keys() == saved[0].keys()
    for name, value in loaded.items():
        assert torch.equal(value, saved[0][name] + saved[1][name]), name


def load_residuals(comm, directory: str) -> dict:
    engine = _engine(comm, {"type": "onebit"}, 2, precision="bf16", chunk={"size": 512})
    engine.load_checkpoint(directory)
    return _residuals_by_parameter(engine)


def test_a_checkpoint_with_residuals_does_not_load_without_compression(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    run_ranks(saved_residuals, 2, target, timeout_s=60, deadline_s=120)
    # each rank raised it (run_ranks reports the ranks' tracebacks in one AssertionError)
    refused = r"(?s)CheckpointError: the checkpoint .* does not fit this engine:.*'onebit' in the checkpoint, 'none' in the engine"
    with pytest.raises(AssertionError, match=refused):
        run_ranks(load_without_compression, 2, target, timeout_s=60, deadline_s=120)


def load_without_compression(comm, directory: str) -> None:
    engine = _engine(comm, {"type": "none"}, 2, precision="bf16", chunk={"size": 512})
    engine.load_checkpoint(directory)


def discarding_rank(comm, compression: dict) -> dict[str, Any]:
    """Two steps, then a backward discarded, then a step: what discard said, and after."""
    engine = _engine(comm, compression, 2, precision="bf16", chunk={"size": 512})
    for step in range(2):
        engine.backward(engine(*_batch(step, comm.rank)))
        engine.step()
    engine.backward(engine(*_batch(99, comm.rank)))
    refusal = None
    try:
        engine.discard()
    except EngineUsageError as error:
        refusal = str(error)
        engine.step()  # what the refusal asks for: the window is taken
    return {"refusal": refusal, "stopped": engine.stopped_because}


@pytest.mark.parametrize(
    "compression",
    [{"type": "onebit"}, {"type": "dgc", "density": 0.1}, {"type": "powersgd"}],
    ids=["onebit", "dgc", "powersgd"],
)
def test_discarding_a_window_error_feedback_already_carries_is_refused(compression: dict) -> None:
    """The residual (DGC's velocity, PowerSGD's) took part of the window's gradients during
    backward's reductions: a discard would carry a dropped batch into the next steps (it did,
    silently), so it is refused with what to do."""
    for result in run_threads(discarding_rank, 2, compression):
        assert result["refusal"] is not None
        assert "error feedback already holds part of this window" in result["refusal"]
        assert "engine.step()" in result["refusal"]
        assert result["stopped"] is None


def test_discarding_a_window_of_exact_warm_up_or_terngrad_is_undone() -> None:
    """During the exact warm-up no residual changes, and TernGrad keeps none: the window is
    dropped as without compression."""
    for compression in ({"type": "onebit", "warmup_steps": 10}, {"type": "terngrad"}):
        for result in run_threads(discarding_rank, 2, compression):
            assert result["refusal"] is None, compression


def failing_backward_rank(comm) -> dict[str, Any]:
    engine = _engine(comm, {"type": "onebit"}, 2, precision="bf16", chunk={"size": 512})
    engine.backward(engine(*_batch(0, comm.rank)))
    engine.step()
    loss = engine(*_batch(1, comm.rank))
    original = engine.optimizer.check_early_reads

    def fail_after_the_reductions() -> None:
        original()
        raise RuntimeError("injected failure after the reductions")

    # the last thing backward does: its reductions ran, then it fails
    engine.optimizer.check_early_reads = fail_after_the_reductions
    with pytest.raises(RuntimeError, match="injected failure after the reductions"):
        engine.backward(loss)
    return {"stopped": engine.stopped_because}


def test_a_backward_failing_after_compressed_reductions_stops_the_engine() -> None:
    for result in run_threads(failing_backward_rank, 2):
        assert result["stopped"] is not None
        assert "error feedback already holds part of this window" in result["stopped"]
        assert "load the last checkpoint" in result["stopped"]
