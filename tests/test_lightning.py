"""``ChunkmemStrategy`` (chunkmem/integrations/lightning.py): Lightning's Trainer drives the same
engine a hand-written loop drives, with the same bits.

A small regressor trains with accumulation, clipping, a per-step LR schedule and validation,
in one process and on 2 gloo ranks at ZeRO-2 (as torchrun would start them: Lightning's own
launcher runs the docs' example in tests/test_integration_docs.py); its weights and losses
equal those of ``chunkmem.initialize`` driven by hand over the same batches. A run stopped
after its first epoch resumes from its ``last.ckpt`` (a chunkmem DCP checkpoint) into the
same weights as a run that never stopped. What cannot work is refused by name.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import chunkmem
from chunkmem.errors import ConfigError
from tests.distributed_helpers import run_ranks

pl = pytest.importorskip("lightning.pytorch")
from chunkmem.integrations.lightning import ChunkmemStrategy  # noqa: E402

CONFIG = {"device": {"type": "simulated", "capacity": "64MiB"}}
SAMPLES, FEATURES, BATCH, EPOCHS = 64, 16, 8, 2


class Regressor(pl.LightningModule):
    """An MLP whose steps call ``self.net`` and ``self(...)``, with a per-step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.GELU(),
            torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1),
        )  # fmt: skip
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def trainer(config: dict | None = None, **flags) -> pl.Trainer:
    flags = {"accelerator": "cpu", "devices": 1, "max_epochs": EPOCHS, **flags}
    flags.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        strategy=ChunkmemStrategy(config or CONFIG),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )


def by_hand(
    module: Regressor, epochs: list[list[tuple]], config: dict
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``chunkmem.initialize`` on a copy, the module's optimizer and schedule, every batch
    ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``; the engine steps the schedule
    after each update, as Lightning steps a per-step schedule after each optimizer step."""
    module = copy.deepcopy(module)
    setup = module.configure_optimizers()
    schedule = setup["lr_scheduler"]["scheduler"]
    engine = chunkmem.initialize(
        module, optimizer=setup["optimizer"], config=config, lr_scheduler=schedule
    )
    losses = []
    for batches in epochs:
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    state = engine.state_dict()
    engine.close()
    return state, losses


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    differ = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert differ == [], f"{len(differ)} of {len(ours)} tensors differ: {differ}"


def test_one_process_trains_like_the_engine_driven_by_hand() -> None:
    """Accumulation 2, clipping 0.5, StepLR per step, a validation loop (and its sanity check,
    which runs under inference mode before any training): the same weights and losses."""
    module = Regressor()
    start = copy.deepcopy(module)
    data = dataset()
    run = trainer(accumulate_grad_batches=2, gradient_clip_val=0.5)
    run.fit(module, DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=16))
    batches = list(DataLoader(data, batch_size=BATCH))
    config = {**CONFIG, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
    state, losses = by_hand(start, [batches] * EPOCHS, config)
    assert module.losses == losses
    assert_same_state(module.state_dict(), state)  # teardown closed the engine
    assert run.global_step == EPOCHS * len(batches) // 2
    predictions = trainer().predict(module, DataLoader(data, batch_size=16))
    with torch.no_grad():
        assert torch.equal(torch.cat(predictions), module(data.tensors[0]))


class ConfiguredByChunkmem(Regressor):
    """No optimizer of its own: the config's AdamW and WarmupLR, which the engine steps."""

    def configure_optimizers(self) -> None:
        return None


def test_without_configure_optimizers_the_config_s_optimizer_and_schedule_train() -> None:
    config = {
        **CONFIG,
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "scheduler": {"type": "WarmupLR", "warmup_num_steps": 4},
    }
    module = ConfiguredByChunkmem()
    start = copy.deepcopy(module)
    data = dataset()
    trainer(config).fit(module, DataLoader(data, batch_size=BATCH))
    engine = chunkmem.initialize(start, config=config)
    for _ in range(EPOCHS):
        for x, y in DataLoader(data, batch_size=BATCH):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    assert_same_state(module.state_dict(), engine.state_dict())


def _on_a_rank(comm, config: dict) -> tuple[dict, dict, list[float], list[float]]:
    """Lightning under a torchrun environment (the process group exists), then the same
    engine by hand over the DistributedSampler's batches Lightning gave this rank."""
    rank = comm.rank
    os.environ.update(
        TORCHELASTIC_RUN_ID="chunkmem-test", RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip
    module = Regressor()
    start = copy.deepcopy(module)
    data = dataset()
    trainer(config, devices=2).fit(module, DataLoader(data, batch_size=BATCH))
    epochs = []
    for epoch in range(EPOCHS):  # Lightning shuffles a training loader's distributed sampler
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        epochs.append(list(DataLoader(data, batch_size=BATCH, sampler=sampler)))
    state, losses = by_hand(start, epochs, config)
    return module.state_dict(), state, module.losses, losses


@pytest.mark.distributed
@pytest.mark.integration
def test_two_gloo_ranks_at_zero2_train_like_the_engine_driven_by_hand() -> None:
    config = {**CONFIG, "zero": {"stage": 2}}
    for ours, theirs, our_losses, their_losses in run_ranks(_on_a_rank, 2, config):
        assert our_losses == their_losses
        assert_same_state(ours, theirs)


def test_fit_resumes_from_its_last_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """One run of two epochs saves last.ckpt after each (the second replaces the first);
    another stops after one epoch and a third resumes it from its last.ckpt: the same
    weights, and the schedule continues where it was."""
    data = dataset()

    def fit(module: Regressor, directory: Path, epochs: int, ckpt_path=None) -> pl.Trainer:
        saves = pl.callbacks.ModelCheckpoint(directory, save_last=True, save_top_k=0)
        run = trainer(max_epochs=epochs, callbacks=[saves], enable_checkpointing=True)
        run.fit(module, DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_path)
        return run

    whole = Regressor()
    fit(whole, tmp_path / "whole", EPOCHS)
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["last.ckpt"]
    fit(Regressor(), tmp_path / "first", 1)
    resumed = Regressor()
    run = fit(resumed, tmp_path / "resumed", EPOCHS, ckpt_path=tmp_path / "first" / "last.ckpt")
    assert run.global_step == EPOCHS * SAMPLES // BATCH
    assert resumed.losses == whole.losses[SAMPLES // BATCH :]
    assert_same_state(resumed.state_dict(), whole.state_dict())
    assert run.lr_scheduler_configs[0].scheduler.last_epoch == EPOCHS * SAMPLES // BATCH
    with pytest.raises(chunkmem.CheckpointError, match="during fit"):
        run.save_checkpoint(tmp_path / "after_fit.ckpt")  # fit closed the engine
    with pytest.raises(chunkmem.CheckpointError, match="is a file"):
        not_ours = tmp_path / "plain.ckpt"
        torch.save({}, not_ours)
        trainer().fit(Regressor(), DataLoader(data, batch_size=BATCH), ckpt_path=not_ours)


class TwoOptimizers(Regressor):
    """Lightning takes two optimizers with manual optimization only."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> list:
        return [torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[2:].parameters())]  # fmt: skip


class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class OwnClipping(Regressor):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, algorithm=None):
        pass


@pytest.mark.parametrize(
    ("module", "flags", "config", "refusal"),
    [
        (TwoOptimizers, {}, {}, "a second optimizer is not supported"),
        (Manual, {}, {}, "manual optimization"),
        (OwnClipping, {}, {}, "configure_gradient_clipping is overridden"),
        (Regressor, {"precision": "bf16-true"}, {}, r"precision='bf16-true'"),
        (Regressor, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, {}, "norm only"),
        (Regressor, {"accumulate_grad_batches": 2}, {"gradient_accumulation_steps": 4}, "leave it out of the config"),
        (Regressor, {"precision": "bf16-mixed"}, {"precision": "fp32"}, "set one of the two"),
        (Regressor, {"accumulate_grad_batches": 3}, {}, "not a multiple of accumulate_grad_batches=3"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_by_name(module, flags, config, refusal) -> None:
    run = trainer({**CONFIG, **config}, **flags)
    with pytest.raises(ConfigError, match=refusal):
        run.fit(module(), DataLoader(dataset(), batch_size=BATCH))
