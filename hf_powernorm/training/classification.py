"""The sentence-classification task `classification` of `recipes/train_classification.py`: its
arguments, its data (sentences and labels, the Financial PhraseBank among them), its class names,
and accuracy and macro-F1. The recipe and `hf_powernorm.studies.converted_models` run it through
`run_task` with `main(argv)`; `hf-powernorm compare` fine-tunes a pretrained classifier with it.
"""

from __future__ import annotations

import argparse
from typing import Any

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from ..modeling_powernorm import PowerNormTransformerForSequenceClassification
from .arguments import DATA_FILE_OPTIONS, RecipeParser, add_recipe_args, check_args
from .corpora import SENTIMENT_LABELS
from .evaluation import evaluate_accuracy
from .options import BadInput, add_task_option
from .readers import (
    data_files_from_args,
    label_names_of,
    limit_splits,
    load_classification_dataset,
    load_hub_dataset,
    read_lines,
    read_table,
    rename_columns,
)
from .tasks import Task, register_task, run_task
from .tokenization import column_texts, tokenize_classification

# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128, "encoder_layers": 2, "dropout": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return check_options(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    p = RecipeParser(description="Train a PowerNorm Transformer sentence classifier.")
    add_recipe_args(p, vocab_size=1000, learning_rate=1e-3, num_warmup_steps=100, num_train_epochs=5,
                    output_dir="outputs/classification")
    p.add_argument("--phrasebank_file", help="a Financial PhraseBank file (sentence@label per line)")
    add_task_option(p, "label_names", default=",".join(SENTIMENT_LABELS))
    add_task_option(p, "max_length", help="truncate sentences to this many tokens")
    for name in Classification.column_options:
        add_task_option(p, name)
    return p


def check_options(args: argparse.Namespace) -> argparse.Namespace:
    """The recipes' checks, then that the training data comes from one option."""
    check_args(args, path_options=Classification.input_path_options)
    if args.phrasebank_file and args.train_file:
        raise BadInput("give either --phrasebank_file or --train_file, not both")
    return args


@register_task("classification")
class Classification(Task):
    """Cross-entropy of a linear head on the mean of the encoder's real tokens; accuracy and macro-F1."""

    script = "recipes/train_classification.py"
    model_class, auto_class = PowerNormTransformerForSequenceClassification, AutoModelForSequenceClassification
    build_parser, check_options = staticmethod(build_parser), staticmethod(check_options)
    pretrained_auto_class = "AutoModelForSequenceClassification"
    default_size = DEFAULT_SIZE
    metric, mode = "accuracy", "max"
    corpus = "the embedded sentiment corpus"
    description = "A PowerNorm Transformer sentence classifier trained on {data}."
    input_path_options = (*DATA_FILE_OPTIONS, "phrasebank_file")
    needed_columns = "'text' (or 'sentence') and 'label'"
    column_options = ("text_column", "label_column")
    own_options = ("max_length", "label_names")
    decoder_batches = False
    labels: list[str] = []  # the class names, in the order of the label ids

    def load_data(self, accelerator: Accelerator) -> dict:
        """Sentences and labels -> tokenizer -> cached token ids; keeps the class names."""
        args = self.args
        raw = self.read_splits(args.seed)
        if "train" not in raw and args.do_train:
            raise BadInput(f"no train split; got {list(raw)} (pass --train_file or --phrasebank_file)")
        raw = limit_splits(raw, args.max_train_samples, args.max_eval_samples)
        self.prepare_tokenizer(accelerator, lambda: column_texts(raw["train"]))
        self.labels = label_names_of(raw)
        with accelerator.main_process_first():
            return self.tokenize(raw, self.tokenizer)

    def read_splits(self, seed: int):
        """Sentences and labels (`--text_column`/`--label_column` name other columns); the labels
        encoded as ids of `--label_names`, missing splits carved out of train with `seed`."""
        args = self.args
        files = data_files_from_args(args.train_file or args.phrasebank_file, args.validation_file, args.test_file)
        names = args.label_names.split(",") if isinstance(args.label_names, str) else args.label_names
        columns = {"text": args.text_column, "label": args.label_column}
        raw = load_classification_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config,
                                          data_files=files, label_names=names, seed=seed, columns=columns)
        for split, part in raw.items():
            if "label" not in part.column_names:
                raise BadInput(f"no label was found: --task {self.name} needs {self.needed_columns} columns; split "
                               f"{split!r} has {part.column_names} (name yours with --text_column and "
                               f"--label_column)")
        return raw

    def tokenize(self, raw, tokenizer):
        return tokenize_classification(raw, tokenizer, self.args.max_length, **self.tokenize_options())

    def resolve_labels(self) -> None:
        """`--label_names` (class names in the order of label ids) as a list: as given, else the
        embedded corpus's three classes without data, else the data's labels matched to the
        pretrained model's `id2label` (`names_for_labels`)."""
        args = self.args
        if isinstance(args.label_names, str):  # as given on the command line
            args.label_names = [name.strip() for name in args.label_names.split(",")]
        elif args.label_names is None and args.train_file is None and args.dataset_name is None:
            args.label_names = list(SENTIMENT_LABELS)
        elif args.label_names is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(args.model_name_or_path,
                                                trust_remote_code=bool(args.trust_remote_code))
            args.label_names = names_for_labels(self.data_labels(),
                                                [str(config.id2label[i]) for i in range(config.num_labels)])
        self.labels = list(args.label_names)

    def data_labels(self) -> list[Any] | tuple[str, ...]:
        """The distinct labels of the training data (a ClassLabel's names as a tuple), read before the
        readers encode them."""
        from datasets import ClassLabel

        args = self.args
        columns = {"label": args.label_column}
        if args.dataset_name:
            part = rename_columns(next(iter(load_hub_dataset(args.dataset_name, args.dataset_config).values())),
                                  columns, args.dataset_name)
        elif args.train_file.endswith((".csv", ".json", ".jsonl")):
            part = rename_columns(read_table(args.train_file), columns, args.train_file)
        else:  # Financial PhraseBank 'sentence@label' lines
            labels = sorted({line.rsplit("@", 1)[-1].strip() for line in read_lines(args.train_file) if "@" in line})
            if not labels:
                raise BadInput(f"{args.train_file}: no label was found: expected 'sentence@label' lines, or a CSV "
                               f"or JSON lines file with a label column")
            return labels
        if "label" not in part.column_names:
            raise BadInput(f"no label was found: --task {self.name} needs {self.needed_columns} columns; the data has "
                           f"{part.column_names} (name yours with --text_column and --label_column)")
        feature = part.features["label"]
        return tuple(feature.names) if isinstance(feature, ClassLabel) else sorted(set(part["label"]), key=str)

    def label_fields(self) -> dict[str, Any]:
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)),
                "label2id": {name: i for i, name in enumerate(self.labels)}}

    def pretrained_fields(self) -> dict[str, Any]:
        """The class names as the config's fields; a head of another size is rebuilt."""
        from transformers import AutoConfig

        fields = self.label_fields()
        trust_remote_code = bool(getattr(self.args, "trust_remote_code", False))
        if AutoConfig.from_pretrained(self.args.model_name_or_path,
                                      trust_remote_code=trust_remote_code).num_labels != len(self.labels):
            fields["ignore_mismatched_sizes"] = True
        return fields

    def describe(self, data: dict) -> str:
        return f"{len(data.get('train', []))} training sentences, classes {self.labels}"

    def model_fields(self) -> dict:
        return {**super().model_fields(), **self.label_fields()}

    def evaluate(self, accelerator: Accelerator, model, loader: DataLoader, split: str) -> dict:
        return evaluate_accuracy(accelerator, model, loader, len(self.labels))

    def summary(self, results: dict, split: str) -> str:
        return f"accuracy {results[f'{split}_accuracy']:.4f}, macro-F1 {results[f'{split}_macro_f1']:.4f}"

    def training_data(self) -> str:
        return self.args.dataset_name or self.args.phrasebank_file or self.args.train_file or self.corpus


def names_for_labels(labels: list[Any] | tuple[str, ...], model_names: list[str]) -> list[str]:
    """Class names for the data's `labels` (its distinct values, or a ClassLabel's names as a tuple):
    the model's names when they cover the data (its classification head stays as trained), else the
    data's own (integers 0..k-1 named "0".."k-1", strings sorted)."""
    if isinstance(labels, tuple):
        return list(labels)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        if min(labels) < 0:
            raise BadInput(f"class labels must be names or indices from 0; the data has {min(labels)}")
        count = max(labels) + 1
        return model_names if len(model_names) == count else [str(i) for i in range(count)]
    names = sorted({str(v).strip() for v in labels})
    return model_names if set(names) <= set(model_names) else names


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    return run_task(Classification(parse_args(argv)), argv)

