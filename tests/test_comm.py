"""The communication layer: exact collectives, the volume ledger, validation, dead and hung ranks."""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chunkmem.errors import ChunkmemError
from tests.distributed_helpers import run_ranks
from zero.comm import CollectiveError, Communicator, Group, Handle, init_world, padded_numel
from zero.process_group import LAUNCH_ENV
from zero.ring import DIRECT_ALL_REDUCE_MAX_BYTES, host_all_reduce_path

DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)
SHARD = 3  # elements per rank: odd, so no slot boundary is a power of two


def _pattern(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent small integers: exact in every dtype here, and sums of 4 ranks fit int8."""
    values = (torch.arange(numel) * 3 + 7 * rank) % 31
    return (values - 15 if dtype.is_signed else values).to(dtype)


def _reduced(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([t.long() for t in inputs])
    reduced = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    return reduced.to(inputs[0].dtype)


def _check_collectives(comm: Communicator, group: Group) -> None:
    """Every collective on ``group``, sync and async, compared with its exact expected result."""
    n, size, me = SHARD, group.size, group.rank
    for dtype in DTYPES:
        everyone = torch.cat([_pattern(i, n, dtype) for i in range(size)])
        inputs = [_pattern(i, n * size, dtype) for i in range(size)]
        what = f"{dtype} on {group.name}"

        full = torch.empty(n * size, dtype=dtype)
        comm.all_gather(_pattern(me, n, dtype), full, group=group)
        assert torch.equal(full, everyone), f"all_gather {what}"
        shard = torch.empty(n, dtype=dtype)
        comm.reduce_scatter(inputs[me].clone(), shard, group=group)
        assert torch.equal(shard, _reduced("sum", inputs)[me * n : (me + 1) * n]), (
            f"reduce_scatter {what}"
        )
        for op in ("sum", "max", "min"):
            tensor = _pattern(me, n, dtype)
            comm.all_reduce(tensor, op=op, group=group)
            expected = _reduced(op, [_pattern(i, n, dtype) for i in range(size)])
            assert torch.equal(tensor, expected), f"all_reduce {op} {what}"

        # Async: three collectives in flight at once, waited for in reverse order.
        full, shard, tensor = (
            torch.empty(n * size, dtype=dtype),
            torch.empty(n, dtype=dtype),
            _pattern(me, n, dtype),
        )
        handles: list[Handle] = [
            comm.all_gather(_pattern(me, n, dtype), full, group=group, async_op=True),
            comm.reduce_scatter(inputs[me].clone(), shard, group=group, async_op=True),
            comm.all_reduce(tensor, op="max", group=group, async_op=True),
        ]
        for handle in reversed(handles):
            handle.wait()
            assert handle.is_completed()
        assert torch.equal(full, everyone), f"async all_gather {what}"
        assert torch.equal(shard, _reduced("sum", inputs)[me * n : (me + 1) * n]), what
        assert torch.equal(tensor, _reduced("max", [_pattern(i, n, dtype) for i in range(size)]))

        # In place: the shard is this rank's slot of the output, as ZeRO-3 gathers parameters.
        full = torch.zeros(n * size, dtype=dtype)
        full[me * n : (me + 1) * n] = _pattern(me, n, dtype)
        comm.all_gather(full[me * n : (me + 1) * n], full, group=group)
        assert torch.equal(full, everyone), f"in-place all_gather {what}"

    # A uint8 view carries any dtype bit for bit (how fp8 or packed int4 would travel).
    bf16 = torch.cat([_pattern(i, n, torch.bfloat16) for i in range(size)]) / 7
    full = torch.empty(2 * n * size, dtype=torch.uint8)
    comm.all_gather(bf16[me * n : (me + 1) * n].view(torch.uint8), full, group=group)
    assert torch.equal(full.view(torch.bfloat16), bf16)

    tensor = _pattern(me, n, torch.float32)
    comm.broadcast(tensor, src=size - 1, group=group)
    assert torch.equal(tensor, _pattern(size - 1, n, torch.float32)), "broadcast"
    gathered = comm.all_gather_object({"global": comm.rank, "pad": "x" * me}, group=group)
    assert gathered == [{"global": group.ranks[i], "pad": "x" * i} for i in range(size)]
    comm.barrier(group=group)

    with pytest.raises(ValueError, match=rf"= {n} \* {size} = {n * size} elements, got 99"):
        comm.all_gather(torch.zeros(n), torch.zeros(99), group=group)


def _collectives_on_world(comm: Communicator) -> None:
    _check_collectives(comm, comm.world)


def _collectives_on_world_and_pairs(comm: Communicator) -> None:
    pairs = [comm.new_group("pair0", [0, 1]), comm.new_group("pair1", [2, 3])]
    mine, other = pairs[comm.rank // 2], pairs[1 - comm.rank // 2]
    assert (mine.rank, mine.size, other.rank) == (comm.rank % 2, 2, -1)
    # torch numbers group ranks by global rank; [1, 0] would silently swap them.
    with pytest.raises(ValueError, match=r"ranks \[1, 0\] must be distinct and increasing"):
        comm.new_group("backwards", [1, 0])
    _check_collectives(comm, comm.world)
    _check_collectives(comm, mine)  # broadcast src=1 in pair1 is global rank 3
    with pytest.raises(
        ValueError, match=rf"rank {comm.rank} is not a member of group '{other.name}'"
    ):
        comm.barrier(group=other)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_collectives_are_exact_on_two_ranks() -> None:
    assert run_ranks(_collectives_on_world, 2) == [None, None]


def _collectives_on_gloo_builtins(comm: Communicator) -> None:
    comm.transport.rings = False  # the transport switch zero.transport: builtin
    _check_collectives(comm, comm.world)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_collectives_are_exact_on_gloos_own_collectives_too() -> None:
    assert run_ranks(_collectives_on_gloo_builtins, 2) == [None, None]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_collectives_are_exact_on_four_ranks_and_on_two_rank_subgroups() -> None:
    assert run_ranks(_collectives_on_world_and_pairs, 4) == [None] * 4


@pytest.mark.parametrize(
    ("size", "direct_up_to_bytes"),
    [(2, 1024 * 1024), (4, 128 * 1024), (8, 37448), (16, 16 * 1024), (64, 16 * 1024)],
)
def test_an_all_reduce_is_direct_while_its_extra_bytes_fit_the_budget(
    size: int, direct_up_to_bytes: int
) -> None:
    """(n-1)(n-2)/n x the bytes beyond a ring, at most 192 KiB; always up to 16 KiB, never
    above 1 MiB; above it a float sum that splits evenly is a ring, the rest the builtin."""
    at = torch.empty(direct_up_to_bytes, dtype=torch.uint8).view(torch.float32)
    above = torch.empty((direct_up_to_bytes // 4 // size + 1) * size, dtype=torch.float32)
    assert host_all_reduce_path(at, "max", size) == "direct"
    assert host_all_reduce_path(above, "sum", size) == "ring"
    assert host_all_reduce_path(above, "max", size) == "builtin"
    assert host_all_reduce_path(above[:-1], "sum", size) == "builtin"  # uneven
    assert host_all_reduce_path(torch.zeros(4, dtype=torch.bool), "max", size) == "builtin"
    assert host_all_reduce_path(at, "sum", 1) == "builtin"


def _all_reduce_paths(comm: Communicator) -> list[tuple[str, int]]:
    """Which way each all-reduce travelled (counted by wrapping the two classes): large host
    sums as rings, small ones of any op as one direct exchange, the rest as gloo's builtin;
    two rings in flight at once, waited for in reverse order; exact and alike on every rank."""
    import zero.torch_transport as transport

    launched: list[tuple[str, int]] = []
    originals = {"ring": transport.RingAllReduceWork, "direct": transport.DirectAllReduceWork}

    def counted(kind: str):
        def launch(tensor: torch.Tensor, *args: object) -> object:
            launched.append((kind, tensor.numel()))
            return originals[kind](tensor, *args)

        return launch

    transport.RingAllReduceWork = counted("ring")  # type: ignore[assignment,misc]
    transport.DirectAllReduceWork = counted("direct")  # type: ignore[assignment,misc]
    try:
        size, me = comm.size, comm.rank
        numel = DIRECT_ALL_REDUCE_MAX_BYTES // 4 * 2  # a multiple of 2 and 4, never direct
        exact = _pattern(me, numel, torch.float32)
        noisy = torch.randn(numel, generator=torch.Generator().manual_seed(me))
        uneven = _pattern(me, numel + 1, torch.float32)
        handles = [
            comm.all_reduce(exact, async_op=True),
            comm.all_reduce(noisy, async_op=True),
        ]
        for handle in reversed(handles):
            handle.wait()
        comm.all_reduce(uneven)
        largest = _pattern(me, numel, torch.float32)
        comm.all_reduce(largest, op="max")
        norm = torch.tensor([float(me) + 0.5])
        comm.all_reduce(norm)
        flags = torch.tensor([me, -me], dtype=torch.int64)
        comm.all_reduce(flags, op="min")
        assert torch.equal(
            exact, _reduced("sum", [_pattern(i, numel, torch.float32) for i in range(size)])
        )
        assert torch.equal(
            uneven, _reduced("sum", [_pattern(i, numel + 1, torch.float32) for i in range(size)])
        )
        assert torch.equal(
            largest, _reduced("max", [_pattern(i, numel, torch.float32) for i in range(size)])
        )
        assert norm.item() == sum(i + 0.5 for i in range(size))
        assert flags.tolist() == [0, -(size - 1)]
        inputs = [
            torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(size)
        ]
        assert torch.allclose(noisy, sum(inputs), atol=1e-5)
        # every rank holds the same bits, not just close values
        everyone = torch.empty(numel * size)
        comm.all_gather(noisy, everyone)
        assert all(torch.equal(part, noisy) for part in everyone.view(size, numel))
    finally:
        transport.RingAllReduceWork = originals["ring"]  # type: ignore[misc]
        transport.DirectAllReduceWork = originals["direct"]  # type: ignore[misc]
    return launched


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_all_reduces_travel_as_rings_or_one_exchange_exactly_and_alike(world: int) -> None:
    numel = DIRECT_ALL_REDUCE_MAX_BYTES // 4 * 2
    paths = [("ring", numel), ("ring", numel), ("direct", 1), ("direct", 2)]
    assert run_ranks(_all_reduce_paths, world) == [paths] * world


def _issue_one_step_of_each(comm: Communicator) -> tuple[int, list, dict]:
    pair = [comm.new_group("pair0", [0, 1]), comm.new_group("pair1", [2, 3])][comm.rank // 2]
    comm.tag = 1
    handle = comm.all_gather(torch.zeros(3), torch.zeros(12), async_op=True)
    recorded_at_launch = len(comm.ledger.records)
    handle.wait()
    comm.reduce_scatter(torch.zeros(12), torch.zeros(3))
    comm.all_reduce(torch.zeros(12))
    comm.all_reduce(torch.zeros(5))
    comm.broadcast(torch.zeros(12), src=0)
    comm.all_gather(
        torch.zeros(6, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.bfloat16), group=pair
    )
    comm.all_reduce(torch.zeros(12, dtype=torch.bfloat16), group=pair)
    comm.all_gather_object("x" * 10)
    comm.barrier()
    comm.tag = 2
    comm.all_gather(torch.zeros(3), torch.zeros(12))
    ledger = comm.ledger
    sums = {
        "all_reduce world step 1": ledger.elements_sent(op="all_reduce", group="world", tag=1),
        "step 2": ledger.elements_sent(tag=2),
        "all_gather bytes": ledger.bytes_sent(op="all_gather"),
        "pair": ledger.elements_sent(group=pair.name),
    }
    return recorded_at_launch, ledger.records, {"sums": sums, "totals": ledger.totals()}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ledger_records_ring_volume_per_rank_and_separates_steps_by_tag() -> None:
    results = run_ranks(_issue_one_step_of_each, 4)
    header = 8 + len(pickle.dumps("x" * 10))  # int64 length + pickle, per rank
    for rank, (recorded_at_launch, records, summary) in enumerate(results):
        pair = "pair0" if rank < 2 else "pair1"
        root = 12 if rank == 0 else 0
        assert recorded_at_launch == 1, "an async collective is recorded when it is launched"
        # numel * (n-1)/n for gathers; a small all_reduce is one direct exchange, (n-1) * numel
        # (on 2 ranks as much as the ring's 2 * numel * (n-1)/n); numel from the broadcast root.
        assert [
            (r.op, r.group, r.numel, r.elements_sent, r.bytes_sent, r.dtype, r.tag) for r in records
        ] == [
            ("all_gather", "world", 12, 9, 36, "float32", 1),
            ("reduce_scatter", "world", 12, 9, 36, "float32", 1),
            ("all_reduce", "world", 12, 36, 144, "float32", 1),
            ("all_reduce", "world", 5, 15, 60, "float32", 1),
            ("broadcast", "world", 12, root, 4 * root, "float32", 1),
            ("all_gather", pair, 12, 6, 12, "bfloat16", 1),
            ("all_reduce", pair, 12, 12, 24, "bfloat16", 1),
            ("all_gather_object", "world", 4 * header, 3 * header, 3 * header, "uint8", 1),
            ("barrier", "world", 0, 0, 0, "", 1),
            ("all_gather", "world", 12, 9, 36, "float32", 2),
        ], f"rank {rank}"
        assert summary["sums"] == {
            "all_reduce world step 1": 51,
            "step 2": 9,
            "all_gather bytes": 36 + 12 + 36,
            "pair": 18,
        }
        totals = summary["totals"]
        assert totals[("all_gather", "world")] == {
            "calls": 2,
            "elements_sent": 18,
            "bytes_sent": 72,
        }
        assert totals[("broadcast", "world")] == {
            "calls": 1,
            "elements_sent": root,
            "bytes_sent": 4 * root,
        }
        assert len(totals) == 8


def _die_during_an_all_gather(
    comm: Communicator, ready_dir: str
) -> tuple[CollectiveError | None, float]:
    # Rank 1 dies once every survivor is past setup: dying while a peer still connects the
    # Communicator's diagnosis group would fail that peer's setup, not its all_gather.
    survivors = comm.size - 1
    if comm.rank == 1:
        end = time.monotonic() + 30.0
        while len(list(Path(ready_dir).iterdir())) < survivors and time.monotonic() < end:
            time.sleep(0.02)
        time.sleep(0.2)  # the survivors are inside the all_gather by now
        os._exit(1)
    (Path(ready_dir) / str(comm.rank)).touch()
    start = time.monotonic()
    try:
        comm.all_gather(torch.ones(4), torch.empty(4 * comm.size), async_op=True).wait()
    except CollectiveError as error:
        return error, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_dead_rank_makes_every_survivor_raise_within_the_timeout(tmp_path: Path) -> None:
    timeout_s = 3.0
    results = run_ranks(
        _die_during_an_all_gather, 4, str(tmp_path), timeout_s=timeout_s, dying_ranks=[1]
    )
    assert results[1] is None
    for rank in (0, 2, 3):
        error, elapsed_s = results[rank]
        assert isinstance(error, CollectiveError), f"rank {rank} completed the all_gather"
        assert (error.op, error.group, error.ranks) == ("all_gather", "world", (0, 1, 2, 3))
        assert str(error).startswith(
            "all_gather on group 'world' (ranks [0, 1, 2, 3]) failed after"
        )
        assert "A peer rank may have died or hung" in str(error)
        assert elapsed_s < timeout_s + 3.0, f"rank {rank} took {elapsed_s:.1f} s"


def _hang_in_rank_one(comm: Communicator, released: str) -> tuple[CollectiveError | None, float]:
    if comm.rank == 1:  # alive, but never joins; waits until rank 0 has given up
        end = time.monotonic() + 30.0
        while not Path(released).exists() and time.monotonic() < end:
            time.sleep(0.02)
        return None, 0.0
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), op="max")
    except CollectiveError as error:
        return error, time.monotonic() - start
    finally:
        Path(released).touch()
    return None, time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_hung_rank_makes_the_others_raise_at_the_timeout(tmp_path: Path) -> None:
    timeout_s = 2.0
    results = run_ranks(_hang_in_rank_one, 2, str(tmp_path / "released"), timeout_s=timeout_s)
    error, elapsed_s = results[0]
    assert isinstance(error, CollectiveError), "rank 0 completed an all_reduce rank 1 never joined"
    assert (error.op, error.group) == ("all_reduce", "world")
    assert timeout_s * 0.9 <= elapsed_s < timeout_s + 3.0, f"raised after {elapsed_s:.1f} s"


def _raise_on_rank_one(comm: Communicator) -> int:
    if comm.rank == 1:
        raise RuntimeError("boom on rank 1")
    return comm.rank


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_run_ranks_fails_with_the_failing_ranks_traceback() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 raised:\n(.|\n)*boom on rank 1") as failure:
        run_ranks(_raise_on_rank_one, 2)
    assert "rank 0" not in str(failure.value)


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchrun's environment for a world of one process; destroys the world afterwards."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def solo(launch_env: None) -> Communicator:
    return Communicator(init_world(backend="gloo", timeout_s=10.0))


def test_init_world_without_a_launch_environment_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(ChunkmemError, match="none of them set") as error:
        init_world()
    assert "torchrun --nproc-per-node" in str(error.value)
    assert "torch.distributed.init_process_group" in str(error.value)


def test_init_world_with_a_partial_environment_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(
        ChunkmemError, match=r"only RANK, WORLD_SIZE set \(missing MASTER_ADDR, MASTER_PORT\)"
    ):
        init_world()


def test_init_world_runs_a_world_of_one_from_the_launch_environment(launch_env: None) -> None:
    world = init_world(timeout_s=7.0)  # backend "auto": NCCL where CUDA is, else gloo
    assert world == Group("world", (0,), dist.group.WORLD, rank=0, size=1, timeout_s=7.0)
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert init_world(timeout_s=7.0) == world, "an initialized world is wrapped, not re-created"
    comm = Communicator(world)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full, tensor = torch.zeros(4, device=device), torch.arange(4.0, device=device)
    comm.all_gather(tensor, full)
    assert torch.equal(full, tensor)
    comm.all_reduce(full)
    assert torch.equal(full, tensor)
    comm.broadcast(tensor, src=0)
    assert comm.all_gather_object("only") == ["only"]
    comm.barrier()
    assert comm.ledger.elements_sent() == 0, "a group of one sends nothing"
    assert [r.op for r in comm.ledger.records] == [
        "all_gather",
        "all_reduce",
        "broadcast",
        "all_gather_object",
        "barrier",
    ]


F8 = torch.float8_e4m3fn
REFUSED = {
    "non-contiguous": (
        lambda c: c.all_gather(torch.zeros(8)[::2], torch.zeros(4)),
        ValueError,
        r"all_gather: shard must be contiguous, got stride \(2,\)",
    ),
    "stacked output": (
        lambda c: c.all_gather(torch.zeros(4), torch.zeros(1, 4)),
        ValueError,
        r"all_gather: full must be a flat 1-D buffer .* got shape \(1, 4\)",
    ),
    "size mismatch": (
        lambda c: c.reduce_scatter(torch.zeros(5), torch.zeros(4)),
        ValueError,
        r"reduce_scatter: full must have .* = 4 \* 1 = 4 elements, got 5",
    ),
    "dtype mismatch": (
        lambda c: c.all_gather(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)),
        TypeError,
        r"full has dtype torch.float32 but shard has torch.bfloat16",
    ),
    "device mismatch": (
        lambda c: c.all_gather(torch.zeros(4, device="meta"), torch.zeros(4)),
        ValueError,
        r"full is on cpu but shard is on meta",
    ),
    "not a tensor": (
        lambda c: c.all_gather([0.0] * 4, torch.zeros(4)),
        TypeError,
        r"shard must be a torch.Tensor, got list",
    ),
    "2-D all_reduce": (lambda c: c.all_reduce(torch.zeros(2, 2)), ValueError, r"shape \(2, 2\)"),
    "0-D all_reduce": (lambda c: c.all_reduce(torch.tensor(1.0)), ValueError, r"shape \(\)"),
    "average": (
        lambda c: c.all_reduce(torch.zeros(4), op="avg"),
        ValueError,
        r"op must be one of \['max', 'min', 'sum'\], got 'avg'; to average, sum and divide",
    ),
    "broadcast src outside the group": (
        lambda c: c.broadcast(torch.zeros(4), src=1),
        ValueError,
        r"src=1 is not a rank of group 'world' \(ranks \[0\]\)",
    ),
    "fp8 on gloo": (
        lambda c: c.all_gather(torch.zeros(4, dtype=F8), torch.zeros(4, dtype=F8)),
        TypeError,
        r"gloo cannot send; pass shard.view\(torch.uint8\)",
    ),
    "group by name": (
        lambda c: c.barrier(group="world"),
        TypeError,
        r"group must be a Group or None, got str",
    ),
    "duplicate group name": (
        lambda c: c.new_group("world", [0]),
        ValueError,
        r"a group named 'world' exists already",
    ),
    "rank outside the world": (
        lambda c: c.new_group("pair", [0, 1]),
        ValueError,
        r"ranks \[0, 1\] must lie in \[0, 1\)",
    ),
    "empty group": (lambda c: c.new_group("none", []), ValueError, r"needs at least one rank"),
}


@pytest.mark.parametrize(("call", "error", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_wrong_input_is_refused_before_anything_is_sent(
    solo: Communicator, call, error, message
) -> None:
    with pytest.raises(error, match=message):
        call(solo)
    assert not solo.ledger.records, "a refused call must not be recorded"


def test_new_group_on_a_world_of_one(solo: Communicator) -> None:
    with pytest.raises(ValueError, match=r"ranks \[0, 0\] must be distinct and increasing"):
        solo.new_group("twice", [0, 0])
    alone = solo.new_group("alone", [0])
    assert (alone.name, alone.ranks, alone.rank, alone.size, alone.timeout_s) == (
        "alone",
        (0,),
        0,
        1,
        10.0,
    )
    assert alone.is_member and alone.process_group is not dist.group.WORLD


def test_collective_error_names_op_group_cause_and_crosses_processes() -> None:
    error = CollectiveError("all_gather", "world", (0, 1), 5.04, 5.0, "Connection reset by peer")
    assert str(error).startswith(
        "all_gather on group 'world' (ranks [0, 1]) failed after 5.0 s: Connection reset by peer. "
        "A peer rank may have died or hung"
    )
    assert "stop training rather than retry" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.op, copy.group, copy.ranks, copy.cause, str(copy)) == (
        "all_gather",
        "world",
        (0, 1),
        "Connection reset by peer",
        str(error),
    )
    assert isinstance(error, ChunkmemError) and isinstance(error, RuntimeError)


@pytest.mark.parametrize(
    ("numel", "multiple", "padded"),
    [(0, 4, 0), (1, 4, 4), (8, 4, 8), (9, 4, 12), (5, 1, 5), (7, 3, 9)],
)
def test_padded_numel_rounds_up_to_the_multiple(numel: int, multiple: int, padded: int) -> None:
    assert padded_numel(numel, multiple) == padded


def test_padded_numel_refuses_negative_sizes_and_zero_multiples() -> None:
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        padded_numel(-1, 4)
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        padded_numel(4, 0)


class _SlowStep:
    """A point-to-point exchange that takes ``seconds`` to arrive, as gloo's Work waits."""

    def __init__(self, seconds: float) -> None:
        self._done_at = time.monotonic() + seconds

    def wait(self, timeout) -> bool:
        left = self._done_at - time.monotonic()
        if left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Timed out waiting for the exchange")
        time.sleep(max(left, 0.0))
        return True


def test_a_ring_wait_has_one_timeout_for_all_its_steps(monkeypatch) -> None:
    """Three steps of 0.4 s each fit one 1 s timeout per step, but not 1 s in total: a peer
    dying mid-ring must not stretch the wait to a timeout per step."""
    from datetime import timedelta

    from zero.ring import RingWork

    monkeypatch.setattr(RingWork, "_launch_step", lambda self: [_SlowStep(0.4)])
    full, shard = torch.zeros(8), torch.zeros(2)
    ring = RingWork(full, shard, (0, 1, 2, 3), 0, None, reduce=False, tag=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="step 3 of 3|Timed out"):
        ring.wait(timedelta(seconds=1.0))
    # The raise shows the single deadline (a timeout per step lets all three 0.4 s steps
    # finish); this bound catches a wait that overran it, with room for a loaded machine.
    assert time.monotonic() - start < 1.8


class _DoneStep:
    def wait(self, timeout) -> bool:
        return True


def test_receive_buffers_are_reused_by_shape_and_kept_few() -> None:
    from zero.ring import ReceiveBuffers

    pool = ReceiveBuffers()
    first = pool.take(torch.zeros(5))
    pool.give_back(first)
    assert pool.take(torch.zeros(5)) is first
    assert pool.take(torch.zeros(5)) is not first, "handed out once, not twice"
    assert pool.take(torch.zeros(5, dtype=torch.bfloat16)).dtype == torch.bfloat16
    many = [pool.take(torch.zeros(3)) for _ in range(6)]
    for buffer in many:
        pool.give_back(buffer)
    again = [pool.take(torch.zeros(3)) for _ in range(6)]
    kept = {id(b) for b in many}
    assert sum(id(b) in kept for b in again) == ReceiveBuffers.KEEP_PER_SHAPE


def test_a_finished_reduce_scatter_ring_hands_its_receive_buffer_to_the_next(
    monkeypatch,
) -> None:
    """[Note: reusing receive buffers] in zero/ring.py: one buffer serves consecutive rings of
    a shape; a ring that failed keeps its own (a receive may still write into it)."""
    from datetime import timedelta

    from zero import ring as ring_module

    pool = ring_module.ReceiveBuffers()
    monkeypatch.setattr(ring_module, "RECEIVE_BUFFERS", pool)
    monkeypatch.setattr(ring_module.RingWork, "_launch_step", lambda self: [_DoneStep()])
    full, shard = torch.arange(8.0), torch.zeros(4)
    first = ring_module.RingWork(full, shard, (0, 1), 0, None, reduce=True, tag=0)
    buffer = first._received
    first.wait(timedelta(seconds=5))
    second = ring_module.RingWork(full, shard, (0, 1), 0, None, reduce=True, tag=1)
    assert second._received is buffer
    second.wait(timedelta(seconds=5))

    monkeypatch.setattr(ring_module.RingWork, "_launch_step", lambda self: [_SlowStep(2.0)])
    failing = ring_module.RingWork(full, shard, (0, 1), 0, None, reduce=True, tag=2)
    assert failing._received is buffer
    with pytest.raises(RuntimeError):
        failing.wait(timedelta(seconds=0.1))
    assert pool.take(shard) is not buffer, "a failed ring's buffer is not reused"
