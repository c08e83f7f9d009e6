"""Train a PowerNorm Transformer for translation with Accelerate (the paper's Section 5.1 recipe).

A `PowerNormTransformerForConditionalGeneration` trained with label-smoothed cross-entropy on
token-budget batches of a joint BPE. Every `--eval_steps` updates (else every epoch) it translates
the validation split with beam search (`generate`) and scores it with sacreBLEU; the best model is
kept, training stops after `--patience` validations without improvement, and the best model is
scored on the test split and exported. Without arguments a small model trains on the embedded
synthetic German->English corpus. The paper's commands (IWSLT14, WMT14) are in `recipes/README.md`;
average the last checkpoints with `recipes/average_checkpoints.py`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_training as rt  # noqa: E402
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PowerNormTransformerForConditionalGeneration  # noqa: E402

# sacrebleu warns about tokenized text (the embedded corpus is) at every validation: once is enough.
logging.getLogger("sacrebleu").addFilter(ru.OncePerMessage())

# The default model for the embedded corpus: the preset `tiny` at width 64.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer for translation.")
    rt.add_recipe_args(p, eval_batch_size=64, output_dir="outputs/translation")
    p.add_argument("--source_lang", default="de")
    p.add_argument("--target_lang", default="en")
    p.add_argument("--max_length", type=int, default=128, help="truncate source and target to this")
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--num_beams", type=int, default=5)
    p.add_argument("--length_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=128)
    args = p.parse_args(argv)
    rt.check_args(args)
    if args.source_lang == args.target_lang:
        raise ValueError(f"--source_lang and --target_lang are both {args.source_lang!r}")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ValueError(f"--label_smoothing must be in [0, 1); got {args.label_smoothing}")
    for option in ("num_beams", "max_new_tokens", "max_length"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option} must be at least 1; got {getattr(args, option)}")
    return args


def load_data(args: argparse.Namespace, accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict]:
    """Raw pairs (JSON lines, aligned text files, a Hub dataset or the embedded corpus) -> joint BPE
    -> `input_ids` and `labels`."""
    files = ru.data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = ru.load_translation_dataset(args.source_lang, args.target_lang, dataset_name=args.dataset_name,
                                      dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
    languages = (args.source_lang, args.target_lang)
    tokenizer = ru.prepare_tokenizer(args, accelerator, lambda: ru.translation_texts(raw["train"], languages))
    with accelerator.main_process_first():
        data = ru.tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang, args.max_length)
    return tokenizer, data


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast,
                num_processes: int) -> PowerNormTransformerForConditionalGeneration:
    """The preset (`tiny` at `DEFAULT_SIZE` by default) with `--norm_type` in the encoder."""
    fields = {"encoder_norm_type": args.norm_type} if args.norm_type else {}
    config = rt.build_config(args, tokenizer, num_processes, DEFAULT_SIZE, args.max_length, **fields)
    return PowerNormTransformerForConditionalGeneration(config)


def translation_loss(args: argparse.Namespace, accelerator: Accelerator) -> rt.LossFn:
    """Label-smoothed cross-entropy with teacher forcing. Labels are not passed to the model, so it
    computes no loss of its own; it builds the decoder inputs from them."""
    def compute(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inputs["decoder_input_ids"] = accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels(labels)
        return ru.label_smoothed_loss(model(**inputs).logits, labels, args.label_smoothing)

    return compute


@torch.no_grad()
def evaluate_bleu(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader,
                  tokenizer: PreTrainedTokenizerFast) -> dict[str, float | str]:
    """Beam search on every batch, gathered across processes; BLEU (cased and uncased) by sacrebleu."""
    model.eval()
    predictions, references = [], []
    for batch in tqdm(loader, desc="Generating", disable=not accelerator.is_local_main_process, leave=False):
        generated = accelerator.unwrap_model(model).generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=args.num_beams,
            length_penalty=args.length_penalty, max_new_tokens=args.max_new_tokens)
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=ru.IGNORE_INDEX)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        predictions += ru.decode_for_bleu(tokenizer, generated)
        references += [[r] for r in ru.decode_for_bleu(tokenizer, labels)]
    model.train()
    metric = ru.load_metric("sacrebleu")
    cased = metric.compute(predictions=predictions, references=references)
    uncased = metric.compute(predictions=predictions, references=references, lowercase=True)
    return {"bleu": cased["score"], "bleu_lowercase": uncased["score"], "bleu_signature": cased["signature"]}


def final_scores(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
                 loaders: dict[str, DataLoader], tokenizer: PreTrainedTokenizerFast) -> dict[str, float | str]:
    """`<split>_bleu`, `<split>_bleu_lowercase` and `<split>_bleu_signature` of every evaluation split."""
    results: dict[str, float | str] = {}
    for split, loader in loaders.items():
        scores = evaluate_bleu(args, accelerator, model, loader, tokenizer)
        results.update({f"{split}_{k}": v for k, v in scores.items()})
        accelerator.print(f"{split}: BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})")
    return results


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    args = parse_args(argv)
    accelerator = rt.make_accelerator(args)
    rt.start_run(accelerator, args, "train_wmt")
    tokenizer, data = load_data(args, accelerator)
    model = build_model(args, tokenizer, accelerator.num_processes)
    rt.log_run_start(accelerator, args, model, f"{len(data['train'])} training pairs, vocabulary {len(tokenizer)}")
    optimizer = ru.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = ru.inverse_sqrt_schedule(optimizer, args.warmup_steps, args.warmup_init_lr)
    collate = ru.PaddingCollator(tokenizer.pad_token_id, decoder_attention_mask=True)
    loader, sampler = rt.train_loader(data["train"], collate, args.max_tokens, args.seed, ("input_ids", "labels"))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    collate = ru.PaddingCollator(tokenizer.pad_token_id)
    evals = {s: accelerator.prepare(rt.eval_loader(data[s], collate, args.eval_batch_size, args.max_eval_samples))
             for s in ("validation", "test") if s in data}
    stopper = rt.EarlyStopping("max", args.patience)
    accelerator.register_for_checkpointing(scheduler, stopper)
    validate = (lambda: evaluate_bleu(args, accelerator, model, evals["validation"], tokenizer)["bleu"]) \
        if "validation" in evals else None
    steps = rt.train(args, accelerator, model, optimizer, scheduler, loader, translation_loss(args, accelerator),
                     sampler=sampler, evaluate=validate, stopper=stopper, tokenizer=tokenizer)
    results = rt.finish_training(accelerator, model, args.output_dir, stopper, steps)
    results.update(final_scores(args, accelerator, model, evals, tokenizer))
    rt.save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | list[str] | None]:
    data = args.dataset_name or args.train_file or "the embedded synthetic German/English corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name,
            "language": [args.source_lang, args.target_lang], "datasets": args.dataset_name,
            "training_command": rt.training_command("recipes/train_wmt.py", argv),
            "description": f"A PowerNorm Transformer for {args.source_lang}->{args.target_lang} translation, "
                           f"trained on {data}."}


if __name__ == "__main__":
    main()
