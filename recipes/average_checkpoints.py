"""Average the weights of the last N checkpoints (the paper's translation recipe, Section 5.1).

Each checkpoint is a folder with a `model.safetensors` (a `save_pretrained` directory or an
Accelerate `save_state` folder). Floating-point tensors are averaged in float64 and cast back to
their dtype; integer and boolean tensors (e.g. PowerNorm's `num_batches_tracked` step counter) are
copied from the newest checkpoint. The output folder gets the averaged `model.safetensors` plus
every other file of the newest checkpoint (config, remote code, tokenizer), except the
optimizer/scheduler/RNG states, which do not fit the average.

    python recipes/average_checkpoints.py --checkpoint_dir outputs/wmt --num_checkpoints 5 \
        --output_dir outputs/wmt/averaged
    python recipes/average_checkpoints.py --inputs ckpt_a ckpt_b --output_dir averaged
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_powernorm.training import select_checkpoints, write_average


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", help="folder holding checkpoint folders such as step_1000")
    source.add_argument("--inputs", nargs="+", help="checkpoint folders, oldest first")
    parser.add_argument("--num_checkpoints", type=int, default=5,
                        help="with --checkpoint_dir: how many of the newest checkpoints to average")
    parser.add_argument("--prefix", help="with --checkpoint_dir: checkpoint name prefix (e.g. step)")
    parser.add_argument("--output_dir", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folders = ([Path(p) for p in args.inputs] if args.inputs
               else select_checkpoints(args.checkpoint_dir, args.num_checkpoints, args.prefix))
    output_dir = write_average(folders, args.output_dir)
    print(f"averaged {len(folders)} checkpoints ({', '.join(f.name for f in folders)}) into {output_dir}")


if __name__ == "__main__":
    main()
