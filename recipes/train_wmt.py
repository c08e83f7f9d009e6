"""Train a PowerNorm Transformer for translation with Accelerate (the paper's Section 5.1 recipe).

A `PowerNormTransformerForConditionalGeneration` trained with label-smoothed cross-entropy on
token-budget batches of a joint BPE. Every `--eval_steps` updates (else every epoch) it translates
the validation split with beam search (`generate`) and scores it with sacreBLEU; the best model is
kept, training stops after `--patience` validations without improvement, and the best model is
scored on the test split (its translations in `generated_predictions.txt`) and exported. Without
arguments a small model trains on the embedded synthetic German->English corpus. The paper's
commands (IWSLT14, WMT14) are in `recipes/README.md`; average the last checkpoints with
`recipes/average_checkpoints.py`. `--model_name_or_path` fine-tunes an export, or with
`--no-do_train` only translates and scores it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from accelerate import Accelerator
from transformers import PreTrainedTokenizerFast

from hf_powernorm import PowerNormTransformerForConditionalGeneration
from hf_powernorm.training import (
    OncePerMessage,
    PaddingCollator,
    add_recipe_args,
    build_model,
    check_args,
    data_files_from_args,
    evaluate_bleu,
    fit,
    limit_splits,
    load_translation_dataset,
    log_run_start,
    make_accelerator,
    model_tokenizer_path,
    prepare_eval_loaders,
    prepare_tokenizer,
    save_outputs,
    score_splits,
    start_run,
    tokenize_translation,
    training_command,
    translation_loss,
    translation_texts,
)

# sacrebleu warns about tokenized text (the embedded corpus is) at every validation: once is enough.
logging.getLogger("sacrebleu").addFilter(OncePerMessage())

# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer for translation.")
    add_recipe_args(p, eval_batch_size=64, output_dir="outputs/translation")
    p.add_argument("--source_lang", default="de")
    p.add_argument("--target_lang", default="en")
    p.add_argument("--max_length", type=int, default=128, help="default of the two maximum lengths below")
    p.add_argument("--max_source_length", type=int, help="truncate sources to this many tokens")
    p.add_argument("--max_target_length", type=int, help="truncate targets to this many tokens")
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--num_beams", type=int, default=5)
    p.add_argument("--length_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=128)
    args = p.parse_args(argv)
    check_args(args)
    if args.source_lang == args.target_lang:
        raise ValueError(f"--source_lang and --target_lang are both {args.source_lang!r}")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ValueError(f"--label_smoothing must be in [0, 1); got {args.label_smoothing}")
    args.max_source_length = args.max_source_length or args.max_length
    args.max_target_length = args.max_target_length or args.max_length
    for option in ("num_beams", "max_new_tokens", "max_source_length", "max_target_length"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option} must be at least 1; got {getattr(args, option)}")
    return args


def load_data(args: argparse.Namespace, accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict]:
    """Raw pairs (JSON lines, aligned text files, a Hub dataset or the embedded corpus) -> joint BPE
    -> cached `input_ids` and `labels`."""
    files = data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = load_translation_dataset(args.source_lang, args.target_lang, dataset_name=args.dataset_name,
                                   dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw and args.do_train:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
    raw = limit_splits(raw, args.max_train_samples, args.max_eval_samples)
    languages = (args.source_lang, args.target_lang)
    tokenizer = prepare_tokenizer(model_tokenizer_path(args), args.output_dir, args.vocab_size, accelerator,
                                  lambda: translation_texts(raw["train"], languages),
                                  model_max_length=max(args.max_source_length, args.max_target_length))
    with accelerator.main_process_first():
        data = tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang, args.max_source_length,
                                    args.max_target_length, num_proc=args.preprocessing_num_workers,
                                    overwrite_cache=args.overwrite_cache)
    return tokenizer, data


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    start_run(accelerator, args, "train_wmt")
    tokenizer, data = load_data(args, accelerator)
    fields = {"encoder_norm_type": args.norm_type} if args.norm_type else {}
    model = build_model(args, PowerNormTransformerForConditionalGeneration, tokenizer, accelerator.num_processes,
                        DEFAULT_SIZE, max(args.max_source_length, args.max_target_length), **fields)
    log_run_start(accelerator, args, model, f"{len(data.get('train', []))} training pairs, vocabulary {len(tokenizer)}")
    evals = prepare_eval_loaders(accelerator, data, PaddingCollator(tokenizer.pad_token_id), args.eval_batch_size)
    generation = {"num_beams": args.num_beams, "length_penalty": args.length_penalty,
                  "max_new_tokens": args.max_new_tokens}
    results = {}
    if args.do_train:
        validate = (lambda m: evaluate_bleu(accelerator, m, evals["validation"], tokenizer, **generation)["bleu"]) \
            if "validation" in evals else None
        # The decoder's padding is marked too, so batch statistics in the decoder leave it out.
        collate = PaddingCollator(tokenizer.pad_token_id, decoder_attention_mask=True)
        model, results = fit(args, accelerator, model, data["train"], collate,
                             translation_loss(accelerator, args.label_smoothing), tokenizer=tokenizer, mode="max",
                             validate=validate, length_columns=("input_ids", "labels"))
    else:
        model = accelerator.prepare(model)
    predictions = {"test": Path(args.output_dir) / "generated_predictions.txt"}
    results.update(score_splits(lambda split, loader: evaluate_bleu(
        accelerator, model, loader, tokenizer, predictions.get(split), **generation), evals))
    for split in evals:
        accelerator.print(f"{split}: BLEU {results[f'{split}_bleu']:.2f} ({results[f'{split}_bleu_signature']})")
    save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | list[str] | None]:
    data = args.dataset_name or args.train_file or "the embedded synthetic German/English corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name,
            "language": [args.source_lang, args.target_lang], "datasets": args.dataset_name,
            "training_command": training_command("recipes/train_wmt.py", argv),
            "description": f"A PowerNorm Transformer for {args.source_lang}->{args.target_lang} translation, "
                           f"trained on {data}."}


if __name__ == "__main__":
    main()
