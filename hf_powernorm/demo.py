"""A short demo of every norm: a few training steps of a tiny pre-norm residual stack.

    python -m hf_powernorm.demo [--steps 40] [--seed 0]

The task is synthetic and generated in memory (no download): predict, for each token of a padded
batch, the parity of the sum of its own id and its left neighbour's. Each norm trains the same
stack from the same initial weights; the demo prints the first and last loss and, for norms with
running statistics, the state of their buffers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from .normalization import NORM_CLASSES, build_norm

VOCAB, HIDDEN, HEADS = 50, 64, 4


class TinyStack(nn.Module):
    """Embedding -> 2 x (norm -> feed-forward -> residual) -> final norm -> classifier."""

    def __init__(self, norm_name: str, group_num: int):
        super().__init__()
        options = {"group_num": group_num} if norm_name in ("powernorm", "groupnorm") else {}
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=2)  # sees the left neighbour
        self.norms = nn.ModuleList(build_norm(norm_name, HIDDEN, **options) for _ in range(3))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN)) for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)  # (batch, seq, hidden)
        hidden = self.mix(F.pad(hidden.transpose(1, 2), (1, 0))).transpose(1, 2)
        for norm, ffn in zip(self.norms, self.ffns):
            hidden = hidden + ffn(norm(hidden, attention_mask))
        return self.head(self.norms[-1](hidden, attention_mask))


def make_batch(generator: torch.Generator, batch: int = 16, seq: int = 24):
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    previous = F.pad(input_ids, (1, 0))[:, :-1]
    labels = ((input_ids + previous) % 2).masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def train(norm_name: str, steps: int, seed: int) -> tuple[float, float, nn.Module]:
    torch.manual_seed(seed)
    model = TinyStack(norm_name, group_num=HEADS)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        input_ids, attention_mask, labels = make_batch(generator)
        logits = model(input_ids, attention_mask)
        loss = F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-5:]) / 5, model


def describe_buffers(norm: nn.Module) -> str:
    parts = []
    for name, buf in norm.named_buffers():
        if buf.dim() == 0:
            parts.append(f"{name}={int(buf)}")
        else:
            parts.append(f"{name} mean={buf.mean():.3g} [{buf.min():.3g}, {buf.max():.3g}]")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"Tiny pre-norm stack, hidden {HIDDEN}, {args.steps} Adam steps per norm, padded batches")
    print(f"{'norm':<12}{'first loss':>12}{'last loss':>12}   running statistics of the first norm")
    for name in NORM_CLASSES:
        first, last, model = train(name, args.steps, args.seed)
        print(f"{name:<12}{first:>12.4f}{last:>12.4f}   {describe_buffers(model.norms[0]) or '-'}")


if __name__ == "__main__":
    main()
