"""End-to-end tests of the training recipes on their embedded default corpora (a few steps each)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
COMMON = ["--max_eval_samples", "8", "--eval_batch_size", "4", "--max_tokens", "512", "--vocab_size", "300",
          "--warmup_steps", "3"]
FAST = [*COMMON, "--num_beams", "2", "--max_new_tokens", "8"]


def _run(args: list[str], launcher: list[str] | None = None, script: str = "train_wmt.py") -> str:
    command = (launcher or [sys.executable]) + [str(ROOT / "recipes" / script), *args]
    out = subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def test_train_wmt_trains_saves_and_resumes_exactly(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _run([*FAST, "--max_train_steps", "6", "--checkpointing_steps", "2", "--output_dir", str(first)])
    assert [p.name for p in sorted(first.glob("step_*"))] == ["step_2", "step_4", "step_6"]
    results = json.loads((first / "all_results.json").read_text())
    assert results["train_steps"] == 6
    assert "case:mixed" in results["validation_bleu_signature"] and "test_bleu" in results
    card = (first / "README.md").read_text()
    assert "validation_bleu" in card and "--max_train_steps 6" in card and "powernorm" in card

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_powernorm  # noqa: F401  (registers the Auto classes)

    model = AutoModelForSeq2SeqLM.from_pretrained(first)
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert len(tokenizer) == model.config.vocab_size and model.config.pad_token_id == tokenizer.pad_token_id
    encoded = tokenizer(["Der Hund schläft ."], return_tensors="pt")
    assert model.generate(**encoded, max_new_tokens=5).shape[0] == 1

    # Averaging the last two checkpoints gives a folder that loads like a saved model.
    import average_checkpoints

    average_checkpoints.main(["--checkpoint_dir", str(first), "--num_checkpoints", "2",
                              "--output_dir", str(tmp_path / "averaged")])
    averaged = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "averaged").state_dict()
    step_4, step_6 = (load_file(str(first / name / "model.safetensors")) for name in ("step_4", "step_6"))
    key = "model.encoder.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(averaged[key], (step_4[key].double() + step_6[key].double()).div(2).float())
    assert averaged["model.encoder.layers.0.self_attn_norm.num_batches_tracked"].item() == 6

    # Resume from the newest of two checkpoints and finish the run: same weights as without a break.
    second.mkdir()
    shutil.copytree(first / "tokenizer", second / "tokenizer")
    for name in ("step_2", "step_4"):
        shutil.copytree(first / name, second / name)
    log = _run([*FAST, "--max_train_steps", "6", "--tokenizer_name", str(second / "tokenizer"),
                "--resume_from_checkpoint", "latest", "--output_dir", str(second)])
    assert f"Resuming from {second / 'step_4'}" in log
    resumed, straight = load_file(str(second / "model.safetensors")), load_file(str(first / "model.safetensors"))
    assert resumed.keys() == straight.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-5, atol=1e-6, msg=key)
    assert resumed["model.encoder.layers.0.self_attn_norm.num_batches_tracked"].item() == 6


@pytest.mark.skipif(os.environ.get("RUN_SLOW") != "1", reason="slow: two processes; set RUN_SLOW=1")
@pytest.mark.slow
def test_train_wmt_two_processes(tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "29517"]
    log = _run([*FAST, "--cpu", "--max_train_steps", "3", "--output_dir", str(tmp_path)], launcher)
    assert "2 process(es)" in log
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["powernorm_sync_stats"] is True
    assert json.loads((tmp_path / "all_results.json").read_text())["train_steps"] == 3
