"""The runs of a comparison: the checks on the model and the data before any training (`prepare`),
each cell's fine-tuning and scores (`run_cell`), the grid of cells with the learning rates chosen
on validation (`run_cells`, `choose_learning_rates`), the kept models, and `run_comparison`, which
holds the output folder for one process while it prepares, runs and writes the outputs."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..training.executors import JOBS_FOLDER, output_to
from ..training.grid import RESULT_NAME, Cell, cell_result, finished_results, run_grid
from ..training.locking import hold_output_folder
from ..training.readers import split_train
from ..training.reports import numeric_scores
from ..training.tasks import Task, get_task, task_names
from .executors import NO_VERDICT, RunsFailed, submit_cells
from ..training.options import BadInput, MissingInput, is_main_process, world_size
from .options import BASELINES, CompareOptions, library_args
from .plan import (
    check_output_folder,
    continue_or_clear,
    given_comparison,
    make_cells,
    redo_changed_runs,
    redo_runs_without_models,
    run_args,
    save_comparison,
    saved_comparison,
)
from .report import final_runs, result_rows, write_outputs

# The tiny GPT-2 of the embedded default.
EMBEDDED_MODEL = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 80}


def task_of(options: CompareOptions | argparse.Namespace) -> Task:
    """The registry's task of `--task` over the options as the library reads them (a run's as they are)."""
    args = options if isinstance(options, argparse.Namespace) else library_args(options)
    task = get_task(args.task)(args)
    task.write_predictions = False  # a comparison keeps scores, not outputs
    return task


# ---------------------------------------------------------------------------------------------
# Checks before any training: model, task, data
# ---------------------------------------------------------------------------------------------

def check_model(options: CompareOptions) -> dict[str, int]:
    """The model fits `--task` (a causal LM for `causal-lm`) and has norms that `convert_norms`
    knows; returns its norm classes and counts (for the report). Builds the model from its config
    only (random weights)."""
    from transformers import AutoConfig

    from ..converter import find_norms

    task = task_of(options)
    config = AutoConfig.from_pretrained(options.model_name_or_path, trust_remote_code=options.trust_remote_code)
    auto_class = task.auto_model_class()
    if type(config) not in auto_class._model_mapping:
        fitting = [name for name in task_names() if type(config) in get_task(name).auto_model_class()._model_mapping]
        raise BadInput(f"--task {task.name} does not fit --model_name_or_path {options.model_name_or_path} "
                       f"(model_type {config.model_type!r} has no {auto_class.__name__}); tasks that fit it: "
                       f"{fitting or 'none'}")
    model = _model_from_config(options)
    task.check_pretrained(model, config)
    norms = find_norms(model, config.get_text_config().hidden_size)
    if not norms:
        raise BadInput(f"--model_name_or_path {options.model_name_or_path} ({type(model).__name__}) has no norm "
                       f"that convert_norms knows (LayerNorm or RMSNorm layers): nothing to compare")
    positions = _positions(config)
    option = f"--{task.length_option}"
    length = getattr(options, task.length_option)
    if positions is not None and length is not None and length > positions:
        raise BadInput(f"{option} {length} exceeds the {positions} positions of --model_name_or_path "
                       f"{options.model_name_or_path}; lower {option}")
    counts: dict[str, int] = {}
    for name in norms:
        cls = type(model.get_submodule(name)).__name__
        counts[cls] = counts.get(cls, 0) + 1
    return counts


def _model_from_config(options: CompareOptions):
    """The model of `--model_name_or_path` for `--task` with random weights, on CPU."""
    import torch
    from transformers import AutoConfig

    trusted = options.trust_remote_code
    config = AutoConfig.from_pretrained(options.model_name_or_path, trust_remote_code=trusted)
    with torch.device("cpu"):
        return task_of(options).auto_model_class().from_config(config, trust_remote_code=trusted)


def check_preserving(options: CompareOptions) -> dict[str, str]:
    """With `preserve_function`, each converted norm of `--norms` tried on the model built from its
    config, with its runs' conversion options: returns the norms it cannot keep the function with
    and why (their runs convert without it, and the report says so). Nothing is tried without."""
    from ..converter import convert_norms
    from ..training.models import converter_options

    if not options.preserve_function:
        return {}
    refused = {}
    for norm in options.norms:
        if norm in BASELINES:
            continue
        try:
            convert_norms(_model_from_config(options), norm, modules=options.convert_modules, preserve_function=True,
                          **converter_options(library_args(options, convert_norms=norm), 1))
        except (ValueError, TypeError) as error:  # a target, source or option it cannot keep the function with
            refused[norm] = " ".join(str(error).split())
    return refused


def _positions(config) -> int | None:
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def fit_lengths(options: CompareOptions, tokenizer) -> None:
    """The task's length option (`--block_size` for causal-lm, else `--max_length`) when not given:
    what the model's positions and the tokenizer allow (as Transformers' `run_clm` does), at most the
    task's cap (1024 tokens a block, 128 a sequence), and `--max_tokens`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(options.model_name_or_path, trust_remote_code=options.trust_remote_code)
    limits = [_positions(config),
              tokenizer.model_max_length if tokenizer.model_max_length < 1e6 else None]
    allowed = min((limit for limit in limits if limit), default=None)
    task = task_of(options)
    if getattr(options, task.length_option) is None:
        setattr(options, task.length_option, min(allowed or task.length_cap, task.length_cap, options.max_tokens))


def embedded_model(folder: Path) -> str:
    """The embedded default's model: a tiny GPT-2 (seed 0) with a BPE of the embedded English
    corpus, saved once into `folder`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..training.corpora import synthetic_lm_corpus
    from ..training.tokenization import column_texts, train_bpe_tokenizer

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        tokenizer = train_bpe_tokenizer(column_texts(synthetic_lm_corpus()["train"]), vocab_size=500)
        config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **EMBEDDED_MODEL)
        GPT2LMHeadModel(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def load_model_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's own tokenizer; one without a padding token pads with its end token
    (`pad_with_eos`, the recipes' rule)."""
    from transformers import AutoTokenizer

    from ..training.tokenization import pad_with_eos

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise BadInput(f"the tokenizer of --model_name_or_path {path} cannot be loaded: "
                       f"{str(error).strip().splitlines()[0]}") from None
    return pad_with_eos(tokenizer, path)


def load_raw_data(options: CompareOptions):
    """The task's splits from `--dataset_name` or the data files (the embedded corpus without
    either), validation and test carved out of train when missing (seed 0: the same for every
    run), checked to hold the task's columns. Data that cannot be read is a ValueError naming it."""
    with reading_data(options):
        raw = split_train(task_of(options).read_splits(seed=0), seed=0)
    if "train" not in raw:
        raise BadInput(f"no train split; found {list(raw)} (pass --train_file, or a --dataset_name with one)")
    from ..training.readers import limit_splits

    return limit_splits(raw, options.max_train_samples, options.max_eval_samples)


@contextlib.contextmanager
def reading_data(options: CompareOptions | argparse.Namespace) -> Iterator[None]:
    """Data that cannot be read (not text, an offline Hub id) as a ValueError naming it and why."""
    import datasets

    try:
        yield
    except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError, RuntimeError) as error:
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        # The readers' own message (e.g. an offline Hub id), else the error deep inside `datasets`.
        reason = str(error) if isinstance(error, RuntimeError) else f"{type(cause).__name__}: {cause}"
        raise BadInput(f"could not read the data {options.dataset_name or options.train_file}: {reason}") from None


def resolve_label_names(options: CompareOptions | argparse.Namespace) -> None:
    """The options the task settles from the data before tokenizing (classification: the class
    names, matched to the model's `id2label`)."""
    task = task_of(options)
    with reading_data(options):
        task.resolve_labels()
    options.label_names = task.args.label_names


def tokenize_data(options: CompareOptions, raw, tokenizer):
    """The cached `Dataset.map` passes of the task: a second run over the same data reads them."""
    return task_of(options).tokenize(raw, tokenizer)


def load_model(args: argparse.Namespace, tokenizer, fields: dict[str, Any], num_processes: int, calibration=None):
    """The model of `--model_name_or_path` through the comparison's one pipeline, the same steps in
    every arm: loaded; with `centre_arms` (`preserve_function` without `--keep_tied_head`) its
    residual stream centred and a tied head untied (`converter.centre_stream`), on the first
    training batches (`calibration`: the training split and its collator); then its norms converted
    to `args.convert_norms` (`--convert_modules`, `--powernorm_*`, `preserve_function` calibrated on
    the same batches), or kept where that is None (the baseline). Returns the model in training mode
    and what its conversion did (`conversion_facts`)."""
    from ..converter import centre_stream
    from ..training.models import calibration_batches, check_embeddings, convert_loaded, load_pretrained

    model = load_pretrained(args, task_of(args).auto_model_class(), **fields)
    batches = calibration_batches(args, calibration, always=args.centre_arms)  # collated once, for both steps
    centring = centre_stream(model, batches, modules=args.convert_modules) if args.centre_arms and batches else None
    report = None
    if args.convert_norms is not None:
        report = convert_loaded(model, args, num_processes, batches, centre_stream=False)
    check_embeddings(model, tokenizer, args.model_name_or_path)
    return model.train(), conversion_facts(model, centring, report, len(batches) if centring is not None else 0)


def conversion_facts(model, centring, report, batches: int) -> dict[str, Any]:
    """What the pipeline did to one arm's model, for the report: the writers of the residual stream
    centred, the head untied (or tied, or neither), the norms converted, exactly or approximately
    (each approximate norm's largest mean / RMS), the calibration batches, the largest change of the
    first logits."""
    from ..converter import head_is_tied

    approximate = [[name, ratio] for name, ratio in report.approximate] if report is not None else []
    return {"centred_writers": len(centring.writers) if centring is not None else 0,
            "head": "untied" if centring is not None and centring.untied else
                    "tied" if head_is_tied(model) else "separate",
            "converted_norms": len(report.replaced) if report is not None else 0,
            "to": report.norm_type if report is not None else None,
            "exact": report.preserves_function if report is not None else None,
            "approximate": approximate, "calibration_batches": batches,
            "start_gap": report.start_gap if report is not None else None}


def arm_invariants(model, args: argparse.Namespace, data, summary: dict[str, Any]) -> dict[str, Any]:
    """What must be equal in every arm of a comparison, at the same seed, for a verdict about the norm:
    the trainable parameters outside the norm modules, the head's tying, the updates, the training
    tokens and a digest of the first training batches' token ids (the data order), the evaluation
    tokens and the learning-rate schedule; and, free to differ, the norm modules' own parameters.
    Under `--patience` the updates and training tokens are each arm's own."""
    from ..converted_norms import MaskAwareNorm
    from ..converter import head_is_tied, is_norm_candidate
    from ..normalization import NORM_CLASSES

    norm_types = (MaskAwareNorm, *NORM_CLASSES.values())
    norms = [name + "." for name, module in model.named_modules()
             if name and (isinstance(module, norm_types) or is_norm_candidate(module))]
    inside = outside = 0
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            if any(name.startswith(prefix) for prefix in norms):
                inside += parameter.numel()
            else:
                outside += parameter.numel()
    evaluated = {split: sum(len(ids) for ids in data[split]["input_ids"]) for split in ("validation", "test")
                 if split in data}
    # Under early stopping each arm stops where its own validation does: its updates and tokens are the
    # treatment's, not an invariant.
    stopping = args.patience is not None
    return {"trainable_outside_norms": outside, "norm_parameters": inside, "head_tied": head_is_tied(model),
            "updates": f"early stopping (patience {args.patience})" if stopping else summary.get("train_steps"),
            "train_tokens": None if stopping else summary.get("train_tokens"),
            "first_batches": summary.get("first_batches_sha256"), "eval_tokens": evaluated,
            "schedule": f"{args.lr_scheduler_type}, warmup {args.num_warmup_steps}, "
                        f"at most {args.max_train_steps} updates"}


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """One progress bar per run: no bars of Transformers' shard writing or of `datasets`' passes
    while the comparison runs; the caller's settings come back after it."""
    import datasets
    import transformers

    shown = transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown[0]:
            transformers.utils.logging.enable_progress_bar()
        if shown[1]:
            datasets.enable_progress_bars()


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """Fine-tune and score one (norm, seed, learning rate) of the comparison in `folder`: the
    validation score right after conversion, the training, the scores of the best validated model,
    the time it took and, for seq2seq, three sample outputs. The libraries' progress bars are off
    while it runs, in `main`'s process or in a fresh one of `--jobs`."""
    with _quiet_libraries():
        return _run_cell(cell, folder)


def _run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    from ..training.checkpoints import remove_checkpoints
    from ..training.loop import make_accelerator, prepare_eval_loaders
    from ..training.losses import model_loss
    from ..training.tasks import fit_and_score

    started = time.perf_counter()
    if world_size() == 1:  # under `accelerate launch`, `run_cells` has readied the folder
        continue_or_clear(folder, saved_comparison(folder.parents[1])["args"].get("checkpoint_runs", False))
    args = run_args(cell, folder)
    task = task_of(args)
    if args.embedded_default:
        import torch

        torch.set_num_threads(1)  # a tiny model: several threads cost more than they bring
    accelerator = make_accelerator(args, task.input_path_options)
    task.tokenizer = tokenizer = load_model_tokenizer(args.model_name_or_path, args.trust_remote_code)
    task.resolve_labels()
    with accelerator.main_process_first():
        raw = load_raw_data(args)
        data = task.tokenize(raw, tokenizer)
    collate = task.train_collate()
    model, conversion = load_model(args, tokenizer, task.pretrained_fields(), accelerator.num_processes,
                                   calibration=(data["train"], collate))
    evals = prepare_eval_loaders(accelerator, data, collate, args.eval_batch_size)
    model.to(accelerator.device)
    start = task.evaluate(accelerator, model, evals["validation"], "validation")  # the starting handicap
    start.setdefault("loss", validation_loss(accelerator, model, evals["validation"]))
    # The model's own loss for every task: a pretrained head is fine-tuned as it was trained.
    model, summary, scores = fit_and_score(task, accelerator, model, data, evals, loss=model_loss)
    invariants = arm_invariants(accelerator.unwrap_model(model), args, data, summary)
    samples = task.samples(accelerator, model, raw, data, collate)
    for tracker in accelerator.trackers:  # not `end_training`: the next run needs the process group
        tracker.finish()
    if accelerator.is_main_process:
        if not args.save_models:  # the weights are not what a comparison keeps
            shutil.rmtree(Path(args.output_dir) / "best_model", ignore_errors=True)
        remove_checkpoints(args.output_dir)  # they served their end
    accelerator.wait_for_everyone()
    return {**summary, "scores": numeric_scores(scores), "start": numeric_scores(start), "samples": samples,
            "conversion": conversion, "invariants": invariants,
            "seconds": round(time.perf_counter() - started, 1),
            "fingerprint": saved_comparison(folder.parents[1])["fingerprint"]}


def validation_loss(accelerator, model, loader) -> float:
    """The model's own loss over `loader`, averaged over examples (every process's batches)."""
    import torch

    from ..training.losses import model_loss

    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in loader:
            count = batch["input_ids"].shape[0]
            pair = torch.stack([model_loss(model, batch).double() * count,
                                torch.tensor(count, dtype=torch.float64, device=batch["input_ids"].device)])
            total += accelerator.gather_for_metrics(pair[None]).sum(0).cpu()
    model.train()
    return float(total[0] / total[1])


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------

def run_cells(cells: list[Cell], options: CompareOptions) -> list[dict[str, Any]]:
    """The unfinished runs of `cells`, one after the other in this process (under `accelerate
    launch` every process runs every cell together, the main process clearing its folder and
    writing its result), or with `--jobs N` by `run_grid` in N processes at once. A finished run
    whose inputs changed since is run again (and with `--save_models` one that kept no model), and
    what is left to run is said first; each run
    shows one progress bar, announced by a line."""
    if not options.report_only and is_main_process():
        redo_changed_runs(cells, options.output_dir)
        if options.save_models:  # added to runs that finished without it: they run again to keep their models
            redo_runs_without_models(cells, options.output_dir)
        finished = sum(cell_result(options.output_dir, cell) is not None for cell in cells)
        print(f"{finished} of {len(cells)} runs finished, {len(cells) - finished} to run", file=sys.stderr)
    if options.executor != "local" and not options.report_only:
        # Each job is given the options with its cell: none reads `compare.json`, which could change while it waits.
        failed = submit_cells(cells, functools.partial(run_job, comparison=saved_comparison(options.output_dir)),
                              options)
        if failed:
            raise RunsFailed(failed, NO_VERDICT)
        return [cell_result(options.output_dir, cell) for cell in cells]
    if options.jobs > 1 or options.report_only:
        return run_grid(cells, run_cell, options.output_dir, jobs=options.jobs, desc="Comparison",
                        report_only=options.report_only, resume_cells=True)
    run_cells_here(cells, options.output_dir, options.cpu)
    return [r for r in (cell_result(options.output_dir, cell) for cell in cells) if r is not None]


def run_job(cell: Cell, output_dir: str, gpus_per_run: int = 0, log: str | None = None,
            comparison: dict[str, Any] | None = None) -> None:
    """One run of `--executor submitit` or `ray`, in its job's process: the cell run and its result
    written, as the local grid does; with more than one GPU, through `accelerate launch` of this
    module (one process per GPU, as `accelerate launch hf-powernorm compare` runs each cell). `log`:
    a file for the run's output (Ray's tasks; submitit keeps its own); `comparison`: the options and
    fingerprint the driver submitted with the cell, read instead of `compare.json`."""
    import torch

    comparison = saved_comparison(output_dir) if comparison is None else comparison
    torch.set_num_threads(comparison["args"]["cpus_per_run"])  # the cores the job was given
    with output_to(log), given_comparison(output_dir, comparison):
        if gpus_per_run > 1:
            cell_file = Path(output_dir) / JOBS_FOLDER / f"{cell.name}.cell.json"
            cell_file.parent.mkdir(parents=True, exist_ok=True)
            cell_file.write_text(json.dumps({"name": cell.name, "options": cell.options, "paths": cell.paths,
                                             "comparison": comparison}))
            import socket
            import subprocess

            with socket.socket() as sock:  # a port of its own: jobs may share a node
                sock.bind(("127.0.0.1", 0))
                port = str(sock.getsockname()[1])
            subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
                            "--num_processes", str(gpus_per_run), "--main_process_port", port, "-m", __name__,
                            output_dir, str(cell_file)], check=True)
            return
        run_cells_here([cell], output_dir)


def run_cells_here(cells: Sequence[Cell], output_dir: str | Path, cpu: bool = False) -> None:
    """The unfinished `cells` one after the other in this process, or in every process of an
    `accelerate launch` together (the main process readying each folder and writing its result)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    from ..training.checkpoints import write_json_atomically

    state = PartialState(cpu=cpu)
    state.wait_for_everyone()  # the main process has set aside the runs to redo
    todo = [cell for cell in cells if cell_result(output_dir, cell) is None]
    state.wait_for_everyone()  # every process has read which cells are finished
    checkpoint_runs = saved_comparison(output_dir)["args"].get("checkpoint_runs", False)
    for number, cell in enumerate(todo, start=1):
        folder = Path(output_dir) / "cells" / cell.name
        if state.is_main_process:
            print(f"run {number} of {len(todo)}: {cell.name}", file=sys.stderr)
            if world_size() > 1:
                continue_or_clear(folder, checkpoint_runs)
        state.wait_for_everyone()
        result = {"cell": cell.name, **cell.options, **run_cell(cell, folder)}
        if state.is_main_process:
            write_json_atomically(folder / RESULT_NAME, result)
        state.wait_for_everyone()
        AcceleratorState._reset_state()  # the next run builds its own Accelerator


def choose_learning_rates(options: CompareOptions) -> dict[str, float]:
    """Each norm's learning rate: `--learning_rate`, or with `--tune_lr` the rate of `--lr_grid`
    whose run with the first seed scored best on validation."""
    if not options.tune_lr:
        return {norm: options.learning_rate for norm in options.norms}
    grid = {norm: list(options.lr_grid) for norm in options.norms}
    results = run_cells(make_cells(options, grid, options.seeds[:1]), options)
    task = task_of(options)
    chosen = {}
    for norm in options.norms:
        scored = [(r["scores"][f"validation_{task.metric}"], r["learning_rate"]) for r in results if r["norm"] == norm]
        if not scored:  # --report_only before the grid finished
            continue
        pick = min if task.mode == "min" else max
        chosen[norm] = pick(scored, key=lambda pair: _finite(pair[0], task.mode))[1]
    return chosen


def _finite(value: float, mode: str) -> float:
    """A diverged run's score (NaN) ranks last."""
    return value if not math.isnan(value) else (math.inf if mode == "min" else -math.inf)


# ---------------------------------------------------------------------------------------------
# Outputs: results.csv, report.md, validation_curves.png
# ---------------------------------------------------------------------------------------------
# The models a comparison keeps
# ---------------------------------------------------------------------------------------------

def keep_best_models(results: Sequence[dict[str, Any]], chosen: dict[str, float],
                     options: CompareOptions) -> dict[str, Path]:
    """`--save_models`: each norm's best run over the seeds (by its best validation score) copied
    with the tokenizer into `output_dir/models/<norm>`; returns the folders."""
    mode = task_of(options).mode
    kept = {}
    for norm in options.norms:
        runs = [r for r in final_runs(results, norm, chosen) if r.get("best_validation") is not None]
        folders = {r["cell"]: Path(options.output_dir) / "cells" / r["cell"] / "run" / "best_model" for r in runs}
        runs = [r for r in runs if folders[r["cell"]].is_dir()]
        if not runs:
            continue
        pick = min if mode == "min" else max
        best = pick(runs, key=lambda r: _finite(r["best_validation"], mode))
        target = Path(options.output_dir) / "models" / norm
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folders[best["cell"]], target, symlinks=True)  # a link stays one: never uploaded
        load_model_tokenizer(options.model_name_or_path, options.trust_remote_code).save_pretrained(target)
        (target / "comparison_run.json").write_text(json.dumps({k: best[k] for k in (
            "cell", "norm", "seed", "learning_rate", "best_step", "best_validation", "scores")}, indent=1))
        kept[norm] = target
    return kept


def push_models(kept: dict[str, Path], options: CompareOptions) -> list[str]:
    """`--push_to_hub`: each kept model uploaded to `<--hub_model_id>-<norm>` as a recipe's export is
    (`upload_saved_model`: its top-level files, no link followed); a repository created private with
    `--hub_private_repo`, else as the account's default is. Returns the repositories."""
    from huggingface_hub import HfApi

    from ..hub import upload_saved_model

    api, repos = HfApi(), []
    for norm, folder in kept.items():
        repo = api.create_repo(f"{options.hub_model_id}-{norm}", private=options.hub_private_repo or None,
                               exist_ok=True).repo_id
        upload_saved_model(folder, repo, commit_message=f"hf-powernorm compare: the best {norm} model")
        repos.append(repo)
    return repos


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------

def prepare(options: CompareOptions) -> dict[str, Any]:
    """Every check before training, on the main process first: the model (the embedded default's
    built once) and the lengths it allows, the class names, the output folder, the data read and
    tokenized into the cache; `compare.json` written with the inputs' fingerprint. Returns the
    model's norm classes and counts, and its vocabulary size."""
    from ..training.arguments import check_batch_budget
    from ..training.models import resolve_model_path

    if options.model_name_or_path is not None:
        options.model_name_or_path = resolve_model_path(options.model_name_or_path)
        saved = _saved_config(options.model_name_or_path)
        check_not_converted(options, saved)
        check_own_code(options, saved)
        facts = model_facts(options)
        options.not_preserved = check_preserving(options)
        fit_lengths(options, load_model_tokenizer(options.model_name_or_path, options.trust_remote_code))
        check_batch_budget(library_args(options))
        resolve_label_names(options)
    check_output_folder(options)
    if options.report_only and not any((Path(options.output_dir) / "cells").glob(f"*/{RESULT_NAME}")):
        raise MissingInput(f"--report_only: no finished run under {options.output_dir}/cells")  # nothing written
    if options.model_name_or_path is None:
        options.model_name_or_path = embedded_model(Path(options.output_dir) / "model")
        facts = model_facts(options)
        resolve_label_names(options)
    if not options.report_only:
        tokenizer = load_model_tokenizer(options.model_name_or_path, options.trust_remote_code)
        tokenize_data(options, load_raw_data(options), tokenizer)
    Path(options.output_dir).mkdir(parents=True, exist_ok=True)
    if not options.report_only:
        save_comparison(options, facts)
    return facts


def _saved_config(path: str) -> dict[str, Any]:
    """The `config.json` of a model folder as saved ({} where the folder has none)."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}


def check_not_converted(options: CompareOptions, saved: dict[str, Any]) -> None:
    """A model whose norms `convert_norms` already replaced (a kept `models/<norm>`; `saved`: its
    `config.json`): one line naming its norm, as a comparison converts a model's own LayerNorms or
    RMSNorms (it would find none)."""
    from ..converted_norms import CONVERSION_CONFIG_KEY

    conversion = saved.get(CONVERSION_CONFIG_KEY)
    if isinstance(conversion, dict) and "norm_type" in conversion:
        raise BadInput(f"--model_name_or_path {options.model_name_or_path}: its norms were converted to "
                       f"{conversion['norm_type']} ({CONVERSION_CONFIG_KEY} in its config.json); a comparison "
                       f"converts a model's own LayerNorm or RMSNorm layers: give the model it was converted from")


def check_own_code(options: CompareOptions, saved: dict[str, Any]) -> None:
    """A model that brings its own code, without `--trust_remote_code`: one line that says to pass it,
    where Transformers (told `trust_remote_code=False`) would refuse it, by its rule: the config's
    (`saved`) `auto_map` names an `AutoConfig` class and its `model_type` is not one Transformers knows."""
    from transformers import CONFIG_MAPPING

    if options.trust_remote_code:
        return
    if "AutoConfig" in saved.get("auto_map", {}) and saved.get("model_type") not in CONFIG_MAPPING:
        raise BadInput(f"--model_name_or_path {options.model_name_or_path} brings its own code (an auto_map in "
                       f"its config.json): pass --trust_remote_code to run it")


def model_facts(options: CompareOptions) -> dict[str, Any]:
    """What the report says of the model: its norm classes and counts, its vocabulary size."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(options.model_name_or_path, trust_remote_code=options.trust_remote_code)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    return {"norm_counts": check_model(options), "vocab_size": vocab_size}


def run_comparison(options: CompareOptions) -> list[dict[str, Any]]:
    """Run (or resume) the comparison of `options` and write its outputs, holding its output folder
    for this process (`FolderInUse`, a ValueError's one line, when another holds it); returns the
    rows of results.csv. Interrupted (Ctrl-C), it writes the report of the runs finished so far and
    raises KeyboardInterrupt with a line that says so; the same command resumes."""
    from ..training.locking import FolderInUse, NotAFolder, NotALock

    try:
        with hold_output_folder(options.output_dir, enabled=is_main_process()), _quiet_libraries():
            return _main(options)
    except FolderInUse as error:  # raised on entry only: another process holds the folder
        raise BadInput(f"--output_dir {error}") from None
    except (NotALock, NotAFolder) as error:  # raised on entry only: the folder's lock is not one, or it is a file
        raise BadInput(str(error)) from None


def _main(options: CompareOptions) -> list[dict[str, Any]]:
    """`run_comparison` once the folder is held, with the libraries' progress bars off."""
    if world_size() > 1:
        from accelerate import PartialState

        state = PartialState(cpu=options.cpu)
        with state.main_process_first():
            facts = prepare(options) if state.is_main_process else None
        if not state.is_main_process:  # the folder and model the main process made
            saved = saved_comparison(options.output_dir)
            options, facts = CompareOptions.from_json(saved["args"]), saved["model"]
        is_main = state.is_main_process
    else:
        facts, is_main = prepare(options), True
    try:
        chosen, results = _run(options)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(options, facts) if is_main else "") from None
    except RunsFailed as failed:
        _report_missing(options, facts, failed)
        raise
    if is_main:
        print(write_outputs(results, chosen, options, facts))
        if options.save_models:
            kept = keep_best_models(results, chosen, options)
            if not kept:
                raise BadInput("--save_models kept no model: no finished run holds its best model (a run that "
                               "finished without --save_models keeps none; the same command without "
                               "--report_only runs it again)")
            print(f"kept models: {', '.join(str(folder) for folder in kept.values())}", file=sys.stderr)
            if options.push_to_hub:
                print(f"pushed to the Hub: {', '.join(push_models(kept, options))}", file=sys.stderr)
    return result_rows(results, chosen)


def _run(options: CompareOptions) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Each norm's learning rate, then its runs over the seeds (the tuning grid's results too)."""
    chosen = choose_learning_rates(options)
    results = run_cells(make_cells(options, {n: [lr] for n, lr in chosen.items()}, options.seeds), options)
    if options.tune_lr:  # the grid's other rates too, for results.csv
        grid_cells = make_cells(options, {n: list(options.lr_grid) for n in options.norms}, options.seeds[:1])
        grid = finished_results(grid_cells, options.output_dir)
        results = list({r["cell"]: r for r in [*grid, *results]}.values())
    if not results:
        raise MissingInput(f"--report_only: no finished run under {options.output_dir}/cells")
    return chosen, results


def _report_missing(options: CompareOptions, facts: dict[str, Any], failed: RunsFailed) -> None:
    """The outputs of the runs finished, the report naming the failed runs and their logs, with no verdict."""
    options.report_only = True
    try:
        chosen, results = _run(options)
    except FileNotFoundError:  # no run finished: nothing to tabulate
        chosen, results = {}, []
    print(write_outputs(results, chosen, options, facts, missing=failed.failed))


def _interrupted(options: CompareOptions, facts: dict[str, Any]) -> str:
    """The report of the runs finished so far, and the line that says where it is (on a line of its
    own: the interrupted progress bars are closed first)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    options.report_only = True
    try:
        chosen, results = _run(options)
    except FileNotFoundError:
        return "no run had finished; rerun the same command to start again"
    write_outputs(results, chosen, options, facts)
    return (f"{len(results)} runs had finished: their report is in {Path(options.output_dir) / 'report.md'}; "
            f"rerun the same command to resume")



def _run_launched_cell(output_dir: str, cell_file: str) -> None:
    """`accelerate launch -m hf_powernorm.compare.runs OUTPUT_DIR CELL_JSON`: one cell of a job with
    several GPUs, run by every process together (`run_job`)."""
    saved = json.loads(Path(cell_file).read_text(encoding="utf-8"))
    with given_comparison(output_dir, saved["comparison"]):
        run_cells_here([Cell(saved["name"], saved["options"], tuple(saved["paths"]))], output_dir)


if __name__ == "__main__":
    _run_launched_cell(*sys.argv[1:3])
