"""`hf-powernorm compare` on inputs nobody in the project made: bad inputs as one line and exit
status 2 before any work, labels and columns from the data, single `Dataset` folders, inputs that
change between runs, Ctrl-C, the checks that withhold a verdict, the baseline's name, the kept
models, and the defaults that fit the model."""

import argparse
import csv
import json
import math
from pathlib import Path

import pytest

from hf_powernorm import cli, compare
from hf_powernorm.compare import runs as compare_runs
from test_compare import (  # noqa: F401 (fixtures)
    TINY,
    _rows,
    _save_tiny,
    _save_tiny_bart,
    _save_tiny_bert,
    _tokenizer,
    bert_case,
)

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def _cli(argv, capsys) -> tuple[int, str]:
    """The console script's exit status and its stderr."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["compare", *argv])
    return stopped.value.code, capsys.readouterr().err


def _one_line_error(argv, capsys, match: str) -> None:
    code, err = _cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hf-powernorm compare: error: ") and match in err, err


# --------------------------------------------------------------------------------------------
# Help and bad input
# --------------------------------------------------------------------------------------------

def test_help_lists_only_the_options_compare_takes_each_with_help():
    parser = compare.build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    assert not {f"--{name}" for name in compare.NOT_TAKEN if name != "push_to_hub"} & options
    assert {"--text_column", "--label_column", "--source_column", "--target_column", "--save_models",
            "--push_to_hub", "--convert_modules", "--no_preserve_function"} <= options
    silent = [action.dest for action in parser._actions if not action.help]
    assert silent == []
    text = parser.format_help()
    assert "--seeds [SEEDS ...]" in text and "default: [1, 2, 3]" in text.replace("\n", " ").replace("  ", "")


def test_bad_inputs_are_one_line_and_exit_2_before_any_work(gpt2_case, capsys, tmp_path):
    model, task, data = gpt2_case
    out = tmp_path / "out"
    base = ["--model_name_or_path", model, "--task", task, "--output_dir", str(out)]
    _one_line_error([*base, *data, "--seeds", "-1"], capsys, "--seeds -1: a seed must be between 0 and")
    binary = tmp_path / "train.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    _one_line_error([*base, "--train_file", str(binary), "--block_size", "16"], capsys, "is not a text file")
    binary.write_bytes(bytes(range(128, 256)) * 8)  # no NUL byte, but not UTF-8 text
    _one_line_error([*base, "--train_file", str(binary), "--block_size", "16"], capsys,
                    f"could not read the data {binary}: UnicodeDecodeError")
    _one_line_error([*base, *data, "--preset", "tiny"], capsys, "unrecognized arguments: --preset tiny")
    _one_line_error([*base, *data, "--push_to_hub"], capsys, "add --save_models")
    _one_line_error([*base, *data, "--label_column", "y"], capsys, "--label_column is for --task classification")
    _one_line_error([*base, *data, "--convert_modules", "layers.("], capsys, "is not a regular expression")
    _one_line_error([*base, "--dataset_name", "nobody/no-such-dataset", "--block_size", "16"], capsys,
                    "needs the Hugging Face Hub, but offline mode is on")
    assert not out.exists()  # nothing written before the error


def test_bert_is_refused_for_causal_lm_and_a_binary_csv_is_one_line(bert_case, capsys, tmp_path):
    model, _, _ = bert_case
    binary = tmp_path / "train.csv"
    binary.write_bytes(b"text,label\n" + bytes(range(128, 256)) * 8 + b",1\n")
    _one_line_error(["--model_name_or_path", model, "--task", "classification", "--train_file", str(binary),
                     "--output_dir", str(tmp_path / "c")], capsys, f"{binary}:2: not UTF-8 (byte 0x80 at column 1)")
    _one_line_error(["--model_name_or_path", model, "--task", "causal-lm", "--output_dir", str(tmp_path / "o")],
                    capsys, "--task causal-lm needs a causal language model")


def test_ctrl_c_writes_the_partial_report_and_the_rerun_resumes(gpt2_case, capsys, tmp_path, monkeypatch):
    model, task, data = gpt2_case
    out = tmp_path / "out"
    argv = ["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "2", "--norms", "layernorm",
            *TINY, "--output_dir", str(out)]
    real = compare_runs.run_cell

    def interrupted_at_seed_2(cell, folder):
        if cell.options["seed"] == 2:
            raise KeyboardInterrupt
        return real(cell, folder)

    monkeypatch.setattr(compare_runs, "run_cell", interrupted_at_seed_2)
    code, err = _cli(argv, capsys)
    last = err.strip().splitlines()[-1]
    assert code == 130 and last.startswith("hf-powernorm compare: interrupted: 1 runs had finished")
    assert "rerun the same command to resume" in last and "Traceback" not in err
    assert {r["seed"] for r in _rows(out)} == {"1"}
    trained = []
    monkeypatch.setattr(compare_runs, "run_cell", lambda cell, folder: trained.append(cell.name) or real(cell, folder))
    compare.main(argv)
    assert trained == ["layernorm-lr0.0005-seed2"]
    assert "1 of 2 runs finished, 1 to run" in capsys.readouterr().err
    assert {r["seed"] for r in _rows(out)} == {"1", "2"}


def _compare_killed(argv, crash):
    """A forked `compare` that dies as a killed process would (`crash`: the checkpoints' test hook)."""
    import os

    from accelerate.state import AcceleratorState

    from hf_powernorm.training import checkpoints

    os.environ[checkpoints.CRASH_AFTER_FILES_ENV] = crash
    AcceleratorState._reset_state(reset_partial_state=True)
    compare.main(argv)


def _killed_at_update_3(gpt2_case, tmp_path) -> tuple[list[str], Path]:
    """An unbroken comparison in `tmp_path/unbroken`, and the same with `--checkpoint_runs` in
    `tmp_path/out` killed while writing the checkpoint of update 3 (one at each validation, every
    update here): the command that resumes it, and its run's folder."""
    import multiprocessing
    import signal

    model, task, data = gpt2_case
    argv = ["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "--norms", "powernorm", *TINY,
            "--max_train_steps", "4"]
    compare.main([*argv, "--output_dir", str(tmp_path / "unbroken")])
    resumable = [*argv, "--output_dir", str(tmp_path / "out"), "--checkpoint_runs"]
    child = multiprocessing.get_context("fork").Process(target=_compare_killed, args=(resumable, "0@3"))
    child.start()
    child.join(300)
    run = tmp_path / "out" / "cells" / "powernorm-lr0.0005-seed1" / "run"
    assert child.exitcode == -signal.SIGKILL and (run / "step_2").is_dir() and not (run / "step_3").exists()
    return resumable, run


def _assert_unbroken_scores(unbroken: Path, out: Path) -> None:
    """The rows of `out`'s results.csv are those of `unbroken`'s, scores to float precision."""
    expected, rows = _rows(unbroken), _rows(out)
    assert len(rows) == len(expected) > 0
    scores = ("loss", "nll", "perplexity")
    for a, b in zip(expected, rows):
        assert {k: v for k, v in a.items() if k not in ("seconds", *scores)} == \
               {k: v for k, v in b.items() if k not in ("seconds", *scores)}
        assert {k: float(b[k]) for k in scores} == pytest.approx({k: float(a[k]) for k in scores}, rel=1e-5)


def test_checkpoint_runs_a_killed_run_goes_on_to_the_scores_of_an_unbroken_one(gpt2_case, capsys, tmp_path):
    import multiprocessing

    resumable, run = _killed_at_update_3(gpt2_case, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    compare.main(resumable)
    assert f"Resuming from {run / 'step_2'}" in capsys.readouterr().out
    _assert_unbroken_scores(tmp_path / "unbroken", out)
    assert not list(run.glob("step_*"))  # the checkpoint served its end

    # Inputs changed since the stopped attempt: its checkpoint is not gone on from.
    child = multiprocessing.get_context("fork").Process(target=_compare_killed, args=(resumable, "0@3"))
    (out / "cells" / "powernorm-lr0.0005-seed1" / "result.json").unlink()
    child.start()
    child.join(300)
    assert (run / "step_2").is_dir()
    (out / "cells" / "powernorm-lr0.0005-seed1" / "started.json").write_text('{"train_file": "another"}')
    capsys.readouterr()
    compare.main(resumable)
    assert "Resuming from" not in capsys.readouterr().out and len(_rows(out)) == len(_rows(tmp_path / "unbroken"))


def test_checkpoint_runs_a_checkpoint_failing_its_hash_is_set_aside_and_the_rerun_scores(gpt2_case, capsys,
                                                                                      tmp_path, caplog):
    """One flipped byte in a stopped run's checkpoint: the same command sets it aside, naming it,
    starts the run over, and exits with the scores of an unbroken run."""
    resumable, run = _killed_at_update_3(gpt2_case, tmp_path)
    weights = bytearray((run / "step_2" / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 1
    (run / "step_2" / "model.safetensors").write_bytes(bytes(weights))
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        cli.main(["compare", *resumable])  # exits 0: no SystemExit
    assert "Resuming from" not in capsys.readouterr().out
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"{run / 'step_2'}: model.safetensors does not match its SHA-256" in warned
    assert f"set aside as {run / 'step_2.corrupt'}" in warned and "starts over" in warned
    _assert_unbroken_scores(tmp_path / "unbroken", tmp_path / "out")
    # the finished run's checkpoints are gone, the one set aside is kept with its flipped byte
    assert not list(run.glob("step_[0-9]*[0-9]"))
    assert (run / "step_2.corrupt" / "model.safetensors").read_bytes() == bytes(weights)


# --------------------------------------------------------------------------------------------
# Fingerprints: a changed input is not silently reused
# --------------------------------------------------------------------------------------------

def test_a_changed_model_folder_redoes_its_runs_and_says_so(gpt2_case, capsys, tmp_path, monkeypatch):
    import shutil

    import torch
    from transformers import GPT2LMHeadModel

    source, task, data = gpt2_case
    model = tmp_path / "model"
    shutil.copytree(source, model)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(model), "--task", task, *data, "--seeds", "1", "--norms", "layernorm",
            *TINY, "--output_dir", str(out)]
    compare.main(argv)
    first = json.loads((out / "cells" / "layernorm-lr0.0005-seed1" / "result.json").read_text())
    trained = []
    real = compare_runs.run_cell
    monkeypatch.setattr(compare_runs, "run_cell", lambda cell, folder: trained.append(cell.name) or real(cell, folder))
    capsys.readouterr()
    compare.main(argv)  # nothing changed: resumed, and it says so
    assert trained == [] and "1 of 1 runs finished, 0 to run" in capsys.readouterr().err
    fixed = GPT2LMHeadModel.from_pretrained(model)
    with torch.no_grad():
        fixed.transformer.wte.weight.mul_(0.5)
    fixed.save_pretrained(model)  # the model was fixed in its folder
    compare.main(argv)
    err = capsys.readouterr().err
    assert trained == ["layernorm-lr0.0005-seed1"]
    assert "layernorm-lr0.0005-seed1: the model changed since it ran; running it again" in err
    again = json.loads((out / "cells" / "layernorm-lr0.0005-seed1" / "result.json").read_text())
    assert again["fingerprint"]["model"] != first["fingerprint"]["model"]
    assert again["fingerprint"]["data"] == first["fingerprint"]["data"]
    assert again["scores"] != first["scores"]


# --------------------------------------------------------------------------------------------
# Labels, columns, data folders
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def binary_bert(tmp_path_factory):
    """A two-class BERT (the config's default LABEL_0/LABEL_1) and a CSV of 0/1 labels whose columns
    are named `review` and `stars`."""
    from hf_powernorm.training import synthetic_classification_corpus

    folder = tmp_path_factory.mktemp("binary-bert")
    corpus = synthetic_classification_corpus({"train": 60, "validation": 12, "test": 12})
    with open(folder / "train.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "stars"])
        train = corpus["train"]
        writer.writerows((text, int(label == 2)) for text, label in zip(train["text"], train["label"]))
    _save_tiny_bert(_tokenizer(corpus["train"]["text"]), folder / "model", num_labels=2)
    return str(folder / "model"), str(folder / "train.csv")


def test_binary_bert_with_0_1_labels_and_named_columns_runs(binary_bert, tmp_path):
    model, train = binary_bert
    out = tmp_path / "out"
    compare.main(["--model_name_or_path", model, "--task", "classification", "--train_file", train,
                  "--text_column", "review", "--label_column", "stars", "--seeds", "1", *TINY,
                  "--output_dir", str(out)])
    rows = _rows(out)
    assert {(r["norm"], r["split"]) for r in rows} == {(n, s) for n in ("layernorm", "powernorm")
                                                      for s in ("validation", "test")}
    assert all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    saved = json.loads((out / "compare.json").read_text())["args"]
    assert saved["label_names"] == ["LABEL_0", "LABEL_1"]  # the model's own two classes: its head kept
    start = json.loads((out / "cells" / "powernorm-lr0.0005-seed1" / "result.json").read_text())["start"]
    assert start["loss"] > 0 and 0 <= start["accuracy"] <= 1  # the starting point the report shows
    assert "| validation loss before fine-tuning |" in (out / "report.md").read_text(encoding="utf-8")


def test_class_names_come_from_the_model_and_the_data():
    from hf_powernorm.training.classification import names_for_labels as names

    assert names([0, 1], ["LABEL_0", "LABEL_1"]) == ["LABEL_0", "LABEL_1"]
    assert names([0, 1, 2], ["LABEL_0", "LABEL_1"]) == ["0", "1", "2"]  # another head size: rebuilt
    assert names(["pos", "neg"], ["neg", "pos"]) == ["neg", "pos"]
    assert names(["positive", "negative"], ["positive", "negative", "neutral"]) == ["positive", "negative", "neutral"]
    assert names(["b", "a"], ["LABEL_0", "LABEL_1"]) == ["a", "b"]
    assert names(("x", "y", "z"), ["LABEL_0"]) == ["x", "y", "z"]  # a ClassLabel's names
    with pytest.raises(ValueError, match="indices from 0; the data has -1"):
        names([-1, 0], ["LABEL_0"])
    given = argparse.Namespace(task="classification", label_names="neg, pos")
    compare.resolve_label_names(given)
    assert given.label_names == ["neg", "pos"]  # --label_names wins
    embedded = argparse.Namespace(task="classification", label_names=None, train_file=None, dataset_name=None)
    compare.resolve_label_names(embedded)
    assert embedded.label_names == ["negative", "neutral", "positive"]  # the embedded corpus's classes


def test_a_single_dataset_folder_with_another_text_column_loads(gpt2_case, tmp_path):
    from datasets import Dataset

    from hf_powernorm.training import synthetic_lm_corpus

    model, task, _ = gpt2_case
    Dataset.from_dict({"body": synthetic_lm_corpus({"train": 40})["train"]["text"]}).save_to_disk(tmp_path / "ds")
    args = compare.parse_args(["--model_name_or_path", model, "--task", task, "--dataset_name", str(tmp_path / "ds"),
                               "--text_column", "body", "--block_size", "16", "--output_dir", str(tmp_path / "o")])
    raw = compare.load_raw_data(args)
    assert set(raw) == {"train", "validation", "test"} and raw["train"].column_names == ["text"]
    assert len(raw["train"]) + len(raw["validation"]) + len(raw["test"]) == 40


def test_summarisation_columns_and_sample_outputs(tmp_path):
    from hf_powernorm.training import synthetic_translation_corpus

    pairs = synthetic_translation_corpus()["train"].select(range(48))["translation"]
    rows = [{"document": p["de"], "summary": p["en"]} for p in pairs]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tokenizer = _tokenizer([t for r in rows for t in r.values()])
    _save_tiny_bart(tokenizer, tmp_path / "model")
    out = tmp_path / "out"
    compare.main(["--model_name_or_path", str(tmp_path / "model"), "--task", "seq2seq", "--train_file",
                  str(tmp_path / "train.jsonl"), "--source_column", "document", "--target_column", "summary",
                  "--max_length", "12", "--max_tokens", "128", "--seeds", "1", *TINY, "--output_dir", str(out)])
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Sample outputs" in report and "### BartLayerNorm" not in report
    result = json.loads((out / "cells" / "powernorm-lr0.0005-seed1" / "result.json").read_text())
    assert len(result["samples"]) == 3 and result["start"]["loss"] > 0  # the model's own loss before training
    documents = {r["document"] for r in rows}
    assert all(s["source"] in documents and isinstance(s["output"], str) for s in result["samples"])
    assert report.count("- source: ") == 6  # three per norm


# --------------------------------------------------------------------------------------------
# The report: checks before a verdict, the baseline's name, run times
# --------------------------------------------------------------------------------------------

def _invariants(seed, **changed):
    """What `arm_invariants` records of a run: equal in every arm of a seed but the norms' own parameters."""
    return {"trainable_outside_norms": 1000, "norm_parameters": 64, "head_tied": False, "updates": 4,
            "train_tokens": 256, "first_batches": f"digest-of-seed-{seed}", "eval_tokens": {"validation": 99},
            "schedule": "inverse_sqrt, warmup 1, at most 4 updates", **changed}


def _result(norm, seed, test, *, start=50.0, validation=None, best_step=1, steps=4, **changed):
    validation = test if validation is None else validation
    return {"cell": f"{norm}-lr0.001-seed{seed}", "norm": norm, "seed": seed, "learning_rate": 1e-3,
            "scores": {"validation_perplexity": validation, "test_perplexity": test},
            "start": {"perplexity": start, "loss": math.log(start)},
            "best_step": best_step, "train_steps": steps, "seconds": 90.0, "invariants": _invariants(seed, **changed)}


def _report(results, tmp_path, norms=("layernorm", "powernorm")):
    args = compare.parse_args(["--seeds", "1", "2", "--norms", *norms, "--output_dir", str(tmp_path)])
    args.model_name_or_path = str(tmp_path)
    facts = {"norm_counts": {"LlamaRMSNorm": 5}, "vocab_size": 99}
    return compare.report_text(results, dict.fromkeys(norms, 1e-3), args, facts)


def test_a_sound_comparison_gets_its_verdict_named_by_the_models_norm(tmp_path):
    report = _report([_result("layernorm", 1, 20.0), _result("layernorm", 2, 20.2),
                      _result("powernorm", 1, 18.0), _result("powernorm", 2, 18.1)], tmp_path)
    start = f"{math.log(50):.3f} ± 0.000 | 50.000 ± 0.000"  # loss and perplexity before fine-tuning
    assert f"| LlamaRMSNorm (the model's own) | 0.001 | 1, 2 | {start} |" in report
    # Two pairs: t with one degree of freedom is the Cauchy distribution, whose quantile is a tangent.
    mean, error = -2.05, 0.1 / math.sqrt(2) / math.sqrt(2)  # differences -2.0 and -2.1
    half, p_value = math.tan(math.pi * 0.475) * error, 1 - 2 / math.pi * math.atan(abs(mean) / error)
    assert (f"| powernorm | 2 | {mean:+.3f} | [{mean - half:+.3f}, {mean + half:+.3f}] | {p_value:.3f} | PN better |"
            in report)
    assert "Every check passed" in report and "Holm-adjusted over the 1 comparison(s) with an interval" in report
    assert "| 1.5 |" in report  # minutes per run
    assert "LN better" not in report and "against LlamaRMSNorm" in report


def test_holm_over_the_comparisons_made_can_take_a_verdict_back(tmp_path):
    base = [_result("layernorm", 1, 20.0), _result("layernorm", 2, 20.2)]
    powernorm = [_result("powernorm", 1, 18.0), _result("powernorm", 2, 18.0)]  # differences -2.0, -2.2
    alone = _report(base + powernorm, tmp_path)
    assert "| powernorm | 2 | -2.100 |" in alone and "| PN better |" in alone
    rmsnorm = [_result("rmsnorm", 1, 19.0), _result("rmsnorm", 2, 18.7)]  # differences -1.0, -1.5
    both = _report(base + powernorm + rmsnorm, tmp_path, ("layernorm", "powernorm", "rmsnorm"))
    assert "PN better" not in both and both.count("| tie |") == 2
    assert "Holm-adjusted over the 2 comparison(s) with an interval" in both


@pytest.mark.parametrize("case, flag", [
    ("barely trained", "perplexity above half the vocabulary (99)"),
    ("best at the last update", "best model at the last update (seed 1, 2)"),
    ("no better than its start", "no better than before fine-tuning (seed 1, 2)"),
])
def test_a_flagged_comparison_gets_no_verdict(case, flag, tmp_path):
    base = [_result("layernorm", 1, 20.0), _result("layernorm", 2, 20.2)]
    other = {"barely trained": [_result("powernorm", 1, 60.0, start=90.0), _result("powernorm", 2, 61.0, start=90.0)],
             "best at the last update": [_result("powernorm", s, 10.0, best_step=4) for s in (1, 2)],
             "no better than its start": [_result("powernorm", s, 10.0, start=9.0) for s in (1, 2)]}[case]
    report = _report(base + other, tmp_path)
    assert "| flagged: no verdict |" in report and flag in report
    assert "PN better" not in report and "Every check passed" not in report


@pytest.mark.parametrize("changed, named", [
    ({"trainable_outside_norms": 1064}, "trainable parameters outside the norms differs from the baseline's (1064 "
                                        "against 1000)"),
    ({"head_tied": True}, "head tied differs from the baseline's (True against False)"),
    ({"first_batches": "another order"}, "first training batches (the data order) differs"),
    ({"train_tokens": 300}, "training tokens differs from the baseline's (300 against 256)"),
    ({"schedule": "linear, warmup 1, at most 4 updates"}, "learning-rate schedule differs"),
])
def test_arms_that_differ_beyond_their_norms_get_no_verdict_naming_the_difference(changed, named, tmp_path):
    base = [_result("layernorm", 1, 20.0), _result("layernorm", 2, 20.2)]
    # A clear gain, which the verdict would call "PN better" were the arms equal but for their norms.
    other = [_result("powernorm", 1, 18.0, norm_parameters=96, **changed),
             _result("powernorm", 2, 18.1, norm_parameters=96, **changed)]
    report = _report(base + other, tmp_path)
    assert "| flagged: no verdict |" in report and named in report and "PN better" not in report
    # The norms' own parameters may differ: the same runs with only those apart keep their verdict.
    fair = [_result("powernorm", 1, 18.0, norm_parameters=96), _result("powernorm", 2, 18.1, norm_parameters=96)]
    assert "PN better" in _report(base + fair, tmp_path)
    # A run without the record (an older comparison's) shows nothing equal: no verdict either.
    unrecorded = [{k: v for k, v in run.items() if k != "invariants"} for run in fair]
    assert "nothing shows the arms equal" in _report(base + unrecorded, tmp_path)


def test_the_same_function_as_the_baseline_gets_no_verdict_row_and_the_tolerance_is_stated(tmp_path):
    base = [_result("layernorm", 1, 98.99092112), _result("layernorm", 2, 97.5)]
    # RMSNorm in place of a Llama's own LlamaRMSNorm: the same function, the scores differ by rounding.
    same = [_result("rmsnorm", 1, 98.99092463), _result("rmsnorm", 2, 97.5 * (1 + 2e-8))]
    apart = [_result("powernorm", 1, 98.99092112 * (1 + 1e-5)), _result("powernorm", 2, 97.5 * (1 - 1e-5))]
    report = _report(base + same + apart, tmp_path, ("layernorm", "rmsnorm", "powernorm"))
    assert "| rmsnorm | 2 |" not in report and "| powernorm | 2 |" in report  # a verdict row for PN only
    assert "- rmsnorm: the same function as LlamaRMSNorm" in report and "within a relative 1e-06" in report
    assert "Holm-adjusted over the 1 comparison(s) with an interval" in report  # RMSNorm is not in the family
    # Equal scores with training losses that differ (an accuracy that happens to be equal): not the same function.
    for r in base + same:
        folder = tmp_path / "cells" / r["cell"] / "run"
        folder.mkdir(parents=True, exist_ok=True)
        loss = 3.0 if r["norm"] == "layernorm" else 3.1
        (folder / "training_log.jsonl").write_text(json.dumps({"step": 1, "loss": loss}) + "\n")
    assert "| rmsnorm | 2 |" in _report(base + same, tmp_path, ("layernorm", "rmsnorm"))
    # Perplexity 1 everywhere (a tokenizer that encodes the text to nothing): flagged, not the same function.
    empty = [_result(norm, seed, 1.0) for norm in ("layernorm", "rmsnorm") for seed in (3, 4)]
    report = _report(empty, tmp_path / "empty", ("layernorm", "rmsnorm"))
    assert "| rmsnorm | 2 |" in report and "no token to predict" in report
    assert "- rmsnorm: the same function" not in report


def test_bleu_zero_everywhere_is_flagged():
    runs = [{"seed": s, "scores": {"test_bleu": 0.0, "validation_bleu": 0.0}, "start": {"bleu": 0.0}} for s in (1, 2)]
    assert any("BLEU 0 in every run" in flag for flag in compare.run_flags(runs, "bleu", "max", 99))


def test_the_baseline_of_a_llama_is_named_by_its_rmsnorm(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_powernorm.training import synthetic_lm_corpus

    tokenizer = _tokenizer(synthetic_lm_corpus({"train": 40})["train"]["text"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                         pad_token_id=tokenizer.pad_token_id)
    _save_tiny(LlamaForCausalLM, config, tokenizer, tmp_path / "llama")
    args = compare.parse_args(["--model_name_or_path", str(tmp_path / "llama"), "--max_tokens", "512",
                               "--output_dir", str(tmp_path / "o")])
    facts = compare.model_facts(args)
    assert facts["norm_counts"] == {"LlamaRMSNorm": 5} and facts["vocab_size"] == len(tokenizer)
    assert compare.baseline_name(facts["norm_counts"]) == "LlamaRMSNorm (the model's own)"
    compare.fit_lengths(args, compare.load_model_tokenizer(args.model_name_or_path))
    assert args.block_size == 48  # what the model's positions allow, not an error


# --------------------------------------------------------------------------------------------
# Defaults that fit a pretrained model, and the kept models
# --------------------------------------------------------------------------------------------

def test_pretrained_models_convert_keeping_their_function_by_default(gpt2_case, tmp_path):
    model, task, data = gpt2_case
    argv = ["--model_name_or_path", model, "--task", task, *data, "--output_dir", str(tmp_path / "o")]
    assert compare.parse_args(argv).preserve_function is True
    assert compare.parse_args([*argv, "--no_preserve_function"]).preserve_function is False
    assert compare.parse_args(["--output_dir", str(tmp_path / "e")]).preserve_function is False  # random init
    args = compare.parse_args([*argv, "--convert_modules", r"\.h\.1\."])
    compare.prepare(args)
    cell = compare.make_cells(args, {"powernorm": [1e-3]}, [1])[0]
    run = compare.run_args(cell, tmp_path / "o" / "cells" / cell.name)
    assert (run.convert_norms, run.convert_modules, run.push_to_hub) == ("powernorm", r"\.h\.1\.", False)
    # Kept for each norm the converter can keep the function with; the others say why not.
    assert run.preserve_function is ("powernorm" not in args.not_preserved)
    assert run.preserve_function or args.not_preserved["powernorm"]


def test_a_norm_that_cannot_keep_the_function_runs_without_it_and_says_why(gpt2_case, tmp_path, monkeypatch):
    import hf_powernorm.converter

    model, task, data = gpt2_case
    real = hf_powernorm.converter.convert_norms

    def convert(model, norm_type, *, preserve_function=False, **options):
        if preserve_function and norm_type == "rmsnorm":
            raise ValueError("preserve_function=True cannot keep the function of a LayerNorm with rmsnorm")
        return real(model, norm_type, **{k: v for k, v in options.items() if v is not None})

    monkeypatch.setattr(hf_powernorm.converter, "convert_norms", convert)
    args = compare.parse_args(["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm",
                               "powernorm", "rmsnorm", "--output_dir", str(tmp_path / "o")])
    compare.prepare(args)
    assert args.not_preserved == {"rmsnorm": "preserve_function=True cannot keep the function of a LayerNorm "
                                             "with rmsnorm"}
    runs = {cell.options["norm"]: compare.run_args(cell, tmp_path / "o" / "cells" / cell.name)
            for cell in compare.make_cells(args, dict.fromkeys(args.norms, [1e-3]), [1])}
    assert (runs["powernorm"].preserve_function, runs["rmsnorm"].preserve_function) == (True, False)
    assert "without it for rmsnorm (preserve_function=True cannot keep" in compare.conversion_sentence(args)


def test_save_models_keeps_each_norms_best_model_and_pushes_it(gpt2_case, tmp_path, hub):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_powernorm import PowerNorm, load_converted

    model, task, data = gpt2_case
    out = tmp_path / "out"
    compare.main(["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "2", *TINY,
                  "--save_models", "--output_dir", str(out)])
    kept = out / "models" / "powernorm"
    run = json.loads((kept / "comparison_run.json").read_text())
    results = {r: json.loads((out / "cells" / f"powernorm-lr0.0005-seed{r}" / "result.json").read_text())
               for r in (1, 2)}
    assert run["best_validation"] == min(r["best_validation"] for r in results.values())
    converted = load_converted(kept, AutoModelForCausalLM)
    assert any(isinstance(m, PowerNorm) for m in converted.modules())
    assert AutoTokenizer.from_pretrained(kept).pad_token_id is not None
    baseline = AutoModelForCausalLM.from_pretrained(out / "models" / "layernorm")
    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.isfinite(baseline(ids).logits).all() and torch.isfinite(converted.eval()(ids).logits).all()

    args = compare.parse_args(["--output_dir", str(out), "--save_models", "--hub_model_id", "me/gpt2"])
    (tmp_path / "token").write_text("a secret")
    (kept / "notes.txt").symlink_to(tmp_path / "token")  # planted: what it points to is never sent
    with pytest.raises(ValueError, match=r"holds symbolic links \(notes.txt\): an upload sends regular files only"):
        compare.push_models({"powernorm": kept}, args)
    assert hub.commits == []
    (kept / "notes.txt").unlink()
    repos = compare.push_models({"powernorm": kept}, args)
    # Without --hub_private_repo the account's default decides (an organisation's may be private).
    assert repos == ["me/gpt2-powernorm"] and hub.repos[-1] == ("me/gpt2-powernorm", {"private": None,
                                                                                     "exist_ok": True})
    assert {"model.safetensors", "tokenizer.json", "comparison_run.json"} <= set(hub.commits[0]["files"])


def test_save_models_added_to_a_finished_comparison_keeps_the_models(gpt2_case, tmp_path, capsys):
    """A finished comparison run again with `--save_models`: its runs, which kept no model, run again
    to the same scores and keep them; with `--report_only` nothing can be kept: exit 2, one line."""
    model, task, data = gpt2_case
    argv = ["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "--norms", "layernorm", *TINY,
            "--output_dir", str(tmp_path / "out")]
    compare.main(argv)
    first = _rows(tmp_path / "out")
    assert not (tmp_path / "out" / "models").exists()
    capsys.readouterr()
    _one_line_error([*argv, "--save_models", "--report_only"], capsys, "--save_models kept no model")
    capsys.readouterr()
    compare.main([*argv, "--save_models"])
    err = capsys.readouterr().err
    assert "layernorm-lr0.0005-seed1: finished without --save_models" in err and "0 of 1 runs finished" in err
    assert (tmp_path / "out" / "models" / "layernorm" / "model.safetensors").is_file()
    again = _rows(tmp_path / "out")
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in again] == \
           [{k: v for k, v in r.items() if k != "seconds"} for r in first]
    capsys.readouterr()
    compare.main([*argv, "--save_models"])  # kept now: nothing to run again
    assert "1 of 1 runs finished, 0 to run" in capsys.readouterr().err


def test_the_plot_puts_training_loss_beside_validation_on_log_axes_with_markers(tmp_path, monkeypatch):
    import matplotlib.figure

    results = [_result(norm, seed, 20.0) for norm in ("layernorm", "powernorm") for seed in (1, 2)]
    for r in results:
        folder = tmp_path / "cells" / r["cell"] / "run"
        folder.mkdir(parents=True)
        records = [{"step": s, "loss": 6.0 / s} for s in (1, 2, 3, 4)] + [{"step": s, "validation": 700.0 / s}
                                                                           for s in (2, 4)]
        (folder / "training_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    drawn = {}

    def record(figure, path, **kwargs):
        drawn.update(axes=[(a.get_ylabel(), a.get_yscale(), [line.get_marker() for line in a.get_lines()],
                            [line.get_label() for line in a.get_lines()]) for a in figure.axes])

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    args = compare.parse_args(["--seeds", "1", "2", "--output_dir", str(tmp_path)])
    compare.plot_curves(results, {"layernorm": 1e-3, "powernorm": 1e-3}, args, tmp_path / "c.png",
                        "LayerNorm (the model's own)")
    (loss, loss_scale, loss_markers, labels), (metric, metric_scale, metric_markers, _) = drawn["axes"]
    assert (loss, loss_scale, metric, metric_scale) == ("training loss", "log", "validation perplexity", "log")
    assert set(loss_markers) == set(metric_markers) == {"o"}
    assert labels == ["LayerNorm (the model's own) (2 seeds)", "powernorm (2 seeds)"]


def test_runs_write_one_progress_bar_each_not_nested_ones(gpt2_case, tmp_path, capsys):
    import datasets
    import transformers

    model, task, data = gpt2_case
    compare.main(["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "2", "--norms", "layernorm",
                  *TINY, "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert "run 1 of 2: layernorm-lr0.0005-seed1" in err and "run 2 of 2: layernorm-lr0.0005-seed2" in err
    assert "Comparison" not in err and "\x1b[A" not in err  # no grid bar above the run's, no cursor-up
    assert "Tokenizing lines" not in err  # no bar of `datasets`' passes
    # the caller's settings come back: a later in-process run shows its bars
    assert transformers.utils.logging.is_progress_bar_enabled() and datasets.is_progress_bar_enabled()


def test_a_run_in_a_fresh_process_of_jobs_has_the_library_bars_off(monkeypatch, tmp_path):
    """`--jobs` runs `run_cell` in fresh processes, not under `main`: it quiets the libraries itself."""
    import datasets
    import transformers

    seen = []
    monkeypatch.setattr(compare_runs, "_run_cell", lambda cell, folder: seen.append(
        (transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())) or {})
    assert compare.run_cell(None, tmp_path) == {}
    assert seen == [(False, False)]
    assert transformers.utils.logging.is_progress_bar_enabled() and datasets.is_progress_bar_enabled()


def test_a_message_over_several_lines_is_printed_as_one(capsys):
    from hf_powernorm.training.options import BadInput

    def entry(argv):
        raise BadInput("the data cannot be read:\n  line 2 of the library's message\n")

    with pytest.raises(SystemExit) as stopped:
        cli.run_command("compare", entry, [])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err == "hf-powernorm compare: error: the data cannot be read: line 2 of the library's message\n"


def test_a_saved_dataset_dict_with_integer_labels_trains_a_binary_bert(binary_bert, tmp_path):
    from datasets import DatasetDict

    from hf_powernorm.training.readers import read_table

    model, train = binary_bert
    table = read_table(train)
    DatasetDict({"train": table.select(range(40)), "validation": table.select(range(40, 50)),
                 "test": table.select(range(50, 60))}).save_to_disk(tmp_path / "stars")
    args = compare.parse_args(["--model_name_or_path", model, "--task", "classification", "--dataset_name",
                               str(tmp_path / "stars"), "--text_column", "review", "--label_column", "stars",
                               "--max_tokens", "256", "--output_dir", str(tmp_path / "o")])
    compare.prepare(args)
    raw = compare.load_raw_data(args)
    assert args.label_names == ["LABEL_0", "LABEL_1"] and set(raw) == {"train", "validation", "test"}
    assert raw["train"].features["label"].names == ["LABEL_0", "LABEL_1"]
    assert raw["test"]["label"] == table.select(range(50, 60))["stars"]  # indices kept as the data has them
