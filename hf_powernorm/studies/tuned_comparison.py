"""LayerNorm, PN, RMSNorm, DyT and Derf, each tuned alike, in the paper's regime: PTB and Multi30k,
and PTB's picks carried unchanged to a second language-modelling corpus (tinyshakespeare).

The question: at a fair setting - the paper's training regime as far as a CPU allows, and the same
tuning effort for every norm - does PN beat LayerNorm? RMSNorm (LayerNorm without centering) is the
control for PN's other difference, dropping the mean. STUDIES.md holds the answer; docs/tuned_comparison.md
the binding table, the reasons for each rule and when each was written; docs/tuned_comparison_log.md the runs' log.

Stages, each tuning run scoring validation only: 1. `lr` (peak learning rate x warmup per norm,
short budget), 2. `alpha` and 3. `denominator` (PN), 4. `recheck` (the learning rate at the long
budget), 5. `final` (the picks over seeds, scoring test once, after every pick is fixed),
6. `transfer` (PTB's picks on tinyshakespeare), 7. DyT and Derf (`ELEMENTWISE`): `lr-elementwise`,
`alpha_init` and `recheck-elementwise`, then their finals. Verdicts: `reports.paired_verdicts`, each
arm against LayerNorm (DyT and Derf also against PN) over paired seeds, Holm-adjusted. Outputs in
`--output_dir`: `results.csv`, `curves.csv`, `picks.json`, `summary.md`, `curves_<task>_<updates>.png`.
The regime, each stage's rules and the outputs: docs/tuned_comparison.md, "How the code runs the study".

    python recipes/studies/tuned_comparison.py --data_dir DIR --transfer_data_dir DIR2 --jobs 1
    python recipes/studies/tuned_comparison.py --smoke --output_dir /tmp/tc  # embedded corpora, seconds

Resumable (finished runs are never redone, a killed run goes on from its last checkpoint);
`--report_only` writes the outputs of the runs finished so far, `--export_dir DIR` copies them with
each finished run's records into DIR (`results/tuned_comparison/` is such a copy).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from ..training import (
    latest_checkpoint,
    remove_checkpoints,
    select_checkpoints,
    synthetic_translation_corpus,
    write_average,
)
from ..training.atomic_files import remove_path, write_json_atomically
from ..training.evaluation import references_file
from ..training.executors import add_executor_args, executor_settings
from ..training.grid import RESULT_NAME, Cell, cell_result, finished_results, reset_accelerate, run_grid
from ..training.options import BadInput, MissingInput
from ..training.reports import (
    MIN_PAIRS,
    SIGNIFICANCE,
    PairedVerdict,
    mean_std,
    numeric_scores,
    paired_cell,
    paired_verdicts,
    write_rows,
)
from ..training.statistics import paired_bootstrap_bleu
from ..training.run_log import LOG_NAME
from ..training.tasks import get_task, option_words, run_task
from .norm_comparison import log_folder, multi30k_files, validation_curve
from .runs import STUDY_LM, lm_size, lm_split_files, prepare_lm_data, study_output_dir, train_study_lm

TASKS = ("ptb", "multi30k", "tinyshakespeare")
# The task whose picks the transfer task runs unchanged.
TRANSFER_FROM = {"tinyshakespeare": "ptb"}
NORMS = ("layernorm", "powernorm", "rmsnorm")
# The arms besides the norms tuned from stage 1: PN at the authors' alphas (its own rate and warmup),
# PN's pick with the authors' alpha_fwd and the tuned alpha_bkw (finals only), PN in every layer.
AUTHORS, ALPHA_ARM, EVERY_LAYER = "powernorm-authors", "powernorm-fwd0.9", "powernorm-all"
RECHECKED = (*NORMS, AUTHORS)
DEFAULT_ALPHA, DEFAULT_DENOMINATOR = 0.9, "running"
# The element-wise norms (DyT, Derf), tuned after the arms above have their finals: the same stages
# with their initial alpha (before attention, and before the FFN and in the final norm) in place of
# PN's alphas, from the model family's default; their finals at both budgets of `ELEMENTWISE_TASKS`'
# first task and at the short budget of the others.
ELEMENTWISE = ("dyt", "derf")
ELEMENTWISE_TASKS = ("ptb", "multi30k")
DEFAULT_ALPHA_INIT = 1.0
# Their initial alphas, a grid of 3 x 4 = 12 runs per norm: as many as PN's alpha_fwd x alpha_bkw
# (kept apart from `SIZES`, which finished runs recorded before these norms joined the study).
ALPHAS_INIT = {"real": {"attention": (0.5, 1.0, 2.0), "other": (0.25, 0.5, 1.0, 2.0)},
               "smoke": {"attention": (1.0,), "other": (0.5, 1.0)}}
# Amendment 2: a final whose training is its arm's winning tuning run (the same code, options and
# seed; it differs only in the splits it scores) would carry that run's selection into the test
# score. Such seed-1 finals - per task, each arm's budgets by index into `budgets` - draw their
# dropout afresh (`dropout_seed` = seed + `FRESH_DRAW`; initialisation and batch order are the
# seed's), as the other arms' seed-1 finals, trained on other code than their tuning runs, did.
FRESH_FINALS = {"ptb": {"dyt": (0, 1), "derf": (0, 1), AUTHORS: (1,)},
                "multi30k": {"dyt": (0,), "derf": (0,), AUTHORS: (1,)}}
FRESH_DRAW = 1000
# A killed run goes on from its last checkpoint: a language-model run writes one every
# `RESUME_EVERY` updates (a Multi30k run keeps its own, every `checkpointing_steps`, for the
# average), so a session that ends mid-run loses at most that many updates. A checkpoint changes
# no result, so this is not one of the runs' recorded options (`SIZES`).
RESUME_EVERY = 500
COLUMNS = ("task", "norm", "stage", "updates", "learning_rate", "warmup", "dropout", "label_smoothing", "alpha_fwd",
           "alpha_bkw", "denominator", "alpha_init_attention", "alpha_init_other", "seed", "split", "metric",
           "examples", "value")
SIZES = {
    "real": {
        "ptb": {"vocab_size": 4000, "block_size": 128, "max_tokens": 2048, "budgets": (1500, 4500),
                "eval_steps": 150, "learning_rates": (5e-4, 1e-3, 2e-3), "warmups": (150, 500),
                "alphas_fwd": (0.9, 0.95, 0.99), "alphas_bkw": (0.9, 0.95, 0.99, 1.0), "recheck": (0.5, 1.0, 2.0),
                "dropout": 0.3, "label_smoothing": 0.1},
        "multi30k": {"vocab_size": 8000, "max_tokens": 2048, "budgets": (2000, 4000), "eval_steps": 250,
                     "learning_rates": (1.5e-3, 3e-3, 6e-3), "warmups": (200, 600),
                     "alphas_fwd": (0.9, 0.95, 0.99), "alphas_bkw": (0.9, 0.95, 0.99, 1.0),
                     "recheck": (0.5, 1.0, 2.0), "dropout": 0.3, "label_smoothing": 0.1, "max_eval_samples": 500,
                     "num_beams": 5, "checkpointing_steps": 200, "averaged": 5, "inner_dropout": 0.1},
    },
    "smoke": {
        "ptb": {"vocab_size": 120, "block_size": 16, "max_tokens": 128, "budgets": (4, 6), "eval_steps": 2,
                "learning_rates": (5e-3, 1e-2), "warmups": (2,), "alphas_fwd": (0.9,), "alphas_bkw": (0.9, 1.0),
                "recheck": (1.0, 2.0), "dropout": 0.3, "label_smoothing": 0.1},
        "multi30k": {"vocab_size": 150, "max_tokens": 256, "budgets": (2, 4), "eval_steps": 2,
                     "learning_rates": (3e-3,), "warmups": (1,), "alphas_fwd": (0.9,), "alphas_bkw": (0.9, 1.0),
                     "recheck": (1.0,), "dropout": 0.3, "label_smoothing": 0.1, "max_eval_samples": 4,
                     "num_beams": 2, "checkpointing_steps": 1, "averaged": 2, "inner_dropout": 0.1},
    },
}
for _sizes in SIZES.values():  # the transfer corpus trains as PTB does: PTB's picks at PTB's sizes
    _sizes["tinyshakespeare"] = _sizes["ptb"]
LOWER_IS_BETTER = {"ptb": True, "multi30k": False, "tinyshakespeare": True}
# The headline scores of a final run, `(split, metric, what is scored)`, the first the paper's: test
# perplexity of the best validated model; Multi30k test BLEU of the average of the last checkpoints,
# and of the best validated checkpoint.
HEADLINES = {"ptb": (("test", "perplexity", "best validated model"),),
             "multi30k": (("test", "bleu_averaged", "average of the last checkpoints, beam 5"),
                          ("test", "bleu", "best validated checkpoint, beam 5; not the paper's inference")),
             "tinyshakespeare": (("test", "perplexity", "best validated model"),)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", help="a folder holding ptb/ptb.{train,valid,test}.txt and multi30k/raw/ "
                                      "(required unless --smoke)")
    p.add_argument("--transfer_data_dir", help="a folder holding train.txt, valid.txt and test.txt of the second "
                                               "language-modelling corpus (task tinyshakespeare; required for it "
                                               "unless --smoke)")
    p.add_argument("--output_dir", default="outputs/studies/tuned_comparison")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the short budget's finals (and transfer)")
    p.add_argument("--long_seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="the long budget's finals")
    add_executor_args(p)
    p.add_argument("--elementwise", action=argparse.BooleanOptionalAction, default=True,
                   help="after the other arms' finals, tune DyT and Derf and run their finals (default: on)")
    p.add_argument("--smoke", action="store_true", help="the embedded corpora at tiny sizes (seconds)")
    p.add_argument("--report_only", action="store_true",
                   help="write the outputs from the runs finished so far, and run nothing")
    p.add_argument("--export_dir", help="also copy the outputs, and each finished run's result and validation "
                                        "records, into this folder: small enough to commit, and its cells/ copied "
                                        "into an output folder resumes the study there")
    args = p.parse_args(argv)
    if args.export_dir and Path(args.export_dir).resolve() == Path(args.output_dir).resolve():
        raise BadInput(f"--export_dir must differ from --output_dir; both are {args.export_dir}")
    for name in ("seeds", "long_seeds"):
        if not getattr(args, name):
            raise BadInput(f"--{name} needs at least one seed")
    if 1 not in args.seeds:
        raise BadInput(f"--seeds must include 1, the tuning seed; got {args.seeds}")
    if args.data_dir is None and not args.smoke:
        raise BadInput("pass --data_dir (a folder with ptb/ and multi30k/raw/), or --smoke for the embedded corpora")
    for task in args.tasks:
        if task in TRANSFER_FROM and TRANSFER_FROM[task] not in args.tasks:
            raise BadInput(f"--tasks {task} runs {TRANSFER_FROM[task]}'s picks: add {TRANSFER_FROM[task]} to --tasks")
    if "tinyshakespeare" in args.tasks and not args.smoke:
        transfer_files(args.transfer_data_dir)  # fails now, not after hours of other runs
    args.sizes = SIZES["smoke" if args.smoke else "real"]
    args.alphas_init = ALPHAS_INIT["smoke" if args.smoke else "real"]
    # How often a norm's learning-rate grid may grow past an edge its pick lies on (not a run
    # option: the runs it adds are named by their learning rate).
    args.extensions = 1 if args.smoke else 2
    if "multi30k" in args.tasks and not args.smoke:
        multi30k_files(args.data_dir)  # fails now, not after hours of PTB runs
    return args


# -- one run ------------------------------------------------------------------------------------


# What a run varies besides norm, rate, warmup, budget and seed: PN's options, then DyT's and Derf's.
OPTION_KEYS = ("alpha_fwd", "alpha_bkw", "denominator", "alpha_init_attention", "alpha_init_other")


def setting(norm: str, learning_rate: float, warmup: int, alpha_fwd: float | None = None,
            alpha_bkw: float | None = None, denominator: str | None = None) -> dict[str, Any]:
    """What a run varies besides budget and seed; PN's options are None for the other norms, and
    DyT's and Derf's initial alphas (the model family's default to start) None for the others.
    The element-wise options are only present for those norms: a run of the other norms keeps the
    options it was recorded with."""
    pn = norm.startswith("powernorm")
    chosen = {"norm": norm, "learning_rate": learning_rate, "warmup": warmup,
              "alpha_fwd": (alpha_fwd or DEFAULT_ALPHA) if pn else None,
              "alpha_bkw": (alpha_bkw or DEFAULT_ALPHA) if pn else None,
              "denominator": (denominator or DEFAULT_DENOMINATOR) if pn else None}
    if norm in ELEMENTWISE:
        chosen.update(alpha_init_attention=DEFAULT_ALPHA_INIT, alpha_init_other=DEFAULT_ALPHA_INIT)
    return chosen


def _norm_options(options: dict[str, Any]) -> dict[str, Any]:
    norm = options["norm"]
    kind = "powernorm" if norm.startswith("powernorm") else norm  # PN's arms differ in options only
    if options["task"] != "multi30k":
        chosen = {"norm_type": kind}
    elif norm == EVERY_LAYER:
        chosen = {"encoder_norm_type": "powernorm", "decoder_norm_type": "powernorm"}
    else:  # the encoder's norm; LayerNorm in the decoder (the recipe's default)
        chosen = {"encoder_norm_type": kind, "decoder_norm_type": "layernorm"}
    if kind == "powernorm":
        chosen.update(powernorm_alpha_fwd=options["alpha_fwd"], powernorm_alpha_bkw=options["alpha_bkw"],
                      powernorm_backward_denominator=options["denominator"], powernorm_warmup_steps=options["warmup"])
    if kind in ELEMENTWISE:
        chosen.update(norm_alpha_init_attention=options["alpha_init_attention"],
                      norm_alpha_init_ffn=options["alpha_init_other"], norm_alpha_init_final=options["alpha_init_other"])
    return chosen


def _run_options(options: dict[str, Any]) -> dict[str, Any]:
    """The training options of a run: its seed (and a final's fresh dropout draws), budget, dropout and
    norms."""
    sizes = options["sizes"]
    fresh = {"dropout_seed": options["dropout_seed"]} if options.get("dropout_seed") is not None else {}
    return {"seed": options["seed"], **fresh, "max_tokens": sizes["max_tokens"],
            "learning_rate": options["learning_rate"], "num_warmup_steps": options["warmup"], "max_train_steps": options["updates"],
            "eval_steps": sizes["eval_steps"], "dropout": sizes["dropout"], **_norm_options(options),
            # Early stopping where the sizes name a patience (the convergence study's; protocol 2's have none).
            **({"patience": sizes["patience"]} if "patience" in sizes else {})}


def _scored_files(options: dict[str, Any]) -> dict[str, Any] | None:
    """The splits a run reads: a tuning run never sees the test split (the blind protocol)."""
    files = options["files"]
    if files is None or options.get("final"):
        return files
    return {split: path for split, path in files.items() if split != "test"}


def _resume_in(run: Path, folder: Path, restart: tuple[str, ...] = ()) -> dict[str, str]:
    """The option that continues a killed attempt's run in `run` (inside the cell's `folder`) from
    its newest complete checkpoint, with the outputs named in `restart` (made after training)
    cleared; where there is none, `folder` is cleared and the run starts afresh."""
    resumable = run.is_dir() and latest_checkpoint(run, "step") is not None
    for path in folder.iterdir():
        if not resumable or path.name in restart:
            remove_path(path)
    return {"resume_from_checkpoint": "latest"} if resumable else {}


def train_lm(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    sizes = options["sizes"]
    resume = {"checkpointing_steps": RESUME_EVERY, "checkpoints_total_limit": 1} \
        if options["updates"] > RESUME_EVERY else {}
    argv = option_words({**_run_options(options), "clip_norm": 0.25, "weight_decay": 0.01, **resume,
                         **_resume_in(folder, folder)})
    _, scores = train_study_lm(folder, options["tokenizer"], argv, _scored_files(options), sizes["block_size"],
                               options["model_size"], label_smoothing=sizes["label_smoothing"])
    remove_checkpoints(folder)
    return scores


def train_multi30k(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The translation task of `recipes/train_wmt.py` in this process, then the average of its last
    checkpoints scored."""
    sizes, files = options["sizes"], _scored_files(options)
    data = {f"{split}_file": files[split] for split in ("validation", "test") if split in files}
    samples = options.get("max_eval_samples", sizes["max_eval_samples"])
    generation = {**({"max_eval_samples": samples} if samples else {}), "num_beams": sizes["num_beams"],
                  "length_penalty": 1.0, "max_new_tokens": 50}
    translation = get_task("seq2seq")
    run, averaged, averaged_scores = folder / "run", folder / "averaged", folder / "averaged_scores"
    resume = _resume_in(run, folder, restart=(averaged.name, averaged_scores.name))
    results = numeric_scores(run_task(translation.from_options(
        output_dir=str(run), **_run_options(options), **resume, vocab_size=sizes["vocab_size"],
        label_smoothing=sizes["label_smoothing"], checkpointing_steps=sizes["checkpointing_steps"],
        config_overrides=f"attention_dropout={sizes['inner_dropout']},activation_dropout={sizes['inner_dropout']}",
        checkpoints_total_limit=sizes["averaged"], **generation, train_file=files["train"], **data)))
    reset_accelerate()
    write_average(select_checkpoints(run, sizes["averaged"], "step"), averaged)
    scored = numeric_scores(run_task(translation.from_options(do_train=False, model_name_or_path=str(averaged),
                                                        output_dir=str(averaged_scores), **generation, **data)))
    reset_accelerate()
    remove_checkpoints(run)  # the averaged export keeps what the checkpoints were for
    return {**results, **{f"{k}_averaged": v for k, v in scored.items() if k.endswith("bleu")}}


def cpu_record(folder: Path) -> Path:
    """Where the CPU seconds of a cell's attempts so far are kept while it runs: beside its folder
    (a run starts in an empty one), `.<cell>.cpu_seconds.json`."""
    return folder.with_name(f".{folder.name}.cpu_seconds.json")


class _CpuClock:
    """The CPU seconds a cell has cost over all its attempts: those before (in its `cpu_record`,
    which a killed attempt kept up to `every` seconds before it died) plus this process's since it
    started, written every `every` seconds from a thread; the record goes when the run is done."""

    def __init__(self, folder: Path, every: float = 60.0) -> None:
        self.path, self.every = cpu_record(folder), every
        self.before = json.loads(self.path.read_text(encoding="utf-8"))["cpu_seconds"] if self.path.is_file() else 0.0
        self.started = time.process_time()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._keep, daemon=True)

    def total(self) -> float:
        return round(self.before + time.process_time() - self.started, 1)

    def _keep(self) -> None:
        while not self.done.wait(self.every):
            write_json_atomically(self.path, {"cpu_seconds": self.total()})

    def __enter__(self) -> "_CpuClock":
        self.thread.start()
        return self

    def __exit__(self, error_type: type | None, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        if error_type is None:
            remove_path(self.path)  # the result holds the total
        else:
            write_json_atomically(self.path, {"cpu_seconds": self.total()})


def run_cell(cell: Cell, folder: Path) -> dict[str, Any]:
    """One run, with the CPU seconds it cost (`cpu_seconds`: one thread's, its killed attempts'
    included), for the cut rule's account."""
    import torch

    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    train = train_multi30k if cell.options["task"] == "multi30k" else train_lm
    with _CpuClock(folder) as clock:
        scores = train(cell.options, folder)
    return {**scores, "cpu_seconds": clock.total()}


# -- the protocol -------------------------------------------------------------------------------


def _cell(task: str, inputs: dict[str, Any], sizes: dict[str, Any], chosen: dict[str, Any], updates: int,
          seed: int, final: bool = False, dropout_seed: int | None = None) -> Cell:
    """A tuning run (validation only, on `max_eval_samples` sentences where the task limits them) or,
    with `final`, a final (named `...-final`: whole validation and test splits, test scored); with
    `dropout_seed`, a final drawing its dropout afresh (`...-final-draw<dropout_seed>`)."""
    name = (f"{task}-{chosen['norm']}-lr{chosen['learning_rate']:g}-w{chosen['warmup']}"
            + (f"-a{chosen['alpha_fwd']:g}-{chosen['alpha_bkw']:g}-{chosen['denominator']}"
               if chosen["alpha_fwd"] is not None else "")
            + (f"-ai{chosen['alpha_init_attention']:g}-{chosen['alpha_init_other']:g}"
               if chosen.get("alpha_init_attention") is not None else "")
            + f"-u{updates}-seed{seed}" + ("-final" if final else "")
            + (f"-draw{dropout_seed}" if dropout_seed is not None else ""))
    options = {"task": task, **chosen, "updates": updates, "seed": seed, "sizes": sizes, "final": final,
               "max_eval_samples": None if final else sizes.get("max_eval_samples"), **inputs}
    if dropout_seed is not None:  # only here: the other cells' options stay those they finished with
        options["dropout_seed"] = dropout_seed
    return Cell(name, options, paths=tuple(k for k in ("files", "tokenizer") if k in inputs))


def _best(task: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the best validation score (the first of equals, in grid order)."""
    pick = min if LOWER_IS_BETTER[task] else max
    return pick(results, key=lambda r: r["best_validation"])


def _chosen(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in ("norm", "learning_rate", "warmup", *OPTION_KEYS) if k in result}


def _beyond(picked: float, rates: set[float]) -> float | None:
    """The next learning rate past the edge of `rates` that `picked` lies on (x2 above the highest,
    /2 below the lowest), or None for a pick inside them."""
    return picked * 2 if picked == max(rates) else picked / 2 if picked == min(rates) else None


def _norms(results: list[dict[str, Any]]) -> list[str]:
    """The norms (arms) of a stage's results, in grid order."""
    return list(dict.fromkeys(result["norm"] for result in results))


def _edge_extension(protocol: "Protocol", results: list[dict[str, Any]]) -> list[Cell]:
    """A learning rate picked at the edge of a norm's grid is no pick: one step (x2, or /2) beyond
    that edge, at every warmup, for each norm whose pick lies there - the same rule for every norm."""
    extra = []
    for norm in _norms(results):
        runs = [r for r in results if r["norm"] == norm]
        beyond = _beyond(_best(protocol.task, runs)["learning_rate"], {r["learning_rate"] for r in runs})
        if beyond is not None:
            extra += [protocol.cell(setting(norm, beyond, warmup), protocol.short)
                      for warmup in protocol.sizes["warmups"]]
    return extra


def _alpha_init_extension(protocol: "Protocol", results: list[dict[str, Any]]) -> list[Cell]:
    """Amendment 2: an initial alpha picked at the edge of the values its axis has run (before
    attention; before the FFN and in the final norm) is no pick either: the next value beyond (x2, or
    /2) on that axis, the other at the pick - the rate grid's rule, for each norm and each axis whose
    grid (`ALPHAS_INIT`) has two values or more; returns only cells that have not run yet."""
    done = {result["cell"] for result in results}
    extra = []
    for norm in _norms(results):
        runs = [r for r in results if r["norm"] == norm]
        pick = _best(protocol.task, runs)
        for axis, grid in protocol.args.alphas_init.items():
            beyond = _beyond(pick[f"alpha_init_{axis}"], {r[f"alpha_init_{axis}"] for r in runs}) \
                if len(grid) > 1 else None
            if beyond is not None:
                extra.append(protocol.cell({**_chosen(pick), f"alpha_init_{axis}": beyond}, protocol.short))
    return [cell for cell in extra if cell.name not in done]


def _recheck_extension(protocol: "Protocol", results: list[dict[str, Any]]) -> list[Cell]:
    """Stage 4's learning-rate edge: a long-budget pick at the edge of the rates re-checked for an arm
    at the pick's warmup gets the next rate beyond (x2 or /2) with its other options - the same rule
    for every arm; returns only cells that have not run yet."""
    done = {result["cell"] for result in results}
    extra = []
    for norm in _norms(results):
        runs = [r for r in results if r["norm"] == norm]
        pick = _best(protocol.task, runs)
        beyond = _beyond(pick["learning_rate"], {r["learning_rate"] for r in runs if r["warmup"] == pick["warmup"]})
        if beyond is not None:
            extra.append(protocol.cell({**_chosen(pick), "learning_rate": beyond}, protocol.long))
    return [cell for cell in extra if cell.name not in done]


# Tasks whose warmup picked at the edge of the warmups run is extended (stage 1 and stage 4).
WARMUP_EDGE_TASKS = ("multi30k",)


def _next_warmup(protocol: "Protocol", warmup: int, warmups: list[int], budget: int) -> int | None:
    """The warmup beyond the edge of `warmups` that `warmup` lies on: x2 while below `budget`, /2 while
    at least 1; None inside them, on a task without the warmup rule, or with one warmup in the grid."""
    if protocol.task not in WARMUP_EDGE_TASKS or len(protocol.sizes["warmups"]) < 2:
        return None
    if warmup == max(warmups) and warmup * 2 < budget:
        return warmup * 2
    if warmup == min(warmups) and warmup // 2 >= 1:
        return warmup // 2
    return None


def _warmup_extension(protocol: "Protocol", results: list[dict[str, Any]]) -> list[Cell]:
    """A warmup picked at the edge of the warmups a norm has run is no pick either: the pick's
    learning rate and the rates x2 and /2 of it at the next warmup beyond (x2 while below the short
    budget, or /2 while at least 1); a pick at such a new warmup and at the edge of the rates run
    there gets the next rate beyond (x2 or /2). The same rule for every norm; returns only cells that
    have not run yet (none: the warmups and rates are settled)."""
    if protocol.task not in WARMUP_EDGE_TASKS or len(protocol.sizes["warmups"]) < 2:
        return []
    done = {result["cell"] for result in results}
    extra = []
    for norm in _norms(results):
        runs = [r for r in results if r["norm"] == norm]
        pick = _best(protocol.task, runs)
        rate, warmup = pick["learning_rate"], pick["warmup"]
        longer = _next_warmup(protocol, warmup, [r["warmup"] for r in runs], protocol.short)
        settings = [(value, longer) for value in (rate / 2, rate, rate * 2)] if longer else []
        if not settings and warmup not in protocol.sizes["warmups"]:
            beyond = _beyond(rate, {r["learning_rate"] for r in runs if r["warmup"] == warmup})
            settings = [(beyond, warmup)] if beyond is not None else []
        cells = [protocol.cell(setting(norm, value, steps), protocol.short) for value, steps in settings]
        extra += [cell for cell in cells if cell.name not in done]
    return extra


def _recheck_cells(protocol: "Protocol", stage_one: list[dict[str, Any]], norms: tuple[str, ...]) -> list[Cell]:
    """Stage 4 for every arm in `norms`: its short-budget pick's learning rate x `recheck` at the
    long budget, at the pick's warmup and, where that warmup lies at the edge of the warmups its norm
    ran in stage 1 (`WARMUP_EDGE_TASKS`), at the next warmup beyond, below the long budget."""
    cells = []
    for norm in norms:
        pick = protocol.picks[f"{norm}@{protocol.short}"]
        source = "powernorm" if norm == AUTHORS else norm  # stage 1 ran PN at the authors' alphas
        longer = _next_warmup(protocol, pick["warmup"], [r["warmup"] for r in stage_one if r["norm"] == source],
                              protocol.long)
        for warmup in (pick["warmup"], *([longer] if longer else [])):
            cells += [protocol.cell({**pick, "learning_rate": pick["learning_rate"] * factor, "warmup": warmup},
                                    protocol.long) for factor in protocol.sizes["recheck"]]
    return cells


def _score_label(split: str, metric: str, scored: str) -> str:
    """A headline score as the summary's tables name it, e.g. `test bleu (best validated checkpoint, ...)`."""
    return f"{split} {metric.partition('_')[0]} ({scored})"


class Protocol:
    """Runs (or, with `report_only`, reads) one task's stages in order; each stage's cells come from
    the picks of the stages before it. `stages` maps a stage name to its cells' results. `tune` runs
    stages 1-4 and says whether every pick is fixed; `run_finals` then runs the finals."""

    def __init__(self, task: str, args: argparse.Namespace, inputs: dict[str, Any], output_dir: Path) -> None:
        self.task, self.args, self.inputs, self.output_dir = task, args, inputs, output_dir
        self.sizes = args.sizes[task]
        self.short, self.long = self.sizes["budgets"]
        self.stages: dict[str, list[tuple[Cell, dict[str, Any] | None]]] = {}
        self.picks: dict[str, dict[str, Any]] = {}
        self.pending_fresh: list[str] = []  # fresh finals (amendment 2) whose old final stands in

    def _stage(self, name: str, cells: list[Cell]) -> list[dict[str, Any]] | None:
        """The stage's results in cell order, or None while any of its cells has not finished."""
        unique = list({cell.name: cell for cell in cells}.values())
        if self.args.report_only:
            done = {r["cell"]: r for r in finished_results(unique, self.output_dir)}
        else:
            done = {r["cell"]: r for r in run_grid(unique, run_cell, self.output_dir, desc=f"{self.task} {name}",
                                                   resume_cells=True, executor=executor_settings(self.args))}
        self.stages[name] = [(cell, done.get(cell.name)) for cell in cells]
        return None if len(done) < len(unique) else [done[cell.name] for cell in cells]

    def _extended_stage(self, name: str, cells: list[Cell], rules) -> list[dict[str, Any]] | None:
        """`_stage(name, cells)`, then for each `(rule, rounds)` in turn up to `rounds` times: the cells
        `rule(self, results)` adds, run as part of the same stage, until it adds none."""
        results = self._stage(name, cells)
        for rule, rounds in rules:
            for _ in range(rounds):
                if results is None:
                    return None
                extra = rule(self, results)
                if not extra:
                    break
                cells = cells + extra
                results = self._stage(name, cells)
        return results

    def cell(self, chosen: dict[str, Any], updates: int, seed: int = 1, final: bool = False) -> Cell:
        return _cell(self.task, self.inputs, self.sizes, chosen, updates, seed, final)

    def _fresh(self, norm: str, updates: int, seed: int) -> bool:
        """Whether this final draws its dropout afresh (`FRESH_FINALS`)."""
        budgets = FRESH_FINALS.get(self.task, {}).get(norm, ())
        return seed == 1 and updates in [self.sizes["budgets"][index] for index in budgets]

    def final_cell(self, chosen: dict[str, Any], updates: int, seed: int) -> Cell:
        """A final of `chosen` (an arm's pick): with fresh dropout draws where `FRESH_FINALS` says."""
        fresh = seed + FRESH_DRAW if self._fresh(chosen["norm"], updates, seed) else None
        return _cell(self.task, self.inputs, self.sizes, chosen, updates, seed, final=True, dropout_seed=fresh)

    def replaced_cell(self, fresh: Cell) -> Cell:
        """The final that a fresh one replaces: the same run without fresh draws (its training is the
        winning tuning run's), kept in the record beside it."""
        return self.cell(_chosen(fresh.options), fresh.options["updates"], fresh.options["seed"], final=True)

    def replaced_cells(self, cells: list[Cell]) -> list[Cell]:
        """`replaced_cell` of each fresh final among `cells`."""
        return [self.replaced_cell(cell) for cell in cells if "dropout_seed" in cell.options]

    def _rate_stage(self, name: str, norms: tuple[str, ...]) -> list[dict[str, Any]] | None:
        """Stage 1 for `norms` as stage `name`: learning rate x warmup at the short budget and seed 1,
        then the learning-rate edge, then the warmup edge (one longer warmup, then up to two rates
        beyond)."""
        grid = [self.cell(setting(norm, lr, warmup), self.short) for norm in norms
                for lr in self.sizes["learning_rates"] for warmup in self.sizes["warmups"]]
        return self._extended_stage(name, grid, (
            (_edge_extension, self.args.extensions),
            (_warmup_extension, self.args.extensions + 1 if self.task in WARMUP_EDGE_TASKS else 0)))

    def _pick_each(self, results: list[dict[str, Any]], norms: tuple[str, ...], updates: int) -> None:
        """Each of `norms`' best run in `results` (by validation) as its pick at `updates`."""
        for norm in norms:
            self.picks[f"{norm}@{updates}"] = _chosen(_best(self.task, [r for r in results if r["norm"] == norm]))

    def _recheck_stage(self, name: str, stage_one: list[dict[str, Any]], norms: tuple[str, ...]) -> bool:
        """Stage 4 for `norms` as stage `name` (`_recheck_cells`, with the learning-rate edge); their
        long-budget picks once it has finished, and whether it has."""
        results = self._extended_stage(name, _recheck_cells(self, stage_one, norms),
                                       ((_recheck_extension, self.args.extensions),))
        if results is not None:
            self._pick_each(results, norms, self.long)
        return results is not None

    def tune(self) -> bool:
        """Stages 1-4 (validation only); True once every pick is fixed."""
        sizes = self.sizes
        stage_one = self._rate_stage("lr", NORMS)
        if stage_one is None:
            return False
        self._pick_each(stage_one, NORMS, self.short)
        pn = self.picks[f"powernorm@{self.short}"]
        self.picks[f"{AUTHORS}@{self.short}"] = {**pn, "norm": AUTHORS}
        results = self._stage("alpha", [self.cell({**pn, "alpha_fwd": af, "alpha_bkw": ab}, self.short)
                                         for af in sizes["alphas_fwd"] for ab in sizes["alphas_bkw"]])
        if results is None:
            return False
        pn = _chosen(_best(self.task, results))
        results = self._stage("denominator", [self.cell({**pn, "denominator": d}, self.short)
                                              for d in ("running", "batch")])
        if results is None:
            return False
        self.picks[f"powernorm@{self.short}"] = _chosen(_best(self.task, results))
        if not self._recheck_stage("recheck", stage_one, RECHECKED):
            return False
        self.picks[f"{ALPHA_ARM}@{self.long}"] = {**self.picks[f"powernorm@{self.long}"], "norm": ALPHA_ARM,
                                                  "alpha_fwd": DEFAULT_ALPHA, "alpha_bkw": 1.0}
        return True

    def final_cells(self, extras: bool = True) -> list[Cell]:
        """Stage 5, seed by seed so that a seed's arms finish together: the arms at both budgets; with
        `extras` then the alpha arm at the long budget and (Multi30k) PN in every layer at both, the
        rows the cut rule drops first."""
        cells = [self.final_cell(self.picks[f"{norm}@{updates}"], updates, seed)
                 for updates, seeds in ((self.short, self.args.seeds), (self.long, self.args.long_seeds))
                 for seed in seeds for norm in RECHECKED]
        if not extras:
            return cells
        cells += [self.cell(self.picks[f"{ALPHA_ARM}@{self.long}"], self.long, seed, final=True)
                  for seed in self.args.long_seeds]
        if self.task == "multi30k":
            cells += [self.cell({**self.picks[f"powernorm@{updates}"], "norm": EVERY_LAYER}, updates, seed, final=True)
                      for updates in (self.short, self.long) for seed in self.args.seeds]
        return cells

    def elementwise_budgets(self) -> tuple[int, ...]:
        """The budgets of DyT's and Derf's finals: both on the first of `ELEMENTWISE_TASKS`, the short
        one on the others; none on a task outside them."""
        if self.task not in ELEMENTWISE_TASKS:
            return ()
        return (self.short, self.long) if self.task == ELEMENTWISE_TASKS[0] else (self.short,)

    def tune_elementwise(self) -> bool:
        """DyT's and Derf's stages, as the other norms': `lr-elementwise` (rate x warmup at the model
        family's initial alphas, with the same edge rules), `alpha_init` (the initial alphas at that
        pick, `ALPHAS_INIT`: the place of PN's alphas), and `recheck-elementwise` where their long
        budget has finals; True once their picks for `elementwise_budgets()` are fixed."""
        budgets = self.elementwise_budgets()
        if not budgets:
            return False
        grid = self.args.alphas_init
        stage_one = self._rate_stage("lr-elementwise", ELEMENTWISE)
        if stage_one is None:
            return False
        cells = [self.cell({**_chosen(_best(self.task, [r for r in stage_one if r["norm"] == norm])),
                            "alpha_init_attention": attention, "alpha_init_other": other}, self.short)
                 for norm in ELEMENTWISE for attention in grid["attention"] for other in grid["other"]]
        results = self._extended_stage("alpha_init", cells, ((_alpha_init_extension, self.args.extensions),))
        if results is None and self.args.report_only:
            results = self._so_far("alpha_init", cells)
        if results is None:
            return False
        self._pick_each(results, ELEMENTWISE, self.short)
        return self.long not in budgets or self._recheck_stage("recheck-elementwise", stage_one, ELEMENTWISE)

    def _so_far(self, stage: str, grid: list[Cell]) -> list[dict[str, Any]] | None:
        """For a report while a stage's edge runs (amendment 2's) are under way: the results it has so
        far, once its grid's are all in, so that the picks and finals of amendment 1 stand until
        the edge runs say otherwise; the stage stays unfinished (the summary says it is interim)."""
        done = [result for _, result in self.stages[stage] if result is not None]
        names = {result["cell"] for result in done}
        return done if all(cell.name in names for cell in grid) else None

    def elementwise_final_cells(self) -> list[Cell]:
        """DyT's and Derf's finals, seed by seed, at the seeds the other arms have at each budget."""
        seeds = {self.short: self.args.seeds, self.long: self.args.long_seeds}
        return [self.final_cell(self.picks[f"{norm}@{updates}"], updates, seed)
                for updates in self.elementwise_budgets() for seed in seeds[updates] for norm in ELEMENTWISE]

    def run_finals(self, extras: bool = True, elementwise: bool = False) -> None:
        """The finals: the arms' main ones, with `extras` the rows the cut rule drops first, with
        `elementwise` also DyT's and Derf's (after their tuning); the finals their fresh ones replace
        are read, never run (stage `replaced`)."""
        cells = self.final_cells(extras) + (self.elementwise_final_cells() if elementwise else [])
        self._stage("final", cells)
        self.pending_fresh, self.stages["replaced"] = [], []
        for index, (cell, result) in enumerate(self.stages["final"]):
            if "dropout_seed" not in cell.options:
                continue
            old = self.replaced_cell(cell)
            old_result = cell_result(self.output_dir, old)
            if old_result is None:
                continue
            if result is None:  # not run yet: the final it will replace stands in its row until it has
                self.stages["final"][index] = (old, old_result)
                self.pending_fresh.append(cell.name)
            else:
                self.stages["replaced"].append((old, old_result))


class Transfer(Protocol):
    """A second corpus for a task's picks: LayerNorm's, PN's and RMSNorm's picks of `source` at each of
    its budgets, unchanged, at `--seeds`; no tuning of its own."""

    def __init__(self, task: str, args: argparse.Namespace, inputs: dict[str, Any], output_dir: Path,
                 source: Protocol) -> None:
        super().__init__(task, args, inputs, output_dir)
        self.source = source

    def tune(self) -> bool:
        wanted = [f"{norm}@{updates}" for norm in NORMS for updates in (self.short, self.long)]
        if any(key not in self.source.picks for key in wanted):
            return False
        self.picks = {key: self.source.picks[key] for key in wanted}
        return True

    def final_cells(self, extras: bool = True) -> list[Cell]:
        return [self.cell(self.picks[f"{norm}@{updates}"], updates, seed, final=True)
                for updates in (self.short, self.long) for seed in self.args.seeds for norm in NORMS]


# -- outputs ------------------------------------------------------------------------------------


def _evaluations(result: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(split, metric, value) of one run; test only for a final (a tuning run of the first protocol
    scored test too: those scores are never read)."""
    rows = []
    for key, value in sorted(result.items()):
        split, _, metric = key.partition("_")
        if split == "test" and not result.get("final"):
            continue
        if split in ("validation", "test") and metric in ("perplexity", "word_perplexity", "loss", "bleu",
                                                          "bleu_averaged"):
            rows.append((split, metric, value))
    rows.append(("validation", "best", result["best_validation"]))
    return rows


@functools.lru_cache(maxsize=None)
def _sentences(path: str) -> int | None:
    """The sentences (non-blank lines) of a split's file - for a translation split, of its target side
    (`<prefix>.en`) - or None where the file is not on this machine."""
    for candidate in (Path(path), Path(f"{path}.en")):
        if candidate.is_file():
            with open(candidate, encoding="utf-8") as handle:
                return sum(1 for line in handle if line.strip())
    return None


def _examples(result: dict[str, Any], split: str) -> int | None:
    """How many sentences a run scored on `split`: the whole split, or its first `max_eval_samples`."""
    files = result.get("files") or {}
    count = _sentences(files[split]) if split in files else None
    # Runs of the first protocol recorded no `max_eval_samples` of their own: their sizes' applied.
    limit = result.get("max_eval_samples", result["sizes"].get("max_eval_samples"))
    return None if count is None else min(count, limit) if limit else count


def result_rows(protocols: list[Protocol]) -> list[dict[str, Any]]:
    rows = []
    for protocol in protocols:
        for stage, cells in protocol.stages.items():
            for _, result in cells:
                if result is None:
                    continue
                base = {key: result[key] for key in COLUMNS if key in result}
                base.update(stage=stage if stage in ("final", "replaced") else "tune",
                            dropout=result["sizes"]["dropout"], label_smoothing=result["sizes"]["label_smoothing"])
                rows += [{**base, "split": split, "metric": metric, "examples": _examples(result, split),
                          "value": value} for split, metric, value in _evaluations(result)]
    unique = {tuple(str(row.get(c, "")) for c in COLUMNS): row for row in rows}  # a run asked twice, once
    return list(unique.values())


def _finished(protocol: Protocol, stage: str = "final") -> list[dict[str, Any]]:
    """The finished runs' results of one stage (the finals by default)."""
    return [result for _, result in protocol.stages.get(stage, []) if result is not None]


def _mean_std(values: list[float]) -> str:
    """`mean_std` of the seeds' values, and how many seeds."""
    if not values:
        return "-"
    return f"{mean_std(values)} ({len(values)} seed{'s' if len(values) > 1 else ''})"


# The arms compared with LayerNorm, in the headline's order, and their names there.
ARM_NAMES = {"powernorm": "PN (its picks)", AUTHORS: "PN, authors' alphas 0.9/0.9 (own rate, warmup)",
             ALPHA_ARM: "PN, alpha_fwd 0.9 / alpha_bkw 1.0 (PN's long pick)", EVERY_LAYER: "PN in every layer",
             "rmsnorm": "RMSNorm", "dyt": "DyT", "derf": "Derf"}
BASELINE_NAMES = {"layernorm": "LayerNorm", "powernorm": "PN (its picks)"}
# Every comparison of the headline, `(arm, baseline)`: each arm against LayerNorm, and DyT and Derf
# also against PN.
COMPARED = (*((norm, "layernorm") for norm in ARM_NAMES), *((norm, "powernorm") for norm in ELEMENTWISE))


def _by_seed(results: list[dict[str, Any]], norm: str, updates: int, key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in results if r["norm"] == norm and r["updates"] == updates and key in r}


def comparisons(protocols: list[Protocol]) -> list[dict[str, Any]]:
    """Every comparison the summary makes - each of `COMPARED` where both sides have finals, per
    task, budget and headline score - with its paired verdict, Holm's adjustment taken over all of
    them."""
    found = []
    for protocol in protocols:
        finals = _finished(protocol)
        for updates in (protocol.short, protocol.long):
            for split, metric, scored in HEADLINES[protocol.task]:
                key = f"{split}_{metric}"
                for norm, against in COMPARED:
                    baseline, other = _by_seed(finals, against, updates, key), _by_seed(finals, norm, updates, key)
                    if baseline and other:
                        found.append({"task": protocol.task, "updates": updates, "norm": norm, "against": against,
                                      "key": key, "baseline": baseline, "other": other,
                                      "label": _score_label(split, metric, scored),
                                      "lower": LOWER_IS_BETTER[protocol.task]})
    verdicts = paired_verdicts([(c["baseline"], c["other"], c["lower"]) for c in found])
    return [{**c, "verdict": v} for c, v in zip(found, verdicts)]


def _verdict_words(norm: str, against: str, verdict: PairedVerdict) -> str:
    if verdict.better is None:
        return f"no verdict (fewer than {MIN_PAIRS} paired seeds)"
    return {"other": f"{ARM_NAMES[norm]} better", "baseline": f"{BASELINE_NAMES[against]} better",
            "neither": "no difference shown"}[verdict.better]


def headline(protocols: list[Protocol]) -> list[str]:
    lines = ["| task | updates | score | arm | baseline | baseline's score | arm's score | paired seeds "
             "| arm minus baseline, mean [95% CI] | Holm p | verdict |",
             "|---|---:|---|---|---|---|---|---:|---|---:|---|"]
    for c in comparisons(protocols):
        verdict = c["verdict"]
        p_value = "-" if verdict.adjusted_p is None else f"{verdict.adjusted_p:.3f}"
        lines.append(f"| {c['task']} | {c['updates']} | {c['label']} | {ARM_NAMES[c['norm']]} | "
                     f"{BASELINE_NAMES[c['against']]} | {_mean_std(list(c['baseline'].values()))} | "
                     f"{_mean_std(list(c['other'].values()))} | {len(verdict.differences)} | {paired_cell(verdict)} | "
                     f"{p_value} | {_verdict_words(c['norm'], c['against'], verdict)} |")
    return lines


# Where a translation final keeps the test translations behind each BLEU headline score (with the
# references they were scored against), for the paired bootstrap over sentences.
TRANSLATIONS = {"test_bleu": "run", "test_bleu_averaged": "averaged_scores"}
BOOTSTRAP_SAMPLES = 1000


def _translation_files(output_dir: Path, result: dict[str, Any], key: str) -> tuple[Path, Path]:
    predictions = Path(output_dir) / "cells" / result["cell"] / TRANSLATIONS[key] / "generated_predictions.txt"
    return predictions, references_file(predictions)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def bootstraps(protocols: list[Protocol], output_dir: Path) -> list[str]:
    """Per seed, each BLEU comparison of the headline as sacreBLEU's paired bootstrap over the test
    sentences (`BOOTSTRAP_SAMPLES` resamples): the arm's BLEU minus the baseline's at that seed, its
    95% percentile interval and p-value. A seed whose translations are not on this machine, or
    whose two runs were scored against other references, is left out."""
    finals = {(r["task"], r["norm"], r["updates"], r["seed"]): r for protocol in protocols
              for r in _finished(protocol)}
    lines = ["| task | updates | score | arm | baseline | seed | sentences | arm minus baseline, BLEU [95% bootstrap] "
             "| p |", "|---|---:|---|---|---|---:|---:|---|---:|"]
    for c in comparisons(protocols):
        if c["key"] not in TRANSLATIONS:
            continue
        for seed in sorted(set(c["baseline"]) & set(c["other"])):
            runs = [finals[(c["task"], norm, c["updates"], seed)] for norm in (c["against"], c["norm"])]
            files = [_translation_files(output_dir, run, c["key"]) for run in runs]
            if not all(path.is_file() for pair in files for path in pair):
                continue
            (base, base_refs), (other, other_refs) = [(_lines(p), _lines(r)) for p, r in files]
            if base_refs != other_refs:
                continue
            interval = paired_bootstrap_bleu(base, other, base_refs, samples=BOOTSTRAP_SAMPLES)
            lines.append(f"| {c['task']} | {c['updates']} | {c['label']} | {ARM_NAMES[c['norm']]} | "
                         f"{BASELINE_NAMES[c['against']]} | {seed} | {interval.n} | {interval.mean:+.2f} "
                         f"[{interval.low:+.2f}, {interval.high:+.2f}] | {interval.p_value:.3f} |")
    return lines


_SEED_COLUMNS = ("layernorm", *ARM_NAMES)


def replaced_finals(protocols: list[Protocol]) -> list[str]:
    """The seed-1 finals that fresh dropout draws replaced (amendment 2), old and new headline scores
    side by side; empty where none was replaced."""
    lines = ["| task | updates | arm | seed | score | replaced (the winning tuning run's training) | fresh draws |",
             "|---|---|---|---|---|---|---|"]
    for protocol in protocols:
        fresh = {(r["norm"], r["updates"], r["seed"]): r for r in _finished(protocol)}
        for old in _finished(protocol, "replaced"):  # each beside its fresh final, which has run
            new = fresh[(old["norm"], old["updates"], old["seed"])]
            for split, metric, scored in HEADLINES[protocol.task]:
                key = f"{split}_{metric}"
                lines.append(f"| {protocol.task} | {old['updates']} | {ARM_NAMES.get(old['norm'], old['norm'])} | "
                             f"{old['seed']} | {_score_label(split, metric, scored)} | {old[key]:.2f} | "
                             f"{new[key]:.2f} |")
    return lines if len(lines) > 2 else []


def per_seed(protocols: list[Protocol]) -> list[str]:
    """The finals' headline scores seed by seed, with PN minus LayerNorm at each seed: whether a mean
    difference is one seed's or every seed's."""
    names = " | ".join(["LayerNorm", *ARM_NAMES.values()])
    lines = [f"| task | updates | score | seed | {names} | PN minus LN |",
             "|---|---:|---|---:|" + "---:|" * (len(_SEED_COLUMNS) + 1)]
    for protocol in protocols:
        finals = _finished(protocol)
        for updates in (protocol.short, protocol.long):
            for split, metric, scored in HEADLINES[protocol.task]:
                key = f"{split}_{metric}"
                by_seed: dict[int, dict[str, float]] = {}
                for result in finals:
                    if result["updates"] == updates and result["norm"] in _SEED_COLUMNS and key in result:
                        by_seed.setdefault(result["seed"], {})[result["norm"]] = result[key]
                for seed, scores in sorted(by_seed.items()):
                    cells = [f"{scores[norm]:.2f}" if norm in scores else "-" for norm in _SEED_COLUMNS]
                    difference = (f"{scores['powernorm'] - scores['layernorm']:+.2f}"
                                  if "powernorm" in scores and "layernorm" in scores else "-")
                    lines.append(f"| {protocol.task} | {updates} | {_score_label(split, metric, scored)} | "
                                 f"{seed} | {' | '.join(cells)} | {difference} |")
    return lines


def cpu_hours(protocols: list[Protocol]) -> str:
    """The CPU time of the finished runs that record it (`run_cell`'s `cpu_seconds`), per task."""
    parts = []
    for protocol in protocols:
        seconds = [r["cpu_seconds"] for r in _finished_runs(protocol) if r.get("cpu_seconds") is not None]
        if seconds:
            parts.append(f"{protocol.task} {sum(seconds) / 3600:.1f} over {len(seconds)} run"
                         + ("s" if len(seconds) != 1 else ""))
    return "; ".join(parts) or "no run records it yet"


def interim_note(protocols: list[Protocol]) -> list[str]:
    """A warning above the headline while any task's finals are unfinished or any of its arms is
    still tuning (its finals are still to come): the adjustment covers the comparisons made so far,
    so a verdict can still change; nothing once every stage and every final is in."""
    pending = [name for protocol in protocols for name in protocol.pending_fresh]
    fresh = [f"**Interim:** {len(pending)} fresh seed-1 finals of amendment 2 have not run yet "
             f"({', '.join(pending)}); until they have, their rows hold the seed-1 finals they will replace.",
             ""] if pending else []
    return fresh + _progress_note(protocols)


def _progress_note(protocols: list[Protocol]) -> list[str]:
    """The interim warning of unfinished finals or tuning stages (`interim_note`'s second part)."""
    done, total = _finished_of([entry for protocol in protocols for entry in protocol.stages.get("final", [])])
    tuning = [f"{protocol.task} {stage}" for protocol in protocols for stage, cells in protocol.stages.items()
              if stage != "final" and _unfinished(cells)]
    if total and done == total and not tuning and all("final" in protocol.stages for protocol in protocols):
        return []
    if not total:
        return ["**Interim:** the tuning is still running and no final has been queued: no test score exists "
                "yet, so no verdict below.", ""]
    still = f" Still tuning, their finals to come: {', '.join(tuning)}." if tuning else ""
    return [f"**Interim:** {done} of the {total} finals queued so far have finished.{still} Holm's adjustment "
            "covers the comparisons they allow, not those of the finished study, so a verdict below can change "
            "as the rest come in.", ""]


def _finished_of(cells: list[tuple[Cell, dict[str, Any] | None]]) -> tuple[int, int]:
    """How many of the distinct cells in a stage's `(cell, result)` pairs have finished, and of how many."""
    return len({cell.name for cell, result in cells if result is not None}), len({cell.name for cell, _ in cells})


def _unfinished(cells: list[tuple[Cell, dict[str, Any] | None]]) -> bool:
    done, total = _finished_of(cells)
    return done < total


def _progress(protocol: Protocol) -> str:
    parts = []
    for stage, cells in protocol.stages.items():
        done, total = _finished_of(cells)
        parts.append(f"{stage} {done}/{total}")
    return f"{protocol.task}: " + (", ".join(parts) or "nothing run")


# The study's outputs, written by `write_outputs` (with the figures `curves_<task>_<updates>.png`).
OUTPUT_FILES = RESULTS_CSV, CURVES_CSV, PICKS_JSON, SUMMARY_MD = ("results.csv", "curves.csv", "picks.json",
                                                                  "summary.md")


def _finished_runs(protocol: Protocol) -> list[dict[str, Any]]:
    """Each finished run of the protocol once, in stage order (a final's seed 1 is also a tuning run)."""
    runs = {result["cell"]: result for cells in protocol.stages.values() for _, result in cells if result is not None}
    return list(runs.values())


def write_outputs(protocols: list[Protocol], args: argparse.Namespace, output_dir: Path) -> None:
    write_rows(result_rows(protocols), output_dir / RESULTS_CSV, columns=COLUMNS)
    with open(output_dir / CURVES_CSV, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "norm", "updates", "cell", "seed", "step", "validation"])
        for result in (run for protocol in protocols for run in _finished_runs(protocol)):
            for step, value in validation_curve(output_dir, result):
                writer.writerow([result["task"], result["norm"], result["updates"], result["cell"],
                                 result["seed"], step, value])
    picks = {protocol.task: protocol.picks for protocol in protocols}
    (output_dir / PICKS_JSON).write_text(json.dumps(picks, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    corpora = "smoke sizes" if args.smoke else "PTB, Multi30k, tinyshakespeare"
    made = comparisons(protocols)
    adjusted = sum(c["verdict"].interval is not None for c in made)  # Holm covers those with an interval
    lines = [f"# LayerNorm, PN, RMSNorm, DyT and Derf, tuned alike ({corpora})", "",
             "Headline scores (finals only; whole test splits): test perplexity per BPE token of the best validated "
             "model (PTB; tinyshakespeare with PTB's picks unchanged); Multi30k test BLEU of the average of the last "
             "checkpoints (beam 5; the paper's inference) and of the best validated checkpoint (beam 5). Each arm "
             "against LayerNorm (DyT and Derf also against PN) over the seeds both have: the mean of the per-seed "
             f"differences with its 95% t interval, Holm's adjustment over the {adjusted} comparisons below that have "
             f"{MIN_PAIRS} or more paired seeds (of {len(made)}); an arm is better "
             f"or worse when the adjusted p-value is below {SIGNIFICANCE}, else no difference is shown; under "
             f"{MIN_PAIRS} paired seeds, no verdict.", "", *interim_note(protocols), *headline(protocols), "",
             "Per seed (the finals):", "", *per_seed(protocols), "",
             *(["Seed-1 finals drawn afresh (amendment 2): where a final had repeated its arm's winning tuning run, "
                "it ran again with other dropout draws (the same initialisation and batch order); the tables above "
                "use the fresh ones.", "", *replaced, ""] if (replaced := replaced_finals(protocols)) else []),
             f"BLEU per seed, sacreBLEU's paired bootstrap over the test sentences ({BOOTSTRAP_SAMPLES} resamples): "
             "how far a seed's difference stands from what resampling the sentences gives. Descriptive, per seed, "
             "not corrected for their number; the verdicts above come from the seeds.", "",
             *bootstraps(protocols, output_dir), "",
             "Stages finished: " + "; ".join(_progress(p) for p in protocols), "",
             "CPU-hours of the runs that record them (their killed attempts included): "
             + cpu_hours(protocols) + ".", "",
             f"Picks (validation only): `{PICKS_JSON}`."]
    (output_dir / SUMMARY_MD).write_text("\n".join(lines) + "\n", encoding="utf-8")
    for protocol in protocols:
        _plot(protocol, output_dir)


# The difference panel starts at this fraction of the budget: the first evaluations differ by
# several points and would flatten the rest of the curve.
DIFFERENCE_FROM = 0.2


def _plot(protocol: Protocol, output_dir: Path) -> None:
    """Validation over updates of the finals: per norm the mean over seeds and the seeds' range
    (left), and each norm's seeds minus LayerNorm's mean at the same update (right), where
    differences of a fraction of a point are visible. A budget without finals has no figure (one
    left by an earlier report, from finals that a later protocol change has not asked for, is removed)."""
    finals = _finished(protocol)
    for updates in protocol.sizes["budgets"]:
        if not any(r["updates"] == updates for r in finals):
            (output_dir / f"curves_{protocol.task}_{updates}.png").unlink(missing_ok=True)
    if not finals:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for updates in protocol.sizes["budgets"]:
        runs = [r for r in finals if r["updates"] == updates]
        if not runs:
            continue
        curves = {norm: [dict(validation_curve(output_dir, r)) for r in runs if r["norm"] == norm]
                  for norm in dict.fromkeys(r["norm"] for r in runs)}
        steps = {norm: sorted(set.intersection(*(set(c) for c in runs_))) for norm, runs_ in curves.items()}
        means = {norm: {s: statistics.fmean(c[s] for c in curves[norm]) for s in steps[norm]} for norm in curves}
        figure, (axis, difference) = plt.subplots(1, 2, figsize=(11, 4))
        for norm, norm_curves in curves.items():
            values = [[c[s] for c in norm_curves] for s in steps[norm]]
            seeds = f"{len(norm_curves)} seed{'s' if len(norm_curves) > 1 else ''}"
            line, = axis.plot(steps[norm], [statistics.fmean(v) for v in values], label=f"{norm} ({seeds})")
            axis.fill_between(steps[norm], [min(v) for v in values], [max(v) for v in values], alpha=0.2)
            if "layernorm" in means and norm != "layernorm":
                shared = [s for s in steps[norm] if s in means["layernorm"] and s >= DIFFERENCE_FROM * updates]
                gaps = [[c[s] - means["layernorm"][s] for c in norm_curves] for s in shared]
                difference.plot(shared, [statistics.fmean(g) for g in gaps], color=line.get_color(), label=norm)
                difference.fill_between(shared, [min(g) for g in gaps], [max(g) for g in gaps],
                                        color=line.get_color(), alpha=0.2)
        _label(axis, difference, protocol.task, updates)
        figure.tight_layout()
        figure.savefig(output_dir / f"curves_{protocol.task}_{updates}.png", dpi=100)
        plt.close(figure)


def _label(axis: Any, difference: Any, task: str, updates: int) -> None:
    """The two panels' scales, labels, titles and legends."""
    if LOWER_IS_BETTER[task]:
        axis.set_yscale("log")
    metric = "validation perplexity" if LOWER_IS_BETTER[task] else "validation BLEU"
    axis.set_xlabel("update")
    axis.set_ylabel(metric)
    axis.set_title(f"{task}, {updates} updates: mean and seed range")
    axis.legend(fontsize=8)
    difference.axhline(0.0, color="black", linewidth=0.8)
    difference.set_xlabel("update")
    difference.set_ylabel(f"{metric} minus LayerNorm's mean")
    difference.set_title(f"against LayerNorm's mean, from update {DIFFERENCE_FROM * updates:g} (seed range)")
    if difference.lines[1:]:
        difference.legend(fontsize=8)


def export(protocols: list[Protocol], output_dir: Path, export_dir: Path) -> int:
    """Copy the outputs and each finished run's records into `export_dir` (`export_runs`); a figure
    there that the outputs no longer have is removed. Returns the number of runs exported."""
    figures = sorted(path.name for path in output_dir.glob("curves_*.png"))
    for path in export_dir.glob("curves_*.png"):
        if path.name not in figures:
            path.unlink()
    results = [result for protocol in protocols for result in _finished_runs(protocol)]
    return export_runs(results, output_dir, export_dir, [*OUTPUT_FILES, *figures])


def export_runs(results: list[dict[str, Any]], output_dir: Path, export_dir: Path, files: list[str]) -> int:
    """Copy the output `files` and each finished run's `result.json` and validation records (the lines of
    its log that `validation_curve` reads, as they are), and a translation final's test translations
    with their references (`bootstraps` reads them), into `export_dir`; a run folder there that
    is no longer a finished run is removed. An unfinished run's `cpu_record` (the CPU seconds its
    attempts have cost so far) is copied too, not its checkpoints. Returns the number of runs
    exported. Copied into an output folder, `cells/` resumes the study: the grid never reruns a run
    with a result, the report reads the same curves from it, and a run that was under way starts
    again from its beginning with the CPU seconds already spent on it in its account."""
    (export_dir / "cells").mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copyfile(output_dir / name, export_dir / name)
    finished = {result["cell"]: result for result in results}
    for cell, result in finished.items():
        target = log_folder(export_dir, result)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(output_dir / "cells" / cell / RESULT_NAME, export_dir / "cells" / cell / RESULT_NAME)
        for key in TRANSLATIONS if result.get("final") and result["task"] == "multi30k" else ():
            for path in _translation_files(output_dir, result, key):
                if path.is_file():
                    copy = export_dir / path.relative_to(output_dir)
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, copy)
        lines = (log_folder(output_dir, result) / LOG_NAME).read_text(encoding="utf-8").splitlines(keepends=True)
        records = [line for line in lines if line.strip() and "validation" in json.loads(line)]
        (target / LOG_NAME).write_text("".join(records), encoding="utf-8")
    records = {path.name for path in (output_dir / "cells").glob(".*.cpu_seconds.json")
               if path.name[1:-len(".cpu_seconds.json")] not in finished}
    for name in records:
        shutil.copyfile(output_dir / "cells" / name, export_dir / "cells" / name)
    for folder in (export_dir / "cells").iterdir():
        if folder.name not in finished and folder.name not in records:
            remove_path(folder)
    return len(finished)


def transfer_files(data_dir: str | None) -> dict[str, str]:
    """The transfer corpus's splits: `train.txt`, `valid.txt` and `test.txt` in `data_dir`."""
    if data_dir is None:
        raise BadInput("--tasks tinyshakespeare needs --transfer_data_dir (a folder holding train.txt, valid.txt "
                       "and test.txt), or --smoke for the embedded corpus")
    folder = Path(data_dir).resolve()
    files = {split: folder / f"{name}.txt" for split, name in (("train", "train"), ("validation", "valid"),
                                                                ("test", "test"))}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise MissingInput(f"--transfer_data_dir {data_dir}: no {missing}")
    return {split: str(path) for split, path in files.items()}


# The smoke sizes' translation corpus: the finals score whole splits, kept small here.
SMOKE_TRANSLATION = {"train": 4000, "validation": 12, "test": 12}


def _smoke_translation_files(folder: Path) -> dict[str, str]:
    """The embedded translation corpus as JSON-lines files, written once: a tuning run then reads
    train and validation only, as with the real files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {split: folder / f"{split}.jsonl" for split in SMOKE_TRANSLATION}
    if not all(path.is_file() for path in files.values()):
        for split, part in synthetic_translation_corpus(sizes=SMOKE_TRANSLATION).items():
            part.to_json(str(files[split]), lines=True, force_ascii=False)
    return {split: str(path) for split, path in files.items()}


def _inputs(task: str, args: argparse.Namespace, output_dir: Path) -> dict[str, Any]:
    sizes = args.sizes[task]
    if task == "multi30k":
        return {"files": (_smoke_translation_files(output_dir / "multi30k-smoke") if args.smoke
                          else multi30k_files(args.data_dir))}
    folder = output_dir if task == "ptb" else output_dir / task
    if task == "ptb" or args.smoke:
        files = lm_split_files(args.data_dir, folder, args.smoke)
    else:
        files = transfer_files(args.transfer_data_dir)
    model_size = lm_size(argparse.Namespace(hidden_size=STUDY_LM["hidden_size"], layers=STUDY_LM["decoder_layers"]))
    tokenizer = prepare_lm_data(files, folder, sizes["vocab_size"], sizes["block_size"])
    # The tuning runs' splits (no test) tokenized once here too, not in each run.
    prepare_lm_data({split: path for split, path in files.items() if split != "test"}, folder, sizes["vocab_size"],
                    sizes["block_size"])
    return {"files": files, "model_size": model_size, "tokenizer": tokenizer}


def run_finals_together(protocols: list[Protocol], extras: bool) -> None:
    """Each protocol's `run_finals(extras)`, their runs queued as one grid in task order: with
    `--jobs 2` a core that finishes one task's last run starts the next task's first rather than
    waiting for the other core (no task's finals depend on another's)."""
    if protocols and not protocols[0].args.report_only:
        first = protocols[0]
        cells = list({cell.name: cell for protocol in protocols for cell in protocol.final_cells(extras)}.values())
        run_grid(cells, run_cell, first.output_dir, desc="finals", resume_cells=True,
                 executor=executor_settings(first.args))
    for protocol in protocols:
        protocol.run_finals(extras)


def _protocol(task: str, args: argparse.Namespace, output_dir: Path, made: dict[str, Protocol]) -> Protocol:
    inputs = _inputs(task, args, output_dir)
    if task in TRANSFER_FROM:
        return Transfer(task, args, inputs, output_dir, made[TRANSFER_FROM[task]])
    return Protocol(task, args, inputs, output_dir)


def main(argv: list[str] | None = None) -> list[Protocol]:
    args = parse_args(argv)
    output_dir = study_output_dir(args)
    made: dict[str, Protocol] = {}
    for task in (task for task in TASKS if task in args.tasks):  # a transfer task after its source
        made[task] = _protocol(task, args, output_dir, made)
    output_dir.mkdir(parents=True, exist_ok=True)
    protocols = list(made.values())
    # Every task's tuning before any final: the picks are fixed first, then test is scored; every
    # task's main finals before the rows the cut rule drops first.
    tuned = [protocol for protocol in protocols if protocol.tune()]
    write_outputs(protocols, args, output_dir)
    for extras in (False, True):
        run_finals_together(tuned, extras)
        write_outputs(protocols, args, output_dir)
    # DyT and Derf once every other final has run: a task's tuning, then its finals, task by task.
    for protocol in tuned if args.elementwise else []:
        if protocol.tune_elementwise():
            protocol.run_finals(elementwise=True)
        write_outputs(protocols, args, output_dir)
    print((output_dir / SUMMARY_MD).read_text(encoding="utf-8"))
    if args.export_dir:
        count = export(protocols, output_dir, Path(args.export_dir))
        print(f"Exported the outputs and {count} finished runs to {args.export_dir}")
    return protocols


if __name__ == "__main__":
    from ..cli import run_command

    run_command("studies", main)
