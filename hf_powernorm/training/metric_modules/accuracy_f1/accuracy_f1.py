"""Accuracy and macro-averaged F1 for sentence classification, as a local `evaluate` metric.

`hf_powernorm.training.load_metric("accuracy_f1")` (`evaluate.load` of this folder) loads this file without the Hub. Macro-F1 averages
the per-class F1 over the classes that occur in the references or the predictions (the definition
of scikit-learn's `f1_score(average="macro")`, which is not a dependency here); a class with no
true positive and some false positive or negative scores 0.
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy and macro-F1 over integer class labels."
_KWARGS = """
Args:
    predictions: list of predicted class ids.
    references: list of reference class ids.
    num_labels: optional; if given, macro-F1 averages over all classes 0..num_labels-1.
Returns:
    accuracy, macro_f1 (both in [0, 1]), per_class_f1 (list, ordered by class id).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class AccuracyF1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features({
                "predictions": datasets.Value("int64"),
                "references": datasets.Value("int64"),
            }),
        )

    def _compute(self, predictions, references, num_labels=None):
        if not references:
            raise ValueError("accuracy_f1 needs at least one prediction")
        classes = range(num_labels) if num_labels else sorted(set(predictions) | set(references))
        pairs = list(zip(predictions, references))
        per_class = []
        for label in classes:
            true_pos = sum(p == label and r == label for p, r in pairs)
            false_pos = sum(p == label and r != label for p, r in pairs)
            false_neg = sum(p != label and r == label for p, r in pairs)
            denominator = 2 * true_pos + false_pos + false_neg
            per_class.append(2 * true_pos / denominator if denominator else 0.0)
        accuracy = sum(p == r for p, r in pairs) / len(pairs)
        return {"accuracy": accuracy, "macro_f1": sum(per_class) / len(per_class),
                "per_class_f1": per_class}
