"""Average the weights of the last N checkpoints (the paper's translation recipe, Section 5.1).

Each checkpoint is a folder with a `model.safetensors` (a `save_pretrained` directory or an
Accelerate `save_state` folder). Floating-point tensors are averaged in float64 and cast back to
their dtype; integer and boolean tensors (e.g. PowerNorm's `num_batches_tracked` step counter) are
copied from the newest checkpoint, since the mean of step counters is not a step. The output folder
gets the averaged `model.safetensors` plus every other file of the newest checkpoint (config,
remote code, tokenizer), except the optimizer/scheduler/RNG states, which do not fit the average.

    python recipes/average_checkpoints.py --checkpoint_dir outputs/wmt --num_checkpoints 5 \
        --output_dir outputs/wmt/averaged
    python recipes/average_checkpoints.py --inputs ckpt_a ckpt_b --output_dir averaged
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_utils import list_checkpoints  # noqa: E402

WEIGHTS_NAME = "model.safetensors"
_TRAINING_STATE = ("optimizer", "scheduler", "random_states", "scaler", "sampler", "custom_checkpoint")


def select_checkpoints(checkpoint_dir: str | Path, num_checkpoints: int,
                       prefix: str | None = None) -> list[Path]:
    """The newest `num_checkpoints` folders with a `model.safetensors` in `checkpoint_dir`."""
    if num_checkpoints < 1:
        raise ValueError(f"num_checkpoints must be at least 1; got {num_checkpoints}")
    found = list_checkpoints(checkpoint_dir, prefix, required_file=WEIGHTS_NAME)
    if len(found) < num_checkpoints:
        raise ValueError(f"asked to average the last {num_checkpoints} checkpoints but {checkpoint_dir} "
                         f"holds {len(found)} with a {WEIGHTS_NAME}: {[p.name for p in found]}")
    return found[-num_checkpoints:]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        contents = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise FileNotFoundError(f"{path} not found (contents: {contents})")
    return load_file(str(path))


def average_state_dicts(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The averaged state dict of `folders`, ordered oldest to newest."""
    if not folders:
        raise ValueError("no checkpoint to average")
    newest = _weights(folders[-1])
    sums = {k: v.double() for k, v in newest.items() if v.is_floating_point()}
    for folder in tqdm(folders[:-1], desc="Averaging checkpoints"):
        state = _weights(folder)
        if state.keys() != newest.keys():
            diff = sorted(state.keys() ^ newest.keys())
            raise ValueError(f"{folder} and {folders[-1]} hold different tensors: {diff[:10]}")
        for key, total in sums.items():
            if state[key].shape != total.shape:
                raise ValueError(f"tensor {key!r} has shape {tuple(state[key].shape)} in {folder} "
                                 f"but {tuple(total.shape)} in {folders[-1]}")
            total += state[key].double()
    return {k: (sums[k] / len(folders)).to(v.dtype) if k in sums else v.clone()
            for k, v in newest.items()}


def write_average(folders: list[Path], output_dir: str | Path) -> Path:
    """Average `folders` into `output_dir`, copying the newest checkpoint's other files."""
    output_dir = Path(output_dir)
    if output_dir.resolve() in {f.resolve() for f in folders}:
        raise ValueError(f"output_dir {output_dir} is one of the averaged checkpoints")
    averaged = average_state_dicts(folders)
    output_dir.mkdir(parents=True, exist_ok=True)
    for item in folders[-1].iterdir():
        if item.is_file() and item.name != WEIGHTS_NAME and not item.name.startswith(_TRAINING_STATE):
            shutil.copy2(item, output_dir / item.name)
    save_file(averaged, str(output_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return output_dir


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
