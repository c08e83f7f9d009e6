"""Train a PowerNorm Transformer language model with Accelerate (the paper's Section 5.2, Table 3).

A decoder-only `PowerNormTransformerForCausalLM` with PN at every norm (preset `lm-small`),
trained on fixed-length blocks of the token stream. Perplexity is exp(mean token NLL) over the
whole validation/test stream (every token after the first is scored exactly once), gathered across
processes. Without arguments a small model trains on the embedded English corpus (about 30 s on 2
CPU cores). PTB:

    accelerate launch recipes/train_lm.py --train_file ptb/ptb.train.txt \
        --validation_file ptb/ptb.valid.txt --test_file ptb/ptb.test.txt --preset lm-small \
        --vocab_size 16000 --block_size 256 --max_tokens 4096 --learning_rate 5e-4 \
        --warmup_steps 2000 --clip_norm 0.25 --num_train_epochs 60 --eval_steps 250 --patience 8 \
        --checkpointing_steps 1000 --output_dir outputs/ptb-powernorm

With a BPE tokenizer `perplexity` is per BPE token (about 1.1 per PTB word); `word_perplexity` is
exp(the same total NLL / the number of words, one end of line per line counted), PTB's convention.

The task (arguments, data, head, metric) is `hf_powernorm.training.language_modeling`; `run_task` runs it.
"""

from hf_powernorm.training.language_modeling import DEFAULT_SIZE, LanguageModelling, main, parse_args  # noqa: F401
from hf_powernorm.training.tasks import run_script

if __name__ == "__main__":
    run_script(main)
