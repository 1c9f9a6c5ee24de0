"""Recording, replaying and re-recording traces."""

from __future__ import annotations

from chunkmem.tracer import Moment, Phase, Tracer

F = Phase.FORWARD


def run_cycle(tracer: Tracer, signature, labels, nonmodel=0) -> list[bool]:
    tracer.begin_cycle(signature)
    replaying = []
    for i, label in enumerate(labels):
        tracer.on_moment(Moment(F, label), nonmodel)
        tracer.on_access(i, True)
        tracer.on_nonmodel(nonmodel + 10 * i)
        replaying.append(tracer.replaying)
    tracer.end_cycle()
    return replaying


def test_first_cycle_records_then_replays() -> None:
    tracer = Tracer()
    assert run_cycle(tracer, "s", "abc") == [False] * 3
    assert run_cycle(tracer, "s", "abc") == [True] * 3
    trace = tracer.traces_for("s")[0]
    assert [m.label for m in trace.moments] == list("abc")
    assert trace.nonmodel_peak == [0, 10, 20]


def test_next_device_use_wraps_to_the_next_cycle() -> None:
    tracer = Tracer()
    run_cycle(tracer, "s", "abcd")
    trace = tracer.traces_for("s")[0]
    assert trace.next_device_use(2, 0) == 2
    assert trace.next_device_use(2, 2) == 0  # needed at this very moment
    assert trace.next_device_use(0, 1) == 3  # next cycle's moment 0: 4 - 1
    assert trace.next_device_use(99, 0) == float("inf")


def test_divergence_stops_replay_and_both_patterns_are_kept() -> None:
    tracer = Tracer()
    run_cycle(tracer, "s", "abc")
    assert run_cycle(tracer, "s", "abxc") == [True, True, False, False]
    assert tracer.divergences == 1
    assert run_cycle(tracer, "s", "abxc") == [True] * 4
    assert run_cycle(tracer, "s", "abc") == [True] * 3, "the older pattern is still known"
    assert tracer.divergences == 1


def test_signatures_have_separate_traces_and_peaks_only_grow() -> None:
    tracer = Tracer()
    run_cycle(tracer, ("train", 16), "ab", nonmodel=100)
    run_cycle(tracer, ("train", 8), "ab", nonmodel=50)
    run_cycle(tracer, ("train", 16), "ab", nonmodel=40)
    assert tracer.traces_for(("train", 16))[0].nonmodel_peak == [100, 110]
    assert tracer.traces_for(("train", 8))[0].nonmodel_peak == [50, 60]


def test_old_signatures_are_forgotten_beyond_the_limit() -> None:
    from chunkmem import tracer as tracer_module

    tracer = Tracer()
    for length in range(tracer_module._SIGNATURES + 5):
        run_cycle(tracer, ("eval", length), "ab")
    run_cycle(tracer, ("eval", 5), "ab")  # recently used: kept
    assert len(tracer._traces) == tracer_module._SIGNATURES
    assert not tracer.traces_for(("eval", 0)) and tracer.traces_for(("eval", 5))
