"""Metrics: the local `evaluate` modules (sacreBLEU, accuracy and macro-F1) that load offline,
perplexity over a whole stream, and the decoding of ids for BLEU.

The modules live in `metric_modules/` inside the package, so `load_metric("sacrebleu")` works
wherever the package is installed, without the Hub.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .batching import IGNORE_INDEX

METRICS_DIR = Path(__file__).resolve().parent / "metric_modules"


def load_metric(name: str, **kwargs: Any):
    """One of the `evaluate` metric modules in `metric_modules/` (loads offline)."""
    import evaluate

    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        available = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"unknown metric {name!r}; available in {METRICS_DIR}: {available}")
    return evaluate.load(str(path), **kwargs)


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp of the mean token NLL over the whole evaluated stream."""
    if num_tokens <= 0:
        raise ValueError(f"perplexity needs at least one scored token; got {num_tokens}")
    mean = float(nll_sum) / int(num_tokens)
    return math.exp(mean) if mean < 700 else float("inf")


def decode_for_bleu(tokenizer, token_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
    """Detokenized text of generated or label ids (-100 and special tokens dropped)."""
    rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else [list(r) for r in token_ids]
    rows = [[t for t in row if t != IGNORE_INDEX] for row in rows]
    return [text.strip() for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


class OncePerMessage(logging.Filter):
    """Lets each distinct message of a logger through once (e.g. sacrebleu's warning about
    tokenized periods, which it repeats at every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def count_words(lines: Iterable[str]) -> int:
    """Words of a language-modelling split, the end of each line counted as one (PTB's convention
    for word-level perplexity)."""
    return sum(len(line.split()) + 1 for line in lines)
