"""The language-model runs the studies share: their data options and split files (PTB's, the
user's files or a `datasets.load_dataset` corpus, or the embedded corpus at smoke size), the BPE
and token blocks prepared once per study, and one run of the training library's `causal-lm` task
(the recipes' own argument parser, `train_and_score`), returning the trained model with its scores.
Last, what the studies of a few named settings share (`long_run`, `pn_ablation`, `warmup_switch`,
each training the LM under every setting for every seed): their command line, cells, one run of a
cell and summary table; such a study keeps its settings, their flags, its measures and columns."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..training.arguments import add_recipe_args, check_args
from ..training.corpora import synthetic_lm_corpus
from ..training.executors import add_executor_args, executor_settings
from ..training.grid import Cell, run_grid
from ..training.options import BadInput, MissingInput
from ..training.readers import data_files_from_args, load_lm_dataset, split_train
from ..training.tasks import get_task, train_and_score
from ..training.tokenization import column_texts, lm_blocks, load_tokenizer, tokenize_lines, train_bpe_tokenizer

PTB_SPLITS = (("train", "train"), ("validation", "valid"), ("test", "test"))


# What a study without data options says it needs.
DATA_OPTIONS = ("--data_dir (a folder holding ptb/ptb.{train,valid,test}.txt), --train_file/--validation_file/"
                "--test_file (plain text, one line a row), or --dataset_name (a Hub id, or a local folder or file "
                "that datasets.load_dataset reads)")


def study_output_dir(args: argparse.Namespace) -> Path:
    """`--output_dir` as a Path, refused in one line where it is a file. Not created here: a study
    creates it once its inputs are found, so that an input it refuses leaves no empty folder behind."""
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise BadInput(f"--output_dir {output_dir} is a file, not a folder")
    return output_dir


def lm_split_files(data_dir: str | Path | None, output_dir: str | Path, smoke: bool, *,
                   data_files: dict[str, str] | None = None, dataset_name: str | None = None,
                   dataset_config: str | None = None) -> dict[str, str]:
    """The text file of each split (train, validation, test): `data_files` as given, the splits of
    `dataset_name` written once into `output_dir` (validation and test carved out of train where
    missing), PTB's `ptb.{train,valid,test}.txt` under `data_dir`, or with `smoke` and no data
    the embedded corpus written once into `output_dir`. Without any, a ValueError names the options;
    a missing PTB raises `FileNotFoundError` naming the folder."""
    if data_files:
        missing = [f"--{split}_file" for split in ("train", "validation", "test") if split not in data_files]
        if missing:
            raise BadInput(f"a study trains on train and scores validation and test: also pass {', '.join(missing)}")
        return {split: str(Path(path).resolve()) for split, path in data_files.items()}
    if dataset_name:
        return _dataset_split_files(dataset_name, dataset_config, Path(output_dir))
    if data_dir is None and not smoke:
        raise BadInput(f"no data: pass {DATA_OPTIONS}; or --smoke for the embedded corpus at tiny sizes")
    if not smoke:
        folder = Path(data_dir).resolve() / "ptb"
        if not (folder / "ptb.train.txt").is_file():
            raise MissingInput(f"--data_dir {data_dir}: no ptb/ptb.train.txt there (or pass --train_file/"
                               f"--validation_file/--test_file or --dataset_name; --smoke runs on the embedded "
                               f"corpus)")
        return {split: str(folder / f"ptb.{name}.txt") for split, name in PTB_SPLITS}
    return _write_split_files(synthetic_lm_corpus({"train": 200, "validation": 30, "test": 30}, seed=3),
                              Path(output_dir), "smoke")


def _dataset_split_files(name: str, config: str | None, output_dir: Path) -> dict[str, str]:
    """`datasets.load_dataset(name, config)`'s text splits as files in `output_dir` (once)."""
    files = {split: output_dir / f"dataset.{split}.txt" for split, _ in PTB_SPLITS}
    if all(path.is_file() for path in files.values()):
        return {split: str(path) for split, path in files.items()}
    return _write_split_files(split_train(load_lm_dataset(dataset_name=name, dataset_config=config), seed=0),
                              output_dir, "dataset")


def _write_split_files(corpus: Any, output_dir: Path, prefix: str) -> dict[str, str]:
    """Each split's `text` column as `output_dir/{prefix}.{split}.txt`, one row a line (once)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, part in corpus.items():
        files[split] = str(output_dir / f"{prefix}.{split}.txt")
        if not Path(files[split]).is_file():
            with open(files[split], "w", encoding="utf-8") as handle:
                handle.writelines(line + "\n" for line in column_texts(part))
    return files


def study_data_files(args: argparse.Namespace, output_dir: str | Path) -> dict[str, str]:
    """`lm_split_files` from a study's data options (`add_study_data_args`)."""
    return lm_split_files(args.data_dir, output_dir, args.smoke,
                          data_files=data_files_from_args(args.train_file, args.validation_file, args.test_file),
                          dataset_name=args.dataset_name, dataset_config=args.dataset_config)


def prepare_lm_data(files: dict[str, str], output_dir: str | Path, vocab_size: int, block_size: int) -> str:
    """Train the BPE once into `output_dir/tokenizer` and fill the datasets cache with the token
    blocks, so that the runs (in other processes) only read them. Returns the tokenizer folder."""
    tokenizer_dir = Path(output_dir) / "tokenizer"
    raw = load_lm_dataset(data_files=files)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_bpe_tokenizer(column_texts(raw["train"]), vocab_size).save_pretrained(tokenizer_dir)
    lm_blocks(tokenize_lines(raw, load_tokenizer(tokenizer_dir)), block_size)
    return str(tokenizer_dir)


def budget_argv(seed: int, sizes: dict[str, Any]) -> list[str]:
    """The flags every run of a study shares, from a sizes dict with `max_tokens`, `learning_rate`,
    `warmup_steps`, `max_train_steps`, `eval_steps` (and optionally `gradient_accumulation_steps`)."""
    argv = ["--seed", str(seed), "--max_tokens", str(sizes["max_tokens"]),
            "--learning_rate", str(sizes["learning_rate"]), "--num_warmup_steps", str(sizes["warmup_steps"]),
            "--max_train_steps", str(sizes["max_train_steps"]), "--eval_steps", str(sizes["eval_steps"])]
    if sizes.get("gradient_accumulation_steps", 1) != 1:
        argv += ["--gradient_accumulation_steps", str(sizes["gradient_accumulation_steps"])]
    return argv


def lm_run_args(folder: str | Path, tokenizer: str, argv: Sequence[str]) -> argparse.Namespace:
    """The options of one run, through the recipes' parser and checks (`argv` as on a command line)."""
    args = add_recipe_args(argparse.ArgumentParser()).parse_args(
        ["--output_dir", str(folder), "--tokenizer_name", tokenizer, *argv])
    check_args(args)
    return args


def train_study_lm(folder: str | Path, tokenizer: str, argv: Sequence[str], files: dict[str, str], block_size: int,
                   model_size: dict[str, Any], *,
                   label_smoothing: float = 0.0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """One run of the `causal-lm` task in `folder`: `PowerNormTransformerForCausalLM` of `model_size`
    with `--norm_type` of `argv` at every norm position, on `files`' blocks of `block_size` tokens
    (label-smoothed next-token loss with `label_smoothing`). Returns the model (unwrapped, in eval
    mode) and its training summary with validation and test loss and perplexity (per BPE token, and
    per word; unsmoothed)."""
    args = lm_run_args(folder, tokenizer, argv)
    args.train_file, args.validation_file, args.test_file = (files.get(split) for split, _ in PTB_SPLITS)
    args.block_size, args.label_smoothing = block_size, label_smoothing
    model, results = train_and_score(get_task("causal-lm")(args), model_size)
    return model, {k: v for k, v in results.items()
                   if not k.startswith(("validation_", "test_")) or k.endswith(("perplexity", "loss"))}


# The studies' language model: `lm-small`'s layout (pre-norm decoder, learned positions) at a size
# that 2 CPU cores train in minutes; `--hidden_size` and `--layers` scale it on a GPU.
STUDY_LM = {"hidden_size": 128, "intermediate_size": 512, "decoder_layers": 2, "num_attention_heads": 4,
            "encoder_layers": 0, "is_encoder_decoder": False, "position_embedding_type": "learned",
            "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}


def add_lm_size_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--hidden_size` (heads of 32 channels, feed-forward 4x) and `--layers` of the studies' LM."""
    parser.add_argument("--hidden_size", type=int, default=STUDY_LM["hidden_size"],
                        help="width of the LM (a multiple of 32: one attention head per 32 channels)")
    parser.add_argument("--layers", type=int, default=STUDY_LM["decoder_layers"], help="decoder layers of the LM")
    return parser


def lm_size(args: argparse.Namespace) -> dict[str, Any]:
    """The studies' LM at `args.hidden_size` and `args.layers` (checked here, at the boundary)."""
    if args.hidden_size < 32 or args.hidden_size % 32:
        raise BadInput(f"--hidden_size must be a positive multiple of 32; got {args.hidden_size}")
    if args.layers < 1:
        raise BadInput(f"--layers must be at least 1; got {args.layers}")
    return {**STUDY_LM, "hidden_size": args.hidden_size, "intermediate_size": 4 * args.hidden_size,
            "num_attention_heads": args.hidden_size // 32, "decoder_layers": args.layers}


def add_study_data_args(parser: argparse.ArgumentParser, data_dir_holds: str) -> argparse.ArgumentParser:
    """The data options of a study: `--data_dir` (no default: a study without data runs only with
    `--smoke`), and the recipes' `--train_file/--validation_file/--test_file` and
    `--dataset_name/--dataset_config_name` (read by `datasets.load_dataset`, a local folder too)."""
    data = parser.add_argument_group("data (one of them; none with --smoke: the embedded corpus)")
    data.add_argument("--data_dir", help=f"a folder holding {data_dir_holds}")
    data.add_argument("--train_file", help="the training split's file (instead of --data_dir)")
    data.add_argument("--validation_file")
    data.add_argument("--test_file")
    data.add_argument("--dataset_name", help="a Hub dataset id, or a local folder or file for datasets.load_dataset")
    data.add_argument("--dataset_config_name", "--dataset_config", dest="dataset_config",
                      help="the dataset's configuration")
    return parser


def add_study_args(parser: argparse.ArgumentParser, sizes: dict[str, dict[str, Any]], output_dir: str,
                   seeds: Sequence[int]) -> argparse.ArgumentParser:
    """The options every LM study shares: the data (`add_study_data_args`), `--output_dir`, `--seeds`, where the
    runs go (`--jobs`, `--executor` and its options: `training.executors.add_executor_args`), `--smoke`,
    `--report_only`, the LM's size, and one flag per entry of `sizes["real"]` (default from `sizes["smoke"]` with
    `--smoke`; `fill_sizes` sets them after parsing)."""
    add_study_data_args(parser, "ptb/ptb.{train,valid,test}.txt")
    parser.add_argument("--output_dir", default=output_dir)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    add_executor_args(parser)
    parser.add_argument("--smoke", action="store_true", help="the embedded corpus at tiny sizes (seconds)")
    parser.add_argument("--report_only", action="store_true",
                        help="write the outputs from the runs finished so far, and run nothing")
    for name, value in sizes["real"].items():
        smoke = sizes["smoke"][name]
        parser.add_argument(f"--{name}", type=type(value), help=f"default {value} ({smoke} with --smoke)")
    return add_lm_size_args(parser)


def fill_sizes(args: argparse.Namespace, sizes: dict[str, dict[str, Any]]) -> argparse.Namespace:
    """Give every size flag left unset its real (or `--smoke`) default."""
    for name, value in sizes["smoke" if args.smoke else "real"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def run_study(args: argparse.Namespace, prepare: Callable[[argparse.Namespace, Path], Any],
              make_cells: Callable[[argparse.Namespace, Any], list], run_cell: Callable[..., dict],
              write_results: Callable[..., None], desc: str) -> list[dict[str, Any]]:
    """A study's `main` after parsing: its inputs found and prepared once (`prepare(args, output_dir)`,
    before --output_dir is created, so that an input refused leaves nothing behind), `make_cells(args,
    inputs)` run by `run_grid` where `--executor` says, `write_results(results, args, output_dir)`, and
    the summary printed. With `args.report_only` nothing runs and the results are those of the
    finished cells. Returns the results in cell order."""
    executor = executor_settings(args)  # checked before anything is written
    output_dir = study_output_dir(args)
    inputs = prepare(args, output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = run_grid(make_cells(args, inputs), run_cell, output_dir, desc=desc, report_only=args.report_only,
                       executor=executor)
    write_results(results, args, output_dir)
    print((output_dir / "summary.md").read_text(encoding="utf-8"))
    return results


def run_lm_study(args: argparse.Namespace, make_cells: Callable[..., list], run_cell: Callable[..., dict],
                 write_results: Callable[..., None], desc: str) -> list[dict[str, Any]]:
    """`run_study` on PTB's files (or the user's, or the embedded corpus) and their BPE, prepared once:
    `make_cells(args, files, tokenizer)`."""
    def prepare(args: argparse.Namespace, output_dir: Path) -> tuple[dict[str, str], str]:
        files = study_data_files(args, output_dir)
        return files, prepare_lm_data(files, output_dir, args.vocab_size, args.block_size)

    return run_study(args, prepare, lambda args, inputs: make_cells(args, *inputs), run_cell, write_results, desc)


# The studies of a few named settings, each run for every seed (`long_run`, `pn_ablation`,
# `warmup_switch`). What every run of them adds to its budget's flags: gradient clipping and weight decay.
SHARED_FLAGS = ("--clip_norm", "0.25", "--weight_decay", "0.01")
# A cell's options that say where its data is and how large its LM is, not what the study varies.
CELL_INPUTS = ("files", "tokenizer", "model_size")


def parse_setting_args(argv: list[str] | None, doc: str, sizes: dict[str, dict[str, Any]], settings: Iterable[str],
                       output_dir: str, seeds: Sequence[int],
                       add_args: Callable[[argparse.ArgumentParser], Any] | None = None) -> argparse.Namespace:
    """A study's options: `add_study_args` (with `sizes`, and `output_dir` and `seeds` as defaults),
    `--settings` (any of `settings`, all by default) and what `add_args(parser)` adds; the first
    paragraph of `doc` describes the command. Size flags left unset get their defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_study_args(parser, sizes, output_dir, seeds=seeds)
    parser.add_argument("--settings", nargs="+", default=list(settings), choices=list(settings))
    if add_args is not None:
        add_args(parser)
    return fill_sizes(parser.parse_args(argv), sizes)


def size_values(args: argparse.Namespace, sizes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The value in `args` of each size flag of `sizes`."""
    return {name: getattr(args, name) for name in sizes["real"]}


def setting_cells(args: argparse.Namespace, files: dict[str, str], tokenizer: str, sizes: dict[str, dict[str, Any]],
                  runs: Iterable[tuple[str, dict[str, Any]]]) -> list[Cell]:
    """One cell per `(name, options)` of `runs`, in their order: its options, the data (`files`,
    `tokenizer`), the LM's size (`lm_size(args)`) and the values of the size flags."""
    inputs = {"files": files, "tokenizer": tokenizer, "model_size": lm_size(args)}
    return [Cell(name, {**options, **inputs, **size_values(args, sizes)}, paths=("files", "tokenizer"))
            for name, options in runs]


def train_setting(cell: Cell, folder: Path, flags: Sequence[str]) -> dict[str, Any]:
    """Train the run of `cell` in `folder`: the budget of its seed and sizes (`budget_argv`),
    `SHARED_FLAGS`, then `flags`. Returns its scores (`train_study_lm`)."""
    torch.set_num_threads(1)  # runs share the machine's cores (--jobs)
    options = cell.options
    argv = [*budget_argv(options["seed"], options), *SHARED_FLAGS, *flags]
    _, scores = train_study_lm(folder, options["tokenizer"], argv, options["files"], options["block_size"],
                               options["model_size"])
    return scores


def runs_by_setting(results: Sequence[dict[str, Any]], settings: Iterable[str]) -> list[tuple[str, list[dict]]]:
    """Each of `settings` that has runs among `results`, with those runs, in the order of `settings`."""
    groups = [(setting, [r for r in results if r["setting"] == setting]) for setting in settings]
    return [(setting, runs) for setting, runs in groups if runs]


def write_summary(output_dir: Path, args: argparse.Namespace, title: str, intro: str, header: Sequence[str],
                  align: str, rows: Iterable[Sequence[str]], after: Sequence[str] = ()) -> None:
    """`summary.md` in `output_dir`: the heading `title` (with the corpus), the paragraph `intro`, a
    table of `header` and `rows` (cells as text; `align` a letter a column, `l`eft or `r`ight),
    then the lines `after`."""
    if len(align) != len(header) or set(align) - set("lr"):
        raise ValueError(f"align must be one letter l or r per column of {list(header)}; got {align!r}")
    corpus = "embedded corpus, smoke sizes" if args.smoke else "PTB"
    lines = [f"# {title} ({corpus})", "", intro, "", _table_row(header),
             "|" + "".join("---:|" if side == "r" else "---|" for side in align), *map(_table_row, rows), *after]
    (output_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _table_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
