"""Train a PowerNorm Transformer sentence classifier with Accelerate (accuracy and macro-F1).

An encoder-only `PowerNormTransformerForSequenceClassification` (mean over real tokens, linear
head) with `--norm_type` in the encoder (PN by default). Data: CSV or JSON lines with `text` (or
`sentence`) and `label` columns, a Financial PhraseBank file (`sentence@label` per line, split
80/10/10 with the seed), a Hub dataset when online, or the embedded three-way sentiment corpus
(the default: validation accuracy 0.51 after the first epoch, 0.91 after 140 updates, about
15 s on 2 CPU cores). The Financial PhraseBank (all annotators agree):

    accelerate launch recipes/train_classification.py \
        --phrasebank_file financial_phrasebank/utf8_lf/Sentences_AllAgree.txt --vocab_size 4000 \
        --max_tokens 2048 --warmup_steps 200 --num_train_epochs 40 --patience 10 \
        --output_dir outputs/phrasebank-powernorm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_training as rt  # noqa: E402
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PowerNormTransformerForSequenceClassification  # noqa: E402

# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128, "encoder_layers": 2, "dropout": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer sentence classifier.")
    rt.add_recipe_args(p, vocab_size=1000, learning_rate=1e-3, warmup_steps=100, num_train_epochs=5,
                       output_dir="outputs/classification")
    p.add_argument("--phrasebank_file", help="a Financial PhraseBank file (sentence@label per line)")
    p.add_argument("--label_names", default=",".join(ru.SENTIMENT_LABELS),
                   help="comma-separated class names of local files (Hub datasets bring their own)")
    p.add_argument("--max_length", type=int, default=128, help="truncate sentences to this many tokens")
    args = p.parse_args(argv)
    rt.check_args(args)
    if args.phrasebank_file and args.train_file:
        raise ValueError("give either --phrasebank_file or --train_file, not both")
    return args


def load_data(args: argparse.Namespace,
              accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict, list[str]]:
    """Sentences and labels -> tokenizer -> token ids; returns the class names too."""
    files = ru.data_files_from_args(args.train_file or args.phrasebank_file, args.validation_file, args.test_file)
    raw = ru.load_classification_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config,
                                         data_files=files, label_names=args.label_names.split(","), seed=args.seed)
    if "train" not in raw:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file or --phrasebank_file)")
    tokenizer = ru.prepare_tokenizer(args, accelerator, lambda: ru.column_texts(raw["train"]))
    with accelerator.main_process_first():
        data = ru.tokenize_classification(raw, tokenizer, args.max_length)
    return tokenizer, data, ru.label_names_of(raw)


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast, labels: list[str],
                num_processes: int) -> PowerNormTransformerForSequenceClassification:
    """The encoder of the preset (`tiny` at `DEFAULT_SIZE` by default) with `--norm_type` in it."""
    fields = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
              "label2id": {name: i for i, name in enumerate(labels)}}
    if args.norm_type:
        fields["encoder_norm_type"] = args.norm_type
    config = rt.build_config(args, tokenizer, num_processes, DEFAULT_SIZE, args.max_length, **fields)
    return PowerNormTransformerForSequenceClassification(config)


def classification_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


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
    scores = ru.load_metric("accuracy_f1").compute(predictions=predictions, references=references,
                                                   num_labels=num_labels)
    return {"accuracy": scores["accuracy"], "macro_f1": scores["macro_f1"], "examples": len(references)}


def final_scores(accelerator: Accelerator, model: torch.nn.Module, loaders: dict[str, DataLoader],
                 num_labels: int) -> dict[str, float | int]:
    """`<split>_accuracy`, `<split>_macro_f1` and `<split>_examples` of every evaluation split."""
    results: dict[str, float | int] = {}
    for split, loader in loaders.items():
        scores = evaluate_accuracy(accelerator, model, loader, num_labels)
        results.update({f"{split}_{k}": v for k, v in scores.items()})
        accelerator.print(f"{split}: accuracy {scores['accuracy']:.4f}, macro-F1 {scores['macro_f1']:.4f}")
    return results


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    args = parse_args(argv)
    accelerator = rt.make_accelerator(args)
    rt.start_run(accelerator, args, "train_classification")
    tokenizer, data, labels = load_data(args, accelerator)
    model = build_model(args, tokenizer, labels, accelerator.num_processes)
    rt.log_run_start(accelerator, args, model, f"{len(data['train'])} training sentences, classes {labels}, "
                                               f"vocabulary {len(tokenizer)}")
    optimizer = ru.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = ru.inverse_sqrt_schedule(optimizer, args.warmup_steps, args.warmup_init_lr)
    collate = ru.PaddingCollator(tokenizer.pad_token_id)
    loader, sampler = rt.train_loader(data["train"], collate, args.max_tokens, args.seed)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    evals = {s: accelerator.prepare(rt.eval_loader(data[s], collate, args.eval_batch_size, args.max_eval_samples))
             for s in ("validation", "test") if s in data}
    stopper = rt.EarlyStopping("max", args.patience)
    accelerator.register_for_checkpointing(scheduler, stopper)
    validate = (lambda: evaluate_accuracy(accelerator, model, evals["validation"], len(labels))["accuracy"]) \
        if "validation" in evals else None
    steps = rt.train(args, accelerator, model, optimizer, scheduler, loader, classification_loss, sampler=sampler,
                     evaluate=validate, stopper=stopper, tokenizer=tokenizer)
    results = rt.finish_training(accelerator, model, args.output_dir, stopper, steps)
    results.update(final_scores(accelerator, model, evals, len(labels)))
    rt.save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | None]:
    data = args.dataset_name or args.phrasebank_file or args.train_file or "the embedded sentiment corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name, "language": "en",
            "datasets": args.dataset_name, "training_command": rt.training_command(
                "recipes/train_classification.py", argv),
            "description": f"A PowerNorm Transformer sentence classifier trained on {data}."}


if __name__ == "__main__":
    main()
