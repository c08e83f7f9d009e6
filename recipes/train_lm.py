"""Train a PowerNorm Transformer language model with Accelerate (the paper's Section 5.2, Table 3).

A decoder-only `PowerNormTransformerForCausalLM` with PN at every norm (preset `lm-small`),
trained on fixed-length blocks of the token stream. Perplexity is exp(mean token NLL) over the
whole validation/test stream (every token after the first is scored exactly once), gathered across
processes. Without arguments a small model trains on the embedded English corpus (validation
perplexity 52 after the first epoch, 10.3 after 402 updates, about 30 s on 2 CPU cores). PTB:

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
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_training as rt  # noqa: E402
import recipe_utils as ru  # noqa: E402

from hf_powernorm import PRESETS, PowerNormTransformerForCausalLM  # noqa: E402

# The default model for the embedded corpus: the preset `lm-small` at a laptop's size.
DEFAULT_SIZE = {**{k: v for k, v in PRESETS["lm-small"].items() if k != "vocab_size"},
                "hidden_size": 64, "intermediate_size": 256, "decoder_layers": 2, "num_attention_heads": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a PowerNorm Transformer language model.")
    rt.add_recipe_args(p, learning_rate=2e-3, warmup_steps=100, num_train_epochs=6, output_dir="outputs/lm")
    p.add_argument("--block_size", type=int, default=64, help="tokens per training/evaluation block")
    args = p.parse_args(argv)
    rt.check_args(args)
    if args.block_size < 2 or args.block_size > args.max_tokens:
        raise ValueError(f"--block_size must be in [2, --max_tokens={args.max_tokens}]; got {args.block_size}")
    return args


def load_data(args: argparse.Namespace,
              accelerator: Accelerator) -> tuple[PreTrainedTokenizerFast, dict, dict[str, int]]:
    """Text lines -> tokenizer -> token stream per split -> blocks of `block_size` tokens; also the
    number of words per split, end of line counted as one (PTB's convention for word perplexity)."""
    files = ru.data_files_from_args(args.train_file, args.validation_file, args.test_file)
    raw = ru.load_lm_dataset(dataset_name=args.dataset_name, dataset_config=args.dataset_config, data_files=files)
    if "train" not in raw:
        raise ValueError(f"no train split; got {list(raw)} (pass --train_file)")
    raw = ru.split_train(raw, seed=args.seed)
    tokenizer = ru.prepare_tokenizer(args, accelerator, lambda: ru.column_texts(raw["train"]))
    blocks = {split: ru.lm_blocks(ru.token_stream(part, tokenizer), args.block_size) for split, part in raw.items()}
    words = {split: sum(len(line.split()) + 1 for line in ru.column_texts(part)) for split, part in raw.items()}
    return tokenizer, blocks, words


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast,
                num_processes: int) -> PowerNormTransformerForCausalLM:
    """The preset `lm-small` (PN everywhere), at `DEFAULT_SIZE` unless `--preset` is given."""
    fields = {"encoder_norm_type": args.norm_type, "decoder_norm_type": args.norm_type} if args.norm_type else {}
    config = rt.build_config(args, tokenizer, num_processes, DEFAULT_SIZE, args.block_size, **fields)
    return PowerNormTransformerForCausalLM(config)


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss  # mean NLL of the batch's next-token predictions


@torch.no_grad()
def evaluate_perplexity(accelerator: Accelerator, model: torch.nn.Module,
                        loader: DataLoader) -> dict[str, float | int]:
    """exp(mean NLL) over every scored token of the split: per-block sums, gathered over processes."""
    model.eval()
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sums, counts = accelerator.gather_for_metrics(ru.sequence_nll(logits, batch["labels"]))  # (blocks,) each
        nll += sums.double().sum().cpu()
        count += int(counts.sum())
    model.train()
    return {"perplexity": ru.perplexity(float(nll), count), "loss": float(nll) / count, "tokens": count,
            "nll": float(nll)}


def final_scores(args: argparse.Namespace, accelerator: Accelerator, model: torch.nn.Module,
                 loaders: dict[str, DataLoader], words: dict[str, int]) -> dict[str, float | int]:
    """`<split>_perplexity` (per token), `_word_perplexity` (per word, whole splits only), `_tokens`..."""
    results: dict[str, float | int] = {}
    for split, loader in loaders.items():
        scores = evaluate_perplexity(accelerator, model, loader)
        if not args.max_eval_samples:  # the whole split: its NLL per word, as word-level models report
            scores["word_perplexity"] = ru.perplexity(scores["nll"], words[split])
        results.update({f"{split}_{k}": v for k, v in scores.items()})
        accelerator.print(f"{split}: perplexity {scores['perplexity']:.3f} over {scores['tokens']} tokens"
                          f", {scores.get('word_perplexity', float('nan')):.3f} per word")
    return results


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    args = parse_args(argv)
    accelerator = rt.make_accelerator(args)
    rt.start_run(accelerator, args, "train_lm")
    tokenizer, data, words = load_data(args, accelerator)
    model = build_model(args, tokenizer, accelerator.num_processes)
    rt.log_run_start(accelerator, args, model, f"{len(data['train'])} training blocks of up to "
                                               f"{args.block_size} tokens, vocabulary {len(tokenizer)}")
    optimizer = ru.build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = ru.inverse_sqrt_schedule(optimizer, args.warmup_steps, args.warmup_init_lr)
    collate = ru.PaddingCollator(tokenizer.pad_token_id)
    loader, sampler = rt.train_loader(data["train"], collate, args.max_tokens, args.seed)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    evals = {s: accelerator.prepare(rt.eval_loader(data[s], collate, args.eval_batch_size, args.max_eval_samples))
             for s in ("validation", "test") if s in data}
    stopper = rt.EarlyStopping("min", args.patience)
    accelerator.register_for_checkpointing(scheduler, stopper)
    validate = (lambda: evaluate_perplexity(accelerator, model, evals["validation"])["perplexity"]) \
        if "validation" in evals else None
    steps = rt.train(args, accelerator, model, optimizer, scheduler, loader, lm_loss, sampler=sampler,
                     evaluate=validate, stopper=stopper, tokenizer=tokenizer)
    results = rt.finish_training(accelerator, model, args.output_dir, stopper, steps)
    results.update(final_scores(args, accelerator, model, evals, words))
    rt.save_outputs(accelerator, model, tokenizer, args, results, card_kwargs(args, argv))
    return results


def card_kwargs(args: argparse.Namespace, argv: list[str] | None) -> dict[str, str | None]:
    data = args.dataset_name or args.train_file or "the embedded English corpus"
    return {"repo_id": args.hub_model_id or Path(args.output_dir).resolve().name, "language": "en",
            "datasets": args.dataset_name, "training_command": rt.training_command("recipes/train_lm.py", argv),
            "description": f"A PowerNorm Transformer language model trained on {data}."}


if __name__ == "__main__":
    main()
