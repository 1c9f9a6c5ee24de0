"""Optimizer states off the device: on the host, on NVMe, partly offloaded, bf16 moments, the
native host optimizer, and the step overlapped with backward (docs/offload.md).

Each run trains the model of ``tests/offload_helpers`` (two parameter groups and a frozen
layer) for 20 steps and compares it with ``torch.optim.AdamW(fused=True)`` on the same data.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import chunkmem
import chunkmem.update_kernels as update_kernels
from chunkmem.chunk import ChunkKind
from chunkmem.devices import DeferredCopy, SimulatedDevice
from chunkmem.errors import ConfigError, EngineUsageError
from chunkmem.update_builder import UpdateBuilder
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads
from tests.offload_helpers import (
    assert_same_state,
    batches,
    initialize,
    make_model,
    max_rel_diff,
    round_moments_to_bf16,
    train_engine,
    train_torch,
)

STEPS = 20
TOLERANCE = 1e-6  # the bound; the runs below are exact (0.0)
DEVICE = {"type": "simulated", "capacity": 500_000}  # below the model states: chunks move


def nvme(path) -> dict:
    return {"optimizer": "nvme", "nvme": {"path": str(path), "block_size": 4096}}


def trainable_elements(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def frozen_unchanged(state: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    """The frozen layer keeps its values (in the compute dtype: it has no fp32 master)."""
    return all(
        torch.equal(state[f"frozen.{n}"], p.to(state[f"frozen.{n}"].dtype))
        for n, p in model.frozen.named_parameters()
    )


def trainable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: v for n, v in state.items() if not n.startswith("frozen.")}


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_states_off_the_device_match_torch_adamw(where: str, tmp_path) -> None:
    model, data = make_model(), batches(STEPS, rows=8)
    expected = train_torch(model, data)
    engine = initialize(
        make_model(),
        device=DEVICE,
        offload={"optimizer": where, "nvme": {"path": str(tmp_path), "block_size": 4096}},
    )
    train_engine(engine, data)
    state = engine.state_dict()
    assert max_rel_diff(state, expected) <= TOLERANCE
    assert max_rel_diff(state, expected) == 0.0, "the host kernel is torch's, bit for bit"
    assert frozen_unchanged(state, model)
    assert set(engine.run_summary().optimizer_state_homes) == {where}
    assert engine.ledger.bytes_moved(STEPS - 1) > 0, "the model must not fit: chunks move"
    paths = engine.write_report(tmp_path / "report")
    report = json.loads(paths["json"].read_text())
    assert report["summary"]["optimizer_state_homes"][where] == len(
        engine.params.trainable_layouts()
    )
    if where == "nvme":
        assert list(report["summary"]["tiers"]) == ["device", "host", "nvme"]
        assert report["bytes_moved"][-1]["to_nvme"] > 0
        assert "Nvme bytes at each moment" in paths["html"].read_text()
    engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_native_host_optimizer_on_several_threads_matches_torch_adamw(precision) -> None:
    """The host update's OpenMP threads split the elements, never a sum: the same bits as
    torch's fused AdamW at 2 host threads and 2 torch threads, the reference at 2 too
    (docs/reproducibility.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        data = batches(8, rows=8)
        expected = train_torch(make_model(), data, precision=precision)
        engine = initialize(
            make_model(),
            precision=precision,
            device=DEVICE,
            offload={"optimizer": "host", "optimizer_threads": 2},
        )
        assert engine.optimizer.updates.host_threads == 2
        train_engine(engine, data)
        assert max_rel_diff(trainable(engine.state_dict()), trainable(expected)) == 0.0
        assert set(engine.run_summary().optimizer_state_homes) == {"host"}
        engine.close()
    finally:
        torch.set_num_threads(threads)


def test_states_on_nvme_under_a_host_budget_smaller_than_the_states_match_torch_adamw(
    tmp_path,
) -> None:
    """bf16, so that the host can be smaller than the states: the first cycle, recorded with
    no chunk budget, evicts every parameter and gradient chunk to the host, which in fp32 is
    as many bytes as the two moments. Compared: the fp32 masters."""
    model, data = make_model(), batches(STEPS, rows=8)
    expected = train_torch(model, data, precision="bf16")
    state_bytes = 12 * trainable_elements(model)  # fp32 masters, exp_avg and exp_avg_sq
    # The host holds the masters until the first step sends them to NVMe, what the device
    # evicts (2 bytes per parameter), the NVMe tier's staging buffers (6 blocks) and the
    # states of the chunk group updating (the largest has 9216 elements).
    host = 6 * sum(p.numel() for p in model.parameters()) + 6 * 4096 + 12 * 9216 + 16384
    assert host < state_bytes
    engine = initialize(
        make_model(),
        precision="bf16",
        device=DEVICE,
        host={"capacity": host},
        offload={"optimizer": "nvme", "nvme": {"path": str(tmp_path), "block_size": 4096}},
    )
    train_engine(engine, data)
    state = engine.state_dict()
    assert max_rel_diff(trainable(state), trainable(expected)) <= TOLERANCE
    assert max_rel_diff(trainable(state), trainable(expected)) == 0.0
    assert frozen_unchanged(state, model)
    ledger = engine.ledger
    assert ledger.tiers["host"].peak <= host
    nvme = ledger.tiers["nvme"]
    assert sum(nvme.by_kind[k] for k in ("master", "exp_avg", "exp_avg_sq")) >= state_bytes
    assert ledger.bytes_into("nvme", STEPS - 1) >= state_bytes, "written back every step"
    root = engine.residency.tiers["nvme"].root
    assert any(root.iterdir())
    engine.close()
    assert not root.exists() and list(tmp_path.iterdir()) == [], "close removes the files"


def record_deferred_copies(monkeypatch) -> list[str]:
    """The names of the threads that run deferred copies (a list filled as they run)."""
    copied_on: list[str] = []
    wait = DeferredCopy.wait

    def recording_wait(self: DeferredCopy) -> None:
        if not self.is_completed():
            copied_on.append(threading.current_thread().name)
        wait(self)

    monkeypatch.setattr(DeferredCopy, "wait", recording_wait)
    return copied_on


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("where", ["host", "nvme"])
def test_the_overlapped_step_equals_the_serial_step_bit_for_bit(
    precision: str, where: str, tmp_path
) -> None:
    data = batches(8, rows=8)
    offload = {"optimizer": where, "nvme": {"path": str(tmp_path), "block_size": 4096}}
    runs = serial_and_overlapped(
        lambda engine: train_engine(engine, data), len(data) - 2, offload, precision=precision
    )
    assert_same_state(runs[True], runs[False])


def serial_and_overlapped(
    train: Callable[[object], None], min_started: int, offload: dict, **config
) -> dict[bool, dict[str, torch.Tensor]]:
    """The state after ``train`` of a serial and an overlapped engine (keyed by overlap); the
    overlapped one started at least ``min_started`` updates in backward (every cycle after
    the first does)."""
    runs = {}
    for overlap in (False, True):
        engine = initialize(
            make_model(), device=DEVICE, offload={**offload, "overlap": overlap}, **config
        )
        train(engine)
        runs[overlap] = engine.state_dict()
        if overlap:
            assert engine.reducer.listener.started >= min_started
        engine.close()
    return runs


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_overlapped_step_with_accumulation_equals_the_serial_step_bit_for_bit(
    precision: str,
) -> None:
    """A layout final in the last micro-batch but not yet startable (fp32: a unit still
    computes on its parameter chunk) is the step's to update. It must not start in the next
    window's first micro-batch with that micro-batch's gradients alone: that crashed (the
    chunk in use) or dropped the later micro-batches' gradients."""
    data = batches(6, rows=8)

    def two_micro_batches_a_step(engine) -> None:
        for x, y in data:
            for micro in range(2):
                engine.backward(engine(x[micro::2], y[micro::2]))
                engine.step()

    runs = serial_and_overlapped(
        two_micro_batches_a_step,
        len(data) - 2,
        {"optimizer": "host"},
        precision=precision,
        gradient_accumulation_steps=2,
    )
    assert_same_state(runs[True], runs[False])


def test_fp32_early_updates_copy_their_chunks_off_the_device_on_the_host_thread(
    monkeypatch,
) -> None:
    """fp32 training updates the parameter chunk itself on the host: an early update's moves
    of it and its gradients are left to the update's thread, which copies before it reads
    (chunkmem/devices.py, [Note: copies a reader runs]); backward's thread copies nothing."""
    copied_on = record_deferred_copies(monkeypatch)
    data = batches(6, rows=8)
    engine = initialize(
        make_model(),
        precision="fp32",
        device=DEVICE,
        offload={"optimizer": "host", "overlap": True},
    )
    train_engine(engine, data)
    started = engine.reducer.listener.started
    engine.close()
    assert started >= len(data) - 2
    assert len(copied_on) >= 2 * started, "the parameter and gradient chunk of each update"
    assert all(name.startswith("chunkmem-host-step") for name in copied_on), set(copied_on)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gpus_gradients_are_copied_down_for_the_reader_and_give_the_same_bits(
    overlap: bool, monkeypatch
) -> None:
    """On a GPU, bf16 gradients are copied into host buffers for the host update, on the copy
    stream: the update's thread waits for the copies before its kernels read them, and
    backward's thread does not block on them. Emulated here: the gradients are taken as not
    readable in place, and each copy is left to its first waiter (a copy engine's event that
    only a wait completes). A kernel that read a buffer before its copy would read zeros."""
    data = batches(6, rows=8)
    reference = initialize(make_model(), precision="bf16", device=DEVICE,
                           offload={"optimizer": "host", "overlap": False})  # fmt: skip
    train_engine(reference, data)
    expected = reference.state_dict()
    reference.close()

    copied_on = record_deferred_copies(monkeypatch)

    def to_host_on_a_copy_engine(self, device_tensor, host):
        host.zero_()
        return DeferredCopy(host, device_tensor)

    monkeypatch.setattr(SimulatedDevice, "to_host", to_host_on_a_copy_engine)
    monkeypatch.setattr(UpdateBuilder, "reads_grads_in_place", staticmethod(lambda _source: False))
    engine = initialize(make_model(), precision="bf16", device=DEVICE,
                        offload={"optimizer": "host", "overlap": overlap})  # fmt: skip
    train_engine(engine, data)
    state = engine.state_dict()
    started = engine.reducer.listener.started if overlap else 0
    engine.close()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    assert copied_on, "the gradients went through the host buffers"
    if overlap:
        assert started >= len(data) - 2
        host_thread = [n for n in copied_on if n.startswith("chunkmem-host-step")]
        assert len(host_thread) >= started, "each early update copies its own gradients"


def test_the_overlapped_norm_check_sees_the_serial_norm_and_stops_on_nan() -> None:
    """An early update measures its gradients on its own thread before consuming them; the
    step's global norm is the serial step's, bit for bit, and a NaN found after updates
    began in backward stops the engine instead of skipping."""
    data = batches(6, rows=8)
    norms: dict[bool, list[float]] = {}
    for overlap in (False, True):
        engine = initialize(
            make_model(), device=DEVICE, offload={"optimizer": "host", "overlap": overlap}
        )
        norms[overlap] = []
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
            norms[overlap].append(engine.last_grad_norm)
        if overlap:
            assert engine.reducer.listener.started >= len(data) - 2
            x, y = data[0]
            engine.backward(engine(x, y) * float("nan"))
            with pytest.raises(FloatingPointError, match="already updated during backward"):
                engine.step()
            with pytest.raises(EngineUsageError, match="stopped"):
                engine(x, y)
        engine.close()
    assert norms[True] == norms[False]


def test_discard_after_an_overlapped_backward_asks_for_the_step() -> None:
    data = batches(3, rows=8)
    engine = initialize(make_model(), device=DEVICE, offload={"optimizer": "host", "overlap": True})
    train_engine(engine, data[:2])
    engine.backward(engine(*data[2]))
    with pytest.raises(EngineUsageError, match=r"already ran in backward .* call engine.step"):
        engine.discard()
    engine.step()  # and the engine trains on


def test_bf16_moments_equal_fp32_adamw_with_the_moments_rounded_each_step(tmp_path) -> None:
    model, data = make_model(), batches(STEPS, rows=8)
    expected = train_torch(model, data, after_step=round_moments_to_bf16)
    for where in ("host", "nvme"):
        engine = initialize(
            make_model(),
            device=DEVICE,
            offload={
                "optimizer": where,
                "state_dtype": "bf16",
                "nvme": {"path": str(tmp_path), "block_size": 4096},
            },
        )
        train_engine(engine, data)
        assert max_rel_diff(engine.state_dict(), expected) == 0.0, where
        moments = [c for c in engine.residency.chunks.values() if c.kind.value == "exp_avg"]
        assert {c.dtype for c in moments} == {torch.bfloat16}
        engine.close()


def test_optimizer_ratio_offloads_the_groups_final_first_and_stays_exact() -> None:
    model, data = make_model(), batches(6, rows=8)
    expected = train_torch(model, data)
    engine = initialize(
        make_model(),
        device={"type": "simulated", "capacity": "64MiB"},
        offload={"optimizer": "host", "optimizer_ratio": 0.5},
    )
    train_engine(engine, data)
    assert max_rel_diff(engine.state_dict(), expected) == 0.0
    layouts = engine.params.trainable_layouts()
    homes = [engine.states.home(layout).name for layout in layouts]
    offloaded = homes.count("host")
    assert homes == ["device"] * (len(homes) - offloaded) + ["host"] * offloaded
    elements = [engine.states.state_span(layout)[1] for layout in layouts]
    assert sum(elements[-offloaded:]) >= 0.5 * sum(elements) > sum(elements[-offloaded + 1 :])


def test_the_old_placement_key_still_works_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="now 'offload.optimizer'"):
        config = chunkmem.Config.from_dict({"placement": {"optimizer_states": "host"}})
    assert config.offload.optimizer == "host"
    with pytest.raises(ConfigError, match="keep only offload.optimizer"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunkmem.Config.from_dict(
            {"placement": {"optimizer_states": "host"}, "offload": {"optimizer": "device"}}
        )
    with pytest.raises(ConfigError, match="offload.nvme.path is not set"):
        chunkmem.Config.from_dict({"offload": {"optimizer": "nvme"}})
    with pytest.raises(ConfigError, match="offload.optimizer must be 'host' or 'nvme'"):
        chunkmem.Config.from_dict({"offload": {"optimizer_ratio": 0.5}})


def test_without_the_native_library_torch_runs_the_host_update_and_says_so(
    monkeypatch, caplog
) -> None:
    from chunkmem import update_kernels
    from kernels import host_optim
    from kernels._build import BuildError

    def no_compiler(*_args, **_kwargs):
        raise BuildError("no C++ compiler (g++) found")

    monkeypatch.setattr(host_optim, "load_library", no_compiler)
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        assert update_kernels.native_host_optimizer.__wrapped__() is None
    assert "native host optimizer cannot be used (no C++ compiler" in caplog.text
    monkeypatch.setattr(update_kernels, "native_host_optimizer", lambda: None)
    model, data = make_model(), batches(6, rows=8)
    engine = initialize(make_model(), device=DEVICE, offload={"optimizer": "host"})
    train_engine(engine, data)
    assert max_rel_diff(engine.state_dict(), train_torch(model, data)) == 0.0
    monkeypatch.setattr(chunkmem.api, "native_host_optimizer", lambda: None)
    with pytest.raises(ConfigError, match="state_dtype 'bf16' needs the native host optimizer"):
        initialize(make_model(), device=DEVICE, offload={"state_dtype": "bf16"})


# ---------------------------------------------------------------- two ranks
def zero_rank(comm, steps: int, stage: int, offload: dict) -> dict:
    data = batches(steps, rows=8)
    with one_rank_at_a_time(comm):
        model = make_model()
    engine = initialize(
        model,
        comm=comm,
        device={"type": "simulated", "capacity": "8MiB"},
        zero={"stage": stage, "timeout_s": 30},
        offload={**offload, "optimizer_threads": 1},
    )
    half = 8 // comm.size
    for x, y in data:
        rows = slice(comm.rank * half, (comm.rank + 1) * half)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    result = {
        "state": engine.state_dict(),
        "started": engine.reducer.listener.started,
        "homes": engine.run_summary().optimizer_state_homes,
    }
    engine.close()  # ranks end with os._exit, which skips exit handlers
    return result


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_zero2_on_two_ranks_with_states_on_the_host_and_overlap_matches_torch_adamw() -> None:
    """Bit for bit, with the reference at the ranks' thread count (tests/thread_count.py):
    torch's CPU LayerNorm backward sums its weight and bias gradients over rows in an order
    that depends on the thread count."""
    offload = {"optimizer": "host", "overlap": True}
    results = run_ranks(zero_rank, 2, STEPS, 2, offload, timeout_s=30, deadline_s=150)
    expected = train_torch(make_model(), batches(STEPS, rows=8), ranks=2)
    for rank, result in enumerate(results):
        assert max_rel_diff(result["state"], expected) <= TOLERANCE, rank
        assert max_rel_diff(result["state"], expected) == 0.0, rank
        assert set(result["homes"]) == {"host"}
        assert result["started"] >= STEPS - 2, "updates start in backward, after reduce-scatters"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stages_1_and_3_with_states_on_nvme_and_overlap_match_torch_adamw(
    stage: int, tmp_path
) -> None:
    """Stage 1 reduces before the step, so its updates start there; stage 3 after each
    reduce-scatter in backward, as stage 2. On the in-process world (stage 2 with states on
    the host runs on gloo ranks above)."""
    steps = 8
    offload = {"overlap": True, **nvme(tmp_path)}
    results = run_threads(zero_rank, 2, steps, stage, offload, timeout_s=30)
    expected = train_torch(make_model(), batches(steps, rows=8), ranks=2)
    for rank, result in enumerate(results):
        assert max_rel_diff(result["state"], expected) == 0.0, rank
        assert set(result["homes"]) == {"nvme"}
        assert result["started"] >= steps - 2
    assert list(tmp_path.iterdir()) == [], "each rank's close removed its files"


def accumulating_zero_rank(comm, stage: int, overlap: bool) -> dict[str, torch.Tensor]:
    """fp32, two micro-batches a step, each rank its half of each micro-batch."""
    with one_rank_at_a_time(comm):
        model = make_model()
    engine = initialize(
        model,
        comm=comm,
        device=DEVICE,
        precision="fp32",
        gradient_accumulation_steps=2,
        zero={"stage": stage, "timeout_s": 30},
        offload={"optimizer": "host", "overlap": overlap},
    )
    for x, y in batches(4, rows=8):
        for micro in range(2):
            rows = slice(micro * 4 + comm.rank * 2, micro * 4 + comm.rank * 2 + 2)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    state = engine.state_dict()
    engine.close()
    return state


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_with_accumulation_and_overlap_equals_the_serial_step(stage: int) -> None:
    """An update left waiting at the end of a window must not start in the next window's first
    micro-batch: under ZeRO-2/3 it read a gradient shard that micro-batch had not reduced
    (one rank failed, the other waited for the collective)."""
    serial = run_threads(accumulating_zero_rank, 2, stage, False, timeout_s=30)
    overlapped = run_threads(accumulating_zero_rank, 2, stage, True, timeout_s=30)
    for rank in range(2):
        assert_same_state(overlapped[rank], serial[rank])


class SharedInCheckpoint(torch.nn.Module):
    """``shared`` runs before a reentrant activation checkpoint and, while ``inside`` is set,
    inside it too: its gradient then arrives in two parts, the recomputation's last."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.inside = True

    def block(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(h))
        return torch.tanh(self.shared(h)) if self.inside else h

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return F.mse_loss(self.head(h), y)


def shared_in_checkpoint_engine(precision: str, overlap: bool, clip: float = 0.0):
    torch.manual_seed(0)
    model = SharedInCheckpoint()
    engine = chunkmem.initialize(
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={
            "chunk": {"size": 512},
            "device": DEVICE,
            "precision": precision,
            "gradient_clipping": clip,
            "offload": {"optimizer": "host", "overlap": overlap},
        },
    )
    return model, engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gradient_in_two_parts_is_waited_for_before_its_update_starts(precision: str) -> None:
    """The early update of ``shared`` started at its first part, and the second was added
    after it read the gradient and dropped by the step. Its layout is now final once every
    slot has as many parts as in the previous cycle."""
    runs = {}
    for overlap in (False, True):
        _model, engine = shared_in_checkpoint_engine(precision, overlap)
        train_engine(engine, batches(5, rows=8))
        runs[overlap] = engine.state_dict()
        if overlap:
            assert engine.reducer.listener.started >= 3
        engine.close()
    assert_same_state(runs[True], runs[False])


def test_a_part_arriving_after_its_update_began_stops_the_engine_and_says_why() -> None:
    """The pattern changes: ``shared`` gets one part in the first cycles, two in the next.
    Its early update began after the first: not an exact step any more, so backward raises
    and the engine stops (its updates were final, not speculative)."""
    model, engine = shared_in_checkpoint_engine("fp32", overlap=True)
    model.inside = False
    data = batches(4, rows=8)
    train_engine(engine, data[:2])
    model.inside = True
    with pytest.raises(EngineUsageError, match=r"another gradient contribution after their "):
        engine.backward(engine(*data[2]))
    with pytest.raises(EngineUsageError, match=r"use_reentrant=False"):
        engine(*data[3])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_part_arriving_after_a_speculative_update_began_drops_only_that_batch(
    precision: str,
) -> None:
    """Under clipping the early updates are speculative: undone exactly, the batch dropped,
    and the next one (whose parts the previous cycle taught) trains as the serial engine. In
    fp32 the early update holds the parameter chunk, which the recomputation needs again: the
    update finishes first (it crashed on the chunk in use before)."""
    states = {}
    for overlap in (False, True):
        model, engine = shared_in_checkpoint_engine(precision, overlap, clip=1.0)
        model.inside = False
        data = batches(5, rows=8)
        train_engine(engine, data[:2])
        model.inside = True
        if overlap:
            with pytest.raises(EngineUsageError, match=r"another gradient contribution"):
                engine.backward(engine(*data[2]))
            assert engine.stopped_because is None
        train_engine(engine, data[3:])
        states[overlap] = engine.state_dict()
        engine.close()
    assert_same_state(states[True], states[False])


def test_an_early_update_measures_a_gpus_gradients_where_the_serial_step_does(monkeypatch) -> None:
    """Under clipping, the step measures on the GPU the gradients no early update saw (torch's
    norm there), and the native kernel would measure their host copies with other bits: so an
    early update measures a GPU's gradients on the GPU too, copied down with them, and every
    clipped overlapped step, rollbacks included, is the serial one's bit for bit. Emulated:
    the gradients are taken as not readable in place, and tensors inside a parameter or
    gradient chunk stand for a GPU's, which torch measures (the host copies go to the native
    norm); on one thread, as torch's CPU norm sums in an order that depends on its thread
    count (a GPU's does not)."""
    engines: dict[bool, object] = {}

    def on_the_device(tensor: torch.Tensor) -> bool:
        address = tensor.data_ptr()
        for engine in engines.values():
            for layout in engine.manager.params.trainable_layouts():
                for kind in (ChunkKind.PARAM, ChunkKind.GRAD):
                    payload = layout.chunks[kind].payload if kind in layout.chunks else None
                    if payload is not None and payload.data_ptr() <= address < (
                        payload.data_ptr() + payload.numel() * payload.element_size()
                    ):
                        return True
        return False

    natively = update_kernels.measured_natively
    monkeypatch.setattr(UpdateBuilder, "reads_grads_in_place", staticmethod(lambda _source: False))
    monkeypatch.setattr(update_kernels, "measured_natively", lambda tensors: natively(tensors)
                        and not any(map(on_the_device, tensors)))  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    data = batches(8, rows=8)
    try:
        for overlap in (False, True):
            engines[overlap] = initialize(make_model(), precision="bf16", device=DEVICE,
                                          gradient_clipping=1.0,
                                          offload={"optimizer": "host", "overlap": overlap})  # fmt: skip
        for index, (x, y) in enumerate(data):
            scale = 1e3 if index in (3, 5) else 1e-3  # steps 3 and 5 clip
            for engine in engines.values():
                engine.backward(engine(x, y) * scale)
                engine.step()
            assert engines[True].last_grad_norm == engines[False].last_grad_norm, index
            assert_same_state(engines[True].state_dict(), engines[False].state_dict())
        summary = engines[True].run_summary()
        assert summary.speculative_rollbacks == 2 and summary.speculative_commits >= 4
    finally:
        for engine in engines.values():
            engine.close()
        torch.set_num_threads(threads)


def test_a_layout_is_final_once_each_slot_has_the_contributions_of_the_cycle_before():
    """The count the overlap starts an update on (``ExpectedGradients``): the first cycle
    waits for one gradient per slot; later ones for as many as the cycle before gave each
    slot, and not for a slot that got none then."""
    from chunkmem.sharding import ExpectedGradients

    engine = initialize(make_model(), device=DEVICE)
    train_engine(engine, batches(1, 4))  # packs the parameters into layouts
    layout = max(engine.manager.params.trainable_layouts(), key=lambda lay: len(lay.slots))
    first, second, *rest = layout.slots
    assert rest, "the test needs a layout of three slots or more"
    arrived = ExpectedGradients()
    arrived.begin()
    for slot in (first, second, *rest[:-1]):
        arrived.add(slot)
        assert not arrived.complete(layout)
    arrived.add(first)  # a second contribution: a reentrant checkpoint's recomputation
    assert not arrived.complete(layout) and not arrived.all_in(layout)
    arrived.add(rest[-1])
    assert arrived.complete(layout) and arrived.all_in(layout)
    arrived.learn()

    arrived.begin()  # the next cycle: ``first`` twice, every other slot once
    for slot in layout.slots:
        arrived.add(slot)
    assert not arrived.complete(layout) and not arrived.all_in(layout)
    arrived.add(first)
    assert arrived.complete(layout) and arrived.all_in(layout)
    arrived.learn()

    arrived.begin()  # ``second`` gets none in this cycle: it is waited for
    for slot in (first, first, *rest):
        arrived.add(slot)
    assert not arrived.complete(layout)
    arrived.learn()

    arrived.begin()  # and not in the next, which the cycle before taught
    for slot in (first, first, *rest[:-1]):
        arrived.add(slot)
    assert not arrived.complete(layout)
    arrived.add(rest[-1])
    assert arrived.complete(layout) and not arrived.all_in(layout)
    arrived.add(first)  # more contributions than expected keep it final
    assert arrived.complete(layout)
    engine.close()
