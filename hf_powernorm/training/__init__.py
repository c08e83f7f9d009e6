"""The training library under the recipes, `hf-powernorm compare` and the studies: data readers,
embedded corpora, tokenization, batching, optimization, losses, the Accelerate loop, the task
registry and its tasks (`TASK_REGISTRY`, `get_task`; the modules `language_modeling`,
`translation`, `classification`) with the run bodies (`run_task`, `train_and_score`), checkpoints,
evaluation, metrics, the export, resumable grids of runs (`grid`) and report helpers (`reports`);
the studies built on it are `hf_powernorm.studies`. Never
copied next to a checkpoint: the model files import nothing from it.

    from hf_powernorm.training import load_lm_dataset, tokenize_lines, lm_blocks, train
"""

from .arguments import PN_OPTIONS, add_recipe_args, check_args, check_batch_budget
from .averaging import average_state_dicts, check_average_inputs, select_checkpoints, write_average
from .batching import (
    IGNORE_INDEX,
    PaddingCollator,
    ShuffledBatchSampler,
    TokenBudgetBatchSampler,
    eval_loader,
    train_loader,
)
from .checkpoints import (
    BEST_MODEL_DIR,
    MANIFEST_NAME,
    TRAINING_STATE_NAME,
    IncompleteCheckpointError,
    average_buffers_across_processes,
    check_output_dir,
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_scheduler_state,
    prune_checkpoints,
    read_manifest,
    remove_checkpoints,
    save_checkpoint,
    scheduler_state,
    write_manifest,
)
from .corpora import (
    SENTIMENT_LABELS,
    synthetic_classification_corpus,
    synthetic_lm_corpus,
    synthetic_translation_corpus,
)
from .evaluation import bleu_scores, evaluate_accuracy, evaluate_bleu, evaluate_perplexity, score_splits, translate
from .export import complete_average_export, save_json, save_outputs, save_results, training_command
from .losses import label_smoothed_loss, model_loss, sequence_nll, token_nll, translation_loss
from .loop import (
    EarlyStopping,
    check_run_start,
    finish_training,
    fit,
    log_run_start,
    make_accelerator,
    max_update_steps,
    prepare_eval_loaders,
    start_run,
    train,
)
from .metrics import METRICS_DIR, OncePerMessage, count_words, decode_for_bleu, load_metric, perplexity
from .models import build_config, build_model, model_tokenizer_path, norm_types, resolve_model_path
from .optimization import SCHEDULER_TYPES, build_optimizer, build_scheduler, inverse_sqrt_schedule, parameter_groups
from .readers import (
    data_files_from_args,
    label_names_of,
    limit_samples,
    limit_splits,
    load_classification_dataset,
    load_hub_dataset,
    load_lm_dataset,
    load_translation_dataset,
    read_lines,
    read_phrasebank,
    split_train,
)
from .resuming import resolve_resume_path
from .run_log import RunLog, read_run_log
from .tasks import TASK_REGISTRY, Task, get_task, register_task, run_task, task_names, train_and_score
from .tokenization import (
    SPECIAL_TOKENS,
    column_texts,
    lm_blocks,
    load_tokenizer,
    pad_with_eos,
    prepare_tokenizer,
    sequence_lengths,
    tokenize_classification,
    tokenize_lines,
    tokenize_translation,
    train_bpe_tokenizer,
    translation_texts,
)

__all__ = [
    "BEST_MODEL_DIR", "IGNORE_INDEX", "MANIFEST_NAME", "METRICS_DIR", "PN_OPTIONS", "SCHEDULER_TYPES",
    "SENTIMENT_LABELS", "SPECIAL_TOKENS", "TASK_REGISTRY", "TRAINING_STATE_NAME", "Task", "EarlyStopping",
    "IncompleteCheckpointError", "OncePerMessage", "PaddingCollator", "RunLog", "ShuffledBatchSampler",
    "TokenBudgetBatchSampler", "add_recipe_args", "average_buffers_across_processes", "average_state_dicts",
    "bleu_scores", "build_config", "build_model", "build_optimizer", "build_scheduler", "check_args",
    "check_average_inputs", "check_batch_budget", "check_output_dir", "check_run_start", "column_texts",
    "complete_average_export", "count_words", "data_files_from_args", "decode_for_bleu", "eval_loader",
    "evaluate_accuracy", "evaluate_bleu", "evaluate_perplexity", "finish_training", "fit", "get_task",
    "incomplete_checkpoints", "inverse_sqrt_schedule", "label_names_of", "label_smoothed_loss", "latest_checkpoint",
    "limit_samples", "limit_splits", "list_checkpoints", "lm_blocks", "load_classification_dataset",
    "load_hub_dataset", "load_lm_dataset", "load_metric", "load_scheduler_state", "load_tokenizer",
    "load_translation_dataset", "log_run_start", "make_accelerator", "max_update_steps", "model_loss",
    "model_tokenizer_path", "norm_types", "pad_with_eos", "parameter_groups", "perplexity", "prepare_eval_loaders",
    "prepare_tokenizer", "prune_checkpoints", "read_lines", "read_manifest", "read_phrasebank", "read_run_log",
    "register_task", "remove_checkpoints", "resolve_model_path", "resolve_resume_path", "run_task",
    "save_checkpoint", "save_json", "save_outputs", "save_results", "scheduler_state", "score_splits",
    "select_checkpoints", "sequence_lengths",
    "sequence_nll", "split_train", "start_run", "synthetic_classification_corpus", "synthetic_lm_corpus",
    "synthetic_translation_corpus", "task_names", "token_nll", "tokenize_classification", "tokenize_lines",
    "tokenize_translation", "train", "train_bpe_tokenizer", "train_and_score", "train_loader", "training_command",
    "translate", "translation_loss", "translation_texts", "write_average", "write_manifest",
]
