"""Shared helpers for the training recipes (`train_wmt.py`, `train_lm.py`, `train_classification.py`).

The recipes follow the paper's experimental setup (Shen et al., "PowerNorm: Rethinking Batch
Normalization in Transformers", ICML 2020, Section 5 and Appendix A): fairseq-style translation
training with joint BPE, token-budget batches, Adam (0.9, 0.98), an inverse-square-root schedule
with linear warmup, label smoothing and checkpoint averaging; language modelling on a token stream;
sentence classification. This module holds everything that does not depend on the model:

- data readers returning `datasets.DatasetDict` (local files, Hub datasets, embedded default corpora),
- a deterministic synthetic German/English grammar that generates the default corpora offline,
- joint BPE training with `tokenizers`, wrapped as a Transformers fast tokenizer,
- token-budget batching and padding collation,
- optimizer, learning-rate schedule, losses, perplexity and the local `evaluate` metrics,
- checkpoint directory discovery shared with `average_checkpoints.py`.

The Accelerate side (arguments, loaders, the training loop, checkpoints, export) is in
`recipe_training.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, DatasetDict
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Sampler

RECIPES_DIR = Path(__file__).resolve().parent
METRICS_DIR = RECIPES_DIR / "metrics"
SPLITS = ("train", "validation", "test")
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's dictionary order: ids 0-3
SENTIMENT_LABELS = ("negative", "neutral", "positive")
IGNORE_INDEX = -100
_JSON_SUFFIXES = (".json", ".jsonl")
_TRUTHY = {"1", "on", "yes", "true"}


# ---------------------------------------------------------------------------------------------
# Synthetic German/English grammar: the embedded default corpora
# ---------------------------------------------------------------------------------------------

# (gender, German singular, German plural, English singular, English plural)
_NOUNS = (
    ("m", "Hund", "Hunde", "dog", "dogs"), ("m", "Mann", "Männer", "man", "men"),
    ("m", "Lehrer", "Lehrer", "teacher", "teachers"), ("m", "Vogel", "Vögel", "bird", "birds"),
    ("m", "Apfel", "Äpfel", "apple", "apples"), ("m", "Ball", "Bälle", "ball", "balls"),
    ("m", "Tisch", "Tische", "table", "tables"), ("m", "Brief", "Briefe", "letter", "letters"),
    ("m", "Arzt", "Ärzte", "doctor", "doctors"), ("m", "König", "Könige", "king", "kings"),
    ("f", "Katze", "Katzen", "cat", "cats"), ("f", "Frau", "Frauen", "woman", "women"),
    ("f", "Blume", "Blumen", "flower", "flowers"), ("f", "Stadt", "Städte", "city", "cities"),
    ("f", "Lampe", "Lampen", "lamp", "lamps"), ("f", "Maus", "Mäuse", "mouse", "mice"),
    ("f", "Tür", "Türen", "door", "doors"), ("f", "Schule", "Schulen", "school", "schools"),
    ("n", "Kind", "Kinder", "child", "children"), ("n", "Haus", "Häuser", "house", "houses"),
    ("n", "Buch", "Bücher", "book", "books"), ("n", "Pferd", "Pferde", "horse", "horses"),
    ("n", "Auto", "Autos", "car", "cars"), ("n", "Mädchen", "Mädchen", "girl", "girls"),
    ("n", "Fenster", "Fenster", "window", "windows"), ("n", "Schiff", "Schiffe", "ship", "ships"),
)
# (German 3rd singular, German 3rd plural, English 3rd singular, English plural)
_TRANSITIVE = (
    ("sieht", "sehen", "sees", "see"), ("kauft", "kaufen", "buys", "buy"),
    ("findet", "finden", "finds", "find"), ("liebt", "lieben", "loves", "love"),
    ("hört", "hören", "hears", "hear"), ("malt", "malen", "paints", "paint"),
    ("sucht", "suchen", "looks for", "look for"), ("trägt", "tragen", "carries", "carry"),
    ("baut", "bauen", "builds", "build"), ("zeigt", "zeigen", "shows", "show"),
    ("öffnet", "öffnen", "opens", "open"), ("vergisst", "vergessen", "forgets", "forget"),
)
_INTRANSITIVE = (
    ("schläft", "schlafen", "sleeps", "sleep"), ("lacht", "lachen", "laughs", "laugh"),
    ("läuft", "laufen", "runs", "run"), ("singt", "singen", "sings", "sing"),
    ("wartet", "warten", "waits", "wait"), ("schwimmt", "schwimmen", "swims", "swim"),
)
# (German stem, English): the German ending depends on article, case, gender and number.
_ADJECTIVES = (
    ("groß", "big"), ("klein", "small"), ("alt", "old"), ("jung", "young"), ("rot", "red"),
    ("blau", "blue"), ("schnell", "fast"), ("langsam", "slow"), ("schön", "beautiful"),
    ("neu", "new"), ("müd", "tired"), ("klug", "clever"),
)
_NUMBERS = (
    ("zwei", "two"), ("drei", "three"), ("vier", "four"), ("fünf", "five"), ("sechs", "six"),
    ("sieben", "seven"), ("acht", "eight"), ("neun", "nine"), ("zehn", "ten"), ("elf", "eleven"),
    ("zwölf", "twelve"),
)
_ADVERBS = (("heute", "today"), ("jetzt", "now"), ("manchmal", "sometimes"),
            ("leider", "unfortunately"), ("hier", "here"))
_SUBORDINATORS = (("weil", "because"), ("während", "while"), ("obwohl", "although"), ("wenn", "when"))
_REPORTING = (("glaubt", "glauben", "believes", "believe"), ("sagt", "sagen", "says", "say"),
              ("weiß", "wissen", "knows", "know"))
_DEF_ARTICLE = {("nom", "m"): "der", ("nom", "f"): "die", ("nom", "n"): "das",
                ("acc", "m"): "den", ("acc", "f"): "die", ("acc", "n"): "das"}
_INDEF_ARTICLE = {("nom", "m"): "ein", ("nom", "f"): "eine", ("nom", "n"): "ein",
                  ("acc", "m"): "einen", ("acc", "f"): "eine", ("acc", "n"): "ein"}
_WEAK_ENDING = {("nom", "m"): "e", ("nom", "f"): "e", ("nom", "n"): "e",
                ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "e"}
_MIXED_ENDING = {("nom", "m"): "er", ("nom", "f"): "e", ("nom", "n"): "es",
                 ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "es"}


@dataclass
class _Phrase:
    de: list[str]
    en: list[str]
    plural: bool = False


def _noun_phrase(rng: random.Random, case: str) -> _Phrase:
    """A German noun phrase inflected for `case` and its English translation."""
    gender, de_sg, de_pl, en_sg, en_pl = rng.choice(_NOUNS)
    adjective = rng.choice(_ADJECTIVES) if rng.random() < 0.5 else None
    kind = rng.choice(("definite", "definite", "indefinite", "plural", "number"))
    key = (case, gender)
    if kind == "definite":
        de, en, ending, noun = [_DEF_ARTICLE[key]], ["the"], _WEAK_ENDING[key], (de_sg, en_sg)
    elif kind == "indefinite":
        first = adjective[1] if adjective else en_sg
        article = "an" if first[0] in "aeiou" else "a"
        de, en, ending, noun = [_INDEF_ARTICLE[key]], [article], _MIXED_ENDING[key], (de_sg, en_sg)
    elif kind == "plural":
        de, en, ending, noun = ["die"], ["the"], "en", (de_pl, en_pl)
    else:
        number = rng.choice(_NUMBERS)
        de, en, ending, noun = [number[0]], [number[1]], "e", (de_pl, en_pl)
    if adjective:
        de.append(adjective[0] + ending)
        en.append(adjective[1])
    return _Phrase(de + [noun[0]], en + [noun[1]], plural=kind in ("plural", "number"))


def _clause(rng: random.Random) -> tuple[_Phrase, list[str], list[str], _Phrase | None]:
    """Subject, German verb, English verb and optional object of one clause."""
    subject = _noun_phrase(rng, "nom")
    number = 1 if subject.plural else 0
    if rng.random() < 0.7:
        verb = rng.choice(_TRANSITIVE)
        return subject, [verb[number]], verb[2 + number].split(), _noun_phrase(rng, "acc")
    verb = rng.choice(_INTRANSITIVE)
    return subject, [verb[number]], [verb[2 + number]], None


def _main_order(rng: random.Random) -> tuple[list[str], list[str]]:
    """German verb-second main clause, optionally fronted by an adverb (subject-verb inversion)."""
    subject, de_verb, en_verb, obj = _clause(rng)
    de_obj, en_obj = (obj.de, obj.en) if obj else ([], [])
    if rng.random() < 0.3:
        de_adv, en_adv = rng.choice(_ADVERBS)
        return [de_adv, *de_verb, *subject.de, *de_obj], [en_adv, *subject.en, *en_verb, *en_obj]
    return [*subject.de, *de_verb, *de_obj], [*subject.en, *en_verb, *en_obj]


def _subordinate(rng: random.Random) -> tuple[list[str], list[str]]:
    """A German subordinate clause: the finite verb goes to the end."""
    subject, de_verb, en_verb, obj = _clause(rng)
    de_obj, en_obj = (obj.de, obj.en) if obj else ([], [])
    return [*subject.de, *de_obj, *de_verb], [*subject.en, *en_verb, *en_obj]


def _sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One German sentence and its English translation, both tokenized with spaces."""
    shape = rng.random()
    de, en = _main_order(rng)
    if shape < 0.3:
        sub_de, sub_en = _subordinate(rng)
        conj_de, conj_en = rng.choice(_SUBORDINATORS)
        de, en = [*de, ",", conj_de, *sub_de], [*en, ",", conj_en, *sub_en]
    elif shape < 0.45:
        speaker = _noun_phrase(rng, "nom")
        verb = rng.choice(_REPORTING)
        number = 1 if speaker.plural else 0
        sub_de, sub_en = _subordinate(rng)
        de = [*speaker.de, verb[number], ",", "dass", *sub_de]
        en = [*speaker.en, verb[2 + number], "that", *sub_en]
    elif shape < 0.55:
        other_de, other_en = _main_order(rng)
        de, en = [*de, "und", *other_de], [*en, "and", *other_en]
    return _capitalize(" ".join(de + ["."])), _capitalize(" ".join(en + ["."]))


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _unique_samples(make: Callable[[random.Random], Any], sizes: dict[str, int], seed: int,
                    key: Callable[[Any], str]) -> dict[str, list[Any]]:
    """Draw distinct samples for every split: no sentence appears in two splits."""
    rng, seen, out = random.Random(seed), set(), {}
    for split, size in sizes.items():
        out[split] = []
        while len(out[split]) < size:
            sample = make(rng)
            if key(sample) not in seen:
                seen.add(key(sample))
                out[split].append(sample)
    return out


def synthetic_translation_corpus(source_lang: str = "de", target_lang: str = "en",
                                 sizes: dict[str, int] | None = None, seed: int = 0) -> DatasetDict:
    """The embedded German<->English translation corpus, generated deterministically from `seed`.

    Every pair follows a small grammar: article/adjective inflection by case, gender and number,
    verb-second order after a fronted adverb, and verb-final order in subordinate clauses.
    """
    pair = {source_lang, target_lang}
    if pair != {"de", "en"}:
        raise ValueError(f"the embedded translation corpus is German/English (de, en); got the pair "
                         f"{source_lang}-{target_lang}. Pass --train_file etc. for other languages.")
    sizes = sizes or {"train": 4000, "validation": 300, "test": 300}
    pairs = _unique_samples(_sentence_pair, sizes, seed, key=lambda p: p[0])
    return DatasetDict({
        split: Dataset.from_dict({"translation": [{"de": de, "en": en} for de, en in rows]})
        for split, rows in pairs.items()
    })


def synthetic_lm_corpus(sizes: dict[str, int] | None = None, seed: int = 1) -> DatasetDict:
    """The embedded language-modelling corpus: English sentences of the translation grammar."""
    sizes = sizes or {"train": 6000, "validation": 400, "test": 400}
    lines = _unique_samples(lambda rng: _sentence_pair(rng)[1], sizes, seed, key=lambda s: s)
    return DatasetDict({split: Dataset.from_dict({"text": rows}) for split, rows in lines.items()})


_SENTIMENT_SUBJECTS = ("the film", "the service", "the hotel", "the food", "the new phone",
                       "the staff", "the outlook", "the quarterly report", "the product launch",
                       "the customer support", "the delivery", "the merger")
_POSITIVE_CUES = ("good", "great", "excellent", "impressive", "strong", "pleasant", "reliable")
_NEGATIVE_CUES = ("bad", "poor", "terrible", "weak", "disappointing", "awful", "unreliable")
_NEUTRAL_PREDICATES = ("scheduled for monday", "described in the annual report", "based in helsinki",
                       "available in three colours", "handled by a subsidiary", "due next year",
                       "listed on the website", "similar to last year")
_INTENSIFIERS = ("", "", "very", "really", "quite", "extremely")
_METRICS = (("net sales", "were"), ("operating profit", "was"), ("revenue", "was"),
            ("the share price", "was"), ("orders", "were"), ("earnings", "were"))
_UP_VERBS = ("rose", "increased", "grew", "improved")
_DOWN_VERBS = ("fell", "decreased", "dropped", "declined")
_CONTEXTS = ("", "", "according to the company ,", "in the third quarter ,", "last year ,")


def _opinion(rng: random.Random) -> tuple[str, str]:
    """`<subject> was [not] [very] <cue>`: negation flips the polarity of the cue word."""
    label = rng.choice(SENTIMENT_LABELS)
    subject, verb = rng.choice(_SENTIMENT_SUBJECTS), rng.choice(("was", "is"))
    if label == "neutral":
        return f"{subject} {verb} {rng.choice(_NEUTRAL_PREDICATES)}", label
    negate = rng.random() < 0.3
    polar = label if not negate else ("positive" if label == "negative" else "negative")
    cue = rng.choice(_POSITIVE_CUES if polar == "positive" else _NEGATIVE_CUES)
    words = [subject, verb, "not" if negate else "", rng.choice(_INTENSIFIERS), cue]
    return " ".join(w for w in words if w), label


def _financial(rng: random.Random) -> tuple[str, str]:
    """`<metric> rose|fell by N %` (or `did not rise`), or a neutral statement of the figure."""
    label, (metric, be) = rng.choice(SENTIMENT_LABELS), rng.choice(_METRICS)
    context, amount = rng.choice(_CONTEXTS), f"{rng.randint(1, 40)}.{rng.randint(0, 9)}"
    if label == "neutral":
        body = rng.choice((f"{metric} {be} eur {amount} mn", f"{metric} remained unchanged",
                           f"the company will report {metric} in march"))
    elif rng.random() < 0.25:
        verb = "rise" if label == "negative" else "fall"
        body = f"{metric} did not {verb}"
    else:
        body = f"{metric} {rng.choice(_UP_VERBS if label == 'positive' else _DOWN_VERBS)} by {amount} %"
    return f"{context} {body}".strip(), label


def _sentiment_example(rng: random.Random) -> tuple[str, str]:
    text, label = (_opinion if rng.random() < 0.5 else _financial)(rng)
    return _capitalize(text) + " .", label


def synthetic_classification_corpus(sizes: dict[str, int] | None = None, seed: int = 2) -> DatasetDict:
    """The embedded three-way sentiment corpus (negative/neutral/positive, with negation)."""
    sizes = sizes or {"train": 3000, "validation": 300, "test": 300}
    rows = _unique_samples(_sentiment_example, sizes, seed, key=lambda s: s[0])
    return DatasetDict({
        split: _labelled_dataset([t for t, _ in r], [SENTIMENT_LABELS.index(l) for _, l in r],
                                 SENTIMENT_LABELS)
        for split, r in rows.items()
    })


# ---------------------------------------------------------------------------------------------
# Data readers
# ---------------------------------------------------------------------------------------------

def data_files_from_args(train_file: str | None = None, validation_file: str | None = None,
                         test_file: str | None = None) -> dict[str, str]:
    """The `{split: path}` mapping of the recipes' `--train_file/--validation_file/--test_file`."""
    files = {"train": train_file, "validation": validation_file, "test": test_file}
    return {split: path for split, path in files.items() if path}


def hf_offline() -> bool:
    """Whether Hugging Face Hub access is switched off (`HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE`)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("HF_DATASETS_OFFLINE", ""))
    return any(f.strip().lower() in _TRUTHY for f in flags) or bool(datasets.config.HF_HUB_OFFLINE)


class OncePerMessage(logging.Filter):
    """Lets each distinct message of a logger through once (e.g. sacrebleu's warning about
    tokenized periods, which it repeats at every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def load_hub_dataset(name: str, config: str | None = None) -> DatasetDict:
    """`datasets.load_dataset(name, config)`, failing clearly when the Hub cannot be reached. In
    offline mode a dataset that `datasets` has cached still loads."""
    advice = ("pass local files with --train_file/--validation_file/--test_file, or leave out "
              "--dataset_name to use the embedded default corpus")
    try:
        return datasets.load_dataset(name, config)
    except ConnectionError as error:
        if hf_offline():
            raise RuntimeError(f"--dataset_name {name!r} needs the Hugging Face Hub, but offline mode is on "
                               f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and it is not in the datasets cache; "
                               f"{advice}") from error
        raise RuntimeError(f"could not download --dataset_name {name!r} ({error}); {advice}") from error


def _check_file(path: str | Path, what: str = "data file") -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    return path


def _check_splits(dataset: DatasetDict, origin: str) -> DatasetDict:
    if "train" not in dataset and "validation" not in dataset and "test" not in dataset:
        raise ValueError(f"{origin} has none of the splits {SPLITS}; found {list(dataset)}")
    for split, part in dataset.items():
        if len(part) == 0:
            raise ValueError(f"split {split!r} of {origin} is empty")
    return dataset


def _read_lines(path: Path) -> list[str]:
    """Lines of a text file: UTF-8, else Latin-1; LF, CRLF or CR line ends.

    `str.splitlines` is not used because it also breaks at U+0085, which Latin-1 decodes from 0x85.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def _translation_from_prefix(prefix: str, source_lang: str, target_lang: str) -> Dataset:
    """Two aligned plain-text files `{prefix}.{source_lang}` and `{prefix}.{target_lang}`."""
    paths = [Path(f"{prefix}.{lang}") for lang in (source_lang, target_lang)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        found = sorted(p.suffix[1:] for p in Path(prefix).parent.glob(Path(prefix).name + ".*"))
        raise FileNotFoundError(
            f"language pair {source_lang}-{target_lang}: {', '.join(map(str, missing))} not found; "
            f"languages found for prefix {prefix!r}: {found or 'none'}")
    source, target = (_read_lines(p) for p in paths)
    if len(source) != len(target):
        raise ValueError(f"{paths[0]} has {len(source)} lines but {paths[1]} has {len(target)}: "
                         f"parallel files must be aligned line by line")
    rows = [{source_lang: s, target_lang: t} for s, t in zip(source, target)]
    return Dataset.from_dict({"translation": rows})


def _translation_languages(dataset: Dataset) -> list[str]:
    feature = dataset.features.get("translation")
    if feature is None:
        raise ValueError(f"translation data needs a 'translation' column; found {dataset.column_names}")
    languages = getattr(feature, "languages", None)
    return sorted(languages) if languages is not None else sorted(feature)


def load_translation_dataset(source_lang: str, target_lang: str, *, dataset_name: str | None = None,
                             dataset_config: str | None = None,
                             data_files: dict[str, str] | None = None) -> DatasetDict:
    """Translation pairs as a `DatasetDict` with a `translation` column `{lang: text}`.

    `data_files` maps splits to either JSON-lines files (`{"translation": {"de": ..., "en": ...}}`)
    or path prefixes of aligned plain-text files (`data/train` -> `data/train.de`, `data/train.en`).
    With neither `dataset_name` nor `data_files`, the embedded synthetic corpus is returned.
    """
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
    elif data_files:
        dataset, origin = DatasetDict(), "the translation files"
        for split, path in data_files.items():
            if str(path).endswith(_JSON_SUFFIXES):
                part = datasets.load_dataset("json", data_files=str(_check_file(path)), split="train")
            else:
                part = _translation_from_prefix(str(path), source_lang, target_lang)
            dataset[split] = part
    else:
        dataset, origin = synthetic_translation_corpus(source_lang, target_lang), "the embedded corpus"
    _check_splits(dataset, origin)
    for split, part in dataset.items():
        languages = _translation_languages(part)
        if source_lang not in languages or target_lang not in languages:
            raise ValueError(f"language pair {source_lang}-{target_lang} not in split {split!r} of "
                             f"{origin}; languages found: {languages}")
    return dataset


def load_lm_dataset(*, dataset_name: str | None = None, dataset_config: str | None = None,
                    data_files: dict[str, str] | None = None) -> DatasetDict:
    """Language-modelling text as a `DatasetDict` with one `text` column (one line per row).

    Local files are plain text (`.txt`, `.raw`, `.tokens`, ...) or JSON lines with a `text` field.
    Hub datasets with a `sentence` column (e.g. `ptb_text_only`) are renamed to `text`.
    """
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
    elif data_files:
        dataset, origin = DatasetDict(), "the text files"
        for split, path in data_files.items():
            builder = "json" if str(path).endswith(_JSON_SUFFIXES) else "text"
            dataset[split] = datasets.load_dataset(builder, data_files=str(_check_file(path)),
                                                   split="train")
    else:
        dataset, origin = synthetic_lm_corpus(), "the embedded corpus"
    dataset = DatasetDict({s: _rename_text_column(d, origin) for s, d in dataset.items()})
    return _check_splits(DatasetDict({s: d.select_columns(["text"]) for s, d in dataset.items()}),
                         origin)


def _rename_text_column(dataset: Dataset, origin: str) -> Dataset:
    if "text" in dataset.column_names:
        return dataset
    if "sentence" in dataset.column_names:
        return dataset.rename_column("sentence", "text")
    raise ValueError(f"{origin} needs a 'text' or 'sentence' column; found {dataset.column_names}")


# ---------------------------------------------------------------------------------------------
# Classification data
# ---------------------------------------------------------------------------------------------

def _labelled_dataset(texts: list[str], labels: list[int], label_names: Sequence[str]) -> Dataset:
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": ClassLabel(names=list(label_names))})
    return Dataset.from_dict({"text": texts, "label": labels}, features=features)


def label_to_id(label: Any, label_names: Sequence[str], where: str) -> int:
    """The index of `label` (a name, or an integer index) in `label_names`."""
    if isinstance(label, str) and label.strip() in label_names:
        return list(label_names).index(label.strip())
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(label_names):
        return label
    raise ValueError(f"unknown label {label!r} in {where}; expected one of {list(label_names)} "
                     f"or an index below {len(label_names)}")


def read_phrasebank(path: str | Path, label_names: Sequence[str] = SENTIMENT_LABELS) -> Dataset:
    """A Financial PhraseBank file: one `sentence@label` per line, UTF-8 or Latin-1."""
    path = _check_file(path)
    texts, labels = [], []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        if "@" not in line:
            raise ValueError(f"{path}:{number}: expected 'sentence@label', got {line[:80]!r}")
        text, label = line.rsplit("@", 1)
        texts.append(text.strip())
        labels.append(label_to_id(label, label_names, f"{path}:{number}"))
    return _labelled_dataset(texts, labels, label_names)


def _read_labelled_table(path: str, label_names: Sequence[str]) -> Dataset:
    """CSV or JSON lines with a `text` (or `sentence`) column and a `label` column."""
    builder = "json" if path.endswith(_JSON_SUFFIXES) else "csv"
    table = datasets.load_dataset(builder, data_files=str(_check_file(path)), split="train")
    table = _rename_text_column(table, path)
    if "label" not in table.column_names:
        raise ValueError(f"{path} needs a 'label' column; found {table.column_names}")
    labels = [label_to_id(v, label_names, f"{path} row {i + 1}") for i, v in enumerate(table["label"])]
    return _labelled_dataset(table["text"], labels, label_names)


def split_train(dataset: DatasetDict, validation_fraction: float = 0.1, test_fraction: float = 0.1,
                seed: int = 0) -> DatasetDict:
    """Carve deterministic validation/test splits out of `train` when they are missing."""
    missing = [s for s in ("validation", "test") if s not in dataset]
    if not missing or "train" not in dataset:
        return dataset
    fractions = {"validation": validation_fraction, "test": test_fraction}
    train, out = dataset["train"], DatasetDict(dataset)
    for split in missing:
        size = max(1, round(fractions[split] * len(dataset["train"])))
        parts = train.train_test_split(test_size=size, seed=seed, shuffle=True)
        train, out[split] = parts["train"], parts["test"]
    out["train"] = train
    return out


def load_classification_dataset(*, dataset_name: str | None = None, dataset_config: str | None = None,
                                data_files: dict[str, str] | None = None,
                                label_names: Sequence[str] = SENTIMENT_LABELS,
                                seed: int = 0) -> DatasetDict:
    """Sentence classification as a `DatasetDict` with `text` and a `ClassLabel` `label` column.

    Local files: `.csv`, `.json`/`.jsonl` (columns text or sentence, and label), or `.txt` in the
    Financial PhraseBank `sentence@label` format. Missing validation/test splits are carved out of
    train (10% each, seeded).
    """
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
        dataset = DatasetDict({s: _rename_text_column(d, origin) for s, d in dataset.items()})
    elif data_files:
        dataset, origin = DatasetDict(), "the classification files"
        for split, path in data_files.items():
            is_table = str(path).endswith(_JSON_SUFFIXES + (".csv",))
            dataset[split] = (_read_labelled_table(str(path), label_names) if is_table
                              else read_phrasebank(path, label_names))
    else:
        dataset, origin = synthetic_classification_corpus(), "the embedded corpus"
    return split_train(_check_splits(dataset, origin), seed=seed)


def label_names_of(dataset: DatasetDict) -> list[str]:
    """The class names of a classification `DatasetDict` (for `id2label` in the model config)."""
    feature = next(iter(dataset.values())).features["label"]
    if not isinstance(feature, ClassLabel):
        raise ValueError(f"the 'label' column must be a ClassLabel with names; got {feature}")
    return list(feature.names)


# ---------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------

def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                        show_progress: bool = False):
    """A joint BPE tokenizer trained on `texts`, as a `transformers.PreTrainedTokenizerFast`.

    NFKC normalisation, whitespace kept as `▁` (Metaspace) so decoding restores the text, special
    tokens `<s>` (0), `<pad>` (1), `</s>` (2), `<unk>` (3) as in fairseq's dictionaries and the
    model config's defaults, and `</s>` appended to every sequence (as fairseq appends EOS to
    source, target and language-model lines).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens; got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress)
    tokenizer.train_from_iterator(texts, trainer)
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def load_tokenizer(path: str | Path):
    """A saved tokenizer directory, checked to have the pad and EOS tokens the recipes rely on."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # Where it was loaded from, not what it is: kept, they would travel into every export (and to the Hub).
    for name in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(name, None)
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"tokenizer {path} has no {name.removesuffix('_id')}; the recipes need one")
    return tokenizer


def prepare_tokenizer(args: argparse.Namespace, accelerator, texts: Callable[[], Iterable[str]]):
    """`--tokenizer_name`, or a BPE trained once on the main process, saved, and read by every process."""
    directory = Path(args.tokenizer_name or Path(args.output_dir) / "tokenizer")
    with accelerator.main_process_first():
        if args.tokenizer_name is None and accelerator.is_main_process:
            train_bpe_tokenizer(texts(), args.vocab_size, show_progress=True).save_pretrained(directory)
    return load_tokenizer(directory)


def translation_texts(dataset: Dataset, languages: Sequence[str], batch_size: int = 1000) -> Iterator[str]:
    """Every sentence of `languages` in a translation split: the input of a joint BPE."""
    for start in range(0, len(dataset), batch_size):
        for pair in dataset[start:start + batch_size]["translation"]:
            yield from (pair[lang] for lang in languages)


def column_texts(dataset: Dataset, column: str = "text", batch_size: int = 1000) -> Iterator[str]:
    """Every row of a text column, in batches (no full copy of the column in memory)."""
    for start in range(0, len(dataset), batch_size):
        yield from dataset[start:start + batch_size][column]


def tokenize_translation(dataset: DatasetDict, tokenizer, source_lang: str, target_lang: str,
                         max_length: int = 256, num_proc: int | None = None) -> DatasetDict:
    """`input_ids` from the source and `labels` from the target (both end in `</s>`, truncated)."""
    def encode(batch: dict[str, list]) -> dict[str, list]:
        sources = [pair[source_lang] for pair in batch["translation"]]
        targets = [pair[target_lang] for pair in batch["translation"]]
        encoded = tokenizer(sources, text_target=targets, max_length=max_length, truncation=True)
        return {"input_ids": encoded["input_ids"], "labels": encoded["labels"]}

    return dataset.map(encode, batched=True, num_proc=num_proc,
                       remove_columns=next(iter(dataset.values())).column_names,
                       desc="Tokenizing translation pairs")


def tokenize_classification(dataset: DatasetDict, tokenizer, max_length: int = 256,
                            num_proc: int | None = None) -> DatasetDict:
    """`input_ids` of each sentence (ending in `</s>`, truncated) and its integer `label`."""
    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], max_length=max_length, truncation=True)
        return {"input_ids": encoded["input_ids"], "label": batch["label"]}

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=["text"],
                       desc="Tokenizing sentences")


def token_stream(dataset: Dataset, tokenizer, batch_size: int = 1000) -> list[int]:
    """The concatenated token ids of every line, each line ending in `</s>`."""
    from tqdm.auto import tqdm

    stream: list[int] = []
    batches = _batches(column_texts(dataset), batch_size)
    for texts in tqdm(batches, total=math.ceil(len(dataset) / batch_size), desc="Tokenizing the text stream"):
        for ids in tokenizer(texts)["input_ids"]:
            stream.extend(ids)
    return stream


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def lm_blocks(stream: Sequence[int], block_size: int) -> Dataset:
    """Fixed-length blocks of a token stream for a causal LM that shifts its labels internally.

    Consecutive blocks overlap by one token, so every token after the first is a prediction target
    exactly once: the mean NLL over all blocks is the NLL of the whole stream. The last block may be
    shorter (the collator pads it and masks its labels).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2; got {block_size}")
    if len(stream) < 2:
        raise ValueError(f"the token stream has {len(stream)} tokens; at least 2 are needed")
    stride = block_size - 1
    starts = range(0, len(stream) - 1, stride)
    blocks = [list(stream[s:s + block_size]) for s in starts]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def sequence_lengths(dataset: Dataset, columns: Sequence[str] = ("input_ids", "labels")) -> list[int]:
    """Per-example length for batching: the longest of the given sequence columns."""
    present = [c for c in columns if c in dataset.column_names]
    if not present:
        raise ValueError(f"none of the columns {list(columns)} in {dataset.column_names}")
    columns_lengths = [map(len, dataset[c]) for c in present]
    return [max(lens) for lens in zip(*columns_lengths)]


# ---------------------------------------------------------------------------------------------
# Token-budget batching and collation
# ---------------------------------------------------------------------------------------------

class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-bucketed batches whose padded size (longest length x batch size) is <= `max_tokens`.

    As fairseq's `--max-tokens`: examples are sorted by length (ties broken randomly by seed and
    epoch), cut greedily into batches, and the batch order is shuffled by (seed, epoch). With
    `num_replicas > 1`, batches are dealt round-robin and the list is padded by repeating its first
    batches, so every rank gets the same number. Call `set_epoch` before each epoch.

    Under `accelerator.prepare`, keep `num_replicas=1`: Accelerate shards batch samplers itself
    (round-robin, `even_batches=True`), and `set_epoch` must still be called on this object.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, max_sentences: int | None = None) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}); got {rank}")
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
        if too_long:
            index, length = too_long[0]
            raise ValueError(f"example {index} has {length} tokens, more than max_tokens={max_tokens} "
                             f"({len(too_long)} such examples); raise --max_tokens or lower the "
                             f"maximum sequence length")
        self.lengths, self.max_tokens, self.max_sentences = list(lengths), max_tokens, max_sentences
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        order.sort(key=self.lengths.__getitem__)  # stable: equal lengths keep the random order
        batches, batch, longest = [], [], 0
        for index in order:
            longest_if_added = max(longest, self.lengths[index])
            full = self.max_sentences is not None and len(batch) >= self.max_sentences
            if batch and (longest_if_added * (len(batch) + 1) > self.max_tokens or full):
                batches.append(batch)
                batch, longest_if_added = [], self.lengths[index]
            batch.append(index)
            longest = longest_if_added
        if batch:
            batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._all_batches()
        if not batches:
            return iter(())
        total = len(self) * self.num_replicas
        padded = [batches[i % len(batches)] for i in range(total)]
        return iter(padded[self.rank::self.num_replicas])

    def __len__(self) -> int:
        # The greedy cut depends only on the sorted lengths, so the count is the same every epoch.
        if not hasattr(self, "_num_batches"):
            self._num_batches = len(self._all_batches())
        return math.ceil(self._num_batches / self.num_replicas)


@dataclass
class PaddingCollator:
    """Pads `input_ids` with `pad_token_id`, sequence `labels` with -100, and adds `attention_mask`.

    One collator for the three tasks: seq2seq (`input_ids` + `labels`; the model builds its decoder
    inputs from the labels), causal LM blocks (`labels` equal to `input_ids`) and classification
    (an integer `label`, returned as `labels`). With `decoder_attention_mask=True` the decoder's
    padding is marked too, so norms with batch statistics in the decoder leave it out (decoder
    position t reads label t - 1, so it is real exactly when label t is).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    decoder_attention_mask: bool = False  # seq2seq: mark the decoder positions that have a label

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {"input_ids": self._pad([f["input_ids"] for f in features], self.pad_token_id)}
        batch["attention_mask"] = self._pad([[1] * len(f["input_ids"]) for f in features], 0)
        key = next((k for k in ("labels", "label") if k in features[0]), None)
        if key is None:
            return batch
        labels = [f[key] for f in features]
        if isinstance(labels[0], (list, tuple, torch.Tensor)):
            batch["labels"] = self._pad(labels, IGNORE_INDEX)
            if self.decoder_attention_mask:
                batch["decoder_attention_mask"] = (batch["labels"] != IGNORE_INDEX).long()
        else:
            batch["labels"] = torch.tensor([int(label) for label in labels], dtype=torch.long)
        return batch

    def _pad(self, sequences: list[Sequence[int]], value: int) -> torch.Tensor:
        length = max(len(s) for s in sequences)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = torch.full((len(sequences), length), value, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            out[row, :len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        return out


# ---------------------------------------------------------------------------------------------
# Optimizer, schedule, losses
# ---------------------------------------------------------------------------------------------

def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: parameters with `ndim < 2` (biases, norm weights) get none."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8) -> torch.optim.AdamW:
    """Adam with decoupled weight decay (fairseq's `adam`), betas (0.9, 0.98) as in the paper."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def inverse_sqrt_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                          warmup_init_lr: float = 1e-7) -> LambdaLR:
    """fairseq's `inverse_sqrt`: linear warmup from `warmup_init_lr` to the optimizer's lr over
    `warmup_steps` updates, then lr * sqrt(warmup_steps / step).

    `transformers.get_inverse_sqrt_schedule` has the same decay but warms up from 0, so its first
    update is lost; the paper's recipe starts from 1e-7.
    """
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be at least 1; got {warmup_steps}")
    lrs = [group["lr"] for group in optimizer.param_groups]
    if any(lr <= 0 for lr in lrs):
        raise ValueError(f"the optimizer's learning rate must be positive; got {lrs}")

    def factor(step: int, base_lr: float) -> float:
        if step < warmup_steps:
            return (warmup_init_lr + step * (base_lr - warmup_init_lr) / warmup_steps) / base_lr
        return math.sqrt(warmup_steps / step)

    return LambdaLR(optimizer, [lambda step, lr=lr: factor(step, lr) for lr in lrs])


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored (-100) positions of aligned `logits` and `labels`.

    Computed in float32 whatever the logits' dtype.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed token NLL and scored-token counts, each `(batch,)`.

    `shift=True` for a causal LM (the logits at position t predict the label at t + 1). Per-row
    values can be gathered across processes with `gather_for_metrics` (which drops duplicates).
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="none")
    return nll.view(labels.shape).sum(-1), (labels != IGNORE_INDEX).sum(-1)


def token_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token NLL over the batch and the number of scored tokens."""
    nll, count = sequence_nll(logits, labels, shift)
    return nll.sum(), count.sum()


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp of the mean token NLL over the whole evaluated stream."""
    if num_tokens <= 0:
        raise ValueError(f"perplexity needs at least one scored token; got {num_tokens}")
    mean = float(nll_sum) / int(num_tokens)
    return math.exp(mean) if mean < 700 else float("inf")


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

def load_metric(name: str, **kwargs: Any):
    """One of the `evaluate` metric modules shipped in `recipes/metrics/` (loads offline)."""
    import evaluate

    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        available = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"unknown metric {name!r}; available in {METRICS_DIR}: {available}")
    return evaluate.load(str(path), **kwargs)


def decode_for_bleu(tokenizer, token_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
    """Detokenized text of generated or label ids (-100 and special tokens dropped)."""
    rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else [list(r) for r in token_ids]
    rows = [[t for t in row if t != IGNORE_INDEX] for row in rows]
    return [text.strip() for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


# ---------------------------------------------------------------------------------------------
# Checkpoints and results
# ---------------------------------------------------------------------------------------------

_CHECKPOINT_NAME = re.compile(r"^(?P<prefix>.*?)[_-]?(?P<number>\d+)$")


def list_checkpoints(directory: str | Path, prefix: str | None = None,
                     required_file: str | None = None) -> list[Path]:
    """Checkpoint folders `<prefix>_<N>` (or `<prefix>-<N>`) in `directory`, oldest to newest by N.

    With `prefix=None` the folders must share one prefix (`step_10`, `step_200`); mixing e.g.
    `epoch_*` and `step_*` is an error because their numbers are not comparable.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if path.is_dir() and match and (required_file is None or (path / required_file).is_file()):
            found.setdefault(match["prefix"], []).append((int(match["number"]), path))
    if prefix is not None:
        found = {prefix: found.get(prefix, [])}
    elif len(found) > 1:
        raise ValueError(f"checkpoints in {directory} have several prefixes {sorted(found)}; choose one")
    return [path for _, path in sorted(next(iter(found.values()), []))]


def latest_checkpoint(directory: str | Path, prefix: str | None = None) -> Path | None:
    """The newest checkpoint folder in `directory` (for `--resume_from_checkpoint latest`)."""
    checkpoints = list_checkpoints(directory, prefix)
    return checkpoints[-1] if checkpoints else None


def save_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON (e.g. `all_results.json`)."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
