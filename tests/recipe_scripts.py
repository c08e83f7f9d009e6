"""The recipe scripts as modules, loaded from their files (they are scripts, not a package), so
that tests call their `main(argv)` and `parse_args(argv)` in-process."""

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


average_checkpoints = load_recipe("average_checkpoints")
train_classification = load_recipe("train_classification")
train_lm = load_recipe("train_lm")
train_wmt = load_recipe("train_wmt")
