"""A small model with two parameter groups and a frozen layer, and its plain-PyTorch training.

The reference is ``torch.optim.AdamW(fused=True)``, the kernel chunkmem runs on the device and
the native host optimizer reproduces bit for bit, so the engine's parameters must match
it to the last bit wherever the states live. Under data parallelism the reference adds the
ranks' gradients as the reduce-scatter does (for two ranks, ``g0 + g1``: one rounding, in
either order) and divides in the kernel, as the engine does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 96
LAYERS = 6
CHUNK = 4096  # elements: a dozen chunk groups, so updates can start while backward goes on


class Net(nn.Module):
    """An MLP whose forward returns the loss; ``frozen`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.hidden = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(LAYERS)
        )
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        return F.mse_loss(self.out(h), y)


def param_groups(model: nn.Module) -> list[dict]:
    """Matrices decay; biases and norms do not, with their own lr, betas and eps."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {
            "params": [p for _n, p in trainable if p.ndim == 2],
            "lr": 2e-3,
            "weight_decay": 0.05,
            "betas": (0.9, 0.95),
        },
        {
            "params": [p for _n, p in trainable if p.ndim < 2],
            "lr": 5e-3,
            "weight_decay": 0.0,
            "betas": (0.8, 0.99),
            "eps": 1e-7,
        },
    ]


def batches(count: int, rows: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 16, generator=generator), torch.randn(rows, 4, generator=generator))
        for _ in range(count)
    ]


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def train_torch(
    model: nn.Module,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ranks: int = 1,
    after_step: Callable[[torch.optim.Optimizer], None] | None = None,
    precision: str = "fp32",
) -> dict[str, torch.Tensor]:
    """Train a copy of ``model`` with ``torch.optim.AdamW(fused=True)``; each batch is split
    into ``ranks`` equal slices whose gradients are summed, then divided by ``ranks``.

    bf16: the usual mixed-precision recipe: a bf16 copy computes, fp32 masters (from the
    original weights) take the widened gradients and are copied back. Returns the fp32
    values (the masters)."""
    compute = copy.deepcopy(model)
    masters = compute
    if precision == "bf16":
        compute = compute.to(torch.bfloat16)
        masters = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(param_groups(masters), fused=True)
    pairs = [
        (c, m)
        for c, m in zip(compute.parameters(), masters.parameters(), strict=True)
        if c.requires_grad
    ]
    for x, y in data:
        grads = None
        for x_r, y_r in zip(x.chunk(ranks), y.chunk(ranks), strict=True):
            compute(
                x_r.to(precision_dtype(precision)), y_r.to(precision_dtype(precision))
            ).backward()
            mine = [c.grad.float() for c, _m in pairs]
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine, strict=True)]
            for c, _m in pairs:
                c.grad = None
        for (_c, m), g in zip(pairs, grads, strict=True):
            m.grad = g
        optimizer.grad_scale = None if ranks == 1 else torch.tensor(float(ranks))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(optimizer)
        if compute is not masters:
            with torch.no_grad():
                for c, m in pairs:
                    c.copy_(m)
    return {n: p.detach().clone() for n, p in masters.named_parameters()}


def precision_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def round_moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    """What bf16 moments do after each step: the moments stored rounded to bf16."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(state[key].bfloat16())


def initialize(model: nn.Module, comm=None, **config) -> object:
    """An engine with the two parameter groups; a rank of ``comm``'s world when given."""
    import chunkmem

    return chunkmem.initialize(
        model,
        optimizer=torch.optim.AdamW(param_groups(model)),
        config={"chunk": {"size": CHUNK}, **config},
        comm=comm,
    )


def train_engine(engine, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """The same tensors under the same names, bit for bit."""
    assert ours.keys() == theirs.keys()
    differ = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert differ == [], f"{len(differ)} of {len(ours)} tensors differ: {differ}"


def max_rel_diff(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, ref in reference.items():
        diff = float((ours[name].float() - ref.float()).abs().max())
        scale = float(ref.abs().max())
        worst = max(worst, diff / scale if scale else diff)
    return worst
