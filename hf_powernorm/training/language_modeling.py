"""The language-modelling task of `recipes/train_lm.py` (the paper's Section 5.2): its
arguments, its data (fixed-length blocks of the token stream), and perplexity per token and per
word. The recipe and `hf_powernorm.studies.converted_models` run it through `run_task` with
`main(argv)`.
"""

from __future__ import annotations

import argparse

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ..configuration_powernorm import PRESETS
from ..modeling_powernorm import PowerNormTransformerForCausalLM
from .arguments import add_recipe_args, check_args
from .evaluation import evaluate_perplexity
from .metrics import count_words
from .readers import data_files_from_args, limit_splits, load_lm_dataset, split_train
from .tasks import Task, run_task
from .tokenization import column_texts, lm_blocks, tokenize_lines

# The default model for the embedded corpus: the preset `lm-small` at a laptop's size.
DEFAULT_SIZE = {**{k: v for k, v in PRESETS["lm-small"].items() if k != "vocab_size"},
                "hidden_size": 64, "intermediate_size": 256, "decoder_layers": 2, "num_attention_heads": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer language model.")
    add_recipe_args(p, learning_rate=2e-3, num_warmup_steps=100, num_train_epochs=6, output_dir="outputs/lm")
    p.add_argument("--block_size", type=int, default=64, help="tokens per training/evaluation block")
    args = p.parse_args(argv)
    check_args(args)
    if args.block_size < 2 or args.block_size > args.max_tokens:
        raise ValueError(f"--block_size must be in [2, --max_tokens={args.max_tokens}]; got {args.block_size}")
    return args


class LanguageModelling(Task):
    """Next-token cross-entropy on fixed-length blocks of the token stream; perplexity per token and
    per word."""

    script = "recipes/train_lm.py"
    model_class, auto_class = PowerNormTransformerForCausalLM, AutoModelForCausalLM
    default_size = DEFAULT_SIZE
    metric, mode = "perplexity", "min"
    corpus = "the embedded English corpus"
    description = "A PowerNorm Transformer language model trained on {data}."

    def load_data(self, accelerator: Accelerator) -> dict:
        """Text lines -> tokenizer -> cached token ids per line -> cached blocks of `block_size` tokens;
        also the number of words per split, end of line counted as one (PTB's word perplexity)."""
        args = self.args
        files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
        raw = load_lm_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config, data_files=files)
        if "train" not in raw and args.do_train:
            raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
        raw = limit_splits(split_train(raw, seed=args.seed), args.max_train_samples, args.max_eval_samples)
        self.prepare_tokenizer(accelerator, lambda: column_texts(raw["train"]))
        with accelerator.main_process_first():
            lines = tokenize_lines(raw, self.tokenizer, num_proc=args.preprocessing_num_workers,
                                   overwrite_cache=args.overwrite_cache)
            blocks = lm_blocks(lines, args.block_size, num_proc=args.preprocessing_num_workers,
                               overwrite_cache=args.overwrite_cache)
        self.words = {split: count_words(column_texts(part)) for split, part in raw.items()}
        return blocks

    def describe(self, data: dict) -> str:
        return f"{len(data.get('train', []))} training blocks of up to {self.args.block_size} tokens"

    def model_fields(self) -> dict:
        norm = self.args.norm_type
        return {"encoder_norm_type": norm, "decoder_norm_type": norm} if norm else {}

    def max_length(self) -> int:
        return self.args.block_size

    def evaluate(self, accelerator: Accelerator, model, loader: DataLoader, split: str) -> dict:
        return evaluate_perplexity(accelerator, model, loader, self.words[split])

    def summary(self, results: dict, split: str) -> str:
        return (f"perplexity {results[f'{split}_perplexity']:.3f} over {results[f'{split}_tokens']} tokens, "
                f"{results[f'{split}_word_perplexity']:.3f} per word")


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    return run_task(LanguageModelling(parse_args(argv)), argv)

