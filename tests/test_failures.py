"""The failures a new user hits in the first week: none silent, none leaking.

Each test fails on the engine as it was before the fix it covers (see docs/failures.md for
what the user sees in every failure mode).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chunkmem
from chunkmem.config import Config
from chunkmem.errors import ChunkmemError, CollectiveError, ConfigError, EngineUsageError
from chunkmem.models.gpt import GPT, GPTConfig
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads
from tests.reference import max_relative_diff, token_batches, train_engine, train_reference
from tests.test_aborts import FAIL_AT, batches, make_engine
from zero.comm import CollectiveRecord, CommLedger

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def engine_for(model: nn.Module, capacity: int | str = "10MB", **config) -> chunkmem.Engine:
    config.setdefault("optimizer", {"lr": 1e-3})
    return chunkmem.initialize(
        model, config={"device": {"type": "simulated", "capacity": capacity}, **config}
    )


class Wrapped(nn.Module):
    """A GPT whose loss can be made to raise, or to be NaN, after the whole forward ran."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(SMALL)
        self.fail = False
        self.poison = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.gpt(x, y)
        if self.fail:
            raise RuntimeError("bad batch")
        return loss * float("nan") if self.poison else loss


# ---------------------------------------------------------------- 1. activations
def test_failed_and_discarded_forwards_release_their_activations() -> None:
    torch.manual_seed(0)
    engine = engine_for(Wrapped(), capacity="4MB")
    data = token_batches(2, batch=8, seq=16, vocab=64)
    train_engine(engine, data[:1])
    engine.module.fail = True
    for _attempt in range(40):  # each leaked ~150 KB: the device ran out after about 17
        with pytest.raises(RuntimeError, match="bad batch"):
            engine(*data[1])
        assert engine.ledger.device.nonmodel == 0
    engine.module.fail = False
    loss = engine(*data[1])  # a forward whose loss is dropped without backward
    with pytest.raises(EngineUsageError, match=r"engine\.discard\(\)"):
        engine(*data[1])
    engine.discard()
    assert engine.ledger.device.nonmodel == 0
    del loss
    train_engine(engine, data)


# ---------------------------------------------------------------- 2. strict device limit
def test_the_device_limit_holds_when_the_loss_follows_the_last_layer() -> None:
    """At the smallest capacity this tied-weight GPT trains with, the device peaked 5% over
    capacity at the head's moment: the loss's activations were counted before the head's
    chunk (no longer in use) was evicted to make room for them."""
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    capacity = 2_772_050
    engine = engine_for(GPT(config), capacity=capacity)
    train_engine(engine, token_batches(3, batch=4, seq=64, vocab=512))
    assert engine.ledger.device.peak <= capacity


# ---------------------------------------------------------------- 3. stray gradients
def test_gradients_from_a_backward_around_the_engine_are_refused() -> None:
    model = GPT(SMALL)
    data = token_batches(3, batch=2, seq=16, vocab=64)
    reference = train_reference(model, data)
    engine = engine_for(copy.deepcopy(model))
    train_engine(engine, data[:1])
    stray = engine.module(*data[1])  # the bare model, not engine(...)
    with pytest.raises(EngineUsageError, match="arrived outside engine.backward"):
        stray.backward()
    train_engine(engine, data[1:])
    state = engine.state_dict()
    assert max_relative_diff({n: state[n] for n in reference.masters}, reference.masters) == 0.0


CUT_OFF_LOSSES = {
    "detached": lambda output: output.detach().clone().requires_grad_(),
    "apart from the model": lambda output: torch.ones((), requires_grad=True) * 2.0,
}


@pytest.mark.parametrize("cut_off", sorted(CUT_OFF_LOSSES))
def test_a_backward_that_reaches_no_parameter_is_refused_and_changes_nothing(cut_off) -> None:
    """Accepted before: step() returned True, updated nothing, and the forward's saved
    activations stayed held, so training ran out of device memory a few steps later."""
    model = GPT(SMALL)
    data = token_batches(3, batch=2, seq=16, vocab=64)
    reference = train_reference(model, data)
    engine = engine_for(copy.deepcopy(model))
    train_engine(engine, data[:1])
    before = engine.state_dict()
    loss = CUT_OFF_LOSSES[cut_off](engine(*data[1]))
    with pytest.raises(EngineUsageError, match="reached none of the model's trainable"):
        engine.backward(loss)
    assert engine.activations.held_bytes == 0, "the forward's saved tensors were released"
    assert engine.ledger.device.nonmodel == 0
    with pytest.raises(EngineUsageError, match="needs engine.backward"):
        engine.step()  # nothing to update
    after = engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "nothing was updated"
    train_engine(engine, data[1:])  # the batch again, then the next: as if never refused
    state = engine.state_dict()
    assert max_relative_diff({n: state[n] for n in reference.masters}, reference.masters) == 0.0


def refused_then_trained(comm, stage: int, refuse: bool) -> dict:
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(SMALL)
    engine = chunkmem.initialize(
        model,
        comm=comm,
        config={
            "device": {"type": "simulated", "capacity": "10MB"},
            "chunk": {"size": 2048},
            "optimizer": {"lr": 1e-3},
            "zero": {"stage": stage, "timeout_s": 10},
        },
    )
    data = token_batches(3, batch=2 * comm.size, seq=16, vocab=64)
    mine = [(x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]) for x, y in data]
    refused = 0
    for step, (x, y) in enumerate(mine):
        output = engine(x, y)
        if step == 1 and refuse:
            with pytest.raises(EngineUsageError, match="reached none"):
                engine.backward(output.detach().clone().requires_grad_())
            refused += 1
            output = engine(x, y)
        engine.backward(output)
        engine.step()
    return {"state": engine.state_dict(), "refused": refused}


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_refusing_a_cut_off_loss_stays_in_step_and_trains_exactly(stage) -> None:
    """On an in-process world of 2 ranks: the refusal comes before any collective of the
    backward, so the ranks stay in step, and the next batches train as if it never came."""
    refused = run_threads(refused_then_trained, 2, stage, True)
    control = run_threads(refused_then_trained, 2, stage, False)
    for rank in range(2):
        assert (refused[rank]["refused"], control[rank]["refused"]) == (1, 0)
        state, expected = refused[rank]["state"], control[rank]["state"]
        assert all(torch.equal(state[k], expected[k]) for k in expected), rank


# ---------------------------------------------------------------- 4. two engines
def test_a_second_engine_on_one_model_is_refused_until_the_first_closes() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    first = engine_for(model, precision="bf16")
    train_engine(first, token_batches(2, batch=2, seq=16, vocab=64))
    with pytest.raises(ConfigError, match="already wrapped"):
        engine_for(model)
    values = first.state_dict()
    first.close()
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.detach(), values[name]), name
    second = engine_for(model)
    assert second.state_dict()["wte.weight"].equal(values["wte.weight"])
    train_engine(second, token_batches(1, batch=2, seq=16, vocab=64))


# ---------------------------------------------------------------- 5. non-finite values
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_gradient_raises_naming_the_step_and_changes_nothing(precision: str) -> None:
    torch.manual_seed(0)
    engine = engine_for(Wrapped(), precision=precision)
    data = token_batches(3, batch=2, seq=16, vocab=64)
    train_engine(engine, data[:1])
    before = engine.state_dict()
    engine.module.poison = True
    engine.backward(engine(*data[1]))
    with pytest.raises(FloatingPointError, match="step 2: the global gradient norm is nan"):
        engine.step()
    assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
    engine.module.poison = False
    train_engine(engine, data[2:])  # the next batch trains


def test_nonfinite_skip_skips_logs_and_counts(caplog) -> None:
    torch.manual_seed(0)
    engine = engine_for(Wrapped(), precision="bf16", nonfinite="skip")
    data = token_batches(2, batch=2, seq=16, vocab=64)
    train_engine(engine, data[:1])
    before = engine.state_dict()
    engine.module.poison = True
    engine.backward(engine(*data[1]))
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        assert engine.step() is False
    assert "step 2 skipped" in caplog.text
    assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
    assert engine.run_summary().skipped_steps == 1


def test_fp16_stuck_at_the_minimum_loss_scale_raises() -> None:
    torch.manual_seed(0)
    engine = engine_for(
        Wrapped(),
        precision="fp16",
        loss_scale={"initial_scale": 4.0, "min_scale": 1.0, "max_skips_at_min_scale": 3},
    )
    engine.module.poison = True
    data = token_batches(1, batch=2, seq=16, vocab=64)[0]
    results = []
    with pytest.raises(ChunkmemError, match="overflowed 3 steps in a row at the minimum"):
        for _step in range(10):
            engine.backward(engine(*data))
            results.append(engine.step())
    assert results == [False, False, False, False]  # 4 -> 2 -> 1, then 2 skips at 1


# ---------------------------------------------------------------- 6. desynchronized ranks
def desynchronized_rank(comm, stage: int) -> dict:
    """Rank 1 raises in backward at batch FAIL_AT, catches it and carries on."""
    engine = make_engine(stage, comm)
    data = batches(comm.size, comm.rank)
    started = None
    try:
        for index, batch in enumerate(data * 3):
            if index == FAIL_AT and comm.rank == 1:
                engine.module.fail_backward = True
                with pytest.raises(RuntimeError, match="injected"):
                    engine.backward(engine(*batch))
                engine.module.fail_backward = False
                continue
            started = started or (time.monotonic() if index >= FAIL_AT else None)
            engine.backward(engine(*batch))
            engine.step()
    except CollectiveError as error:
        return {"error": str(error), "after_s": time.monotonic() - (started or time.monotonic())}
    return {"error": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "world"), [(3, "threads"), pytest.param(2, "gloo", marks=pytest.mark.distributed)]
)
def test_a_rank_that_carries_on_after_an_exception_is_caught_on_every_rank(
    stage: int, world: str
) -> None:
    """On gloo the rings' tags never match and the wait times out; in the in-process world the
    meeting sees the two identities at once. Either way every rank names both sides."""
    timeout_s = 3.0
    run = run_threads if world == "threads" else run_ranks
    results = run(desynchronized_rank, 2, stage, timeout_s=timeout_s)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained on out of step"
        assert "ranks are out of step" in result["error"], result["error"]
        assert result["after_s"] < timeout_s + 1.5, result
    assert "rank 0 is at collective" in results[0]["error"]
    assert "rank 1 is at collective" in results[0]["error"]


# ---------------------------------------------------------------- 7. the comm ledger
def test_the_comm_ledger_keeps_totals_and_a_bounded_window() -> None:
    ledger = CommLedger(max_records=100, max_tags=4)
    for step in range(50):
        for _ in range(20):
            ledger.add(CollectiveRecord("all_gather", "world", 8, 4, 16, "float32", step))
    assert len(ledger.records) == 100 and ledger.records_dropped == 900
    assert ledger.elements_sent() == 1000 * 4 and ledger.bytes_sent(op="all_gather") == 16000
    assert ledger.elements_sent(tag=49) == 20 * 4
    with pytest.raises(KeyError, match="left the ledger's window"):
        ledger.elements_sent(tag=3)
    assert ledger.totals()[("all_gather", "world")]["calls"] == 1000


# ---------------------------------------------------------------- 8. smaller items
def test_a_config_file_that_is_not_utf8_names_the_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"precision": "bf16", "note": "caf\xe9"}')
    with pytest.raises(ConfigError, match=r"config\.json' is not UTF-8"):
        Config.from_json(path)


def test_a_config_passed_as_the_optimizer_says_so() -> None:
    with pytest.raises(ConfigError, match="pass it by keyword"):
        chunkmem.initialize(GPT(SMALL), {"device": {"type": "simulated", "capacity": "1MB"}})


class NormedMLP(nn.Module):
    """BatchNorm statistics and a rotary-style frequency table: floating-point buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        angles = h[:, :8] * self.inv_freq
        h = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1) + h
        return F.mse_loss(self.out(torch.relu(h)), y)


def test_floating_point_buffers_train_in_bf16_like_model_to_bf16() -> None:
    torch.manual_seed(0)
    model = NormedMLP()
    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(4)]
    reference = train_reference(model, data, precision="bf16")
    engine = engine_for(copy.deepcopy(model), precision="bf16")
    train_engine(engine, data)
    assert engine.module.norm.running_mean.dtype == torch.bfloat16
    state = engine.state_dict()
    assert max_relative_diff({n: state[n] for n in reference.masters}, reference.masters) == 0.0


def test_a_model_in_another_dtype_than_the_precision_is_said_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        engine_for(GPT(SMALL).to(torch.bfloat16))
    assert "parameters are bfloat16; chunkmem trains them in float32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        engine_for(GPT(SMALL), precision="bf16")  # fp32 weights become the fp32 masters
    assert "chunkmem trains them" not in caplog.text


# ---------------------------------------------------------------- 10. a rank killed mid-run
DEATH_TIMEOUT_S = 3.0


def killed_at_step_three(comm, killed: int, record_dir: str) -> None:
    """ZeRO-2 training; rank ``killed`` SIGKILLs itself inside step 3's backward (its peers'
    reductions in flight), after writing the moment it died. A survivor writes when and how
    it raised, then exits at once, as a training script does: a peer still diagnosing must
    not wait on it."""
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(SMALL),
        config={
            "device": {"type": "simulated", "capacity": "10MB"},
            "chunk": {"size": 2048},
            "zero": {"stage": 2, "timeout_s": DEATH_TIMEOUT_S},
        },
    )
    data = token_batches(6, batch=2, seq=16, vocab=64)
    for step, (x, y) in enumerate(data):
        if step == 3 and comm.rank == killed:
            layouts = engine.params.trainable_layouts()
            victim = layouts[len(layouts) // 2].slots[0].param

            def die(_grad: torch.Tensor) -> None:
                (Path(record_dir) / "killed_at").write_text(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)

            victim.register_hook(die)
        try:
            engine.backward(engine(x, y))
            engine.step()
        except CollectiveError as error:
            record = {"raised_at": time.monotonic(), "message": str(error), "step": step}
            (Path(record_dir) / f"rank{comm.rank}.json").write_text(json.dumps(record))
            os._exit(0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_survivor_of_a_killed_rank_raises_within_the_timeout_naming_it(
    world: int, tmp_path
) -> None:
    run_ranks(
        killed_at_step_three,
        world,
        1,
        str(tmp_path),
        timeout_s=DEATH_TIMEOUT_S,
        deadline_s=90,
        dying_ranks=range(world),
    )
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in range(world):
        if rank == 1:
            continue
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} never raised"
        result = json.loads(path.read_text())
        late_s = result["raised_at"] - killed_at
        assert late_s < DEATH_TIMEOUT_S + 1.0, f"rank {rank} raised {late_s:.2f} s after the kill"
        assert result["step"] == 3, rank
        assert 1 in _ranks_named(result["message"], "gone"), f"rank {rank}: {result['message']}"


def _ranks_named(message: str, status: str) -> set[int]:
    """The ranks a collective error says are ``status`` ("rank 1 is gone", "ranks 0-2 are
    gone")."""
    named: set[int] = set()
    for listed in re.findall(rf"ranks? ([0-9, -]+) (?:is|are) {status}", message):
        for part in listed.split(", "):
            low, _, high = part.partition("-")
            named.update(range(int(low), int(high or low) + 1))
    return named
