"""The language-model data path on the tokenizers people have, as Transformers' `run_clm.py` reads
text: line breaks kept (or dropped with `--no_keep_linebreaks`), blank lines in the stream, a
dataset's rows separated by EOS, whatever a tokenizer adds by itself detected (a GPT-2-style
byte-level BPE built here, one that prepends BOS, BERT's `[CLS] ... [SEP]`, this package's BPE with
and without an appending post-processor); the studies' token streams held to their hashes; an
exported language model continues a prompt; `compare` on a GPT-2-style model and such a tokenizer."""

import hashlib
import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from hf_powernorm import compare, training
from hf_powernorm.training import language_modeling, readers, tokenization
from hf_powernorm.training.tasks import get_task

from recipe_scripts import lm_text_files, train_lm

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")

_SPEAKERS = ("First Citizen", "Second Citizen", "MENENIUS", "CORIOLANUS", "All")
_WORDS = ("we", "the", "people", "speak", "hear", "me", "you", "are", "resolved", "to", "die", "than",
          "famish", "corn", "at", "our", "own", "price", "let", "us", "kill", "him", "good", "citizens")


def shakespeare_like(lines: int, seed: int = 0) -> str:
    """Speeches as in Tiny Shakespeare: a speaker's line, one to three lines of verse, a blank line."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < lines:
        out.append(f"{rng.choice(_SPEAKERS)}:")
        for _ in range(rng.randint(1, 3)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 9))]
            out.append(" ".join(words).capitalize() + rng.choice((".", ",", "!", "?")))
        out.append("")
    return "".join(line + "\n" for line in out[:lines])


def byte_level_tokenizer(texts, vocab_size: int = 301, bos: bool = False, eos: bool = True):
    """A GPT-2-style tokenizer: byte-level BPE, `<|endoftext|>` its only special token, nothing
    appended to a text (with `bos`, `<|endoftext|>` put before it, as Llama puts `<s>`); no padding
    token, and with `eos=False` no special token at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                               special_tokens=[("<|endoftext|>", 0)])
    if not eos:
        return PreTrainedTokenizerFast(tokenizer_object=backend)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def with_appending_post_processor(tokenizer, folder: Path):
    """`tokenizer` (this package's BPE) saved with the post-processor that appends `</s>` to every text,
    and loaded back: a tokenizer folder as older versions of the package wrote it."""
    from tokenizers import Tokenizer, processors

    tokenizer.save_pretrained(folder)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tokenizer.eos_token_id)])
    backend.save(str(folder / "tokenizer.json"))
    return training.load_tokenizer(folder)


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# The studies' streams and the other tasks' ids, as the package gave them
# --------------------------------------------------------------------------------------------

# sha256 of the token ids of the studies' smoke setup (`lm_split_files(smoke=True)`, the BPE of
# `prepare_lm_data` at vocabulary 120, blocks of 16) and of the translation and classification passes
# on the embedded corpora, computed by the package when its BPE appended `</s>` itself.
SMOKE_HASHES = {
    "bpe_model": "2e362114d203dc4d683015274db4e8c5da7109ae1642875884d20a253bbefe33",
    "lm_blocks": "0f9e090856477aa78fc9ad97c4d13e2dfabfe5b38c0ed775ff347a075cd3af08",
    "lm_lines": "4e50d54a49d1ab5016f28e5a1a4b1a8748b931e9eff2cb44bdc6e42c02a9bf51",
    "lm_rows": "4e50d54a49d1ab5016f28e5a1a4b1a8748b931e9eff2cb44bdc6e42c02a9bf51",
    "translation_256_256": "fad63cecaedd5c1760ef93df85a99f821ac6a90f61b27e208e1d64fa20f90a03",
    "translation_9_7": "ff6cc535923c418414c6994f31365b5da4180ea55b4e7ce67e239f791b9d6a79",
    "classification_256": "2c92683b581db8398ecb4941c395a7115919df74919e6f55519337682fb66f96",
    "classification_8": "66dee7605218f4f00a174656c346ddf712fb4a7b1bf32594ecaacd8e23b41380",
}
SMOKE_SIZES = {"train": 200, "validation": 30, "test": 30}


def _columns(dataset: DatasetDict, columns) -> dict[str, list]:
    return {split: [list(dataset[split][column]) for column in columns] for split in dataset}


def _ids(dataset: DatasetDict) -> dict[str, list]:
    return {split: list(dataset[split]["input_ids"]) for split in dataset}


def _lm_hashes(files: dict[str, str], tokenizer, tokenizer_dir: str, output_dir: Path) -> dict[str, str]:
    """The smoke stream as the studies' runs read it (`train_and_score`'s task over `lm_run_args`)."""
    from hf_powernorm.studies.runs import lm_run_args

    args = lm_run_args(output_dir / "run", tokenizer_dir, [])
    args.train_file, args.validation_file, args.test_file = files["train"], files["validation"], files["test"]
    args.block_size = 16
    task = get_task("causal-lm")(args)
    raw = task.read_splits(0)
    embedded = training.synthetic_lm_corpus(SMOKE_SIZES, seed=3)
    return {"lm_blocks": _sha(_ids(task.tokenize(raw, tokenizer))),
            "lm_lines": _sha(_ids(training.tokenize_lines(raw, tokenizer))),
            "lm_rows": _sha(_ids(training.tokenize_lines(embedded, tokenizer, documents=list(embedded))))}


def _task_hashes(translation_tokenizer, classification_tokenizer) -> dict[str, str]:
    translation = training.synthetic_translation_corpus(sizes=SMOKE_SIZES)
    classification = training.synthetic_classification_corpus(sizes=SMOKE_SIZES)
    hashes = {}
    for lengths in ((256, 256), (9, 7)):
        pairs = training.tokenize_translation(translation, translation_tokenizer, "de", "en", *lengths)
        hashes["translation_{}_{}".format(*lengths)] = _sha(_columns(pairs, ["input_ids", "labels", "length"]))
    for length in (256, 8):
        sentences = training.tokenize_classification(classification, classification_tokenizer, length)
        hashes[f"classification_{length}"] = _sha(_columns(sentences, ["input_ids", "label", "length"]))
    return hashes


@pytest.fixture(scope="module")
def task_tokenizers():
    translation = training.synthetic_translation_corpus(sizes=SMOKE_SIZES)
    classification = training.synthetic_classification_corpus(sizes=SMOKE_SIZES)
    return (training.train_bpe_tokenizer(training.translation_texts(translation["train"], ("de", "en")), 150),
            training.train_bpe_tokenizer(training.column_texts(classification["train"]), 120))


def test_study_smoke_streams_and_task_ids_are_unchanged(task_tokenizers, tmp_path):
    """The PTB-style smoke stream of the studies, and the translation and classification ids, hash
    as they did when the BPE appended `</s>` itself: finished study cells stay valid."""
    from hf_powernorm.studies.runs import lm_split_files, prepare_lm_data

    files = lm_split_files(None, tmp_path, smoke=True)
    tokenizer_dir = prepare_lm_data(files, tmp_path, vocab_size=120, block_size=16)
    tokenizer = training.load_tokenizer(tokenizer_dir)
    assert tokenizer("the dog")["input_ids"] == tokenizer("the dog", add_special_tokens=False)["input_ids"]
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    hashes = {"bpe_model": _sha(model), **_lm_hashes(files, tokenizer, tokenizer_dir, tmp_path),
              **_task_hashes(*task_tokenizers)}
    assert hashes == SMOKE_HASHES


def test_tokenizers_saved_with_an_appending_post_processor_give_the_same_ids(task_tokenizers, tmp_path):
    """A tokenizer folder written when the BPE appended `</s>` itself: its own `</s>` is detected
    and not doubled, so every stream and id hashes as with the tokenizer that appends nothing."""
    from hf_powernorm.studies.runs import lm_split_files, prepare_lm_data

    files = lm_split_files(None, tmp_path, smoke=True)
    tokenizer_dir = prepare_lm_data(files, tmp_path, vocab_size=120, block_size=16)
    old = with_appending_post_processor(training.load_tokenizer(tokenizer_dir), tmp_path / "old")
    assert old("the dog")["input_ids"][-1] == old.eos_token_id
    assert tokenization.special_tokens_added(old) == ((), (old.eos_token_id,))
    olds = [with_appending_post_processor(t, tmp_path / f"old{i}") for i, t in enumerate(task_tokenizers)]
    hashes = {**_lm_hashes(files, old, str(tmp_path / "old"), tmp_path), **_task_hashes(*olds)}
    assert hashes == {k: v for k, v in SMOKE_HASHES.items() if k != "bpe_model"}


def test_classification_ids_with_a_tokenizer_that_adds_cls_and_sep():
    """BERT-style `[CLS] ... [SEP]` (the PhraseBank study's WordPiece) kept as the tokenizer adds
    them, truncated as `truncation=True` truncates."""
    from hf_powernorm.studies.phrasebank_norms import train_wordpiece_tokenizer

    corpus = training.synthetic_classification_corpus(sizes={"train": 60, "test": 7})
    wordpiece = train_wordpiece_tokenizer(corpus["train"]["text"], 120)
    assert tokenization.sequence_ends(wordpiece) == ((wordpiece.cls_token_id,), (wordpiece.sep_token_id,))
    for length in (256, 7):
        ids = training.tokenize_classification(corpus, wordpiece, length)
        for split in corpus:
            assert list(ids[split]["input_ids"]) == wordpiece(list(corpus[split]["text"]), max_length=length,
                                                              truncation=True)["input_ids"]


# --------------------------------------------------------------------------------------------
# Text files: line breaks and blank lines, at a batch boundary
# --------------------------------------------------------------------------------------------

# Line 3 (index 2) is blank, so a batch of 3 lines starts right after it.
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n\nFirst Citizen:\n" \
       "You are all resolved rather to die than to famish?\n"


@pytest.fixture(scope="module")
def tokenizers():
    texts = shakespeare_like(300).splitlines() + TEXT.splitlines()
    return {"byte-level": byte_level_tokenizer(texts), "bpe": training.train_bpe_tokenizer(texts, 199),
            "byte-level-bos": byte_level_tokenizer(texts, bos=True)}


def _stream_of(blocks) -> list[int]:
    """The token stream the overlapping blocks cover (each block starts with the previous one's last token)."""
    rows = list(blocks["input_ids"])
    return rows[0] + [token for row in rows[1:] for token in row[1:]]


def _decoded(tokenizer, stream: list[int]) -> str:
    """The text of a stream: the text line breaks decoded, or an EOS read as the line break it stands for."""
    if tokenization.writes_line_breaks(tokenizer):
        return tokenizer.decode(stream, skip_special_tokens=True)
    lines, line = [], []
    for token in stream:
        if token == tokenizer.eos_token_id:
            lines.append(tokenizer.decode(line))
            line = []
        else:
            line.append(token)
    assert not line, "the stream ends inside a line"
    return "".join(text + "\n" for text in lines)


def _text_file_blocks(path: Path, tokenizer, **options):
    task = language_modeling.LanguageModelling.from_options(train_file=str(path), validation_file=str(path),
                                                            block_size=8, output_dir=str(path.parent / "out"),
                                                            **options)
    raw = task.read_splits(0)
    lines = training.tokenize_lines(raw, tokenizer, keep_linebreaks=task.args.keep_linebreaks)
    return task, raw, lines


@pytest.mark.parametrize("kind", ["byte-level", "byte-level-bos", "bpe"])
def test_text_file_stream_keeps_its_line_breaks_and_blank_lines(kind, tokenizers, tmp_path):
    """A GPT-2-style tokenizer writes each line break as text, this package's BPE (no line break in
    its vocabulary) as `</s>`; blank lines are part of the stream, a batch of rows may start after
    one, and the stream decodes to the file's text. A tokenizer that puts a BOS before a text (as
    Llama's) opens the file's stream with it, once."""
    tokenizer = tokenizers[kind]
    path = tmp_path / "speech.txt"
    path.write_text(TEXT, encoding="utf-8")
    task, raw, lines = _text_file_blocks(path, tokenizer)
    assert raw["train"][2]["text"] == ""
    eos_in_stream = [tokenizer.eos_token_id in ids for ids in lines["train"]["input_ids"]]
    assert all(eos_in_stream) if kind == "bpe" else not any(eos_in_stream[1:])  # (a BOS may open row 0)
    blocks = training.lm_blocks(lines, block_size=8, lines_per_batch=3)["train"]
    stream = _stream_of(blocks)
    assert _decoded(tokenizer, stream) == TEXT
    starts = [tokenizer.bos_token_id] if kind == "byte-level-bos" else []
    assert stream[:len(starts)] == starts and stream.count(tokenizer.bos_token_id) == len(starts)
    # The task's own pass gives those blocks.
    assert list(task.tokenize(raw, tokenizer)["train"]["input_ids"]) == list(
        training.lm_blocks(lines, block_size=8)["train"]["input_ids"])


def test_no_keep_linebreaks_joins_the_lines_across_blank_lines(tokenizers, tmp_path):
    """Without line breaks, a blank line is a row without a token: a batch of rows starting after
    one takes its context token from the last line that has one."""
    tokenizer = tokenizers["byte-level"]
    path = tmp_path / "speech.txt"
    path.write_text(TEXT, encoding="utf-8")
    for flag in ("--no_keep_linebreaks", "--no-keep_linebreaks"):
        assert train_lm.parse_args(["--train_file", str(path), flag]).keep_linebreaks is False
    assert train_lm.parse_args(["--train_file", str(path)]).keep_linebreaks is True
    task, raw, lines = _text_file_blocks(path, tokenizer, keep_linebreaks=False)
    assert list(lines["train"][2]["input_ids"]) == []
    blocks = training.lm_blocks(lines, block_size=4, lines_per_batch=3)["train"]
    stream = [token for ids in lines["train"]["input_ids"] for token in ids]
    assert _stream_of(blocks) == stream
    assert tokenizer.decode(stream) == TEXT.replace("\n", "")
    # The task's own pass reads --no_keep_linebreaks too.
    assert list(task.tokenize(raw, tokenizer)["train"]["input_ids"]) == list(
        training.lm_blocks(lines, block_size=8)["train"]["input_ids"])


def test_a_tokenizer_without_an_end_token_puts_only_text_in_the_stream(tokenizers, tmp_path):
    """A tokenizer with no EOS and no line break in its vocabulary: lines and documents follow one
    another with nothing between them, never a `None` id."""
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast(tokenizer_object=tokenizers["bpe"].backend_tokenizer, pad_token="<pad>",
                                     unk_token="<unk>")
    assert no_eos.eos_token_id is None and not tokenization.writes_line_breaks(no_eos)
    assert tokenization.sequence_ends(no_eos) == ((), ())
    path = tmp_path / "speech.txt"
    path.write_text(TEXT, encoding="utf-8")
    raw = _text_file_blocks(path, no_eos)[1]
    expected = [t for text in raw["train"]["text"] for t in no_eos(text, add_special_tokens=False)["input_ids"]]
    for documents in ((), ("train", "validation")):
        lines = training.tokenize_lines(raw, no_eos, documents=documents)
        stream = [token for ids in lines["train"]["input_ids"] for token in ids]
        assert stream == expected and None not in stream
        assert _stream_of(training.lm_blocks(lines, block_size=8)["train"]) == expected


def test_dataset_rows_are_documents_separated_by_eos(tokenizers, tmp_path):
    """Rows of a `datasets` dataset (a saved folder, JSON lines, CSV with a text column, as
    `run_clm.py` reads them) are documents: each followed by EOS, and preceded by what the tokenizer
    puts before a text (a BOS) where it puts one. A CSV's header and other columns are no text."""
    rows = ["First Citizen:\nBefore we proceed.", "", "All:\nSpeak, speak."]
    DatasetDict({"train": Dataset.from_dict({"text": rows})}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows), encoding="utf-8")
    Dataset.from_dict({"id": [1, 2, 3], "text": rows}).to_csv(str(tmp_path / "rows.csv"), index=False)
    csv_raw = language_modeling.LanguageModelling.from_options(
        train_file=str(tmp_path / "rows.csv"), output_dir=str(tmp_path / "o")).read_splits(0)
    assert list(csv_raw["train"]["text"]) == rows  # the header is no text, the empty field an empty document
    gpt2 = tokenizers["byte-level"]
    with_bos = byte_level_tokenizer(shakespeare_like(300).splitlines(), bos=True)
    assert tokenization.sequence_ends(gpt2) == ((), (gpt2.eos_token_id,))
    assert tokenization.sequence_ends(with_bos) == ((with_bos.bos_token_id,), (with_bos.eos_token_id,))
    for options in ({"dataset_name": str(tmp_path / "saved")}, {"train_file": str(tmp_path / "rows.jsonl")},
                    {"train_file": str(tmp_path / "rows.csv")}):
        task = language_modeling.LanguageModelling.from_options(block_size=4, output_dir=str(tmp_path / "o"),
                                                                **options)
        raw = task.read_splits(0)
        files = {"train": task.args.train_file} if task.args.train_file else None
        assert readers.lm_document_splits(["train", "test"], dataset_name=task.args.dataset_name,
                                          data_files=files) == ["train", "test"]
        for tokenizer, prefix in ((gpt2, []), (with_bos, [with_bos.bos_token_id])):
            stream = _stream_of(task.tokenize(raw, tokenizer)["train"])
            texts = list(raw["train"]["text"])
            expected = [t for text in texts for t in
                        [*prefix, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]]
            assert stream == expected


@pytest.mark.parametrize("keep_linebreaks", [True, False])
def test_a_folder_of_text_files_gives_the_stream_of_the_same_files(keep_linebreaks, tokenizers, tmp_path):
    """`--dataset_name` a local folder of .txt files (the `datasets` text builder) reads them as
    `--train_file`/`--validation_file` do: lines with their line breaks (or without, with
    `--no_keep_linebreaks`), blank lines kept, not a document per line."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for split, seed in (("train", 3), ("validation", 4)):
        (folder / f"{split}.txt").write_text(shakespeare_like(40, seed=seed), encoding="utf-8")
    assert readers.is_text_folder(folder) and not readers.is_text_folder(tmp_path / "nowhere")
    common = {"block_size": 8, "output_dir": str(tmp_path / "out"), "keep_linebreaks": keep_linebreaks}
    by_folder = language_modeling.LanguageModelling.from_options(dataset_name=str(folder), **common)
    by_files = language_modeling.LanguageModelling.from_options(
        train_file=str(folder / "train.txt"), validation_file=str(folder / "validation.txt"), **common)
    for kind in ("byte-level", "bpe"):
        tokenizer = tokenizers[kind]
        streams = [{split: _stream_of(part) for split, part in task.tokenize(task.read_splits(0), tokenizer).items()}
                   for task in (by_folder, by_files)]
        assert streams[0] == streams[1] and set(streams[0]) == {"train", "validation"}
        if kind == "byte-level":
            assert (tokenizer.eos_token_id in streams[0]["train"]) is False
            assert (_decoded(tokenizer, streams[0]["train"]) == (folder / "train.txt").read_text()) is keep_linebreaks


# --------------------------------------------------------------------------------------------
# An exported language model continues a prompt
# --------------------------------------------------------------------------------------------

def test_translation_and_classification_tokenizers_end_a_text_with_eos_as_barts_do():
    """A source or a sentence to classify, encoded by the exported tokenizer, ends in the `</s>` the
    model was trained with (BART's and Marian's tokenizers append it); a language model's tokenizer
    leaves a prompt open. The training ids are the same either way."""
    assert get_task("seq2seq").tokenizer_appends_eos and get_task("classification").tokenizer_appends_eos
    assert not get_task("causal-lm").tokenizer_appends_eos
    translation = training.synthetic_translation_corpus(sizes=SMOKE_SIZES)
    classification = training.synthetic_classification_corpus(sizes=SMOKE_SIZES)
    appending = (
        training.train_bpe_tokenizer(training.translation_texts(translation["train"], ("de", "en")), 150,
                                     append_eos=True),
        training.train_bpe_tokenizer(training.column_texts(classification["train"]), 120, append_eos=True))
    for tokenizer in appending:
        ids = tokenizer("the dog")["input_ids"]
        assert ids == tokenizer("the dog", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert _task_hashes(*appending) == {k: v for k, v in SMOKE_HASHES.items() if k.startswith(("translation", "class"))}


def test_the_recipes_bpe_encodes_a_prompt_with_blank_lines_as_its_training_stream(tokenizers, tmp_path):
    """This package's BPE ends each training line with `</s>`: a prompt with line breaks (LF, CRLF)
    and blank lines encodes to the ids the same text has in the training stream, with no unknown
    token, also once saved and loaded again."""
    bpe = tokenizers["bpe"]
    bpe.save_pretrained(tmp_path / "bpe")
    reloaded = training.load_tokenizer(tmp_path / "bpe")
    text = "First Citizen:\nBefore we proceed.\n\nAll:\nSpeak, speak.\n"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    raw = _text_file_blocks(tmp_path / "prompt.txt", bpe)[1]
    stream = [t for ids in training.tokenize_lines(raw, bpe)["train"]["input_ids"] for t in ids]
    for tokenizer in (bpe, reloaded):
        for prompt in (text, text.replace("\n", "\r\n")):
            ids = tokenizer(prompt)["input_ids"]
            assert ids == stream and tokenizer.unk_token_id not in ids
    assert not tokenization.writes_line_breaks(bpe)  # the training stream still ends lines with `</s>`
    assert bpe("the dog")["input_ids"] == bpe("the dog", add_special_tokens=False)["input_ids"]


def test_exported_tokenizer_leaves_a_prompt_open_and_generation_continues_it(tmp_path):
    from transformers import AutoTokenizer, pipeline

    files = lm_text_files(tmp_path, {"train": 150, "validation": 20}, seed=4)
    out = tmp_path / "lm"
    train_lm.main([*files, "--output_dir", str(out), "--vocab_size", "99", "--block_size", "16", "--max_tokens",
                   "64", "--max_train_steps", "3", "--eval_steps", "3", "--warmup_steps", "1"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = "The old teacher"
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.eos_token_id not in ids and tokenizer.decode(ids) == prompt
    generator = pipeline("text-generation", model=str(out))
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    generated = generator(prompt, return_tensors=True, **options)[0]["generated_token_ids"]
    assert list(generated[:len(ids)]) == ids and len(generated) == len(ids) + 4
    text = generator(prompt, **options)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt) and "</s>" not in text
    card = (out / "README.md").read_text(encoding="utf-8")
    assert 'pipeline("text-generation"' in card and '"The old teacher"' in card


# --------------------------------------------------------------------------------------------
# `compare` on a GPT-2-style model with a byte-level tokenizer
# --------------------------------------------------------------------------------------------

def test_compare_on_a_gpt2_style_model_and_text_with_blank_lines(tokenizers, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tokenizers["byte-level"]
    text = shakespeare_like(300, seed=1)
    assert "\n\n" in text
    (tmp_path / "shakespeare.txt").write_text(text, encoding="utf-8")
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=40,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    output = tmp_path / "compare"
    rows = compare.main(["--model_name_or_path", str(tmp_path / "model"), "--train_file",
                         str(tmp_path / "shakespeare.txt"), "--block_size", "16", "--max_tokens", "64",
                         "--norms", "layernorm", "rmsnorm", "--seeds", "1", "--max_train_steps", "2",
                         "--eval_steps", "1", "--num_warmup_steps", "1", "--output_dir", str(output)])
    assert sorted((r["norm"], r["split"]) for r in rows) == [
        (norm, split) for norm in ("layernorm", "rmsnorm") for split in ("test", "validation")]
    assert all(float(r["perplexity"]) > 1 for r in rows)
    assert "test perplexity" in (output / "report.md").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# A tokenizer without a padding token: one rule for the recipes and `compare`
# --------------------------------------------------------------------------------------------

def _gpt2_folder(folder: Path, tokenizer) -> Path:
    """A tiny GPT-2 saved with `tokenizer` (no padding token in either)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=40,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_lm_recipe_pads_a_gpt2_style_tokenizer_with_its_eos_and_says_so_once(tokenizers, tmp_path, caplog):
    """A GPT-2-style model folder without a padding token converts, trains and exports, padding with
    its end token as `compare` does; the log says so once."""
    tokenizer = tokenizers["byte-level"]
    assert tokenizer.pad_token is None
    folder = _gpt2_folder(tmp_path / "gpt2", tokenizer)
    (tmp_path / "speech.txt").write_text(shakespeare_like(200, seed=2), encoding="utf-8")
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        results = train_lm.main(["--train_file", str(tmp_path / "speech.txt"), "--model_name_or_path", str(folder),
                                 "--convert_norms", "powernorm", "--block_size", "16", "--max_tokens", "64",
                                 "--max_train_steps", "2", "--warmup_steps", "1", "--output_dir", str(out)])
    assert results["test_perplexity"] > 1 and (out / "model.safetensors").is_file()
    said = [r.getMessage() for r in caplog.records if "no padding token" in r.getMessage()]
    assert len(said) == 1 and "'<|endoftext|>'" in said[0], said
    assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == "<|endoftext|>"
    assert compare.load_model_tokenizer(str(folder)).pad_token_id == tokenizer.eos_token_id


def test_a_tokenizer_without_padding_or_end_token_is_one_line_in_the_recipe_and_compare(tmp_path, capsys,
                                                                                          monkeypatch):
    """Nothing to pad with: the recipe and `compare` refuse alike, exit 2, one line naming the fix."""
    import sys

    from hf_powernorm import cli
    from hf_powernorm.training.tasks import run_script

    bare = byte_level_tokenizer(shakespeare_like(100).splitlines(), eos=False)
    assert bare.pad_token is None and bare.eos_token is None and bare.unk_token is None
    folder = _gpt2_folder(tmp_path / "bare", bare)
    with pytest.raises(ValueError, match="no padding token and no end-of-sequence token"):
        tokenization.pad_with_eos(bare, "a test")
    (tmp_path / "speech.txt").write_text(shakespeare_like(100), encoding="utf-8")
    data = ["--train_file", str(tmp_path / "speech.txt"), "--model_name_or_path", str(folder), "--block_size", "16",
            "--max_tokens", "64"]
    monkeypatch.setattr(sys, "argv", ["train_lm.py"])
    capsys.readouterr()
    for command in (lambda: run_script(train_lm.main, [*data, "--convert_norms", "powernorm",
                                                         "--output_dir", str(tmp_path / "lm")]),
                    lambda: cli.main(["compare", *data, "--norms", "rmsnorm", "--output_dir", str(tmp_path / "cmp")])):
        with pytest.raises(SystemExit) as stopped:
            command()
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if ": error: " in line]
        assert stopped.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert f"the tokenizer of {folder} has no padding token" in lines[0] and "save_pretrained" in lines[0]
