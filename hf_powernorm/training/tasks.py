"""The tasks of the training library, their registry, and the body the training recipes share.

`TASK_REGISTRY` maps a task's name to its `Task` class, as fairseq's `TASK_REGISTRY` does:
`register_task("causal-lm")` adds one, `get_task(name)` finds it. A task (`language_modeling.py`,
`translation.py`, `classification.py`) owns its data (files, local folders, Hub ids, the embedded
corpus: `read_splits`), its tokenisation (`tokenize`), its model classes (its PowerNorm head and the
Auto class of a pretrained Transformers model), its loss and scorer (`loss`, `evaluate`), its metric
and direction, and the options that name its input files (`input_path_options`). The recipes, the
studies and `hf-powernorm compare` all run through it. Each task reads as its differences, in the
manner of Accelerate's `examples/by_feature` and Transformers' `run_*_no_trainer.py` kept short: its
arguments, its data, its head and default size, its metric. `run_task` does what every task does the
same way: the accelerator, the output folder (held by one run at a time: `locking.py`) and the run's
start (`build_accelerator`, `prepare_output_dir`, `start_run`), the model (`build_model`: new,
loaded or converted), training with early stopping on the task's validation metric (`fit`), the
scores of every evaluation split, and the export with its model card (`save_outputs`). `run_script`
runs a recipe's `main` as a command: a bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from .arguments import DATA_FILE_OPTIONS
from .atomic_files import DiskFullError, clear_folder
from .batching import PaddingCollator
from .evaluation import score_splits
from .export import save_outputs, training_command
from .losses import model_loss
from .loop import (
    LossFn,
    build_accelerator,
    fit,
    log_run_start,
    prepare_eval_loaders,
    prepare_output_dir,
    start_run,
)
from .locking import LOCK_NAME, FolderInUse, hold_output_folder
from .models import build_model, check_config_options, model_tokenizer_path, resolve_model_path
from .tokenization import load_tokenizer, prepare_tokenizer

# What a command reports as a bad input, in one line: its options, its data, its output folder, its disk.
BAD_INPUT = (ValueError, FileNotFoundError, FolderInUse, DiskFullError)


class Task:
    """One task. A subclass sets the class attributes and writes `read_splits`, `tokenize`, `evaluate`
    and `summary`; the other methods are what most tasks do, for a subclass to change where it differs."""

    name: str  # its key in `TASK_REGISTRY` (set by `register_task`)
    script: str  # the recipe's path in the repository ("recipes/train_lm.py"): run name, card command
    model_class: type[torch.nn.Module]  # the PowerNorm Transformer head it trains
    auto_class: type | None = None  # the Auto class a converted model loads with; None: no --convert_norms
    default_size: dict[str, Any] = {}  # the config of a new model where no preset or config is given
    metric: str  # the validation score that picks the best model and stops training
    mode: str = "max"  # "max": a higher `metric` is better; "min": a lower one
    length_columns: tuple[str, ...] = ("input_ids",)  # what the token budget of a training batch counts
    corpus: str  # the training data without data options (the embedded corpus), for the card
    description: str  # the card's description: `{data}` stands for the training data, `{option}` for --option
    input_path_options: tuple[str, ...] = DATA_FILE_OPTIONS  # the options that name its data files
    pretrained_auto_class: str  # the Transformers Auto class of a pretrained model of the task (by name)
    needed_columns: str  # the columns its data must hold, in words
    column_options: tuple[str, ...] = ()  # the options naming the user's columns that the task reads
    length_option: str = "max_length"  # the option that caps a sequence's tokens
    length_cap: int = 128  # the cap when neither the option nor the model says less
    own_options: tuple[str, ...] = ()  # the options no other task reads (`--block_size`, `--num_beams`, ...)
    decoder_batches: bool = True  # PN's batch statistics mix a decoder's positions: no PN warmup by default
    write_predictions: bool = True  # `evaluate` writes the test split's outputs into `--output_dir`
    # A trained tokenizer appends `</s>` to what it encodes (BART's and Marian's do, for a source or a
    # sentence to classify); a language model's leaves a prompt open (GPT-2's and Llama's).
    tokenizer_appends_eos: bool = True

    build_parser: Callable[[], argparse.ArgumentParser]  # the recipe's command line
    check_options: Callable[[argparse.Namespace], argparse.Namespace]  # its checks, after parsing

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer: Any = None
        self.command_line: list[str] | None = None  # the options as typed, for the model card

    @classmethod
    def from_options(cls, **options: Any) -> Task:
        """The task over the recipe's defaults with `options` (by the options' names, valued as the
        parser gives them: `learning_rate=3e-3`, `checkpointing_steps="500"`), checked as its command
        line is: a call of the task from code instead of a command line built for it."""
        parser = cls.build_parser()
        args = parser.parse_args([])
        actions = {action.dest: action for action in parser._actions if action.dest != "help"}
        unknown = sorted(set(options) - set(actions))
        if unknown:
            raise TypeError(f"{cls.__name__}.from_options: unknown options {unknown}; valid: {sorted(actions)}")
        for name, value in options.items():
            setattr(args, name, _parsed(actions[name], value))
        task = cls(cls.check_options(args))
        task.command_line = option_words(options)
        return task

    def load_data(self, accelerator: Accelerator) -> dict[str, Any]:
        """The tokenized splits ("train", "validation", "test" where present); sets `self.tokenizer`."""
        raise NotImplementedError

    def read_splits(self, seed: int) -> Any:
        """The raw splits (a `DatasetDict`) of the data options: `--dataset_name` (a Hub id or a local
        folder), the data files, else the embedded corpus; `seed` carves missing splits where the
        task's reader does."""
        raise NotImplementedError

    def tokenize(self, raw: Any, tokenizer: Any) -> Any:
        """The cached `Dataset.map` passes that turn `raw` into the model's inputs."""
        raise NotImplementedError

    def keep_split_facts(self, raw: Any) -> None:
        """Keep what the scores need from the raw splits besides the tokens (the words of a split)."""

    def check_model_options(self, model_size: dict[str, Any]) -> None:
        """The model's options checked as the config of a new model of `model_size` would take them
        (`check_config_options`), before anything is written."""
        check_config_options(self.args, model_size, self.max_length(), **self.model_fields())

    def resolve_labels(self) -> None:
        """Settle the options that depend on the data before it is tokenized (the class names)."""

    def pretrained_fields(self) -> dict[str, Any]:
        """Fields that a pretrained model's `from_pretrained` takes for this task (its classes)."""
        return {}

    def check_pretrained(self, model: torch.nn.Module, config: Any) -> None:
        """A ValueError when a pretrained model of the task's Auto class cannot do the task."""

    def samples(self, accelerator: Accelerator, model: torch.nn.Module, raw: Any, data: Any,
                collate: PaddingCollator) -> list[dict[str, str]]:
        """A few outputs of the model beside their references, for a report; none by default."""
        return []

    @classmethod
    def auto_model_class(cls) -> type:
        """The Auto class of `pretrained_auto_class`."""
        import transformers

        return getattr(transformers, cls.pretrained_auto_class)

    def tokenize_options(self) -> dict[str, Any]:
        return {"num_proc": self.args.preprocessing_num_workers, "overwrite_cache": self.args.overwrite_cache}

    def prepare_tokenizer(self, accelerator: Accelerator, texts: Callable[[], Iterable[str]]) -> None:
        """`self.tokenizer`: `--tokenizer_name`, the model's, or a BPE trained on `texts()`."""
        self.tokenizer = prepare_tokenizer(model_tokenizer_path(self.args), self.args.output_dir,
                                           self.args.vocab_size, accelerator, texts,
                                           model_max_length=self.max_length(),
                                           append_eos=self.tokenizer_appends_eos)

    def evaluate(self, accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader,
                 split: str) -> dict[str, Any]:
        """The scores of one split (`metric` among them)."""
        raise NotImplementedError

    def summary(self, results: dict[str, Any], split: str) -> str:
        """One line of a split's scores in `results` (keys prefixed by the split's name)."""
        raise NotImplementedError

    def describe(self, data: dict[str, Any]) -> str:
        """The training data in a few words, for the log."""
        return f"{len(data.get('train', []))} training examples"

    def model_fields(self) -> dict[str, Any]:
        """Config fields of the model from the command line (`--norm_type` in the encoder)."""
        return {"encoder_norm_type": self.args.norm_type} if self.args.norm_type else {}

    def max_length(self) -> int:
        """The longest sequence the model must take (its position table)."""
        return self.args.max_length

    def train_collate(self) -> PaddingCollator:
        return PaddingCollator(self.tokenizer.pad_token_id)

    def loss(self, accelerator: Accelerator) -> LossFn:
        return model_loss

    def training_data(self) -> str:
        return self.args.dataset_name or self.args.train_file or self.corpus

    def card_kwargs(self, argv: list[str] | None) -> dict[str, Any]:
        """What `render_model_card` takes from the run besides the model and its scores."""
        return {"repo_id": self.args.hub_model_id or Path(self.args.output_dir).resolve().name, "language": "en",
                "datasets": self.args.dataset_name,
                "training_command": training_command(self.script, self.command_line if argv is None else argv),
                "description": self.description.format(data=self.training_data(), **vars(self.args))}


def option_words(options: dict[str, Any]) -> list[str]:
    """`options` as they would be typed on a command line (a flag for a boolean)."""
    words: list[str] = []
    for name, value in options.items():
        words += [f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else [f"--{name}", str(value)]
    return words


def _parsed(action: argparse.Action, value: Any) -> Any:
    """`value` as the parser gives the option of `action` when the value is typed: a float option
    given 1 holds 1.0, an untyped one given 500 holds "500"."""
    if value is None or isinstance(value, bool) or not action.option_strings:
        return value
    return action.type(str(value)) if action.type is not None else str(value)


TASK_REGISTRY: dict[str, type[Task]] = {}
# The modules whose tasks `get_task` registers on first use.
BUILTIN_TASK_MODULES = ("language_modeling", "translation", "classification")


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """A class decorator adding a `Task` subclass to `TASK_REGISTRY` under `name`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a task name must be a non-empty string; got {name!r}")

    def register(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"register_task({name!r}) takes a Task subclass; got {cls!r}")
        if TASK_REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"task {name!r} is already registered as {TASK_REGISTRY[name].__name__}")
        cls.name = name
        TASK_REGISTRY[name] = cls
        return cls

    return register


def task_names() -> list[str]:
    """The registered task names, sorted (the built-in tasks registered first)."""
    for module in BUILTIN_TASK_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return sorted(TASK_REGISTRY)


def get_task(name: str) -> type[Task]:
    """The `Task` class registered as `name`; a ValueError naming the valid names otherwise."""
    names = task_names()
    if not isinstance(name, str):
        raise TypeError(f"a task name is a string, one of {names}; got {type(name).__name__} {name!r}")
    if name not in TASK_REGISTRY:
        raise ValueError(f"unknown task {name!r}; valid tasks: {names}")
    return TASK_REGISTRY[name]


def run_task(task: Task, argv: list[str] | None = None) -> dict[str, Any]:
    """Data -> model -> train (`--do_train`) -> score every evaluation split -> export. Returns the
    results: the training summary and each split's scores, keys prefixed by the split's name.

    The checks that need no data run first; then the output folder is held (`hold_output_folder`,
    by the main process) for the whole run, and a bad input found while the data is read and the
    model built removes what the run wrote there, so that the corrected command starts afresh."""
    args = task.args
    task.check_model_options(task.default_size)
    if args.model_name_or_path:  # a Hub repository becomes its local snapshot
        args.model_name_or_path = resolve_model_path(args.model_name_or_path)
    accelerator = build_accelerator(args)
    with hold_output_folder(args.output_dir, enabled=accelerator.is_main_process):
        fresh = prepare_output_dir(accelerator, args, task.input_path_options)
        start_run(accelerator, args, Path(task.script).stem)
        with _cleared_on_bad_input(accelerator, args.output_dir, enabled=fresh):
            data = task.load_data(accelerator)
            model = build_model(args, task.model_class, task.tokenizer, accelerator.num_processes, task.default_size,
                                task.max_length(), auto_class=task.auto_class,
                                calibration=(data["train"], task.train_collate()) if "train" in data else None,
                                **task.model_fields())
        return _train_score_export(task, accelerator, data, model, argv)


def _train_score_export(task: Task, accelerator: Accelerator, data: dict[str, Any], model: torch.nn.Module,
                        argv: list[str] | None) -> dict[str, Any]:
    """`run_task` once the data and the model are there."""
    args = task.args
    log_run_start(accelerator, args, model, f"{task.describe(data)}, vocabulary {len(task.tokenizer)}")
    evals = prepare_eval_loaders(accelerator, data, PaddingCollator(task.tokenizer.pad_token_id),
                                 args.eval_batch_size)
    results: dict[str, Any] = {}
    if args.do_train:
        validate = (lambda m: task.evaluate(accelerator, m, evals["validation"], "validation")[task.metric]) \
            if "validation" in evals else None
        model, results = fit(args, accelerator, model, data["train"], task.train_collate(), task.loss(accelerator),
                             tokenizer=task.tokenizer, mode=task.mode, validate=validate,
                             length_columns=task.length_columns)
    else:
        model = accelerator.prepare(model)
    results.update(score_splits(lambda split, loader: task.evaluate(accelerator, model, loader, split), evals))
    for split in evals:
        accelerator.print(f"{split}: {task.summary(results, split)}")
    save_outputs(accelerator, model, task.tokenizer, args, results, task.card_kwargs(argv))
    return results


@contextlib.contextmanager
def _cleared_on_bad_input(accelerator: Accelerator, output_dir: str, enabled: bool) -> Iterator[None]:
    """A bad input (`BAD_INPUT`) raised in the body empties `output_dir` (its lock kept) when the run
    started it empty: a refused start leaves nothing that would refuse the corrected one."""
    try:
        yield
    except BAD_INPUT:
        if enabled and accelerator.is_main_process and Path(output_dir).is_dir():
            clear_folder(output_dir, keep=(LOCK_NAME,))
        raise


def run_script(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> None:
    """A recipe's `main(argv)` as a command: a bad input (`BAD_INPUT`: a ValueError, a missing file,
    an output folder in use, a full disk) is one line `<script>: error: <message>` on stderr and exit
    status 2, as `hf-powernorm compare` reports it; any other error keeps its traceback."""
    try:
        main(argv)
    except BAD_INPUT as error:
        one_line = " ".join(str(error).split())  # a library's message may span lines
        print(f"{Path(sys.argv[0]).name}: error: {one_line}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def train_and_score(task: Task, model_size: dict[str, Any], *,
                    eval_batch_size: int = 32) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The run body without an export, for the studies: the task's data tokenized with the saved
    tokenizer of `--tokenizer_name`, a new `task.model_class` of `model_size` (the command line's
    norms), training with early stopping on the task's validation metric (`fit`), and the scores of
    every evaluation split. Returns the trained model (unwrapped, in eval mode), for measures taken
    on it, and the results: the training summary and each split's scores."""
    args = task.args
    task.check_model_options(model_size)
    accelerator = build_accelerator(args)
    with hold_output_folder(args.output_dir, enabled=accelerator.is_main_process):
        prepare_output_dir(accelerator, args, task.input_path_options)
        task.tokenizer = load_tokenizer(args.tokenizer_name)
        raw = task.read_splits(args.seed)
        data = task.tokenize(raw, task.tokenizer)
        task.keep_split_facts(raw)
        model = build_model(args, task.model_class, task.tokenizer, accelerator.num_processes, model_size,
                            task.max_length(), **task.model_fields())
        return _fit_and_score(task, accelerator, model, data, eval_batch_size)


def _fit_and_score(task: Task, accelerator: Accelerator, model: torch.nn.Module, data: dict[str, Any],
                   eval_batch_size: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """`train_and_score` once the data and the model are there."""
    evals = prepare_eval_loaders(accelerator, data, task.train_collate(), eval_batch_size)
    model, summary, scores = fit_and_score(task, accelerator, model, data, evals)
    accelerator.end_training()
    return accelerator.unwrap_model(model).eval(), {**summary, **scores}


def fit_and_score(task: Task, accelerator: Accelerator, model: torch.nn.Module, data: dict[str, Any],
                  evals: dict[str, DataLoader], loss: LossFn | None = None
                  ) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """The part of the run body that the studies (`train_and_score`) and `hf-powernorm compare` share:
    training on `data["train"]` with early stopping on the task's validation metric (`fit`, with
    `loss`, the task's by default), then the scores of every split of `evals`. Returns the model,
    the training summary and the scores (keys prefixed by the split's name)."""
    validate = lambda m: task.evaluate(accelerator, m, evals["validation"], "validation")[task.metric]  # noqa: E731
    model, summary = fit(task.args, accelerator, model, data["train"], task.train_collate(),
                         loss or task.loss(accelerator), tokenizer=task.tokenizer, mode=task.mode, validate=validate,
                         length_columns=task.length_columns)
    scores = score_splits(lambda split, loader: task.evaluate(accelerator, model, loader, split), evals)
    return model, summary, scores


__all__ = ["BAD_INPUT", "TASK_REGISTRY", "Task", "fit_and_score", "get_task", "option_words", "register_task", "run_script",
           "run_task", "task_names", "train_and_score"]
