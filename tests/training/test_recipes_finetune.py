"""The recipes as a user of Transformers' `*_no_trainer.py` examples runs them: an export
fine-tuned or only scored by a second run (`--model_name_or_path`, `--no-do_train`), the results
files and the run's JSON-lines log, fixed-size batches, a second run over the same data reading the
`datasets` cache, and an exported tokenizer that loads without a remote-code question."""

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from recipe_scripts import train_classification, train_lm

from hf_powernorm import PowerNorm, PowerNormTransformerForCausalLM, training
from hf_powernorm.instrumentation import read_norm_statistics

LM_FAST = ["--vocab_size", "120", "--block_size", "16", "--max_tokens", "128", "--warmup_steps", "3",
           "--learning_rate", "5e-3", "--eval_batch_size", "16"]
COUNTER = "model.decoder.layers.0.self_attn_norm.num_batches_tracked"

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def _text_files(root: Path, seed: int) -> list[str]:
    corpus = training.synthetic_lm_corpus({"train": 200, "validation": 30, "test": 30}, seed=seed)
    args = []
    for split, name in (("train", "train"), ("validation", "valid"), ("test", "test")):
        path = root / f"{name}.txt"
        path.write_text("".join(line + "\n" for line in corpus[split]["text"]), encoding="utf-8")
        args += [f"--{split}_file", str(path)]
    return args


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, list[str], dict]:
    root = tmp_path_factory.mktemp("lm_first")
    files = _text_files(root, seed=11)
    out = root / "out"
    results = train_lm.main([*LM_FAST, *files, "--max_train_steps", "4", "--eval_steps", "2", "--output_dir", str(out)])
    return out, files, results


def test_results_files_and_the_run_log(first_run):
    out, _, results = first_run
    everything = json.loads((out / "all_results.json").read_text())
    assert everything == pytest.approx(results)
    train = json.loads((out / "train_results.json").read_text())
    assert train == {"train_steps": 4, "best_step": results["best_step"], "best_validation": results["best_validation"]}
    scores = json.loads((out / "eval_results.json").read_text())
    assert set(scores) == set(everything) - set(train) and "test_perplexity" in scores
    log = training.read_run_log(out)
    updates = [r for r in log if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["learning_rate"] > 0 and r["tokens_per_second"] > 0 for r in updates)
    validations = [r for r in log if "validation" in r]
    assert [r["step"] for r in validations] == [2, 4]
    assert validations[-1]["best_validation"] == pytest.approx(results["best_validation"])


def test_an_export_is_fine_tuned_then_scored_by_later_runs(first_run, tmp_path):
    """`--model_name_or_path` starts from the export's weights, running statistics and tokenizer
    (PN's step counter goes on from the export's); `--no-do_train` only scores and exports it."""
    first, files, _ = first_run
    second = tmp_path / "second"
    tuned = train_lm.main([*LM_FAST, *files, "--model_name_or_path", str(first), "--max_train_steps", "3",
                           "--eval_steps", "3", "--output_dir", str(second)])
    assert tuned["train_steps"] == 3
    start, end = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert end[COUNTER].item() == start[COUNTER].item() + 3
    assert json.loads((second / "tokenizer.json").read_text()) == json.loads((first / "tokenizer.json").read_text())
    assert not (second / "tokenizer").exists()  # no new BPE: the export's own
    third = tmp_path / "third"
    scored = train_lm.main([*LM_FAST, *files, "--model_name_or_path", str(second), "--no-do_train",
                            "--output_dir", str(third)])
    assert "train_steps" not in scored
    assert scored["test_perplexity"] == pytest.approx(tuned["test_perplexity"], rel=1e-6)
    again = load_file(str(third / "model.safetensors"))
    assert all((again[k] == end[k]).all() for k in end)


@pytest.mark.parametrize("bad, message", [
    (["--norm_type", "layernorm"], "brings its own architecture; leave out --norm_type"),
    (["--no-do_train"], "--no-do_train scores an existing model: give --model_name_or_path"),
])
def test_model_source_conflicts_fail_before_any_work(first_run, bad, message, tmp_path):
    first, files, _ = first_run
    source = ["--model_name_or_path", str(first)] if "--norm_type" in bad else []
    with pytest.raises(ValueError, match=message):
        train_lm.main([*LM_FAST, *files, *source, *bad, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_classifier_of_other_labels_is_refused(tmp_path):
    out = tmp_path / "cls"
    train_classification.main(["--vocab_size", "150", "--max_tokens", "256", "--max_train_steps", "1",
                               "--max_eval_samples", "8", "--output_dir", str(out)])
    two_classes = tmp_path / "two.csv"
    two_classes.write_text("text,label\n" + "".join(f"sales rose {i} %,positive\nsales fell {i} %,negative\n"
                                                    for i in range(20)))
    with pytest.raises(ValueError, match=r"num_labels is 3 in the model, 2 here"):
        train_classification.main(["--model_name_or_path", str(out), "--train_file", str(two_classes),
                                   "--label_names", "negative,positive", "--max_train_steps", "1",
                                   "--output_dir", str(tmp_path / "again")])


def test_fixed_size_batches(tmp_path):
    out = tmp_path / "cls"
    results = train_classification.main([
        "--vocab_size", "150", "--per_device_train_batch_size", "32", "--max_train_samples", "320",
        "--num_train_epochs", "2", "--max_eval_samples", "16", "--lr_scheduler_type", "linear",
        "--num_warmup_steps", "2", "--output_dir", str(out)])
    assert results["train_steps"] == 2 * 10  # 320 examples in batches of 32, two epochs
    rates = [r["learning_rate"] for r in training.read_run_log(out) if "loss" in r]
    assert rates[-1] == pytest.approx(0.0, abs=1e-12) and max(rates) == pytest.approx(1e-3)


def test_a_second_run_over_the_same_data_reads_the_cache(tmp_path, capfd):
    files = _text_files(tmp_path, seed=12)
    run = [*LM_FAST, *files, "--max_train_steps", "1", "--max_eval_samples", "10"]
    train_lm.main([*run, "--output_dir", str(tmp_path / "first")])
    first = capfd.readouterr().err
    assert "Tokenizing lines (train)" in first and "Cutting 16-token blocks (train)" in first
    train_lm.main([*run, "--output_dir", str(tmp_path / "second")])
    second = capfd.readouterr().err
    assert "Tokenizing lines" not in second and "Cutting" not in second
    train_lm.main([*run, "--overwrite_cache", "--output_dir", str(tmp_path / "third")])
    assert "Tokenizing lines (train)" in capfd.readouterr().err


def test_the_exported_tokenizer_loads_without_a_question(first_run, run_without_the_package, tmp_path):
    """`AutoTokenizer` always reads the folder's config.json, whose remote-code `auto_map` makes it
    ask before running code; `trust_remote_code=False` answers no up front and the tokenizer loads
    all the same (it needs no code), as does `PreTrainedTokenizerFast` directly. Its maximum length
    is the model's positions, not the training block's."""
    out = first_run[0]
    child = run_without_the_package(
        "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
        f"auto = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=False)\n"
        f"fast = PreTrainedTokenizerFast.from_pretrained({str(out)!r})\n"
        "print(auto.model_max_length, fast.model_max_length, auto('the dog .')['input_ids'] == "
        "fast('the dog .')['input_ids'])\n",
        tmp_path / "hf")
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Do you wish to run the custom code" not in child.stdout + child.stderr
    positions = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert positions > 16 and child.stdout.split() == [str(positions), str(positions), "True"]


def test_record_norm_stats_writes_every_norm_layer(tmp_path):
    """`--record_norm_stats 2` writes, every second update, one row per norm layer with the batch
    and running statistics, the gradient contributions and Lemma 2's condition."""
    out = tmp_path / "lm"
    files = _text_files(tmp_path, seed=13)
    train_lm.main([*LM_FAST, *files, "--max_train_steps", "4", "--record_norm_stats", "2", "--output_dir", str(out)])
    rows = read_norm_statistics(out / "norm_stats.jsonl")
    model = PowerNormTransformerForCausalLM.from_pretrained(out)
    layers = sorted(name for name, module in model.named_modules() if isinstance(module, PowerNorm))
    assert len(layers) == 2 * 2 + 1  # two sub-layers in each of two layers, and the final norm
    assert sorted({r["layer"] for r in rows}) == layers and sorted({r["step"] for r in rows}) == [2, 4]
    assert len(rows) == 2 * len(layers)
    for row in rows:
        for key in ("batch_psi2_avg", "running_phi_avg", "dist_psi2", "g_mu", "g_sigma2", "g_psi2",
                    "weight_grad_norm", "lemma2_fraction"):
            assert row[key] is not None and math.isfinite(row[key]) and row[key] >= 0, (key, row)
        assert row["tokens"] > 0 and row["norm"] == "PowerNorm"


def test_a_hub_repository_in_the_cache_is_fine_tuned_offline(first_run, tmp_path, monkeypatch):
    """`--model_name_or_path ORG/NAME` resolves to the repository's snapshot in the Hub cache
    (offline here), with its tokenizer."""
    import huggingface_hub

    first, files, _ = first_run
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--pn-lm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(first, repo / "snapshots" / commit, ignore=shutil.ignore_patterns("step_*", "best_model"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    results = train_lm.main([*LM_FAST, *files, "--model_name_or_path", "org/pn-lm", "--max_train_steps", "1",
                             "--output_dir", str(tmp_path / "tuned")])
    assert results["train_steps"] == 1
    start = load_file(str(first / "model.safetensors"))
    assert load_file(str(tmp_path / "tuned" / "model.safetensors"))[COUNTER].item() == start[COUNTER].item() + 1
    with pytest.raises(ValueError, match="'org/absent' is neither a folder nor a Hub repository"):
        train_lm.main([*LM_FAST, *files, "--model_name_or_path", "org/absent", "--output_dir", str(tmp_path / "x")])


def _transformers_model_folder(root: Path, kind: str, texts: list[str]) -> Path:
    """A tiny randomly initialised BERT classifier or GPT-2 LM with a BPE of `texts`, saved as a
    Transformers model folder (no Hub weights)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    tokenizer = training.train_bpe_tokenizer(texts, vocab_size=150)
    if kind == "bert":
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=37, max_position_embeddings=160, pad_token_id=tokenizer.pad_token_id,
                            num_labels=3)
        model = BertForSequenceClassification(config)
    else:
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
        model = GPT2LMHeadModel(config)
    folder = root / kind
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_convert_norms_fine_tunes_a_transformers_model(kind, tmp_path):
    """`--model_name_or_path` a Transformers model folder with `--convert_norms powernorm`: its
    norms become PowerNorm with the command line's options, it trains with real-token statistics,
    and the export reloads with `load_converted` to the same scores."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_powernorm import load_converted

    if kind == "bert":
        script, auto, score = train_classification, AutoModelForSequenceClassification, "test_accuracy"
        corpus = training.synthetic_classification_corpus({"train": 60})["train"]["text"]
        extra = ["--max_tokens", "256", "--max_eval_samples", "16"]
    else:
        script, auto, score = train_lm, AutoModelForCausalLM, "test_perplexity"
        files = _text_files(tmp_path, seed=14)
        corpus = Path(files[1]).read_text().splitlines()
        extra = [*files, "--block_size", "16", "--max_tokens", "128"]
    folder = _transformers_model_folder(tmp_path, kind, corpus)
    out = tmp_path / "out"
    results = script.main([*extra, "--model_name_or_path", str(folder), "--convert_norms", "PowerNorm",
                           "--powernorm_warmup_steps", "2", "--powernorm_group_num", "none", "--max_train_steps", "4",
                           "--output_dir", str(out)])
    config = json.loads((out / "config.json").read_text())
    conversion = config["powernorm_conversion"]
    assert conversion["norm_type"] == "powernorm" and len(conversion["modules"]) == 5  # two a layer, and the embeddings or final one
    assert conversion["options"]["warmup_steps"] == 2 and conversion["options"]["group_num"] is None
    saved = load_file(str(out / "model.safetensors"))
    counters = [v.item() for k, v in saved.items() if k.endswith("num_batches_tracked")]
    assert counters and set(counters) == {4}  # every converted norm, once per update
    assert "load_converted" in (out / "README.md").read_text()
    reloaded = load_converted(out, auto)
    assert sum(k.endswith("running_phi") for k in reloaded.state_dict()) == len(counters)
    scored = script.main([*extra, "--model_name_or_path", str(out), "--convert_norms", "powernorm", "--no-do_train",
                          "--output_dir", str(tmp_path / "scored")])
    assert scored[score] == pytest.approx(results[score], rel=1e-6)
