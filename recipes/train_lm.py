"""Train a PowerNorm Transformer language model with Accelerate (the paper's Section 5.2, Table 3).

A decoder-only `PowerNormTransformerForCausalLM` with PN at every norm (preset `lm-small`),
trained on fixed-length blocks of the token stream. Perplexity is exp(mean token NLL) over the
whole validation/test stream (every token after the first is scored exactly once), gathered across
processes. Without arguments a small model trains on the embedded English corpus (about 30 s on 2
CPU cores). PTB:

    accelerate launch recipes/train_lm.py --train_file ptb/ptb.train.txt \
        --validation_file ptb/ptb.valid.txt --test_file ptb/ptb.test.txt --preset lm-small \
        --vocab_size 16000 --block_size 256 --max_tokens 4096 --learning_rate 5e-4 \
        --warmup_steps 2000 --clip_norm 0.25 --num_train_epochs 60 --eval_steps 250 --patience 8 \
        --checkpointing_steps 1000 --output_dir outputs/ptb-powernorm

With a BPE tokenizer `perplexity` is per BPE token (about 1.1 per PTB word); `word_perplexity` is
exp(the same total NLL / the number of words, one end of line per line counted), PTB's convention.
"""

from __future__ import annotations

import argparse

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_powernorm import PRESETS, PowerNormTransformerForCausalLM
from hf_powernorm.training import (
    Task,
    add_recipe_args,
    check_args,
    column_texts,
    count_words,
    data_files_from_args,
    evaluate_perplexity,
    limit_splits,
    lm_blocks,
    load_lm_dataset,
    run_task,
    split_train,
    tokenize_lines,
)

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


if __name__ == "__main__":
    main()
