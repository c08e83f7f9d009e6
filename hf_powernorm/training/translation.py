"""The translation task `seq2seq` of `recipes/train_wmt.py` (the paper's Section 5.1): its
arguments, its data (source/target pairs, joint BPE), its label-smoothed loss and BLEU of beam
search. The recipe and the studies that translate (`hf_powernorm.studies.norm_comparison`,
`tuned_comparison`) run it through `run_task`; `hf-powernorm compare` fine-tunes a pretrained
sequence-to-sequence model with it (pairs from two text columns too, e.g. summaries).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from accelerate import Accelerator
from torch.utils.data import DataLoader

from ..modeling_powernorm import PowerNormTransformerForConditionalGeneration
from .arguments import RecipeParser, add_recipe_args, check_args
from .batching import PaddingCollator
from .evaluation import evaluate_bleu
from .losses import check_label_smoothing, translation_loss
from .metrics import OncePerMessage
from .options import BadInput, add_task_option
from .readers import data_files_from_args, limit_splits, load_translation_dataset
from .tasks import Task, register_task, run_task
from .tokenization import tokenize_translation, translation_texts

# sacrebleu warns about tokenized text (the embedded corpus is) at every validation: once is enough.
logging.getLogger("sacrebleu").addFilter(OncePerMessage())


# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return check_options(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    p = RecipeParser(description="Train a PowerNorm Transformer for translation.")
    add_recipe_args(p, eval_batch_size=64, output_dir="outputs/translation")
    add_task_option(p, "source_lang")
    add_task_option(p, "target_lang")
    add_task_option(p, "max_length", help="default of the two maximum lengths below")
    p.add_argument("--max_source_length", type=int, help="truncate sources to this many tokens")
    p.add_argument("--max_target_length", type=int, help="truncate targets to this many tokens")
    p.add_argument("--label_smoothing", type=float, default=0.1)
    add_task_option(p, "num_beams")
    p.add_argument("--length_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=128)
    for name in Translation.column_options:
        add_task_option(p, name)
    return p


def check_column_pair(source_column: str | None, target_column: str | None) -> None:
    """Two text columns in place of 'translation': both named, or neither."""
    if (source_column is None) != (target_column is None):
        raise BadInput("--source_column and --target_column go together: give both, or neither to read the "
                       "'translation' column")


def check_options(args: argparse.Namespace) -> argparse.Namespace:
    """The recipes' checks, then the translation options' (the two maximum lengths filled in)."""
    check_args(args, path_options=Translation.input_path_options)
    if args.source_lang == args.target_lang:
        raise BadInput(f"--source_lang and --target_lang are both {args.source_lang!r}")
    check_column_pair(args.source_column, args.target_column)
    check_label_smoothing(args.label_smoothing, "--label_smoothing")
    args.max_source_length = args.max_source_length or args.max_length
    args.max_target_length = args.max_target_length or args.max_length
    for option in ("num_beams", "max_new_tokens", "max_source_length", "max_target_length"):
        if vars(args)[option] < 1:
            raise BadInput(f"--{option} must be at least 1; got {vars(args)[option]}")
    return args


@register_task("seq2seq")
class Translation(Task):
    """Label-smoothed cross-entropy on token-budget batches of source and target; BLEU of beam search."""

    script = "recipes/train_wmt.py"
    model_class = PowerNormTransformerForConditionalGeneration
    build_parser, check_options = staticmethod(build_parser), staticmethod(check_options)
    pretrained_auto_class = "AutoModelForSeq2SeqLM"
    default_size = DEFAULT_SIZE
    metric, mode = "bleu", "max"
    length_columns = ("input_ids", "labels")
    corpus = "the embedded synthetic German/English corpus"
    description = "A PowerNorm Transformer for {source_lang}->{target_lang} translation, trained on {data}."
    needed_columns = "'translation' ({lang: text})"
    column_options = ("source_column", "target_column")
    own_options = ("max_length", "source_lang", "target_lang", "num_beams")

    def load_data(self, accelerator: Accelerator) -> dict:
        """Raw pairs (JSON lines, aligned text files, a Hub dataset or the embedded corpus) -> joint BPE
        -> cached `input_ids` and `labels`."""
        args = self.args
        raw = self.read_splits(args.seed)
        if "train" not in raw and args.do_train:
            raise BadInput(f"no train split; got {list(raw)} (pass --train_file)")
        raw = limit_splits(raw, args.max_train_samples, args.max_eval_samples)
        languages = (args.source_lang, args.target_lang)
        self.prepare_tokenizer(accelerator, lambda: translation_texts(raw["train"], languages))
        with accelerator.main_process_first():
            return self.tokenize(raw, self.tokenizer)

    def read_splits(self, seed: int):
        """Source/target pairs: a 'translation' column, or two text columns (`--source_column` and
        `--target_column`, e.g. a document and its summary)."""
        args = self.args
        files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
        columns = {"source": args.source_column, "target": args.target_column} if args.source_column else None
        return load_translation_dataset(args.source_lang, args.target_lang, dataset_name=args.dataset_name,
                                        dataset_config=args.dataset_config, data_files=files, columns=columns)

    def tokenize(self, raw, tokenizer):
        args = self.args
        return tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang,
                                    args.max_source_length or args.max_length,
                                    args.max_target_length or args.max_length,
                                    **self.tokenize_options())

    def describe(self, data: dict) -> str:
        return f"{len(data.get('train', []))} training pairs"

    def max_length(self) -> int:
        return max(self.args.max_source_length, self.args.max_target_length)

    def train_collate(self) -> PaddingCollator:
        # The decoder's padding is marked too, so batch statistics in the decoder leave it out.
        return PaddingCollator(self.tokenizer.pad_token_id, decoder_attention_mask=True)

    def loss(self, accelerator: Accelerator):
        return translation_loss(accelerator, self.args.label_smoothing)

    def evaluate(self, accelerator: Accelerator, model, loader: DataLoader, split: str) -> dict:
        """BLEU of beam search (`--max_new_tokens`, else `--max_length` new tokens at most); with
        `write_predictions`, the test split's translations go to `generated_predictions.txt`."""
        args = self.args
        predictions = Path(args.output_dir) / "generated_predictions.txt" \
            if split == "test" and self.write_predictions else None
        return evaluate_bleu(accelerator, model, loader, self.tokenizer, predictions, **self.generate_options())

    def generate_options(self) -> dict:
        args = self.args
        options = {"num_beams": args.num_beams, "length_penalty": args.length_penalty,
                   "max_new_tokens": args.max_new_tokens or args.max_length}
        return {k: v for k, v in options.items() if v is not None}

    def samples(self, accelerator: Accelerator, model, raw, data, collate) -> list[dict[str, str]]:
        """The first three validation examples: source, reference and the model's output."""
        from .batching import eval_loader
        from .evaluation import translate

        count = min(3, len(data["validation"]))
        loader = accelerator.prepare(eval_loader(data["validation"].select(range(count)), collate, count))
        outputs, references = translate(accelerator, model, loader, self.tokenizer, **self.generate_options())
        sources = [pair[self.args.source_lang] for pair in raw["validation"].select(range(count))["translation"]]
        return [{"source": source, "reference": reference, "output": output}
                for source, reference, output in zip(sources, references, outputs)]

    def summary(self, results: dict, split: str) -> str:
        return f"BLEU {results[f'{split}_bleu']:.2f} ({results[f'{split}_bleu_signature']})"

    def card_kwargs(self, argv: list[str] | None) -> dict:
        return {**super().card_kwargs(argv), "language": [self.args.source_lang, self.args.target_lang]}


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    return run_task(Translation(parse_args(argv)), argv)

