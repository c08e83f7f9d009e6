"""Data readers: every corpus reaches training as a `datasets.DatasetDict`.

Local files are read by `datasets.load_dataset` (JSON lines, CSV, plain text) or written once into
the `datasets` cache by `Dataset.from_generator` (aligned text files given by prefix, Financial
PhraseBank `sentence@label` files in UTF-8 or Latin-1), so that every split is an Arrow file on
disk: memory stays flat in the corpus size and tokenization is cached (`tokenization.py`). A
generated dataset is keyed by its files' paths, sizes and modification times, so an edited file is
read again. Hub datasets load with `--dataset_name` when the Hub can be reached, or from the cache.
With no data given, the embedded corpora of `corpora.py` are used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
from datasets import ClassLabel, Dataset, DatasetDict

from .checks import check_columns
from .corpora import (
    SENTIMENT_LABELS,
    synthetic_classification_corpus,
    synthetic_lm_corpus,
    synthetic_translation_corpus,
)
from .options import BadInput, MissingInput

SPLITS = ("train", "validation", "test")
_JSON_SUFFIXES = (".json", ".jsonl")
_TABLE_SUFFIXES = (*_JSON_SUFFIXES, ".csv")  # a row per example (a document, for a language model)
_TRUTHY = {"1", "on", "yes", "true"}


def data_files_from_args(train_file: str | None = None, validation_file: str | None = None,
                         test_file: str | None = None) -> dict[str, str]:
    """The `{split: path}` mapping of the recipes' `--train_file/--validation_file/--test_file`."""
    files = {"train": train_file, "validation": validation_file, "test": test_file}
    return {split: path for split, path in files.items() if path}


def hf_offline() -> bool:
    """Whether Hugging Face Hub access is switched off (`HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE`)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("HF_DATASETS_OFFLINE", ""))
    return any(f.strip().lower() in _TRUTHY for f in flags) or bool(datasets.config.HF_HUB_OFFLINE)


def load_hub_dataset(name: str, config: str | None = None) -> DatasetDict:
    """`datasets.load_dataset(name, config)`, failing clearly when the Hub cannot be reached. In
    offline mode a dataset that `datasets` has cached still loads. A folder written by
    `save_to_disk` loads with `load_from_disk` (a single `Dataset` as the train split)."""
    if name.startswith(("/", "./", "../")) and not Path(name).exists():  # a path, not a Hub id
        raise BadInput(f"--dataset_name {name}: no such folder (expected a local folder of data files, a saved "
                       f"dataset's folder or a Hub id)")
    if is_saved_dataset(name):
        saved = datasets.load_from_disk(name)
        return saved if isinstance(saved, DatasetDict) else DatasetDict({"train": saved})
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


def is_saved_dataset(path: str | Path) -> bool:
    """Whether `path` is a folder of `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def rename_columns(part: Dataset, columns: dict[str, str] | None, origin: str) -> Dataset:
    """`part` with the columns the user named (`{reader's name: user's name}`, e.g. `{"text": "body"}`)
    renamed to the names the readers read; a named column that is missing is a ValueError."""
    for standard, given in (columns or {}).items():
        if given is None or given == standard:
            continue
        check_columns(part.column_names, {f"--{standard}_column": given}, origin)
        if standard in part.column_names:
            part = part.remove_columns(standard)
        part = part.rename_column(given, standard)
    return part


def _check_file(path: str | Path, what: str = "data file") -> Path:
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"{what} not found: {path}")
    return path


def _check_splits(dataset: DatasetDict, origin: str) -> DatasetDict:
    if "train" not in dataset and "validation" not in dataset and "test" not in dataset:
        raise BadInput(f"{origin} has none of the splits {SPLITS}; found {list(dataset)}")
    for split, part in dataset.items():
        if len(part) == 0:
            raise BadInput(f"split {split!r} of {origin} is empty")
    return dataset


def _file_signature(*paths: Path) -> tuple[tuple[str, int, int], ...]:
    """What keys a generated dataset in the cache: each file's absolute path, size and mtime."""
    return tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths)


def _text_encoding(path: Path) -> str:
    """UTF-8 (a byte-order mark allowed) if the whole file decodes as such, else Latin-1."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            for _ in iter(lambda: handle.read(1 << 20), ""):
                pass
        return "utf-8-sig"
    except UnicodeDecodeError:
        return "latin-1"


def read_lines(path: str | Path) -> Iterator[str]:
    """The lines of a text file, streamed: UTF-8, else Latin-1; LF, CRLF or CR line ends.

    Text mode's universal newlines break at exactly those three, unlike `str.splitlines`, which
    also breaks at U+0085 (what Latin-1 decodes from byte 0x85).
    """
    path = Path(path)
    with open(path, encoding=_text_encoding(path), newline=None) as handle:
        for line in handle:
            yield line.removesuffix("\n")


def _aligned_rows(paths: tuple[str, ...], languages: tuple[str, ...], signature: Any) -> Iterator[dict[str, Any]]:
    """`{"translation": {lang: line}}` rows of aligned files (`signature` only keys the cache)."""
    for lines in zip(*(read_lines(p) for p in paths)):
        yield {"translation": dict(zip(languages, lines))}


def _translation_from_prefix(prefix: str, source_lang: str, target_lang: str, split: str = "train") -> Dataset:
    """Two aligned plain-text files `{prefix}.{source_lang}` and `{prefix}.{target_lang}`."""
    paths = [Path(f"{prefix}.{lang}") for lang in (source_lang, target_lang)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        found = sorted(p.suffix[1:] for p in Path(prefix).parent.glob(Path(prefix).name + ".*"))
        raise MissingInput(
            f"language pair {source_lang}-{target_lang}: {', '.join(map(str, missing))} not found; "
            f"languages found for prefix {prefix!r}: {found or 'none'}")
    line_counts = [sum(1 for _ in read_lines(p)) for p in paths]
    if line_counts[0] != line_counts[1]:
        raise BadInput(f"{paths[0]} has {line_counts[0]} lines but {paths[1]} has {line_counts[1]}: "
                       f"parallel files must be aligned line by line")
    if line_counts[0] == 0:
        raise BadInput(f"split {split!r} is empty: {paths[0]} and {paths[1]} hold no line")
    columns = {lang: datasets.Value("string") for lang in (source_lang, target_lang)}
    features = datasets.Features({"translation": columns})
    # Tuples, not lists: `from_generator` would shard list arguments over several generator calls.
    return Dataset.from_generator(_aligned_rows, features=features, gen_kwargs={
        "paths": tuple(str(p) for p in paths), "languages": (source_lang, target_lang),
        "signature": _file_signature(*paths)})


def _translation_languages(dataset: Dataset) -> list[str]:
    feature = dataset.features.get("translation")
    if feature is None:
        raise BadInput(f"translation data needs a 'translation' column; found {dataset.column_names}")
    languages = getattr(feature, "languages", None)
    return sorted(languages) if languages is not None else sorted(feature)


def load_translation_dataset(source_lang: str, target_lang: str, *, dataset_name: str | None = None,
                             dataset_config: str | None = None, data_files: dict[str, str] | None = None,
                             columns: dict[str, str] | None = None) -> DatasetDict:
    """Translation pairs as a `DatasetDict` with a `translation` column `{lang: text}`.

    `data_files` maps splits to either JSON-lines files (`{"translation": {"de": ..., "en": ...}}`)
    or path prefixes of aligned plain-text files (`data/train` -> `data/train.de`, `data/train.en`).
    With neither `dataset_name` nor `data_files`, the embedded synthetic corpus is returned.
    `columns` (`{"source": name, "target": name}`) reads pairs from two text columns instead (e.g.
    summarisation's `document` and `summary`; CSV files too), as `source_lang` and `target_lang`.
    """
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
    elif data_files:
        dataset, origin = DatasetDict(), "the translation files"
        for split, path in data_files.items():
            if str(path).endswith(_JSON_SUFFIXES) or (columns and str(path).endswith(".csv")):
                part = read_table(str(path))
            else:
                part = _translation_from_prefix(str(path), source_lang, target_lang, split)
            dataset[split] = part
    else:
        dataset, origin = synthetic_translation_corpus(source_lang, target_lang), "the embedded corpus"
    if columns:
        dataset = DatasetDict({split: _pairs_from_columns(part, columns, (source_lang, target_lang), origin)
                               for split, part in dataset.items()})
    _check_splits(dataset, origin)
    for split, part in dataset.items():
        languages = _translation_languages(part)
        if source_lang not in languages or target_lang not in languages:
            raise BadInput(f"language pair {source_lang}-{target_lang} not in split {split!r} of "
                           f"{origin}; languages found: {languages}")
    return dataset


def _pairs_from_columns(part: Dataset, columns: dict[str, str], languages: tuple[str, str], origin: str) -> Dataset:
    """A `translation` column `{source_lang: source, target_lang: target}` from two text columns."""
    part = rename_columns(part, columns, origin)

    def pairs(batch: dict[str, list]) -> dict[str, list]:
        return {"translation": [dict(zip(languages, pair)) for pair in zip(batch["source"], batch["target"])]}

    return part.map(pairs, batched=True, remove_columns=part.column_names, desc="Pairing columns")


def load_lm_dataset(*, dataset_name: str | None = None, dataset_config: str | None = None,
                    data_files: dict[str, str] | None = None, columns: dict[str, str] | None = None) -> DatasetDict:
    """Language-modelling text as a `DatasetDict` with one `text` column: a line per row (its line
    break left out) of a plain-text file (`.txt`, `.raw`, `.tokens`, ...) or of a local folder of
    them, a document per row of JSON lines with a `text` field, of a CSV file with a `text` column (as
    `run_clm.py` reads them) or of a dataset (`lm_document_splits` tells which); a missing text is an
    empty document.
    Hub datasets with a `sentence` column (e.g. `ptb_text_only`) are renamed to `text`; `columns`
    (`{"text": name}`) names another column.
    """
    named: dict[str, str] = {}  # a data file's split, named by its option in errors
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
    elif data_files:
        dataset, origin = DatasetDict(), "the data files"
        named = {split: f"--{split}_file {path}" for split, path in data_files.items()}
        for split, path in data_files.items():
            builder = "json" if str(path).endswith(_JSON_SUFFIXES) else "csv" if str(path).endswith(".csv") \
                else "text"
            dataset[split] = datasets.load_dataset(builder, data_files=str(_check_file(path)), split="train")
    else:
        dataset, origin = synthetic_lm_corpus(), "the embedded corpus"
    named = {split: named.get(split, origin) for split in dataset}
    dataset = DatasetDict({s: _rename_text_column(rename_columns(d, columns, named[s]), named[s])
                           .select_columns(["text"]) for s, d in dataset.items()})
    return _check_splits(DatasetDict({s: _no_missing_text(d) for s, d in dataset.items()}), origin)


def _no_missing_text(dataset: Dataset) -> Dataset:
    """A missing text (an empty CSV field, a JSON null) as an empty document."""
    if None not in dataset.unique("text"):
        return dataset
    return dataset.map(lambda batch: {"text": [text or "" for text in batch["text"]]}, batched=True)


def lm_document_splits(splits: Iterable[str], *, dataset_name: str | None = None,
                       data_files: dict[str, str] | None = None) -> list[str]:
    """The splits among `splits` whose rows `load_lm_dataset` reads as documents: those of a
    dataset (a Hub id or a saved dataset as `dataset_name`, JSON lines, the embedded corpus), not
    lines of plain text: a plain-text file, or a local folder of them as `dataset_name`, which gives
    the stream that the same files give as data files (`is_text_folder`). A split carved out of
    train (`split_train`) is read as train is."""
    if dataset_name:
        return [] if is_text_folder(dataset_name) else list(splits)
    if not data_files:
        return list(splits)
    return [split for split in splits
            if str(data_files.get(split, data_files.get("train", ""))).endswith(_TABLE_SUFFIXES)]


def is_text_folder(path: str | Path) -> bool:
    """Whether `path` is a local folder of plain-text files, which `datasets` reads with its text
    builder (a line per row), not a saved dataset."""
    if not Path(path).is_dir() or is_saved_dataset(path):
        return False
    return datasets.load_dataset_builder(str(path)).name == "text"


def _rename_text_column(dataset: Dataset, origin: str) -> Dataset:
    if "text" in dataset.column_names:
        return dataset
    if "sentence" in dataset.column_names:
        return dataset.rename_column("sentence", "text")
    raise BadInput(f"{origin} needs a 'text' or 'sentence' column (or --text_column naming one); found "
                   f"{dataset.column_names}")


def label_to_id(label: Any, label_names: Sequence[str], where: str) -> int:
    """The index of `label` (a name, or an integer index) in `label_names`."""
    if isinstance(label, str) and label.strip() in label_names:
        return list(label_names).index(label.strip())
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(label_names):
        return label
    raise BadInput(f"unknown label {label!r} in {where}; expected one of {list(label_names)} "
                   f"or an index below {len(label_names)}")


def _labelled_features(label_names: Sequence[str]) -> datasets.Features:
    return datasets.Features({"text": datasets.Value("string"), "label": ClassLabel(names=list(label_names))})


def _phrasebank_rows(path: str, label_names: tuple[str, ...], signature: Any) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        if "@" not in line:
            raise BadInput(f"{path}:{number}: no label was found: expected 'sentence@label' (or a CSV or JSON "
                           f"lines file with a label column), got {line[:80]!r}")
        text, label = line.rsplit("@", 1)
        yield {"text": text.strip(), "label": label_to_id(label, label_names, f"{path}:{number}")}


def read_phrasebank(path: str | Path, label_names: Sequence[str] = SENTIMENT_LABELS) -> Dataset:
    """A Financial PhraseBank file: one `sentence@label` per line, UTF-8 or Latin-1."""
    path = _check_file(path)
    kwargs = {"path": str(path), "label_names": tuple(label_names), "signature": _file_signature(path)}
    # Checked here, where a bad line's error reaches the caller as it is (inside the generator,
    # `datasets` would wrap it in a generic generation error).
    if not sum(1 for _ in _phrasebank_rows(**kwargs)):
        raise BadInput(f"{path} holds no sentence")
    return Dataset.from_generator(_phrasebank_rows, features=_labelled_features(label_names), gen_kwargs=kwargs)


def read_table(path: str) -> Dataset:
    """A CSV or JSON-lines file as one `Dataset`; a file that is not UTF-8 is a ValueError naming its line."""
    builder = "json" if path.endswith(_JSON_SUFFIXES) else "csv"
    try:
        return datasets.load_dataset(builder, data_files=str(_check_file(path)), split="train")
    except datasets.exceptions.DatasetGenerationError as error:
        line = _first_line_not_utf8(Path(path))
        if line is not None:
            raise BadInput(f"{path}:{line[0]}: not UTF-8 ({line[1]}); save the file as UTF-8") from error
        cause = error
        while cause.__cause__ is not None:  # the parser's own error, under the generation's
            cause = cause.__cause__
        raise BadInput(f"{path} cannot be read as {builder.upper()} ({type(cause).__name__}: {cause})") from error


def _first_line_not_utf8(path: Path) -> tuple[int, str] | None:
    """The number of the first line of `path` that does not decode as UTF-8, and why; None if all do."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return number, f"byte 0x{line[error.start]:02x} at column {error.start + 1}"
    return None


def _read_labelled_table(path: str, label_names: Sequence[str], columns: dict[str, str] | None = None) -> Dataset:
    """CSV or JSON lines with a `text` (or `sentence`) column and a `label` column (or those of `columns`)."""
    table = _rename_text_column(rename_columns(read_table(path), columns, path), path)
    if "label" not in table.column_names:
        raise BadInput(f"{path}: no label was found: expected a 'label' column (or name yours with "
                       f"--label_column); its columns are {table.column_names}")
    return _labels_to_ids(table.select_columns(["text", "label"]), label_names, path)


def _labels_to_ids(table: Dataset, label_names: Sequence[str], where: str) -> Dataset:
    """`table`'s labels (names or indices) as a `ClassLabel` of `label_names`."""

    def to_ids(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return {"label": [label_to_id(v, label_names, f"{where} row {i + 1}")
                          for v, i in zip(batch["label"], indices)]}

    return table.map(to_ids, batched=True, with_indices=True, features=_labelled_features(label_names),
                     desc="Reading labels")


def split_train(dataset: DatasetDict, validation_fraction: float = 0.1, test_fraction: float = 0.1,
                seed: int = 0) -> DatasetDict:
    """Carve deterministic validation/test splits out of `train` when they are missing."""
    missing = [s for s in ("validation", "test") if s not in dataset]
    if not missing or "train" not in dataset:
        return dataset
    fractions = {"validation": validation_fraction, "test": test_fraction}
    train, out = dataset["train"], DatasetDict(dataset)
    sizes = [max(1, round(fractions[split] * len(train))) for split in missing]
    if len(train) <= sum(sizes):
        raise BadInput(f"the training data has {len(train)} example(s): too few to carve {' and '.join(missing)} "
                       f"out of it ({', '.join(f'{fractions[s]:.0%}' for s in missing)}, at least one example each, "
                       f"and some left to train on); give {' and '.join(f'--{s}_file' for s in missing)}, or more data")
    for split, size in zip(missing, sizes):
        parts = train.train_test_split(test_size=size, seed=seed, shuffle=True)
        train, out[split] = parts["train"], parts["test"]
    out["train"] = train
    return out


def load_classification_dataset(*, dataset_name: str | None = None, dataset_config: str | None = None,
                                data_files: dict[str, str] | None = None,
                                label_names: Sequence[str] = SENTIMENT_LABELS,
                                seed: int = 0, columns: dict[str, str] | None = None) -> DatasetDict:
    """Sentence classification as a `DatasetDict` with `text` and a `ClassLabel` `label` column.

    Local files: `.csv`, `.json`/`.jsonl` (columns text or sentence, and label), or `.txt` in the
    Financial PhraseBank `sentence@label` format; `columns` (`{"text": name, "label": name}`) names
    other columns. Missing validation/test splits are carved out of train (10% each, seeded).
    """
    if dataset_name:
        dataset, origin = load_hub_dataset(dataset_name, dataset_config), f"dataset {dataset_name!r}"
        dataset = DatasetDict({s: _rename_text_column(rename_columns(d, columns, origin), origin)
                               for s, d in dataset.items()})
        # Labels stored as plain names or indices (not a ClassLabel) are encoded as local files' are.
        dataset = DatasetDict({s: _labels_to_ids(d.select_columns(["text", "label"]), label_names, f"{origin} {s}")
                               if "label" in d.column_names and not isinstance(d.features["label"], ClassLabel)
                               else d for s, d in dataset.items()})
    elif data_files:
        dataset, origin = DatasetDict(), "the classification files"
        for split, path in data_files.items():
            is_table = str(path).endswith(_JSON_SUFFIXES + (".csv",))
            dataset[split] = (_read_labelled_table(str(path), label_names, columns) if is_table
                              else read_phrasebank(path, label_names))
    else:
        dataset, origin = synthetic_classification_corpus(), "the embedded corpus"
    return split_train(_check_splits(dataset, origin), seed=seed)


def label_names_of(dataset: DatasetDict) -> list[str]:
    """The class names of a classification `DatasetDict` (for `id2label` in the model config)."""
    feature = next(iter(dataset.values())).features["label"]
    if not isinstance(feature, ClassLabel):
        raise BadInput(f"the 'label' column must be a ClassLabel with names; got {feature}")
    return list(feature.names)


def limit_samples(dataset: Dataset, max_samples: int | None) -> Dataset:
    """The first `max_samples` examples (`--max_train_samples`, `--max_eval_samples`), or all."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    return dataset.select(range(max_samples))


def limit_splits(dataset: DatasetDict, max_train_samples: int | None,
                 max_eval_samples: int | None) -> DatasetDict:
    """`train` cut to `max_train_samples`, every other split to `max_eval_samples`."""
    return DatasetDict({split: limit_samples(part, max_train_samples if split == "train" else max_eval_samples)
                        for split, part in dataset.items()})
