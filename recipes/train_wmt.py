"""Train a PowerNorm Transformer for translation with Accelerate (the paper's Section 5.1 recipe).

A `PowerNormTransformerForConditionalGeneration` trained with label-smoothed cross-entropy on
token-budget batches of a joint BPE. Every `--eval_steps` updates (else every epoch) it translates
the validation split with beam search (`generate`) and scores it with sacreBLEU; the best model is
kept, training stops after `--patience` validations without improvement, and the best model is
scored on the test split (its translations in `generated_predictions.txt`) and exported. Without
arguments a small model trains on the embedded synthetic German->English corpus. The paper's
commands (IWSLT14, WMT14) are in `recipes/README.md`; average the last checkpoints with
`recipes/average_checkpoints.py`. `--model_name_or_path` fine-tunes an export, or with
`--no-do_train` only translates and scores it.

The task (arguments, data, head, metric) is `hf_powernorm.training.translation`; `run_task` runs it.
"""

from hf_powernorm.training.translation import DEFAULT_SIZE, Translation, main, parse_args  # noqa: F401
from hf_powernorm.training.tasks import run_script

if __name__ == "__main__":
    run_script(main)
