"""Average the weights of the last N checkpoints (the paper's translation recipe, Section 5.1).

Each checkpoint is a complete `step_<N>` folder written by a recipe (its manifest matches its
files); incomplete ones, left by a run killed while it wrote them, are passed over with
`--checkpoint_dir` and refused with `--inputs`, as are inputs given out of order or whose tensors
differ in names or shapes. Floating-point tensors are averaged in float64 and cast back to their
dtype; integer and boolean tensors (e.g. PowerNorm's `num_batches_tracked` step counter) are
copied from the newest checkpoint. The output is an export: the averaged `model.safetensors`, the
newest checkpoint's config, code files and tokenizer (not its optimizer, schedule or RNG states),
`all_results.json` (the averaged checkpoints and their updates) and a model card. It is written in
a temporary folder and renamed into place, so it is complete or absent; an existing one is
replaced only with `--overwrite`.

    python recipes/average_checkpoints.py --checkpoint_dir outputs/wmt --num_checkpoints 5 \
        --output_dir outputs/wmt/averaged
    python recipes/average_checkpoints.py --inputs ckpt_a ckpt_b --output_dir averaged
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_powernorm.training import select_checkpoints, training_command, write_average
from hf_powernorm.training.tasks import run_script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", help="folder holding checkpoint folders such as step_1000")
    source.add_argument("--inputs", nargs="+", help="checkpoint folders, oldest first")
    parser.add_argument("--num_checkpoints", type=int, default=5,
                        help="with --checkpoint_dir: how many of the newest complete checkpoints to average")
    parser.add_argument("--prefix", help="with --checkpoint_dir: checkpoint name prefix (e.g. step)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace --output_dir if it exists")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not args.overwrite:
        raise ValueError(f"--output_dir {output_dir} already exists; pass --overwrite to replace it")
    folders = ([Path(p) for p in args.inputs] if args.inputs
               else select_checkpoints(args.checkpoint_dir, args.num_checkpoints, args.prefix))
    write_average(folders, output_dir, overwrite=args.overwrite,
                  command=training_command("recipes/average_checkpoints.py", argv))
    print(f"averaged {len(folders)} checkpoints ({', '.join(f.name for f in folders)}) into {output_dir}")


if __name__ == "__main__":
    run_script(main)
