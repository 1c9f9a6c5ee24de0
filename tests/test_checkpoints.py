"""Checkpoints: bit-exact resume, resharding across world sizes and ZeRO stages, atomic saves
under SIGKILL, consolidation into plain PyTorch, and errors that name what does not fit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import chunkmem
from chunkmem.checkpoint.consolidate import TensorReader
from chunkmem.checkpoint.pieces import Box, row_major_boxes
from chunkmem.chunk import ChunkKind
from chunkmem.errors import CheckpointError, EngineUsageError
from chunkmem.models.gpt import GPT, GPTConfig
from tests.distributed_helpers import run_ranks
from tests.reference import max_relative_diff
from tests.thread_count import child_env

ROOT = Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
DROPOUT = GPTConfig(**{**CONFIG.__dict__, "dropout": 0.1})
GLOBAL_BATCH = 4
SAVED_AT, CONTINUED = 3, 3


def batches(steps: int, rows: int = GLOBAL_BATCH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(
        0, CONFIG.vocab_size, (steps, rows, CONFIG.block_size + 1), generator=generator
    )


def engine_config(precision: str = "fp32", stage: int = 0, **extra) -> dict:
    config = {
        "precision": precision,
        "device": {"type": "simulated", "capacity": "64MiB"},
        "chunk": {"size": 2048},
        "optimizer": {"lr": 1e-3},
        "gradient_clipping": 0.5,  # active: the norm's summation order matters
        **extra,
    }
    if stage:
        config["zero"] = {"stage": stage, "timeout_s": 30}
    return config


def moments(engine: chunkmem.Engine) -> dict:
    """This rank's Adam moments per layout and step counts per parameter."""
    state = {}
    for layout in engine.params.trainable_layouts():
        for kind in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ):
            chunk = layout.chunks.get(kind)
            values = engine.states.preloaded(layout, kind)
            if chunk is not None:
                values = engine.residency.contents(chunk)
            state[(layout.index, kind.value)] = None if values is None else values.clone()
    state["steps"] = {s.name: float(c) for s, c in engine.optimizer.step_counts.items()}
    return state


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = TensorReader(path)
    return {
        key: reader.read(key)
        for key, entry in reader.metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


# ------------------------------------------------------------------ boxes


@pytest.mark.parametrize("shape", [(), (7,), (5, 7), (3, 4, 5), (2, 3, 1, 4)])
def test_row_major_boxes_are_contiguous_runs_that_cover_the_range(shape) -> None:
    numel = int(np.prod(shape))
    flat = torch.arange(numel).view(shape)
    rng = random.Random(0)
    ranges = [(0, numel), *((a, rng.randint(a, numel)) for a in rng.choices(range(numel), k=30))]
    for lo, hi in ranges:
        boxes = row_major_boxes(shape, lo, hi)
        assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)
        covered = []
        for box in boxes:
            region = flat[
                tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
            ]
            expected = torch.arange(box.start, box.start + box.numel)
            assert torch.equal(region.reshape(-1), expected), (shape, lo, hi, box)
            covered += expected.tolist()
        assert covered == list(range(lo, hi))
    assert row_major_boxes((4, 6), 6, 18) == [Box(6, (1, 0), (2, 6))]


# ------------------------------------------------------------------ resume, one process


class Probe(nn.Module):
    """A GPT with dropout (the RNG state matters), a layer that gets a gradient only on even
    steps (step counts differ per parameter), a frozen layer, a 0-d parameter and a buffer
    the forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(DROPOUT)
        self.aux = nn.Linear(CONFIG.n_embd, CONFIG.n_embd, bias=False)
        self.frozen = nn.Linear(CONFIG.n_embd, CONFIG.n_embd)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(()))
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("probe", torch.randn(4, CONFIG.n_embd))

    def forward(self, x: torch.Tensor, y: torch.Tensor, aux: bool) -> torch.Tensor:
        self.calls += 1
        loss = self.gpt(x, y) * self.gain
        if aux:
            loss = loss + 1e-2 * self.aux(self.frozen(self.probe)).square().mean()
        return loss


class StepCounter:
    """Stands in for an LR scheduler: anything with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def train_probe(engine, rows: torch.Tensor, steps: range) -> list[float]:
    losses = []
    for step in steps:
        row = rows[step]
        loss = engine(row[:, :-1], row[:, 1:], step % 2 == 0)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def make_probe(precision: str) -> chunkmem.Engine:
    torch.manual_seed(0)
    engine = chunkmem.initialize(Probe(), config=engine_config(precision))
    engine.lr_scheduler = StepCounter()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(precision, tmp_path) -> None:
    rows = batches(SAVED_AT + CONTINUED)
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    straight = make_probe(precision)
    train_probe(straight, rows, range(SAVED_AT))
    straight.lr_scheduler.steps = 5
    scheduler_state = straight.lr_scheduler.state_dict()
    straight.save_checkpoint(tmp_path / "ck", client_state={"next_step": SAVED_AT})
    python_draw, numpy_draw = random.random(), np.random.rand()
    losses = train_probe(straight, rows, range(SAVED_AT, SAVED_AT + CONTINUED))

    resumed = make_probe(precision)  # reseeds: only the checkpoint brings the state back
    assert resumed.load_checkpoint(tmp_path / "ck") == {"next_step": SAVED_AT}
    assert (random.random(), np.random.rand()) == (python_draw, numpy_draw)
    assert resumed.lr_scheduler.state_dict() == scheduler_state
    assert resumed.global_steps == SAVED_AT
    assert train_probe(resumed, rows, range(SAVED_AT, SAVED_AT + CONTINUED)) == losses
    assert same(resumed.state_dict(), straight.state_dict())
    assert same(moments(resumed), moments(straight))
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    steps = moments(resumed)["steps"]
    assert 0 < steps["aux.weight"] < steps["gpt.wte.weight"]  # aux on even steps only


def _with_torch_scheduler() -> chunkmem.Engine:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return chunkmem.initialize(model, optimizer, engine_config(), lr_scheduler=warmup)


def _with_config_scheduler() -> chunkmem.Engine:
    torch.manual_seed(0)
    schedule = {"type": "WarmupDecayLR", "warmup_num_steps": 3, "total_num_steps": 8}
    return chunkmem.initialize(GPT(CONFIG), config=engine_config(scheduler=schedule))


@pytest.mark.parametrize("make", [_with_torch_scheduler, _with_config_scheduler])
def test_resume_continues_the_learning_rate_schedule(make, tmp_path) -> None:
    rows = batches(SAVED_AT + CONTINUED)

    def train(engine, steps):
        for row in rows[steps]:
            engine.backward(engine(row[:, :-1], row[:, 1:]))
            engine.step()

    straight = make()
    train(straight, slice(0, SAVED_AT))
    straight.save_checkpoint(tmp_path / "ck")
    rates = straight.get_lr()
    train(straight, slice(SAVED_AT, None))
    resumed = make()
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.get_lr() == rates
    train(resumed, slice(SAVED_AT, None))
    assert resumed.get_lr() == straight.get_lr()
    assert same(resumed.state_dict(), straight.state_dict())


def test_save_and_load_between_steps_only(tmp_path) -> None:
    engine = make_probe("fp32")
    row = batches(1)[0]
    engine.backward(engine(row[:, :-1], row[:, 1:], False))
    with pytest.raises(EngineUsageError, match="between optimizer steps.*backward_done"):
        engine.save_checkpoint(tmp_path / "ck")
    engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="already exists"):
        engine.save_checkpoint(tmp_path / "ck")


# ------------------------------------------------------------------ mismatches


class Renamed(GPT):
    """CONFIG's GPT whose final norm has another name."""

    def __init__(self) -> None:
        super().__init__(CONFIG)
        self.norm_out = self.ln_f
        del self.ln_f

    def forward(self, idx, targets=None):  # never called
        raise NotImplementedError


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    engine = chunkmem.initialize(GPT(CONFIG), config=engine_config())
    path = tmp_path_factory.mktemp("small") / "ck"
    engine.save_checkpoint(path)
    engine.close()
    return path


def _frozen_head() -> GPT:
    model = GPT(CONFIG)
    model.blocks[0].mlp.fc.weight.requires_grad_(False)
    return model


def _with_buffer() -> GPT:
    model = GPT(CONFIG)
    model.register_buffer("seen", torch.zeros(3))
    return model


@pytest.mark.parametrize(
    ("build", "config", "message"),
    [
        (Renamed, {}, r"parameter 'ln_f.weight' is in the checkpoint but not in the engine"),
        (Renamed, {}, r"parameter 'norm_out.weight' is in the engine but not in the checkpoint"),
        (
            lambda: GPT(GPTConfig(**{**CONFIG.__dict__, "vocab_size": 65})),
            {},
            r"parameter 'wte.weight': shape \(64, 32\) in the checkpoint, \(65, 32\) in the engine",
        ),
        (
            _frozen_head,
            {},
            r"parameter 'blocks.0.mlp.fc.weight': trainable True in the checkpoint, False",
        ),
        (_with_buffer, {}, r"buffer 'seen' is in the engine but not in the checkpoint"),
        (
            lambda: GPT(CONFIG),
            {"precision": "bf16"},
            r"config key 'precision': 'fp32' in the checkpoint, 'bf16' in the engine",
        ),
        (
            lambda: GPT(CONFIG),
            {"optimizer": {"type": "adam"}},
            r"optimizer: adamw in the checkpoint, adam in the engine",
        ),
        (
            lambda: GPT(GPTConfig(**{**CONFIG.__dict__, "tie_weights": False})),
            {},
            r"parameter 'wte.weight': aliases \('head.weight',\) in the checkpoint, \(\) in the",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_names_the_difference(
    small_checkpoint, build, config, message
) -> None:
    torch.manual_seed(0)
    engine = chunkmem.initialize(build(), config=engine_config(**config))
    before = engine.state_dict()
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(small_checkpoint)
    assert same(engine.state_dict(), before)  # nothing was loaded
    assert engine.stopped_because is None


def test_an_incomplete_or_missing_checkpoint_is_refused(small_checkpoint, tmp_path) -> None:
    engine = chunkmem.initialize(GPT(CONFIG), config=engine_config())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "chunkmem.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"broken is not a complete.*\.metadata missing"):
        engine.load_checkpoint(broken)
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere: not a directory"):
        engine.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"\.safetensors or \.pt/\.pth/\.bin"):
        chunkmem.consolidate(small_checkpoint, tmp_path / "model.npz")


# ------------------------------------------------------------------ consolidation


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_consolidated_state_dict_loads_into_the_plain_model_and_matches(
    precision, tmp_path, monkeypatch
) -> None:
    torch.manual_seed(0)
    engine = chunkmem.initialize(GPT(CONFIG), config=engine_config(precision))
    rows = batches(3)
    for row in rows:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    read = []
    original = TensorReader.read
    monkeypatch.setattr(
        TensorReader, "read", lambda self, key: read.append(key) or original(self, key)
    )
    pt = chunkmem.consolidate(tmp_path / "ck", tmp_path / "model.pt")
    safetensors = chunkmem.consolidate(tmp_path / "ck", tmp_path / "model.safetensors")
    assert read and all(key.startswith("model.") for key in read)  # no optimizer state
    x = rows[0][:, :-1]
    with torch.no_grad():
        expected = engine(x)
    for state in (torch.load(pt, weights_only=True), _read_safetensors(safetensors)):
        plain = GPT(CONFIG)
        plain.load_state_dict(state)  # strict: every key, tied ones included
        assert plain.head.weight.data_ptr() == plain.wte.weight.data_ptr()
        assert all(v.dtype == torch.float32 for v in state.values())
        if precision == "bf16":
            plain = plain.to(torch.bfloat16)  # the engine computes on the rounded masters
        with torch.no_grad():
            assert torch.equal(plain(x), expected)
    assert same(torch.load(pt, weights_only=True), engine.state_dict())


def test_consolidated_safetensors_load_with_from_pretrained(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    engine = chunkmem.initialize(transformers.GPT2LMHeadModel(config), config=engine_config())
    x = batches(1)[0][:, :-1]
    for _ in range(2):
        engine.backward(engine(x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    chunkmem.consolidate(tmp_path / "ck", tmp_path / "hf" / "model.safetensors")
    config.save_pretrained(tmp_path / "hf")
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(plain(x).logits, engine(x).logits)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors = pytest.importorskip("safetensors.torch")
    return safetensors.load_file(path)


# ------------------------------------------------------------------ ZeRO on 2 ranks


def zero_resume_rank(comm, stage: int, directory: str) -> dict:
    """Uninterrupted run and a run resumed from its checkpoint in a fresh engine, this rank's
    slice of each global batch, dropout on (per-rank RNG)."""
    rows = batches(SAVED_AT + CONTINUED)[:, comm.rank * 2 : comm.rank * 2 + 2]

    def make():
        torch.manual_seed(0)
        return chunkmem.initialize(GPT(DROPOUT), config=engine_config("bf16", stage))

    def train(engine, steps):
        losses = []
        for row in rows[steps]:
            loss = engine(row[:, :-1], row[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return losses

    torch.manual_seed(100 + comm.rank)
    straight = make()
    train(straight, slice(0, SAVED_AT))
    straight.save_checkpoint(Path(directory) / "ck", client_state={"rank": comm.rank})
    losses = train(straight, slice(SAVED_AT, None))
    resumed = make()
    client_state = resumed.load_checkpoint(Path(directory) / "ck")
    resumed_losses = train(resumed, slice(SAVED_AT, None))
    return {
        "client_state": client_state,
        "losses": resumed_losses == losses,
        "values": same(resumed.state_dict(), straight.state_dict()),
        "moments": same(moments(resumed), moments(straight)),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_resume_on_two_ranks_is_bit_exact(stage, tmp_path) -> None:
    results = run_ranks(zero_resume_rank, 2, stage, str(tmp_path), timeout_s=30, deadline_s=180)
    for rank, result in enumerate(results):
        assert result == {
            "client_state": {"rank": rank},
            "losses": True,
            "values": True,
            "moments": True,
        }


# ------------------------------------------------------------------ resharding

LR_RESHARD = 1e-4  # as tests/test_zero.py: keeps reassociation differences small


def make_zero3(world: int) -> chunkmem.Engine:
    torch.manual_seed(0)
    config = engine_config(stage=3 if world > 1 else 0, optimizer={"lr": LR_RESHARD})
    return chunkmem.initialize(GPT(CONFIG), config=config)


def train_slice(engine, rank: int, world: int, steps: slice) -> list[float]:
    """This rank's rows of each global batch of GLOBAL_BATCH rows."""
    local = GLOBAL_BATCH // world
    losses = []
    for row in batches(SAVED_AT + CONTINUED)[steps, rank * local : (rank + 1) * local]:
        loss = engine(row[:, :-1], row[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def save_on_four_rank(comm, directory: str) -> dict | None:
    engine = make_zero3(4)
    train_slice(engine, comm.rank, 4, slice(0, SAVED_AT))
    engine.save_checkpoint(Path(directory) / "on4", client_state={"rank": comm.rank})
    train_slice(engine, comm.rank, 4, slice(SAVED_AT, None))
    state = engine.state_dict()
    return state if comm.rank == 0 else None


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory) -> tuple[Path, dict]:
    """A ZeRO-3 run on 4 ranks saved after SAVED_AT steps, and its values CONTINUED steps on."""
    directory = tmp_path_factory.mktemp("reshard")
    results = run_ranks(save_on_four_rank, 4, str(directory), timeout_s=30, deadline_s=240)
    return directory / "on4", results[0]


def continue_on_two_rank(comm, saved: str, directory: str) -> dict:
    """Load the 4-rank checkpoint on 2 ranks; save the restored state at once; continue with
    a save and a fresh engine after one step; and continue uninterrupted."""
    out = Path(directory)
    interrupted = make_zero3(2)
    client_state = interrupted.load_checkpoint(saved)
    interrupted.save_checkpoint(out / "restored")
    train_slice(interrupted, comm.rank, 2, slice(SAVED_AT, SAVED_AT + 1))
    interrupted.save_checkpoint(out / "one_more")
    fresh = make_zero3(2)
    fresh.load_checkpoint(out / "one_more")
    losses = train_slice(fresh, comm.rank, 2, slice(SAVED_AT + 1, None))
    straight = make_zero3(2)
    straight.load_checkpoint(saved)
    straight_losses = train_slice(straight, comm.rank, 2, slice(SAVED_AT, None))
    state = straight.state_dict()
    return {
        "client_state": client_state,
        "losses": losses == straight_losses[1:],
        "values": same(fresh.state_dict(), state),
        "moments": same(moments(fresh), moments(straight)),
        "state": state if comm.rank == 0 else None,
    }


@pytest.mark.distributed
def test_saved_on_four_ranks_at_zero3_resumes_on_two(four_rank_run, tmp_path) -> None:
    saved, four_rank_values = four_rank_run
    results = run_ranks(
        continue_on_two_rank, 2, str(saved), str(tmp_path), timeout_s=30, deadline_s=240
    )
    for result in results:  # another world size: every rank gets rank 0's client state
        assert {k: result[k] for k in ("client_state", "losses", "values", "moments")} == {
            "client_state": {"rank": 0},
            "losses": True,
            "values": True,
            "moments": True,
        }
    restored, original = checkpoint_tensors(tmp_path / "restored"), checkpoint_tensors(saved)
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], original[k]) for k in original)
    # Two ranks sum gradients in another order than four: close, not equal.
    assert max_relative_diff(results[0]["state"], four_rank_values) < 1e-5


def load_and_save(comm, saved: str, out: str) -> None:
    engine = make_zero3(comm.size)
    engine.load_checkpoint(saved)
    engine.save_checkpoint(out)


@pytest.mark.distributed
def test_resharding_restores_the_saved_state_exactly(four_rank_run, tmp_path) -> None:
    """4 ranks to 1 (other chunk size: none is rounded to 4 ranks), to 3 (2112-element
    chunks), and one process to ZeRO-3 on 2 ranks: every tensor as saved."""
    saved, _values = four_rank_run
    original = checkpoint_tensors(saved)
    single = make_zero3(1)
    single.load_checkpoint(saved)
    single.save_checkpoint(tmp_path / "on1")
    run_ranks(load_and_save, 3, str(saved), str(tmp_path / "on3"), timeout_s=30, deadline_s=240)
    run_ranks(
        load_and_save, 2, str(tmp_path / "on1"), str(tmp_path / "on1to2"), timeout_s=30,
        deadline_s=240,
    )  # fmt: skip
    for name in ("on1", "on3", "on1to2"):
        restored = checkpoint_tensors(tmp_path / name)
        assert restored.keys() == original.keys(), name
        assert all(torch.equal(restored[k], original[k]) for k in original), name
    consolidated = torch.load(chunkmem.consolidate(saved, tmp_path / "m.pt"), weights_only=True)
    assert same(consolidated, single.state_dict())


# ------------------------------------------------------------------ atomic saves

_CHILD = """
import sys, time
from pathlib import Path
import torch
import chunkmem
from chunkmem.models.gpt import GPT
from tests.test_checkpoints import CONFIG, batches, engine_config

directory, where = Path(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
engine = chunkmem.initialize(GPT(CONFIG), config=engine_config())
for step, row in enumerate(batches(4)):
    if step == 2:
        engine.save_checkpoint(directory / "step_2")
    engine.backward(engine(row[:, :-1], row[:, 1:]))
    engine.step()


def pause(*args, **kwargs):
    (directory / "paused").touch()
    time.sleep(600)


if where == "mid_write":  # after the first item of this rank's file
    import torch.distributed.checkpoint.filesystem as dcp_files
    write = dcp_files._write_item
    dcp_files._write_item = lambda *a, **k: (write(*a, **k), pause())[0]
else:  # every file written and fsynced, the manifest too; before the rename
    import chunkmem.checkpoint.commit as commit
    commit.fsync_directory = pause
engine.save_checkpoint(directory / "step_4")
"""


def _reference_after(steps: int) -> dict:
    torch.manual_seed(0)
    engine = chunkmem.initialize(GPT(CONFIG), config=engine_config())
    for row in batches(steps):
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    values = engine.state_dict()
    engine.close()
    return values


@pytest.mark.parametrize("where", ["mid_write", "before_rename"])
def test_a_save_killed_with_sigkill_leaves_the_last_checkpoint_loadable(where, tmp_path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), where],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "paused").exists():
            assert child.poll() is None, child.communicate()[0].decode()
            assert time.monotonic() < deadline, "the child never reached the pause"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    debris = [p.name for p in tmp_path.iterdir() if p.name.startswith(".step_4.chunkmem-tmp-")]
    assert len(debris) == 1 and not (tmp_path / "step_4").exists()
    engine = chunkmem.initialize(GPT(CONFIG), config=engine_config())
    with pytest.raises(CheckpointError, match=r"step_4: not a directory.*did not finish"):
        engine.load_checkpoint(tmp_path / "step_4")
    engine.load_checkpoint(tmp_path / "step_2")
    assert same(engine.state_dict(), _reference_after(2))
    for row in batches(4)[2:]:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    engine.save_checkpoint(tmp_path / "step_4")  # the debris is no obstacle, and goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paused", "step_2", "step_4"]
    assert same(
        torch.load(chunkmem.consolidate(tmp_path / "step_4", tmp_path / "m.pt"), weights_only=True),
        _reference_after(4),
    )


# ------------------------------------------------------------------ states on NVMe


def test_resume_with_optimizer_states_on_nvme(tmp_path) -> None:
    """Masters and moments on the NVMe tier (not addressable): saving reads copies of them;
    loading before the first step fills the moments the first step places there, and
    loading into an engine whose states are already there writes them through host memory."""
    from tests.offload_helpers import batches as mlp_batches
    from tests.offload_helpers import initialize, make_model, train_engine

    def make():
        offload = {
            "optimizer": "nvme",
            "nvme": {"path": str(tmp_path / "nvme"), "block_size": 4096},
        }
        device = {"type": "simulated", "capacity": "64MiB"}
        return initialize(make_model(), precision="bf16", device=device, offload=offload)

    data = mlp_batches(6, 8)
    straight = make()
    train_engine(straight, data[:3])
    assert straight.states.home(straight.params.trainable_layouts()[0]).name == "nvme"
    straight.save_checkpoint(tmp_path / "ck")
    train_engine(straight, data[3:])
    expected = straight.state_dict()
    straight.close()
    fresh = make()
    fresh.load_checkpoint(tmp_path / "ck")
    train_engine(fresh, data[3:])
    assert same(fresh.state_dict(), expected)
    fresh.close()
    warm = make()
    train_engine(warm, mlp_batches(1, 8, seed=9))  # its states are placed on NVMe
    warm.load_checkpoint(tmp_path / "ck")
    train_engine(warm, data[3:])
    assert same(warm.state_dict(), expected)
    warm.close()
