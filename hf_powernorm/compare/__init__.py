"""Does Power Normalization help my model? `hf-powernorm compare` answers it on the user's model and
data: each norm of `--norms` converted into the model of `--model_name_or_path` by `convert_norms`,
fine-tuned by the training library's `fit` at equal settings over the seeds of `--seeds` (a
resumable grid of runs), and scored, with a paired verdict against the first norm. What it writes
and how it runs: `hf-powernorm compare --help` and docs/compare.md.

    hf-powernorm compare --model_name_or_path gpt2 --task causal-lm --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 --norms layernorm powernorm --seeds 1 2 3 \\
        --max_train_steps 1000 --output_dir outputs/compare-gpt2

The package: `options` (the typed options and their command line, which imports no torch),
`plan` (`compare.json`, the cells and the inputs' fingerprint), `runs` (the checks on the model and
data, the runs, the grid), `executors` (the runs as jobs of submitit or Ray) and `report` (results.csv,
report.md, the curves).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

# The names of the package, by the module that holds them: loaded on first use, so that the command
# line (`options`) parses, and prints its help, before torch is imported.
EXPORTS = {
    "options": ("BASELINE", "NOT_TAKEN", "CompareOptions", "build_parser", "check_norms", "library_args",
                "parse_args"),
    "plan": ("SETTINGS_NAME", "check_output_folder", "fingerprint", "make_cells", "redo_changed_runs", "run_args"),
    "report": ("SAME_FUNCTION_TOLERANCE", "baseline_name", "conversion_sentence", "plot_curves", "report_text",
               "result_rows", "run_flags", "same_function", "verdict", "write_outputs"),
    "executors": ("FailedRun", "RunsFailed", "submit_cells"),
    "runs": ("check_model", "embedded_model", "fit_lengths", "keep_best_models", "load_model_tokenizer", "load_raw_data", "model_facts",
             "prepare", "push_models", "resolve_label_names", "run_cell", "run_cells", "run_comparison",
             "run_cells_here", "run_job",
             "tokenize_data"),
}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`hf-powernorm compare`: parse and check the options, then run (or resume) the comparison and
    write its outputs; returns the rows of results.csv."""
    from .options import parse_args

    options = parse_args(argv)
    from .executors import RunsFailed
    from .runs import run_comparison

    try:
        return run_comparison(options)
    except RunsFailed as failed:  # the report names them; exit status 1
        print(f"hf-powernorm compare: {failed}", file=sys.stderr)
        raise SystemExit(1) from None


def __getattr__(name: str) -> Any:
    for module, names in EXPORTS.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["main", *(name for names in EXPORTS.values() for name in names)]
