"""The recipes' trackers (`--with_tracking --report_to`) and Hub upload (`--push_to_hub`).

TensorBoard runs for real: the event files a run writes are read back. No Hub server is reachable
from the tests: the `hub` fixture of `conftest.py` records what the recipe creates and uploads.
"""

import json
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from safetensors.torch import load_file

from recipe_scripts import lm_text_files, train_classification, train_lm

from hf_powernorm import training

ROOT = Path(__file__).resolve().parents[2]

LM_TINY = ["--vocab_size", "120", "--block_size", "16", "--max_tokens", "128", "--warmup_steps", "3",
           "--learning_rate", "5e-3", "--eval_batch_size", "16", "--max_train_steps", "4", "--eval_steps", "2"]

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> list[str]:
    return lm_text_files(tmp_path_factory.mktemp("lm_data"), {"train": 80, "validation": 12}, seed=5)


# --------------------------------------------------------------------------------------------
# Tracking
# --------------------------------------------------------------------------------------------

def test_with_tracking_writes_tensorboard_scalars(text_files, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = train_lm.main([*LM_TINY, *text_files, "--with_tracking", "--output_dir", str(tmp_path)])
    runs = list((tmp_path / "train_lm").rglob("events.out.tfevents.*"))
    assert runs, f"no TensorBoard event file under {tmp_path / 'train_lm'}"
    events = EventAccumulator(str(runs[0].parent))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for tag in ("train_loss", "lr", "tokens_per_second"):
        assert [step for step, _ in scalars[tag]] == [1, 2, 3, 4], tag
    assert all(value > 0 for _, value in scalars["tokens_per_second"])
    # Learning rate of the inverse-square-root schedule: linear warmup over 3 updates, then decay.
    lrs = [value for _, value in scalars["lr"]]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[3] < lrs[2]
    # Validation every 2 updates (perplexity), then the final scores at the last update.
    assert [step for step, _ in scalars["validation"]] == [2, 4]
    assert scalars["validation_perplexity"] == [(4, pytest.approx(results["validation_perplexity"], rel=1e-6))]


@pytest.mark.parametrize("report_to, message", [
    ("tensorbored", "unknown tracker \\['tensorbored'\\]; valid: \\['all'"),
    ("wandb", "\\['wandb'\\] not installed .*pip install wandb"),
    ("all", "no tracker is installed; pip install tensorboard"),
])
def test_trackers_that_cannot_log_fail_before_training(report_to, message, tmp_path, monkeypatch):
    monkeypatch.setattr(training.arguments, "get_available_trackers", lambda: [])  # as on a machine without any tracker
    with pytest.raises(ValueError, match=message):
        train_lm.main(["--with_tracking", "--report_to", report_to, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Hub
# --------------------------------------------------------------------------------------------

@pytest.fixture
def online_with_token(monkeypatch):
    """What `--push_to_hub` needs before it starts: the Hub not switched off, and a token."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)


def test_push_to_hub_creates_the_repository_first_and_uploads_the_export(online_with_token, hub, tmp_path):
    first_update = []
    step = training.inverse_sqrt_schedule

    def schedule(*args, **kwargs):  # built before training: the repository must exist by then
        first_update.append(len(hub.repos))
        return step(*args, **kwargs)

    with mock.patch.object(training.optimization, "inverse_sqrt_schedule", schedule):
        results = train_classification.main([
            "--vocab_size", "150", "--max_tokens", "256", "--warmup_steps", "3", "--max_train_steps", "3",
            "--max_eval_samples", "30", "--checkpointing_steps", "1", "--push_to_hub", "--hub_model_id",
            "org/pn-sentiment", "--hub_private_repo", "--output_dir", str(tmp_path)])
    assert hub.repos == [("org/pn-sentiment", {"private": True, "exist_ok": True})]
    assert first_update == [1]
    [commit] = hub.commits
    assert commit["repo_id"] == "org/pn-sentiment" and commit["commit_message"] == \
        "Upload PowerNorm Transformer (3 updates)"
    files = commit["files"]
    # Exactly the files of the export, none of the checkpoints or the best-model copy.
    assert set(files) == {p.name for p in tmp_path.iterdir() if p.is_file()}
    assert {"model.safetensors", "config.json", "configuration_powernorm.py", "modeling_powernorm.py",
            "tokenizer.json", "tokenizer_config.json", "README.md", "all_results.json"} <= set(files)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert files["model.safetensors"] == (tmp_path / "model.safetensors").read_bytes()
    assert {"model.encoder.final_norm.running_phi", "model.encoder.final_norm.running_nu",
            "model.encoder.final_norm.num_batches_tracked"} <= set(weights)
    card = files["README.md"].decode()
    assert 'AutoModelForSequenceClassification.from_pretrained("org/pn-sentiment", trust_remote_code=True)' in card
    assert 'AutoTokenizer.from_pretrained("org/pn-sentiment", trust_remote_code=False)' in card
    assert "--push_to_hub" in card
    assert json.loads(files["all_results.json"]) == pytest.approx(results)


@pytest.mark.parametrize("offline, token, message", [
    (True, "hf_" + "x" * 34, "--push_to_hub needs the Hugging Face Hub, but HF_HUB_OFFLINE is set"),
    (False, None, "--push_to_hub needs a Hugging Face token"),
])
def test_push_to_hub_without_hub_or_token_fails_before_training(offline, token, message, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # none stored
    with pytest.raises(ValueError, match=message):
        train_classification.main(["--push_to_hub", "--hub_model_id", "org/x", "--output_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_a_failed_upload_keeps_the_export_and_says_so(online_with_token, hub, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ConnectionError("the Hub hung up")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", refuse)
    with pytest.raises(RuntimeError, match="uploading to org/pn-lm failed \\(the Hub hung up\\); the export in .* "
                                           "is complete"):
        train_lm.main([*LM_TINY, "--max_train_steps", "2", "--push_to_hub", "--hub_model_id", "org/pn-lm",
                       "--output_dir", str(tmp_path)])
    assert hub.repos == [("org/pn-lm", {"private": None, "exist_ok": True})]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "all_results.json"):
        assert (tmp_path / name).is_file(), name
