"""``ChunkmemTrainer`` (chunkmem/integrations/hf.py): Hugging Face's Trainer drives the same
engine a hand-written loop drives, with the same bits.

A tiny Llama (fp32 and bf16) and a LoRA Llama under Hugging Face's documented ZeRO-3 DeepSpeed
config, "auto" values and all, train with accumulation 2 through the Trainer's defaults
(its AdamW with decay groups, its linear schedule, or the config's optimizer and WarmupLR) and
give the losses, gradient norms and weights of ``chunkmem.initialize`` driven by hand over the
same batches. With ``num_items_in_batch`` the Trainer's loss is already the window's share; by
hand, ``engine.backward(loss * 2)`` hands the engine's division by 2 exactly that (2 is a power
of two). TRL's ``SFTTrainer`` with the mixin trains bit for bit like ``SFTTrainer`` itself
(fp32, no clipping: both run torch's fused AdamW). A resumed run equals an uninterrupted one;
``save_model`` writes what ``from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import chunkmem
from chunkmem.errors import ConfigError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from chunkmem.integrations.hf import ENGINE_CHECKPOINT, ChunkmemTrainer  # noqa: E402
from chunkmem.integrations.hf_config import fill_auto  # noqa: E402
from tests.hf_helpers import VOCAB, batches, llama  # noqa: E402
from tests.offload_helpers import assert_same_state  # noqa: E402
from tests.test_lora import lora_llama  # noqa: E402

CONFIG = {"device": {"type": "simulated", "capacity": "64MiB"}}
# Hugging Face's documented ZeRO-3 config (the DeepSpeed integration page), as users have it.
ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip
BATCHES, ACCUMULATION = 8, 2


def rows(data: list[tuple]) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]}
        for ids, mask, labels in data
        for i in range(len(ids))
    ]


def arguments(directory: Path, **overrides) -> transformers.TrainingArguments:
    settings = {
        "output_dir": str(directory), "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": ACCUMULATION, "num_train_epochs": 1,
        "learning_rate": 1e-3, "weight_decay": 0.01, "warmup_steps": 2, "logging_steps": 1,
        "save_strategy": "no", "report_to": [], "disable_tqdm": True, "use_cpu": True,
        "train_sampling_strategy": "sequential", **overrides,
    }  # fmt: skip
    return transformers.TrainingArguments(**settings)


def logged(trainer: transformers.Trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def by_hand(
    model: torch.nn.Module, data: list[tuple], config: dict, optimizer=None, schedule=None
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The engine over the same windows: each micro-batch's loss is its token sum over the
    window's count (num_items_in_batch, as the Trainer passes it); the Trainer's logged loss
    of a window is the sum of its micro-batches' losses."""
    engine = chunkmem.initialize(model, optimizer=optimizer, config=config, lr_scheduler=schedule)
    losses, norms = [], []
    for start in range(0, len(data), ACCUMULATION):
        window = data[start : start + ACCUMULATION]
        count = sum(labels[:, 1:].ne(-100).sum() for _, _, labels in window)
        total = torch.zeros(())
        for ids, mask, labels in window:
            loss = engine(
                input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count
            ).loss
            engine.backward(loss * ACCUMULATION)
            engine.step()
            total += loss.detach()
        losses.append(total.item())
        norms.append(engine.last_grad_norm)
    return engine.state_dict(), losses, norms


@pytest.fixture
def own_world():
    """A config asking for ZeRO in one process gets a process group of one; later tests in
    this process expect none."""
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_llama_trains_like_the_engine_driven_by_hand(tmp_path: Path, precision: str) -> None:
    """The Trainer's own AdamW (decay and no-decay groups), linear schedule with warm-up and
    clipping at 1.0; bf16 from TrainingArguments(bf16=True)."""
    model = llama()
    start = copy.deepcopy(model)
    data = batches(count=BATCHES)
    args = arguments(tmp_path, bf16=precision == "bf16")
    trainer = ChunkmemTrainer(
        model=model, args=args, train_dataset=rows(data), chunkmem_config=CONFIG
    )
    trainer.train()
    decay = trainer.get_decay_parameter_names(start)
    named = [(n, p) for n, p in start.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    schedule = transformers.get_scheduler("linear", optimizer, 2, BATCHES // ACCUMULATION)
    config = {
        **CONFIG, "precision": precision, "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
    }  # fmt: skip
    state, losses, norms = by_hand(start, data, config, optimizer, schedule)
    assert logged(trainer, "loss") == losses
    assert logged(trainer, "grad_norm") == norms
    assert_same_state(trainer.engine.state_dict(), state)


def test_lora_under_hugging_faces_zero3_config_trains_like_the_engine_by_hand(
    tmp_path: Path, own_world: None
) -> None:
    """The config's "auto" values filled from TrainingArguments (ZeRO-3 in a world of one,
    optimizer states on the host, the config's AdamW and WarmupLR); the adapters saved by
    save_model load into PEFT."""
    model = lora_llama()
    start = copy.deepcopy(model)
    data = batches(count=BATCHES)
    args = arguments(tmp_path, weight_decay=0.0)
    config = {**ZERO3, "chunkmem": CONFIG}
    trainer = ChunkmemTrainer(
        model=model, args=args, train_dataset=rows(data), chunkmem_config=config
    )
    trainer.train()
    assert trainer.engine.config.zero.stage == 3
    assert trainer.engine.config.offload.optimizer == "host"
    filled = fill_auto(config, args, world_size=1, num_training_steps=BATCHES // ACCUMULATION)
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
    }  # fmt: skip
    state, losses, norms = by_hand(start, data, filled)
    assert logged(trainer, "loss") == losses
    assert_same_state(trainer.engine.state_dict(), state)

    trainer.save_model(tmp_path / "adapters")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(model.get_base_model().config)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    adapters = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(adapters) == sum("lora_" in n for n in state) > 0
    for name, value in adapters.items():
        assert torch.equal(value, state[name]), name


def test_a_resumed_run_equals_an_uninterrupted_one_and_from_pretrained_loads_it(
    tmp_path: Path,
) -> None:
    """Checkpoints at steps 2 and 4 (checkpoint-N/chunkmem is the engine's); a new trainer
    resumes checkpoint-2 and ends with the first run's weights and step losses."""
    data = rows(batches(count=BATCHES))

    def trainer(directory: Path) -> ChunkmemTrainer:
        args = arguments(directory, save_strategy="steps", save_steps=2)
        return ChunkmemTrainer(model=llama(), args=args, train_dataset=data, chunkmem_config=CONFIG)

    whole = trainer(tmp_path / "whole")
    whole.train()
    assert (tmp_path / "whole" / "checkpoint-2" / ENGINE_CHECKPOINT / ".metadata").is_file()
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert logged(resumed, "loss")[2:] == logged(whole, "loss")[2:]  # 1-2: its trainer_state
    assert_same_state(resumed.engine.state_dict(), whole.engine.state_dict())

    resumed.save_model(tmp_path / "final")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_state(loaded.state_dict(), resumed.engine.state_dict())
    with pytest.raises(chunkmem.CheckpointError, match="holds no chunkmem checkpoint"):
        trainer(tmp_path / "again").train(resume_from_checkpoint=str(tmp_path / "final"))


def test_evaluation_runs_through_the_engine_before_and_after_training(tmp_path: Path) -> None:
    """evaluate() calls the engine under no grad (evaluation cycles): its loss is the plain
    model's with the engine's weights, before training and after."""
    data = batches(count=BATCHES)
    held_out = batches(count=2, seed=7)
    trainer = ChunkmemTrainer(
        model=llama(), args=arguments(tmp_path), train_dataset=rows(data), chunkmem_config=CONFIG
    )

    def plain_loss() -> float:
        plain = llama()
        plain.load_state_dict(trainer.engine.state_dict())
        with torch.no_grad():
            losses = [plain(input_ids=i, attention_mask=m, labels=y).loss for i, m, y in held_out]
        return torch.stack(losses).mean().item()

    before = trainer.evaluate(rows(held_out))["eval_loss"]
    assert before == pytest.approx(plain_loss(), rel=1e-6)
    trainer.train()
    after = trainer.evaluate(rows(held_out))["eval_loss"]
    assert after == pytest.approx(plain_loss(), rel=1e-6)
    assert after != before


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny Llama's vocabulary (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="w0", eos_token="w1", pad_token="w1", unk_token="w2"
    )


def test_trl_sft_trainer_with_the_mixin_trains_like_sft_trainer(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from chunkmem.integrations.hf import ChunkmemTrainerMixin

    class ChunkmemSFTTrainer(ChunkmemTrainerMixin, trl.SFTTrainer):
        pass

    generator = torch.Generator().manual_seed(0)
    texts = [
        " ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (12,), generator=generator))
        for _ in range(16)
    ]

    def train(trainer_class: type, **extra) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = llama()
        args = trl.SFTConfig(
            output_dir=str(tmp_path / trainer_class.__name__), per_device_train_batch_size=4,
            gradient_accumulation_steps=ACCUMULATION, max_steps=2, learning_rate=1e-3,
            max_grad_norm=0.0, bf16=False, max_length=16, logging_steps=1, save_strategy="no",
            report_to=[], disable_tqdm=True, use_cpu=True,
        )  # fmt: skip
        dataset = datasets.Dataset.from_dict({"text": texts})
        trainer = trainer_class(
            model=model, args=args, train_dataset=dataset, processing_class=word_tokenizer(),
            **extra,
        )  # fmt: skip
        trainer.train()
        engine = getattr(trainer, "engine", None)
        state = (
            engine.state_dict() if engine else {k: v.clone() for k, v in model.state_dict().items()}
        )
        return logged(trainer, "loss"), state

    plain_losses, plain_state = train(trl.SFTTrainer)
    losses, state = train(ChunkmemSFTTrainer, chunkmem_config=CONFIG)
    assert losses == plain_losses
    assert_same_state(state, plain_state)


@pytest.mark.parametrize(
    ("overrides", "config", "refusal"),
    [
        ({"fp16": True}, CONFIG, r"fp16=True\) does not work"),
        ({"torch_compile": True}, CONFIG, r"torch_compile=True\) does not work"),
        ({"label_smoothing_factor": 0.1}, CONFIG, "label_smoothing_factor=0.1"),
        ({}, {**CONFIG, "gradient_accumulation_steps": 4}, "gradient_accumulation_steps=...\\) alone"),
        ({}, {**CONFIG, "gradient_clipping": 0.5}, "max_grad_norm 1.0 differ"),
        ({}, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "chunkmem": CONFIG},
         "'optimizer.params.lr' is 0.1, TrainingArguments' learning_rate 0.001"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_by_name(tmp_path: Path, overrides, config, refusal) -> None:
    data = rows(batches(count=2))
    with pytest.raises(ConfigError, match=refusal):
        ChunkmemTrainer(
            model=llama(), args=arguments(tmp_path, **overrides), train_dataset=data,
            chunkmem_config=config,
        )  # fmt: skip


def test_an_epoch_ending_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    data = rows(batches(count=3))  # 3 batches, accumulation 2: the last window is short
    trainer = ChunkmemTrainer(
        model=llama(), args=arguments(tmp_path), train_dataset=data, chunkmem_config=CONFIG
    )
    with pytest.raises(ConfigError, match="1 of 2 micro-batches"):
        trainer.train()


def test_auto_values_passed_to_initialize_say_what_fills_them(tmp_path: Path) -> None:
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(ZERO3))
    with pytest.raises(ConfigError) as refusal:
        chunkmem.initialize(llama(), config=path)
    message = str(refusal.value)
    assert message.startswith("DeepSpeed key 'fp16.enabled' must be true or false, got 'auto'")
    for key in ("bf16.enabled", "optimizer.params.lr", "scheduler.params.warmup_num_steps",
                "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):  # fmt: skip
        assert repr(key) in message
    assert "reduce_bucket_size" not in message  # accepted whatever its value
    assert "TrainingArguments" in message and "ChunkmemTrainer" in message
