"""Bad input to the recipes as a user meets it: one line on stderr and exit status 2 before anything
is written in `--output_dir`, and the corrected command then runs; an output folder used by one
process at a time (a live holder named, a killed one's lock taken over, also under `accelerate
launch`); a full disk during a checkpoint named, its partial write removed; `--trust_remote_code`."""

import csv
import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator

from launching import TWO_PROCESSES, _run_once, free_port
from recipe_scripts import lm_text_files, train_classification, train_lm, train_wmt
from test_recipes_finetune import _transformers_model_folder
from test_training_locking import _start_holder

from hf_powernorm import training
from hf_powernorm.training.locking import LOCK_NAME
from hf_powernorm.training.tasks import run_script

ROOT = Path(__file__).resolve().parents[2]
LM_FAST = ["--vocab_size", "100", "--block_size", "16", "--max_tokens", "128", "--warmup_steps", "2",
           "--eval_batch_size", "16", "--max_train_steps", "1"]
CLS_FAST = ["--vocab_size", "100", "--max_tokens", "256", "--warmup_steps", "2", "--eval_batch_size", "32",
            "--max_train_steps", "1"]

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def _command(script, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """`script`'s exit status and stderr when run as a command (`run_script`, as its `__main__` does)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [f"{script.__name__.removeprefix('recipes_')}.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        run_script(script.main, argv)
    return stopped.value.code, capsys.readouterr().err


def _error_line(err: str) -> str:
    """The one error line of a command's stderr (beside progress bars and logs of the data it read)."""
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory) -> list[str]:
    return lm_text_files(tmp_path_factory.mktemp("lm"), {"train": 120, "validation": 20, "test": 20}, seed=3)


@pytest.fixture(scope="module")
def csv_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cls")
    corpus = training.synthetic_classification_corpus({"train": 90}, seed=4)["train"]
    rows = io.StringIO()
    csv.writer(rows, lineterminator="\n").writerows(
        (text, training.SENTIMENT_LABELS[label]) for text, label in zip(corpus["text"], corpus["label"]))
    files = {"good": root / "train.csv", "latin1": root / "latin1.csv", "unlabelled": root / "unlabelled.csv",
             "plain": root / "plain.txt", "ragged": root / "ragged.csv"}
    files["good"].write_text("text,label\n" + rows.getvalue(), encoding="utf-8")
    files["latin1"].write_bytes(("text,label\n" + rows.getvalue()).encode() + "caf\xe9,positive\n".encode("latin-1"))
    files["unlabelled"].write_text("text,stars\n" + rows.getvalue(), encoding="utf-8")
    files["ragged"].write_text("text,label\n" + rows.getvalue() + "a,b,c\n", encoding="utf-8")
    files["plain"].write_text("".join(line + "\n" for line in corpus["text"]), encoding="utf-8")
    return files


@pytest.mark.parametrize("script, bad, message", [
    (train_lm, ["--learning_rate", "-0.001"], "--learning_rate -0.001: expected a learning rate, a finite number > 0"),
    (train_lm, ["--learning_rate", "0"], "--learning_rate 0.0: expected a learning rate, a finite number > 0"),
    (train_classification, ["--dropout", "2"], "--dropout 2.0: expected a dropout probability in [0, 1)"),
    (train_wmt, ["--weight_decay", "-1"], "--weight_decay -1.0: expected a weight decay, a finite number >= 0"),
    (train_lm, ["--powernorm_alpha_fwd", "2"], "powernorm_alpha_fwd must be a number in [0, 1], got 2.0"),
    (train_classification, ["--config_overrides", "hidden_sizee=3"], "key hidden_sizee isn't in the original config"),
    (train_wmt, ["--clip_norm", "-1"], "--clip_norm -1.0: expected a finite number >= 0"),
    (train_lm, ["--learning_rate", "abc"], "argument --learning_rate: invalid float value: 'abc'"),
], ids=["lr-negative", "lr-zero", "dropout", "weight-decay", "pn-alpha", "config-field", "clip-norm", "not-a-number"])
def test_options_are_checked_before_anything_is_written(script, bad, message, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    code, err = _command(script, [*bad, "--output_dir", str(out)], capsys, monkeypatch)
    name = script.__name__.removeprefix("recipes_")
    assert code == 2 and err.startswith(f"{name}.py: error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_the_script_exits_2_with_one_line_and_the_corrected_command_runs(lm_files, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "recipes" / "train_lm.py"), *LM_FAST, *lm_files, "--output_dir", str(out)]
    refused = subprocess.run([*command, "--learning_rate", "-0.001"], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and refused.stderr == (
        "train_lm.py: error: --learning_rate -0.001: expected a learning rate, a finite number > 0\n"), refused.stderr
    assert not out.exists()
    results = train_lm.main([*LM_FAST, *lm_files, "--output_dir", str(out), "--learning_rate", "1e-3"])
    assert results["train_steps"] == 1 and (out / "model.safetensors").is_file() and not (out / LOCK_NAME).exists()


def test_bad_data_is_one_line_and_leaves_nothing_behind(csv_files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    model = tmp_path / "not_a_model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    for bad, message in [
        (["--train_file", str(csv_files["latin1"])], f"{csv_files['latin1']}:92: not UTF-8 (byte 0xe9 at column 4)"),
        (["--train_file", str(csv_files["unlabelled"])], f"{csv_files['unlabelled']}: no label was found"),
        (["--train_file", str(csv_files["plain"])], f"{csv_files['plain']}:1: no label was found"),
        (["--train_file", str(csv_files["ragged"])], f"{csv_files['ragged']} cannot be read as CSV"),
        (["--model_name_or_path", str(model)], f"--model_name_or_path {model} holds no config.json"),
    ]:
        code, err = _command(train_classification, [*CLS_FAST, *bad, "--output_dir", str(out)], capsys, monkeypatch)
        assert code == 2 and message in _error_line(err), err
        assert not out.exists()  # made for the run, emptied and removed with its lock
    results = train_classification.main([*CLS_FAST, "--train_file", str(csv_files["good"]), "--output_dir", str(out)])
    assert results["train_steps"] == 1 and (out / "model.safetensors").is_file()


def test_labels_of_a_file_without_any(csv_files):
    """The class names read from the data before a pretrained classifier is loaded (`data_labels`)."""
    task = train_classification.Classification.from_options(train_file=str(csv_files["plain"]))
    with pytest.raises(ValueError, match=f"^{csv_files['plain']}: no label was found: expected 'sentence@label'"):
        task.data_labels()
    task = train_classification.Classification.from_options(train_file=str(csv_files["unlabelled"]))
    with pytest.raises(ValueError, match="^no label was found: --task classification needs .* 'stars'"):
        task.data_labels()


def test_a_named_column_that_is_missing():
    from datasets import Dataset

    from hf_powernorm.training.readers import rename_columns

    part = Dataset.from_dict({"review": ["good"], "stars": [5]})
    assert rename_columns(part, {"text": "review", "label": None}, "train.csv").column_names == ["text", "stars"]
    with pytest.raises(ValueError, match=r"^--text_column 'body': no such column in train.csv; expected one of "
                                         r"\['review', 'stars'\]$"):
        rename_columns(part, {"text": "body"}, "train.csv")


def test_a_live_output_folder_is_refused_and_a_killed_holders_lock_taken_over(lm_files, tmp_path, capsys,
                                                                              monkeypatch):
    out = tmp_path / "out"
    holder = _start_holder(out)  # a run in progress, as far as the folder can tell
    try:
        argv = [*LM_FAST, *lm_files, "--output_dir", str(out)]
        code, err = _command(train_lm, argv, capsys, monkeypatch)
        assert code == 2 and err.count("\n") == 1 and f"{out} is in use by process {holder.pid}" in err, err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid  # left behind by the killed process
    results = train_lm.main(argv)
    assert results["train_steps"] == 1 and not (out / LOCK_NAME).exists()


def test_a_live_output_folder_refuses_a_two_process_launch(lm_files, tmp_path):
    out = tmp_path / "out"
    holder = _start_holder(out)
    try:
        command = [sys.executable, "-m", "accelerate.commands.launch", *TWO_PROCESSES, "--main_process_port",
                   free_port(), str(ROOT / "recipes" / "train_lm.py"), "--cpu", *LM_FAST, *lm_files,
                   "--output_dir", str(out)]
        returncode, output = _run_once(command, timeout=300)
        assert returncode not in (0, None) and f"train_lm.py: error: {out} is in use by process {holder.pid}" in output, \
            output[-4000:]
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_full_disk_during_a_checkpoint_is_named_and_the_partial_write_removed(lm_files, tmp_path, capsys,
                                                                                 monkeypatch):
    def fill_the_disk(self, output_dir):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 64)  # a partial write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Accelerator, "save_state", fill_the_disk)
    out = tmp_path / "out"
    code, err = _command(train_lm, [*LM_FAST, *lm_files, "--checkpointing_steps", "1", "--output_dir", str(out)],
                         capsys, monkeypatch)
    line = _error_line(err)
    assert code == 2 and f"the disk holding {out} is full" in line and "writing checkpoint step_1 failed" in line, err
    assert not [p.name for p in out.iterdir() if "step_1" in p.name]


def test_a_full_disk_during_the_export_removes_its_files_keeps_the_checkpoint_and_resuming_exports(
        lm_files, tmp_path, capsys, monkeypatch):
    """The final `save_pretrained` on a full disk: one line naming the folder and how to export again,
    the export's partial files removed, the folder's checkpoint kept; the command it names exports."""
    from transformers import PreTrainedModel

    out = tmp_path / "out"
    save_pretrained = PreTrainedModel.save_pretrained

    def fill_the_disk(self, save_directory, *args, **kwargs):
        if Path(save_directory) != out:  # the best model's copy: written as usual
            return save_pretrained(self, save_directory, *args, **kwargs)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 64)  # a partial write
        raise OSError(errno.ENOSPC, "No space left on device")

    argv = [*LM_FAST, *lm_files, "--checkpointing_steps", "1", "--output_dir", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "save_pretrained", fill_the_disk)
        code, err = _command(train_lm, argv, capsys, monkeypatch)
    line = _error_line(err)
    assert code == 2 and f"the disk holding {out} is full (" in line and "writing the export failed" in line, err
    assert "--resume_from_checkpoint latest (from step_1) exports it" in line, line
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert (out / "step_1").is_dir()
    results = train_lm.main([*argv, "--resume_from_checkpoint", "latest"])
    assert results["train_steps"] == 1
    assert (out / "model.safetensors").stat().st_size > 64 and (out / "README.md").exists()


def test_trust_remote_code_loads_a_model_with_its_own_code(lm_files, tmp_path, capsys, monkeypatch):
    """A GPT-2 whose config and model classes live in its folder (`auto_map`): refused in one line
    without `--trust_remote_code`, never with Transformers' question on the terminal; converted and
    trained with it."""
    folder = _transformers_model_folder(tmp_path, "gpt2", Path(lm_files[1]).read_text().splitlines())
    (folder / "configuration_custom.py").write_text(
        "from transformers import GPT2Config\n\n\nclass CustomConfig(GPT2Config):\n    model_type = 'custom_gpt2'\n")
    (folder / "modeling_custom.py").write_text(
        "from transformers import GPT2LMHeadModel\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(GPT2LMHeadModel):\n    config_class = CustomConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom_gpt2", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    argv = [*LM_FAST, *lm_files, "--model_name_or_path", str(folder), "--convert_norms", "powernorm",
            "--output_dir", str(out)]
    code, err = _command(train_lm, argv, capsys, monkeypatch)
    assert code == 2 and "trust_remote_code=True" in _error_line(err) and "[y/N]" not in err, err
    assert not out.exists()
    results = train_lm.main([*argv, "--trust_remote_code"])
    assert results["train_steps"] == 1
    assert json.loads((out / "config.json").read_text())["powernorm_conversion"]["norm_type"] == "powernorm"


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("basic_ios::clear: iostream error")], ids=["errno", "torch"])
def test_a_full_disk_during_an_atomic_write_keeps_the_old_file(failure, tmp_path, monkeypatch):
    """`write_json_atomically` on a full disk (as Python or PyTorch's writer reports it, here when
    the file is flushed): one line naming the folder, the temporary file removed, the previous
    version in place."""
    from hf_powernorm.training.atomic_files import DiskFullError, write_json_atomically

    path = tmp_path / "state.json"
    write_json_atomically(path, {"step": 1})

    def write_half_then(raised: BaseException):
        def flush(descriptor):
            os.ftruncate(descriptor, os.fstat(descriptor).st_size // 2)
            raise raised
        return flush

    monkeypatch.setattr(os, "fsync", write_half_then(failure))
    with pytest.raises(DiskFullError) as error:
        write_json_atomically(path, {"step": 2})
    assert str(error.value).startswith(f"the disk holding {tmp_path} is full (") and "\n" not in str(error.value)
    assert error.value.__cause__ is failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert json.loads(path.read_text()) == {"step": 1}
    monkeypatch.setattr(os, "fsync", write_half_then(KeyError("not a disk")))
    with pytest.raises(KeyError):  # any other failure is itself, the partial file removed all the same
        write_json_atomically(path, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_atomic_write_never_goes_through_a_link_at_its_temporary_name(tmp_path):
    from hf_powernorm.training.atomic_files import write_json_atomically

    path, target = tmp_path / "state.json", tmp_path / "notes.txt"
    target.write_text("mine")
    temporary = tmp_path / f".state.json.tmp-{os.getpid()}"
    temporary.symlink_to(target)
    with pytest.raises(ValueError, match=f"^{temporary} is a symbolic link where a temporary file is written"):
        write_json_atomically(path, {"step": 1})
    assert target.read_text() == "mine" and temporary.is_symlink() and not path.exists()
    temporary.unlink()
    temporary.write_text("left by a killed writer")  # a regular leftover of this process id is replaced
    write_json_atomically(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 2} and not temporary.exists()
