"""benchmarks/compression's arithmetic: the moving average, time to loss and the keys, on
made-up runs (the benchmark itself needs root for its network namespaces)."""

from __future__ import annotations

import chunkmem
from benchmarks.compression import (
    GATHER_AT_STEP,
    METHODS,
    ONE_RING,
    TORCH_HOOK,
    compression_for,
    metrics,
    moving_average,
    time_to_loss,
)


def test_moving_average_warms_up_then_slides() -> None:
    assert moving_average([4.0, 2.0, 6.0, 8.0], 2) == [4.0, 3.0, 4.0, 7.0]


def _entry(seconds: list[float], losses: list[float]) -> dict:
    return {"rounds": [{"step_s": seconds, "losses": losses}]}


def test_time_to_loss_counts_the_steps_until_the_smoothed_loss_reaches_the_target() -> None:
    entry = _entry([1.0, 2.0, 4.0, 8.0], [5.0, 3.0, 1.0, 1.0])
    assert time_to_loss(entry, 2.0, 2) == 7.0  # smoothed: 5, 4, 2, 1
    assert time_to_loss(entry, 0.5, 2) is None


def one_seed(slow: dict) -> dict:
    """The seeds phase's details for the cluster's runs alone (seed 0)."""
    from benchmarks.compression import seeded_rel_diffs

    final = {name: [entry["final_loss"]] for name, entry in slow.items() if "final_loss" in entry}
    return {"rel_diff": seeded_rel_diffs(final)}


def test_metrics_are_the_issue_s_keys_as_ratios_to_the_uncompressed_run() -> None:
    none = {"bytes_sent_per_step": 100, "time_to_loss_s": 10.0, "final_loss": 2.0}
    slow = {"none": none, TORCH_HOOK: {"time_to_loss_s": 5.0}, ONE_RING: {"time_to_loss_s": 25.0},
            GATHER_AT_STEP: {"time_to_loss_s": 30.0}}  # fmt: skip
    for index, method in enumerate(METHODS[1:]):
        slow[method] = {
            "bytes_sent_per_step": 10 * (index + 1),
            "time_to_loss_s": None if method == "terngrad" else 20.0,
            "final_loss": 2.2,
        }
    out = metrics({"rates": {"1gbit": slow}, "seeds": one_seed(slow)})
    assert out["wire_bytes_ratio_vs_uncompressed_onebit"] == 0.1
    assert out["time_to_loss_ratio_vs_uncompressed_onebit"] == 2.0
    assert out["time_to_loss_ratio_vs_uncompressed_terngrad"] is None
    assert abs(out["final_loss_rel_diff_vs_uncompressed_powersgd"] - 0.1) < 1e-12
    assert out["powersgd_time_to_loss_ratio_vs_torch_hook"] == 4.0
    assert out["powersgd_one_ring_time_to_loss_ratio_vs_torch_hook"] == 5.0
    assert out["powersgd_gather_at_step_time_to_loss_ratio_vs_torch_hook"] == 6.0
    assert "auto_time_ratio_vs_best_fixed" not in out


def test_auto_is_judged_against_the_best_fixed_choice_at_each_rate() -> None:
    """Its probe counts in its time; the best fixed choice may be none; the headline key is
    the worse rate."""
    auto_entry = _entry([1.0, 1.0, 1.0], [3.0, 2.0, 1.0])
    auto_entry["auto"] = {"probe_s": 0.5, "chosen": "none"}
    assert time_to_loss(auto_entry, 1.5, 1) == 3.5

    def rate(auto_s: float, fastest: float) -> dict:
        summary = {
            m: {"time_to_loss_s": fastest + i, "bytes_sent_per_step": 1, "final_loss": 1.0}
            for i, m in enumerate(METHODS)
        }
        summary["terngrad"]["time_to_loss_s"] = None  # never reached: not a candidate
        summary["auto"] = {"time_to_loss_s": auto_s, "auto": {"chosen": "none"}}
        return summary

    out = metrics({"rates": {"1gbit": rate(10.5, 10.0), "10gbit": rate(4.0, 4.0)}})
    assert out["auto_time_ratio_vs_best_fixed_1gbit"] == 1.05
    assert out["auto_time_ratio_vs_best_fixed_10gbit"] == 1.0
    assert out["auto_time_ratio_vs_best_fixed"] == 1.05
    assert out["auto_choice_10gbit"] == "none"


def test_each_method_runs_at_its_papers_settings() -> None:
    assert compression_for("onebit", 200) == {
        "type": "onebit", "warmup_steps": 40, "freeze_variance": True,
    }  # fmt: skip
    assert compression_for("powersgd", 200) == {"type": "powersgd", "warmup_steps": 20}
    assert compression_for("terngrad", 200) == {"type": "terngrad"}
    assert compression_for("auto", 12)["warmup_steps"] == 3  # the judge needs 3 timed steps
    assert compression_for("dgc", 200) == {
        "type": "dgc", "warmup_steps": 40, "freeze_variance": True, "density": 0.001,
        "block_size": 32, "momentum_correction": True, "sparsity_warmup_steps": 40,
    }  # fmt: skip


def test_the_judged_runs_train_side_by_side_and_the_reported_ones_alone() -> None:
    """Every run whose time enters a key (the methods, auto, the torch hook, the ablation) is
    interleaved; the ZeRO-3 and offload runs (reported, not judged) are not."""
    from benchmarks.compression import FULL, _runs

    runs = _runs(FULL, "1gbit")
    judged = [run["name"] for run in runs if run.get("interleaved")]
    assert judged == [
        "none", "onebit", "terngrad", "powersgd", "dgc", "auto", "ddp_powersgd_hook",
        "onebit-ef-only", "powersgd-one-ring", "powersgd-gather-at-step",
    ]  # fmt: skip
    at_step = next(run for run in runs if run["name"] == GATHER_AT_STEP)
    assert at_step["gather_at_step"] and at_step["compression"]["type"] == "powersgd"
    one_ring = next(run for run in runs if run["name"] == "powersgd-one-ring")
    assert one_ring["one_ring"] and one_ring["compression"] == compression_for("powersgd", 200)
    alone = [run["name"] for run in runs if not run.get("interleaved")]
    assert alone and all(name.endswith(("-zero3", "-offload", "-sgd")) for name in alone)
    assert [name for name in alone if name.endswith("-sgd")] == [
        "none-sgd", "powersgd-sgd", "dgc-sgd", "onebit-sgd", "ddp_powersgd_hook-sgd",
    ]  # fmt: skip
    assert all(run.get("interleaved") for run in _runs(FULL, "10gbit"))


def test_under_momentum_sgd_each_method_runs_at_its_papers_settings() -> None:
    """PowerSGD with its warm-up, DGC with the correction as the momentum (so the optimizer's
    is 0) and the sparsity warm-up only, 1-bit SGD with error feedback from the first step."""
    from benchmarks.compression import PAPERS_SGD, papers_sgd_run

    powersgd = papers_sgd_run("powersgd", 200, 300)
    assert powersgd["compression"] == compression_for("powersgd", 200)
    assert powersgd["optimizer"] == PAPERS_SGD and PAPERS_SGD["momentum"] == 0.9
    dgc = papers_sgd_run("dgc", 200, 300)
    assert dgc["compression"] == {
        "type": "dgc", "density": 0.001, "block_size": 32, "momentum_correction": True,
        "sparsity_warmup_steps": 40,
    }  # fmt: skip
    assert dgc["optimizer"] == {**PAPERS_SGD, "momentum": 0.0}
    assert papers_sgd_run("onebit", 200, 300)["compression"] == {"type": "onebit"}
    for method in ("powersgd", "dgc", "onebit"):  # each a config the engine takes
        run = papers_sgd_run(method, 200, 300)
        chunkmem.Config.from_dict(
            {"zero": {"stage": 2}, "compression": run["compression"],
             "optimizer": run["optimizer"], "gradient_clipping": 1.0}
        )  # fmt: skip


def test_the_momentum_sgd_keys_compare_with_the_exact_sgd_run() -> None:
    none = {"bytes_sent_per_step": 100, "time_to_loss_s": 10.0, "final_loss": 2.0}
    slow = {"none": none, "none-sgd": {**none, "final_loss": 2.5}}
    slow["powersgd-sgd"] = {**none, "final_loss": 2.525}
    out = metrics({"rates": {"1gbit": slow}, "seeds": one_seed(slow)})
    assert abs(out["final_loss_rel_diff_vs_uncompressed_powersgd_momentum_sgd"] - 0.01) < 1e-12
    assert "final_loss_rel_diff_vs_uncompressed_dgc_momentum_sgd" not in out


def test_the_final_loss_keys_are_medians_over_seeds_each_paired_with_its_exact_run() -> None:
    """Each seed's loss against the exact run's of the same seed, then the median: a seed
    whose exact run is better does not count against the method twice. Torch's hook (one
    seed: it needs processes) keeps the cluster's run."""
    from benchmarks.compression import seeded_rel_diffs

    final = {"none": [2.0, 4.0, 2.0], "powersgd": [2.02, 4.4, 2.1],
             "none-sgd": [3.0, 3.0, 3.0], "powersgd-sgd": [3.3, 3.0, 3.03]}  # fmt: skip
    diffs = seeded_rel_diffs(final)
    powersgd = diffs["final_loss_rel_diff_vs_uncompressed_powersgd"]
    assert [round(d, 12) for d in powersgd["per_seed"]] == [0.01, 0.1, 0.05]
    assert (round(powersgd["median"], 12), round(powersgd["min"], 12)) == (0.05, 0.01)
    assert round(powersgd["max"], 12) == 0.1
    assert set(diffs) == {
        "final_loss_rel_diff_vs_uncompressed_powersgd",
        "final_loss_rel_diff_vs_uncompressed_powersgd_momentum_sgd",
    }
    none = {"bytes_sent_per_step": 100, "time_to_loss_s": 10.0, "final_loss": 2.0}
    slow = {"none": none, "powersgd": {**none, "final_loss": 2.02}, "none-sgd": none,
            "ddp_powersgd_hook-sgd": {**none, "final_loss": 2.2}}  # fmt: skip
    out = metrics({"rates": {"1gbit": slow}, "seeds": {"rel_diff": diffs}})
    assert round(out["final_loss_rel_diff_vs_uncompressed_powersgd"], 12) == 0.05
    assert round(out["final_loss_rel_diff_vs_uncompressed_powersgd_momentum_sgd"], 12) == 0.01
    assert (
        round(out["final_loss_rel_diff_vs_uncompressed_ddp_powersgd_hook_momentum_sgd"], 12) == 0.1
    )
    # the seeds phase did not finish: no median to give, so no key under a median's name
    unseeded = metrics({"rates": {"1gbit": slow}})
    assert "final_loss_rel_diff_vs_uncompressed_powersgd" not in unseeded
    assert "final_loss_rel_diff_vs_uncompressed_ddp_powersgd_hook_momentum_sgd" in unseeded


def test_the_seeded_runs_are_the_cluster_s_keyed_runs_cut_to_the_judged_length() -> None:
    from benchmarks.compression import FULL, SGD_SUFFIX, _runs, seeded_runs

    runs = seeded_runs(FULL)
    assert [run["name"] for run in runs] == [
        "none", "onebit", "terngrad", "powersgd", "dgc", "onebit-ef-only",
        "none-sgd", "powersgd-sgd", "dgc-sgd", "onebit-sgd",
    ]  # fmt: skip
    cluster = {run["name"]: run for run in _runs(FULL, "1gbit")}
    for run in runs:
        assert run["steps"] == FULL["steps"]
        assert run["compression"] == cluster[run["name"]]["compression"]
        assert run.get("optimizer") == cluster[run["name"]].get("optimizer")
        assert run.get("optimizer") is not None or not run["name"].endswith(SGD_SUFFIX)


def _seeded_spec() -> tuple[dict, dict, list]:
    from benchmarks.compression import QUICK
    from benchmarks.zeropp import WORLD, _text_batches

    spec = {"local_batch": 2, "seq": 16, "lr": 1e-3, "precision": "bf16"}
    setup = {**QUICK, "steps": 2, "window": 1, "seeds": 1}
    return spec, setup, [_text_batches(spec, rank) for rank in range(WORLD)]


def test_a_seed_sets_the_model_and_the_batches_and_repeats_bit_for_bit() -> None:
    """Step 0's loss is the mean over ranks of plain torch's bf16 forward of the seed's model
    on the seed's batches: an independent check of what a seed changes."""
    import torch

    from benchmarks.compression import SEED_BATCH_OFFSET, _model, seeded_runs, train_in_process

    spec, setup, batches = _seeded_spec()
    exact = seeded_runs(setup)[0]
    assert exact["name"] == "none"
    first = train_in_process(spec, exact, 1, batches)
    assert first == train_in_process(spec, exact, 1, batches)
    assert first != train_in_process(spec, exact, 0, batches)
    model = _model(1).to(torch.bfloat16)
    with torch.no_grad():
        eager = [float(model(*batch(SEED_BATCH_OFFSET))) for batch in batches]
    assert first[0] == sum(eager) / len(eager)


def test_seeds_refuse_to_run_when_the_in_process_world_is_not_the_cluster_s_bits() -> None:
    import pytest

    from benchmarks.compression import final_losses_over_seeds, seeded_runs, train_in_process

    spec, setup, batches = _seeded_spec()
    runs = seeded_runs(setup)
    losses = train_in_process(spec, runs[0], 0, batches)
    cluster = {run["name"]: {"rounds": [{"losses": [1.0, 2.0]}]} for run in runs}
    cluster["none"]["rounds"][0]["losses"] = losses
    done = final_losses_over_seeds(spec, setup, cluster)
    assert done["exact_run_same_bits_as_cluster"] and done["final_loss"]["powersgd"] == [2.0]
    cluster["none"]["rounds"][0]["losses"] = [losses[0], losses[1] + 1e-6]
    with pytest.raises(RuntimeError, match="differs from the cluster's from step 1"):
        final_losses_over_seeds(spec, setup, cluster)
