"""`hf-powernorm compare`'s options and plan: help that answers before torch is imported, each
default said once and true, the checks that refuse bad values before anything is written, an
output folder held by one process, the data's contents in the fingerprint, a model that brings its
own code, and RMSNorm against a Llama's own norm reported as the same function."""

import argparse
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm import compare
from hf_powernorm.compare import runs as compare_runs
from hf_powernorm.compare.options import CompareOptions
from test_compare import TINY, _rows, _save_tiny, _tokenizer
from test_compare_trust import _one_line_error

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")

ROOT = Path(__file__).resolve().parents[2]
# The console script pip writes for `hf-powernorm`, then what the process had imported.
CONSOLE_SCRIPT = """import json, sys
from hf_powernorm.cli import main
try:
    main()
except SystemExit:
    pass
print(json.dumps({name: name in sys.modules for name in ("torch", "transformers")}), file=sys.stderr)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# --------------------------------------------------------------------------------------------
# Help
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("words", [["--help"], ["compare", "--help"], ["compare", "-h"], ["studies", "--help"]])
def test_help_is_printed_before_torch_or_transformers_is_imported(words, tmp_path):
    script = tmp_path / "hf-powernorm"
    script.write_text(CONSOLE_SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), *words], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr
    assert json.loads(done.stderr.strip().splitlines()[-1]) == {"torch": False, "transformers": False}


@pytest.mark.parametrize("module", ["hf_powernorm.cli compare", "hf_powernorm.compare"])
def test_help_by_python_m_imports_no_torch(module):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", *module.split(), "--help"], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert done.returncode == 0 and "--trust_remote_code" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert {"hf_powernorm.compare.options", "hf_powernorm.training.options"} <= imported
    assert not {"torch", "transformers"} & imported


def test_the_help_of_norms_names_every_norm_of_the_registry():
    from hf_powernorm.compare.options import NORMS
    from hf_powernorm.normalization import NORM_CLASSES

    assert NORMS == tuple(NORM_CLASSES)
    norms = next(a for a in compare.build_parser()._actions if a.dest == "norms")
    listed = norms.help.partition("of the norm registry: ")[2].partition(";")[0]
    assert listed.split(", ") == list(NORM_CLASSES)


def test_a_command_that_runs_loads_the_library_and_registers_the_family(tmp_path):
    script = tmp_path / "hf-powernorm"
    script.write_text(CONSOLE_SCRIPT + "import transformers\nprint(transformers.AutoConfig.for_model("
                      "'powernorm_transformer').model_type, file=sys.stderr)\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), "compare", "--norms", "powrnorm"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert "error: --norms: unknown norm 'powrnorm'" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "powernorm_transformer"


def test_each_default_is_said_once_true_and_no_option_compare_lacks_is_named():
    parser = compare.build_parser()
    defaults = CompareOptions()
    for action in parser._actions[1:]:
        if action.help == argparse.SUPPRESS:  # another spelling of a listed option
            continue
        assert action.help.count("default") <= 1, action.dest
        assert action.default == getattr(defaults, action.dest), action.dest
        if action.default not in (None, False) and "default:" not in action.help:
            pytest.fail(f"--{action.dest}: its default {action.default!r} is not said")
        if f"(default: {action.default})" in action.help:
            assert action.help.endswith(f"(default: {action.default})")
    text = parser.format_help()
    assert "--preserve_function" not in text and "preset" not in text
    assert "--label_column LABEL_COLUMN" in text and text.count("default: 'label'") == 1
    assert not re.search(r"norm_alpha_init|embed_scale_learnable", text)  # the PowerNorm family's own options


def test_the_options_shared_with_the_recipes_parse_as_theirs():
    from hf_powernorm.training.arguments import add_recipe_args
    from hf_powernorm.training.optimization import SCHEDULER_TYPES

    recipe = {a.dest: a for a in add_recipe_args(argparse.ArgumentParser())._actions}
    ours = {a.dest: a for a in compare.build_parser()._actions}
    shared = set(recipe) & set(ours) - {"help"}
    assert len(shared) > 30 and not set(recipe) - set(ours) - set(compare.NOT_TAKEN) - {"help"}
    for name in shared:
        assert ours[name].option_strings == recipe[name].option_strings, name
        assert (ours[name].type, ours[name].nargs) == (recipe[name].type, recipe[name].nargs), name
    assert list(ours["lr_scheduler_type"].choices) == list(SCHEDULER_TYPES)


def test_every_task_option_is_a_comparison_option():
    """The options the registry's tasks own (`Task.own_options`, `column_options`) are fields of the comparison."""
    from hf_powernorm.training.tasks import get_task, task_names

    owned = {name for task in map(get_task, task_names()) for name in (*task.own_options, *task.column_options)}
    assert owned <= {field.name for field in __import__("dataclasses").fields(CompareOptions)}
    assert compare.parse_args(["--no_keep_linebreaks"]).keep_linebreaks is False
    assert compare.parse_args(["--no-keep_linebreaks"]).keep_linebreaks is False
    assert compare.parse_args([]).keep_linebreaks is True


def test_the_options_a_task_owns_parse_as_its_recipe_has_them():
    """Each option a task owns (`Task.own_options`) and each naming a column it reads
    (`Task.column_options`) is declared once (`training.options.TaskOptions`): `compare` has the
    spellings, type and action of the task's recipe, its default its own (one beam)."""
    from hf_powernorm.training.tasks import get_task, task_names

    def flags(parser, name):
        return [(a.option_strings, a.type, a.nargs, type(a).__name__) for a in parser._actions if a.dest == name]

    ours = compare.build_parser()
    for task in map(get_task, task_names()):
        recipe = task.build_parser()
        for name in (*task.own_options, *task.column_options):
            assert flags(ours, name) == flags(recipe, name) != [], (task.name, name)
    assert (ours.parse_args([]).num_beams, get_task("seq2seq").build_parser().parse_args([]).num_beams) == (1, 5)


def test_options_are_saved_and_read_back_field_by_field(gpt2_case, tmp_path):
    model, task, data = gpt2_case
    options = compare.parse_args(["--model_name_or_path", model, "--task", task, *data, "--output_dir",
                                  str(tmp_path / "o"), "--lr_grid", "1e-3", "3e-3", "--tune_lr"])
    assert isinstance(options, CompareOptions) and options.lr_grid == [1e-3, 3e-3]
    assert CompareOptions.from_json(json.loads(json.dumps(options.to_json()))) == options
    assert "output_dir" not in options.settings() and options.settings()["learning_rate"] == 5e-4


# --------------------------------------------------------------------------------------------
# Bad values: refused before anything is written, and the corrected command runs
# --------------------------------------------------------------------------------------------

def test_bad_quantities_are_refused_before_anything_is_written_and_the_corrected_rerun_runs(
        gpt2_case, capsys, tmp_path):
    model, task, data = gpt2_case
    out = tmp_path / "out"
    base = ["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm", "--seeds", "1", *TINY,
            "--output_dir", str(out)]
    for bad, said in ((["--learning_rate", "-0.001"], "--learning_rate -0.001: expected a learning rate"),
                      (["--learning_rate", "0"], "--learning_rate 0.0: expected a learning rate, a finite number > 0"),
                      (["--tune_lr", "--lr_grid", "0.001", "-0.001"], "--lr_grid -0.001: expected a learning rate"),
                      (["--lr_grid", "0.001", "0.003"], "--lr_grid 0.001 0.003 is the grid that --tune_lr chooses "
                                                        "from: add --tune_lr"),
                      (["--weight_decay", "-1"], "--weight_decay -1.0: expected a weight decay"),
                      (["--jobs", "0"], "--jobs 0: expected an integer > 0")):
        _one_line_error([*base, *bad], capsys, said)
        assert not out.exists(), bad
    compare.main(base)
    assert {r["norm"] for r in _rows(out)} == {"layernorm"}


def test_a_report_of_no_runs_and_a_file_for_the_folder_are_one_line_and_write_nothing(tmp_path, capsys):
    """--report_only on a new folder built the embedded model in it before saying it held no run; a
    file given as the folder stopped with a traceback."""
    empty = tmp_path / "empty"
    _one_line_error(["--report_only", "--output_dir", str(empty)], capsys,
                    f"--report_only: no finished run under {empty}/cells")
    assert not empty.exists()
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    _one_line_error(["--output_dir", str(mine)], capsys, f"--output_dir {mine} is a file, not a folder")
    assert mine.read_text() == "mine"


# --------------------------------------------------------------------------------------------
# One process per output folder
# --------------------------------------------------------------------------------------------

def _compare_held_at_its_first_run(argv, started):
    """A forked `compare` that stops (holding its folder) once its first run starts."""
    import time

    from accelerate.state import AcceleratorState

    def wait(cell, folder):
        started.set()
        time.sleep(600)

    AcceleratorState._reset_state(reset_partial_state=True)
    compare_runs.run_cell = wait
    compare.main(argv)


def test_a_second_comparison_on_a_live_folder_stops_naming_the_first_and_a_killed_ones_lock_is_taken_over(
        gpt2_case, capsys, tmp_path):
    model, task, data = gpt2_case
    out = tmp_path / "out"
    argv = ["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm", "--seeds", "1", *TINY,
            "--output_dir", str(out)]
    context = multiprocessing.get_context("fork")
    started = context.Event()
    first = context.Process(target=_compare_held_at_its_first_run, args=(argv, started))
    first.start()
    try:
        assert started.wait(300)
        _one_line_error(argv, capsys, f"in use by process {first.pid}")
        assert not (out / "cells" / "layernorm-lr0.0005-seed1" / "result.json").exists()
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.join()
    from hf_powernorm.compare.plan import HOLDER_FILES
    from hf_powernorm.training.locking import LOCK_NAME

    assert HOLDER_FILES == (LOCK_NAME,) and (out / LOCK_NAME).is_file()  # left by the killed process: taken over
    compare.main(argv)
    assert {r["norm"] for r in _rows(out)} == {"layernorm"} and not (out / ".lock").exists()


# --------------------------------------------------------------------------------------------
# The data's contents in the fingerprint
# --------------------------------------------------------------------------------------------

def _data_changed(argv, capsys, edit) -> None:
    """Run `argv`, `edit()` the data in place, run again: the run is redone, and the log says why."""
    out = Path(argv[argv.index("--output_dir") + 1])
    compare.main(argv)
    result = out / "cells" / "layernorm-lr0.0005-seed1" / "result.json"
    first = json.loads(result.read_text())
    edit()
    capsys.readouterr()
    compare.main(argv)
    err = capsys.readouterr().err
    assert "layernorm-lr0.0005-seed1: the data changed since it ran; running it again" in err
    assert "0 of 1 runs finished, 1 to run" in err
    again = json.loads(result.read_text())
    assert again["fingerprint"]["data"] != first["fingerprint"]["data"]
    assert again["fingerprint"]["model"] == first["fingerprint"]["model"]


def test_a_train_file_edited_in_place_redoes_the_runs_and_says_the_data_changed(gpt2_case, capsys, tmp_path):
    model, task, data = gpt2_case
    train = tmp_path / "train.txt"
    text = Path(data[data.index("--train_file") + 1]).read_text(encoding="utf-8")
    train.write_text(text, encoding="utf-8")
    data = [*data]
    data[data.index("--train_file") + 1] = str(train)
    argv = ["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm", "--seeds", "1", *TINY,
            "--output_dir", str(tmp_path / "out")]
    # The same size and name: only the contents tell the edit apart.
    _data_changed(argv, capsys, lambda: train.write_text(text.replace("a", "e"), encoding="utf-8"))


def test_each_data_file_is_in_the_fingerprint(gpt2_case, tmp_path):
    """An edit of the validation or test file changes the data's fingerprint as one of the train
    file does: the runs scored on it are redone."""
    from hf_powernorm.compare.options import parse_args
    from hf_powernorm.compare.plan import fingerprint

    model, task, data = gpt2_case
    data = [*data]
    texts = {}
    for split in ("train", "validation", "test"):
        given = Path(data[data.index(f"--{split}_file") + 1])
        texts[split] = given.read_text(encoding="utf-8")
        (tmp_path / given.name).write_text(texts[split], encoding="utf-8")
        data[data.index(f"--{split}_file") + 1] = str(tmp_path / given.name)
    options = parse_args(["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm",
                          "--output_dir", str(tmp_path / "out")])
    seen = [fingerprint(options)]
    for split in ("train", "validation", "test"):
        (tmp_path / f"{split}.txt").write_text(texts[split].replace("a", "e"), encoding="utf-8")  # same size
        seen.append(fingerprint(options))
        assert seen[-1]["data"] != seen[-2]["data"], split
        assert {k: v for k, v in seen[-1].items() if k != "data"} == {k: v for k, v in seen[0].items() if k != "data"}


def test_a_local_dataset_folder_edited_in_place_redoes_the_runs(gpt2_case, capsys, tmp_path):
    from datasets import Dataset

    from hf_powernorm.training import synthetic_lm_corpus

    model, task, _ = gpt2_case
    lines = synthetic_lm_corpus({"train": 40})["train"]["text"]
    folder = tmp_path / "ds"
    Dataset.from_dict({"text": lines}).save_to_disk(folder)
    argv = ["--model_name_or_path", model, "--task", task, "--dataset_name", str(folder), "--block_size", "16",
            "--max_tokens", "64", "--norms", "layernorm", "--seeds", "1", *TINY, "--output_dir", str(tmp_path / "out")]

    def rewrite():
        Dataset.from_dict({"text": lines[::-1]}).save_to_disk(tmp_path / "ds2")
        for path in (tmp_path / "ds2").iterdir():
            os.replace(path, folder / path.name)

    _data_changed(argv, capsys, rewrite)


# --------------------------------------------------------------------------------------------
# A model that brings its own code
# --------------------------------------------------------------------------------------------

def test_a_folder_with_its_own_code_without_trust_remote_code_is_one_line_and_no_prompt(gpt2_case, capsys,
                                                                                        tmp_path):
    import shutil

    model, task, data = gpt2_case
    own = tmp_path / "own"
    shutil.copytree(model, own)
    config = json.loads((own / "config.json").read_text())
    config.update(model_type="my_gpt2", auto_map={"AutoConfig": "configuration_my_gpt2.MyGPT2Config"})
    (own / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(own), "--task", task, *data, "--output_dir", str(out)]
    capsys.readouterr()
    _one_line_error(argv, capsys, "brings its own code (an auto_map in its config.json): pass --trust_remote_code")
    assert not out.exists()
    assert compare.parse_args([*argv, "--trust_remote_code"]).trust_remote_code is True
    assert "trust_remote_code" not in compare.parse_args(argv).settings()  # where the code runs, not what is measured


@pytest.mark.parametrize("trusted", [[], ["--trust_remote_code"]])
def test_a_converted_folder_is_one_line_naming_its_norm(trusted, gpt2_case, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_powernorm import convert_norms

    model, task, data = gpt2_case
    converted = AutoModelForCausalLM.from_pretrained(model)
    convert_norms(converted, "powernorm")
    converted.save_pretrained(tmp_path / "converted")
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tmp_path / "converted"), "--task", task, *data, "--output_dir", str(out),
            *trusted]
    capsys.readouterr()
    _one_line_error(argv, capsys, "its norms were converted to powernorm (powernorm_conversion in its config.json); "
                                  "a comparison converts a model's own LayerNorm or RMSNorm layers: give the model "
                                  "it was converted from")
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# The same function as the baseline
# --------------------------------------------------------------------------------------------

def test_rmsnorm_in_a_llama_is_reported_as_the_same_function_as_its_own_norm(capsys, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_powernorm.training import synthetic_lm_corpus

    corpus = synthetic_lm_corpus({"train": 60, "validation": 12, "test": 12}, seed=5)
    tokenizer = _tokenizer(corpus["train"]["text"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                         pad_token_id=tokenizer.pad_token_id)
    _save_tiny(LlamaForCausalLM, config, tokenizer, tmp_path / "llama")
    for split, part in corpus.items():
        (tmp_path / f"{split}.txt").write_text("".join(line + "\n" for line in part["text"]), encoding="utf-8")
    out = tmp_path / "out"
    compare.main(["--model_name_or_path", str(tmp_path / "llama"), "--train_file", str(tmp_path / "train.txt"),
                  "--validation_file", str(tmp_path / "validation.txt"), "--test_file", str(tmp_path / "test.txt"),
                  "--block_size", "16", "--max_tokens", "64", "--norms", "layernorm", "rmsnorm", "--seeds", "1", "2",
                  *TINY, "--output_dir", str(out)])
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "- rmsnorm: the same function as LlamaRMSNorm" in report and "| rmsnorm | 2 |" not in report
    tested = {(r["norm"], r["seed"]): float(r["perplexity"]) for r in _rows(out) if r["split"] == "test"}
    assert tested[("rmsnorm", "1")] == pytest.approx(tested[("layernorm", "1")], rel=1e-6)
