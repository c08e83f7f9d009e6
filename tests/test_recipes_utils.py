"""Tests of the recipes' shared helpers: data readers, embedded corpora, BPE, batching, schedule,
metrics, checkpoint averaging, and the model config built from the command line. Every test makes
its own small data in a temporary folder."""

import argparse
import json
import logging
import math
import random
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import average_checkpoints as avg  # noqa: E402
import recipe_training as rt  # noqa: E402
import recipe_utils as ru  # noqa: E402

GERMAN_VERBS = {form for verbs in (ru._TRANSITIVE, ru._INTRANSITIVE) for verb in verbs for form in verb[:2]}


# ---------------------------------------------------------------------------------------------
# Embedded corpora
# ---------------------------------------------------------------------------------------------

def test_translation_corpus_is_deterministic_and_splits_are_disjoint():
    sizes = {"train": 300, "validation": 40, "test": 40}
    first, second = (ru.synthetic_translation_corpus(sizes=sizes) for _ in range(2))
    assert {s: len(d) for s, d in first.items()} == sizes
    assert first["train"]["translation"] == second["train"]["translation"]
    assert ru.synthetic_translation_corpus(sizes=sizes, seed=5)["train"][0] != first["train"][0]
    sources = {s: {p["de"] for p in d["translation"]} for s, d in first.items()}
    assert not sources["train"] & sources["test"] and not sources["train"] & sources["validation"]


def test_translation_corpus_follows_its_grammar():
    pairs = ru.synthetic_translation_corpus(sizes={"train": 600})["train"]["translation"]
    subordinate = [p for p in pairs if ", weil " in p["de"]]
    assert subordinate, "no subordinate clause generated"
    for pair in subordinate:
        assert pair["de"].split()[-2] in GERMAN_VERBS  # verb-final before the full stop
        assert ", because " in pair["en"]
    fronted = [p for p in pairs if p["de"].startswith("Heute ")]
    assert fronted and all(p["de"].split()[1] in GERMAN_VERBS for p in fronted)  # verb second
    assert all(p["en"].startswith("Today ") for p in fronted)
    assert any(" den " in p["de"] for p in pairs)  # masculine accusative article
    assert all(p["de"][0].isupper() and p["en"].endswith(" .") for p in pairs)


def test_lm_and_classification_corpora_are_deterministic_and_balanced():
    lm = ru.synthetic_lm_corpus(sizes={"train": 200, "validation": 20})
    assert lm["train"]["text"] == ru.synthetic_lm_corpus(sizes={"train": 200, "validation": 20})["train"]["text"]
    data = ru.synthetic_classification_corpus(sizes={"train": 900, "test": 60})
    assert ru.label_names_of(data) == ["negative", "neutral", "positive"]
    labels = data["train"]["label"]
    assert all(labels.count(i) > 225 for i in range(3))
    negated = [(t, l) for t, l in zip(data["train"]["text"], labels) if " not " in t]
    positive_cues = set(ru._POSITIVE_CUES)
    flipped = [l for t, l in negated if t.rstrip(" .").split()[-1] in positive_cues]
    assert flipped and set(flipped) == {0}  # "was not good" is negative


# ---------------------------------------------------------------------------------------------
# Readers and their errors
# ---------------------------------------------------------------------------------------------

def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_translation_reader_json_lines_and_parallel_text(tmp_path):
    rows = [{"translation": {"de": f"Satz {i} .", "en": f"sentence {i} ."}} for i in range(5)]
    _write_lines(tmp_path / "train.jsonl", [json.dumps(r) for r in rows])
    _write_lines(tmp_path / "valid.de", ["Hallo .", "Welt ."])
    _write_lines(tmp_path / "valid.en", ["hello .", "world ."])
    data = ru.load_translation_dataset("de", "en", data_files={
        "train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "valid")})
    assert data["train"][3]["translation"] == {"de": "Satz 3 .", "en": "sentence 3 ."}
    assert data["validation"]["translation"] == [{"de": "Hallo .", "en": "hello ."},
                                                 {"de": "Welt .", "en": "world ."}]


def test_translation_reader_errors_name_the_bad_value(tmp_path):
    _write_lines(tmp_path / "train.jsonl", [json.dumps({"translation": {"de": "a", "en": "b"}})])
    with pytest.raises(ValueError, match=r"de-fr.*\['de', 'en'\]"):
        ru.load_translation_dataset("de", "fr", data_files={"train": str(tmp_path / "train.jsonl")})
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        ru.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "missing.jsonl")})
    _write_lines(tmp_path / "t.de", ["a"])
    _write_lines(tmp_path / "t.en", ["b"])
    with pytest.raises(FileNotFoundError, match=r"t\.fr.*\['de', 'en'\]"):
        ru.load_translation_dataset("de", "fr", data_files={"train": str(tmp_path / "t")})
    _write_lines(tmp_path / "t.en", ["b", "c"])
    with pytest.raises(ValueError, match="aligned"):
        ru.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "t")})
    (tmp_path / "e.de").write_text("")
    (tmp_path / "e.en").write_text("")
    with pytest.raises(ValueError, match="split 'test'.*empty"):
        ru.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "train.jsonl"),
                                                            "test": str(tmp_path / "e")})
    with pytest.raises(ValueError, match="de-fr"):
        ru.load_translation_dataset("de", "fr")


def test_lm_reader_text_files(tmp_path):
    _write_lines(tmp_path / "train.txt", ["the cat sat .", "", "the dog ran ."])
    data = ru.load_lm_dataset(data_files={"train": str(tmp_path / "train.txt")})
    assert data["train"]["text"] == ["the cat sat .", "", "the dog ran ."]
    assert ru.load_lm_dataset()["validation"].column_names == ["text"]


def test_hub_dataset_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="'wmt14'.*offline"):
        ru.load_translation_dataset("de", "en", dataset_name="wmt14", dataset_config="de-en")


def test_hub_dataset_without_network_fails_clearly(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(ru.datasets.config, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub")

    monkeypatch.setattr(ru.datasets, "load_dataset", unreachable)
    with pytest.raises(RuntimeError, match="could not download --dataset_name 'wikitext'.*--train_file"):
        ru.load_lm_dataset(dataset_name="wikitext", dataset_config="wikitext-103-raw-v1")


def _hub_tables() -> dict[tuple[str, str | None], DatasetDict]:
    """Small stand-ins with the splits, columns and features of the Hub datasets the READMEs name."""
    pairs = [{"de": f"Das Haus {i} ist rot .", "en": f"The house {i} is red ."} for i in range(6)]
    translation = DatasetDict({s: Dataset.from_dict({"translation": pairs}) for s in ("train", "validation", "test")})
    lines = [" = Valkyria Chronicles = \n", "", " The game began development in 2010 . \n"]
    sentences = ["no it was n't black monday", "but while the new york stock exchange did n't fall"]
    labels = ClassLabel(names=["negative", "neutral", "positive"])
    phrasebank = Dataset.from_dict({"sentence": [f"sales rose {i} %" for i in range(20)],
                                    "label": [i % 3 for i in range(20)]},
                                   features=Features({"sentence": Value("string"), "label": labels}))
    return {("wmt14", "de-en"): translation, ("iwslt2017", "iwslt2017-de-en"): translation,
            ("wikitext", "wikitext-103-raw-v1"): DatasetDict({s: Dataset.from_dict({"text": lines})
                                                               for s in ("train", "validation", "test")}),
            ("ptb_text_only", None): DatasetDict({s: Dataset.from_dict({"sentence": sentences})
                                                  for s in ("train", "validation", "test")}),
            ("financial_phrasebank", "sentences_allagree"): DatasetDict({"train": phrasebank})}


def test_hub_datasets_reach_the_recipes_in_their_hub_layout(monkeypatch):
    """`--dataset_name` for each dataset the READMEs name, as `datasets` gives it (here from its
    cache, in offline mode: a cached dataset loads without the Hub)."""
    tables = _hub_tables()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(ru.datasets, "load_dataset", lambda name, config=None: tables[name, config])
    for name, config in (("wmt14", "de-en"), ("iwslt2017", "iwslt2017-de-en")):
        data = ru.load_translation_dataset("en", "de", dataset_name=name, dataset_config=config)
        assert sorted(data) == ["test", "train", "validation"]
        assert data["train"][0]["translation"] == {"de": "Das Haus 0 ist rot .", "en": "The house 0 is red ."}
        with pytest.raises(ValueError, match="de-fr"):
            ru.load_translation_dataset("de", "fr", dataset_name=name, dataset_config=config)
    wikitext = ru.load_lm_dataset(dataset_name="wikitext", dataset_config="wikitext-103-raw-v1")
    assert wikitext["validation"]["text"][2] == " The game began development in 2010 . \n"
    ptb = ru.load_lm_dataset(dataset_name="ptb_text_only")  # its `sentence` column becomes `text`
    assert ptb["test"].column_names == ["text"] and ptb["test"]["text"][0] == "no it was n't black monday"
    phrasebank = ru.load_classification_dataset(dataset_name="financial_phrasebank",
                                                dataset_config="sentences_allagree", seed=3)
    # One train split on the Hub: validation and test are carved out of it (10% each, seeded).
    assert {s: len(d) for s, d in phrasebank.items()} == {"train": 16, "validation": 2, "test": 2}
    assert ru.label_names_of(phrasebank) == ["negative", "neutral", "positive"]
    assert set(phrasebank["train"].column_names) == {"text", "label"}


def test_phrasebank_latin1_with_mixed_line_ends(tmp_path):
    raw = ("Operating profit rose to EUR 13.1 mn .@positive\r\n"
           "Sales in Åland fell 5 % , said the CEO\x85@negative\r"
           "The company is based in Espoo @ Finland .@neutral\r\n")
    path = tmp_path / "Sentences_AllAgree.txt"
    path.write_bytes(raw.encode("latin-1"))
    data = ru.read_phrasebank(path)
    assert data["label"] == [2, 0, 1]
    assert data["text"][1] == "Sales in Åland fell 5 % , said the CEO"  # 0x85 is no line break
    assert data["text"][2] == "The company is based in Espoo @ Finland ."
    path.write_bytes("Ein Satz .@mixed\n".encode())
    with pytest.raises(ValueError, match=r"'mixed'.*Sentences_AllAgree\.txt:1"):
        ru.read_phrasebank(path)


def test_classification_reader_csv_json_and_split(tmp_path):
    (tmp_path / "train.csv").write_text("sentence,label\n" + "".join(
        f"sentence number {i},{['negative', 'neutral', 'positive'][i % 3]}\n" for i in range(50)))
    _write_lines(tmp_path / "test.jsonl", [json.dumps({"text": "fine", "label": 2})])
    files = {"train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.jsonl")}
    data = ru.load_classification_dataset(data_files=files, seed=3)
    assert len(data["train"]) == 45 and len(data["validation"]) == 5 and data["test"]["label"] == [2]
    again = ru.load_classification_dataset(data_files=files, seed=3)
    assert data["validation"]["text"] == again["validation"]["text"]
    assert ru.label_names_of(data) == ["negative", "neutral", "positive"]
    _write_lines(tmp_path / "bad.jsonl", [json.dumps({"text": "x", "label": 7})])
    with pytest.raises(ValueError, match=r"unknown label 7 in .*bad\.jsonl row 1"):
        ru.load_classification_dataset(data_files={"train": str(tmp_path / "bad.jsonl")})


# ---------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    corpus = ru.synthetic_translation_corpus(sizes={"train": 400})
    return ru.train_bpe_tokenizer(ru.translation_texts(corpus["train"], ("de", "en")), vocab_size=300)


def test_bpe_round_trip_through_auto_tokenizer(bpe, tmp_path):
    from transformers import AutoTokenizer

    assert [bpe.bos_token_id, bpe.pad_token_id, bpe.eos_token_id, bpe.unk_token_id] == [0, 1, 2, 3]
    assert 100 < len(bpe) <= 300
    text = "Heute sieht der große Hund einen kleinen Vogel , weil die Katze schläft ."
    ids = bpe(text)["input_ids"]
    assert ids[-1] == bpe.eos_token_id and bpe.unk_token_id not in ids
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == text
    reloaded = ru.load_tokenizer(tmp_path)
    assert reloaded.pad_token_id == 1
    # Saved again (the export), it says nothing of where it was loaded from.
    reloaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(saved), saved
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ru.load_tokenizer(tmp_path / "nowhere")


def test_tokenize_translation_and_lm_blocks(bpe):
    corpus = ru.synthetic_translation_corpus(sizes={"train": 20})
    data = ru.tokenize_translation(corpus, bpe, "de", "en", max_length=8)
    row = data["train"][0]
    assert set(row) == {"input_ids", "labels"} and len(row["input_ids"]) <= 8
    assert row["labels"][-1] == bpe.eos_token_id
    assert ru.decode_for_bleu(bpe, [row["labels"] + [-100]]) == [
        bpe.decode(row["labels"], skip_special_tokens=True).strip()]
    stream = ru.token_stream(ru.synthetic_lm_corpus(sizes={"train": 10})["train"], bpe)
    assert stream.count(bpe.eos_token_id) == 10
    blocks = ru.lm_blocks(stream, block_size=16)
    assert all(len(b) == 16 for b in blocks["input_ids"][:-1])
    assert blocks[1]["input_ids"][0] == blocks[0]["input_ids"][-1]  # one-token overlap
    assert sum(len(b) - 1 for b in blocks["input_ids"]) == len(stream) - 1  # each target once


def test_model_config_from_the_command_line(bpe):
    parser = rt.add_recipe_args(argparse.ArgumentParser())
    args = parser.parse_args(["--powernorm_alpha_fwd", "0.95", "--warmup_steps", "7", "--encoder_norm_type",
                              "layernorm", "--powernorm_group_num", "none", "--config_overrides", "encoder_layers=3"])
    config = rt.build_config(args, bpe, 2, {"hidden_size": 64, "intermediate_size": 128}, max_length=100,
                             encoder_norm_type="batchnorm")
    assert config.encoder_norm_type == "layernorm"  # the option wins over the script's own field
    assert (config.hidden_size, config.encoder_layers, config.vocab_size) == (64, 3, len(bpe))
    assert (config.powernorm_alpha_fwd, config.powernorm_group_num) == (0.95, None)
    assert config.powernorm_warmup_steps == 7  # PN's warmup follows the learning-rate warmup
    # Updates on the command line, training forward passes (one per micro-batch) in the config.
    accumulated = parser.parse_args(["--warmup_steps", "7", "--gradient_accumulation_steps", "3"])
    assert rt.build_config(accumulated, bpe, 1, {}, 100).powernorm_warmup_steps == 21
    accumulated.powernorm_warmup_steps = 5
    assert rt.build_config(accumulated, bpe, 1, {}, 100).powernorm_warmup_steps == 15
    assert config.pad_token_id == bpe.pad_token_id and config.max_position_embeddings >= 102
    assert config.powernorm_sync_stats is True  # several processes: synchronised by default
    assert rt.build_config(parser.parse_args([]), bpe, 1, {}, 100).powernorm_sync_stats is False
    assert rt.build_config(parser.parse_args(["--no-sync_stats"]), bpe, 2, {}, 100).powernorm_sync_stats is False
    paper = rt.build_config(parser.parse_args(["--preset", "iwslt14-small"]), bpe, 1, {"hidden_size": 64}, 100)
    assert (paper.hidden_size, paper.powernorm_warmup_steps, paper.decoder_norm_type) == (512, 8000, "layernorm")

# ---------------------------------------------------------------------------------------------
# Batching and collation
# ---------------------------------------------------------------------------------------------

def test_token_budget_batches_respect_budget_and_are_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(500)]
    sampler = ru.TokenBudgetBatchSampler(lengths, max_tokens=256, seed=7)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert all(max(lengths[i] for i in b) * len(b) <= 256 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert list(ru.TokenBudgetBatchSampler(lengths, max_tokens=256, seed=7)) == batches
    sampler.set_epoch(1)
    assert list(sampler) != batches and len(list(sampler)) == len(batches)
    capped = ru.TokenBudgetBatchSampler(lengths, max_tokens=256, max_sentences=5, shuffle=False)
    assert max(len(b) for b in capped) == 5
    with pytest.raises(ValueError, match="example 3 has 90 tokens.*max_tokens=64"):
        ru.TokenBudgetBatchSampler([1, 2, 3, 90], max_tokens=64)


def test_token_budget_sharding_gives_equal_counts():
    lengths = [random.Random(1).randint(1, 30) for _ in range(101)] * 1
    full = ru.TokenBudgetBatchSampler(lengths, max_tokens=64, seed=3)
    shards = [ru.TokenBudgetBatchSampler(lengths, max_tokens=64, seed=3, num_replicas=3, rank=r)
              for r in range(3)]
    counts = {len(list(s)) for s in shards} | {len(s) for s in shards}
    assert counts == {math.ceil(len(full) / 3)}
    assert {i for s in shards for b in s for i in b} == set(range(101))
    assert list(shards[1]) == list(full)[1::3][:len(shards[1])]


def test_padding_collator_for_each_task():
    collate = ru.PaddingCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 2], "labels": [7, 2]}, {"input_ids": [5, 2], "labels": [8, 9, 2]}])
    assert batch["input_ids"].tolist() == [[5, 6, 2], [5, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 2, -100], [8, 9, 2]]
    assert "decoder_attention_mask" not in batch
    seq2seq = ru.PaddingCollator(pad_token_id=0, decoder_attention_mask=True)
    batch = seq2seq([{"input_ids": [5], "labels": [7, 2]}, {"input_ids": [5], "labels": [8, 9, 2]}])
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    batch = ru.PaddingCollator(0, pad_to_multiple_of=4)([{"input_ids": [4, 2], "label": 2}])
    assert batch["input_ids"].tolist() == [[4, 2, 0, 0]] and batch["labels"].tolist() == [2]


# ---------------------------------------------------------------------------------------------
# Optimizer, schedule, losses
# ---------------------------------------------------------------------------------------------

def test_weight_decay_by_ndim_and_inverse_sqrt_schedule():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = ru.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed, plain = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [(3, 4)] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0
    assert optimizer.defaults["betas"] == (0.9, 0.98)
    scheduler = ru.inverse_sqrt_schedule(optimizer, warmup_steps=100, warmup_init_lr=1e-7)
    lrs = []
    for _ in range(401):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-7)
    assert lrs[50] == pytest.approx(1e-7 + 50 * (1e-3 - 1e-7) / 100)
    assert lrs[100] == pytest.approx(1e-3) and lrs[400] == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="warmup_steps.*0"):
        ru.inverse_sqrt_schedule(optimizer, warmup_steps=0)


def test_losses_and_perplexity():
    vocab = 11
    logits = torch.zeros(2, 5, vocab)  # uniform prediction: perplexity equals the vocabulary size
    labels = torch.randint(0, vocab, (2, 5))
    labels[1, 3:] = -100
    nll, count = ru.token_nll(logits, labels, shift=True)
    assert int(count) == 2 * 4 - 2
    assert ru.perplexity(nll.item(), int(count)) == pytest.approx(vocab)
    rows, counts = ru.sequence_nll(logits, labels)
    assert counts.tolist() == [4, 2] and rows.tolist() == pytest.approx([4 * math.log(vocab), 2 * math.log(vocab)])
    smoothed = ru.label_smoothed_loss(torch.randn(2, 5, vocab), labels, label_smoothing=0.1)
    assert smoothed.ndim == 0 and torch.isfinite(smoothed)
    with pytest.raises(ValueError, match="0"):
        ru.perplexity(1.0, 0)


# ---------------------------------------------------------------------------------------------
# Metrics (local evaluate modules, offline)
# ---------------------------------------------------------------------------------------------

def test_sacrebleu_metric_matches_sacrebleu():
    predictions = ["The cat sat on the mat .", "a dog runs in the park"]
    references = [["the cat sat on the mat ."], ["A dog ran in the park ."]]
    metric = ru.load_metric("sacrebleu")
    for lowercase in (False, True):
        result = metric.compute(predictions=predictions, references=references, lowercase=lowercase)
        direct = sacrebleu.corpus_bleu(predictions, [[r[0] for r in references]], lowercase=lowercase)
        assert result["score"] == pytest.approx(direct.score)
        assert ("case:lc" in result["signature"]) == lowercase
    cased = metric.compute(predictions=predictions, references=references)["score"]
    assert cased < metric.compute(predictions=predictions, references=references, lowercase=True)["score"]
    with pytest.raises(ValueError, match="unknown metric 'bleurt'"):
        ru.load_metric("bleurt")


def test_once_per_message_filter(caplog):
    logger = logging.getLogger("hf_powernorm.test_once")
    logger.addFilter(ru.OncePerMessage())
    with caplog.at_level(logging.WARNING, logger="hf_powernorm.test_once"):
        for word in ("period", "period", "comma", "period"):
            logger.warning("tokenized %s", word)
    assert [r.getMessage() for r in caplog.records] == ["tokenized period", "tokenized comma"]


def test_accuracy_f1_metric():
    metric = ru.load_metric("accuracy_f1")
    result = metric.compute(predictions=[0, 1, 2, 2, 1], references=[0, 1, 1, 2, 2])
    assert result["accuracy"] == pytest.approx(3 / 5)
    # class 0: F1 1; class 1: tp 1, fp 1, fn 1 -> 0.5; class 2: tp 1, fp 1, fn 1 -> 0.5
    assert result["per_class_f1"] == pytest.approx([1.0, 0.5, 0.5])
    assert result["macro_f1"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# Checkpoints and averaging
# ---------------------------------------------------------------------------------------------

def _checkpoint(folder: Path, value: float, step: int) -> None:
    folder.mkdir(parents=True)
    save_file({"weight": torch.full((2, 3), value), "half": torch.full((2,), value, dtype=torch.float16),
               "norm.num_batches_tracked": torch.tensor(step)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"step": step}))
    (folder / "optimizer.bin").write_bytes(b"state")
    (folder / "custom_checkpoint_0.pkl").write_bytes(b"scheduler")


def test_average_checkpoints_keeps_integer_counters(tmp_path):
    for step, value in ((9, 1.0), (10, 2.0), (100, 6.0), (2, 50.0)):
        _checkpoint(tmp_path / f"step_{step}", value, step)
    assert ru.latest_checkpoint(tmp_path).name == "step_100"  # numeric, not lexicographic order
    chosen = avg.select_checkpoints(tmp_path, 3)
    assert [p.name for p in chosen] == ["step_9", "step_10", "step_100"]
    avg.main(["--checkpoint_dir", str(tmp_path), "--num_checkpoints", "3",
              "--output_dir", str(tmp_path / "averaged")])
    state = load_file(str(tmp_path / "averaged" / "model.safetensors"))
    assert torch.equal(state["weight"], torch.full((2, 3), 3.0))
    assert state["half"].dtype == torch.float16 and state["half"][0].item() == 3.0
    assert state["norm.num_batches_tracked"].item() == 100
    assert state["norm.num_batches_tracked"].dtype == torch.int64
    assert json.loads((tmp_path / "averaged" / "config.json").read_text()) == {"step": 100}
    assert not any((tmp_path / "averaged" / n).exists() for n in ("optimizer.bin", "custom_checkpoint_0.pkl"))
    with pytest.raises(ValueError, match=r"last 5 checkpoints.*holds 4"):
        avg.select_checkpoints(tmp_path, 5)


def test_checkpoint_listing_errors(tmp_path):
    _checkpoint(tmp_path / "epoch_1", 1.0, 1)
    _checkpoint(tmp_path / "step_5", 1.0, 5)
    with pytest.raises(ValueError, match=r"\['epoch', 'step'\]"):
        ru.list_checkpoints(tmp_path)
    assert [p.name for p in ru.list_checkpoints(tmp_path, prefix="step")] == ["step_5"]
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match=r"other.*model\.safetensors"):
        avg.average_state_dicts([tmp_path / "step_5", tmp_path / "other"])


def test_metrics_load_offline_with_an_empty_cache(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    code = ("import evaluate; m = evaluate.load(%r); "
            "print(m.compute(predictions=['a b c d'], references=[['a b c d']])['score'])")
    out = subprocess.run([sys.executable, "-c", code % str(ru.METRICS_DIR / "sacrebleu")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(100.0)
