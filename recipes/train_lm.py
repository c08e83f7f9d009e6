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
from pathlib import Path

from accelerate import Accelerator
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_powernorm import PRESETS, PowerNormTransformerForCausalLM
from hf_powernorm.training import (
    PaddingCollator,
    add_recipe_args,
    build_model,
    check_args,
    column_texts,
    count_words,
    data_files_from_args,
    evaluate_perplexity,
    fit,
    limit_splits,
    lm_blocks,
    load_lm_dataset,
    log_run_start,
    make_accelerator,
    model_loss,
    model_tokenizer_path,
    prepare_eval_loaders,
    prepare_tokenizer,
    save_outputs,
    score_splits,
    split_train,
    start_run,
    tokenize_lines,
    training_command,
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


def load_data(args: argparse.Namespace,
              accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict, dict[str, int]]:
    """Text lines -> tokenizer -> cached token ids per line -> cached blocks of `block_size` tokens;
    also the number of words per split, end of line counted as one (PTB's word perplexity)."""
    files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = load_lm_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw and args.do_train:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
    raw = limit_splits(split_train(raw, seed=args.seed), args.max_train_samples, args.max_eval_samples)
    tokenizer = prepare_tokenizer(model_tokenizer_path(args), args.output_dir, args.vocab_size, accelerator,
                                  lambda: column_texts(raw["train"]), model_max_length=args.block_size)
    with accelerator.main_process_first():
        lines = tokenize_lines(raw, tokenizer, num_proc=args.preprocessing_num_workers,
                               overwrite_cache=args.overwrite_cache)
        blocks = lm_blocks(lines, args.block_size, num_proc=args.preprocessing_num_workers,
                           overwrite_cache=args.overwrite_cache)
    words = {split: count_words(column_texts(part)) for split, part in raw.items()}
    return tokenizer, blocks, words


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    start_run(accelerator, args, "train_lm")
    tokenizer, data, words = load_data(args, accelerator)
    fields = {"encoder_norm_type": args.norm_type, "decoder_norm_type": args.norm_type} if args.norm_type else {}
    model = build_model(args, PowerNormTransformerForCausalLM, tokenizer, accelerator.num_processes, DEFAULT_SIZE,
                        args.block_size, auto_class=AutoModelForCausalLM, **fields)
    log_run_start(accelerator, args, model, f"{len(data.get('train', []))} training blocks of up to "
                                            f"{args.block_size} tokens, vocabulary {len(tokenizer)}")
    collate = PaddingCollator(tokenizer.pad_token_id)
    evals = prepare_eval_loaders(accelerator, data, collate, args.eval_batch_size)
    results = {}
    if args.do_train:
        validate = (lambda m: evaluate_perplexity(accelerator, m, evals["validation"])["perplexity"]) \
            if "validation" in evals else None
        model, results = fit(args, accelerator, model, data["train"], collate, model_loss, tokenizer=tokenizer,
                             mode="min", validate=validate)
    else:
        model = accelerator.prepare(model)
    results.update(score_splits(lambda split, loader: evaluate_perplexity(accelerator, model, loader, words[split]),
                                evals))
    for split in evals:
        accelerator.print(f"{split}: perplexity {results[f'{split}_perplexity']:.3f} over "
                          f"{results[f'{split}_tokens']} tokens, {results[f'{split}_word_perplexity']:.3f} per word")
    save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | None]:
    data = args.dataset_name or args.train_file or "the embedded English corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name, "language": "en",
            "datasets": args.dataset_name, "training_command": training_command("recipes/train_lm.py", argv),
            "description": f"A PowerNorm Transformer language model trained on {data}."}


if __name__ == "__main__":
    main()
