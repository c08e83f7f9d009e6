"""The options of `hf-powernorm compare`: one typed object (`CompareOptions`), its command line and
its checks.

Each field is an option: the options it shares with the recipes are their declarations
(`training.options.shared`), with a comparison's own default or help where it says them
differently; `build_parser` builds the command line from the fields, every default printed once.
This module imports neither torch nor Transformers, so `--help` answers at once; `parse_args`
imports the training library only once the command line has parsed, to check the values before
anything is written. The options are saved to `compare.json` (`to_json`) and read back
(`from_json`) field by field; `settings` are the fields that change what a comparison measures
(not where or how fast it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..training import options as training_options
from ..training.options import BadInput, add_options, shared, world_size

BASELINE = "layernorm"  # the model's own norms, unchanged
# The baseline named twice in `--norms` (`--norms layernorm layernorm`): its second arm, the A/A run, the
# baseline again through the same pipeline, which must come out the same function.
BASELINE_AGAIN = "layernorm-again"
BASELINES = (BASELINE, BASELINE_AGAIN)
EMBEDDED_TASK = "causal-lm"  # the task of the embedded default
# The tasks of the training registry (`training.tasks.task_names()`; a test holds them equal).
TASKS = ("causal-lm", "classification", "seq2seq")
# The names of the norm registry (`normalization.NORM_CLASSES`; a test holds them equal), for the help.
NORMS = ("powernorm", "powernorm_v", "batchnorm", "batchrenorm", "mabn", "layernorm", "rmsnorm", "groupnorm",
         "none", "dyt", "derf")
MAX_SEED = 2**32 - 1
# Recipe options that a comparison does not take: it sets them itself (the norms, one run per seed,
# which draws its dropout too, the checkpoints of --checkpoint_runs, the function kept unless
# --no_preserve_function), or they build a new model or shape only the PowerNorm Transformer
# family, never a comparison of the user's model.
NOT_TAKEN = ("convert_norms", "norm_type", "encoder_norm_type", "decoder_norm_type", "preset", "config_name",
             "config_overrides", "tokenizer_name", "vocab_size", "dropout", "resume_from_checkpoint",
             "checkpointing_steps", "checkpoints_total_limit", "do_train", "seed", "dropout_seed", "preserve_function",
             "norm_alpha_init_attention", "norm_alpha_init_ffn", "norm_alpha_init_final", "embed_scale_learnable")
# The tiny GPT-2's budget of the embedded default, where the option is left at its default.
EMBEDDED_BUDGET = {"max_train_steps": 60, "block_size": 64, "max_tokens": 256, "learning_rate": 2e-3}
GROUPS = {"data": "data", "model": "tokenizer and model",
          "powernorm": "power normalization (a converted PN's options; default: PowerNorm's own)",
          "training": "training", "evaluation": "evaluation", "comparison": "comparison",
          "columns": "data columns (default: the names each task reads)",
          "kept": "the models a comparison keeps",
          "executor": "where the runs go (one job per run; see docs/compare_executors.md)"}
# The executors of `training.executors.EXECUTORS` (a test holds them equal, and the options' help).
EXECUTORS = ("local", "submitit", "ray")

# `--help`: what a comparison does and writes (the description), how it runs and an example (the epilog).
DESCRIPTION = "Does Power Normalization help my model? One command that answers it on the user's model and data."
EPILOG = (
    "For each norm of `--norms` and each seed of `--seeds`, the model of `--model_name_or_path` (a Hub id\n"
    "or a folder) has its norms converted by `convert_norms` (`layernorm`: the model's own norms,\n"
    "unchanged, named by their class in the report; a model loaded from weights is converted keeping its\n"
    "function unless `--no_preserve_function`; `--convert_modules` selects the norms), is fine-tuned by\n"
    "the training library's `fit` at equal settings (with `--tune_lr`, each norm's learning rate is\n"
    "chosen on validation from `--lr_grid`, with the first seed), and is scored on validation before\n"
    "and after fine-tuning and on test. The runs form a resumable grid (`training/grid.py`): a finished\n"
    "run is not redone unless its fingerprint (model, tokenizer, the data's contents, settings) changed,\n"
    "`--jobs N` runs N at once on CPU, and under `accelerate launch` every run uses all the processes.\n"
    "Writes into `--output_dir`:\n"
    "\n"
    "- `results.csv`: one row per run and evaluated split, with its time;\n"
    "- `report.md`: mean ± standard deviation over the seeds per norm, the checks that withhold a\n"
    "  verdict (degenerate scores, a best model at the last update, no better than before\n"
    "  fine-tuning), the verdict of each norm against the first from the paired test differences over\n"
    "  the seeds (a 95% t interval, Holm over the comparisons; none for a norm that computes the same\n"
    "  function as the first, within a relative 1e-6), seq2seq sample outputs, the settings;\n"
    "- `validation_curves.png`: training loss and validation score against updates (log axis for\n"
    "  losses and perplexity), the mean over seeds with markers and the seeds' range as a band;\n"
    "- with `--save_models`, `models/<norm>`: each norm's best model (and `--push_to_hub` uploads it).\n"
    "\n"
    "Bad input stops with one line before anything is written; the output folder is held by one\n"
    "process at a time (a second start on it stops, naming the first); Ctrl-C writes the report of the\n"
    "runs finished so far, and the same command resumes (with `--checkpoint_runs`, a run cut short goes\n"
    "on from its last validation instead of starting again). Data comes as the recipes take it:\n"
    "`--dataset_name` (a Hub id, a local folder of files or of `save_to_disk`) or\n"
    "`--train_file/--validation_file/--test_file`, with `--text_column` etc. naming other columns,\n"
    "tokenized by cached `Dataset.map` passes. Without a model and data, a tiny GPT-2 trains on the\n"
    "embedded English corpus (under two minutes on 2 CPU cores). A model that brings its own code runs\n"
    "only with `--trust_remote_code`.\n"
    "\n"
    "    hf-powernorm compare --model_name_or_path gpt2 --task causal-lm --dataset_name wikitext \\\n"
    "        --dataset_config_name wikitext-2-raw-v1 --norms layernorm powernorm --seeds 1 2 3 \\\n"
    "        --max_train_steps 1000 --output_dir outputs/compare-gpt2"
)


def option(default: Any = None, help: str = "", group: str = "comparison", **settings: Any) -> Any:
    """A comparison's own option (`training.options.option`; `runtime`: left out of the settings and
    the fingerprint)."""
    return training_options.option(default, help, group, **settings)


def flag(help: str, group: str = "comparison", *, runtime: bool = False) -> Any:
    return training_options.flag(help, group, runtime=runtime)


@dataclass
class CompareOptions:
    """Everything a comparison is run with: the command line's options, then what `parse_args` and
    `prepare` settle from them (the model's folder, whether its function is kept)."""

    # data
    dataset_name: str | None = shared("dataset_name", help="a Hub dataset (needs network, or the datasets cache), a "
                                                           "local folder of data files, or a folder of "
                                                           "Dataset.save_to_disk / DatasetDict.save_to_disk")
    dataset_config: str | None = shared("dataset_config", help="the Hub dataset's configuration")
    train_file: str | None = shared("train_file", help="training data: .txt (causal-lm), .csv/.json/.jsonl (any task), "
                                                       ".txt 'sentence@label' (classification); validation and test "
                                                       "are carved out of it (10%% each) when not given")
    validation_file: str | None = shared("validation_file", help="validation data, the format of --train_file (picks "
                                                                 "each run's best model)")
    test_file: str | None = shared("test_file", help="test data, the format of --train_file (the verdict's scores)")
    max_train_samples: int | None = shared("max_train_samples")
    max_eval_samples: int | None = shared("max_eval_samples")
    preprocessing_num_workers: int | None = shared("preprocessing_num_workers", runtime=True)
    overwrite_cache: bool = shared("overwrite_cache", runtime=True)
    # tokenizer and model
    model_name_or_path: str | None = shared("model_name_or_path", help="the model to compare norms on: a folder or a "
                                                                       "Hub id (offline: from the cache); default: a "
                                                                       "tiny GPT-2 on the embedded corpus")
    trust_remote_code: bool = shared("trust_remote_code", help="run the code a model folder or Hub repository brings "
                                                               "with it (its auto_map), as "
                                                               "from_pretrained(trust_remote_code=True) does; "
                                                               "without it such a model is refused", runtime=True)
    calibration_batches: int = shared("calibration_batches", help="training batches that calibrate PN's running "
                                                                  "statistic where a norm keeps the pretrained "
                                                                  "function (see --no_preserve_function); 0: none, "
                                                                  "the statistic starts at 1")
    # power normalization
    powernorm_alpha_fwd: float | None = shared("powernorm_alpha_fwd")
    powernorm_alpha_bkw: float | None = shared("powernorm_alpha_bkw")
    powernorm_warmup_steps: int | None = shared("powernorm_warmup_steps",
        help="updates using batch statistics; default: none where the function is kept, else 0 for causal-lm and "
             "seq2seq (a decoder's batch mixes positions) and --num_warmup_steps for classification")
    powernorm_group_num: int | str | None = shared("powernorm_group_num")
    powernorm_backward_denominator: str | None = shared("powernorm_backward_denominator",
        help="'running' (the paper's eq. 12) or 'batch' (the reference code)", choices=None)
    powernorm_warmup_statistic: str | None = shared("powernorm_warmup_statistic",
        help="the running statistic during warmup: 'cumulative' mean of the batch statistics, or 'reference' (the "
             "authors' code: cumulative then EMA step)", choices=None)
    powernorm_warmup_ramp_steps: int | None = shared("powernorm_warmup_ramp_steps",
        help="updates after warmup over which the denominator blends from the batch statistic to the running one; 0: "
             "the paper's switch")
    sync_stats: bool | None = shared("sync_stats", help="sum PN/BN statistics over processes; default: on with several "
                                                        "processes (either way they are averaged before the model is "
                                                        "evaluated or saved)")
    # training
    max_tokens: int = shared("max_tokens", help="padded tokens per batch")
    per_device_train_batch_size: int | None = shared("per_device_train_batch_size")
    learning_rate: float = shared("learning_rate", default=5e-4, help="peak learning rate of every norm; with "
                                                                        "--tune_lr, the middle of the grid unless "
                                                                        "--lr_grid is given")
    lr_scheduler_type: str = shared("lr_scheduler_type", default="linear",
        help="fairseq's inverse_sqrt, or a schedule of transformers.get_scheduler")
    num_warmup_steps: int = shared("num_warmup_steps", default=20)
    warmup_init_lr: float = shared("warmup_init_lr", help="inverse_sqrt: the first update's learning rate")
    weight_decay: float = shared("weight_decay", help="AdamW weight decay (not on biases and norm weights)")
    clip_norm: float = shared("clip_norm", help="largest gradient norm; 0: no clipping")
    gradient_accumulation_steps: int = shared("gradient_accumulation_steps", help="batches per update")
    num_train_epochs: int = shared("num_train_epochs", default=3, help="passes over the training data, unless "
                                                                       "--max_train_steps is given")
    max_train_steps: int | None = shared("max_train_steps")
    mixed_precision: str | None = shared("mixed_precision", help="default: the accelerate config's")
    cpu: bool = shared("cpu", runtime=True)
    output_dir: str = shared("output_dir", default="outputs/compare", help="the comparison's folder: new, empty, or "
                                                                           "holding this comparison (resumed)",
        runtime=True)
    overwrite_output_dir: bool = shared("overwrite_output_dir", help="clear --output_dir first if it holds another "
                                                                     "comparison (its compare.json)", runtime=True)
    record_norm_stats: int = shared("record_norm_stats", help="write what every norm layer sees every N updates to "
                                                              "each run's norm_stats.jsonl; 0: never")
    with_tracking: bool = shared("with_tracking", help="log loss, learning rate, validation and final scores to "
                                                       "--report_to", runtime=True)
    report_to: str = shared("report_to", help="with --with_tracking: 'all' or comma-separated Accelerate trackers "
                                              "(tensorboard, wandb, mlflow, ...)", runtime=True)
    # evaluation
    eval_steps: int | None = shared("eval_steps", help="validate every N updates; default: --max_train_steps / 8 when "
                                                       "it is given, else after each epoch")
    patience: int | None = shared("patience")
    eval_batch_size: int = shared("eval_batch_size", default=16, help="examples per evaluation batch", runtime=True)
    # comparison
    task: str = option(EMBEDDED_TASK, "what the model is fine-tuned and scored on; causal-lm reads a 'text' (or "
                                      "'sentence') column, classification 'text' and 'label', seq2seq "
                                      "'translation' ({lang: text})", choices=TASKS)
    norms: list[str] = option([BASELINE, "powernorm"], f"norms to compare, of the norm registry: {', '.join(NORMS)}; "
                                                       f"the first the baseline of the verdict; '{BASELINE}' is "
                                                       f"the model's own norms, unchanged (named by their class in "
                                                       f"the report); '{BASELINE} {BASELINE}' is the A/A run, the "
                                                       f"baseline against itself", runtime=True, nargs="*")
    seeds: list[int] = option([1, 2, 3], f"one run per norm and seed (0 to {MAX_SEED}); a verdict needs at least two",
                              runtime=True, type=int, nargs="*")
    tune_lr: bool = flag("choose each norm's learning rate from --lr_grid on validation (first seed)")
    lr_grid: list[float] | None = option(help="learning rates tried with --tune_lr; default: --learning_rate x 1/3, "
                                              "1, 3", type=float, nargs="+")
    jobs: int = option(1, "runs at once on CPU, each in its own process", runtime=True, type=int)
    report_only: bool = flag("write the outputs from the runs finished so far, and run nothing", runtime=True)
    block_size: int | None = shared("block_size", default=None, group="comparison",
        help="causal-lm: tokens per block; default: what the model's positions and tokenizer allow, at most 1024 and "
             "--max_tokens")
    keep_linebreaks: bool | None = shared("keep_linebreaks", group="comparison",
        help="causal-lm: a text file's lines keep their line breaks in the token stream, as Transformers' run_clm "
             "reads them; --no_keep_linebreaks joins the lines without them")
    max_length: int | None = shared("max_length", default=None, group="comparison",
        help="classification and seq2seq: truncate sequences to this many tokens; default: 128, or fewer if the "
             "model's positions or --max_tokens allow fewer")
    source_lang: str = shared("source_lang", help="seq2seq: the source language of 'translation'", group="comparison")
    target_lang: str = shared("target_lang", help="seq2seq: the target language of 'translation'", group="comparison")
    label_names: str | list[str] | None = shared("label_names", group="comparison",
        help="classification: comma-separated class names, in the order of the model's label ids; default: the "
             "model's id2label when the data's labels are among its names, else the data's labels (sorted); the "
             "embedded corpus: its three classes")
    num_beams: int = shared("num_beams", default=1, help="seq2seq: beams when scoring BLEU", group="comparison")
    convert_modules: str | None = shared("convert_modules", help="convert only the norms whose module name matches this"
                                                                 " regular expression (re.search), e.g. 'encoder' or "
                                                                 "'layers\\.([4-9]|1[0-9])\\.'; default: every norm "
                                                                 "over the hidden size", group="comparison")
    keep_tied_head: bool = flag("keep a head tied to the input embeddings tied in every arm: a LayerNorm model's "
                                "residual stream is then not centred, and its LayerNorms convert approximately (the "
                                "report gives each one's mean / RMS); by default every arm, the baseline too, has "
                                "its stream centred and such a head untied, so that the arms differ in their norms "
                                "alone")
    no_preserve_function: bool = flag("convert without keeping the pretrained model's function; by default a model "
                                      "loaded from weights is converted keeping it, so that every norm starts "
                                      "fine-tuning where the pretrained model is")
    # data columns
    text_column: str | None = shared("text_column", help="causal-lm and classification: the text column; default: "
                                                         "'text', else 'sentence'", group="columns")
    label_column: str | None = shared("label_column", help="classification: the label column; default: 'label'",
                                      group="columns")
    source_column: str | None = shared("source_column", help="seq2seq: a column of source texts (e.g. 'document'), "
                                                             "with --target_column, instead of 'translation'",
                                       group="columns")
    target_column: str | None = shared("target_column", help="seq2seq: a column of target texts (e.g. 'summary')",
                                       group="columns")
    # the models a comparison keeps
    checkpoint_runs: bool = flag("checkpoint each run at each validation (see --eval_steps): a comparison stopped "
                                 "mid-run then goes on from the run's last checkpoint, with the scores of an "
                                 "unbroken run; a run's checkpoint is removed when the run has finished", "kept",
                                 runtime=True)
    save_models: bool = flag("keep each norm's best model (its best run over the seeds, by validation) in "
                             "output_dir/models/<norm>, loadable with load_converted", "kept", runtime=True)
    push_to_hub: bool = shared("push_to_hub", help="with --save_models: upload each kept model to "
                                                   "<--hub_model_id>-<norm>", group="kept", runtime=True)
    hub_model_id: str | None = shared("hub_model_id", help="with --push_to_hub: ORG/NAME, each norm's kept model going "
                                                           "to ORG/NAME-<norm>", group="kept", runtime=True)
    hub_private_repo: bool = shared("hub_private_repo", help="with --push_to_hub: create the repositories private",
        group="kept", runtime=True)
    # where the runs go
    executor: str = option("local", "local: the runs in this process, or --jobs processes at once; submitit: one "
                                    "Slurm job per run (with no sbatch on PATH, submitit's local executor runs the "
                                    "jobs as subprocesses of this machine, at most --jobs at once); ray: one Ray task "
                                    "per run. Either way a killed command, run again, submits only the unfinished "
                                    "runs", "executor", runtime=True, choices=EXECUTORS)
    slurm_partition: str | None = option(help="submitit: the Slurm partition of the jobs", group="executor",
                                         runtime=True)
    gpus_per_run: int = option(0, "submitit, ray: GPUs of each run; over 1, the run starts through Accelerate inside "
                                  "its job, one process per GPU", "executor", runtime=True, type=int, metavar="N")
    cpus_per_run: int = option(1, "submitit, ray: CPU cores of each run", "executor", runtime=True, type=int,
                               metavar="N")
    timeout_min: int = option(240, "submitit: the time limit of each job in minutes", "executor", runtime=True,
                              type=int, metavar="N")
    slurm_extra: list[str] = option([], "submitit: a further sbatch setting of each job as KEY=VALUE (e.g. "
                                        "account=my_lab, qos=high, constraint=a100); repeatable", "executor",
                                    runtime=True, action="append", metavar="KEY=VALUE")
    ray_address: str | None = option(help="ray: the address of a running Ray cluster (e.g. auto, or "
                                           "ray://head:10001); default: a local instance started for the command",
                                     group="executor", runtime=True)
    # settled by `parse_args` and `prepare`, not options
    embedded_default: bool = False  # no --model_name_or_path: the tiny GPT-2 on the embedded corpus
    model_id: str | None = None  # --model_name_or_path as given (a Hub id before it is resolved to its snapshot)
    preserve_function: bool = False  # converted keeping the pretrained function
    not_preserved: dict[str, str] = field(default_factory=dict)  # norms that cannot keep it, and why

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> CompareOptions:
        """The options saved by `to_json`; fields saved by another version and not known here are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})

    def settings(self) -> dict[str, Any]:
        """What a comparison measures: every field but the runtime options, by name."""
        runtime = {f.name for f in dataclasses.fields(self) if f.metadata.get("runtime")}
        return {k: v for k, v in sorted(self.to_json().items()) if k not in runtime}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """A bad option is a `BadInput`: one line on stderr and exit status 2 (`cli.run_command`)."""

    def error(self, message: str):
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `CompareOptions`: a flag per option field, its default said once in its help."""
    parser = _Parser(prog="hf-powernorm compare", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_options(parser, CompareOptions, GROUPS, say_defaults=True)


def parse_args(argv: Sequence[str] | None = None) -> CompareOptions:
    """The options, every check that needs no data done: nothing is written before they pass."""
    options = CompareOptions(**vars(build_parser().parse_args(argv)))
    check_executor(options)
    _check_runs(options)
    _check_quantities(options)
    options.embedded_default = options.model_name_or_path is None
    options.model_id = options.model_name_or_path  # as given: a Hub id is resolved to its local snapshot later
    task = task_class(options)
    if options.embedded_default and task.name != EMBEDDED_TASK:
        raise BadInput(f"--task {task.name} needs --model_name_or_path (a Hub id or a folder); only the embedded "
                       f"default (a tiny GPT-2, --task {EMBEDDED_TASK}) builds its own model")
    _check_columns(options, task)
    _fill_defaults(options, task)
    _check_library_options(options)
    # A model loaded from weights starts where its pretraining left it: so should every norm.
    options.preserve_function = not (options.embedded_default or options.no_preserve_function)
    _check_text_files(options, task)
    return options


def task_class(options: CompareOptions) -> type:
    """The registry's `Task` class of `--task`."""
    from ..training.tasks import get_task

    return get_task(options.task)


def library_args(options: CompareOptions, **overrides: Any) -> argparse.Namespace:
    """The options as the training library reads them (`fit`, the tasks, the converter): the recipes'
    defaults, this comparison's options over them, then `overrides` (a run's norm, seed, folder)."""
    from ..training.arguments import add_recipe_args

    args = add_recipe_args(argparse.ArgumentParser()).parse_args([])
    vars(args).update(options.to_json())
    vars(args).update(overrides)
    return args


def _check_runs(options: CompareOptions) -> None:
    """The options that say which runs to make: norms, seeds, processes, kept models."""
    options.norms = check_norms(options.norms)
    if not options.seeds:
        raise BadInput("--seeds is empty: give at least one seed, e.g. --seeds 1 2 3")
    if len(set(options.seeds)) != len(options.seeds):
        raise BadInput(f"--seeds repeats a seed: {options.seeds}")
    outside = [seed for seed in options.seeds if not 0 <= seed <= MAX_SEED]
    if outside:
        raise BadInput(f"--seeds {outside[0]}: a seed must be between 0 and {MAX_SEED}")
    if options.jobs > 1 and world_size() > 1:
        raise BadInput("--jobs runs several CPU processes; under `accelerate launch` each run already uses "
                       "every process: leave --jobs at 1")
    if options.lr_grid is not None and not options.tune_lr:
        raise BadInput(f"--lr_grid {' '.join(map(str, options.lr_grid))} is the grid that --tune_lr chooses from: "
                       f"add --tune_lr (without it every norm trains at --learning_rate)")
    if options.push_to_hub and not options.save_models:
        raise BadInput("--push_to_hub uploads the models that --save_models keeps: add --save_models")
    if options.push_to_hub and not options.hub_model_id:
        raise BadInput("--push_to_hub needs --hub_model_id ORG/NAME (each norm's model goes to ORG/NAME-<norm>)")
    if options.convert_modules is not None:
        try:
            re.compile(options.convert_modules)
        except re.error as error:
            raise BadInput(f"--convert_modules {options.convert_modules!r} is not a regular expression ({error})") \
                from None


def check_executor(options: CompareOptions) -> None:
    """The executor's options (`training.executors`), and its optional dependency installed (else
    one line naming the extra that installs it), before any other check or work; for jobs, an output
    folder only this user can write."""
    from ..training.executors import check_private_output, executor_settings

    if executor_settings(options).executor != "local" and not options.report_only:
        check_private_output(options.output_dir)


def _check_quantities(options: CompareOptions) -> None:
    """The training library's one rule per quantity: learning rates, weight decay, counts, choices."""
    from ..normalization import BACKWARD_DENOMINATORS, WARMUP_STATISTICS
    from ..training.checks import check_grid, check_learning_rate, check_positive_int, check_weight_decay

    check_learning_rate(options.learning_rate)
    if options.lr_grid is not None:
        options.lr_grid = check_grid(options.lr_grid, check_learning_rate, "--lr_grid")
    check_weight_decay(options.weight_decay)
    check_positive_int(options.jobs, "--jobs")
    for name, valid in (("powernorm_backward_denominator", BACKWARD_DENOMINATORS),
                        ("powernorm_warmup_statistic", WARMUP_STATISTICS)):
        value = getattr(options, name)
        if value is not None and value not in valid:
            raise BadInput(f"--{name} {value!r}: expected one of {list(valid)}")


def _check_library_options(options: CompareOptions) -> None:
    """The recipes' checks of the options they share with a comparison (counts, files, trackers, the
    Hub), on the options as the library reads them."""
    from ..training.arguments import check_args, check_batch_budget

    # The recipes' checks hold --convert_modules to a --convert_norms, which a comparison sets per run.
    args = library_args(options, convert_modules=None)
    check_args(args, norm_options=())
    options.report_to = args.report_to
    check_batch_budget(args)


def _check_columns(options: CompareOptions, task: type) -> None:
    """The column options fit the task: each for the tasks that read it, source and target together."""
    from ..training.tasks import get_task, task_names
    from ..training.translation import check_column_pair

    fitting: dict[str, list[str]] = {}
    for name in task_names():
        for column in get_task(name).column_options:
            fitting.setdefault(column, []).append(name)
    for name, tasks in fitting.items():
        if getattr(options, name) is not None and name not in task.column_options:
            raise BadInput(f"--{name} is for --task {' or '.join(tasks)}, not {task.name}")
    check_column_pair(options.source_column, options.target_column)
    named = [getattr(options, name) for name in fitting if getattr(options, name) is not None]
    if named and options.embedded_default:
        raise BadInput("the column options name columns of your data: give it with --train_file or "
                       "--dataset_name")
    if named and options.train_file is None and options.dataset_name is None:
        raise BadInput("the column options need data: give --train_file or --dataset_name")


def _check_text_files(options: CompareOptions, task: type) -> None:
    """A data file that is not text (a NUL byte in its first 8 KiB) is refused here, not deep in `datasets`."""
    for name in task.input_path_options:
        path = getattr(options, name, None)
        if path and Path(path).is_file():
            with open(path, "rb") as handle:
                if b"\0" in handle.read(8192):
                    raise BadInput(f"--{name} {path} is not a text file (it holds NUL bytes); give a .txt, "
                                   f".csv, .json or .jsonl file")


def _fill_defaults(options: CompareOptions, task: type) -> None:
    """The embedded default's budget, the other tasks' options left out (neither shown in the
    settings nor checked), PN's warmup, the validation interval and the learning-rate grid."""
    from ..training.tasks import get_task, task_names

    defaults = CompareOptions()
    if options.embedded_default:
        for name, value in EMBEDDED_BUDGET.items():
            if getattr(options, name) in (None, getattr(defaults, name)):
                setattr(options, name, value)
    for name in {own for other in task_names() for own in get_task(other).own_options}:
        if name not in task.own_options and hasattr(options, name):
            setattr(options, name, None)
    if task.decoder_batches and options.powernorm_warmup_steps is None:
        # Batch statistics mix the positions of a causal (decoder) batch: no warmup on them by default.
        options.powernorm_warmup_steps = 0
    if options.eval_steps is None and options.max_train_steps is not None:
        options.eval_steps = max(1, options.max_train_steps // 8)  # else after each epoch
    if options.tune_lr and not options.lr_grid:
        options.lr_grid = [options.learning_rate / 3, options.learning_rate, options.learning_rate * 3]


def check_norms(names: Sequence[str]) -> list[str]:
    """The registry names of `--norms`: at least one, each known (ValueError listing the valid ones)."""
    from ..normalization import NORM_CLASSES, normalize_norm_name

    if not names:
        raise BadInput(f"--norms is empty: give the norms to compare, e.g. --norms layernorm powernorm; "
                       f"valid: {sorted(NORM_CLASSES)}")
    norms = []
    for name in names:
        try:
            norms.append(normalize_norm_name(name))
        except ValueError as error:
            raise BadInput(f"--norms: {error}") from None
    if norms.count(BASELINE) == 2:  # the A/A run: the baseline's second arm has a name of its own
        norms[norms.index(BASELINE, norms.index(BASELINE) + 1)] = BASELINE_AGAIN
    if len(set(norms)) != len(norms):
        raise BadInput(f"--norms names a norm twice: {names} (only '{BASELINE}', twice, for the A/A run)")
    return norms
