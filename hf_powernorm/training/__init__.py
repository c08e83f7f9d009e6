"""The training library under the recipes, `hf-powernorm compare` and the studies: data readers,
embedded corpora, tokenization, batching, optimization, losses, the Accelerate loop, the task
registry and its tasks (`TASK_REGISTRY`, `get_task`; the modules `language_modeling`,
`translation`, `classification`) with the run bodies (`run_task`, `train_and_score`), checkpoints,
evaluation, metrics, the export, resumable grids of runs (`grid`) and report helpers (`reports`);
the studies built on it are `hf_powernorm.studies`. Never
copied next to a checkpoint: the model files import nothing from it.

    from hf_powernorm.training import load_lm_dataset, tokenize_lines, lm_blocks, train
"""

from __future__ import annotations

import importlib
from typing import Any

# The names of the package, by the module that holds them: loaded on first use, so that `options`
# (the commands' options) imports without torch.
EXPORTS = {
    "arguments": ("PN_OPTIONS", "add_recipe_args", "check_args", "check_batch_budget"),
    "averaging": ("average_state_dicts", "check_average_inputs", "select_checkpoints", "write_average"),
    "batching": ("IGNORE_INDEX", "PaddingCollator", "ShuffledBatchSampler", "TokenBudgetBatchSampler", "eval_loader",
                 "train_loader"),
    "checkpoints": ("BEST_MODEL_DIR", "MANIFEST_NAME", "TRAINING_STATE_NAME", "IncompleteCheckpointError",
                    "average_buffers_across_processes", "check_output_dir", "incomplete_checkpoints",
                    "latest_checkpoint", "list_checkpoints", "load_scheduler_state", "prune_checkpoints",
                    "read_manifest", "remove_checkpoints", "save_checkpoint", "scheduler_state", "write_manifest"),
    "corpora": ("SENTIMENT_LABELS", "synthetic_classification_corpus", "synthetic_lm_corpus",
                "synthetic_translation_corpus"),
    "evaluation": ("bleu_scores", "evaluate_accuracy", "evaluate_bleu", "evaluate_perplexity", "score_splits",
                   "translate"),
    "export": ("complete_average_export", "save_json", "save_outputs", "save_results", "training_command"),
    "losses": ("label_smoothed_loss", "model_loss", "sequence_nll", "token_nll", "translation_loss"),
    "loop": ("EarlyStopping", "check_run_start", "finish_training", "fit", "log_run_start", "make_accelerator",
             "max_update_steps", "prepare_eval_loaders", "start_run", "train"),
    "metrics": ("METRICS_DIR", "OncePerMessage", "count_words", "decode_for_bleu", "load_metric", "perplexity"),
    "models": ("build_config", "build_model", "model_tokenizer_path", "norm_types", "resolve_model_path"),
    "optimization": ("SCHEDULER_TYPES", "build_optimizer", "build_scheduler", "inverse_sqrt_schedule",
                     "parameter_groups"),
    "readers": ("data_files_from_args", "label_names_of", "limit_samples", "limit_splits",
                "load_classification_dataset", "load_hub_dataset", "load_lm_dataset", "load_translation_dataset",
                "read_lines", "read_phrasebank", "split_train"),
    "resuming": ("resolve_resume_path",),
    "run_log": ("RunLog", "read_run_log"),
    "tasks": ("TASK_REGISTRY", "Task", "get_task", "register_task", "run_task", "task_names", "train_and_score"),
    "tokenization": ("SPECIAL_TOKENS", "column_texts", "lm_blocks", "load_tokenizer", "pad_with_eos",
                     "prepare_tokenizer", "sequence_lengths", "tokenize_classification", "tokenize_lines",
                     "tokenize_translation", "train_bpe_tokenizer", "translation_texts"),
}


def __getattr__(name: str) -> Any:
    for module, names in EXPORTS.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [name for names in EXPORTS.values() for name in names]
