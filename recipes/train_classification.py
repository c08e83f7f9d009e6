"""Train a PowerNorm Transformer sentence classifier with Accelerate (accuracy and macro-F1).

An encoder-only `PowerNormTransformerForSequenceClassification` (mean over real tokens, linear
head) with `--norm_type` in the encoder (PN by default). Data: CSV or JSON lines with `text` (or
`sentence`) and `label` columns, a Financial PhraseBank file (`sentence@label` per line, split
80/10/10 with the seed), a Hub dataset when online, or the embedded three-way sentiment corpus
(the default: about 15 s on 2 CPU cores). The Financial PhraseBank (all annotators agree):

    accelerate launch recipes/train_classification.py \
        --phrasebank_file financial_phrasebank/utf8_lf/Sentences_AllAgree.txt --vocab_size 4000 \
        --max_tokens 2048 --warmup_steps 200 --num_train_epochs 40 --patience 10 \
        --output_dir outputs/phrasebank-powernorm
"""

from __future__ import annotations

import argparse
from pathlib import Path

from accelerate import Accelerator
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from hf_powernorm import PowerNormTransformerForSequenceClassification
from hf_powernorm.training import (
    SENTIMENT_LABELS,
    PaddingCollator,
    add_recipe_args,
    build_model,
    check_args,
    column_texts,
    data_files_from_args,
    evaluate_accuracy,
    fit,
    label_names_of,
    limit_splits,
    load_classification_dataset,
    log_run_start,
    make_accelerator,
    model_loss,
    model_tokenizer_path,
    prepare_eval_loaders,
    prepare_tokenizer,
    save_outputs,
    score_splits,
    start_run,
    tokenize_classification,
    training_command,
)

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


def load_data(args: argparse.Namespace,
              accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict, list[str]]:
    """Sentences and labels -> tokenizer -> cached token ids; returns the class names too."""
    files = data_files_from_args(args.train_file or args.phrasebank_file, args.validation_file, args.test_file)
    raw = load_classification_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config,
                                      data_files=files, label_names=args.label_names.split(","), seed=args.seed)
    if "train" not in raw and args.do_train:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file or --phrasebank_file)")
    raw = limit_splits(raw, args.max_train_samples, args.max_eval_samples)
    tokenizer = prepare_tokenizer(model_tokenizer_path(args), args.output_dir, args.vocab_size, accelerator,
                                  lambda: column_texts(raw["train"]), model_max_length=args.max_length)
    with accelerator.main_process_first():
        data = tokenize_classification(raw, tokenizer, args.max_length, num_proc=args.preprocessing_num_workers,
                                       overwrite_cache=args.overwrite_cache)
    return tokenizer, data, label_names_of(raw)


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    args = parse_args(argv)
    accelerator = make_accelerator(args)
    start_run(accelerator, args, "train_classification")
    tokenizer, data, labels = load_data(args, accelerator)
    fields = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
              "label2id": {name: i for i, name in enumerate(labels)}}
    if args.norm_type:
        fields["encoder_norm_type"] = args.norm_type
    model = build_model(args, PowerNormTransformerForSequenceClassification, tokenizer, accelerator.num_processes,
                        DEFAULT_SIZE, args.max_length, auto_class=AutoModelForSequenceClassification, **fields)
    log_run_start(accelerator, args, model, f"{len(data.get('train', []))} training sentences, classes {labels}, "
                                            f"vocabulary {len(tokenizer)}")
    collate = PaddingCollator(tokenizer.pad_token_id)
    evals = prepare_eval_loaders(accelerator, data, collate, args.eval_batch_size)
    results = {}
    if args.do_train:
        validate = (lambda m: evaluate_accuracy(accelerator, m, evals["validation"], len(labels))["accuracy"]) \
            if "validation" in evals else None
        model, results = fit(args, accelerator, model, data["train"], collate, model_loss, tokenizer=tokenizer,
                             mode="max", validate=validate)
    else:
        model = accelerator.prepare(model)
    results.update(score_splits(lambda split, loader: evaluate_accuracy(accelerator, model, loader, len(labels)),
                                evals))
    for split in evals:
        accelerator.print(f"{split}: accuracy {results[f'{split}_accuracy']:.4f}, "
                          f"macro-F1 {results[f'{split}_macro_f1']:.4f}")
    save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | None]:
    data = args.dataset_name or args.phrasebank_file or args.train_file or "the embedded sentiment corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name, "language": "en",
            "datasets": args.dataset_name, "training_command": training_command(
                "recipes/train_classification.py", argv),
            "description": f"A PowerNorm Transformer sentence classifier trained on {data}."}


if __name__ == "__main__":
    main()
