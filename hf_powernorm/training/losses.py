"""Losses: label-smoothed cross-entropy (the paper's translation loss, smoothing 0.1) and the
per-sequence token NLL that perplexity is computed from."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .batching import IGNORE_INDEX


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Mean label-smoothed cross-entropy of `(N, V)` float logits (what `F.cross_entropy` with
    `label_smoothing` computes), with the gradient written in one go from the saved log-softmax:
    `s * (exp(log p) - eps / V)` per scored row (`s` the output gradient over the scored rows),
    then `-s * (1 - eps)` at each target. Autograd through `F.cross_entropy` builds the same
    gradient from a zero-filled `(N, V)` buffer, a second dense buffer for the smoothing term, their
    sum and log-softmax's backward: at the studies' vocabulary the loss was a quarter of a CPU
    training step (BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
        scored = labels != IGNORE_INDEX
        targets = labels.masked_fill(~scored, 0).unsqueeze(-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        per_row = -(1.0 - label_smoothing) * log_probs.gather(-1, targets).squeeze(-1)
        if label_smoothing:
            per_row = per_row - label_smoothing * log_probs.mean(dim=-1)
        count = scored.sum()
        ctx.save_for_backward(log_probs, targets, scored, count)
        ctx.label_smoothing = label_smoothing
        return torch.where(scored, per_row, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        log_probs, targets, scored, count = ctx.saved_tensors
        eps = ctx.label_smoothing
        row_scale = (scored.to(log_probs.dtype) * (grad_output / count)).unsqueeze(-1)  # 0 on ignored rows
        grad = torch.exp(log_probs)
        if eps:
            grad.sub_(eps / log_probs.size(-1))
        grad.mul_(row_scale).scatter_add_(-1, targets, row_scale * -(1.0 - eps))
        return grad, None, None


def check_label_smoothing(value: float, name: str = "label_smoothing") -> None:
    """Refuse a smoothing weight outside [0, 1) (1 would ignore the labels), naming the option."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {value}")


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean label-smoothed cross-entropy over the non-ignored (-100) positions of aligned `logits`
    and `labels`: `(1 - eps) * NLL + eps * mean over the vocabulary of -log p` per token (what
    `F.cross_entropy(label_smoothing=eps)` computes; NaN when no position is scored, as there).
    Computed in float32 whatever the logits' dtype.
    """
    check_label_smoothing(label_smoothing)
    return _SmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                                       float(label_smoothing))


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with a causal LM's logits: position t scores the label at t + 1, the last
    position none (-100). Scoring the full logits against these avoids copying `logits[:, :-1]`."""
    return torch.cat([labels[..., 1:], labels.new_full((*labels.shape[:-1], 1), IGNORE_INDEX)], dim=-1)


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
    check_label_smoothing(label_smoothing)
    if label_smoothing == 0.0:
        return model_loss

    def compute(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        return label_smoothed_loss(logits, next_token_labels(labels), label_smoothing)

    return compute


def model_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss (causal LM: mean next-token NLL; classification: cross-entropy)."""
    return model(**batch).loss
