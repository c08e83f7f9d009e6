"""Corpus BLEU with sacrebleu (Post, 2018), as a local `evaluate` metric that loads offline.

`hf_powernorm.training.load_metric("sacrebleu")` (`evaluate.load` of this folder) loads this file without the Hub. Case-sensitive by
default; `lowercase=True` gives case-insensitive BLEU. The result carries sacrebleu's signature
string, which states the settings the score was computed with.
"""

import datasets
import evaluate
import sacrebleu as scb

_DESCRIPTION = "Corpus-level BLEU computed by sacrebleu, with its reproducibility signature."
_CITATION = """@inproceedings{post-2018-call,
  title = "A Call for Clarity in Reporting {BLEU} Scores",
  author = "Post, Matt",
  booktitle = "Proceedings of the Third Conference on Machine Translation",
  year = "2018",
}"""
_KWARGS = """
Args:
    predictions: list of detokenized hypotheses.
    references: list of lists of detokenized references (one list per prediction, same count each).
    lowercase: case-insensitive BLEU if True (default False).
    tokenize: sacrebleu tokenizer name (default "13a").
    smooth_method, smooth_value, force, use_effective_order: passed to `sacrebleu.BLEU`.
Returns:
    score, counts, totals, precisions, bp, sys_len, ref_len, signature.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Sacrebleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS,
            features=datasets.Features({
                "predictions": datasets.Value("string"),
                "references": datasets.Sequence(datasets.Value("string")),
            }),
        )

    def _compute(self, predictions, references, lowercase=False, tokenize=None, smooth_method="exp",
                 smooth_value=None, force=False, use_effective_order=False):
        counts = {len(refs) for refs in references}
        if len(counts) > 1:
            raise ValueError(f"every prediction needs the same number of references; got {sorted(counts)}")
        bleu = scb.BLEU(lowercase=lowercase, tokenize=tokenize, smooth_method=smooth_method,
                        smooth_value=smooth_value, force=force, effective_order=use_effective_order)
        transposed = [list(refs) for refs in zip(*references)]
        output = bleu.corpus_score(predictions, transposed)
        return {
            "score": output.score,
            "counts": output.counts,
            "totals": output.totals,
            "precisions": output.precisions,
            "bp": output.bp,
            "sys_len": output.sys_len,
            "ref_len": output.ref_len,
            "signature": str(bleu.get_signature()),
        }
