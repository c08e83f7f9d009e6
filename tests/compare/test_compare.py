"""`hf-powernorm compare`: the embedded default end to end, tiny local GPT-2 / BERT / BART
comparisons on files, resuming, the bad inputs refused before any training, and two processes."""

import csv
import json
import os
from pathlib import Path

import pytest

from launching import accelerate_launch
from hf_powernorm import compare
from hf_powernorm.compare import runs as compare_runs
from hf_powernorm.training import synthetic_classification_corpus, train_bpe_tokenizer
from hf_powernorm.training.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")

ROOT = Path(__file__).resolve().parents[2]
# Two updates, validated after each, on a few examples: seconds per run.
TINY = ["--max_train_steps", "2", "--eval_steps", "1", "--num_warmup_steps", "1", "--max_eval_samples", "24"]


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "results.csv", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _keys(rows: list[dict]) -> list[tuple]:
    return sorted((r["norm"], str(r["seed"]), r["split"]) for r in rows)


def _no_training(monkeypatch) -> None:
    def refuse(cell, folder):
        raise AssertionError(f"{cell.name} trained")

    monkeypatch.setattr(compare_runs, "run_cell", refuse)


# --------------------------------------------------------------------------------------------
# Tiny Transformers models and data files made here
# --------------------------------------------------------------------------------------------

def _tokenizer(texts):
    return train_bpe_tokenizer(texts, vocab_size=120)


def _save_tiny(model_class, config, tokenizer, folder) -> None:
    """A random `model_class(config)` (seed 0), saved with `tokenizer` in `folder`."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _save_tiny_bert(tokenizer, folder, num_labels: int) -> None:
    """A tiny random BERT classifier of `num_labels` classes over `tokenizer`'s vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=64, num_labels=num_labels,
                        pad_token_id=tokenizer.pad_token_id)
    _save_tiny(BertForSequenceClassification, config, tokenizer, folder)


def _save_tiny_bart(tokenizer, folder) -> None:
    """A tiny random BART over `tokenizer`'s vocabulary, saved with the tokenizer in `folder`."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                        decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=None)
    _save_tiny(BartForConditionalGeneration, config, tokenizer, folder)


@pytest.fixture(scope="module")
def bert_case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    corpus = synthetic_classification_corpus({"train": 60, "validation": 12, "test": 12})
    names = corpus["train"].features["label"].names
    with open(folder / "train.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows((text, names[label]) for text, label in zip(corpus["train"]["text"], corpus["train"]["label"]))
    _save_tiny_bert(_tokenizer(corpus["train"]["text"]), folder / "model", num_labels=3)
    # Validation and test are carved out of train (10% each, the same for every run).
    return str(folder / "model"), "classification", ["--train_file", str(folder / "train.csv"), "--max_length",
                                                     "32", "--max_tokens", "256"]


@pytest.fixture(scope="module")
def bart_case(tmp_path_factory):
    from hf_powernorm.training import synthetic_translation_corpus

    folder = tmp_path_factory.mktemp("bart")
    corpus = synthetic_translation_corpus()
    files = {}
    for split, size in (("train", 40), ("validation", 8), ("test", 8)):
        files[split] = folder / f"{split}.jsonl"
        rows = corpus[split].select(range(size))["translation"]
        files[split].write_text("".join(json.dumps({"translation": pair}) + "\n" for pair in rows), encoding="utf-8")
    tokenizer = _tokenizer(text for pair in corpus["train"].select(range(40))["translation"] for text in pair.values())
    _save_tiny_bart(tokenizer, folder / "model")
    data = ["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
            "--test_file", str(files["test"]), "--max_length", "12", "--max_tokens", "128"]
    return str(folder / "model"), "seq2seq", data


# --------------------------------------------------------------------------------------------
# The embedded default, and resuming
# --------------------------------------------------------------------------------------------

def test_embedded_default_writes_report_csv_and_plot_and_resumes(tmp_path, monkeypatch):
    output = tmp_path / "compare"
    argv = ["--seeds", "1", "2", *TINY, "--output_dir", str(output)]
    rows = compare.main(argv)
    assert _keys(rows) == _keys(_rows(output))
    assert _keys(rows) == sorted((norm, seed, split) for norm in ("layernorm", "powernorm") for seed in ("1", "2")
                                 for split in ("validation", "test"))
    assert all(float(r["perplexity"]) > 1 for r in _rows(output))
    report = (output / "report.md").read_text(encoding="utf-8")
    assert "the embedded toy corpus" in report and "5 LayerNorm" in report
    assert "| powernorm | 2 |" in report and "95% interval" in report
    # Two updates: each best model is at the last update, so the checks withhold the verdict.
    assert "| flagged: no verdict |" in report and "best model at the last update" in report
    assert (output / "validation_curves.png").stat().st_size > 1000
    # Resumed: every run finished, nothing trains again, the same rows come back.
    _no_training(monkeypatch)
    assert _keys(compare.main(argv)) == _keys(rows)
    # A killed run (no result) is the only one that trains again.
    os.remove(output / "cells" / "powernorm-lr0.002-seed2" / "result.json")
    with pytest.raises(AssertionError, match="powernorm-lr0.002-seed2 trained"):
        compare.main(argv)


def test_one_seed_gives_no_verdict_and_the_rule_is_stated():
    # Paired differences (other - baseline) over the seeds.
    assert compare.verdict([1.0], "min", ("LN", "PN")) == "one seed: no verdict"
    assert compare.verdict([-1.0, -1.1, -0.9], "min", ("LN", "PN")) == "PN better"
    assert compare.verdict([-1.0, -1.1, -0.9], "max", ("LN", "PN")) == "LN better"
    assert compare.verdict([0.5, -0.3, 0.1], "min", ("LN", "PN")) == "tie"
    # Holm's adjustment over several comparisons can take a verdict back.
    assert compare.verdict([-1.0, -1.1, -0.9], "min", ("LN", "PN"), adjusted_p=0.2) == "tie"


# --------------------------------------------------------------------------------------------
# Tiny local GPT-2 / BERT / BART on files
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["gpt2_case", "bert_case", "bart_case"])
def test_local_model_comparison_on_files(case, request, tmp_path):
    model, task, data = request.getfixturevalue(case)
    output = tmp_path / "compare"
    norms = ["layernorm", "powernorm", "rmsnorm"] if task == "causal-lm" else ["layernorm", "powernorm"]
    compare.main(["--model_name_or_path", model, "--task", task, *data, "--norms", *norms, "--seeds", "1",
                  *TINY, "--output_dir", str(output)])
    rows = _rows(output)
    assert _keys(rows) == sorted((norm, "1", split) for norm in norms for split in ("validation", "test"))
    metric = get_task(task).metric
    assert all(r[metric] != "" for r in rows) and {r["train_steps"] for r in rows} == {"2"}
    report = (output / "report.md").read_text(encoding="utf-8")
    assert "one seed: no verdict" in report and f"test {metric}" in report
    assert (output / "validation_curves.png").is_file()
    # Each converted run really had the norm asked for.
    log = json.loads((output / "cells" / "powernorm-lr0.0005-seed1" / "result.json").read_text())
    assert log["norm"] == "powernorm" and log["train_steps"] == 2


def test_a_hub_id_loads_from_the_cache_offline(gpt2_case, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub

    model, task, data = gpt2_case
    cache = tmp_path / "hub"
    commit = "0" * 40
    snapshot = cache / "models--tiny-org--tiny-gpt2" / "snapshots" / commit
    shutil.copytree(model, snapshot)
    (cache / "models--tiny-org--tiny-gpt2" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-gpt2" / "refs" / "main").write_text(commit, encoding="utf-8")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    output = tmp_path / "compare"
    rows = compare.main(["--model_name_or_path", "tiny-org/tiny-gpt2", "--task", task, *data, "--seeds", "1",
                         *TINY, "--output_dir", str(output)])
    assert _keys(rows) == sorted((norm, "1", split) for norm in ("layernorm", "powernorm")
                                 for split in ("validation", "test"))
    report = (output / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# Does PN help tiny-org/tiny-gpt2?") and str(snapshot) in report  # resolved offline


def test_tune_lr_picks_each_norms_rate_on_validation_with_the_first_seed(gpt2_case, tmp_path):
    model, task, data = gpt2_case
    output = tmp_path / "compare"
    rows = compare.main(["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "2", "--tune_lr",
                         "--lr_grid", "1e-4", "3e-3", *TINY, "--output_dir", str(output)])
    runs = {(r["norm"], r["learning_rate"], r["seed"], r["chosen"]) for r in rows}
    for norm in ("layernorm", "powernorm"):
        tuned = {lr: r["perplexity"] for r in rows for lr in (r["learning_rate"],)
                 if r["norm"] == norm and r["seed"] == 1 and r["split"] == "validation"}
        best = min(tuned, key=tuned.get)
        assert set(tuned) == {1e-4, 3e-3}
        assert {(norm, best, seed, True) for seed in (1, 2)} <= runs  # every seed at the chosen rate
        assert not any(n == norm and lr != best and (seed == 2 or chosen) for n, lr, seed, chosen in runs)
    assert "| LayerNorm (the model's own) | " in (output / "report.md").read_text(encoding="utf-8")


def test_second_run_reads_the_tokenization_cache(gpt2_case, tmp_path):
    model, task, data = gpt2_case
    args = compare.parse_args(["--model_name_or_path", model, "--task", task, *data, "--output_dir", str(tmp_path)])
    tokenizer = compare.load_model_tokenizer(model)
    first = compare.tokenize_data(args, compare.load_raw_data(args), tokenizer)
    second = compare.tokenize_data(args, compare.load_raw_data(args), tokenizer)
    assert first["train"].cache_files and first["train"].cache_files == second["train"].cache_files


# --------------------------------------------------------------------------------------------
# Bad input: a clear error before any training
# --------------------------------------------------------------------------------------------

def _refused(monkeypatch, argv, match, error=ValueError):
    _no_training(monkeypatch)
    with pytest.raises(error, match=match):
        compare.main(argv)


def test_unknown_norm_lists_the_valid_ones(monkeypatch, tmp_path):
    _refused(monkeypatch, ["--norms", "layernorm", "powrnorm", "--output_dir", str(tmp_path)],
             r"unknown norm 'powrnorm'; valid names: \[.*'powernorm'")


def test_empty_seeds_and_norms_are_refused(monkeypatch, tmp_path):
    _refused(monkeypatch, ["--seeds", "--output_dir", str(tmp_path)], "--seeds is empty")
    _refused(monkeypatch, ["--norms", "--output_dir", str(tmp_path)], "--norms is empty")


def test_task_that_does_not_fit_the_model(gpt2_case, monkeypatch, tmp_path):
    model, _, _ = gpt2_case
    _refused(monkeypatch, ["--model_name_or_path", model, "--task", "seq2seq", "--output_dir", str(tmp_path)],
             r"--task seq2seq does not fit .*'gpt2'.*tasks that fit it: \['causal-lm', 'classification'\]")


def test_model_without_a_known_norm(monkeypatch, tmp_path):
    from hf_powernorm import PowerNormTransformerConfig, PowerNormTransformerForCausalLM

    config = PowerNormTransformerConfig.from_preset("tiny", is_encoder_decoder=False, encoder_layers=0,
                                                    decoder_layers=1, hidden_size=32, intermediate_size=37,
                                                    num_attention_heads=4, vocab_size=99)
    PowerNormTransformerForCausalLM(config).save_pretrained(tmp_path / "model")
    _refused(monkeypatch, ["--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out")],
             "has no norm that convert_norms knows")


def test_dataset_without_the_needed_column_names_the_columns_found(gpt2_case, bert_case, monkeypatch, tmp_path):
    model, task, _ = gpt2_case
    (tmp_path / "train.jsonl").write_text('{"body": "a line"}\n{"body": "another"}\n', encoding="utf-8")
    _refused(monkeypatch, ["--model_name_or_path", model, "--task", task, "--train_file", str(tmp_path / "train.jsonl"),
                           "--block_size", "16", "--output_dir", str(tmp_path / "a")],
             r"--train_file \S+train\.jsonl needs a 'text' or 'sentence' column \(or --text_column naming one\); "
             r"found \['body'\]")
    model, task, _ = bert_case
    (tmp_path / "unlabelled").mkdir()
    (tmp_path / "unlabelled" / "train.csv").write_text("text,stars\n" + "good,5\nbad,1\n" * 10, encoding="utf-8")
    _refused(monkeypatch, ["--model_name_or_path", model, "--task", task, "--dataset_name",
                           str(tmp_path / "unlabelled"), "--max_length", "32", "--output_dir", str(tmp_path / "b")],
             r"needs 'text' \(or 'sentence'\) and 'label' columns; the data has \['text', 'stars'\] "
             r"\(name yours with --text_column and --label_column\)")


def test_output_folder_of_another_comparison_or_other_files_is_refused(gpt2_case, monkeypatch, tmp_path):
    model, task, data = gpt2_case
    output = tmp_path / "compare"
    output.mkdir()
    (output / "notes.txt").write_text("mine", encoding="utf-8")
    argv = ["--model_name_or_path", model, "--task", task, *data, "--output_dir", str(output)]
    _refused(monkeypatch, argv, r"holds other files \(notes.txt\)")
    (output / "notes.txt").unlink()
    compare.prepare(compare.parse_args(argv))  # what a comparison leaves before its first run
    _refused(monkeypatch, [*argv, "--max_train_steps", "7"],
             r"another comparison.s results \(.*--max_train_steps: None there, 7 now\).*--overwrite_output_dir")
    assert not (output / "cells").exists()
    (output / "data").mkdir()
    (output / "data" / "train.txt").write_text("a line\n", encoding="utf-8")
    _refused(monkeypatch, [*argv, "--max_train_steps", "7", "--overwrite_output_dir", "--train_file",
                           str(output / "data" / "train.txt")], "would delete .*train.txt")



def _command_error(argv: list[str], capsys) -> str:
    """The one line `hf-powernorm compare` prints for a bad input (exit status 2)."""
    from hf_powernorm import cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        cli.main(["compare", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    return err


def test_overwrite_output_dir_clears_only_a_folder_holding_a_comparison(tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    folder = tmp_path / "work"
    (folder / "sub").mkdir(parents=True)
    (folder / "precious.txt").write_text("mine", encoding="utf-8")
    err = _command_error(["--output_dir", str(folder), "--overwrite_output_dir"], capsys)
    assert "holds no compare.json" in err and "would delete precious.txt, sub" in err
    monkeypatch.chdir(folder)
    err = _command_error(["--output_dir", ".", "--overwrite_output_dir"], capsys)
    assert "holds the current directory" in err
    assert sorted(p.name for p in folder.iterdir()) == ["precious.txt", "sub"]
    assert (folder / "precious.txt").read_text(encoding="utf-8") == "mine"


def test_a_linked_lock_in_the_output_folder_is_refused_and_its_target_kept(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine", encoding="utf-8")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / ".lock").symlink_to(target)
    err = _command_error(["--report_only", "--output_dir", str(shared)], capsys)
    assert f"{shared / '.lock'} is a symbolic link" in err
    assert target.read_text(encoding="utf-8") == "mine" and (shared / ".lock").is_symlink()

def test_no_data_options_use_the_embedded_corpus_and_no_path_outside_the_project():
    args = compare.parse_args([])
    assert args.dataset_name is None and args.train_file is None
    assert not any("shared" in str(v) for v in vars(args).values())


def test_console_script_prints_bad_input_as_one_line(tmp_path, capsys):
    from hf_powernorm import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(["compare", "--norms", "powrnorm", "--output_dir", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith("hf-powernorm compare: error: --norms: unknown norm 'powrnorm'")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["comparre"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "usage: hf-powernorm {compare, studies}" in err
    assert err.endswith("hf-powernorm: error: unknown command 'comparre': expected one of compare, studies\n")


# --------------------------------------------------------------------------------------------
# Two processes through `accelerate launch`
# --------------------------------------------------------------------------------------------

def test_two_processes_give_the_rows_of_one(gpt2_case, tmp_path):
    model, task, data = gpt2_case
    argv = ["--model_name_or_path", model, "--task", task, *data, "--seeds", "1", "2", *TINY, "--cpu"]
    one = compare.main([*argv, "--output_dir", str(tmp_path / "one")])
    accelerate_launch(["-m", "hf_powernorm.compare", *argv, "--output_dir", str(tmp_path / "two")])
    two = _rows(tmp_path / "two")
    assert _keys(two) == _keys(one)
    assert [list(r) for r in two] == [list(r) for r in _rows(tmp_path / "one")]  # the same columns
    # Gathered over both processes with the duplicates dropped: every split scored on the same tokens.
    assert {(r["norm"], r["seed"], r["split"]): r["tokens"] for r in two} == \
        {(r["norm"], str(r["seed"]), r["split"]): str(r["tokens"]) for r in one}
