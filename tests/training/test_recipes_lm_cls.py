"""End-to-end tests of `train_lm.py` and `train_classification.py` (a few updates each).

Each script trains on the embedded default corpus and on small local files written here,
evaluates, exports, and the export loads through the Auto classes with `trust_remote_code=True`
in a fresh process without `hf_powernorm`, giving the scores of `all_results.json`. A run resumed
from `latest` reaches the weights of an unbroken one; bad input fails before training.
"""

import collections
import csv
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from hf_powernorm import NORM_CLASSES

from launching import accelerate_launch
from recipe_scripts import load_recipe, train_classification, train_lm

from hf_powernorm import training
from hf_powernorm.training import language_modeling
from hf_powernorm.training.run_log import LOG_NAME

ROOT = Path(__file__).resolve().parents[2]

LM_FAST = ["--vocab_size", "120", "--block_size", "16", "--max_tokens", "128", "--warmup_steps", "3",
           "--learning_rate", "5e-3", "--eval_batch_size", "16"]
CLS_FAST = ["--vocab_size", "150", "--max_tokens", "256", "--warmup_steps", "3", "--learning_rate", "3e-3",
            "--eval_batch_size", "32"]


pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lm_data")
    corpus = training.synthetic_lm_corpus({"train": 240, "validation": 40, "test": 30}, seed=5)
    return {split: _write_lines(root / f"{split}.txt", corpus[split]["text"]) for split in corpus}


@pytest.fixture(scope="module")
def classification_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cls_data")
    corpus = training.synthetic_classification_corpus({"train": 300, "validation": 45, "test": 30}, seed=7)
    files = {}
    for split, part in corpus.items():
        files[split] = str(root / f"{split}.csv")
        with open(files[split], "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label"])
            writer.writerows((t, training.SENTIMENT_LABELS[l]) for t, l in zip(part["text"], part["label"]))
    rows = [f"{t}@{training.SENTIMENT_LABELS[l]}" for t, l in zip(corpus["train"]["text"], corpus["train"]["label"])]
    files["phrasebank"] = _write_lines(root / "Sentences_AllAgree.txt", rows)
    return files


def _lm_args(files: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return [*LM_FAST, "--train_file", files["train"], "--validation_file", files["validation"],
            "--test_file", files["test"], "--output_dir", str(output_dir), *extra]


@pytest.fixture(scope="module")
def lm_run(text_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_run")
    results = train_lm.main(_lm_args(text_files, out, "--max_train_steps", "6", "--eval_steps", "2",
                                     "--checkpointing_steps", "2", "--dropout", "0.1"))
    return out, results


@pytest.fixture(scope="module")
def cls_run(classification_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("cls_run")
    results = train_classification.main(_cls_args(classification_files, out, "--max_train_steps", "8"))
    return out, results


def _cls_args(files: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return [*CLS_FAST, "--train_file", files["train"], "--validation_file", files["validation"],
            "--test_file", files["test"], "--output_dir", str(output_dir), "--eval_steps", "4",
            "--checkpointing_steps", "4", "--norm_type", "PowerNorm", "--powernorm_group_num", "none",
            "--gradient_accumulation_steps", "2", "--clip_norm", "1.0", "--with_tracking", *extra]


def _stream_blocks(tokenizer, path: str, block_size: int) -> list[list[int]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    stream = [token for ids in tokenizer(lines)["input_ids"] for token in [*ids, tokenizer.eos_token_id]]
    return [stream[s:s + block_size] for s in range(0, len(stream) - 1, block_size - 1)]


# --------------------------------------------------------------------------------------------
# Language modelling
# --------------------------------------------------------------------------------------------

def test_lm_embedded_default_learns_and_scores_the_whole_stream(tmp_path):
    results = train_lm.main(["--max_train_steps", "25", "--warmup_steps", "5", "--learning_rate", "5e-3",
                             "--eval_steps", "25", "--output_dir", str(tmp_path)])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=False)
    validation = training.synthetic_lm_corpus()["validation"]
    stream = [token for line in validation["text"] for token in [*tokenizer(line)["input_ids"], tokenizer.eos_token_id]]
    assert results["validation_tokens"] == len(stream) - 1  # every token after the first, once
    words = sum(len(line.split()) + 1 for line in validation["text"])
    assert results["validation_word_perplexity"] == pytest.approx(math.exp(results["validation_nll"] / words))
    assert results["validation_perplexity"] == pytest.approx(math.exp(results["validation_nll"] / (len(stream) - 1)))
    # A uniform guess scores the vocabulary size; 25 updates already learn the grammar's words.
    assert results["validation_perplexity"] < len(tokenizer) / 4
    assert results["best_step"] == 25 and results["best_validation"] == pytest.approx(results["validation_perplexity"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["decoder_norm_type"] == "powernorm" and config["powernorm_warmup_steps"] == 5
    assert (config["hidden_size"], config["decoder_layers"]) == (64, 2)


def test_lm_local_files_export(lm_run):
    out, results = lm_run
    assert results["train_steps"] == 6
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_4", "step_6"]
    saved = json.loads((out / "all_results.json").read_text())
    assert saved == pytest.approx(results)
    assert {"model.safetensors", "config.json", "tokenizer.json", "modeling_powernorm.py", "README.md"} <= {
        p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "validation_perplexity" in card and "--max_train_steps 6" in card and "train_lm.py" in card
    config = json.loads((out / "config.json").read_text())
    assert config["dropout"] == 0.1 and config["powernorm_sync_stats"] is False
    # The best of the evaluations at steps 2, 4, 6 is the exported model.
    best = load_file(str(out / training.BEST_MODEL_DIR / "model.safetensors"))
    final = load_file(str(out / "model.safetensors"))
    for key in best:
        torch.testing.assert_close(final[key], best[key], msg=key)
    assert final["model.decoder.layers.0.self_attn_norm.num_batches_tracked"].item() == results["best_step"]


def _unigram_perplexity(tokenizer, train_file: str, test_file: str) -> float:
    """Perplexity on the test stream of add-one-smoothed unigram frequencies of the training stream:
    what a model scores that learned which tokens are common, and nothing of their context."""
    def stream(path: str) -> list[int]:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return [token for ids in tokenizer(lines)["input_ids"] for token in [*ids, tokenizer.eos_token_id]]

    train, test = stream(train_file), stream(test_file)
    counts = collections.Counter(train)
    nll = -sum(math.log((counts[t] + 1) / (len(train) + len(tokenizer))) for t in test[1:])
    return math.exp(nll / (len(test) - 1))


@pytest.mark.parametrize("norm", sorted(NORM_CLASSES))
def test_lm_trains_with_every_norm(norm, text_files, tmp_path):
    """30 updates with each norm learn more than unigram frequencies (about 70 here; the norms reach
    34-57)."""
    results = train_lm.main(_lm_args(text_files, tmp_path, "--max_train_steps", "30", "--norm_type", norm))
    assert results["train_steps"] == 30
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert results["test_perplexity"] < _unigram_perplexity(tokenizer, text_files["train"], text_files["test"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["decoder_norm_type"] == norm
    assert f"| decoder (self-attention, feed-forward, final) | `{norm}` |" in (tmp_path / "README.md").read_text()


def test_lm_resume_from_latest_matches_an_unbroken_run(lm_run, text_files, tmp_path, capsys):
    straight, straight_results = lm_run
    extra = ["--eval_steps", "2", "--checkpointing_steps", "2", "--dropout", "0.1"]
    train_lm.main(_lm_args(text_files, tmp_path, "--max_train_steps", "4", *extra))
    capsys.readouterr()
    resumed_results = train_lm.main(_lm_args(text_files, tmp_path, "--max_train_steps", "6",
                                             "--resume_from_checkpoint", "latest", *extra))
    assert f"Resuming from {tmp_path / 'step_4'}" in capsys.readouterr().out
    assert resumed_results == pytest.approx(straight_results)
    for name in ("step_6/model.safetensors", "model.safetensors"):
        resumed, unbroken = load_file(str(tmp_path / name)), load_file(str(straight / name))
        assert resumed.keys() == unbroken.keys()
        for key in unbroken:
            torch.testing.assert_close(resumed[key], unbroken[key], rtol=1e-5, atol=1e-6, msg=f"{name}:{key}")
    assert resumed["model.decoder.final_norm.num_batches_tracked"].item() == straight_results["best_step"]


def test_lm_early_stopping_exports_the_best_model(text_files, tmp_path, monkeypatch):
    scripted_scores = iter([10.0, 9.0, 12.0, 13.0])  # validation perplexity after each update
    measured, real_scores = language_modeling.evaluate_perplexity, []

    def scripted(accelerator, model, loader, num_words=None):
        scores = measured(accelerator, model, loader, num_words)
        real_scores.append(scores["perplexity"])
        return {**scores, "perplexity": next(scripted_scores, scores["perplexity"])}

    monkeypatch.setattr(language_modeling, "evaluate_perplexity", scripted)
    results = train_lm.main(_lm_args(text_files, tmp_path, "--max_train_steps", "20", "--eval_steps", "1",
                                     "--patience", "2", "--checkpointing_steps", "1"))
    # Best at update 2; updates 3 and 4 do not improve: stop after 4 and export update 2's weights.
    assert (results["train_steps"], results["best_step"], results["best_validation"]) == (4, 2, 9.0)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2", "step_3", "step_4"]
    exported = load_file(str(tmp_path / "model.safetensors"))
    step_2 = load_file(str(tmp_path / "step_2" / "model.safetensors"))
    for key in exported:
        torch.testing.assert_close(exported[key], step_2[key], msg=key)
    # Four validations, then the export on validation and test: it scores as update 2's model did.
    assert len(real_scores) == 6 and real_scores[1] != real_scores[3]
    assert results["validation_perplexity"] == pytest.approx(real_scores[1], rel=1e-6)


def test_early_stopping_state_round_trips():
    stopper = training.EarlyStopping("max", patience=2)
    assert [stopper.update(v, step) for step, v in enumerate([0.5, 0.7, 0.6, 0.7], 1)] == [True, True, False, False]
    assert stopper.should_stop and (stopper.best, stopper.best_step) == (0.7, 2)
    restored = training.EarlyStopping("max", patience=2)
    restored.load_state_dict(stopper.state_dict())
    assert restored == stopper
    with pytest.raises(ValueError, match="'lowest'"):
        training.EarlyStopping("lowest")


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------

def test_classification_csv_export(cls_run):
    out, results = cls_run
    assert results["train_steps"] == 8 and results["validation_examples"] == 45 and results["test_examples"] == 30
    assert 0.0 <= results["test_macro_f1"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["encoder_norm_type"] == "powernorm" and config["powernorm_group_num"] is None
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert "validation_accuracy" in (out / "README.md").read_text()
    # Two micro-batches per update: the PN counter counts forward passes of training micro-batches.
    assert load_file(str(out / "model.safetensors"))["model.encoder.final_norm.num_batches_tracked"].item() == \
        2 * results["best_step"]


def test_classification_resume_with_gradient_accumulation(cls_run, classification_files, tmp_path, capsys):
    straight, straight_results = cls_run
    train_classification.main(_cls_args(classification_files, tmp_path, "--max_train_steps", "4"))
    capsys.readouterr()
    resumed_results = train_classification.main(_cls_args(classification_files, tmp_path, "--max_train_steps", "8",
                                                           "--resume_from_checkpoint", str(tmp_path / "step_4")))
    assert f"Resuming from {tmp_path / 'step_4'}" in capsys.readouterr().out
    assert resumed_results == pytest.approx(straight_results)
    resumed, unbroken = (load_file(str(d / "step_8" / "model.safetensors")) for d in (tmp_path, straight))
    for key in unbroken:
        torch.testing.assert_close(resumed[key], unbroken[key], rtol=1e-5, atol=1e-6, msg=key)
    assert resumed["model.encoder.final_norm.num_batches_tracked"].item() == 16  # 2 micro-batches an update


def test_classification_embedded_default_and_phrasebank(classification_files, tmp_path, reset_accelerate):
    default = train_classification.main(["--max_train_steps", "40", "--warmup_steps", "5", "--eval_steps", "40",
                                         "--learning_rate", "3e-3", "--output_dir", str(tmp_path / "default")])
    assert default["validation_examples"] == 300 and default["test_examples"] == 300
    assert default["validation_accuracy"] > 0.5  # three balanced classes: chance is 1/3
    reset_accelerate()
    phrasebank = train_classification.main([
        *CLS_FAST, "--phrasebank_file", classification_files["phrasebank"], "--max_train_steps", "2",
        "--norm_type", "batchnorm", "--mixed_precision", "bf16", "--output_dir", str(tmp_path / "phrasebank")])
    # 300 sentences split 240 / 30 / 30 with the seed.
    assert (phrasebank["validation_examples"], phrasebank["test_examples"]) == (30, 30)
    assert json.loads((tmp_path / "phrasebank" / "config.json").read_text())["encoder_norm_type"] == "batchnorm"
    # bf16 autocast: the exported running statistics stay float32.
    saved = load_file(str(tmp_path / "phrasebank" / "model.safetensors"))
    assert saved["model.encoder.final_norm.running_var"].dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Remote code: a fresh process without the package recomputes the scores
# --------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    r"""
    import json
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    torch.set_num_threads(1)
    data = json.load(open(DATA))
    out = {}

    lm = AutoModelForCausalLM.from_pretrained(DIRS["lm"], trust_remote_code=True).eval()
    assert type(lm).__module__.startswith("transformers_modules."), type(lm).__module__
    lm_tokenizer = AutoTokenizer.from_pretrained(DIRS["lm"], trust_remote_code=False)  # as the card says
    assert lm_tokenizer(data["lm_line"])["input_ids"] == data["lm_line_ids"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for block in data["lm_blocks"]:
            ids = torch.tensor([block])
            logits = lm(input_ids=ids).logits[0, :-1]
            nll += F.cross_entropy(logits.double(), ids[0, 1:], reduction="sum").item()
            count += len(block) - 1
    out["lm_perplexity"], out["lm_tokens"] = float(torch.tensor(nll / count).exp()), count

    cls = AutoModelForSequenceClassification.from_pretrained(DIRS["cls"], trust_remote_code=True).eval()
    assert type(cls).__module__.startswith("transformers_modules."), type(cls).__module__
    with torch.no_grad():
        predicted = [cls(input_ids=torch.tensor([ids])).logits.argmax(-1).item() for ids in data["cls_ids"]]
    out["cls_accuracy"] = sum(p == l for p, l in zip(predicted, data["cls_labels"])) / len(predicted)
    out["id2label"] = cls.config.id2label
    print("RESULTS " + json.dumps(out))
    """
)


def test_exports_load_as_remote_code_in_a_fresh_process(lm_run, cls_run, text_files, classification_files, tmp_path,
                                                        run_without_the_package):
    from transformers import AutoTokenizer

    (lm_dir, lm_results), (cls_dir, cls_results) = lm_run, cls_run
    lm_tokenizer = AutoTokenizer.from_pretrained(lm_dir, trust_remote_code=False)
    cls_tokenizer = AutoTokenizer.from_pretrained(cls_dir, trust_remote_code=False)
    validation = training.load_classification_dataset(data_files={"validation": classification_files["validation"]})
    line = Path(text_files["validation"]).read_text().splitlines()[0]
    data = {"lm_blocks": _stream_blocks(lm_tokenizer, text_files["validation"], 16),
            "lm_line": line, "lm_line_ids": lm_tokenizer(line)["input_ids"],
            "cls_ids": [ids + [cls_tokenizer.eos_token_id] for ids in cls_tokenizer(
                list(validation["validation"]["text"]), max_length=127, truncation=True)["input_ids"]],
            "cls_labels": list(validation["validation"]["label"])}
    (tmp_path / "data.json").write_text(json.dumps(data))
    child = run_without_the_package(
        f"DATA = {str(tmp_path / 'data.json')!r}\nDIRS = {({'lm': str(lm_dir), 'cls': str(cls_dir)})!r}\n" + CHILD,
        hf_home=tmp_path / "hf", workdir=tmp_path)
    assert child.returncode == 0 and "RESULTS " in child.stdout, child.stdout[-3000:] + child.stderr[-6000:]
    got = json.loads(child.stdout.rsplit("RESULTS ", 1)[1].splitlines()[0])  # after any progress bar
    assert got["lm_tokens"] == lm_results["validation_tokens"]
    assert got["lm_perplexity"] == pytest.approx(lm_results["validation_perplexity"], rel=1e-5)
    assert got["cls_accuracy"] == pytest.approx(cls_results["validation_accuracy"])
    assert got["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}


# --------------------------------------------------------------------------------------------
# Bad input fails before training
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", [train_lm, train_classification], ids=["lm", "classification"])
@pytest.mark.parametrize("bad, error, message", [
    (["--train_file", "/nonexistent/train.txt"], FileNotFoundError, "/nonexistent/train.txt"),
    (["--preset", "gpt-huge"], ValueError, "'gpt-huge' is unknown; valid presets"),
    (["--norm_type", "superNorm"], ValueError, "unknown norm 'superNorm'"),
    (["--checkpointing_steps", "often"], ValueError, "'often'"),
])
def test_bad_arguments_fail_before_training(script, bad, error, message, tmp_path):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        script.main([*bad, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_empty_split_fails_before_training(text_files, classification_files, tmp_path):
    empty_txt, empty_csv = tmp_path / "empty.txt", tmp_path / "empty.csv"
    empty_txt.write_text("")
    empty_csv.write_text("text,label\n")
    with pytest.raises(ValueError, match="split 'validation' .*empty"):
        train_lm.main(["--train_file", text_files["train"], "--validation_file", str(empty_txt),
                       "--output_dir", str(tmp_path / "lm")])
    with pytest.raises(ValueError, match="split 'test' .*empty"):
        train_classification.main(["--train_file", classification_files["train"], "--test_file", str(empty_csv),
                                   "--output_dir", str(tmp_path / "cls")])
    assert not list(tmp_path.glob("*/step_*")) and not list(tmp_path.glob("*/model.safetensors"))


def test_the_column_options_read_a_tables_own_columns(classification_files, tmp_path):
    """`--text_column` and `--label_column` (as `compare` has them) name a table's columns in the
    recipes; without them such a table is refused, naming the option that reads it."""
    tables = {}
    for split in ("train", "validation", "test"):
        with open(classification_files[split], newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))[1:]
        tables[split] = tmp_path / f"{split}.csv"
        with open(tables[split], "w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows([["review", "id", "stars"], *([t, i, l] for i, (t, l) in enumerate(rows))])
    files = [f"--{split}_file={path}" for split, path in tables.items()]
    with pytest.raises(ValueError, match=r"needs a 'text' or 'sentence' column \(or --text_column naming one\)"):
        train_classification.main([*CLS_FAST, *files, "--output_dir", str(tmp_path / "refused")])
    results = train_classification.main([*CLS_FAST, *files, "--text_column", "review", "--label_column", "stars",
                                         "--max_train_steps", "2", "--output_dir", str(tmp_path / "cls")])
    assert (results["train_steps"], results["validation_examples"], results["test_examples"]) == (2, 45, 30)
    results = train_lm.main([*LM_FAST, *files, "--text_column", "review", "--max_train_steps", "2",
                             "--output_dir", str(tmp_path / "lm")])
    assert results["train_steps"] == 2 and math.isfinite(results["test_perplexity"])
    with pytest.raises(ValueError, match="--source_column and --target_column go together"):
        load_recipe("train_wmt").main(["--source_column", "review", "--output_dir", str(tmp_path / "wmt")])
    assert not (tmp_path / "wmt").exists()


# --------------------------------------------------------------------------------------------
# Two processes through `accelerate launch`
# --------------------------------------------------------------------------------------------

def _launch(script: str, args: list[str]) -> str:
    return accelerate_launch([str(ROOT / "recipes" / script), "--cpu", *args])


def test_lm_two_processes_unsynced_statistics_are_averaged(text_files, lm_run, tmp_path):
    log = _launch("train_lm.py", _lm_args(text_files, tmp_path, "--max_train_steps", "3", "--no-sync_stats"))
    assert "2 process(es)" in log
    results = json.loads((tmp_path / "all_results.json").read_text())
    # Gathered over both processes with the duplicates of the last batch dropped: the same stream.
    assert results["validation_tokens"] == lm_run[1]["validation_tokens"]
    assert json.loads((tmp_path / "config.json").read_text())["powernorm_sync_stats"] is False
    assert load_file(str(tmp_path / "model.safetensors"))["model.decoder.final_norm.num_batches_tracked"].item() == 3


@pytest.mark.slow  # two processes with synchronised statistics are also the translation recipe's test
def test_classification_two_processes_synchronised_statistics(classification_files, tmp_path):
    files = classification_files
    log = _launch("train_classification.py", [
        *CLS_FAST, "--train_file", files["train"], "--validation_file", files["validation"],
        "--output_dir", str(tmp_path), "--max_train_steps", "3"])
    assert "2 process(es)" in log
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert results["validation_examples"] == 45
    assert json.loads((tmp_path / "config.json").read_text())["powernorm_sync_stats"] is True


def _average_on_rank(rank: int, init_file: str, out_file: str) -> None:
    """One of two gloo processes: its own PN statistics, then the average over both."""
    import types

    import torch.distributed as dist

    from hf_powernorm import PowerNorm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    norm = PowerNorm(4, warmup_steps=0)
    with torch.no_grad():
        norm.running_phi.fill_(1.0 + rank)  # rank 0: 1, rank 1: 2
        norm.running_nu.fill_(float(rank))
        norm.num_batches_tracked.fill_(7)
    accelerator = types.SimpleNamespace(num_processes=2, unwrap_model=lambda m: m)
    assert training.average_buffers_across_processes(accelerator, norm) == 2
    torch.save({k: v.clone() for k, v in norm.state_dict().items()}, f"{out_file}.{rank}")
    dist.destroy_process_group()


def test_statistics_are_averaged_across_processes(tmp_path):
    # Forked: the children share this process's imports (spawning would import everything again).
    torch.multiprocessing.start_processes(_average_on_rank, args=(str(tmp_path / "init"), str(tmp_path / "state")),
                                          nprocs=2, join=True, start_method="fork")
    states = [torch.load(tmp_path / f"state.{rank}", weights_only=True) for rank in (0, 1)]
    for state in states:  # identical on both ranks, whichever writes the file
        torch.testing.assert_close(state["running_phi"], torch.full((4,), 1.5))
        torch.testing.assert_close(state["running_nu"], torch.full((4,), 0.5))
        assert state["running_phi"].dtype == torch.float32 and state["num_batches_tracked"].item() == 7


def test_dropout_seed_redraws_dropout_and_keeps_initialisation_and_batch_order(text_files, tmp_path):
    """`--dropout_seed` reseeds the random draws once the model is built: without dropout the run is
    the same run (the initialisation and the batch order are `--seed`'s), with dropout it differs,
    and two runs with the same `--dropout_seed` agree."""
    def losses(name: str, *extra: str) -> list[float]:
        out = tmp_path / name
        train_lm.main(_lm_args(text_files, out, "--max_train_steps", "4", "--eval_steps", "2", *extra))
        records = [json.loads(line) for line in (out / LOG_NAME).read_text(encoding="utf-8").splitlines()]
        return [record["loss"] for record in records if "loss" in record] + \
            [record["validation"] for record in records if "validation" in record]

    none = ("--dropout", "0.0", "--config_overrides", "attention_dropout=0.0,activation_dropout=0.0")
    plain = losses("plain", *none)
    assert len(plain) == 6
    assert losses("redrawn-no-dropout", *none, "--dropout_seed", "1001") == plain
    with_dropout = losses("dropout", "--dropout", "0.3")
    redrawn = losses("redrawn", "--dropout", "0.3", "--dropout_seed", "1001")
    assert redrawn != with_dropout
    assert losses("redrawn-again", "--dropout", "0.3", "--dropout_seed", "1001") == redrawn
