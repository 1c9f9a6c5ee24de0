"""Step time of chunkmem under Lightning and under Hugging Face's Trainer, against the same engine
driven by hand.

Each framework trains through its integration (chunkmem/integrations/) while a callback, at the
end of every framework step, takes the time since the end of the step before (data, the
framework's hooks, forward, backward, update, schedule) and then runs one step of the same
engine driven by hand on its own copy of the model and the same batches, timed alike: steps
alternate, so machine load hits both alike. Lightning trains the repository's GPT (6x256,
batch 8x128, as benchmarks/overhead) with AdamW; the Trainer a Llama of the same width and
depth with its default AdamW and linear schedule, the hand loop passing the Trainer's
``num_items_in_batch``. Progress bars, loggers and checkpoints are off: what is measured is
the integration, not the framework's I/O. The ratio is the median framework step over the
median hand step after warm-up; each repeat is a fresh run, and the headline is the median
over repeats (the range beside it).
"""

from __future__ import annotations

import copy
import itertools
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader

import chunkmem
from benchmarks._common import median, parse_args, print_table, write_results
from chunkmem.integrations.hf import ChunkmemTrainer
from chunkmem.integrations.lightning import ChunkmemStrategy
from chunkmem.models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    sequence: int
    vocab: int
    batch: int
    warmup: int  # framework steps not counted (traces, state placement)
    steps: int  # counted
    repeats: int


FULL = Size(layers=6, width=256, heads=4, sequence=128, vocab=512, batch=8, warmup=5, steps=20, repeats=3)  # fmt: skip
QUICK = Size(layers=4, width=128, heads=4, sequence=64, vocab=256, batch=8, warmup=2, steps=8, repeats=2)  # fmt: skip


@dataclass
class Alternation:
    """The two step-time series of one run, sampled in turn."""

    hand_step: Callable[[], None]
    framework: list[float] = field(default_factory=list)
    hand: list[float] = field(default_factory=list)
    _last: float | None = None

    def framework_step_ended(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.framework.append(now - self._last)
        start = time.perf_counter()
        self.hand_step()
        self.hand.append(time.perf_counter() - start)
        self._last = time.perf_counter()

    def ratio(self, warmup: int) -> tuple[float, float, float]:
        """(median framework step, median hand step, their ratio) after ``warmup`` steps."""
        framework, hand = median(self.framework[warmup:]), median(self.hand[warmup:])
        return framework, hand, framework / hand


def engine_config(parameters: int) -> dict:
    """Everything fits: the integrations' cost, not chunk traffic (as benchmarks/overhead)."""
    return {"device": {"type": "simulated", "capacity": 64 * parameters + 2**30}}


def token_rows(size: Size, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, size.vocab, (count, size.sequence + 1), generator=generator)


class GPTModule(pl.LightningModule):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch[:, :-1], batch[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class LightningAlternation(pl.Callback):
    def __init__(self, alternation: Alternation) -> None:
        self.alternation = alternation

    def on_train_batch_end(self, *args) -> None:
        self.alternation.framework_step_ended()


def lightning_run(size: Size) -> Alternation:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=size.vocab, block_size=size.sequence, n_layer=size.layers,
        n_head=size.heads, n_embd=size.width,
    )  # fmt: skip
    module = GPTModule(config)
    rows = token_rows(size, (size.warmup + size.steps + 1) * size.batch)
    settings = engine_config(config.num_parameters())
    hand_model = copy.deepcopy(module.model)
    engine = chunkmem.initialize(
        hand_model,
        optimizer=torch.optim.AdamW(hand_model.parameters(), lr=1e-3, weight_decay=0.01),
        config=settings,
    )
    batches = itertools.cycle(DataLoader(rows, batch_size=size.batch))

    def hand_step() -> None:
        row = next(batches)
        engine.backward(engine(row[:, :-1], row[:, 1:]))
        engine.step()

    alternation = Alternation(hand_step)
    trainer = pl.Trainer(
        strategy=ChunkmemStrategy(settings), accelerator="cpu", devices=1,
        max_steps=size.warmup + size.steps + 1, callbacks=[LightningAlternation(alternation)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(rows, batch_size=size.batch))
    engine.close()
    return alternation


class TrainerAlternation(transformers.TrainerCallback):
    def __init__(self, alternation: Alternation) -> None:
        self.alternation = alternation

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.alternation.framework_step_ended()


def hf_run(size: Size) -> Alternation:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=size.vocab, hidden_size=size.width, intermediate_size=4 * size.width,
            num_hidden_layers=size.layers, num_attention_heads=size.heads,
            num_key_value_heads=size.heads, max_position_embeddings=size.sequence + 1,
        )
    )  # fmt: skip
    steps = size.warmup + size.steps + 1
    rows = [{"input_ids": row, "labels": row} for row in token_rows(size, steps * size.batch)]
    settings = engine_config(model.num_parameters())
    hand_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(hand_model.parameters(), lr=1e-3)
    engine = chunkmem.initialize(
        hand_model,
        optimizer=optimizer,
        config={**settings, "gradient_clipping": 1.0},
        lr_scheduler=transformers.get_scheduler("linear", optimizer, 0, steps),
    )
    loader = DataLoader(rows, batch_size=size.batch, collate_fn=transformers.default_data_collator)
    batches: Iterator[dict] = itertools.cycle(loader)

    def hand_step() -> None:
        batch = next(batches)
        count = batch["labels"][:, 1:].ne(-100).sum()
        engine.backward(engine(**batch, num_items_in_batch=count).loss)
        engine.step()

    alternation = Alternation(hand_step)
    with tempfile.TemporaryDirectory() as directory:
        args = transformers.TrainingArguments(
            output_dir=directory, per_device_train_batch_size=size.batch, max_steps=steps,
            learning_rate=1e-3, logging_steps=10**6, save_strategy="no", report_to=[],
            disable_tqdm=True, use_cpu=True, train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = ChunkmemTrainer(
            model=model, args=args, train_dataset=rows, chunkmem_config=settings,
            callbacks=[TrainerAlternation(alternation)],
        )  # fmt: skip
        trainer.train()
    trainer.engine.close()
    engine.close()
    return alternation


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args("integrations", __doc__.splitlines()[0], argv)
    size = QUICK if args.quick else FULL
    runs = {"lightning": lightning_run, "hf_trainer": hf_run}
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for _ in range(size.repeats):
        for name, run in runs.items():
            results[name].append(run(size).ratio(size.warmup))
    rows = [
        [name, repeat, framework, hand, ratio]
        for name, samples in results.items()
        for repeat, (framework, hand, ratio) in enumerate(samples)
    ]
    print_table(
        f"median step time, {size.layers}x{size.width} models, batch {size.batch}x"
        f"{size.sequence}, {size.steps} steps after {size.warmup} of warm-up",
        ["integration", "repeat", "framework s", "by hand s", "ratio"],
        rows,
    )
    ratios = {name: [ratio for _f, _h, ratio in samples] for name, samples in results.items()}
    metrics = {
        "lightning_step_time_ratio_vs_engine": median(ratios["lightning"]),
        "hf_trainer_step_time_ratio_vs_engine": median(ratios["hf_trainer"]),
    }
    details = {
        "size": size.__dict__,
        "ratio_range": {name: [min(r), max(r)] for name, r in ratios.items()},
        "repeats": {
            name: [
                {"framework_step_s": framework, "hand_step_s": hand, "ratio": ratio}
                for framework, hand, ratio in samples
            ]
            for name, samples in results.items()
        },
    }
    path = write_results(args.json, metrics, details, args.quick)
    print(f"\n{metrics}\nranges {details['ratio_range']}\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
