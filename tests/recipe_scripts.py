"""The recipe scripts as modules, loaded from their files (they are scripts, not a package), so
that tests call their `main(argv)` and `parse_args(argv)` in-process; and the small text files the
language-model tests train on."""

import importlib.util
from pathlib import Path
from types import ModuleType

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(name: str) -> ModuleType:
    """`recipes/<name>.py` (e.g. "train_lm") as a module `recipes_<name>`."""
    spec = importlib.util.spec_from_file_location(f"recipes_{name.replace('/', '_')}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_text_files(root: Path, sizes: dict[str, int], seed: int) -> list[str]:
    """The embedded English corpus at `sizes` (`seed`) as `root/<split>.txt`, one line a row;
    returns the recipe options that name them (`--train_file ...`)."""
    from hf_powernorm.training import synthetic_lm_corpus

    corpus = synthetic_lm_corpus(sizes, seed=seed)
    args = []
    for split in sizes:
        (root / f"{split}.txt").write_text("".join(line + "\n" for line in corpus[split]["text"]), encoding="utf-8")
        args += [f"--{split}_file", str(root / f"{split}.txt")]
    return args


average_checkpoints = load_recipe("average_checkpoints")
train_classification = load_recipe("train_classification")
train_lm = load_recipe("train_lm")
train_wmt = load_recipe("train_wmt")
