"""The sentence-classification task of `recipes/train_classification.py`: its arguments, its
data (sentences and labels, the Financial PhraseBank among them), and accuracy and macro-F1. The
recipe and `hf_powernorm.studies.converted_models` run it through `run_task` with `main(argv)`.
"""

from __future__ import annotations

import argparse

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from ..modeling_powernorm import PowerNormTransformerForSequenceClassification
from .arguments import add_recipe_args, check_args
from .corpora import SENTIMENT_LABELS
from .evaluation import evaluate_accuracy
from .readers import data_files_from_args, label_names_of, limit_splits, load_classification_dataset
from .tasks import Task, run_task
from .tokenization import column_texts, tokenize_classification

# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128, "encoder_layers": 2, "dropout": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer sentence classifier.")
    add_recipe_args(p, vocab_size=1000, learning_rate=1e-3, num_warmup_steps=100, num_train_epochs=5,
                    output_dir="outputs/classification")
    p.add_argument("--phrasebank_file", help="a Financial PhraseBank file (sentence@label per line)")
    p.add_argument("--label_names", default=",".join(SENTIMENT_LABELS),
                   help="comma-separated class names of local files (Hub datasets bring their own)")
    p.add_argument("--max_length", type=int, default=128, help="truncate sentences to this many tokens")
    args = p.parse_args(argv)
    check_args(args)
    if args.phrasebank_file and args.train_file:
        raise ValueError("give either --phrasebank_file or --train_file, not both")
    return args


class Classification(Task):
    """Cross-entropy of a linear head on the mean of the encoder's real tokens; accuracy and macro-F1."""

    script = "recipes/train_classification.py"
    model_class, auto_class = PowerNormTransformerForSequenceClassification, AutoModelForSequenceClassification
    default_size = DEFAULT_SIZE
    metric, mode = "accuracy", "max"
    corpus = "the embedded sentiment corpus"
    description = "A PowerNorm Transformer sentence classifier trained on {data}."

    def load_data(self, accelerator: Accelerator) -> dict:
        """Sentences and labels -> tokenizer -> cached token ids; keeps the class names."""
        args = self.args
        files = data_files_from_args(args.train_file or args.phrasebank_file, args.validation_file, args.test_file)
        raw = load_classification_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config,
                                          data_files=files, label_names=args.label_names.split(","), seed=args.seed)
        if "train" not in raw and args.do_train:
            raise ValueError(f"no train split; got {list(raw)} (pass --train_file or --phrasebank_file)")
        raw = limit_splits(raw, args.max_train_samples, args.max_eval_samples)
        self.prepare_tokenizer(accelerator, lambda: column_texts(raw["train"]))
        self.labels = label_names_of(raw)
        with accelerator.main_process_first():
            return tokenize_classification(raw, self.tokenizer, args.max_length,
                                           num_proc=args.preprocessing_num_workers,
                                           overwrite_cache=args.overwrite_cache)

    def describe(self, data: dict) -> str:
        return f"{len(data.get('train', []))} training sentences, classes {self.labels}"

    def model_fields(self) -> dict:
        return {**super().model_fields(), "num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)),
                "label2id": {name: i for i, name in enumerate(self.labels)}}

    def evaluate(self, accelerator: Accelerator, model, loader: DataLoader, split: str) -> dict:
        return evaluate_accuracy(accelerator, model, loader, len(self.labels))

    def summary(self, results: dict, split: str) -> str:
        return f"accuracy {results[f'{split}_accuracy']:.4f}, macro-F1 {results[f'{split}_macro_f1']:.4f}"

    def training_data(self) -> str:
        return self.args.dataset_name or self.args.phrasebank_file or self.args.train_file or self.corpus


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    return run_task(Classification(parse_args(argv)), argv)

