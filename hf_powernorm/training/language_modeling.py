"""The language-modelling task `causal-lm` of `recipes/train_lm.py` (the paper's Section 5.2): its
arguments, its data (fixed-length blocks of the token stream: the lines of text files, or of a local
folder of them, with their line breaks unless `--no_keep_linebreaks`, the rows of a dataset as
documents; `tokenize_lines`), its loss (next-token cross-entropy, label-smoothed with
`args.label_smoothing` where a study sets it), and perplexity per token and per word. The recipe and
`hf_powernorm.studies.converted_models` run it through `run_task` with `main(argv)`, the studies'
language models through `train_and_score`, `hf-powernorm compare` on a pretrained causal LM.
"""

from __future__ import annotations

import argparse

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ..configuration_powernorm import PRESETS
from ..modeling_powernorm import PowerNormTransformerForCausalLM
from .arguments import RecipeParser, add_recipe_args, check_args
from .evaluation import evaluate_perplexity
from .losses import causal_lm_loss
from .metrics import count_words
from .options import BadInput, add_task_option
from .readers import data_files_from_args, limit_splits, lm_document_splits, load_lm_dataset, split_train
from .tasks import Task, register_task, run_task
from .tokenization import column_texts, lm_blocks, tokenize_lines

# The default model for the embedded corpus: the preset `lm-small` at a laptop's size.
DEFAULT_SIZE = {**{k: v for k, v in PRESETS["lm-small"].items() if k != "vocab_size"},
                "hidden_size": 64, "intermediate_size": 256, "decoder_layers": 2, "num_attention_heads": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return check_options(build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    p = RecipeParser(description="Train a PowerNorm Transformer language model.")
    add_recipe_args(p, learning_rate=2e-3, num_warmup_steps=100, num_train_epochs=6, output_dir="outputs/lm")
    add_task_option(p, "block_size")
    add_task_option(p, "keep_linebreaks")  # how the text becomes a token stream, as in Transformers' run_clm.py
    for name in LanguageModelling.column_options:
        add_task_option(p, name)
    return p


def check_options(args: argparse.Namespace) -> argparse.Namespace:
    """The recipes' checks, then the block size's."""
    check_args(args, path_options=LanguageModelling.input_path_options)
    if args.block_size < 2 or args.block_size > args.max_tokens:
        raise BadInput(f"--block_size must be in [2, --max_tokens={args.max_tokens}]; got {args.block_size}")
    return args


@register_task("causal-lm")
class LanguageModelling(Task):
    """Next-token cross-entropy on fixed-length blocks of the token stream; perplexity per token and
    per word."""

    script = "recipes/train_lm.py"
    model_class, auto_class = PowerNormTransformerForCausalLM, AutoModelForCausalLM
    build_parser, check_options = staticmethod(build_parser), staticmethod(check_options)
    pretrained_auto_class = "AutoModelForCausalLM"
    tokenizer_appends_eos = False  # a prompt stays open for generation
    default_size = DEFAULT_SIZE
    metric, mode = "perplexity", "min"
    corpus = "the embedded English corpus"
    description = "A PowerNorm Transformer language model trained on {data}."
    needed_columns = "'text' (or 'sentence')"
    column_options = ("text_column",)
    length_option, length_cap = "block_size", 1024
    own_options = ("block_size", "keep_linebreaks")
    words: dict[str, int] = {}  # words per split, set where the raw splits are tokenized

    def load_data(self, accelerator: Accelerator) -> dict:
        """Text lines -> tokenizer -> cached token ids per line -> cached blocks of `block_size` tokens."""
        args = self.args
        raw = self.read_splits(args.seed)
        if "train" not in raw and args.do_train:
            raise BadInput(f"no train split; got {list(raw)} (pass --train_file)")
        raw = limit_splits(split_train(raw, seed=args.seed), args.max_train_samples, args.max_eval_samples)
        self.prepare_tokenizer(accelerator, lambda: column_texts(raw["train"]))
        with accelerator.main_process_first():
            blocks = self.tokenize(raw, self.tokenizer)
        self.keep_split_facts(raw)
        return blocks

    def read_splits(self, seed: int):
        """Text lines: a text column (`--text_column`, else 'text' or 'sentence') or plain-text files."""
        args = self.args
        files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
        return load_lm_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config, data_files=files,
                               columns={"text": args.text_column})

    def tokenize(self, raw, tokenizer):
        """Cached token ids per line or document (`tokenize_lines`), then cached blocks of
        `block_size` tokens."""
        args, options = self.args, self.tokenize_options()
        files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
        documents = lm_document_splits(raw, dataset_name=args.dataset_name, data_files=files)
        lines = tokenize_lines(raw, tokenizer, documents=documents,
                               keep_linebreaks=args.keep_linebreaks, **options)
        return lm_blocks(lines, args.block_size, **options)

    def keep_split_facts(self, raw) -> None:
        """The number of words per split, end of line counted as one (PTB's word perplexity)."""
        self.words = {split: count_words(column_texts(part)) for split, part in raw.items()}

    def check_pretrained(self, model, config) -> None:
        from ..converter import is_causal

        if not is_causal(model, config):
            raise BadInput(f"--task {self.name} needs a causal language model; --model_name_or_path "
                           f"{self.args.model_name_or_path} ({config.model_type}) attends both ways and would see "
                           f"the tokens it is scored on; use --task classification, or a decoder model")

    def loss(self, accelerator: Accelerator):
        return causal_lm_loss(getattr(self.args, "label_smoothing", 0.0))

    def describe(self, data: dict) -> str:
        return f"{len(data.get('train', []))} training blocks of up to {self.args.block_size} tokens"

    def model_fields(self) -> dict:
        norm = self.args.norm_type
        return {"encoder_norm_type": norm, "decoder_norm_type": norm} if norm else {}

    def max_length(self) -> int:
        return self.args.block_size

    def evaluate(self, accelerator: Accelerator, model, loader: DataLoader, split: str) -> dict:
        return evaluate_perplexity(accelerator, model, loader, self.words.get(split))

    def summary(self, results: dict, split: str) -> str:
        return (f"perplexity {results[f'{split}_perplexity']:.3f} over {results[f'{split}_tokens']} tokens, "
                f"{results[f'{split}_word_perplexity']:.3f} per word")


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    return run_task(LanguageModelling(parse_args(argv)), argv)

