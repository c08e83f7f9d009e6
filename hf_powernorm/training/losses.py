"""Losses: label-smoothed cross-entropy (the paper's translation loss, smoothing 0.1) and the
per-sequence token NLL that perplexity is computed from."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .batching import IGNORE_INDEX


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean label-smoothed cross-entropy over the non-ignored (-100) positions of aligned `logits`
    and `labels`: `(1 - eps) * NLL + eps * mean over the vocabulary of -log p` per token (what
    `F.cross_entropy(label_smoothing=eps)` computes). Computed in float32 whatever the logits' dtype.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed token NLL and scored-token counts, each `(batch,)`.

    `shift=True` for a causal LM (the logits at position t predict the label at t + 1). Per-row
    values can be gathered across processes with `gather_for_metrics` (which drops duplicates).
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="none")
    return nll.view(labels.shape).sum(-1), (labels != IGNORE_INDEX).sum(-1)


def token_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token NLL over the batch and the number of scored tokens."""
    nll, count = sequence_nll(logits, labels, shift)
    return nll.sum(), count.sum()


def translation_loss(accelerator, label_smoothing: float) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """Label-smoothed cross-entropy with teacher forcing for a seq2seq model. Labels are not passed
    to the model, so it computes no loss of its own; it builds the decoder inputs from them."""
    def compute(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inputs["decoder_input_ids"] = accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels(labels)
        return label_smoothed_loss(model(**inputs).logits, labels, label_smoothing)

    return compute


def causal_lm_loss(label_smoothing: float = 0.0) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """Label-smoothed next-token cross-entropy of a causal LM (the logits at t score the label at
    t + 1); with no smoothing, the model's own loss."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    if label_smoothing == 0.0:
        return model_loss

    def compute(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        return label_smoothed_loss(logits[..., :-1, :], labels[..., 1:], label_smoothing)

    return compute


def model_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss (causal LM: mean next-token NLL; classification: cross-entropy)."""
    return model(**batch).loss
