"""Does Power Normalization help my model? One command that answers it on the user's model and data.

For each norm of `--norms` and each seed of `--seeds`, the model of `--model_name_or_path` (a Hub id
or a folder) has its norms converted by `convert_norms` (`layernorm`: the model's own norms,
unchanged, named by their class in the report; a model loaded from weights is converted keeping its
function unless `--no_preserve_function`; `--convert_modules` selects the norms), is fine-tuned by
the training library's `fit` at equal settings (with `--tune_lr`, each norm's learning rate is
chosen on validation from `--lr_grid`, with the first seed), and is scored on validation before
and after fine-tuning and on test. The runs form a resumable grid (`training/grid.py`): a finished
run is not redone unless its fingerprint (model, tokenizer, the data's contents, settings) changed,
`--jobs N` runs N at once on CPU, and under `accelerate launch` every run uses all the processes.
Writes into `--output_dir`:

- `results.csv`: one row per run and evaluated split, with its time;
- `report.md`: mean ± standard deviation over the seeds per norm, the checks that withhold a
  verdict (degenerate scores, a best model at the last update, no better than before
  fine-tuning), the verdict of each norm against the first from the paired test differences over
  the seeds (a 95% t interval, Holm over the comparisons; none for a norm that computes the same
  function as the first, within a relative 1e-6), seq2seq sample outputs, the settings;
- `validation_curves.png`: training loss and validation score against updates (log axis for
  losses and perplexity), the mean over seeds with markers and the seeds' range as a band;
- with `--save_models`, `models/<norm>`: each norm's best model (and `--push_to_hub` uploads it).

Bad input stops with one line before anything is written; the output folder is held by one
process at a time (a second start on it stops, naming the first); Ctrl-C writes the report of the
runs finished so far, and the same command resumes (with `--checkpoint_runs`, a run cut short goes
on from its last validation instead of starting again). Data comes as the recipes take it:
`--dataset_name` (a Hub id, a local folder of files or of `save_to_disk`) or
`--train_file/--validation_file/--test_file`, with `--text_column` etc. naming other columns,
tokenized by cached `Dataset.map` passes. Without a model and data, a tiny GPT-2 trains on the
embedded English corpus (under two minutes on 2 CPU cores). A model that brings its own code runs
only with `--trust_remote_code`.

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
