"""ZeRO stages 1-3 on 2 and 4 ranks: numerics, model-state bytes, communication volume.

Every rank trains its slice of a global batch; the result must equal single-process training
on the global batch, the ledger's per-rank model-state bytes must equal the ZeRO formulas and
the communication ledger's all-gather + reduce-scatter volume per step must equal theory. The
matrix runs on the in-process world (``zero.thread_world``: the same collectives, ledger and
bits, no processes); gloo ranks run the integration cases and must give the same bits.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import replace

import pytest
import torch

import chunkmem
from chunkmem.chunk import ChunkKind
from chunkmem.errors import ConfigError
from chunkmem.models.gpt import GPT, GPTConfig
from chunkmem.pieces import owned_pieces
from tests.distributed_helpers import one_rank_at_a_time, run_ranks, run_threads
from tests.reference import max_relative_diff, train_reference
from zero.comm import CollectiveError
from zero.kinds import GATHERED, GRAD_SHARD

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
LOCAL_BATCH = 2
STEPS = 10
CHUNK = 2048
# (param, grad, optimizer-state) bytes per element: 16-bit compute copy + fp32 master and
# moments, or fp32 throughout (the parameter is its own master).
BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}
MODEL_KINDS = {k.value for k in ChunkKind.all()} - {GATHERED.value}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}
# Distributed sums reassociate floating-point additions; Adam turns those last-bit differences
# into parameter differences that grow with the learning rate (fp32 after 20 steps: 1.3e-5
# at lr 1e-3, 1.4e-6 at 1e-4). A small learning rate keeps the check about the algorithm.
LR = 1e-4


def global_batches(world: int, micro_batches: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(
        0, CONFIG.vocab_size, (micro_batches, world * LOCAL_BATCH, CONFIG.block_size + 1),
        generator=generator,
    )  # fmt: skip


def formula(stage: int, precision: str, elements: int, world: int) -> int:
    p, g, s = BYTES[precision]
    if stage == 1:
        return (p + g) * elements + s * elements // world
    if stage == 2:
        return p * elements + (g + s) * elements // world
    return (p + g + s) * elements // world


def new_engine(
    comm, stage: int, precision: str = "fp32", accumulation: int = 1, device: dict | None = None
) -> chunkmem.Engine:
    """The GPT of CONFIG at ``stage`` on ``comm``; ``device`` is the config's device section
    (default: a simulated device of 64 MiB)."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(CONFIG)
    return chunkmem.initialize(
        model,
        comm=comm,
        config={
            "precision": precision,
            "device": device or {"type": "simulated", "capacity": "64MiB"},
            "chunk": {"size": CHUNK},
            "optimizer": {"lr": LR},
            "gradient_accumulation_steps": accumulation,
            "zero": {"stage": stage, "timeout_s": 20},
        },
    )


def train_rank(
    comm, stage: int, precision: str, accumulation: int, device: dict | None = None
) -> dict:
    """One rank: train STEPS steps on its slice; report state, bytes and volume."""
    engine = new_engine(comm, stage, precision, accumulation, device)
    rows = global_batches(comm.size, STEPS * accumulation)
    local = rows[:, comm.rank * LOCAL_BATCH : (comm.rank + 1) * LOCAL_BATCH]
    measured_step = 3
    state_bytes = None
    for index, row in enumerate(local):
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        if index == measured_step * accumulation + accumulation - 1:  # end of backward
            tiers = (engine.ledger.device.by_kind, engine.ledger.tiers["host"].by_kind)
            state_bytes = sum(n for tier in tiers for k, n in tier.items() if k in MODEL_KINDS)
        engine.step()
    ledger = engine.states.sharding.comm.ledger
    layouts = engine.params.trainable_layouts()
    return {
        "state": engine.state_dict(),
        "state_bytes": state_bytes,
        "volume": sum(
            ledger.elements_sent(op=op, tag=measured_step)
            for op in ("all_gather", "reduce_scatter")
        ),
        "elements": sum(layout.capacity for layout in layouts),
        "used": sum(layout.used for layout in layouts),
    }


@functools.cache
def reference(
    world: int, precision: str, accumulation: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Single-process training on the global batch with plain PyTorch on ``device``; the
    masters on the CPU."""
    torch.manual_seed(0)
    model = GPT(CONFIG).to(device)
    rows = global_batches(world, STEPS * accumulation).to(device)
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in rows]
    run = train_reference(
        copy.deepcopy(model), batches, precision=precision, lr=LR,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    return {name: value.cpu() for name, value in run.masters.items()}


def check(
    results: list[dict],
    stage: int,
    precision: str,
    world: int,
    accumulation: int,
    device: str = "cpu",
) -> None:
    expected = reference(world, precision, accumulation, device)
    for rank, result in enumerate(results):
        ours = {k: v for k, v in result["state"].items() if k in expected}
        assert max_relative_diff(ours, expected) <= TOLERANCE[precision], f"rank {rank}"
        elements = result["elements"]
        # The ZeRO formulas over the chunk capacity: the parameters plus at most one chunk
        # of padding for the (one, trainable) chunk list.
        assert elements - result["used"] <= CHUNK
        assert result["state_bytes"] == formula(stage, precision, elements, world)
        # Stages 1-2: a reduce-scatter and an all-gather, the volume of one all-reduce.
        # Stage 3: a forward and a backward all-gather per micro-batch and a reduce-scatter.
        passes = 2 if stage < 3 else 2 * accumulation + 1
        assert result["volume"] == passes * elements * (world - 1) // world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_match_single_process_fp32(world: int) -> None:
    for stage in (1, 2, 3):
        for accumulation in (1, 2):
            results = run_threads(train_rank, world, stage, "fp32", accumulation, timeout_s=30)
            check(results, stage, "fp32", world, accumulation)


@pytest.mark.timeout(300)
def test_zero_stages_match_single_process_bf16() -> None:
    for stage in (1, 2, 3):
        for accumulation in (1, 2):
            results = run_threads(train_rank, 2, stage, "bf16", accumulation, timeout_s=30)
            check(results, stage, "bf16", 2, accumulation)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "stage", "precision", "accumulation"), [(2, 3, "bf16", 2), (4, 2, "fp32", 1)]
)
def test_gloo_ranks_train_as_the_in_process_world_bit_for_bit(
    world: int, stage: int, precision: str, accumulation: int
) -> None:
    """The real transport (gloo rings, processes): the same bits, bytes and volume."""
    gloo = run_ranks(
        train_rank, world, stage, precision, accumulation, timeout_s=30, deadline_s=240
    )
    threads = run_threads(train_rank, world, stage, precision, accumulation, timeout_s=30)
    check(gloo, stage, precision, world, accumulation)
    for rank in range(world):
        state, expected = gloo[rank].pop("state"), threads[rank].pop("state")
        assert all(torch.equal(state[k], expected[k]) for k in expected), rank
        assert gloo[rank] == threads[rank], rank


def whole_gradient_peak(comm, stage: int) -> tuple[int, int]:
    """Most whole-gradient bytes held at once in steady-state backward, all layouts' worth
    and the largest layout's."""
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(replace(CONFIG, n_layer=8)),
        config={
            "device": {"type": "simulated", "capacity": "16MiB"},
            "chunk": {"size": CHUNK},
            "zero": {"stage": stage, "timeout_s": 20},
        },
    )
    ledger = engine.ledger
    allocate = ledger.allocate
    peak = {"grad": 0}

    def tracking_allocate(tier: str, kind: str, *args) -> None:
        allocate(tier, kind, *args)
        grads = ledger.device.by_kind["grad"] + ledger.tiers["host"].by_kind["grad"]
        peak["grad"] = max(peak["grad"], grads)

    ledger.allocate = tracking_allocate
    rows = global_batches(comm.size, 4)[:, comm.rank * LOCAL_BATCH : (comm.rank + 1) * LOCAL_BATCH]
    for row in rows:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
    capacities = [layout.capacity for layout in engine.params.trainable_layouts()]
    return peak["grad"], sum(capacities) * 4, max(capacities) * 4


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_stage2_frees_whole_gradient_chunks_during_backward() -> None:
    """Stage 1 holds every whole gradient chunk until the step; stage 2 completes its
    reduce-scatters as backward goes, holding at most the ones in flight plus the ones being
    filled, from the first backward on (before, the first one reduced only at its end)."""
    from zero.reduce import MAX_REDUCTIONS_IN_FLIGHT

    stage1_peak, all_grads, largest = run_ranks(whole_gradient_peak, 2, 1, timeout_s=20)[0]
    stage2_peak, _, _ = run_ranks(whole_gradient_peak, 2, 2, timeout_s=20)[0]
    assert all_grads >= 3 * (MAX_REDUCTIONS_IN_FLIGHT + 3) * largest  # a bound that means something
    assert stage1_peak == all_grads
    assert stage2_peak <= (MAX_REDUCTIONS_IN_FLIGHT + 3) * largest


def initialize_with(comm, seed_by_rank: bool, precision_by_rank: bool) -> str:
    torch.manual_seed(comm.rank if seed_by_rank else 0)
    precision = "bf16" if precision_by_rank and comm.rank == 1 else "fp32"
    try:
        chunkmem.initialize(
            GPT(CONFIG),
            config={
                "precision": precision,
                "device": {"type": "simulated", "capacity": "16MiB"},
                "zero": {"stage": 2, "timeout_s": 20},
            },
        )
    except ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_that_disagree_fail_at_initialize_on_every_rank() -> None:
    seeds = run_ranks(initialize_with, 2, True, False, timeout_s=20)
    assert all("initial parameter values differ" in message for message in seeds)
    configs = run_ranks(initialize_with, 2, False, True, timeout_s=20)
    assert all("config key 'precision'" in message for message in configs)


def die_mid_step(comm, stage: int) -> str:
    torch.manual_seed(0)
    engine = chunkmem.initialize(
        GPT(CONFIG),
        config={
            "device": {"type": "simulated", "capacity": "16MiB"},
            "chunk": {"size": CHUNK},
            "zero": {"stage": stage, "timeout_s": 5},
        },
    )
    row = global_batches(comm.size, 1)[0, comm.rank * LOCAL_BATCH : (comm.rank + 1) * LOCAL_BATCH]
    engine.backward(engine(row[:, :-1], row[:, 1:]))
    engine.step()
    loss = engine(row[:, :-1], row[:, 1:])
    if comm.rank == 1:
        import os

        os._exit(1)  # dies between forward and backward
    try:
        engine.backward(loss)
        engine.step()
    except CollectiveError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_dead_rank_stops_the_others_with_a_named_collective(stage: int) -> None:
    results = run_ranks(die_mid_step, 2, stage, timeout_s=5, deadline_s=60, dying_ranks=[1])
    message = results[0]
    assert "on group 'world'" in message and (
        "reduce_scatter" in message or "all_gather" in message
    )


# ---------------------------------------------------------------- the first iteration
def first_iteration(comm, capacity: int | None) -> dict:
    """ZeRO-3 with checkpointing in bf16; per iteration: the device peak and the bytes moved
    to the host; and the losses."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = GPT(replace(CONFIG, n_layer=6, checkpoint=True))
    engine = chunkmem.initialize(
        model,
        comm=comm,
        config={
            "precision": "bf16",
            "device": {"type": "simulated", "capacity": capacity or "1GiB"},
            "chunk": {"size": CHUNK},
            "zero": {"stage": 3, "timeout_s": 20},
        },
    )
    ledger = engine.ledger
    peaks, to_host, losses = [], [], []
    rows = global_batches(comm.size, 4)[:, comm.rank * LOCAL_BATCH : (comm.rank + 1) * LOCAL_BATCH]
    for iteration, row in enumerate(rows):
        loss = engine(row[:, :-1], row[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        peaks.append(ledger.peak_in("device", iteration))
        to_host.append(ledger.bytes_into("host", iteration))
    return {"peaks": peaks, "to_host": to_host, "losses": losses}


@pytest.mark.timeout(120)
def test_a_device_of_the_steady_peak_plus_ten_percent_trains_from_step_one() -> None:
    """Before, the first backward held every whole gradient chunk until its end and the
    recording cycle kept no chunk it did not use that moment: at this capacity the first
    iteration spilled parameters and gradients to the host (4.8 MB here) and fetched them
    back. Now it reduces as gradients come and keeps what fits, like every later one."""
    roomy = run_threads(first_iteration, 2, None, timeout_s=20)
    steady = max(max(r["peaks"][1:]) for r in roomy)
    capacity = int(1.1 * steady)
    tight = run_threads(first_iteration, 2, capacity, timeout_s=20)
    for rank, result in enumerate(tight):
        assert max(result["peaks"]) <= capacity, rank
        assert result["peaks"][0] <= 1.1 * steady, rank
        assert result["to_host"] == [0, 0, 0, 0], f"rank {rank} spilled: {result['to_host']}"
        assert result["losses"] == roomy[rank]["losses"], "placement never changes a value"


def branch_engine(comm, stage: int, **config):
    """An engine on :class:`Branchy`, its parameters the same on every rank."""
    with one_rank_at_a_time(comm):
        torch.manual_seed(0)
        model = Branchy()
    return chunkmem.initialize(
        model,
        comm=comm,
        config={
            "device": {"type": "simulated", "capacity": "16MiB"},
            "chunk": {"size": 256},
            "optimizer": {"lr": 1e-2},
            "zero": {"stage": stage, "timeout_s": 10},
            **config,
        },
    )


def branch_rank(comm, stage: int, clipping: float = 0.0) -> dict:
    """A unit whose second layer only rank 0's batch uses (data decides the branch): its
    gradients exist on one rank only, from the first iteration on. The state, each step's
    norm and each step's all-reduce calls (the ledger's)."""
    engine = branch_engine(comm, stage, gradient_clipping=clipping)
    norms = []
    for x, y in branch_batches()[comm.rank]:
        engine.backward(engine(x, y, comm.rank == 0))
        engine.step()
        norms.append(engine.last_grad_norm)
    ledger = engine.states.sharding.comm.ledger
    step_all_reduces = [
        ledger.by_phase(tag).get(("all_reduce", "step"), {}).get("calls", 0)
        for tag in range(len(norms))
    ]
    return {"state": engine.state_dict(), "norms": norms, "step_all_reduces": step_all_reduces}


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.branch = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return torch.nn.functional.mse_loss(self.head(h), y)


def branch_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(11)
    return [
        [(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator))
         for _ in range(4)]
        for _rank in range(2)
    ]  # fmt: skip


def branch_reference(clipping: float = 0.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Two ranks' gradients summed (rank 1 gives none to the branch), AdamW dividing by 2; a
    parameter counts as having a gradient if any rank gave one. With ``clipping``, the
    average is clipped by ``clip_grad_norm_`` first. The parameters and each step's norm."""
    torch.manual_seed(0)
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    data = branch_batches()
    norms = []
    for step in range(4):
        grads: dict[str, torch.Tensor] = {}
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            x, y = data[rank][step]
            model(x, y, rank == 0).backward()
            for name, param in model.named_parameters():
                if param.grad is not None:
                    grads[name] = grads[name] + param.grad if name in grads else param.grad.clone()
        for name, param in model.named_parameters():
            param.grad = grads.get(name)
        if clipping:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad /= 2
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)))
        else:
            optimizer.grad_scale = torch.tensor(2.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, norms


@pytest.mark.parametrize("stage", [2, 3])
def test_a_branch_one_rank_does_not_take_stays_in_step_bit_for_bit(stage: int) -> None:
    """The branch's layout is complete on rank 0 when its gradients arrive and settled with
    zeros by rank 1's end of backward; both issue the same reductions in the same order."""
    expected, _norms = branch_reference()
    for rank, result in enumerate(run_threads(branch_rank, 2, stage)):
        state = result["state"]
        differ = [name for name, value in expected.items() if not torch.equal(state[name], value)]
        assert differ == [], f"rank {rank}: {differ}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_agrees_on_presence_and_the_norm_in_one_all_reduce(stage: int) -> None:
    """Rank 1 computes no gradient for the branch, yet owns part of its shard: its norm
    reads that part (the branch's gradients from rank 0) before the ranks agree that the
    branch has a gradient, since both ride on the one all-reduce a step sends. Clipping
    fires every step, so a norm that missed it would clip differently."""
    expected, expected_norms = branch_reference(clipping=0.05)
    assert min(expected_norms) > 0.05, "clipping fires"
    for rank, result in enumerate(run_threads(branch_rank, 2, stage, 0.05)):
        assert result["step_all_reduces"] == [1, 1, 1, 1], f"rank {rank}"
        assert result["norms"] == pytest.approx(expected_norms, rel=1e-6), f"rank {rank}"
        for name, value in expected.items():
            torch.testing.assert_close(
                result["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )


def error_feedback_rank(comm) -> dict:
    """1-bit with error feedback at stage 2: rank 0 takes the branch in the first two steps,
    no rank in the last two. Per step, this rank's squared sums of its reduced gradient shard
    (read before the step) over the parameters some rank gave a gradient and over the
    branch, and the engine's norm."""
    engine = branch_engine(
        comm, 2, gradient_clipping=0.05, compression={"type": "onebit", "warmup_steps": 1}
    )
    present, branch, norms = [], [], []
    for step, (x, y) in enumerate(branch_batches()[comm.rank]):
        takes_branch = comm.rank == 0 and step < 2
        engine.backward(engine(x, y, takes_branch))
        sums = {"present": 0.0, "branch": 0.0}
        for layout in engine.params.trainable_layouts():
            shard = layout.chunks[GRAD_SHARD]
            span = engine.states.state_span(layout)
            for slot, lo, hi in owned_pieces(layout, span, with_grads_only=False):
                square = float(shard.span(slot, lo, hi).double().square().sum())
                in_branch = slot.name.startswith("branch.")
                sums["branch" if in_branch else "present"] += square
                if in_branch and step < 2:
                    sums["present"] += square
        engine.step()
        present.append(sums["present"])
        branch.append(sums["branch"])
        norms.append(engine.last_grad_norm)
    return {"present": present, "branch": branch, "norms": norms}


def test_the_norm_counts_only_parameters_the_update_steps_under_error_feedback() -> None:
    """A parameter no rank gave a gradient is skipped by the update, but 1-bit's error
    feedback still sends its residual, so its reduced shard is not zero: the norm (and so
    clipping) counts the parameters some rank gave a gradient, as the update does."""
    ranks = run_threads(error_feedback_rank, 2)
    branch_left = [sum(r["branch"][step] for r in ranks) for step in (2, 3)]
    assert min(branch_left) > 0, "the residual reaches the unused branch's shard"
    for step in range(4):
        expected = math.sqrt(sum(r["present"][step] for r in ranks)) / 2
        for rank, result in enumerate(ranks):
            assert result["norms"][step] == pytest.approx(expected, rel=1e-5), (rank, step)


def carried_gathers(comm) -> dict:
    """Stage 3, 4 steps: which layouts hold a gathered copy between steps, and where the first
    moment's gather was issued (the ledger's calls per phase tag)."""
    engine = new_engine(comm, 3)
    rows = global_batches(comm.size, 4)[:, comm.rank * LOCAL_BATCH : (comm.rank + 1) * LOCAL_BATCH]
    held = []
    for row in rows:
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()
        held.append(
            sorted(c.layout.index for c in engine.residency.chunks.values()
                   if c.kind is GATHERED and c.payload is not None)
        )  # fmt: skip
    ledger = engine.states.sharding.comm.ledger
    gathers = [
        ledger.by_phase(tag).get(("all_gather", "fwd"), {}).get("calls", 0) for tag in range(4)
    ]
    engine.state_dict()  # a save between steps reads shards, not the copy
    engine.gatherer.end_cycle()  # what a checkpoint load does after restoring the shards
    dropped = [
        c for c in engine.residency.chunks.values() if c.kind is GATHERED and c.payload is not None
    ]
    return {"held": held, "gathers": gathers, "left_after_load": len(dropped)}


def test_stage3_gathers_the_first_layout_in_the_step_for_the_next_forward() -> None:
    """From the second step on (the trace replaying), the step gathers the layout the first
    moment computes on after updating it; a step's forward gathers as often as before (one of
    them now in the step before), and a checkpoint load drops the copy. The values: the
    stage-3 tests against one process above."""
    results = run_threads(carried_gathers, 2, timeout_s=30)
    for result in results:
        assert result["held"][0] == []  # recording: nothing carried
        assert all(len(held) == 1 for held in result["held"][1:]), result["held"]
        # Step 1's forward gathered everything itself and its step one more; later steps
        # gather that one in the step before, as many in all.
        first, *steady = result["gathers"][1:]
        assert steady == [first - 1] * len(steady), result["gathers"]
        assert result["left_after_load"] == 0
