"""Evaluation of the three tasks over whole splits, gathered across processes.

- translation: beam search with `generate`, detokenized, scored by sacreBLEU cased and uncased
  (the paper reports case-insensitive BLEU on IWSLT14 and case-sensitive on WMT14);
- language modelling: perplexity = exp(mean token NLL) over every scored token of the split, and
  per word (PTB's convention) when the number of words is known;
- classification: accuracy and macro-F1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .batching import IGNORE_INDEX
from .losses import sequence_nll
from .metrics import decode_for_bleu, load_metric, perplexity


@torch.no_grad()
def translate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, tokenizer: Any,
              **generate_kwargs: Any) -> tuple[list[str], list[str]]:
    """Detokenized translations and references of every example of `loader`, in order."""
    model.eval()
    predictions, references = [], []
    for batch in tqdm(loader, desc="Generating", disable=not accelerator.is_local_main_process, leave=False):
        generated = accelerator.unwrap_model(model).generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **generate_kwargs)
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=IGNORE_INDEX)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        predictions += decode_for_bleu(tokenizer, generated)
        references += decode_for_bleu(tokenizer, labels)
    model.train()
    return predictions, references


def bleu_scores(predictions: list[str], references: list[str]) -> dict[str, float | str]:
    """sacreBLEU cased (`bleu`) and uncased (`bleu_lowercase`), with the cased signature."""
    metric = load_metric("sacrebleu")
    single = [[r] for r in references]
    cased = metric.compute(predictions=predictions, references=single)
    uncased = metric.compute(predictions=predictions, references=single, lowercase=True)
    return {"bleu": cased["score"], "bleu_lowercase": uncased["score"], "bleu_signature": cased["signature"]}


def evaluate_bleu(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, tokenizer: Any,
                  predictions_file: str | Path | None = None, **generate_kwargs: Any) -> dict[str, float | str]:
    """Beam search (or whatever `generate_kwargs` ask) on a split and its BLEU; the translations go
    to `predictions_file` (one per line, the split's order) when given, from the main process, and
    the references BLEU scored them against to `references_file(predictions_file)` beside it (what a
    paired bootstrap over sentences needs)."""
    predictions, references = translate(accelerator, model, loader, tokenizer, **generate_kwargs)
    if predictions_file is not None and accelerator.is_main_process:
        for path, lines in ((Path(predictions_file), predictions), (references_file(predictions_file), references)):
            path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")
    return bleu_scores(predictions, references)


def references_file(predictions_file: str | Path) -> Path:
    """Where `evaluate_bleu` writes the references of `predictions_file`'s translations."""
    return Path(predictions_file).with_name("generated_references.txt")


@torch.no_grad()
def evaluate_perplexity(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader,
                        num_words: int | None = None) -> dict[str, float | int]:
    """exp(mean NLL) over every scored token of the split (per-block sums gathered over processes);
    with `num_words`, also `word_perplexity` = exp(the same total NLL / words)."""
    model.eval()
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sums, counts = accelerator.gather_for_metrics(sequence_nll(logits, batch["labels"]))  # (blocks,) each
        nll += sums.double().sum().cpu()
        count += int(counts.sum())
    model.train()
    scores: dict[str, float | int] = {"perplexity": perplexity(float(nll), count), "loss": float(nll) / count,
                                      "tokens": count, "nll": float(nll)}
    if num_words:
        scores["word_perplexity"] = perplexity(float(nll), num_words)
    return scores


@torch.no_grad()
def evaluate_accuracy(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader,
                      num_labels: int) -> dict[str, float | int]:
    """Accuracy and macro-F1 over every example of the split, gathered across processes."""
    model.eval()
    predictions, references = [], []
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        predicted, labels = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        predictions += predicted.tolist()
        references += labels.tolist()
    model.train()
    scores = load_metric("accuracy_f1").compute(predictions=predictions, references=references, num_labels=num_labels)
    return {"accuracy": scores["accuracy"], "macro_f1": scores["macro_f1"], "examples": len(references)}


def score_splits(evaluate: Callable[[str, DataLoader], dict[str, Any]],
                 loaders: dict[str, DataLoader]) -> dict[str, Any]:
    """`evaluate(split, loader)` for every split, its keys prefixed by the split's name."""
    results: dict[str, Any] = {}
    for split, loader in loaders.items():
        results.update({f"{split}_{k}": v for k, v in evaluate(split, loader).items()})
    return results
