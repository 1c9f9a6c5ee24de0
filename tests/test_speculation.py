"""Speculative host updates (offload/speculation.py): with clipping, fp16 or nonfinite: skip,
updates start in backward assuming coefficient 1, no overflow, finite values, and are undone
exactly when that fails. Every step must equal the serial step's, bit for bit, whatever the
outcome: clipping forced on chosen steps, an fp16 overflow, a NaN; in one process and at ZeRO
0, 2 and 3 on 2 ranks (the in-process world), with states on the host and on NVMe."""

from __future__ import annotations

import pytest
import torch

from chunkmem import host_rows
from chunkmem.chunk import Chunk, ChunkKind, ChunkLayout
from chunkmem.errors import EngineUsageError
from chunkmem.pieces import owned_pieces
from offload import speculation, undo_plan
from offload.undo_plan import not_updated
from tests.distributed_helpers import one_rank_at_a_time, run_threads
from tests.offload_helpers import Net, batches, initialize, make_model

DEVICE = {"type": "simulated", "capacity": 500_000}
STEPS = 8
BIG = {2, 5}  # steps whose loss is scaled up: the norm exceeds the clip, clipping fires
POISON = {4}  # steps whose loss is NaN (fp16: an overflow; nonfinite: skip: skipped)


def recipe(kind: str) -> dict:
    """The clip sits above this model's norms (8-13) and below a scaled step's (8e4-9e4)."""
    return {
        "clip": {"precision": "bf16", "gradient_clipping": 100.0},
        "clip_fp32": {"precision": "fp32", "gradient_clipping": 100.0},
        "fp16": {"precision": "fp16", "gradient_clipping": 100.0},
        "skip": {"precision": "bf16", "gradient_clipping": 100.0, "nonfinite": "skip"},
    }[kind]


def offload_for(where: str, overlap: bool, path) -> dict:
    return {"optimizer": where, "overlap": overlap,
            "nvme": {"path": str(path), "block_size": 4096}}  # fmt: skip


def train(engine, data, rows: slice, poison: bool) -> list:
    """Per step: the losses, whether the step was taken, the norm, and the state after it."""
    out = []
    for step, (x, y) in enumerate(data):
        loss = engine(x[rows], y[rows])
        if step in BIG:
            loss = loss * 1e4
        if poison and step in POISON:
            loss = loss * float("nan")
        engine.backward(loss)
        taken = engine.step()
        out.append((float(loss.detach()), taken, engine.last_grad_norm, engine.state_dict()))
    return out


def same_steps(ours: list, theirs: list) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a[1] == b[1], step  # taken or skipped alike
        for x, y in ((a[0], b[0]), (a[2], b[2])):  # losses and norms, NaN alike
            assert x == y or (x != x and y != y), step
        for name, value in b[3].items():
            assert torch.equal(a[3][name], value), (step, name)


@pytest.mark.parametrize("kind", ["clip", "clip_fp32", "fp16", "skip"])
@pytest.mark.parametrize("where", ["host", "nvme"])
def test_speculative_steps_equal_the_serial_steps_bit_for_bit(kind, where, tmp_path) -> None:
    data = batches(STEPS, rows=8)
    poison = not kind.startswith("clip")
    runs, engines = {}, {}
    for overlap in (False, True):
        engine = initialize(
            make_model(),
            device=DEVICE,
            offload=offload_for(where, overlap, tmp_path),
            **recipe(kind),
        )
        runs[overlap] = train(engine, data, slice(None), poison)
        engines[overlap] = engine
    same_steps(runs[True], runs[False])
    speculative = engines[True]
    summary = speculative.run_summary()
    forced = len(BIG) + (len(POISON) if poison else 0)
    assert summary.speculative_rollbacks == forced
    assert summary.speculative_commits == STEPS - 1 - forced  # the first cycle places states
    # Updates really began in backward: two groups a step with states on the host; on NVMe one
    # update is in flight at a time, so how many more start depends on when the host thread
    # finishes the first (the first group of a step always starts: the last step waited).
    per_step = 2 if where == "host" else 1
    assert speculative.reducer.listener.started >= (STEPS - 1 - forced) * per_step
    for engine in engines.values():
        engine.close()


def test_speculation_memory_is_counted_bounded_and_kept_across_steps() -> None:
    """The shadows and copy buffers are taken once and kept (a standing reservation:
    allocating them each step faulted their pages in again, which cost more than a copy)."""
    data = batches(4, rows=8)
    engine = initialize(
        make_model(),
        device=DEVICE,
        offload={"optimizer": "host", "overlap": True, "speculation_bytes": 110_000},  # fmt: skip
        **recipe("clip"),
    )
    host = engine.ledger.tiers["host"]
    held = []
    for x, y in data:
        engine.backward(engine(x, y))
        held.append(host.by_kind.get("speculation", 0))
        engine.step()
        assert host.by_kind.get("speculation", 0) == held[-1], "kept over the step"
    assert held[0] == 0, "the first cycle places the states: nothing speculated"
    assert 0 < held[1] <= 110_000 and held[1:] == [held[1]] * (len(held) - 1), held
    assert held[1] == engine.optimizer.speculation.held_bytes
    roomy = initialize(make_model(), device=DEVICE,
                       offload={"optimizer": "host", "overlap": True}, **recipe("clip"))  # fmt: skip
    for x, y in data:
        roomy.backward(roomy(x, y))
        roomy.step()
    bounded = engine.reducer.listener.started
    assert 0 < bounded < roomy.reducer.listener.started, "the budget held groups back"


def test_a_failed_backward_undoes_speculative_updates_and_the_engine_trains_on() -> None:
    """Before, a backward that had begun updating stopped the engine on any exception."""
    data = batches(6, rows=8)
    runs = {}
    for fail in (False, True):
        engine = initialize(make_model(), device=DEVICE,
                            offload={"optimizer": "host", "overlap": True}, **recipe("clip"))  # fmt: skip
        for step, (x, y) in enumerate(data):
            if fail and step == 3:
                loss = engine(x, y)
                loss.register_hook(lambda grad: grad)  # the backward starts normally
                engine.module.out.weight.register_hook(_raise_late)
                with pytest.raises(RuntimeError, match="late failure"):
                    engine.backward(loss)
                assert engine.optimizer.layouts_updated == 0
                _remove_hooks(engine.module.out.weight)
                continue
            if step == 3:
                continue  # the run without the failure skips the batch too
            engine.backward(engine(x, y))
            engine.step()
        runs[fail] = engine.state_dict()
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name


def test_a_run_that_fails_before_its_copies_is_undone_without_them(tmp_path, monkeypatch) -> None:
    """States homed on NVMe are copied before an early update's kernels. A run that fails
    before it takes those copies overwrote nothing, so the undo must not write back its copy
    buffers (they hold the last step's states): the engine trains on as if the batch were
    skipped."""
    data = batches(6, rows=8)
    take = speculation.Snapshot.take
    runs = {}
    for fail in (False, True):
        engine = initialize(make_model(), device=DEVICE, offload=offload_for("nvme", True, tmp_path / str(fail)),
                            **recipe("clip"))  # fmt: skip
        for step, (x, y) in enumerate(data):
            if step == 3:
                if fail:
                    monkeypatch.setattr(speculation.Snapshot, "take", _failing_take)
                    with pytest.raises(RuntimeError, match="failed before its copies"):
                        engine.backward(engine(x, y))
                        engine.step()
                    monkeypatch.setattr(speculation.Snapshot, "take", take)
                continue  # the run without the failure skips the batch too
            engine.backward(engine(x, y))
            engine.step()
        runs[fail] = engine.state_dict()
        assert engine.optimizer.speculation.rollbacks == int(fail)
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name


def _failing_take(snapshot: speculation.Snapshot) -> None:
    raise RuntimeError("an early update failed before its copies")


class LateBranch(torch.nn.Module):
    """A branch on the input, so backward reaches it last: on a step that takes it (none
    before), its gradient arrives after its layout's expected gradients began the early
    update."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = torch.nn.Linear(16, 16)
        self.first = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.take_branch = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.take_branch:
            x = x + torch.tanh(self.branch(x))
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.first(x))), y)


@pytest.mark.parametrize("kind", ["clip", "skip"])
def test_a_gradient_after_the_early_start_counts_in_the_norm(kind, tmp_path) -> None:
    """The branch's gradient reaches a layout whose update began early; the step updates it
    and the norm measures it, in the serial step's order: norms and states bit for bit."""
    data = batches(6, rows=8)
    runs, engines = {}, {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = LateBranch()
        engine = initialize(
            model, device=DEVICE, offload=offload_for("host", overlap, tmp_path), **recipe(kind)
        )
        out = []
        for step, (x, y) in enumerate(data):
            model.take_branch = step >= 3
            loss = engine(x, y)
            engine.backward(loss)
            taken = engine.step()
            out.append((float(loss.detach()), taken, engine.last_grad_norm, engine.state_dict()))
        runs[overlap], engines[overlap] = out, engine
    assert engines[True].optimizer.speculation.commits > 0, "updates began early"
    same_steps(runs[True], runs[False])


def test_a_groups_plan_is_kept_while_its_pieces_stay_the_same(tmp_path, monkeypatch) -> None:
    """Reserving looks the plan up (the engine's thread walked every piece for it at every
    early start); a group whose pieces change (a branch's parameters get gradients) gets a new
    one, and the steps stay the serial ones (the test above)."""
    made: list[int] = []
    make = undo_plan.Plan.__init__

    def counted(plan: undo_plan.Plan, layout: ChunkLayout, *args: object) -> None:
        made.append(layout.index)
        make(plan, layout, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(undo_plan.Plan, "__init__", counted)
    torch.manual_seed(0)
    model = LateBranch()
    engine = initialize(
        model, device=DEVICE, offload=offload_for("host", True, tmp_path), **recipe("clip")
    )
    for step, (x, y) in enumerate(batches(8, rows=8)):
        model.take_branch = step >= 4
        engine.backward(engine(x, y))
        engine.step()
    started = engine.reducer.listener.started
    assert started > len(made) > 0, (started, made)
    assert len(made) > len(set(made)), f"the branch's gradients changed the pieces: {made}"


def test_a_plan_is_keyed_on_which_slots_hold_their_gradient() -> None:
    """Rounding the masters overwrites a 16-bit slot that holds its gradient, so the plan
    copies those slots first; a slot whose value was needed in backward stops holding its
    gradient with the same pieces, and the kept plan must not stand for it then."""
    engine = initialize(
        make_model(), device=DEVICE, offload={"optimizer": "host", "overlap": True},
        **recipe("clip"),
    )  # fmt: skip
    (x, y), (x2, y2) = batches(2, rows=8)
    engine.backward(engine(x, y))
    engine.step()  # the states placed
    engine.backward(engine(x2, y2))  # the gradients in their 16-bit slots, before the step
    optimizer = engine.optimizer
    layout = optimizer.params.trainable_layouts()[0]
    pieces = owned_pieces(layout, optimizer.states.state_span(layout))
    home = optimizer.states.home(layout)
    shadowed = speculation.Snapshot.shadowed_kinds(layout, home)
    slot = pieces[0][0]
    assert slot.grad_in_param_slot
    holding = undo_plan.Plan(layout, pieces, shadowed, None)
    key = undo_plan.Plan.key(pieces, home, None)
    slot.grad_in_param_slot = False
    try:
        released = undo_plan.Plan(layout, pieces, shadowed, None)
        assert released.copies != holding.copies, "the plan depends on the flag"
        assert undo_plan.Plan.key(pieces, home, None) != key
    finally:
        slot.grad_in_param_slot = True
    engine.step()


def test_a_plans_gradient_saves_are_cut_once_per_copy_buffer() -> None:
    """The kernel saves each 16-bit gradient held in its parameter slot into the plan's copy
    buffer: the views are cut once and handed to every update of the plan, and cut again
    where the buffers change (a group whose copies grew)."""
    engine = initialize(
        make_model(), device=DEVICE, offload={"optimizer": "host", "overlap": True},
        **recipe("clip"),
    )  # fmt: skip
    (x, y), (x2, y2) = batches(2, rows=8)
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x2, y2))  # the gradients in their 16-bit slots, before the step
    optimizer = engine.optimizer
    layout = optimizer.params.trainable_layouts()[0]
    pieces = owned_pieces(layout, optimizer.states.state_span(layout))
    home = optimizer.states.home(layout)
    plan = undo_plan.Plan(layout, pieces, speculation.Snapshot.shadowed_kinds(layout, home), None)
    assert plan.saves_grads
    for _round in range(2):
        copies = {dtype: torch.empty(numel, dtype=dtype) for dtype, numel in plan.copies.items()}
        plan.saved(copies)
        saves = plan.grad_saves()
        assert plan.grad_saves() is saves, "cut once while the buffers stay"
        assert len(saves) == len(pieces)
        buffer = copies[layout.chunks[ChunkKind.PARAM].dtype]
        begin, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
        offset = 0
        for (slot, lo, hi), save in zip(pieces, saves, strict=True):
            assert save is not None and slot.grad_in_param_slot
            assert save.numel() == hi - lo
            assert save.data_ptr() == begin + offset * buffer.element_size() < end
            offset += hi - lo
    engine.step()


def _raise_late(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("late failure in backward")


def _remove_hooks(param: torch.nn.Parameter) -> None:
    param._backward_hooks.clear()


def speculative_rank(comm, stage: int, where: str, kind: str, overlap: bool, path: str) -> list:
    with one_rank_at_a_time(comm):
        model = make_model()
    engine = initialize(
        model,
        comm=comm,
        device={"type": "simulated", "capacity": "8MiB"},
        zero={"stage": stage, "timeout_s": 20},
        offload={
            **offload_for(where, overlap, path),
            "optimizer_threads": 1,
        },  # fmt: skip
        **recipe(kind),
    )
    half = 8 // comm.size
    out = train(engine, batches(STEPS, rows=8), slice(comm.rank * half, (comm.rank + 1) * half),
                poison=kind == "skip")  # fmt: skip
    summary = engine.run_summary()
    engine.close()
    return [out, summary.speculative_rollbacks]


@pytest.mark.parametrize(
    ("stage", "where", "kind"),
    [(2, "host", "skip"), (2, "nvme", "skip"), (3, "host", "skip"), (3, "nvme", "skip"),
     (2, "host", "clip_fp32"), (3, "nvme", "clip_fp32")],
)  # fmt: skip
def test_zero_ranks_speculate_and_roll_back_alike(
    stage: int, where: str, kind: str, tmp_path
) -> None:
    """fp32 under ZeRO: the kernel leaves the gradients divided by the world size where they
    lie, so a rollback must give them back undivided."""
    serial = run_threads(speculative_rank, 2, stage, where, kind, False, str(tmp_path))
    speculative = run_threads(speculative_rank, 2, stage, where, kind, True, str(tmp_path))
    for rank in range(2):
        same_steps(speculative[rank][0], serial[rank][0])
        assert speculative[rank][1] == len(BIG) + (len(POISON) if kind == "skip" else 0), rank


def test_discard_after_a_speculative_backward_undoes_it() -> None:
    engine = initialize(make_model(), device=DEVICE,
                        offload={"optimizer": "host", "overlap": True}, **recipe("clip"))  # fmt: skip
    data = batches(4, rows=8)
    for x, y in data[:2]:
        engine.backward(engine(x, y))
        engine.step()
    before = engine.state_dict()
    x, y = data[2]
    engine.backward(engine(x, y))
    assert engine.optimizer.layouts_updated > 0, "updates began in backward"
    engine.discard()
    after = engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(EngineUsageError, match="needs engine.backward"):
        engine.step()


class Branching(Net):
    """The last hidden layer is left out on odd steps: its slots get no gradient there."""

    def __init__(self) -> None:
        super().__init__()
        self.skip_last = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        layers = self.hidden[:-1] if self.skip_last else self.hidden
        for layer in layers:
            h = h + torch.tanh(layer(h))
        return torch.nn.functional.mse_loss(self.out(h), y)


@pytest.mark.parametrize("kind", ["clip", "clip_fp32"])
def test_updates_out_of_place_keep_slots_without_a_gradient_exact(kind: str, monkeypatch) -> None:
    """Host states are updated out of place and swapped in when the step stands
    (offload/speculation.py): the shadow must carry what the update leaves out (a layer left
    out on odd steps, padding) and alternate with the payload it replaced. Steps equal the
    serial ones bit for bit, clipping forced or not. Padding is copied once per shadow (each
    update writes none of it) and stays equal in both buffers."""
    padding_copies = []

    def counted(chunk: Chunk, pieces: list) -> list:
        padding_copies.append(chunk.kind)
        return not_updated(chunk, pieces)

    monkeypatch.setattr(speculation, "not_updated", counted)
    data = batches(STEPS, rows=8)
    runs, engines, payloads = {}, {}, set()
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Branching()
        engine = initialize(model, device=DEVICE,
                            offload={"optimizer": "host", "overlap": overlap}, **recipe(kind))  # fmt: skip
        out = []
        for step, (x, y) in enumerate(data):
            model.skip_last = step % 2 == 1
            loss = engine(x, y) * (1e4 if step in BIG else 1.0)
            engine.backward(loss)
            engine.step()
            out.append(engine.state_dict())
            if overlap:
                layout = engine.optimizer.params.trainable_layouts()[-1]
                payloads.add(layout.chunks[ChunkKind.EXP_AVG].payload.data_ptr())
        runs[overlap], engines[overlap] = out, engine
    for serial, overlapped in zip(runs[False], runs[True], strict=True):
        assert all(torch.equal(serial[k], overlapped[k]) for k in serial)
    assert len(payloads) == 2, "a committed step swaps the shadow in; the next swaps back"
    speculated = engines[True].optimizer.speculation
    assert speculated.rollbacks == len(BIG)
    shadows = [(index, kind) for index, kept in speculated._kept.items() for kind in kept.shadows]
    assert len(padding_copies) == len(shadows), "padding copied once per shadow, not a step"
    for index, kept in speculated._kept.items():
        layout = engines[True].optimizer.params.layouts[index]
        for kind, shadow in kept.shadows.items():
            chunk = layout.chunks[kind]
            for lo, hi in not_updated(
                chunk, owned_pieces(layout, (chunk.start, chunk.numel), False)
            ):
                assert torch.equal(shadow[lo:hi], chunk.payload[lo:hi])


def test_what_an_update_leaves_out_is_the_complement_of_its_pieces() -> None:
    layout = ChunkLayout(0, capacity=20, trainable=True)
    slots = [layout.add(name, torch.nn.Parameter(torch.zeros(n))) for name, n in
             (("a", 4), ("b", 6), ("c", 5))]  # fmt: skip
    chunk = Chunk(0, layout, ChunkKind.MASTER, torch.float32, start=0, numel=20)
    a, b, c = slots
    assert not_updated(chunk, []) == [(0, 20)]
    assert not_updated(chunk, [(a, 0, 4), (b, 0, 6), (c, 0, 5)]) == [(15, 20)]  # padding
    assert not_updated(chunk, [(a, 0, 4), (c, 1, 5)]) == [(4, 11), (15, 20)]
    shard = Chunk(1, layout, ChunkKind.MASTER, torch.float32, start=10, numel=10)
    assert not_updated(shard, [(c, 0, 5)]) == [(5, 10)]  # a ZeRO shard: its own coordinates


def test_a_layouts_rows_are_built_once_per_set_of_buffers(monkeypatch) -> None:
    """The host calls' rows are kept across updates (chunkmem/host_rows.py): a speculative
    layout alternates between its chunks' payloads and their shadows, and a rollback's serial
    update writes in place over either, so after the first steps every update finds its rows,
    rollbacks included, and the steps stay the serial ones (the test above)."""
    built: list[int] = []
    make = host_rows.HostRows.__init__

    def counted(rows: host_rows.HostRows, kernels, chunks, *args) -> None:  # type: ignore[no-untyped-def]
        built.append(chunks[ChunkKind.MASTER].layout.index)
        make(rows, kernels, chunks, *args)

    monkeypatch.setattr(host_rows.HostRows, "__init__", counted)
    engine = initialize(make_model(), device=DEVICE, offload=offload_for("host", True, ""),
                        **recipe("clip"))  # fmt: skip
    train(engine, batches(STEPS, rows=8), slice(None), poison=False)
    summary = engine.run_summary()
    assert summary.speculative_rollbacks == len(BIG)
    assert summary.speculative_commits > 0
    by_layout = {index: built.count(index) for index in set(built)}
    assert all(count <= host_rows.KEPT_PER_LAYOUT for count in by_layout.values()), by_layout
    settled = len(built)
    train(engine, batches(STEPS, rows=8, seed=4), slice(None), poison=False)
    assert len(built) == settled, "the same buffers built their rows again"
    engine.close()


def test_rows_are_found_by_their_buffers_addresses_and_the_oldest_set_dropped() -> None:
    """Rows are only addresses: the same addresses find them (whichever tensors hold them
    now), a different address builds new ones, and a layout keeps KEPT_PER_LAYOUT sets."""
    cache = host_rows.RowsCache()
    slot = object()
    pieces = [(slot, 0, 4)]
    grads, steps = [torch.zeros(4)], [torch.zeros(())]
    made: list[object] = []

    def build() -> object:
        made.append(object())
        return made[-1]

    buffers = [torch.zeros(4) for _ in range(host_rows.KEPT_PER_LAYOUT + 1)]
    first = cache.rows(0, build, [buffers[0]], pieces, grads, None, steps)  # type: ignore[arg-type]
    alias = buffers[0].view(4)  # another tensor at the same address
    assert cache.rows(0, build, [alias], pieces, grads, None, steps) is first  # type: ignore[arg-type]
    assert cache.rows(1, build, [buffers[0]], pieces, grads, None, steps) is not first  # type: ignore[arg-type]
    saved = [torch.zeros(4)]
    assert cache.rows(0, build, [buffers[0]], pieces, grads, saved, steps) is not first  # type: ignore[arg-type]
    for buffer in buffers[1:]:
        cache.rows(0, build, [buffer], pieces, grads, None, steps)  # type: ignore[arg-type]
    assert len(made) == 3 + len(buffers) - 1
    assert cache.rows(0, build, [buffers[0]], pieces, grads, None, steps) is not first  # type: ignore[arg-type]
    assert cache.rows(0, build, [buffers[-1]], pieces, grads, None, steps) is made[-2]  # type: ignore[arg-type]
