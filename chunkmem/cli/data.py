"""Text as bytes for ``chunkmem train``: Python's own sources by default, batches of random
windows, and sampling from the trained model."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from chunkmem.errors import ConfigError


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's Python sources, concatenated in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def read_text(path: str | None, max_bytes: int, seq: int) -> torch.Tensor:
    """The bytes of ``path`` (None: the standard library's sources) as an int64 tensor."""
    if path is None:
        text = stdlib_text(max_bytes)
    else:
        try:
            with open(path, "rb") as file:
                text = file.read(max_bytes)
        except OSError as error:
            raise ConfigError(f"train.data: cannot read {path!r}: {error.strerror}") from None
    # Training and held-out windows each need at least one sequence plus its next token.
    if len(text) < 40 * (seq + 1):
        raise ConfigError(
            f"train.data {path or 'stdlib'!r} holds {len(text):,} bytes, too few for windows of "
            f"{seq + 1} bytes with a held-out part: give a longer text or a smaller model.seq"
        )
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(
    data: torch.Tensor, batch: int, seq: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) pairs of ``batch`` random windows; targets are the inputs
    shifted by one byte. The windows depend only on ``generator``'s state, which a
    checkpoint saves, so a resumed run reads what the uninterrupted one would have."""
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@torch.no_grad()
def sample(
    forward: Callable[[torch.Tensor], torch.Tensor], prompt: bytes, length: int, block: int
) -> str:
    """Continue ``prompt`` by sampling (temperature 0.8) from ``forward``'s logits."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor(list(prompt), dtype=torch.long)[None]
    for _ in range(length):
        logits = forward(tokens[:, -block:])[:, -1].float() / 0.8
        choice = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, choice], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
