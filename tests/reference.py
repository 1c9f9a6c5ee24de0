"""Plain-PyTorch training loops the engine is checked against, and comparison helpers.

fp32: the model as given with ``torch.optim.Adam/AdamW(fused=True)``, torch's fastest CPU
Adam; chunkmem runs the same fused kernel, so results agree bit for bit. (The for-loop
implementation rounds differently in the last bit; Adam amplifies that on parameters whose
gradient is pure rounding noise, such as attention key biases, so it is not a useful
reference for a 1e-5 bound.)

bf16/fp16: the standard mixed-precision recipe written out by hand: a 16-bit copy of the
model for forward and backward, fp32 master weights updated by fused Adam, dynamic loss
scaling for fp16 (an overflow skips the step and halves the scale).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ReferenceRun:
    masters: dict[str, torch.Tensor]
    losses: list[float]
    skipped_steps: int


def train_reference(
    model: torch.nn.Module,
    batches: Sequence[tuple],
    *,
    precision: str = "fp32",
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    adamw: bool = True,
    gradient_accumulation_steps: int = 1,
    clip: float = 0.0,
    initial_scale: float = 2.0**16,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer_for: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> ReferenceRun:
    """Train a deep copy of ``model`` on ``batches`` (each a tuple of forward arguments);
    ``optimizer_for`` builds the optimizer over the masters (default: fused AdamW or Adam
    with ``lr`` and ``weight_decay``)."""
    dtype = DTYPES[precision]
    compute = copy.deepcopy(model).to(dtype)
    params = [p for p in compute.parameters() if p.requires_grad]
    originals = [p for p in model.parameters() if p.requires_grad]
    # Masters start from the original fp32 weights, not from their 16-bit rounding.
    masters = [p.detach().float().clone() for p in originals] if dtype != torch.float32 else params
    if optimizer_for is None:
        optimizer_cls = torch.optim.AdamW if adamw else torch.optim.Adam
        optimizer = optimizer_cls(masters, lr=lr, weight_decay=weight_decay, fused=True)
    else:
        optimizer = optimizer_for(masters)
    scale = initial_scale if precision == "fp16" else 1.0
    losses, skipped = [], 0
    for index, batch in enumerate(batches):
        batch = tuple(b.to(dtype) if b.is_floating_point() else b for b in batch)
        loss = compute(*batch) if loss_fn is None else loss_fn(compute, *batch)
        losses.append(float(loss.detach()))
        (loss * (scale / gradient_accumulation_steps)).backward()
        if (index + 1) % gradient_accumulation_steps:
            continue
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = False
        divisor = scale
        if clip > 0 or precision == "fp16":
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            norm = float(torch.linalg.vector_norm(torch.stack(norms))) / scale
            found_inf = not math.isfinite(norm)
            if clip > 0 and not found_inf:
                divisor = scale / min(1.0, clip / (norm + 1e-6))
        if found_inf:
            skipped += 1
            scale *= 0.5
        else:
            if dtype != torch.float32:
                for master, param in zip(masters, params, strict=True):
                    master.grad = None if param.grad is None else param.grad.float()
            # The fused kernel divides gradients by ``grad_scale`` (GradScaler's path).
            optimizer.grad_scale = None if divisor == 1.0 else torch.tensor(divisor)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if dtype != torch.float32:
                with torch.no_grad():
                    for master, param in zip(masters, params, strict=True):
                        param.copy_(master)
        for param in params:
            param.grad = None
    names = {id(p): n for n, p in compute.named_parameters()}
    result = {names[id(p)]: m.detach().clone() for p, m in zip(params, masters, strict=True)}
    return ReferenceRun(result, losses, skipped)


def max_relative_diff(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Max over tensors of max|ours - ref| / max|ref| (per-tensor normalised)."""
    worst = 0.0
    for name, ref in reference.items():
        mine = ours[name].float()
        ref = ref.float()
        denominator = float(ref.abs().max())
        diff = float((mine - ref).abs().max())
        worst = max(worst, diff / denominator if denominator > 0 else diff)
    return worst


def token_batches(count: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[tuple]:
    """(inputs, targets) pairs of random tokens, targets shifted by one."""
    data = torch.randint(
        0, vocab, (count, batch, seq + 1), generator=torch.Generator().manual_seed(seed)
    )
    return [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in data]


def train_engine(engine, batches: Sequence[tuple]) -> list[float]:
    """Drive ``engine`` over ``batches``: forward, backward, step; returns the losses."""
    losses = []
    for batch in batches:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses
