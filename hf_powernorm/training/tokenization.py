"""Tokenization: the joint BPE of the paper's recipes and the cached `Dataset.map` passes.

`train_bpe_tokenizer` trains a fairseq-style joint BPE with `tokenizers` (special tokens `<s>`,
`<pad>`, `</s>`, `<unk>` as ids 0-3) and wraps it as a Transformers fast tokenizer that
`AutoTokenizer` loads without remote code; like GPT-2's and Llama's, it leaves a prompt open (no
`</s>` appended). The data passes add what a sequence needs themselves, after asking the tokenizer
what it adds by itself (`special_tokens_added`: BOS, EOS, `[CLS] ... [SEP]`, or nothing), never
assuming it: a source, target or sentence ends in the tokenizer's end token (`sequence_ends`), and a
language-model stream keeps the line breaks of a text file and separates a dataset's documents by
EOS (`tokenize_lines`), as Transformers' `run_clm.py` reads text. The `tokenize_*` functions and
`lm_blocks` are batched `Dataset.map` passes whose cache key is the input dataset's fingerprint, the
pass's own code, the tokenizer's serialisation and the pass's parameters: a second run over the same
data with the same tokenizer reads the Arrow cache instead of tokenizing again
(`overwrite_cache=True` forces the work), and `num_proc` spreads the work over processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import types
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from .options import BadInput, MissingInput

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's dictionary order: ids 0-3

logger = logging.getLogger(__name__)
_PADDED_WITH_EOS: set[str] = set()  # the tokenizers announced: a command loading one again says it once


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                        show_progress: bool = False, model_max_length: int | None = None,
                        append_eos: bool = False):
    """A joint BPE tokenizer trained on `texts`, as a `transformers.PreTrainedTokenizerFast`.

    NFKC normalisation, whitespace kept as `▁` (Metaspace) so decoding restores the text, special
    tokens `<s>` (0), `<pad>` (1), `</s>` (2), `<unk>` (3) as in fairseq's dictionaries and the
    model config's defaults; a line break encodes as `</s>`, which ends each line in training. By default nothing is added to an encoded text, so that a prompt stays
    open for generation (as GPT-2's and Llama's tokenizers leave it); `append_eos=True` appends `</s>`
    to every text (as BART's and Marian's tokenizers end a source or a sentence to classify). Either
    way the data passes end each sequence with one `</s>` (as fairseq appends EOS to source, target
    and language-model lines): the ids they give are the same.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise BadInput(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens; got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress)
    tokenizer.train_from_iterator(texts, trainer)
    # A line break (LF, CRLF or CR, as `read_lines` splits) encodes as the `</s>` that ends each line
    # of the training text: the normalizer writes it as `</s>`, which the special token then matches,
    # so a prompt of several lines is encoded as its lines are in training, with no unknown token.
    line_break = normalizers.Replace(Regex(r"\r\n|\r|\n"), "</s>")
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), line_break])
    tokenizer.add_special_tokens([AddedToken("</s>", special=True, normalized=True)])
    if append_eos:
        eos_id = tokenizer.token_to_id("</s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)])
    extra = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", **extra)


def load_tokenizer(path: str | Path, model_max_length: int | None = None):
    """A saved tokenizer directory, checked to have the pad and EOS tokens the recipes rely on."""
    from transformers import PreTrainedTokenizerFast

    if not Path(path).is_dir():
        raise MissingInput(f"tokenizer directory not found: {path}")
    if not (Path(path) / "tokenizer.json").is_file():
        raise MissingInput(f"{path} holds no tokenizer.json (a fast tokenizer saved with save_pretrained)")
    # The fast-tokenizer class reads tokenizer.json itself: no model config, so no remote-code question.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    # Where it was loaded from, not what it is: kept, they would travel into every export (and to the Hub).
    for name in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(name, None)
    pad_with_eos(tokenizer, str(path))
    if tokenizer.eos_token_id is None:
        raise BadInput(f"tokenizer {path} has no eos_token; the recipes need one")
    if model_max_length:
        tokenizer.model_max_length = model_max_length
        tokenizer.init_kwargs["model_max_length"] = model_max_length
    return tokenizer


def pad_with_eos(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    """The rule for a tokenizer without a padding token (GPT-2's, Llama's), the same in the recipes
    and `hf-powernorm compare`: it pads with its end-of-sequence token, as Transformers' `run_clm.py`
    does (the attention masks and the -100 labels leave padding out of every loss and statistic),
    said once in the log; without an end token either, a ValueError naming the fix."""
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise BadInput(f"the tokenizer of {source} has no padding token and no end-of-sequence token to pad "
                       f"with: set one of its tokens as tokenizer.pad_token and save it with save_pretrained")
    tokenizer.pad_token = tokenizer.eos_token
    if source in _PADDED_WITH_EOS:
        return tokenizer
    _PADDED_WITH_EOS.add(source)
    logger.warning(f"the tokenizer of {source} has no padding token: padding with its end-of-sequence token "
                   f"{tokenizer.eos_token!r} (left out of the loss by the masks)")
    return tokenizer


def has_tokenizer(path: str | Path | None) -> bool:
    """Whether `path` is a folder holding a saved fast tokenizer."""
    return path is not None and (Path(path) / "tokenizer.json").is_file()


def prepare_tokenizer(tokenizer_name: str | None, output_dir: str | Path, vocab_size: int, accelerator,
                      texts: Callable[[], Iterable[str]], model_max_length: int | None = None,
                      append_eos: bool = False):
    """`tokenizer_name` (a saved tokenizer folder), or a BPE trained once on the main process on
    `texts()` (appending `</s>` to each text when `append_eos`), saved to `output_dir/tokenizer` and
    read back by every process."""
    directory = Path(tokenizer_name or Path(output_dir) / "tokenizer")
    with accelerator.main_process_first():
        if tokenizer_name is None and accelerator.is_main_process:
            train_bpe_tokenizer(texts(), vocab_size, show_progress=True, model_max_length=model_max_length,
                                append_eos=append_eos).save_pretrained(directory)
    return load_tokenizer(directory, model_max_length)


def translation_texts(dataset: Dataset, languages: Sequence[str], batch_size: int = 1000) -> Iterator[str]:
    """Every sentence of `languages` in a translation split: the input of a joint BPE."""
    for start in range(0, len(dataset), batch_size):
        for pair in dataset[start:start + batch_size]["translation"]:
            yield from (pair[lang] for lang in languages)


def column_texts(dataset: Dataset, column: str = "text", batch_size: int = 1000) -> Iterator[str]:
    """Every row of a text column, in batches (no full copy of the column in memory)."""
    for start in range(0, len(dataset), batch_size):
        yield from dataset[start:start + batch_size][column]


def special_tokens_added(tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids `tokenizer` puts before and after a text by itself (`add_special_tokens=True`):
    `((), ())` for GPT-2's, `((bos,), ())` for Llama's, `((cls,), (sep,))` for BERT's, `((), (eos,))`
    for one whose post-processor appends `</s>` (this package's tokenizers saved with one)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain):])
    raise BadInput(f"{type(tokenizer).__name__} encodes 'a' as {full} with its special tokens and as {plain} "
                   f"without: expected the second inside the first")


def sequence_ends(tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What encloses one sequence (a source, a target, a sentence, a document): the tokens the
    tokenizer adds before a text by itself, and after it those it adds, else its EOS token (none
    where it has none)."""
    prefix, suffix = special_tokens_added(tokenizer)
    if not suffix and tokenizer.eos_token_id is not None:
        suffix = (tokenizer.eos_token_id,)
    return prefix, suffix


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str],
                 max_length: int | None = None) -> list[list[int]]:
    """The ids of each text enclosed by `sequence_ends`, truncated to `max_length` ids in all (the
    end tokens kept), as a tokenizer that adds them itself gives them with `truncation=True`."""
    prefix, suffix = sequence_ends(tokenizer)
    if max_length is None:
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        room = max_length - len(prefix) - len(suffix)
        if room < 1:
            raise BadInput(f"max_length {max_length} leaves no room for a token between the "
                           f"{len(prefix) + len(suffix)} tokens that enclose a sequence")
        rows = tokenizer(texts, add_special_tokens=False, max_length=room, truncation=True)["input_ids"]
    return [[*prefix, *row, *suffix] for row in rows]


def writes_line_breaks(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` encodes a line break as text that decodes back to it (GPT-2's byte-level
    BPE, Llama's byte fallback), unlike a vocabulary without one, which makes it unknown, drops it,
    or (this package's BPE, trained on lines) encodes it as the `</s>` that ends a line."""
    ids = tokenizer("\n", add_special_tokens=False)["input_ids"]
    return bool(ids) and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == "\n"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what the tokenizer does (its `tokenizer.json` and special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    content += json.dumps(tokenizer.special_tokens_map, sort_keys=True)
    return hashlib.sha256(content.encode("utf-8")).hexdigest()


def function_fingerprint(function: Callable) -> str:
    """A hash of what a map function computes: its compiled code and the plain values (numbers,
    strings) it closes over, so that a changed function never reads an older function's cache.
    Objects it closes over (a tokenizer, a dataset) are keyed by the caller."""
    plain = [cell.cell_contents for cell in function.__closure__ or ()
             if isinstance(cell.cell_contents, (int, float, str, bool, tuple, type(None)))]
    payload = repr((sys.version_info[:2], _code_key(function.__code__), plain)).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()


def _code_key(code: types.CodeType) -> tuple:
    """What a code object computes, in a form that is the same in every process (unlike `marshal`,
    whose output depends on reference counts)."""
    constants = tuple(_code_key(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return code.co_code, constants, code.co_names, code.co_varnames, code.co_freevars


def _fingerprint(dataset: Dataset, function: Callable, *parts: Any) -> str:
    text = json.dumps([dataset._fingerprint, function_fingerprint(function), *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cached_map(dataset: DatasetDict, function: Callable, key: Sequence[Any], *, num_proc: int | None = None,
               overwrite_cache: bool = False, desc: str, **map_kwargs: Any) -> DatasetDict:
    """`Dataset.map(function, batched=True)` on every split, cached under a fingerprint made of the
    split's own fingerprint and `key` (what the function depends on besides its input)."""
    return DatasetDict({
        split: part.map(function, batched=True, num_proc=num_proc, load_from_cache_file=not overwrite_cache,
                        new_fingerprint=_fingerprint(part, function, desc, *key), desc=f"{desc} ({split})",
                        **map_kwargs)
        for split, part in dataset.items()
    })


def tokenize_translation(dataset: DatasetDict, tokenizer, source_lang: str, target_lang: str,
                         max_source_length: int = 256, max_target_length: int = 256, *,
                         num_proc: int | None = None, overwrite_cache: bool = False) -> DatasetDict:
    """`input_ids` from the source and `labels` from the target (both enclosed by `sequence_ends`:
    ending in `</s>`; truncated), and `length`, the longer of the two (for token-budget batching)."""
    def encode(batch: dict[str, list]) -> dict[str, list]:
        sources = [pair[source_lang] for pair in batch["translation"]]
        targets = [pair[target_lang] for pair in batch["translation"]]
        inputs = encode_texts(tokenizer, sources, max_source_length)
        labels = encode_texts(tokenizer, targets, max_target_length)
        return {"input_ids": inputs, "labels": labels, "length": [max(len(a), len(b)) for a, b in zip(inputs, labels)]}

    key = (tokenizer_fingerprint(tokenizer), source_lang, target_lang, max_source_length, max_target_length)
    return cached_map(dataset, encode, key, num_proc=num_proc, overwrite_cache=overwrite_cache,
                      remove_columns=next(iter(dataset.values())).column_names, desc="Tokenizing translation pairs")


def tokenize_classification(dataset: DatasetDict, tokenizer, max_length: int = 256, *,
                            num_proc: int | None = None, overwrite_cache: bool = False) -> DatasetDict:
    """`input_ids` of each sentence (enclosed by `sequence_ends`: ending in `</s>`, or BERT's
    `[CLS] ... [SEP]`; truncated), its integer `label` and `length`."""
    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = encode_texts(tokenizer, batch["text"], max_length)
        return {"input_ids": ids, "label": batch["label"], "length": [len(row) for row in ids]}

    return cached_map(dataset, encode, (tokenizer_fingerprint(tokenizer), max_length), num_proc=num_proc,
                      overwrite_cache=overwrite_cache, remove_columns=["text"], desc="Tokenizing sentences")


def tokenize_lines(dataset: DatasetDict, tokenizer, *, documents: Collection[str] = (), keep_linebreaks: bool = True,
                   num_proc: int | None = None, overwrite_cache: bool = False) -> DatasetDict:
    """`input_ids` of every row of each split, with what follows the row in the language-model
    stream, as Transformers' `run_clm.py` reads text (blank rows included):

    - the rows of a split not in `documents` are lines of a text file, each ending with its line
      break: the text `\\n` where the tokenizer writes one (`writes_line_breaks`: GPT-2's, Llama's),
      else its EOS token (this package's BPE: fairseq's `</s>` at every line end); none with
      `keep_linebreaks=False`. The first line starts with what the tokenizer puts before a text;
    - the rows of a split in `documents` (a `datasets` dataset's) are documents, enclosed by
      `sequence_ends`: what the tokenizer puts before a text (Llama's BOS), and EOS after it.
    """
    line_end = _line_end(tokenizer, keep_linebreaks)
    document_ends = sequence_ends(tokenizer)
    file_start = document_ends[0]  # Llama's BOS opens a file's stream

    def encode_lines(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        texts = [text + line_end for text in batch["text"]] if isinstance(line_end, str) else batch["text"]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids = ids if isinstance(line_end, str) else [[*row, *line_end] for row in ids]
        if indices and indices[0] == 0:
            ids[0] = [*file_start, *ids[0]]
        return {"input_ids": ids}

    def encode_documents(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        prefix, suffix = document_ends
        return {"input_ids": [[*prefix, *row, *suffix]
                              for row in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    unknown = sorted(set(documents) - set(dataset))
    if unknown:
        raise BadInput(f"documents names splits {unknown} that are not among {list(dataset)}")
    out = DatasetDict()
    for split, part in dataset.items():
        function, ends = (encode_documents, document_ends) if split in documents else (encode_lines, line_end)
        out[split] = cached_map(DatasetDict({split: part}), function, (tokenizer_fingerprint(tokenizer), ends),
                                num_proc=num_proc, overwrite_cache=overwrite_cache, remove_columns=["text"],
                                with_indices=True,
                                desc="Tokenizing lines" if function is encode_lines else "Tokenizing documents")[split]
    return out


def _line_end(tokenizer: PreTrainedTokenizerBase, keep_linebreaks: bool) -> str | tuple[int, ...]:
    """What ends a line of a text file in the stream: the text "\\n" where the tokenizer writes it,
    else the ids of its EOS token (none without one, or without `keep_linebreaks`)."""
    if not keep_linebreaks:
        return ()
    if writes_line_breaks(tokenizer):
        return "\n"
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)


def lm_blocks(tokenized: DatasetDict, block_size: int, *, num_proc: int | None = None,
              overwrite_cache: bool = False, lines_per_batch: int = 1000) -> DatasetDict:
    """Fixed-length blocks of each split's token stream (the rows of `tokenize_lines`, in order),
    for a causal LM that shifts its labels internally.

    Consecutive blocks overlap by one token, so every token after the first of the split is a
    prediction target exactly once: the mean NLL over all blocks is the NLL of the whole stream.
    The map works on `lines_per_batch` rows at a time and starts each batch's stream with the
    last token of the stream before it (context only; rows without a token, such as blank lines
    where line breaks are dropped, are passed over), so the batches join without a gap; the last
    block of a batch may be shorter (the collator pads it and masks its labels).
    """
    if block_size < 2:
        raise BadInput(f"block_size must be at least 2; got {block_size}")
    stride = block_size - 1

    def blocks_of(part: Dataset) -> Callable:
        def cut(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
            stream = _token_before(part, indices[0])
            for ids in batch["input_ids"]:
                stream.extend(ids)
            blocks = [stream[s:s + block_size] for s in range(0, len(stream) - 1, stride)]
            return {"input_ids": blocks, "labels": blocks, "length": [len(b) for b in blocks]}
        return cut

    out = DatasetDict()
    for split, part in tokenized.items():
        cut = blocks_of(part)
        if _count_tokens(part, at_most=2) < 2:
            raise BadInput(f"the token stream of split {split!r} has fewer than 2 tokens")
        out[split] = part.map(cut, batched=True, batch_size=lines_per_batch, with_indices=True,
                              num_proc=num_proc, remove_columns=part.column_names,
                              load_from_cache_file=not overwrite_cache,
                              new_fingerprint=_fingerprint(part, cut, "blocks", block_size, lines_per_batch),
                              desc=f"Cutting {block_size}-token blocks ({split})")
    return out


def _token_before(part: Dataset, index: int) -> list[int]:
    """The last token of the stream before row `index` (`[]` at its start), past rows without one."""
    while index > 0:
        index -= 1
        ids = part[index]["input_ids"]
        if ids:
            return [ids[-1]]
    return []


def _count_tokens(part: Dataset, at_most: int, batch_size: int = 1000) -> int:
    """The tokens of a split's stream, counted until `at_most` are found."""
    total = 0
    for start in range(0, len(part), batch_size):
        total += sum(map(len, part[start:start + batch_size]["input_ids"]))
        if total >= at_most:
            return total
    return total


def sequence_lengths(dataset: Dataset, columns: Sequence[str] = ("input_ids", "labels")) -> list[int]:
    """Per-example length for batching: the `length` column the tokenizing passes write, else the
    longest of the given sequence columns."""
    if "length" in dataset.column_names:
        return list(dataset["length"])
    present = [c for c in columns if c in dataset.column_names]
    if not present:
        raise BadInput(f"none of the columns {list(columns)} in {dataset.column_names}")
    columns_lengths = [map(len, dataset[c]) for c in present]
    return [max(lens) for lens in zip(*columns_lengths)]
