"""The options of `hf-powernorm compare`: one typed object (`CompareOptions`), its command line and
its checks.

Each field is an option: its metadata holds the flag's help, group and argparse settings, from
which `build_parser` builds the command line, every default printed once. This module imports
neither torch nor Transformers, so `--help` answers at once; `parse_args` imports the training
library only once the command line has parsed, to check the values before anything is written.
The options are saved to `compare.json` (`to_json`) and read back (`from_json`) field by field;
`settings` are the fields that change what a comparison measures (not where or how fast it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASELINE = "layernorm"  # the model's own norms, unchanged
# The baseline named twice in `--norms` (`--norms layernorm layernorm`): its second arm, the A/A run, the
# baseline again through the same pipeline, which must come out the same function.
BASELINE_AGAIN = "layernorm-again"
BASELINES = (BASELINE, BASELINE_AGAIN)
EMBEDDED_TASK = "causal-lm"  # the task of the embedded default
# The tasks of the training registry (`training.tasks.task_names()`; a test holds them equal).
TASKS = ("causal-lm", "classification", "seq2seq")
# The schedules of `training.optimization.SCHEDULER_TYPES` (a test holds them equal).
SCHEDULES = ("inverse_sqrt", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
             "constant_with_warmup")
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


def option(default: Any = None, help: str = "", group: str = "comparison", *, runtime: bool = False,
           **argparse_settings: Any) -> Any:
    """A field that is a command-line option. `runtime`: it changes where or how fast a comparison
    runs, or what it keeps, not what it measures (left out of the settings and the fingerprint)."""
    metadata = {"help": help, "group": group, "runtime": runtime, "argparse": argparse_settings}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def flag(help: str, group: str = "comparison", *, runtime: bool = False) -> Any:
    return option(False, help, group, runtime=runtime, action="store_true")


def _group_num(value: str) -> int | str:
    """`--powernorm_group_num`: a positive count, or 'none' (no group scaling)."""
    if value.lower() == "none":
        return "none"
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {value!r}")
    return int(value)


@dataclass
class CompareOptions:
    """Everything a comparison is run with: the command line's options, then what `parse_args` and
    `prepare` settle from them (the model's folder, whether its function is kept)."""

    # data
    dataset_name: str | None = option(
        help="a Hub dataset (needs network, or the datasets cache), a local folder of data files, or a folder of "
             "Dataset.save_to_disk / DatasetDict.save_to_disk", group="data")
    dataset_config: str | None = option(help="the Hub dataset's configuration", group="data",
                                        flags=("--dataset_config_name", "--dataset_config"))
    train_file: str | None = option(
        help="training data: .txt (causal-lm), .csv/.json/.jsonl (any task), .txt 'sentence@label' "
             "(classification); validation and test are carved out of it (10%% each) when not given", group="data")
    validation_file: str | None = option(help="validation data, the format of --train_file (picks each run's best "
                                              "model)", group="data")
    test_file: str | None = option(help="test data, the format of --train_file (the verdict's scores)", group="data")
    max_train_samples: int | None = option(help="train on the first N examples", group="data", type=int)
    max_eval_samples: int | None = option(help="evaluate on the first N examples of each split", group="data",
                                          type=int)
    preprocessing_num_workers: int | None = option(help="processes for tokenization", group="data", runtime=True,
                                                   type=int)
    overwrite_cache: bool = flag("tokenize again instead of reading the cache", "data", runtime=True)
    # tokenizer and model
    model_name_or_path: str | None = option(
        help="the model to compare norms on: a folder or a Hub id (offline: from the cache); default: a tiny GPT-2 "
             "on the embedded corpus", group="model")
    trust_remote_code: bool = flag("run the code a model folder or Hub repository brings with it (its auto_map), "
                                   "as from_pretrained(trust_remote_code=True) does; without it such a model is "
                                   "refused", "model", runtime=True)
    calibration_batches: int = option(8, "training batches that calibrate PN's running statistic where a norm "
                                         "keeps the pretrained function (see --no_preserve_function); 0: none, the "
                                         "statistic starts at 1", "model", type=int, metavar="N")
    # power normalization
    powernorm_alpha_fwd: float | None = option(help="EMA factor of the forward statistic", group="powernorm",
                                               type=float)
    powernorm_alpha_bkw: float | None = option(help="EMA factor of the gradient statistic", group="powernorm",
                                               type=float)
    powernorm_warmup_steps: int | None = option(
        help="updates using batch statistics; default: none where the function is kept, else 0 for causal-lm and "
             "seq2seq (a decoder's batch mixes positions) and --num_warmup_steps for classification",
        group="powernorm", type=int)
    powernorm_group_num: int | str | None = option(help="group scaling groups, or 'none'; default: one per "
                                                        "attention head", group="powernorm", type=_group_num)
    powernorm_backward_denominator: str | None = option(
        help="'running' (the paper's eq. 12) or 'batch' (the reference code)", group="powernorm")
    powernorm_warmup_statistic: str | None = option(
        help="the running statistic during warmup: 'cumulative' mean of the batch statistics, or 'reference' "
             "(the authors' code: cumulative then EMA step)", group="powernorm")
    powernorm_warmup_ramp_steps: int | None = option(
        help="updates after warmup over which the denominator blends from the batch statistic to the running "
             "one; 0: the paper's switch", group="powernorm", type=int)
    sync_stats: bool | None = option(help="sum PN/BN statistics over processes; default: on with several "
                                          "processes (either way they are averaged before the model is evaluated "
                                          "or saved)", group="powernorm", action=argparse.BooleanOptionalAction)
    # training
    max_tokens: int = option(1024, "padded tokens per batch", "training", type=int)
    per_device_train_batch_size: int | None = option(help="examples per batch and process, instead of the "
                                                          "--max_tokens budget", group="training", type=int)
    learning_rate: float = option(5e-4, "peak learning rate of every norm; with --tune_lr, the middle of the "
                                        "grid unless --lr_grid is given", "training", type=float)
    lr_scheduler_type: str = option("linear", "fairseq's inverse_sqrt, or a schedule of transformers.get_scheduler",
                                    "training", choices=SCHEDULES)
    num_warmup_steps: int = option(20, "learning-rate warmup in updates", "training", type=int,
                                   flags=("--num_warmup_steps", "--warmup_steps"))
    warmup_init_lr: float = option(1e-7, "inverse_sqrt: the first update's learning rate", "training", type=float)
    weight_decay: float = option(1e-4, "AdamW weight decay (not on biases and norm weights)", "training", type=float)
    clip_norm: float = option(0.0, "largest gradient norm; 0: no clipping", "training", type=float)
    gradient_accumulation_steps: int = option(1, "batches per update", "training", type=int)
    num_train_epochs: int = option(3, "passes over the training data, unless --max_train_steps is given",
                                   "training", type=int)
    max_train_steps: int | None = option(help="optimizer updates; overrides the epochs", group="training", type=int)
    mixed_precision: str | None = option(help="default: the accelerate config's", group="training",
                                         choices=("no", "fp16", "bf16"))
    cpu: bool = flag("train on CPU even if an accelerator is present", "training", runtime=True)
    output_dir: str = option("outputs/compare", "the comparison's folder: new, empty, or holding this comparison "
                                                "(resumed)", "training", runtime=True)
    overwrite_output_dir: bool = flag("clear --output_dir first if it holds another comparison (its "
                                      "compare.json)", "training", runtime=True)
    record_norm_stats: int = option(0, "write what every norm layer sees every N updates to each run's "
                                       "norm_stats.jsonl; 0: never", "training", type=int, nargs="?", const=1,
                                    metavar="EVERY_N")
    with_tracking: bool = flag("log loss, learning rate, validation and final scores to --report_to", "training",
                               runtime=True)
    report_to: str = option("tensorboard", "with --with_tracking: 'all' or comma-separated Accelerate trackers "
                                           "(tensorboard, wandb, mlflow, ...)", "training", runtime=True)
    # evaluation
    eval_steps: int | None = option(help="validate every N updates; default: --max_train_steps / 8 when it is "
                                         "given, else after each epoch", group="evaluation", type=int)
    patience: int | None = option(help="stop after N validations without improvement", group="evaluation", type=int)
    eval_batch_size: int = option(16, "examples per evaluation batch", "evaluation", runtime=True, type=int,
                                  flags=("--per_device_eval_batch_size", "--eval_batch_size"))
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
    block_size: int | None = option(help="causal-lm: tokens per block; default: what the model's positions and "
                                         "tokenizer allow, at most 1024 and --max_tokens", type=int)
    keep_linebreaks: bool | None = option(True, "causal-lm: a text file's lines keep their line breaks in the token "
                                                "stream, as Transformers' run_clm reads them; --no_keep_linebreaks "
                                                "joins the lines without them",
                                          action=argparse.BooleanOptionalAction, negative="--no_keep_linebreaks")
    max_length: int | None = option(help="classification and seq2seq: truncate sequences to this many tokens; "
                                         "default: 128, or fewer if the model's positions or --max_tokens allow "
                                         "fewer", type=int)
    source_lang: str = option("de", "seq2seq: the source language of 'translation'")
    target_lang: str = option("en", "seq2seq: the target language of 'translation'")
    label_names: str | list[str] | None = option(
        help="classification: comma-separated class names, in the order of the model's label ids; default: the "
             "model's id2label when the data's labels are among its names, else the data's labels (sorted); the "
             "embedded corpus: its three classes")
    num_beams: int = option(1, "seq2seq: beams when scoring BLEU", type=int)
    convert_modules: str | None = option(
        help="convert only the norms whose module name matches this regular expression (re.search), e.g. "
             "'encoder' or 'layers\\.([4-9]|1[0-9])\\.'; default: every norm over the hidden size", metavar="REGEX")
    keep_tied_head: bool = flag("keep a head tied to the input embeddings tied in every arm: a LayerNorm model's "
                                "residual stream is then not centred, and its LayerNorms convert approximately (the "
                                "report gives each one's mean / RMS); by default every arm, the baseline too, has "
                                "its stream centred and such a head untied, so that the arms differ in their norms "
                                "alone")
    no_preserve_function: bool = flag("convert without keeping the pretrained model's function; by default a model "
                                      "loaded from weights is converted keeping it, so that every norm starts "
                                      "fine-tuning where the pretrained model is")
    # data columns
    text_column: str | None = option(help="causal-lm and classification: the text column; default: 'text', else "
                                          "'sentence'", group="columns")
    label_column: str | None = option(help="classification: the label column; default: 'label'", group="columns")
    source_column: str | None = option(help="seq2seq: a column of source texts (e.g. 'document'), with "
                                            "--target_column, instead of 'translation'", group="columns")
    target_column: str | None = option(help="seq2seq: a column of target texts (e.g. 'summary')", group="columns")
    # the models a comparison keeps
    checkpoint_runs: bool = flag("checkpoint each run at each validation (see --eval_steps): a comparison stopped "
                                 "mid-run then goes on from the run's last checkpoint, with the scores of an "
                                 "unbroken run; a run's checkpoint is removed when the run has finished", "kept",
                                 runtime=True)
    save_models: bool = flag("keep each norm's best model (its best run over the seeds, by validation) in "
                             "output_dir/models/<norm>, loadable with load_converted", "kept", runtime=True)
    push_to_hub: bool = flag("with --save_models: upload each kept model to <--hub_model_id>-<norm>", "kept",
                             runtime=True)
    hub_model_id: str | None = option(help="with --push_to_hub: ORG/NAME, each norm's kept model going to "
                                           "ORG/NAME-<norm>", group="kept", runtime=True)
    hub_private_repo: bool = flag("with --push_to_hub: create the repositories private", "kept", runtime=True)
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
    """A bad option is a ValueError: one line on stderr and exit status 2 (`cli.run_command`)."""

    def error(self, message: str):
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `CompareOptions`: a flag per option field, its default said once in its help."""
    # The package's docstring, read from the package already imported (Python imports it before this
    # module), not imported back from it.
    description = sys.modules[__package__].__doc__

    # The usage as the package's docstring tells it: what a comparison does and writes, and an example.
    paragraphs = [p for p in description.split("\n\n") if not p.startswith("The package:")]
    parser = _Parser(prog="hf-powernorm compare", description="\n\n".join(paragraphs[:1]),
                     epilog="\n\n".join(paragraphs[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for spec in dataclasses.fields(CompareOptions):
        if "help" not in spec.metadata:
            continue
        settings = dict(spec.metadata["argparse"])
        flags, negative = settings.pop("flags", (f"--{spec.name}",)), settings.pop("negative", None)
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        group = groups[spec.metadata["group"]]
        group.add_argument(*flags, dest=spec.name, default=default, help=_with_default(spec.metadata["help"], default),
                           **settings)
        if negative:  # the spelling of Transformers' examples beside argparse's --no-<name>
            group.add_argument(negative, dest=spec.name, action="store_false", help=argparse.SUPPRESS)
    return parser


def _with_default(help: str, default: Any) -> str:
    """The help with its default, unless it says the default itself or there is none to say."""
    if "default:" in help or default in (None, False):
        return help
    return f"{help} (default: {default})"


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
        raise ValueError(f"--task {task.name} needs --model_name_or_path (a Hub id or a folder); only the embedded "
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
        raise ValueError("--seeds is empty: give at least one seed, e.g. --seeds 1 2 3")
    if len(set(options.seeds)) != len(options.seeds):
        raise ValueError(f"--seeds repeats a seed: {options.seeds}")
    outside = [seed for seed in options.seeds if not 0 <= seed <= MAX_SEED]
    if outside:
        raise ValueError(f"--seeds {outside[0]}: a seed must be between 0 and {MAX_SEED}")
    if options.jobs > 1 and world_size() > 1:
        raise ValueError("--jobs runs several CPU processes; under `accelerate launch` each run already uses "
                         "every process: leave --jobs at 1")
    if options.push_to_hub and not options.save_models:
        raise ValueError("--push_to_hub uploads the models that --save_models keeps: add --save_models")
    if options.push_to_hub and not options.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id ORG/NAME (each norm's model goes to ORG/NAME-<norm>)")
    if options.convert_modules is not None:
        try:
            re.compile(options.convert_modules)
        except re.error as error:
            raise ValueError(f"--convert_modules {options.convert_modules!r} is not a regular expression ({error})") \
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
            raise ValueError(f"--{name} {value!r}: expected one of {list(valid)}")


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

    fitting: dict[str, list[str]] = {}
    for name in task_names():
        for column in get_task(name).column_options:
            fitting.setdefault(column, []).append(name)
    for name, tasks in fitting.items():
        if getattr(options, name) is not None and name not in task.column_options:
            raise ValueError(f"--{name} is for --task {' or '.join(tasks)}, not {task.name}")
    if (options.source_column is None) != (options.target_column is None):
        raise ValueError("--source_column and --target_column go together: give both, or neither to read the "
                         "'translation' column")
    named = [getattr(options, name) for name in fitting if getattr(options, name) is not None]
    if named and options.embedded_default:
        raise ValueError("the column options name columns of your data: give it with --train_file or "
                         "--dataset_name")
    if named and options.train_file is None and options.dataset_name is None:
        raise ValueError("the column options need data: give --train_file or --dataset_name")


def _check_text_files(options: CompareOptions, task: type) -> None:
    """A data file that is not text (a NUL byte in its first 8 KiB) is refused here, not deep in `datasets`."""
    for name in task.input_path_options:
        path = getattr(options, name, None)
        if path and Path(path).is_file():
            with open(path, "rb") as handle:
                if b"\0" in handle.read(8192):
                    raise ValueError(f"--{name} {path} is not a text file (it holds NUL bytes); give a .txt, "
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
        raise ValueError(f"--norms is empty: give the norms to compare, e.g. --norms layernorm powernorm; "
                         f"valid: {sorted(NORM_CLASSES)}")
    norms = []
    for name in names:
        try:
            norms.append(normalize_norm_name(name))
        except ValueError as error:
            raise ValueError(f"--norms: {error}") from None
    if norms.count(BASELINE) == 2:  # the A/A run: the baseline's second arm has a name of its own
        norms[norms.index(BASELINE, norms.index(BASELINE) + 1)] = BASELINE_AGAIN
    if len(set(norms)) != len(norms):
        raise ValueError(f"--norms names a norm twice: {names} (only '{BASELINE}', twice, for the A/A run)")
    return norms


def world_size() -> int:
    """The processes of an `accelerate launch` (1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
