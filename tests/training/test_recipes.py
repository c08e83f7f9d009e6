"""End-to-end tests of the translation recipe `train_wmt.py` and of `recipes/README.md`.

`train_wmt.py` trains on the embedded default corpus and on small local files written here,
validates with BLEU during training, keeps the best model, stops early, exports, averages
checkpoints, resumes exactly, runs as two Accelerate processes whose saved statistics do not
depend on the rank, and fails on bad input before training. Every command of `recipes/README.md`
runs here at tiny scale: the same options with small sizes and local files.
"""

import csv
import inspect
import json
import re
import shlex
import shutil
import textwrap
from pathlib import Path

import pytest
import sacrebleu
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
from launching import accelerate_launch
from recipe_scripts import average_checkpoints, train_classification, train_lm, train_wmt

from hf_powernorm import training
from hf_powernorm.training import translation

FAST = ["--max_eval_samples", "8", "--eval_batch_size", "4", "--max_tokens", "512", "--vocab_size", "300",
        "--warmup_steps", "3", "--num_beams", "2", "--max_new_tokens", "8"]
STATISTICS = ("running_phi", "running_nu", "num_batches_tracked")
README = ROOT / "recipes" / "README.md"


pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


@pytest.fixture(scope="module")
def translation_files(tmp_path_factory) -> dict[str, str]:
    """Train and test as JSON lines, validation as aligned text files `valid.de` / `valid.en`."""
    root = tmp_path_factory.mktemp("wmt_data")
    corpus = training.synthetic_translation_corpus(sizes={"train": 120, "validation": 24, "test": 16}, seed=3)
    for split in ("train", "test"):
        rows = [json.dumps({"translation": pair}, ensure_ascii=False) for pair in corpus[split]["translation"]]
        (root / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    for lang in ("de", "en"):
        lines = [pair[lang] for pair in corpus["validation"]["translation"]]
        (root / f"valid.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"--train_file": str(root / "train.jsonl"), "--validation_file": str(root / "valid"),
            "--test_file": str(root / "test.jsonl")}


def _file_args(files: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return [*FAST, *(word for option in files.items() for word in option), "--output_dir", str(output_dir), *extra]


def _assert_same_weights(first: Path, second: Path) -> None:
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{first}: {key}")


# --------------------------------------------------------------------------------------------
# One process, in-process runs
# --------------------------------------------------------------------------------------------

def test_train_wmt_trains_saves_and_resumes_exactly(tmp_path, capsys, reset_accelerate):
    first, second = tmp_path / "first", tmp_path / "second"
    run = [*FAST, "--max_train_steps", "6", "--eval_steps", "2", "--checkpointing_steps", "2"]
    results = train_wmt.main([*run, "--output_dir", str(first)])
    assert [p.name for p in sorted(first.glob("step_*"))] == ["step_2", "step_4", "step_6"]
    assert json.loads((first / "all_results.json").read_text()) == pytest.approx(results)
    assert results["train_steps"] == 6 and results["best_step"] in (2, 4, 6)
    assert "case:mixed" in results["validation_bleu_signature"] and "test_bleu" in results
    assert results["best_validation"] == pytest.approx(results["validation_bleu"])  # the best model is exported
    card = (first / "README.md").read_text()
    assert "validation_bleu" in card and "--max_train_steps 6" in card and "powernorm" in card
    log = capsys.readouterr()
    assert "step 2: validation" in log.out and "step 6: validation" in log.out

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_powernorm  # noqa: F401  (registers the Auto classes)

    model = AutoModelForSeq2SeqLM.from_pretrained(first)
    tokenizer = AutoTokenizer.from_pretrained(first, trust_remote_code=False)
    assert len(tokenizer) == model.config.vocab_size and model.config.pad_token_id == tokenizer.pad_token_id
    encoded = tokenizer(["Der Hund schläft ."], return_tensors="pt")
    assert model.generate(**encoded, max_new_tokens=5).shape[0] == 1

    # Averaging the last two checkpoints gives a folder that loads like a saved model.
    average_checkpoints.main(["--checkpoint_dir", str(first), "--num_checkpoints", "2",
                              "--output_dir", str(tmp_path / "averaged")])
    averaged = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "averaged").state_dict()
    step_4, step_6 = (load_file(str(first / name / "model.safetensors")) for name in ("step_4", "step_6"))
    key = "model.encoder.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(averaged[key], (step_4[key].double() + step_6[key].double()).div(2).float())
    assert averaged["model.encoder.layers.0.self_attn_norm.num_batches_tracked"].item() == 6

    # Resume from the newest of two checkpoints and finish the run: same weights as without a break.
    reset_accelerate()
    second.mkdir()  # the folder of a run interrupted after update 4
    for name in ("tokenizer", "step_2", "step_4"):
        (second / name).symlink_to(first / name, target_is_directory=True)
    shutil.copytree(first / training.BEST_MODEL_DIR, second / training.BEST_MODEL_DIR)
    resumed = train_wmt.main([*run, "--tokenizer_name", str(second / "tokenizer"), "--resume_from_checkpoint",
                              "latest", "--output_dir", str(second)])
    assert f"Resuming from {second / 'step_4'}" in capsys.readouterr().out
    assert resumed == pytest.approx(results)
    for name in ("step_6/model.safetensors", "model.safetensors"):
        _assert_same_weights(second / name, first / name)
    assert load_file(str(second / "step_6" / "model.safetensors"))[
        "model.encoder.layers.0.self_attn_norm.num_batches_tracked"].item() == 6


def test_train_wmt_early_stopping_exports_the_best_model(translation_files, tmp_path, monkeypatch):
    scripted_scores = iter([10.0, 20.0, 15.0, 12.0])  # validation BLEU after each update
    measured, translate = translation.evaluate_bleu, training.evaluation.translate
    translations = []

    def recording_translate(*args, **kwargs):
        translations.append(translate(*args, **kwargs))
        return translations[-1]

    def scripted(*args, **kwargs):
        scores = measured(*args, **kwargs)
        return {**scores, "bleu": next(scripted_scores, scores["bleu"])}

    monkeypatch.setattr(training.evaluation, "translate", recording_translate)
    monkeypatch.setattr(translation, "evaluate_bleu", scripted)
    results = train_wmt.main(_file_args(translation_files, tmp_path, "--max_train_steps", "20", "--eval_steps", "1",
                                        "--patience", "2", "--checkpointing_steps", "1"))
    # Best at update 2; updates 3 and 4 do not improve: stop after 4 and export update 2's weights.
    assert (results["train_steps"], results["best_step"], results["best_validation"]) == (4, 2, 20.0)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2", "step_3", "step_4"]
    _assert_same_weights(tmp_path / "model.safetensors", tmp_path / "step_2" / "model.safetensors")
    _assert_same_weights(tmp_path / training.BEST_MODEL_DIR / "model.safetensors",
                         tmp_path / "step_2" / "model.safetensors")
    assert load_file(str(tmp_path / "model.safetensors"))[
        "model.encoder.final_norm.num_batches_tracked"].item() == 2
    # Four validations, then the exported model on validation and test: the final validation
    # translates exactly as the model of update 2 did, so its BLEU is that model's.
    assert len(translations) == 6 and translations[4] == translations[1]
    assert results["validation_bleu"] == pytest.approx(training.bleu_scores(*translations[1])["bleu"])
    predictions, references = translations[5]
    assert (tmp_path / "generated_predictions.txt").read_text(encoding="utf-8").splitlines() == predictions
    assert (tmp_path / "generated_references.txt").read_text(encoding="utf-8").splitlines() == references
    assert results["test_bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score)
    # Validation pairs came from aligned text files, test pairs from JSON lines.
    assert "nrefs:1" in results["validation_bleu_signature"]


@pytest.mark.parametrize("bad, error, message", [
    (["--train_file", "/nonexistent/train"], FileNotFoundError, "--train_file /nonexistent/train"),
    (["--preset", "transformer-huge"], ValueError, "'transformer-huge' is unknown; valid presets"),
    (["--encoder_norm_type", "superNorm"], ValueError, "--encoder_norm_type: unknown norm 'superNorm'"),
    (["--target_lang", "de"], ValueError, "both 'de'"),
    (["--label_smoothing", "1.5"], ValueError, "--label_smoothing must be in .*1.5"),
    (["--num_beams", "0"], ValueError, "--num_beams must be at least 1; got 0"),
    (["--eval_steps", "0"], ValueError, "--eval_steps must be at least 1; got 0"),
    (["--checkpointing_steps", "often"], ValueError, "'often'"),
])
def test_train_wmt_bad_arguments_fail_before_training(bad, error, message, tmp_path):
    with pytest.raises(error, match=message):
        train_wmt.main([*bad, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Remote code: a fresh process without the package recomputes the BLEU scores
# --------------------------------------------------------------------------------------------

def _beam_search(model, pad_token_id: int, rows: list[list[int]], batch_size: int, num_beams: int,
                 length_penalty: float, max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """`generate` as the translation task's `evaluate_bleu` calls it, on batches padded like `PaddingCollator`
    pads them (right, with an attention mask): the generated ids and the beam scores. The child
    below runs this very source."""
    import torch

    sequences, scores = [], []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        width = max(len(row) for row in batch)
        input_ids = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in batch])
        attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in batch])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_beams=num_beams,
                                 length_penalty=length_penalty, max_new_tokens=max_new_tokens,
                                 output_scores=True, return_dict_in_generate=True)
        sequences += out.sequences.tolist()
        scores += out.sequences_scores.tolist()
    return sequences, scores


WMT_CHILD = textwrap.dedent(
    r"""
    import importlib.util, json
    assert importlib.util.find_spec("hf_powernorm") is None, "hf_powernorm must not be importable here"
    import sacrebleu
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    torch.set_num_threads(1)
    data = json.load(open(DATA))
    model = AutoModelForSeq2SeqLM.from_pretrained(MODEL_DIR, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, trust_remote_code=False)  # as the card says
    out = {}
    for split, part in data.items():
        # The exported tokenizer ends a source with `</s>` itself, as the data path does (BART's does too).
        encoded = tokenizer(part["sources"], max_length=MAX_LENGTH, truncation=True)["input_ids"]
        assert encoded == part["input_ids"], f"{split}: the tokenizer encodes the sources differently"
        sequences, scores = _beam_search(model, tokenizer.pad_token_id, part["input_ids"], **GENERATE)
        # training.decode_for_bleu: special tokens dropped, stripped
        hypotheses = [text.strip() for text in tokenizer.batch_decode(sequences, skip_special_tokens=True)]
        out[split] = {"sequences": sequences, "scores": scores, "hypotheses": hypotheses,
                      "bleu": sacrebleu.corpus_bleu(hypotheses, [part["references"]]).score,
                      "bleu_lowercase": sacrebleu.corpus_bleu(hypotheses, [part["references"]], lowercase=True).score}
    print("RESULTS " + json.dumps(out))
    """
)


def test_train_wmt_export_loads_as_remote_code_in_a_fresh_process(translation_files, tmp_path,
                                                                   run_without_the_package):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_powernorm  # noqa: F401  (registers the Auto classes)

    out = tmp_path / "wmt"
    # Enough updates that the translations depend on the source; the best of four validations is exported.
    argv = _file_args(translation_files, out, "--max_train_steps", "200", "--eval_steps", "50")
    results, args = train_wmt.main(argv), train_wmt.parse_args(argv)
    assert json.loads((out / "all_results.json").read_text()) == pytest.approx(results)

    # The evaluation inputs of the run: its data loading and tokenization, its first examples.
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    files = training.data_files_from_args(validation_file=args.validation_file, test_file=args.test_file)
    raw = training.load_translation_dataset(args.source_lang, args.target_lang, data_files=files)
    encoded = training.tokenize_translation(raw, tokenizer, args.source_lang, args.target_lang,
                                            args.max_source_length, args.max_target_length)
    data = {}
    for split in ("validation", "test"):
        first = range(args.max_eval_samples)
        pairs = list(raw[split].select(first)["translation"])
        references = [pair[args.target_lang] for pair in pairs]
        # The recipe scores against its decoded labels: they are the reference text itself.
        assert training.decode_for_bleu(tokenizer, encoded[split].select(first)["labels"]) == references, split
        data[split] = {"sources": [pair[args.source_lang] for pair in pairs], "references": references,
                       "input_ids": [list(ids) for ids in encoded[split].select(first)["input_ids"]]}
    (tmp_path / "data.json").write_text(json.dumps(data, ensure_ascii=False))
    generate = {"batch_size": args.eval_batch_size, "num_beams": args.num_beams,
                "length_penalty": args.length_penalty, "max_new_tokens": args.max_new_tokens}
    assert generate == {"batch_size": 4, "num_beams": 2, "length_penalty": 1.0, "max_new_tokens": 8}

    child = run_without_the_package(
        f"DATA = {str(tmp_path / 'data.json')!r}\nMODEL_DIR = {str(out)!r}\n"
        f"MAX_LENGTH = {args.max_source_length!r}\nGENERATE = {generate!r}\n\n"
        + inspect.getsource(_beam_search) + WMT_CHILD, hf_home=tmp_path / "hf", workdir=tmp_path)
    assert child.returncode == 0 and "RESULTS " in child.stdout, child.stdout[-3000:] + child.stderr[-6000:]
    got = json.loads(child.stdout.rsplit("RESULTS ", 1)[1].splitlines()[0])  # after any progress bar

    # The fresh process's BLEU is the run's, cased and lowercased, on both splits.
    for split in ("validation", "test"):
        for metric in ("bleu", "bleu_lowercase"):
            assert got[split][metric] == pytest.approx(results[f"{split}_{metric}"], rel=1e-9, abs=1e-9), \
                f"{split}_{metric}: fresh process {got[split][metric]} != run {results[f'{split}_{metric}']}"
    # Token for token, and score for score, the remote code translates as the package's class does.
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(model).__module__.startswith("hf_powernorm.")
    for split in ("validation", "test"):
        sequences, scores = _beam_search(model, tokenizer.pad_token_id, data[split]["input_ids"], **generate)
        assert got[split]["sequences"] == sequences, f"{split}: the fresh process generates other tokens"
        assert got[split]["scores"] == pytest.approx(scores, rel=1e-5, abs=1e-6), split
        assert got[split]["hypotheses"] == training.decode_for_bleu(tokenizer, torch.tensor(sequences)), split
    # Not a degenerate comparison: the translations are text, depend on the source, and score above 0.
    hypotheses = got["validation"]["hypotheses"]
    assert all(hypotheses) and len(set(got["validation"]["scores"])) == len(hypotheses), hypotheses
    assert results["validation_bleu"] > 0 and results["test_bleu"] > 0, results


# --------------------------------------------------------------------------------------------
# Two processes through `accelerate launch`
# --------------------------------------------------------------------------------------------

# Runs train_wmt.main in each process and writes that rank's running statistics just before and
# after every checkpoint and after the export.
RANK_DUMPER = textwrap.dedent(
    """
    import importlib.util
    import sys
    from safetensors.torch import save_file
    from hf_powernorm.training import loop, tasks

    spec = importlib.util.spec_from_file_location("train_wmt", f"{RECIPES}/train_wmt.py")
    train_wmt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_wmt)

    def dump(name, accelerator, model):
        state = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).named_buffers()
                 if k.endswith(STATISTICS)}
        save_file(state, f"{OUT}/{name}.rank{accelerator.process_index}.safetensors")

    save_checkpoint, save_outputs = loop.save_checkpoint, tasks.save_outputs

    def dumping_save_checkpoint(accelerator, output_dir, model, tokenizer, completed, **state):
        dump(f"before_step_{completed}", accelerator, model)
        folder = save_checkpoint(accelerator, output_dir, model, tokenizer, completed, **state)
        dump(f"step_{completed}", accelerator, model)
        return folder

    def dumping_save_outputs(accelerator, model, *args):
        save_outputs(accelerator, model, *args)
        dump("final", accelerator, model)

    loop.save_checkpoint, tasks.save_outputs = dumping_save_checkpoint, dumping_save_outputs
    train_wmt.main(sys.argv[1:])
    """
)


def _rank_states(folder: Path, name: str) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(folder / f"{name}.rank{rank}.safetensors")) for rank in (0, 1)]


# Unsynchronised statistics in two processes are also checked on the LM recipe (test_recipes_lm_cls.py).
@pytest.mark.parametrize("sync", ["--sync_stats", pytest.param("--no-sync_stats", marks=pytest.mark.slow)])
def test_train_wmt_two_processes_save_statistics_independent_of_the_rank(sync, translation_files, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    script = tmp_path / "rank_dumper.py"
    script.write_text(f"RECIPES = {str(ROOT / 'recipes')!r}\nOUT = {str(dumps)!r}\nSTATISTICS = {STATISTICS!r}\n"
                      + RANK_DUMPER)
    # The two-process command of recipes/README.md, with the statistics synchronised or not.
    [(_, launcher, args)] = [c for c in readme_commands() if "--num_processes" in c[1]]
    args = [sync if a == "--no-sync_stats" else a for a in _tiny_files(args, translation_files, tmp_path)]
    out = Path(args[args.index("--output_dir") + 1])
    # It is the tiny run of the tests above, for four updates with a checkpoint every two.
    tiny = ["--cpu", sync, *_file_args(translation_files, out, "--max_train_steps", "4", "--checkpointing_steps", "2")]
    assert sorted(_options(args), key=str) == sorted(_options(tiny), key=str)
    port = launcher.index("--main_process_port")
    assert launcher[:2] == ["accelerate", "launch"], launcher
    log = accelerate_launch([str(script), *args], launcher=[*launcher[2:port], *launcher[port + 2:]])
    assert "2 process(es)" in log and "norms {'PowerNorm': 5, 'LayerNorm': 7}" in log and "parameters" in log
    assert "model config: {" in log and "'powernorm_warmup_steps': 3" in log
    assert json.loads((out / "config.json").read_text())["powernorm_sync_stats"] is (sync == "--sync_stats")
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_steps"] == 4 and results["best_step"] == 4  # validated once, after the last update

    # Before the first checkpoint: synchronised statistics agree already; unsynchronised ones differ.
    before = _rank_states(dumps, "before_step_2")
    phi = "model.encoder.final_norm.running_phi"
    assert torch.equal(before[0][phi], before[1][phi]) is (sync == "--sync_stats")
    mean = (before[0][phi].double() + before[1][phi].double()).div(2).float()
    # Whatever the mode, every rank holds the same statistics once saved, and the files hold them.
    for name, saved in (("step_2", out / "step_2"), ("step_4", out / "step_4"), ("final", out)):
        ranks = _rank_states(dumps, name)
        weights = load_file(str(saved / "model.safetensors"))
        assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 3 * 5
        for key in ranks[0]:
            assert torch.equal(ranks[0][key], ranks[1][key]), f"{name}: {key} differs between the ranks"
            assert torch.equal(ranks[0][key], weights[key]), f"{name}: {key} differs from the saved file"
    torch.testing.assert_close(_rank_states(dumps, "step_2")[0][phi], mean, rtol=0, atol=1e-7)
    assert load_file(str(out / "model.safetensors"))["model.encoder.final_norm.num_batches_tracked"].item() == 4


# --------------------------------------------------------------------------------------------
# recipes/README.md at tiny scale
# --------------------------------------------------------------------------------------------

def readme_commands() -> list[tuple[str, list[str], list[str]]]:
    """(script, launcher words, script arguments) of every command of recipes/README.md, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            at = next((i for i, w in enumerate(words) if re.fullmatch(r"recipes/\w+\.py", w)), None)
            if at is not None:
                commands.append((Path(words[at]).name, words[:at], words[at + 1:]))
    return commands


DATA_OPTIONS = ("--train_file", "--validation_file", "--test_file", "--phrasebank_file")
# What sets only the size of a run: the tiny runs give their own value (added when missing).
TINY_SIZES = {
    "train_wmt.py": {"--vocab_size": "300", "--max_tokens": "512", "--warmup_steps": "3", "--max_train_steps": "16",
                     "--eval_batch_size": "4", "--max_eval_samples": "8", "--max_new_tokens": "8"},
    "train_lm.py": {"--vocab_size": "120", "--block_size": "16", "--max_tokens": "128", "--warmup_steps": "3",
                    "--max_train_steps": "6", "--eval_batch_size": "16"},
    "train_classification.py": {"--vocab_size": "150", "--max_tokens": "256", "--warmup_steps": "3",
                                "--max_train_steps": "6", "--eval_batch_size": "32"},
    "average_checkpoints.py": {"--num_checkpoints": "2"},
}


def _options(args: list[str]) -> list[tuple[str, str | None]]:
    pairs, i = [], 0
    while i < len(args):
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        pairs.append((args[i], value))
        i += 1 if value is None else 2
    return pairs


def _tiny_files(args: list[str], files: dict[str, str], tmp_path: Path) -> list[str]:
    """`args` with local tiny files for the data and `tmp_path` for the outputs; a Hub dataset
    becomes the tiny files too."""
    out = []
    for option, value in _options(args):
        if option == "--dataset_config":
            continue
        if option == "--dataset_name":
            out += [word for name in DATA_OPTIONS[:3] for word in (name, files[name])]
            continue
        if option in DATA_OPTIONS:
            value = files[option]
        elif value is not None and value.startswith(("outputs/", "outputs\\")):
            value = str(tmp_path / value)
        elif value is not None and option in ("--output_dir", "--checkpoint_dir"):
            value = str(tmp_path / "outputs" / value)
        out += [option] if value is None else [option, value]
    return out


def _tiny_scale(script: str, args: list[str]) -> list[str]:
    """`args` with the tiny sizes: the preset (the model size) is dropped, as the script's default
    model is small; validation and checkpoint intervals of N updates become 2."""
    sizes, out = TINY_SIZES[script], []
    for option, value in _options(args):
        if option == "--preset" or option in sizes:
            continue
        if option in ("--eval_steps", "--checkpointing_steps") and value.isdigit():
            value = "2"
        out += [option] if value is None else [option, value]
    return out + [word for pair in sizes.items() for word in pair]


@pytest.fixture(scope="module")
def tiny_data(translation_files, tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("tiny_data")
    lm = training.synthetic_lm_corpus({"train": 120, "validation": 20, "test": 20}, seed=4)
    text = {}
    for split, name in (("train", "--train_file"), ("validation", "--validation_file"), ("test", "--test_file")):
        text[name] = str(root / f"{split}.txt")
        Path(text[name]).write_text("\n".join(lm[split]["text"]) + "\n", encoding="utf-8")
    cls = training.synthetic_classification_corpus({"train": 150, "validation": 30, "test": 30}, seed=4)
    labelled = {}
    for split, name in (("train", "--train_file"), ("validation", "--validation_file"), ("test", "--test_file")):
        labelled[name] = str(root / f"{split}.csv")
        with open(labelled[name], "w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows([("text", "label"), *zip(cls[split]["text"], cls[split]["label"])])
    labelled["--phrasebank_file"] = str(root / "Sentences_AllAgree.txt")
    Path(labelled["--phrasebank_file"]).write_text("".join(
        f"{t}@{training.SENTIMENT_LABELS[l]}\n" for t, l in zip(cls["train"]["text"], cls["train"]["label"])))
    return {"train_wmt.py": translation_files, "train_lm.py": text, "train_classification.py": labelled}


SCRIPTS = {"train_wmt.py": train_wmt, "train_lm.py": train_lm, "train_classification.py": train_classification}


def test_readme_commands_run_at_tiny_scale(tiny_data, tmp_path, capsys, reset_accelerate):
    commands = [c for c in readme_commands() if "--num_processes" not in c[1]]  # two processes: above
    assert {script for script, _, _ in commands} == {*SCRIPTS, "average_checkpoints.py"}
    for script, _, args in commands:
        args = _tiny_scale(script, _tiny_files(args, tiny_data.get(script, {}), tmp_path))
        if "--output_dir" not in args:
            args += ["--output_dir", str(tmp_path / f"default_{script}")]
        output_dir = Path(args[args.index("--output_dir") + 1])
        if script == "average_checkpoints.py":
            average_checkpoints.main(args)
            assert (output_dir / "model.safetensors").is_file() and (output_dir / "config.json").is_file()
            continue
        reset_accelerate()
        results = SCRIPTS[script].main(args)
        if "--no-do_train" in args:
            assert "train_steps" not in results and "test_bleu" in results, (script, args)
        else:
            assert 1 <= results["train_steps"] <= int(TINY_SIZES[script]["--max_train_steps"]), (script, args)
        assert (output_dir / "model.safetensors").is_file() and (output_dir / "README.md").is_file()
        if "--resume_from_checkpoint" in args:
            assert f"Resuming from {output_dir}" in capsys.readouterr().out


def test_readme_accelerate_configs_load(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 2
    configs = []
    for number, block in enumerate(blocks):
        (tmp_path / f"{number}.yaml").write_text(block)
        configs.append(load_config_from_file(str(tmp_path / f"{number}.yaml")))
    single, multi = configs
    assert (single.distributed_type, single.num_machines, single.num_processes) == ("MULTI_GPU", 1, 8)
    assert (multi.distributed_type, multi.num_machines, multi.num_processes) == ("MULTI_GPU", 2, 16)
    assert multi.main_process_ip and multi.main_process_port == 29500
