"""Tests of the training library's data side: embedded corpora, readers, BPE, cached tokenization,
language-model blocks, batching and collation. Every test makes its own small data in a temporary
folder."""

import json
import math
import random
from pathlib import Path

import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from hf_powernorm import training
from hf_powernorm.training import corpora, readers

GERMAN_VERBS = {form for verbs in (corpora._TRANSITIVE, corpora._INTRANSITIVE) for verb in verbs for form in verb[:2]}


# ---------------------------------------------------------------------------------------------
# Embedded corpora
# ---------------------------------------------------------------------------------------------

def test_translation_corpus_is_deterministic_and_splits_are_disjoint():
    sizes = {"train": 300, "validation": 40, "test": 40}
    first, second = (training.synthetic_translation_corpus(sizes=sizes) for _ in range(2))
    assert {s: len(d) for s, d in first.items()} == sizes
    assert first["train"]["translation"] == second["train"]["translation"]
    assert training.synthetic_translation_corpus(sizes=sizes, seed=5)["train"][0] != first["train"][0]
    sources = {s: {p["de"] for p in d["translation"]} for s, d in first.items()}
    assert not sources["train"] & sources["test"] and not sources["train"] & sources["validation"]


def test_translation_corpus_follows_its_grammar():
    pairs = training.synthetic_translation_corpus(sizes={"train": 600})["train"]["translation"]
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
    lm = training.synthetic_lm_corpus(sizes={"train": 200, "validation": 20})
    assert lm["train"]["text"] == training.synthetic_lm_corpus(sizes={"train": 200, "validation": 20})["train"]["text"]
    data = training.synthetic_classification_corpus(sizes={"train": 900, "test": 60})
    assert training.label_names_of(data) == ["negative", "neutral", "positive"]
    labels = data["train"]["label"]
    assert all(labels.count(i) > 225 for i in range(3))
    negated = [(t, l) for t, l in zip(data["train"]["text"], labels) if " not " in t]
    positive_cues = set(corpora._POSITIVE_CUES)
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
    data = training.load_translation_dataset("de", "en", data_files={
        "train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "valid")})
    assert data["train"][3]["translation"] == {"de": "Satz 3 .", "en": "sentence 3 ."}
    assert data["validation"]["translation"] == [{"de": "Hallo .", "en": "hello ."},
                                                 {"de": "Welt .", "en": "world ."}]


def test_translation_reader_errors_name_the_bad_value(tmp_path):
    _write_lines(tmp_path / "train.jsonl", [json.dumps({"translation": {"de": "a", "en": "b"}})])
    with pytest.raises(ValueError, match=r"de-fr.*\['de', 'en'\]"):
        training.load_translation_dataset("de", "fr", data_files={"train": str(tmp_path / "train.jsonl")})
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        training.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "missing.jsonl")})
    _write_lines(tmp_path / "t.de", ["a"])
    _write_lines(tmp_path / "t.en", ["b"])
    with pytest.raises(FileNotFoundError, match=r"t\.fr.*\['de', 'en'\]"):
        training.load_translation_dataset("de", "fr", data_files={"train": str(tmp_path / "t")})
    _write_lines(tmp_path / "t.en", ["b", "c"])
    with pytest.raises(ValueError, match="aligned"):
        training.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "t")})
    (tmp_path / "e.de").write_text("")
    (tmp_path / "e.en").write_text("")
    with pytest.raises(ValueError, match="split 'test'.*empty"):
        training.load_translation_dataset("de", "en", data_files={"train": str(tmp_path / "train.jsonl"),
                                                            "test": str(tmp_path / "e")})
    with pytest.raises(ValueError, match="de-fr"):
        training.load_translation_dataset("de", "fr")


def test_lm_reader_text_files(tmp_path):
    _write_lines(tmp_path / "train.txt", ["the cat sat .", "", "the dog ran ."])
    data = training.load_lm_dataset(data_files={"train": str(tmp_path / "train.txt")})
    assert data["train"]["text"] == ["the cat sat .", "", "the dog ran ."]
    assert training.load_lm_dataset()["validation"].column_names == ["text"]


def test_a_dataset_folder_that_does_not_exist_is_named(tmp_path):
    missing = tmp_path / "nofolder"
    with pytest.raises(ValueError, match=f"^--dataset_name {missing}: no such folder \\(expected a local folder"):
        training.load_lm_dataset(dataset_name=str(missing))


def test_hub_dataset_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="'wmt14'.*offline"):
        training.load_translation_dataset("de", "en", dataset_name="wmt14", dataset_config="de-en")


def test_hub_dataset_without_network_fails_clearly(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setattr(readers.datasets.config, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub")

    monkeypatch.setattr(readers.datasets, "load_dataset", unreachable)
    with pytest.raises(RuntimeError, match="could not download --dataset_name 'wikitext'.*--train_file"):
        training.load_lm_dataset(dataset_name="wikitext", dataset_config="wikitext-103-raw-v1")


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
    monkeypatch.setattr(readers.datasets, "load_dataset", lambda name, config=None: tables[name, config])
    for name, config in (("wmt14", "de-en"), ("iwslt2017", "iwslt2017-de-en")):
        data = training.load_translation_dataset("en", "de", dataset_name=name, dataset_config=config)
        assert sorted(data) == ["test", "train", "validation"]
        assert data["train"][0]["translation"] == {"de": "Das Haus 0 ist rot .", "en": "The house 0 is red ."}
        with pytest.raises(ValueError, match="de-fr"):
            training.load_translation_dataset("de", "fr", dataset_name=name, dataset_config=config)
    wikitext = training.load_lm_dataset(dataset_name="wikitext", dataset_config="wikitext-103-raw-v1")
    assert wikitext["validation"]["text"][2] == " The game began development in 2010 . \n"
    ptb = training.load_lm_dataset(dataset_name="ptb_text_only")  # its `sentence` column becomes `text`
    assert ptb["test"].column_names == ["text"] and ptb["test"]["text"][0] == "no it was n't black monday"
    phrasebank = training.load_classification_dataset(dataset_name="financial_phrasebank",
                                                dataset_config="sentences_allagree", seed=3)
    # One train split on the Hub: validation and test are carved out of it (10% each, seeded).
    assert {s: len(d) for s, d in phrasebank.items()} == {"train": 16, "validation": 2, "test": 2}
    assert training.label_names_of(phrasebank) == ["negative", "neutral", "positive"]
    assert set(phrasebank["train"].column_names) == {"text", "label"}


def test_phrasebank_latin1_with_mixed_line_ends(tmp_path):
    raw = ("Operating profit rose to EUR 13.1 mn .@positive\r\n"
           "Sales in Åland fell 5 % , said the CEO\x85@negative\r"
           "The company is based in Espoo @ Finland .@neutral\r\n")
    path = tmp_path / "Sentences_AllAgree.txt"
    path.write_bytes(raw.encode("latin-1"))
    data = training.read_phrasebank(path)
    assert data["label"] == [2, 0, 1]
    assert data["text"][1] == "Sales in Åland fell 5 % , said the CEO"  # 0x85 is no line break
    assert data["text"][2] == "The company is based in Espoo @ Finland ."
    path.write_bytes("Ein Satz .@mixed\n".encode())
    with pytest.raises(ValueError, match=r"'mixed'.*Sentences_AllAgree\.txt:1"):
        training.read_phrasebank(path)


def test_classification_reader_csv_json_and_split(tmp_path):
    (tmp_path / "train.csv").write_text("sentence,label\n" + "".join(
        f"sentence number {i},{['negative', 'neutral', 'positive'][i % 3]}\n" for i in range(50)))
    _write_lines(tmp_path / "test.jsonl", [json.dumps({"text": "fine", "label": 2})])
    files = {"train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.jsonl")}
    data = training.load_classification_dataset(data_files=files, seed=3)
    assert len(data["train"]) == 45 and len(data["validation"]) == 5 and data["test"]["label"] == [2]
    again = training.load_classification_dataset(data_files=files, seed=3)
    assert data["validation"]["text"] == again["validation"]["text"]
    assert training.label_names_of(data) == ["negative", "neutral", "positive"]
    _write_lines(tmp_path / "bad.jsonl", [json.dumps({"text": "x", "label": 7})])
    with pytest.raises(ValueError, match=r"unknown label 7 in .*bad\.jsonl row 1"):
        training.load_classification_dataset(data_files={"train": str(tmp_path / "bad.jsonl")})



def test_too_little_training_data_to_carve_the_evaluation_splits_out_of_says_so():
    """Two examples and no validation or test: one line naming the count and the options that give
    the splits (not `datasets`' message about test_size); three are enough, one example each."""
    two = DatasetDict({"train": Dataset.from_dict({"text": ["a", "b"]})})
    with pytest.raises(ValueError, match=r"^the training data has 2 example\(s\): too few to carve validation and "
                                         r"test out of it \(10%, 10%, .*give --validation_file and --test_file, or "
                                         r"more data$"):
        readers.split_train(two)
    three = readers.split_train(DatasetDict({"train": Dataset.from_dict({"text": ["a", "b", "c"]})}))
    assert {split: len(part) for split, part in three.items()} == {"train": 1, "validation": 1, "test": 1}
    with_test = DatasetDict({"train": Dataset.from_dict({"text": ["a", "b"]}),
                             "test": Dataset.from_dict({"text": ["c"]})})
    assert len(readers.split_train(with_test)["validation"]) == 1


# ---------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    corpus = training.synthetic_translation_corpus(sizes={"train": 400})
    return training.train_bpe_tokenizer(training.translation_texts(corpus["train"], ("de", "en")), vocab_size=300)


def test_bpe_round_trip_through_auto_tokenizer(bpe, tmp_path):
    from transformers import AutoTokenizer

    assert [bpe.bos_token_id, bpe.pad_token_id, bpe.eos_token_id, bpe.unk_token_id] == [0, 1, 2, 3]
    assert 100 < len(bpe) <= 300
    text = "Heute sieht der große Hund einen kleinen Vogel , weil die Katze schläft ."
    ids = bpe(text)["input_ids"]
    # A text is encoded as it is, left open as GPT-2's and Llama's tokenizers leave it.
    assert bpe.eos_token_id not in ids and bpe.unk_token_id not in ids
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == text
    reloaded = training.load_tokenizer(tmp_path)
    assert reloaded.pad_token_id == 1
    # Saved again (the export), it says nothing of where it was loaded from.
    reloaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(saved), saved
    with pytest.raises(FileNotFoundError, match="nowhere"):
        training.load_tokenizer(tmp_path / "nowhere")


def test_tokenize_translation(bpe):
    corpus = training.synthetic_translation_corpus(sizes={"train": 20})
    data = training.tokenize_translation(corpus, bpe, "de", "en", max_source_length=8, max_target_length=6)
    row = data["train"][0]
    assert set(row) == {"input_ids", "labels", "length"}
    assert len(row["input_ids"]) <= 8 and len(row["labels"]) <= 6
    assert row["length"] == max(len(row["input_ids"]), len(row["labels"]))
    assert row["labels"][-1] == bpe.eos_token_id
    assert training.decode_for_bleu(bpe, [row["labels"] + [-100]]) == [
        bpe.decode(row["labels"], skip_special_tokens=True).strip()]


def _stream(bpe, lines: list[str]) -> list[int]:
    return [token for line in lines for token in [*bpe(line)["input_ids"], bpe.eos_token_id]]


@pytest.mark.parametrize("lines_per_batch, num_proc", [(1000, None), (3, None), (4, 2)])
def test_lm_blocks_score_every_token_once_across_map_batches(bpe, lines_per_batch, num_proc):
    """Cut in batches of lines (and processes), the blocks still overlap by one token, so every
    token of the stream after the first is a target exactly once and the stream is unchanged."""
    corpus = training.synthetic_lm_corpus(sizes={"train": 10})
    lines = training.tokenize_lines(corpus, bpe)
    assert lines["train"][0]["input_ids"][-1] == bpe.eos_token_id
    blocks = training.lm_blocks(lines, block_size=16, lines_per_batch=lines_per_batch, num_proc=num_proc)["train"]
    stream = _stream(bpe, corpus["train"]["text"])
    assert stream.count(bpe.eos_token_id) == 10
    rows = list(blocks["input_ids"])
    assert rows == list(blocks["labels"]) and list(blocks["length"]) == [len(r) for r in rows]
    assert all(2 <= len(r) <= 16 for r in rows)
    targets = [t for r in rows for t in r[1:]]
    assert targets == stream[1:]  # every token after the first, once, in order
    assert rows[0][0] == stream[0]
    for first, second in zip(rows, rows[1:]):
        assert second[0] == first[-1]  # each block starts with the previous block's last token
    if lines_per_batch == 1000:
        assert all(len(r) == 16 for r in rows[:-1])
    with pytest.raises(ValueError, match="block_size must be at least 2; got 1"):
        training.lm_blocks(lines, block_size=1)


def _cache_state(dataset) -> list[tuple[str, int]]:
    files = [Path(f["filename"]) for f in dataset.cache_files]
    return [(str(f), f.stat().st_mtime_ns) for f in files]


def test_tokenization_is_cached_and_overwrite_cache_redoes_it(bpe, tmp_path):
    """A second pass over the same file with the same tokenizer reads the Arrow cache that the
    first one wrote; another tokenizer, another file content, or `overwrite_cache` tokenize again."""
    path = _write_lines(tmp_path / "train.txt", [f"the dog number {i} runs ." for i in range(50)])
    raw = training.load_lm_dataset(data_files={"train": str(path)})
    first = training.tokenize_lines(raw, bpe)["train"]
    written = _cache_state(first)
    again = training.tokenize_lines(training.load_lm_dataset(data_files={"train": str(path)}), bpe)["train"]
    assert _cache_state(again) == written and again._fingerprint == first._fingerprint
    assert list(again["input_ids"]) == list(first["input_ids"])
    redone = training.tokenize_lines(raw, bpe, overwrite_cache=True)["train"]
    assert redone.cache_files[0]["filename"] == first.cache_files[0]["filename"]
    assert _cache_state(redone) != written  # written again
    other = training.train_bpe_tokenizer(raw["train"]["text"], vocab_size=60)
    assert training.tokenize_lines(raw, other)["train"]._fingerprint != first._fingerprint
    _write_lines(path, [f"a cat number {i} sleeps ." for i in range(50)])
    edited = training.tokenize_lines(training.load_lm_dataset(data_files={"train": str(path)}), bpe)["train"]
    assert edited._fingerprint != first._fingerprint and edited[0]["input_ids"] != first[0]["input_ids"]


def test_generated_readers_are_cached_and_follow_edits(tmp_path):
    """Aligned text and PhraseBank files are written once into the datasets cache, keyed by the
    files' size and modification time: read again unchanged, they reuse it; edited, they are re-read."""
    for lang, word in (("de", "Satz"), ("en", "sentence")):
        _write_lines(tmp_path / f"train.{lang}", [f"{word} {i} ." for i in range(4)])
    files = {"train": str(tmp_path / "train")}
    first = training.load_translation_dataset("de", "en", data_files=files)["train"]
    second = training.load_translation_dataset("de", "en", data_files=files)["train"]
    assert first.cache_files and first.cache_files == second.cache_files
    _write_lines(tmp_path / "train.en", [f"phrase {i} ." for i in range(4)])
    edited = training.load_translation_dataset("de", "en", data_files=files)["train"]
    assert edited[0]["translation"] == {"de": "Satz 0 .", "en": "phrase 0 ."}


# ---------------------------------------------------------------------------------------------
# Batching and collation
# ---------------------------------------------------------------------------------------------

def test_token_budget_batches_respect_budget_and_are_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(500)]
    sampler = training.TokenBudgetBatchSampler(lengths, max_tokens=256, seed=7)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert all(max(lengths[i] for i in b) * len(b) <= 256 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert list(training.TokenBudgetBatchSampler(lengths, max_tokens=256, seed=7)) == batches
    sampler.set_epoch(1)
    assert list(sampler) != batches and len(list(sampler)) == len(batches)
    capped = training.TokenBudgetBatchSampler(lengths, max_tokens=256, max_sentences=5, shuffle=False)
    assert max(len(b) for b in capped) == 5
    with pytest.raises(ValueError, match="example 3 has 90 tokens.*max_tokens=64"):
        training.TokenBudgetBatchSampler([1, 2, 3, 90], max_tokens=64)


def test_token_budget_sharding_gives_equal_counts():
    lengths = [random.Random(1).randint(1, 30) for _ in range(101)] * 1
    full = training.TokenBudgetBatchSampler(lengths, max_tokens=64, seed=3)
    shards = [training.TokenBudgetBatchSampler(lengths, max_tokens=64, seed=3, num_replicas=3, rank=r)
              for r in range(3)]
    counts = {len(list(s)) for s in shards} | {len(s) for s in shards}
    assert counts == {math.ceil(len(full) / 3)}
    assert {i for s in shards for b in s for i in b} == set(range(101))
    assert list(shards[1]) == list(full)[1::3][:len(shards[1])]


def test_padding_collator_for_each_task():
    collate = training.PaddingCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 2], "labels": [7, 2]}, {"input_ids": [5, 2], "labels": [8, 9, 2]}])
    assert batch["input_ids"].tolist() == [[5, 6, 2], [5, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 2, -100], [8, 9, 2]]
    assert "decoder_attention_mask" not in batch
    seq2seq = training.PaddingCollator(pad_token_id=0, decoder_attention_mask=True)
    batch = seq2seq([{"input_ids": [5], "labels": [7, 2]}, {"input_ids": [5], "labels": [8, 9, 2]}])
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    batch = training.PaddingCollator(0, pad_to_multiple_of=4)([{"input_ids": [4, 2], "label": 2}])
    assert batch["input_ids"].tolist() == [[4, 2, 0, 0]] and batch["labels"].tolist() == [2]




def test_shuffled_batches_are_deterministic_per_epoch():
    sampler = training.ShuffledBatchSampler(23, batch_size=5, seed=4)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 5 and [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert sorted(i for b in batches for i in b) == list(range(23))
    assert list(training.ShuffledBatchSampler(23, batch_size=5, seed=4)) == batches
    sampler.set_epoch(1)
    assert list(sampler) != batches
    with pytest.raises(ValueError, match="batch_size must be at least 1; got 0"):
        training.ShuffledBatchSampler(3, batch_size=0)
