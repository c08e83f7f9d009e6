"""Train a PowerNorm Transformer for translation with Accelerate (the paper's Section 5.1 recipe).

Without arguments it trains a small model on the embedded synthetic German->English corpus: the
defaults are sized for it (3-5 minutes on 2 CPU cores, validation BLEU from 0 to about 99).
The paper's IWSLT14 run is, with the data as JSON lines or aligned text files:

    accelerate launch recipes/train_wmt.py --train_file data/train --validation_file data/valid \
        --test_file data/test --preset iwslt14-small --vocab_size 10000 --max_tokens 4096 \
        --learning_rate 1.5e-3 --warmup_steps 8000 --weight_decay 1e-4 --label_smoothing 0.1 \
        --num_beams 5 --length_penalty 1.0 --checkpointing_steps 2000 --output_dir outputs/iwslt14

then `recipes/average_checkpoints.py` over the last checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PRESETS, PowerNormTransformerConfig, PowerNormTransformerForConditionalGeneration  # noqa: E402
from hf_powernorm.hub import render_model_card  # noqa: E402

logger = get_logger(__name__)
# The default model for the embedded corpus: about 1,200 updates reach a validation BLEU near 99.
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 128}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer for translation.")
    p.add_argument("--dataset_name", help="Hub dataset (needs network), e.g. wmt14 or iwslt2017")
    p.add_argument("--dataset_config", help="Hub dataset configuration, e.g. de-en")
    p.add_argument("--train_file", help="JSON lines, or a prefix of aligned files PREFIX.SRC/PREFIX.TGT")
    p.add_argument("--validation_file")
    p.add_argument("--test_file")
    p.add_argument("--source_lang", default="de")
    p.add_argument("--target_lang", default="en")
    p.add_argument("--tokenizer_name", help="a saved tokenizer directory; default: train a joint BPE")
    p.add_argument("--vocab_size", type=int, default=500, help="joint BPE size (paper: 10k IWSLT, 37k WMT)")
    p.add_argument("--max_length", type=int, default=128, help="truncate source and target to this")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model size; default: 'tiny' at width 64 (FFN 128), sized for the embedded corpus")
    p.add_argument("--config_overrides", help="config fields, e.g. 'hidden_size=64,encoder_layers=3'")
    p.add_argument("--encoder_norm_type", help="override the preset's encoder norm (e.g. powernorm)")
    p.add_argument("--decoder_norm_type", help="override the preset's decoder norm (e.g. layernorm)")
    p.add_argument("--max_tokens", type=int, default=1024, help="padded tokens per batch and process")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--warmup_steps", type=int, default=200)
    p.add_argument("--warmup_init_lr", type=float, default=1e-7)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--clip_norm", type=float, default=0.0, help="max gradient norm; 0 disables")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--num_train_epochs", type=int, default=20)
    p.add_argument("--max_train_steps", type=int, help="optimizer updates; overrides the epochs")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), help="default: accelerate config")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if an accelerator is present")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--checkpointing_steps", help="save the training state every N updates, or 'epoch'")
    p.add_argument("--resume_from_checkpoint", help="a checkpoint folder, or 'latest' in --output_dir")
    p.add_argument("--num_beams", type=int, default=5)
    p.add_argument("--length_penalty", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--eval_batch_size", type=int, default=64, help="sentences per generation batch")
    p.add_argument("--max_eval_samples", type=int, help="evaluate on the first N pairs of each split")
    p.add_argument("--output_dir", default="outputs/translation")
    p.add_argument("--hub_model_id", help="repository name for the model card; default: the output folder's")
    p.add_argument("--with_tracking", action="store_true", help="log to the trackers Accelerate finds")
    return p.parse_args(argv)


def load_data(args, accelerator: Accelerator):
    """Raw pairs -> tokenizer (trained once on the main process, then read by all) -> token ids."""
    files = ru.data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = ru.load_translation_dataset(args.source_lang, args.target_lang, dataset_name=args.dataset_name,
                                      dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw:
        raise ValueError(f"no train split; got {list(raw)}")
    tokenizer_dir = Path(args.tokenizer_name or Path(args.output_dir) / "tokenizer")
    with accelerator.main_process_first():
        if args.tokenizer_name is None and accelerator.is_main_process:
            texts = ru.translation_texts(raw["train"], (args.source_lang, args.target_lang))
            ru.train_bpe_tokenizer(texts, args.vocab_size).save_pretrained(tokenizer_dir)
    tokenizer = ru.load_tokenizer(tokenizer_dir)
    with accelerator.main_process_first():
        data = ru.tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang, args.max_length)
    return tokenizer, data


def build_model(args, tokenizer, num_processes: int) -> PowerNormTransformerForConditionalGeneration:
    overrides = {k: getattr(args, k) for k in ("encoder_norm_type", "decoder_norm_type") if getattr(args, k)}
    if args.preset is None:
        overrides = {**DEFAULT_SIZE, **overrides}
    config = PowerNormTransformerConfig.from_preset(
        args.preset or "tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id, **overrides)
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    if config.powernorm_warmup_steps == 0:
        config.powernorm_warmup_steps = args.warmup_steps  # PN's warmup follows the lr warmup
    # Data parallel: batch statistics over the whole global batch, identical buffers on every rank.
    config.powernorm_sync_stats = config.powernorm_sync_stats or num_processes > 1
    config.max_position_embeddings = max(config.max_position_embeddings, args.max_length + 2)
    config.validate_powernorm_transformer()
    return PowerNormTransformerForConditionalGeneration(config)


def train_loader(args, dataset, pad_token_id: int) -> tuple[DataLoader, ru.TokenBudgetBatchSampler]:
    """Token-budget batches; Accelerate deals them out to the processes (so one replica here)."""
    sampler = ru.TokenBudgetBatchSampler(ru.sequence_lengths(dataset), args.max_tokens, seed=args.seed)
    collate = ru.PaddingCollator(pad_token_id, decoder_attention_mask=True)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate), sampler


def eval_loader(args, dataset, pad_token_id: int) -> DataLoader:
    if args.max_eval_samples:
        dataset = dataset.select(range(min(args.max_eval_samples, len(dataset))))
    return DataLoader(dataset, batch_size=args.eval_batch_size, collate_fn=ru.PaddingCollator(pad_token_id))


@torch.no_grad()
def evaluate_bleu(args, accelerator, model, loader, tokenizer) -> dict[str, float | str]:
    """Beam search on every batch, gathered across processes; BLEU (cased and uncased) by sacrebleu."""
    model.eval()
    predictions, references = [], []
    for batch in tqdm(loader, desc="Generating", disable=not accelerator.is_local_main_process):
        generated = accelerator.unwrap_model(model).generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=args.num_beams,
            length_penalty=args.length_penalty, max_new_tokens=args.max_new_tokens)
        pad = tokenizer.pad_token_id
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=pad)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=ru.IGNORE_INDEX)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        predictions += ru.decode_for_bleu(tokenizer, generated)
        references += [[r] for r in ru.decode_for_bleu(tokenizer, labels)]
    model.train()
    metric = ru.load_metric("sacrebleu")
    cased = metric.compute(predictions=predictions, references=references)
    uncased = metric.compute(predictions=predictions, references=references, lowercase=True)
    return {"bleu": cased["score"], "bleu_lowercase": uncased["score"], "bleu_signature": cased["signature"]}


def resume(args, accelerator, steps_per_epoch: int) -> tuple[int, int, int]:
    """Load the training state; return (completed updates, epoch, batches to skip in that epoch)."""
    path = args.resume_from_checkpoint
    if path == "latest":
        path = ru.latest_checkpoint(args.output_dir, prefix="step")
        if path is None:
            raise ValueError(f"--resume_from_checkpoint latest: no step_* checkpoint in {args.output_dir}")
    name = Path(path).name
    if not name.startswith("step_") or not name.removeprefix("step_").isdigit():
        raise ValueError(f"--resume_from_checkpoint {path}: expected a step_<N> folder written by this script")
    accelerator.print(f"Resuming from {path}")
    accelerator.load_state(str(path))
    completed = int(name.removeprefix("step_"))
    batches = completed * args.gradient_accumulation_steps
    return completed, batches // steps_per_epoch, batches % steps_per_epoch


def save_checkpoint(accelerator, args, model, tokenizer, completed_steps: int) -> None:
    """The full training state, plus config and tokenizer so that averaged checkpoints load with
    `from_pretrained` (see `average_checkpoints.py`)."""
    folder = Path(args.output_dir) / f"step_{completed_steps}"
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def forward_logits(accelerator, model, batch: dict) -> torch.Tensor:
    """Decoder logits for teacher forcing; labels are not passed, so the model computes no loss of
    its own (the recipe's loss is label-smoothed)."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    inputs["decoder_input_ids"] = accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels(labels)
    return model(**inputs).logits


def train(args, accelerator, model, tokenizer, optimizer, scheduler, loader, sampler) -> int:
    updates_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * updates_per_epoch
    completed, start_epoch, skip = 0, 0, 0
    if args.resume_from_checkpoint:
        completed, start_epoch, skip = resume(args, accelerator, len(loader))
    progress = tqdm(total=max_steps, initial=completed, disable=not accelerator.is_local_main_process)
    tokens, started = 0, time.perf_counter()
    for epoch in range(start_epoch, math.ceil(max_steps / updates_per_epoch)):
        sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(model):
                logits = forward_logits(accelerator, model, batch)
                loss = ru.label_smoothed_loss(logits, batch["labels"], args.label_smoothing)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.clip_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_norm)
                optimizer.step()
                optimizer.zero_grad()
            tokens += int(batch["decoder_attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # one schedule step per update, whatever the number of processes
            completed += 1
            progress.update(1)
            rate = tokens / (time.perf_counter() - started)
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                                 tok_s=f"{rate:.0f}")
            if args.with_tracking:
                accelerator.log({"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=completed)
            if args.checkpointing_steps and args.checkpointing_steps.isdigit() \
                    and completed % int(args.checkpointing_steps) == 0:
                save_checkpoint(accelerator, args, model, tokenizer, completed)
            if completed >= max_steps:
                return completed
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, args, model, tokenizer, completed)
    return completed


def save_outputs(args, accelerator, model, tokenizer, results: dict) -> None:
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        ru.save_json(Path(args.output_dir) / "all_results.json", results)
        write_card(args, unwrapped, results)


def write_card(args, model, results: dict) -> None:
    """`README.md` in the output folder: the model card with the norms, the command and the scores."""
    scores = {k: round(v, 2) for k, v in results.items() if "bleu" in k and isinstance(v, float)}
    card = render_model_card(
        model, repo_id=args.hub_model_id or Path(args.output_dir).resolve().name,
        language=[args.source_lang, args.target_lang], datasets=args.dataset_name, results=scores,
        training_command=" ".join(["accelerate launch recipes/train_wmt.py", *sys.argv[1:]]),
        description=f"A PowerNorm Transformer for {args.source_lang}->{args.target_lang} translation, "
                    f"trained on {args.dataset_name or args.train_file or 'the embedded synthetic corpus'}.")
    card.save(Path(args.output_dir) / "README.md")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              log_with="all" if args.with_tracking else None, project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(args.seed)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    tokenizer, data = load_data(args, accelerator)
    model = build_model(args, tokenizer, accelerator.num_processes)
    logger.info(f"{len(data['train'])} training pairs, vocabulary {len(tokenizer)}, "
                f"{model.num_parameters():,} parameters, norms {model.config.encoder_norm_type} (encoder) / "
                f"{model.config.decoder_norm_type} (decoder), {accelerator.num_processes} process(es)")
    optimizer = ru.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = ru.inverse_sqrt_schedule(optimizer, args.warmup_steps, args.warmup_init_lr)
    loader, sampler = train_loader(args, data["train"], tokenizer.pad_token_id)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(scheduler)
    if args.with_tracking:
        accelerator.init_trackers("train_wmt", {k: v for k, v in vars(args).items() if v is not None})
    steps = train(args, accelerator, model, tokenizer, optimizer, scheduler, loader, sampler)
    results = {"train_steps": steps}
    for split in ("validation", "test"):
        if split in data:
            split_loader = accelerator.prepare(eval_loader(args, data[split], tokenizer.pad_token_id))
            scores = evaluate_bleu(args, accelerator, model, split_loader, tokenizer)
            results.update({f"{split}_{k}": v for k, v in scores.items()})
            accelerator.print(f"{split}: BLEU {scores['bleu']:.2f} ({scores['bleu_signature']})")
    save_outputs(args, accelerator, model, tokenizer, results)
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
