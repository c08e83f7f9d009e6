"""Train a PowerNorm Transformer language model with Accelerate (the paper's Section 5.2, Table 3).

A decoder-only `PowerNormTransformerForCausalLM` with PN at every norm (preset `lm-small`),
trained on fixed-length blocks of the token stream. Perplexity is exp(mean token NLL) over the
whole validation/test stream (every token after the first is scored exactly once), gathered across
processes. Without arguments a small model trains on the embedded English corpus (validation
perplexity from about 500 to under 4 in a few minutes on a laptop CPU). PTB, as plain text files:

    accelerate launch recipes/train_lm.py --train_file ptb/ptb.train.txt \
        --validation_file ptb/ptb.valid.txt --test_file ptb/ptb.test.txt --preset lm-small \
        --vocab_size 10000 --block_size 256 --max_tokens 8192 --learning_rate 5e-4 \
        --warmup_steps 4000 --clip_norm 0.25 --num_train_epochs 30 --patience 5 --output_dir outputs/ptb

Note: with a BPE tokenizer the perplexity is per BPE token, not per word.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_training as rt  # noqa: E402
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PowerNormTransformerConfig, PowerNormTransformerForCausalLM  # noqa: E402

# The default model for the embedded corpus (the preset `lm-small` at a laptop's size).
DEFAULT_SIZE = {"hidden_size": 64, "intermediate_size": 256, "decoder_layers": 2, "num_attention_heads": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer language model.")
    rt.add_data_args(p)
    p.add_argument("--vocab_size", type=int, default=500, help="BPE size when training a tokenizer")
    p.add_argument("--block_size", type=int, default=64, help="tokens per training/evaluation block")
    rt.add_model_args(p)
    p.add_argument("--norm_type", help="every norm of the model (default: the preset's, powernorm)")
    rt.add_training_args(p, learning_rate=2e-3, warmup_steps=100, num_train_epochs=4, max_tokens=1024,
                         output_dir="outputs/lm")
    args = p.parse_args(argv)
    rt.check_args(args, ["norm_type"])
    if args.block_size < 2 or args.block_size > args.max_tokens:
        raise ValueError(f"--block_size must be in [2, --max_tokens={args.max_tokens}]; got {args.block_size}")
    return args


def load_data(args: argparse.Namespace, accelerator) -> tuple[object, dict]:
    """Text lines -> tokenizer -> token stream per split -> blocks of `block_size` tokens."""
    files = ru.data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = ru.load_lm_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
    raw = ru.split_train(raw, seed=args.seed)
    tokenizer = rt.build_tokenizer(accelerator, args.tokenizer_name, args.output_dir,
                                   lambda: ru.column_texts(raw["train"]), args.vocab_size)
    blocks = {split: ru.lm_blocks(ru.token_stream(part, tokenizer), args.block_size) for split, part in raw.items()}
    return tokenizer, blocks


def build_model(args: argparse.Namespace, tokenizer, num_processes: int) -> PowerNormTransformerForCausalLM:
    overrides = rt.powernorm_overrides(args)
    if args.norm_type:
        overrides.update(encoder_norm_type=args.norm_type, decoder_norm_type=args.norm_type)
    if args.preset is None:
        overrides = {**DEFAULT_SIZE, **overrides}
    config = PowerNormTransformerConfig.from_preset(
        args.preset or "lm-small", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **overrides)
    config.max_position_embeddings = max(config.max_position_embeddings, args.block_size + 2)
    return PowerNormTransformerForCausalLM(rt.finish_config(config, args, num_processes))


def lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss  # mean NLL of the batch's next-token predictions


@torch.no_grad()
def evaluate_perplexity(accelerator, model, loader) -> dict[str, float | int]:
    """exp(mean NLL) over every scored token of the split: per-block sums, gathered over processes."""
    model.eval()
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        per_token = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels,
                                    ignore_index=ru.IGNORE_INDEX, reduction="none")  # (batch, seq - 1)
        sums, counts = accelerator.gather_for_metrics((per_token.double().sum(1), (labels != ru.IGNORE_INDEX).sum(1)))
        nll += sums.sum().cpu()
        count += int(counts.sum())
    model.train()
    return {"perplexity": ru.perplexity(float(nll), count), "loss": float(nll) / count, "tokens": count}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = rt.make_accelerator(args)
    tokenizer, data = load_data(args, accelerator)
    model = build_model(args, tokenizer, accelerator.num_processes)
    rt.log_run_start(accelerator, args, model, f"{len(data['train'])} training blocks of up to "
                                               f"{args.block_size} tokens, vocabulary {len(tokenizer)}")
    optimizer = ru.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = ru.inverse_sqrt_schedule(optimizer, args.warmup_steps, args.warmup_init_lr)
    loader, sampler = rt.train_loader(data["train"], tokenizer.pad_token_id, args.max_tokens, args.seed)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    evals = {s: accelerator.prepare(rt.eval_loader(data[s], tokenizer.pad_token_id, args.eval_batch_size))
             for s in ("validation", "test") if s in data}
    stopper = rt.EarlyStopping("min", args.patience)
    accelerator.register_for_checkpointing(scheduler, stopper)
    if args.with_tracking:
        accelerator.init_trackers("train_lm", {k: v for k, v in vars(args).items() if v is not None})
    validate = (lambda: evaluate_perplexity(accelerator, model, evals["validation"])["perplexity"]) \
        if "validation" in evals else None
    steps = rt.train(args, accelerator, model, optimizer, scheduler, loader, lm_loss, sampler=sampler,
                     evaluate=validate, stopper=stopper, tokenizer=tokenizer)
    results = rt.finish_training(accelerator, model, args.output_dir, stopper, steps)
    for split, split_loader in evals.items():
        scores = evaluate_perplexity(accelerator, model, split_loader)
        results.update({f"{split}_{k}": v for k, v in scores.items()})
        accelerator.print(f"{split}: perplexity {scores['perplexity']:.3f} over {scores['tokens']} tokens")
    rt.save_outputs(accelerator, model, tokenizer, args.output_dir, results, card_kwargs(args, argv))
    accelerator.end_training()
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict:
    data = args.dataset_name or args.train_file or "the embedded English corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name, "language": "en",
            "datasets": args.dataset_name, "training_command": rt.training_command("recipes/train_lm.py", argv),
            "description": f"A PowerNorm Transformer language model trained on {data}."}


if __name__ == "__main__":
    main()
