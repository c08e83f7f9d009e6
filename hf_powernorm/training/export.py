"""The export of a run: `save_pretrained` (weights with every running statistic, config, code
files), the tokenizer, the results files of Transformers' examples (`all_results.json`,
`train_results.json`, `eval_results.json`), the model card with the command as given, the final
scores to the trackers and, with `--push_to_hub`, the export to the Hub; and what an average of
checkpoints needs to be an export. An export holds no pickle: weights in safetensors, everything
else JSON or text."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from transformers.dynamic_module_utils import custom_object_save

from .. import modeling_powernorm
from ..configuration_powernorm import PowerNormTransformerConfig
from ..converted_norms import CONVERSION_CONFIG_KEY
from ..hub import render_conversion_card, render_model_card, upload_saved_model
from .atomic_files import full_disk_error, remove_path
from .checkpoints import RESULTS_NAME, latest_checkpoint
from .options import BadInput

logger = get_logger(__name__)
_TRAIN_KEYS = ("train_steps", "best_step", "best_validation")


def save_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON (e.g. `all_results.json`)."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def training_command(script: str, argv: list[str] | None) -> str:
    """The command line of this run, as it would be typed."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["accelerate launch", script, *map(shlex.quote, args)])


def save_results(output_dir: str | Path, results: dict[str, Any]) -> None:
    """`all_results.json` (everything), `train_results.json` (the training summary) and
    `eval_results.json` (the scores of the evaluation splits)."""
    output_dir = Path(output_dir)
    save_json(output_dir / RESULTS_NAME, results)
    save_json(output_dir / "train_results.json", {k: v for k, v in results.items() if k in _TRAIN_KEYS})
    save_json(output_dir / "eval_results.json", {k: v for k, v in results.items() if k not in _TRAIN_KEYS})


def save_outputs(accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace,
                 results: dict[str, Any], card_kwargs: dict[str, Any]) -> None:
    """`save_pretrained` (weights, config, code files), tokenizer, the results files and the model
    card `README.md` in `args.output_dir`, with the run's float metrics and `card_kwargs` for
    `render_model_card`; the metrics go to the trackers, the export to the Hub with `--push_to_hub`.
    Ends the run (`end_training`)."""
    output_dir = args.output_dir
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    with _export_removed_on_full_disk(Path(output_dir), accelerator.is_main_process):
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)
        if accelerator.is_main_process:
            _take_the_models_length(tokenizer, unwrapped.config)
            tokenizer.save_pretrained(output_dir)
            save_results(output_dir, results)
            scores = {k: round(v, 4) for k, v in results.items() if isinstance(v, float) and math.isfinite(v)}
            if getattr(unwrapped.config, CONVERSION_CONFIG_KEY, None):
                card_text = render_conversion_card(unwrapped, results=scores, **{
                    key: card_kwargs[key] for key in ("repo_id", "description", "training_command")
                    if key in card_kwargs})
                (Path(output_dir) / "README.md").write_text(card_text, encoding="utf-8")
            else:
                card = render_model_card(unwrapped, results=scores, with_tokenizer=True, **card_kwargs)
                card.save(Path(output_dir) / "README.md")
    if args.with_tracking:
        accelerator.log({k: v for k, v in results.items() if isinstance(v, (int, float))},
                        step=results.get("train_steps"))
    if args.push_to_hub and accelerator.is_main_process:
        _push(output_dir, args.hub_model_id, results)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _take_the_models_length(tokenizer: Any, config: Any) -> None:
    """The exported tokenizer's `model_max_length`: the positions the model takes, not the block or
    sequence length the run tokenized for (kept where the config names no positions)."""
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions:
        tokenizer.model_max_length = positions
        tokenizer.init_kwargs["model_max_length"] = positions


@contextlib.contextmanager
def _export_removed_on_full_disk(folder: Path, main_process: bool) -> Iterator[None]:
    """A full disk while the export is written: what it wrote removed (the folder's earlier entries,
    the checkpoints among them, kept) and one line (`DiskFullError`) saying how to export again."""
    before = {path.name for path in folder.iterdir()} if folder.is_dir() else set()
    try:
        yield
    except BaseException as error:
        def message() -> str:  # the checkpoints looked at for a full disk only
            latest = latest_checkpoint(folder) if folder.is_dir() else None
            again = (f"--resume_from_checkpoint latest (from {latest.name}) exports it" if latest is not None
                     else "run again")
            return f"writing the export failed and its partial files were removed; free some space and {again}"

        full = full_disk_error(error, folder, message)
        if full is None:
            raise
        if main_process and folder.is_dir():
            for path in folder.iterdir():
                if path.name not in before:
                    with contextlib.suppress(OSError):
                        remove_path(path)
        raise full from error


def _push(output_dir: str | Path, hub_model_id: str, results: dict[str, Any]) -> None:
    try:
        commit = upload_saved_model(output_dir, hub_model_id, commit_message=f"Upload PowerNorm "
                                    f"Transformer ({results.get('train_steps')} updates)")
    except Exception as error:
        raise RuntimeError(f"uploading to {hub_model_id} failed ({error}); the export in {output_dir} "
                           f"is complete: upload it again with hf_powernorm.hub.upload_saved_model") from error
    logger.info(f"pushed {output_dir} to {commit.commit_url}", main_process_only=True)


def complete_average_export(folder: str | Path, repo_id: str, steps: list[int], command: str | None = None) -> None:
    """What an average of checkpoints lacks to be an export: the model's code files (the
    checkpoints hold the config's only) and the model card `README.md`, for the model that the
    config in `folder` describes (built on the meta device: neither needs weights)."""
    config = PowerNormTransformerConfig.from_pretrained(folder)
    head = (config.architectures or ["PowerNormTransformerModel"])[0]
    if not hasattr(modeling_powernorm, head):
        raise BadInput(f"{folder}/config.json names the architecture {head!r}, not a PowerNorm Transformer head")
    with torch.device("meta"):
        model = getattr(modeling_powernorm, head)(config)
    custom_object_save(model, folder)
    card = render_model_card(model, repo_id=repo_id, with_tokenizer=True, training_command=command,
                             description=f"The average of the weights of {len(steps)} checkpoints of a PowerNorm "
                                         f"Transformer run (updates {', '.join(map(str, steps))}).")
    card.save(Path(folder) / "README.md")
