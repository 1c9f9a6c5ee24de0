"""``compression: auto``: on a fast link the judge keeps the exact reduction (training is exact
training to the bit); on a slow one it picks the method its model predicts fastest, and trains
as that method would with the same warm-up, to the bit. Every rank decides alike; the decision
is logged, in the report and kept by checkpoints."""

from __future__ import annotations

import functools
import logging

import pytest

import chunkmem
from chunkmem.errors import ConfigError
from tests.distributed_helpers import run_ranks, run_threads
from tests.test_compression import WORLD, _batch, _engine, train_and_checkpoint
from zero import compression as compression_package
from zero.compression import judge as judge_module
from zero.compression.judge import LinkProbe

AUTO = {"type": "auto", "warmup_steps": 3}


def train(comm, compression: dict, steps: int) -> dict:
    """bf16, clipping 1.0, ZeRO-2: losses, and the report's view of the compression."""
    engine = _engine(
        comm, compression, 2, precision="bf16", gradient_clipping=1.0, chunk={"size": 512}
    )
    losses = []
    for step in range(steps):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "compression": engine.run_summary().compression}


def _slow_link(monkeypatch) -> None:
    """A 1 kB/s link, on which every exact step takes 3 s (as it would: its 2.2 kB of
    reduce-scatter take 2.2 s of them); the in-process world is fast, so both are faked."""
    monkeypatch.setattr(
        compression_package, "probe_link", lambda comm, device: LinkProbe(1000, 1.0, 0.0)
    )
    monkeypatch.setattr(judge_module.Judge, "_step_samples", lambda self: [3.0, 3.0])


def test_on_a_fast_link_auto_is_exact_training(caplog) -> None:
    """The in-process world moves bytes at memory speed: no method saves min_gain."""
    with caplog.at_level(logging.INFO, logger="chunkmem"):
        ours = run_threads(train, WORLD, AUTO, 6, timeout_s=60)
    exact = run_threads(train, WORLD, {"type": "none"}, 6, timeout_s=60)
    for rank in range(WORLD):
        assert ours[rank]["losses"] == exact[rank]["losses"]
        decision = ours[rank]["compression"]["auto"]
        assert decision["chosen"] == "none" and decision["from_step"] == 4
        assert "below min_gain" in decision["reason"]
        fastest = min(s for m, s in decision["predicted_s"].items() if m != "none")
        direction = "slower" if fastest > decision["step_s"] else "faster"
        assert f"% {direction} than the exact" in decision["reason"]
        assert decision["predicted_s"]["none"] == decision["step_s"] > 0
        assert decision["wire_bytes"]["onebit"] < decision["wire_bytes"]["none"]
    agreed = [{k: v for k, v in r["compression"]["auto"].items() if k != "probe_s"} for r in ours]
    assert all(a == agreed[0] for a in agreed)  # every rank alike (but its own probe's wall time)
    assert "compression auto: none" in caplog.text


def test_on_a_slow_link_auto_trains_as_the_method_it_picks(monkeypatch) -> None:
    """On a slow link the wire dominates: the fewest bytes win (1-bit: 216 bytes a step
    against 2208 exact), and the run is the fixed 1-bit run with the same three exact steps,
    to the bit."""
    _slow_link(monkeypatch)
    ours = run_threads(train, WORLD, AUTO, 6, timeout_s=60)
    fixed = run_threads(train, WORLD, {"type": "onebit", "warmup_steps": 3}, 6, timeout_s=60)
    for rank in range(WORLD):
        decision = ours[rank]["compression"]["auto"]
        assert decision["chosen"] == "onebit", decision
        wire, predicted = decision["wire_bytes"], decision["predicted_s"]
        assert (wire["none"], wire["onebit"]) == (2208, 216)
        assert predicted["onebit"] == pytest.approx(
            3.0 - (2208 - 216) / 1000 + decision["codec_s"]["onebit"], rel=1e-6
        )
        assert ours[rank]["losses"] == fixed[rank]["losses"]


def test_each_collective_pays_the_probed_latency(monkeypatch) -> None:
    """A link of 1 kB/s whose collectives each take 0.05 s besides: every prediction adds
    its method's collectives (the cost models' traffic entries) times the latency, the exact
    one's taken out of the measured step with its bytes."""
    _slow_link(monkeypatch)
    monkeypatch.setattr(
        compression_package,
        "probe_link",
        lambda comm, device: LinkProbe(1000, 1.0, 0.0, latency_s=0.05),
    )
    decision = run_threads(train, WORLD, AUTO, 5, timeout_s=60)[0]["compression"]["auto"]
    wire, collectives = decision["wire_bytes"], decision["collectives"]
    assert decision["latency_s"] == 0.05
    assert collectives["none"] >= 1 and collectives["powersgd"] > collectives["none"]
    compute = 3.0 - wire["none"] / 1000 - collectives["none"] * 0.05
    for method, codec in decision["codec_s"].items():
        link = wire[method] / 1000 + collectives[method] * 0.05
        assert decision["predicted_s"][method] == pytest.approx(compute + link + codec, rel=1e-6)


def test_min_gain_keeps_the_exact_reduction(monkeypatch) -> None:
    """The same slow link with a gain threshold no method can reach (0.99): none."""
    _slow_link(monkeypatch)
    ours = run_threads(train, WORLD, {**AUTO, "auto_min_gain": 0.99}, 5, timeout_s=60)
    assert {r["compression"]["auto"]["chosen"] for r in ours} == {"none"}


def checkpointed_on_a_slow_link(comm, directory: str, save_at: int | None, resume: bool) -> dict:
    """:func:`train_and_checkpoint` with ``auto`` on :func:`_slow_link`'s link. A resumed
    process times no step (its samples are empty): it can only go on compressing if the
    checkpoint kept the decision."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _slow_link(monkeypatch)
        if resume:
            monkeypatch.setattr(judge_module.Judge, "_step_samples", lambda self: [])
        run = train_and_checkpoint(comm, AUTO, directory, save_at, resume)
    return {"losses": run["losses"], "decision": run["compression"]["auto"]}


def test_a_resumed_run_keeps_the_decision(tmp_path) -> None:
    """Saved right after the decision (4 steps), the resumed run's two steps go on with 1-bit
    (the decision and the residuals loaded), to the bit; a lost decision would reduce exactly
    (the resumed process cannot decide again), and step 6's loss would differ."""
    target = str(tmp_path / "ckpt")
    run = functools.partial(run_ranks, checkpointed_on_a_slow_link, 2, target)
    whole = run(4, False, timeout_s=60, deadline_s=120)
    resumed = run(None, True, timeout_s=60, deadline_s=120)
    for rank in range(2):
        assert resumed[rank]["losses"] == whole[rank]["losses"][4:]
        assert resumed[rank]["decision"] == whole[rank]["decision"]
        assert whole[rank]["decision"]["chosen"] == "onebit"
        assert whole[rank]["decision"]["from_step"] == 4


def test_the_decision_is_in_the_html_report(tmp_path) -> None:
    def run(comm):
        engine = _engine(comm, AUTO, 2, precision="bf16", chunk={"size": 512})
        for step in range(5):
            engine.backward(engine(*_batch(step, comm.rank)))
            engine.step()
        if comm.rank == 0:
            engine.write_report(tmp_path)

    run_threads(run, 2, timeout_s=60)
    page = (tmp_path / "memory_trace.html").read_text()
    assert "auto chose none at step 4" in page


def test_auto_needs_timed_warmup_steps() -> None:
    with pytest.raises(ConfigError, match="warmup_steps >= 3"):
        chunkmem.Config.from_dict({"zero": {"stage": 2}, "compression": {"type": "auto"}})


def test_auto_in_the_estimate_is_exact_traffic_and_the_largest_state() -> None:
    from chunkmem.config import CompressionConfig
    from zero.reduce import ExactReduceScatterCosts
    from zero.topology import Topology

    topology = Topology(4, 2)
    exact = ExactReduceScatterCosts(topology, 2, "reduce")
    auto = compression_package.compressed_reduction_costs(
        CompressionConfig(type="auto", warmup_steps=3), topology, "reduce", exact, 2
    )
    methods = [
        compression_package.compressed_reduction_costs(
            CompressionConfig(type=method), topology, "reduce", exact, 2
        )
        for method in ("onebit", "terngrad", "powersgd")
    ]

    class Layout:  # what the cost models read of a layout
        capacity = 4096
        slots = ()

    layout = Layout()
    assert auto.traffic(layout) == exact.traffic(layout)
    assert auto.state_bytes(layout) == {"ef_residual": 4 * 4096, "powersgd_q": 0}
    # TernGrad's fp32 copy of the gradient is the largest buffer
    assert auto.buffer_bytes(layout) == max(c.buffer_bytes(layout) for c in methods) > 0


def test_on_a_world_of_one_auto_keeps_the_exact_reduction() -> None:
    """One rank sends nothing across ranks: the judge decides 'none' without dividing by the
    probe's zero bandwidth, and training is exact training."""
    ours = run_threads(train, 1, AUTO, 6, timeout_s=60)
    exact = run_threads(train, 1, {"type": "none"}, 6, timeout_s=60)
    assert ours[0]["losses"] == exact[0]["losses"]
    decision = ours[0]["compression"]["auto"]
    assert decision["chosen"] == "none" and "world of one" in decision["reason"]


def train_failing_on_rank_1(comm, steps: int) -> str:
    """Rank 1's codec timing raises; every rank reports what its step raised."""
    engine = _engine(comm, AUTO, 2, precision="bf16", gradient_clipping=1.0, chunk={"size": 512})
    judge = engine.reducer.state.decision
    if comm.rank == 1:

        def broken(layouts, device) -> float:
            raise RuntimeError("codec timing broke")

        for name, candidate in judge.candidates.items():
            judge.candidates[name] = type(candidate)(candidate.reduction, candidate.costs, broken)
    try:
        for step in range(steps):
            loss = engine(*_batch(step, comm.rank))
            engine.backward(loss)
            engine.step()
    except Exception as error:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_rank_failing_to_measure_makes_every_rank_raise_at_once() -> None:
    """The agreeing all-reduce carries a failure flag: rank 0 raises too, at the decision,
    instead of waiting for rank 1 until the collective timeout (60 s here)."""
    raised = run_threads(train_failing_on_rank_1, WORLD, 6, timeout_s=60, deadline_s=30)
    assert "could not time the candidates' codecs on this rank" in raised[1]
    assert "codec timing broke" in raised[1]
    assert all("could not time the candidates' codecs" in r for r in raised), raised
    assert "on another rank" in raised[0]


BETWEEN_STEPS_S = 0.3


def train_with_a_pause_between_steps(comm, steps: int) -> dict:
    """As :func:`train`, but the loop sleeps between steps (data loading, an evaluation)."""
    import time

    engine = _engine(comm, AUTO, 2, precision="bf16", gradient_clipping=1.0, chunk={"size": 512})
    for step in range(steps):
        loss = engine(*_batch(step, comm.rank))
        engine.backward(loss)
        engine.step()
        time.sleep(BETWEEN_STEPS_S)
    return engine.run_summary().compression["auto"]


def test_the_judge_times_the_engines_step_not_the_loops_period() -> None:
    """A method can save none of what the loop does between steps: the step the judge weighs
    savings against is the engine's, forward to the end of step, without the pause."""
    for decision in run_threads(train_with_a_pause_between_steps, WORLD, 5, timeout_s=60):
        assert 0 < decision["step_s"] < BETWEEN_STEPS_S / 2, decision["step_s"]


def test_the_cycle_clock_times_from_the_first_forward_to_the_step_end() -> None:
    """Micro-steps (or an evaluation) before a step count in it from the first forward; an
    end without a start (the first tag an engine sets) times nothing."""
    from zero.cycle_clock import CycleClock

    times = iter([1.0, 4.5, 10.0, 11.0])
    clock = CycleClock(now=lambda: next(times))
    clock.ended()
    clock.began()  # 1.0
    clock.began()  # a second micro-step: not a new start
    clock.ended()  # 4.5
    clock.began()  # 10.0
    clock.ended()  # 11.0
    assert list(clock.durations) == [3.5, 1.0]
