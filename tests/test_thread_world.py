"""The in-process world: every collective exact, the same bits and ledger as gloo, failures named.

These run N ranks as threads of the test process in milliseconds; the spawned-gloo tests of
``tests/test_comm.py`` stay as the integration tests of the real transport.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed_helpers import run_ranks, run_threads
from tests.test_comm import _check_collectives, _collectives_on_world_and_pairs
from zero.collective_failures import AFTER_FAILURE_S
from zero.comm import CollectiveError, Communicator
from zero.thread_world import RanksFailed, ThreadWorld


def _collectives(comm: Communicator) -> None:
    _check_collectives(comm, comm.world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_collective_is_exact_on_the_thread_world(world: int) -> None:
    assert run_threads(_collectives, world) == [None] * world


def test_subgroups_and_non_members_behave_as_on_gloo() -> None:
    assert run_threads(_collectives_on_world_and_pairs, 4) == [None] * 4


def _random_reduce_scatter(comm: Communicator, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(100 + comm.rank)
    full = (torch.randn(8 * comm.size, generator=generator) * 1e3).to(dtype)
    shard = torch.empty(8, dtype=dtype)
    comm.tag = 5
    comm.reduce_scatter(full, shard)
    return shard, comm.ledger.totals()


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_sums_in_the_rings_order_bit_for_bit(dtype: torch.dtype) -> None:
    """At 4 ranks floating-point sums depend on their order: the threads add the ranks in the
    order the gloo ring does, so a gradient reduced in memory equals one reduced over gloo."""
    threads = run_threads(_random_reduce_scatter, 4, dtype)
    gloo = run_ranks(_random_reduce_scatter, 4, dtype)
    for rank in range(4):
        assert torch.equal(threads[rank][0], gloo[rank][0]), rank
        assert threads[rank][1] == gloo[rank][1], "the same ledger"
    # ... and a different order would have changed bits here (so the check can fail).
    fulls = [
        (torch.randn(32, generator=torch.Generator().manual_seed(100 + r)) * 1e3).to(dtype)
        for r in range(4)
    ]
    in_rank_order = fulls[0][:8] + fulls[1][:8] + fulls[2][:8] + fulls[3][:8]
    assert not torch.equal(in_rank_order, threads[0][0])


def _rank_one_returns_early(comm: Communicator) -> tuple[str, float]:
    if comm.rank == 1:
        return "", 0.0
    start = time.monotonic()
    handles = [comm.all_gather(torch.ones(2), torch.empty(2 * comm.size), async_op=True)]
    handles.append(comm.reduce_scatter(torch.ones(2 * comm.size), torch.empty(2), async_op=True))
    messages = []
    for handle in handles:
        with pytest.raises(CollectiveError) as failure:
            handle.wait()
        messages.append(str(failure.value))
    return "\n".join(messages), time.monotonic() - start


def test_a_missing_rank_is_named_and_later_waits_do_not_take_a_second_timeout() -> None:
    timeout_s = 0.5
    results = run_threads(_rank_one_returns_early, 3, timeout_s=timeout_s)
    for rank in (0, 2):
        messages, elapsed_s = results[rank]
        first, second = messages.split("\n")
        assert first.startswith("all_gather on group 'world' (ranks [0, 1, 2]) failed after")
        assert "waiting for group ranks [1]" in first
        assert "rank 1's thread has ended" in first
        assert "after an earlier failure" in second
        assert elapsed_s < timeout_s + 0.3 + 2 * AFTER_FAILURE_S, elapsed_s


def _out_of_step(comm: Communicator) -> None:
    comm.cycle = 7 + comm.rank  # rank 1 believes it is one cycle ahead
    comm.all_reduce(torch.ones(3))


def test_ranks_at_different_collectives_fail_naming_both_sides() -> None:
    with pytest.raises(RanksFailed) as failure:
        run_threads(_out_of_step, 2)
    assert set(failure.value.errors) == {0, 1}
    message = str(failure.value)
    assert "ranks are out of step: rank 0 is at collective #1 of cycle 7" in message
    assert "rank 1 is at collective #1 of cycle 8" in message


def test_a_world_refuses_a_bad_size_and_names_ranks_that_outlive_the_deadline() -> None:
    with pytest.raises(ValueError, match="at least one rank, got size=0"):
        ThreadWorld(0)
    with pytest.raises(RanksFailed, match="rank 0 was still running at the deadline"):
        ThreadWorld(1).run(lambda comm: time.sleep(1.0), deadline_s=0.05)
