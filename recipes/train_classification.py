"""Train a PowerNorm Transformer sentence classifier with Accelerate (accuracy and macro-F1).

An encoder-only `PowerNormTransformerForSequenceClassification` (mean over real tokens, linear
head) with `--norm_type` in the encoder (PN by default). Data: CSV or JSON lines with `text` (or
`sentence`) and `label` columns, a Financial PhraseBank file (`sentence@label` per line, split
80/10/10 with the seed), a Hub dataset when online, or the embedded three-way sentiment corpus
(the default: about 15 s on 2 CPU cores). The Financial PhraseBank (all annotators agree):

    accelerate launch recipes/train_classification.py \
        --phrasebank_file financial_phrasebank/utf8_lf/Sentences_AllAgree.txt --vocab_size 4000 \
        --max_tokens 2048 --warmup_steps 200 --num_train_epochs 40 --patience 10 \
        --output_dir outputs/phrasebank-powernorm

The task (arguments, data, head, metric) is `hf_powernorm.training.classification`; `run_task` runs it.
"""

from hf_powernorm.training.classification import DEFAULT_SIZE, Classification, main, parse_args  # noqa: F401
from hf_powernorm.training.tasks import run_script

if __name__ == "__main__":
    run_script(main)
