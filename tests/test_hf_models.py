"""Hugging Face models through ``chunkmem.initialize``, built from small configs (no weights are
downloaded): they train bit for bit like plain PyTorch, evaluate and generate.

GPT-2 trains on a simulated device of half its model-state bytes with activation
checkpointing; Llama's RMSNorm reads its input twice beside the residual, which the engine's
hooks must not reorder (docs/architecture.md, exactness); T5's decoder reads the encoder
output in every layer; BERT ties its decoder to the word embeddings.
"""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.chunk import ChunkKind
from tests.reference import train_reference

transformers = pytest.importorskip("transformers")
from tests.hf_helpers import VOCAB, batches, causal_lm_loss, gpt2, llama, state_bytes  # noqa: E402

STEPS = 10
OPTIMIZER_KINDS = {ChunkKind.MASTER.value, ChunkKind.EXP_AVG.value, ChunkKind.EXP_AVG_SQ.value}


def train(engine, data, loss_fn=causal_lm_loss) -> list[float]:
    losses = []
    for batch in data:
        loss = loss_fn(engine, *batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def train_both(
    model: torch.nn.Module,
    data: list[tuple],
    precision: str = "fp32",
    loss_fn=causal_lm_loss,
    **config,
) -> tuple[chunkmem.Engine, list[float]]:
    """Train ``model`` with plain torch and through the engine on a simulated device of half
    its model-state bytes; assert the two agree bit for bit. Returns the engine and losses."""
    reference = train_reference(model, data, precision=precision, loss_fn=loss_fn)
    capacity = state_bytes(model, precision) // 2
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={
            "precision": precision,
            "device": {"type": "simulated", "capacity": capacity},
            **config,
        },
    )
    losses = train(engine, data, loss_fn)
    assert engine.ledger.device.peak <= capacity
    assert losses == reference.losses
    state = engine.state_dict()
    differ = [
        name for name, value in reference.masters.items() if not torch.equal(state[name], value)
    ]
    assert differ == [], f"{len(differ)} of {len(reference.masters)} tensors differ: {differ[:5]}"
    return engine, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt2_on_half_its_state_bytes_with_checkpointing_matches_torch_bit_for_bit(
    precision: str,
) -> None:
    engine, _ = train_both(gpt2(checkpointing=True), batches(), precision)
    assert engine.ledger.bytes_moved(STEPS - 1) > 0, "the model must not fit: chunks must move"
    # Tied embeddings stay one tensor: the LM head reads the trained word embeddings.
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight


def test_llama_matches_torch_bit_for_bit_in_fp32() -> None:
    """RMSNorm reads its input twice and the residual a third time; with a hook node on the
    block's inputs, autograd summed those in another order (6.7e-5 off in 10 steps)."""
    train_both(llama(), batches())


def test_llama_trains_in_bf16() -> None:
    data = batches(count=1) * STEPS  # one batch again and again: the loss must fall
    _, losses = train_both(llama(), data, "bf16")
    assert losses[-1] < 0.9 * losses[0]


def test_bert_masked_lm_with_tied_decoder_matches_torch_bit_for_bit() -> None:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    engine, _ = train_both(transformers.BertForMaskedLM(config).train(), batches(count=4))
    assert (
        engine.module.cls.predictions.decoder.weight
        is engine.module.bert.embeddings.word_embeddings.weight
    )


def seq2seq_loss(model, ids, mask, labels) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=labels.roll(1, dims=1)).loss


def test_t5_whose_decoder_reads_the_encoder_output_in_every_layer_matches_torch() -> None:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=1, pad_token_id=1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    # unit_elements 1: the cross-attention is a hooked unit of its own
    train_both(model, batches(count=4), loss_fn=seq2seq_loss, placement={"unit_elements": 1})


def test_generate_after_training_equals_the_plain_model_and_records_one_trace() -> None:
    """``engine.module.generate`` runs every decoding step as an evaluation cycle: one trace
    for all sequence lengths, no gradients, no optimizer state moved; and the same tokens as
    the plain model holding the trained weights."""
    model = gpt2()
    engine = chunkmem.initialize(
        copy.deepcopy(model),
        config={"device": {"type": "simulated", "capacity": state_bytes(model, "fp32") // 2}},
    )
    data = batches(count=3)
    train(engine, data)
    plain = copy.deepcopy(model)
    plain.load_state_dict(engine.state_dict())
    plain.eval()
    engine.eval()
    assert not engine.training and not engine.module.training
    prompt, mask, _ = data[0]
    recorded, moves = engine.tracer.cycles_recorded, len(engine.ledger.moves)
    ours = engine.module.generate(
        input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False
    )
    expected = plain.generate(
        input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False
    )
    assert torch.equal(ours, expected)
    assert engine.tracer.cycles_recorded - recorded == 1, "one evaluation trace for all 8 steps"
    assert {m.kind for m in engine.ledger.moves[moves:]} & OPTIMIZER_KINDS == set()
    with torch.no_grad():
        logits = engine(input_ids=prompt, attention_mask=mask).logits
    assert torch.equal(logits, plain(input_ids=prompt, attention_mask=mask).logits)
    assert engine.train() is engine and engine.module.training
    train(engine, data[:1])  # training goes on after evaluation
    assert engine.global_steps == 4


def test_no_grad_forward_in_the_middle_of_a_training_cycle_is_refused() -> None:
    engine = chunkmem.initialize(
        gpt2(), config={"device": {"type": "simulated", "capacity": "64MiB"}}
    )
    ids, mask, labels = batches(count=1)[0]
    engine(input_ids=ids, attention_mask=mask, labels=labels)
    with (
        torch.no_grad(),
        pytest.raises(chunkmem.EngineUsageError, match="middle of a training cycle"),
    ):
        engine.module.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    engine.discard()
    with torch.no_grad():
        engine.module(input_ids=ids)  # fine once the cycle is dropped
