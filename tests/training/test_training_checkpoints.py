"""Checkpoints that survive a kill, runs that never resume a broken or foreign checkpoint, and
output folders that are never silently reused.

A real training process is killed with SIGKILL at chosen points of its checkpoint writes (the
writer's test hook) and at a random moment; `--resume_from_checkpoint latest` then finishes the run
with the weights of an unbroken one. Checkpoints and exports hold no pickle of the project's own,
every check that needs no data runs before any is read, `--checkpoints_total_limit` keeps the
newest checkpoints, and `average_checkpoints.py` writes a complete export or none.
"""

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from recipe_scripts import average_checkpoints, lm_text_files, train_lm, train_wmt

from hf_powernorm import training
from hf_powernorm.training import averaging, checkpoints, language_modeling, translation

LM_TINY = ["--vocab_size", "120", "--block_size", "16", "--max_tokens", "128", "--warmup_steps", "3",
           "--learning_rate", "5e-3", "--eval_batch_size", "32", "--dropout", "0.1", "--eval_steps", "2"]
RUN = [*LM_TINY, "--max_train_steps", "6", "--checkpointing_steps", "1"]
# Pickle streams start with the PROTO opcode; torch.save writes a zip archive around one.
PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory) -> list[str]:
    return lm_text_files(tmp_path_factory.mktemp("ckpt_data"), {"train": 100, "validation": 16}, seed=21)


@pytest.fixture(scope="module")
def unbroken(lm_files, tmp_path_factory) -> Path:
    """Six updates with a checkpoint after each and a validation every second one, never killed."""
    from accelerate.state import AcceleratorState

    out = tmp_path_factory.mktemp("unbroken") / "run"
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    train_lm.main([*RUN, *lm_files, "--output_dir", str(out)])
    torch.set_num_threads(previous)
    AcceleratorState._reset_state(reset_partial_state=True)
    return out


def _assert_same_weights(first: Path, second: Path) -> None:
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{first}: {key}"


def _pickled(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4).startswith(PICKLE_MAGIC) or path.suffix in (".pkl", ".bin", ".pt", ".pth")


# --------------------------------------------------------------------------------------------
# Killed runs
# --------------------------------------------------------------------------------------------

def _train_in_child(argv: list[str], crash: str | None) -> None:
    """A forked training process (it shares the imports, so it starts in a second, not ten)."""
    from accelerate.state import AcceleratorState

    if crash is not None:
        os.environ[checkpoints.CRASH_AFTER_FILES_ENV] = crash
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(1)
    train_lm.main(argv)


def _start(argv: list[str], crash: str | None = None) -> multiprocessing.Process:
    child = multiprocessing.get_context("fork").Process(target=_train_in_child, args=(argv, crash))
    child.start()
    return child


def test_killed_checkpoint_writes_resume_to_the_weights_of_an_unbroken_run(lm_files, unbroken, tmp_path, capsys,
                                                                          reset_accelerate):
    out = tmp_path / "run"
    first, again = [*RUN, *lm_files, "--output_dir", str(out)], \
        [*RUN, *lm_files, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    files = len([p for p in (unbroken / "step_1").rglob("*") if p.is_file()])  # with the manifest
    # Killed writing update 2 after Accelerate's files, 3 after config and tokenizer, 4 after the
    # manifest but before the rename, 5 just after the rename (complete, leftovers not yet removed).
    for number, (after, step) in enumerate(((1, 2), (files - 2, 3), (files, 4), (files + 1, 5))):
        child = _start(again if number else first, f"{after}@{step}")
        child.join(120)
        assert child.exitcode == -signal.SIGKILL, (after, step, child.exitcode)
        assert (out / f"step_{step}").is_dir() is (step == 5)
        assert bool(list(out.glob(f".step_{step}.tmp-*"))) is (step != 5)  # the interrupted write, aside
        assert (out / f"step_{step - 1}" / training.MANIFEST_NAME).is_file()
    # And a kill -9 at a random moment of a resumed run.
    child = _start(again)
    time.sleep(random.uniform(0.5, 2.5))
    os.kill(child.pid, signal.SIGKILL)
    child.join(120)
    capsys.readouterr()

    reset_accelerate()
    train_lm.main(again)
    log = capsys.readouterr().out
    assert "Resuming from" in log
    for name in ("step_6/model.safetensors", "model.safetensors", "best_model/model.safetensors"):
        _assert_same_weights(out / name, unbroken / name)
    steps = [r["step"] for r in training.read_run_log(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # each update logged once, whatever was redone


def _flip_a_byte(checkpoint: Path) -> None:
    """One byte of the checkpoint's weights changed, its size kept: only the SHA-256 tells."""
    weights = bytearray((checkpoint / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (checkpoint / "model.safetensors").write_bytes(bytes(weights))


def test_latest_passes_over_incomplete_checkpoints_and_sets_aside_corrupt_ones(unbroken, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    out.mkdir()
    for step in (2, 3, 4):
        (out / f"step_{step}").symlink_to(unbroken / f"step_{step}", target_is_directory=True)
    (out / ".step_5.tmp-123").mkdir()
    broken = out / "step_6"  # every file but one byte of the weights
    broken.mkdir()
    for path in (unbroken / "step_6").iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    _flip_a_byte(broken)
    (out / "step_7").mkdir()  # an empty folder, as an older version left one
    with pytest.raises(ValueError, match=r"step_6 is not a complete checkpoint: .*SHA-256"):
        training.resolve_resume_path(str(broken), out)
    with caplog.at_level("WARNING"):
        assert training.resolve_resume_path("latest", out) == out / "step_4"
    said = capsys.readouterr().out
    for name, reason in ((".step_5.tmp-123", "an interrupted write"), ("step_7", "no checkpoint.json")):
        assert f"{name} ({reason}" in said, said
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"{broken}: model.safetensors does not match its SHA-256" in warned[0]
    assert f"set aside as {out / 'step_6.corrupt'}" in warned[0]
    assert not broken.exists() and (out / "step_6.corrupt" / "model.safetensors").is_file()
    assert training.resolve_resume_path("latest", out) == out / "step_4"  # nothing left to set aside
    (tmp_path / "only" / "step_1").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no complete step_\* checkpoint in .*only; incomplete: step_1 \(.*\)\. "
                                         r"Nothing to resume: run the command without --resume_from_checkpoint"):
        training.resolve_resume_path("latest", tmp_path / "only")


def test_a_corrupt_checkpoint_never_blocks_the_rerun(lm_files, unbroken, tmp_path, capsys, caplog, reset_accelerate):
    """A flipped byte in the newest checkpoint: the same command resumes from the one before; in
    every checkpoint: it starts over. Either way it ends with the weights of an unbroken run, the
    corrupt checkpoints set aside and named."""
    import shutil

    out = tmp_path / "run"
    again = [*RUN, *lm_files, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    shutil.copytree(unbroken, out)
    _flip_a_byte(out / "step_6")
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        train_lm.main(again)
    assert f"Resuming from {out / 'step_5'}" in capsys.readouterr().out
    assert any(f"{out / 'step_6'}: model.safetensors does not match" in r.getMessage() for r in caplog.records)
    for name in ("step_6/model.safetensors", "model.safetensors", "best_model/model.safetensors"):
        _assert_same_weights(out / name, unbroken / name)
    assert (out / "step_6.corrupt").is_dir()

    shutil.rmtree(out)
    shutil.copytree(unbroken, out)
    for checkpoint in out.glob("step_*"):
        _flip_a_byte(checkpoint)
    reset_accelerate()
    caplog.clear()
    with caplog.at_level("WARNING"):
        results = train_lm.main(again)
    assert "Resuming from" not in capsys.readouterr().out and results["test_perplexity"] > 1
    assert any("no valid checkpoint left" in r.getMessage() and "starts over" in r.getMessage()
               for r in caplog.records)
    assert sorted(p.name for p in out.glob("step_*.corrupt")) == [f"step_{n}.corrupt" for n in range(1, 7)]
    for name in ("step_6/model.safetensors", "model.safetensors", "best_model/model.safetensors"):
        _assert_same_weights(out / name, unbroken / name)
    steps = [r["step"] for r in training.read_run_log(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # the earlier attempt's log went with it


# --------------------------------------------------------------------------------------------
# No pickle of the project's own
# --------------------------------------------------------------------------------------------

def test_a_manifest_naming_a_path_outside_its_checkpoint_is_refused(unbroken, tmp_path):
    import shutil

    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"not the checkpoint's")
    for name in (str(outside), "../elsewhere.bin"):
        folder = tmp_path / "run" / "step_6"
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        shutil.copytree(unbroken / "step_6", folder)
        manifest = json.loads((folder / training.MANIFEST_NAME).read_text())
        manifest["files"][name] = {"size": outside.stat().st_size, "sha256": "0" * 64}
        (folder / training.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(checkpoints.IncompleteCheckpointError, match=f"names {name!r}, a path outside"):
            training.read_manifest(folder)
        assert checkpoints.latest_checkpoint(tmp_path / "run") is None


def test_checkpoints_keep_the_loop_state_as_json_and_exports_hold_no_pickle(unbroken, tmp_path):
    checkpoint = unbroken / "step_4"
    state = json.loads((checkpoint / training.TRAINING_STATE_NAME).read_text())
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert state["early_stopping"]["best_step"] in (2, 4) and state["sampler"]["seed"] == 1
    # Accelerate pickles its optimizer and RNG states; nothing else in a checkpoint is a pickle.
    pickled = sorted(p.name for p in checkpoint.iterdir() if _pickled(p))
    assert pickled == ["optimizer.bin", "random_states_0.pkl"]
    assert not list(checkpoint.glob("custom_checkpoint_*"))
    manifest = training.read_manifest(checkpoint)
    assert set(manifest["files"]) == {p.name for p in checkpoint.iterdir()} - {training.MANIFEST_NAME}
    # Every file of the exports: the run's (top level and best_model/) and an average.
    average_checkpoints.main(["--checkpoint_dir", str(unbroken), "--num_checkpoints", "2",
                              "--output_dir", str(tmp_path / "averaged")])
    exported = [p for p in unbroken.iterdir() if p.is_file()]
    exported += [*(unbroken / training.BEST_MODEL_DIR).iterdir(), *(tmp_path / "averaged").iterdir()]
    assert len(exported) > 20 and not [p for p in exported if _pickled(p)]


def test_schedules_resume_from_their_json_state():
    """Every schedule of `--lr_scheduler_type` that builds from the command line's options goes on
    from its JSON state as the unbroken one does (the lambdas are built again, not saved)."""
    for name in training.SCHEDULER_TYPES:
        model = torch.nn.Linear(2, 2)
        optimizer = training.build_optimizer(model, lr=1e-3)
        try:
            scheduler = training.build_scheduler(name, optimizer, 3, 12)
        except (TypeError, ValueError):
            continue  # needs options the recipes do not give (e.g. a minimum rate)
        for _ in range(5):
            optimizer.step()
            scheduler.step()
        state = json.loads(json.dumps(training.scheduler_state(scheduler)))
        copy = training.build_optimizer(torch.nn.Linear(2, 2), lr=1e-3)
        copy.load_state_dict(optimizer.state_dict())
        resumed = training.build_scheduler(name, copy, 3, 12)
        training.load_scheduler_state(resumed, state)
        for _ in range(5):
            optimizer.step(), copy.step()
            scheduler.step(), resumed.step()
            assert resumed.get_last_lr() == scheduler.get_last_lr(), name
            assert copy.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"], name


# --------------------------------------------------------------------------------------------
# Refused before any work
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_data(monkeypatch):
    """Reading data or training a BPE fails: what is refused here is refused before both."""
    def refuse(*args, **kwargs):
        raise AssertionError("data was read")

    for module, name in ((language_modeling, "load_lm_dataset"), (translation, "load_translation_dataset"),
                         (training.tokenization, "train_bpe_tokenizer")):
        monkeypatch.setattr(module, name, refuse)


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize("extra, message", [
    (["--norm_type", "layernorm"], r"--norm_type is 'layernorm' here, None there"),
    (["--powernorm_alpha_fwd", "0.5", "--vocab_size", "130"],
     r"--powernorm_alpha_fwd is 0.5 here, None there; --vocab_size is 130 here, 120 there"),
    (["--config_overrides", "hidden_size=32"], r"--config_overrides is 'hidden_size=32' here"),
    (["--gradient_accumulation_steps", "2", "--lr_scheduler_type", "linear"],
     r"--gradient_accumulation_steps is 2 here, 1 there; --lr_scheduler_type is 'linear' here, 'inverse_sqrt'"),
])
def test_resuming_a_checkpoint_of_another_configuration_is_refused_before_any_work(
        extra, message, lm_files, unbroken, tmp_path, no_data):
    out = tmp_path / "run"
    out.mkdir()
    (out / "step_4").symlink_to(unbroken / "step_4", target_is_directory=True)
    before = _listing(out)
    with pytest.raises(ValueError, match=r"step_4: the checkpoint belongs to a run of another configuration: "
                                         + message):
        train_lm.main([*RUN, *lm_files, *extra, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert _listing(out) == before


def test_resuming_with_another_tokenizer_or_model_is_refused(lm_files, unbroken, tmp_path, reset_accelerate):
    out = tmp_path / "run"
    out.mkdir()
    (out / "step_4").symlink_to(unbroken / "step_4", target_is_directory=True)
    other = training.train_bpe_tokenizer(["a b c d e f g"] * 5, vocab_size=20)
    other.save_pretrained(tmp_path / "other")
    before = _listing(out)
    with pytest.raises(ValueError, match=r"the tokenizer of .*other \(\d+ tokens\) is not the checkpoint's "
                                         r"\(\d+ tokens\)"):
        train_lm.main([*RUN, *lm_files, "--tokenizer_name", str(tmp_path / "other"), "--output_dir", str(out),
                       "--resume_from_checkpoint", "latest"])
    # What the command line does not show is compared once the model exists, before training.
    reset_accelerate()
    with pytest.raises(ValueError, match=r"max_position_embeddings is 102 here, 64 there"):
        train_lm.main([*RUN, *lm_files, "--block_size", "100", "--output_dir", str(out),
                       "--resume_from_checkpoint", "latest"])
    assert _listing(out) == before


def test_checks_that_need_no_data_come_before_any_work(lm_files, unbroken, tmp_path, no_data):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "model.safetensors").write_bytes(b"an earlier run")
    cases = [
        (train_lm, ["--output_dir", str(occupied)], r"already holds another run's files \(model.safetensors\): "
                                                    r"pass --overwrite_output_dir"),
        (train_lm, ["--output_dir", str(tmp_path / "a"), "--resume_from_checkpoint", "latest"],
         r"latest: no complete step_\* checkpoint .*without --resume_from_checkpoint"),
        (train_lm, ["--output_dir", str(tmp_path / "a"), "--resume_from_checkpoint", str(tmp_path / "step_3")],
         r"step_3 is not a complete checkpoint"),
        (train_lm, ["--output_dir", str(unbroken), "--resume_from_checkpoint", "latest", "--overwrite_output_dir"],
         r"--overwrite_output_dir would delete the checkpoint"),
        (train_lm, [*lm_files, "--output_dir", str(Path(lm_files[1]).parent), "--overwrite_output_dir"],
         r"would delete .*train.txt, an input of this run"),
        (train_lm, ["--output_dir", str(occupied), "--overwrite_output_dir"],
         r"holds no training_log.jsonl or all_results.json, and clearing it would delete model.safetensors"),
        (train_lm, ["--output_dir", str(tmp_path / "a"), "--checkpoints_total_limit", "0"],
         r"--checkpoints_total_limit must be at least 1; got 0"),
        (train_wmt, ["--output_dir", str(tmp_path / "a"), "--max_tokens", "100"],
         r"--max_tokens 100 is less than --max_source_length 128"),
        (train_wmt, ["--output_dir", str(tmp_path / "a"), "--max_tokens", "100", "--max_length", "64",
                     "--max_target_length", "120"], r"--max_tokens 100 is less than --max_target_length 120"),
    ]
    for script, argv, message in cases:
        with pytest.raises(ValueError, match=message):
            script.main(argv)
    assert not (tmp_path / "a").exists() and [p.name for p in occupied.iterdir()] == ["model.safetensors"]


def test_overwrite_output_dir_clears_another_runs_files(lm_files, tmp_path):
    out = tmp_path / "run"
    (out / "step_9").mkdir(parents=True)
    (out / "tokenizer").mkdir()
    (out / "README.md").write_text("an earlier run")
    (out / "training_log.jsonl").write_text('{"step": 1}\n')  # the record that makes it a run's folder
    train_lm.main([*LM_TINY, *lm_files, "--max_train_steps", "2", "--checkpointing_steps", "2",
                   "--overwrite_output_dir", "--output_dir", str(out)])
    assert not (out / "step_9").exists() and (out / "step_2" / training.MANIFEST_NAME).is_file()
    assert "an earlier run" not in (out / "README.md").read_text()



def test_overwrite_clears_only_a_folder_holding_the_tools_record(tmp_path, monkeypatch):
    folder = tmp_path / "home" / "run"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / checkpoints.LOCK_NAME).write_text("")
    with pytest.raises(ValueError, match=r"holds no compare.json, and clearing it would delete notes.txt;"):
        checkpoints.check_clearable(folder, ["compare.json"])
    (folder / "compare.json").symlink_to(folder / "notes.txt")  # a link is no record of the tool's
    with pytest.raises(ValueError, match=r"would delete compare.json, notes.txt;"):
        checkpoints.check_clearable(folder, ["compare.json"])
    (folder / "compare.json").unlink()
    (folder / "compare.json").write_text("{}")
    checkpoints.check_clearable(folder, ["compare.json"])
    with pytest.raises(ValueError, match=r"would delete .*notes.txt, an input of this run"):
        checkpoints.check_clearable(folder, ["compare.json"], inputs=[None, str(folder / "notes.txt")])
    monkeypatch.setenv("HOME", str(folder / "me"))
    with pytest.raises(ValueError, match=r"holds the home folder"):
        checkpoints.check_clearable(folder, ["compare.json"])
    monkeypatch.chdir(folder)
    with pytest.raises(ValueError, match=r"--output_dir \. holds the current directory"):
        checkpoints.check_clearable(".", ["compare.json"])
    assert sorted(p.name for p in folder.iterdir()) == [checkpoints.LOCK_NAME, "compare.json", "notes.txt"]


# --------------------------------------------------------------------------------------------
# Keeping the newest checkpoints
# --------------------------------------------------------------------------------------------

def test_checkpoints_total_limit_keeps_the_newest_and_the_one_resumed_from(lm_files, tmp_path, capsys,
                                                                         reset_accelerate):
    out = tmp_path / "run"
    run = [*LM_TINY, *lm_files, "--checkpointing_steps", "1", "--output_dir", str(out)]
    train_lm.main([*run, "--max_train_steps", "4", "--checkpoints_total_limit", "2"])
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3", "step_4"]
    assert (out / training.BEST_MODEL_DIR / "model.safetensors").is_file()
    reset_accelerate()
    train_lm.main([*run, "--max_train_steps", "6", "--checkpoints_total_limit", "1",
                   "--resume_from_checkpoint", str(out / "step_3")])
    assert f"Resuming from {out / 'step_3'}" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3", "step_6"]


def test_prune_checkpoints_counts_complete_ones_only(unbroken, tmp_path):
    for step in range(1, 6):
        (tmp_path / f"step_{step}").symlink_to(unbroken / f"step_{step}", target_is_directory=True)
    (tmp_path / "step_7").mkdir()  # incomplete: neither counted nor removed
    deleted = training.prune_checkpoints(tmp_path, 2, protect=[tmp_path / "step_2"])
    assert [p.name for p in deleted] == ["step_1", "step_3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_5", "step_7"]
    assert (unbroken / "step_1" / training.MANIFEST_NAME).is_file()  # a link is removed, not its target
    with pytest.raises(ValueError, match="keep must be at least 1; got 0"):
        training.prune_checkpoints(tmp_path, 0)


# --------------------------------------------------------------------------------------------
# Averaging
# --------------------------------------------------------------------------------------------

def test_average_takes_complete_checkpoints_in_order_with_the_same_tensors(unbroken, tmp_path):
    steps = {step: unbroken / f"step_{step}" for step in range(1, 7)}
    output = tmp_path / "averaged"
    average = lambda *folders: average_checkpoints.main(  # noqa: E731
        ["--inputs", *map(str, folders), "--output_dir", str(output)])
    with pytest.raises(ValueError, match=r"oldest first, each once: .*step_4 \(update 4\) comes after .*step_5"):
        average(steps[5], steps[4])
    with pytest.raises(ValueError, match=r"oldest first, each once: .*step_5 \(update 5\) comes after .*step_5"):
        average(steps[5], steps[5])
    incomplete = tmp_path / "step_7"
    incomplete.mkdir()
    with pytest.raises(ValueError, match=r"step_7 is not a complete checkpoint: .*step_7: no checkpoint.json"):
        average(steps[5], incomplete)
    other = tmp_path / "step_8"  # a complete checkpoint of a wider model
    other.mkdir()
    for path in steps[6].iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    key = next(k for k in weights if k.endswith("fc1.weight"))
    weights[key] = torch.zeros(weights[key].shape[0] + 1, weights[key].shape[1])
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    training.write_manifest(other, 8, {"run": "other"})
    with pytest.raises(ValueError, match=rf"tensor '{key}' has shape \(\d+, \d+\) in .*step_6 but"):
        average(steps[6], other)
    renamed = tmp_path / "step_9"
    renamed.mkdir()
    for path in steps[6].iterdir():
        (renamed / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(renamed / "model.safetensors"))
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    training.write_manifest(renamed, 9, {"run": "other"})
    with pytest.raises(ValueError, match=r"hold different tensors: \['extra.weight'\]"):
        average(steps[6], renamed)
    assert not output.exists() and not list(tmp_path.glob(".averaged*"))


def test_average_writes_a_complete_export_or_none_and_replaces_one_only_when_asked(unbroken, tmp_path, monkeypatch):
    output = tmp_path / "averaged"
    argv = ["--checkpoint_dir", str(unbroken), "--num_checkpoints", "3", "--output_dir", str(output)]
    average_checkpoints.main(argv)
    names = {p.name for p in output.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_powernorm.py", "tokenizer.json", "README.md",
            "all_results.json"} <= names
    assert not names & {"optimizer.bin", "random_states_0.pkl", training.MANIFEST_NAME, training.TRAINING_STATE_NAME}
    results = json.loads((output / "all_results.json").read_text())
    assert results == {"averaged_checkpoints": ["step_4", "step_5", "step_6"], "averaged_steps": [4, 5, 6],
                       "train_steps": 6}
    assert "updates 4, 5, 6" in (output / "README.md").read_text()
    (output / "stale.txt").write_text("left by an earlier export")
    with pytest.raises(ValueError, match=r"already exists; pass --overwrite"):
        average_checkpoints.main(argv)

    def failing_card(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(averaging, "complete_average_export", failing_card)
    with pytest.raises(OSError, match="disk full"):
        average_checkpoints.main([*argv, "--overwrite"])
    assert (output / "stale.txt").is_file() and not list(tmp_path.glob(".averaged*"))  # the old export, whole
    monkeypatch.undo()
    average_checkpoints.main([*argv, "--num_checkpoints", "2", "--overwrite"])
    assert not (output / "stale.txt").exists()
    assert json.loads((output / "all_results.json").read_text())["averaged_steps"] == [5, 6]
