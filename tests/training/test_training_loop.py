"""Tests of the training library's loop side: the model config from the command line, optimizer
and schedules, losses, metrics (local evaluate modules, offline), checkpoint listing and averaging
(`test_training_checkpoints.py` has the rest of the checkpoints)."""

import argparse
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import get_inverse_sqrt_schedule, get_scheduler

from recipe_scripts import average_checkpoints as avg

from hf_powernorm import PowerNormTransformerConfig, training


@pytest.fixture(scope="module")
def bpe():
    corpus = training.synthetic_translation_corpus(sizes={"train": 400})
    return training.train_bpe_tokenizer(training.translation_texts(corpus["train"], ("de", "en")), vocab_size=300)


def test_model_config_from_the_command_line(bpe):
    parser = training.add_recipe_args(argparse.ArgumentParser())
    args = parser.parse_args(["--powernorm_alpha_fwd", "0.95", "--warmup_steps", "7", "--encoder_norm_type",
                              "layernorm", "--powernorm_group_num", "none", "--config_overrides", "encoder_layers=3"])
    config = training.build_config(args, bpe, 2, {"hidden_size": 64, "intermediate_size": 128}, max_length=100,
                             encoder_norm_type="batchnorm")
    assert config.encoder_norm_type == "layernorm"  # the option wins over the script's own field
    assert (config.hidden_size, config.encoder_layers, config.vocab_size) == (64, 3, len(bpe))
    assert (config.powernorm_alpha_fwd, config.powernorm_group_num) == (0.95, None)
    assert config.powernorm_warmup_steps == 7  # PN's warmup follows the learning-rate warmup
    # Updates on the command line, training forward passes (one per micro-batch) in the config.
    accumulated = parser.parse_args(["--warmup_steps", "7", "--gradient_accumulation_steps", "3"])
    assert training.build_config(accumulated, bpe, 1, {}, 100).powernorm_warmup_steps == 21
    accumulated.powernorm_warmup_steps = 5
    assert training.build_config(accumulated, bpe, 1, {}, 100).powernorm_warmup_steps == 15
    assert config.pad_token_id == bpe.pad_token_id and config.max_position_embeddings >= 102
    assert config.powernorm_sync_stats is True  # several processes: synchronised by default
    assert training.build_config(parser.parse_args([]), bpe, 1, {}, 100).powernorm_sync_stats is False
    assert training.build_config(parser.parse_args(["--no-sync_stats"]), bpe, 2, {}, 100).powernorm_sync_stats is False
    options = parser.parse_args(["--powernorm_warmup_statistic", "reference", "--powernorm_warmup_ramp_steps", "5",
                                 "--gradient_accumulation_steps", "2"])
    reference = training.build_config(options, bpe, 1, {}, 100)
    assert (reference.powernorm_warmup_statistic, reference.powernorm_warmup_ramp_steps) == ("reference", 10)
    with pytest.raises(SystemExit):
        parser.parse_args(["--powernorm_warmup_statistic", "ema"])
    paper = training.build_config(parser.parse_args(["--preset", "iwslt14-small"]), bpe, 1, {"hidden_size": 64}, 100)
    assert (paper.hidden_size, paper.powernorm_warmup_steps, paper.decoder_norm_type) == (512, 8000, "layernorm")


def test_a_new_causal_lm_training_on_batch_statistics_says_so_at_the_start(bpe, caplog, reset_accelerate):
    """The LM recipe's default PN trains its first updates (its warmup) on batch statistics, which
    mix the positions of a batch: one warning names the leak and the options that avoid it."""
    from accelerate import PartialState

    from hf_powernorm import PowerNormTransformerForCausalLM
    from hf_powernorm.training import language_modeling

    PartialState(cpu=True)

    def warned(argv: list[str]) -> list[str]:
        args = language_modeling.parse_args(argv)
        caplog.clear()
        with caplog.at_level("WARNING"):
            training.build_model(args, PowerNormTransformerForCausalLM, bpe, 1, language_modeling.DEFAULT_SIZE,
                                 args.block_size)
        return [r.getMessage() for r in caplog.records if "leak" in r.getMessage()]

    said = warned([])  # PN's warmup follows the learning-rate warmup: 100 updates
    assert len(said) == 1 and "powernorm norms train on batch statistics for its first 100 updates" in said[0]
    assert "pass --powernorm_warmup_steps 0 --powernorm_warmup_ramp_steps 0" in said[0] and "rmsnorm" in said[0]
    assert "for its first 105 updates" in warned(["--gradient_accumulation_steps", "2",
                                                  "--powernorm_warmup_ramp_steps", "5"])[0]
    assert "at every update" in warned(["--decoder_norm_type", "batchnorm"])[0]
    assert warned(["--powernorm_warmup_steps", "0"]) == [] and warned(["--decoder_norm_type", "layernorm"]) == []


# ---------------------------------------------------------------------------------------------
# Optimizer, schedule, losses
# ---------------------------------------------------------------------------------------------

def test_weight_decay_by_ndim_and_inverse_sqrt_schedule():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = training.build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed, plain = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [(3, 4)] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0
    assert optimizer.defaults["betas"] == (0.9, 0.98)
    scheduler = training.inverse_sqrt_schedule(optimizer, warmup_steps=100, warmup_init_lr=1e-7)
    lrs = []
    for _ in range(401):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-7)
    assert lrs[50] == pytest.approx(1e-7 + 50 * (1e-3 - 1e-7) / 100)
    assert lrs[100] == pytest.approx(1e-3) and lrs[400] == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="warmup_steps.*0"):
        training.inverse_sqrt_schedule(optimizer, warmup_steps=0)


def test_losses_and_perplexity():
    vocab = 11
    logits = torch.zeros(2, 5, vocab)  # uniform prediction: perplexity equals the vocabulary size
    labels = torch.randint(0, vocab, (2, 5))
    labels[1, 3:] = -100
    nll, count = training.token_nll(logits, labels, shift=True)
    assert int(count) == 2 * 4 - 2
    assert training.perplexity(nll.item(), int(count)) == pytest.approx(vocab)
    rows, counts = training.sequence_nll(logits, labels)
    assert counts.tolist() == [4, 2] and rows.tolist() == pytest.approx([4 * math.log(vocab), 2 * math.log(vocab)])
    with pytest.raises(ValueError, match="0"):
        training.perplexity(1.0, 0)


def test_label_smoothed_loss_against_a_hand_computed_value():
    """Two scored tokens over a vocabulary of 3: per token (1 - eps) * (-log p_label) + eps * mean
    over the vocabulary of -log p, averaged over the scored tokens; the padded one is left out."""
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0], [9.0, 9.0, 9.0]]])
    labels = torch.tensor([[0, 2, -100]])
    eps = 0.1

    def token(row: list[float], label: int) -> float:
        log_z = math.log(sum(math.exp(v) for v in row))
        log_p = [v - log_z for v in row]
        return (1 - eps) * -log_p[label] + eps * -sum(log_p) / len(row)

    expected = (token([2.0, 0.0, -1.0], 0) + token([0.5, 0.5, 3.0], 2)) / 2
    loss = training.label_smoothed_loss(logits, labels, label_smoothing=eps)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() != pytest.approx(training.label_smoothed_loss(logits, labels).item(), rel=1e-3)
    reference = F.cross_entropy(logits[0, :2], labels[0, :2], label_smoothing=eps)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert training.label_smoothed_loss(logits.bfloat16(), labels, eps).dtype == torch.float32


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("spread", [1.0, 300.0])
def test_label_smoothed_loss_and_its_gradient_equal_cross_entropys(eps, spread):
    """The fused loss (its own backward) against autograd through `F.cross_entropy`, in float64
    arithmetic's reach of float32: value and logits' gradient, with ignored rows (a whole sequence
    too), logits far apart (the log-softmax must not overflow), and an output gradient other than 1."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, 40, generator=generator) * spread
    labels = torch.randint(0, 40, (5, 6), generator=generator)
    labels[0, :4] = -100
    labels[3] = -100
    ours_in, ref_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = training.label_smoothed_loss(ours_in, labels, eps)
    reference = F.cross_entropy(ref_in.reshape(-1, 40), labels.reshape(-1), ignore_index=-100, label_smoothing=eps)
    (2.5 * ours).backward()
    (2.5 * reference).backward()
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-7)
    assert (ours_in.grad[3] == 0).all() and (ours_in.grad[0, :4] == 0).all()


def test_causal_lm_loss_scores_each_position_against_the_next_label():
    """`next_token_labels` shifts left and ignores the last position; the loss on the full logits
    equals the loss on `logits[:, :-1]` against `labels[:, 1:]` (which copied the logits)."""
    labels = torch.tensor([[5, 6, 7, -100], [1, 2, 3, 4]])
    assert training.losses.next_token_labels(labels).tolist() == [[6, 7, -100, -100], [2, 3, 4, -100]]
    logits = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(1))
    shifted = training.label_smoothed_loss(logits[:, :-1], labels[:, 1:], 0.1)
    assert training.label_smoothed_loss(logits, training.losses.next_token_labels(labels), 0.1).item() == \
        pytest.approx(shifted.item(), rel=1e-6)
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\); got 1.0"):
        training.label_smoothed_loss(logits, labels, 1.0)


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_schedules_of_transformers_and_inverse_sqrt_after_warmup():
    """`--lr_scheduler_type` other than inverse_sqrt is transformers' schedule; fairseq's
    inverse_sqrt agrees with transformers' after warmup (it differs in warming up from 1e-7)."""
    def optimizer():
        return training.build_optimizer(torch.nn.Linear(2, 2), lr=1e-3)

    ours, theirs = optimizer(), optimizer()
    linear = _lrs(training.build_scheduler("linear", ours, 10, 50), ours, 50)
    assert linear == pytest.approx(_lrs(get_scheduler("linear", theirs, num_warmup_steps=10,
                                                      num_training_steps=50), theirs, 50))
    ours, theirs = optimizer(), optimizer()
    fairseq = _lrs(training.build_scheduler("inverse_sqrt", ours, 10, 50, warmup_init_lr=1e-7), ours, 50)
    library = _lrs(get_inverse_sqrt_schedule(theirs, num_warmup_steps=10), theirs, 50)
    assert fairseq[10:] == pytest.approx(library[10:]) and fairseq[0] == pytest.approx(1e-7) and library[0] == 0
    with pytest.raises(ValueError, match="unknown lr_scheduler_type 'cyclic'.*inverse_sqrt"):
        training.build_scheduler("cyclic", optimizer(), 10, 50)


# ---------------------------------------------------------------------------------------------
# Metrics (local evaluate modules, offline)
# ---------------------------------------------------------------------------------------------

def test_sacrebleu_metric_matches_sacrebleu():
    predictions = ["The cat sat on the mat .", "a dog runs in the park"]
    references = [["the cat sat on the mat ."], ["A dog ran in the park ."]]
    metric = training.load_metric("sacrebleu")
    for lowercase in (False, True):
        result = metric.compute(predictions=predictions, references=references, lowercase=lowercase)
        direct = sacrebleu.corpus_bleu(predictions, [[r[0] for r in references]], lowercase=lowercase)
        assert result["score"] == pytest.approx(direct.score)
        assert ("case:lc" in result["signature"]) == lowercase
    cased = metric.compute(predictions=predictions, references=references)["score"]
    assert cased < metric.compute(predictions=predictions, references=references, lowercase=True)["score"]
    with pytest.raises(ValueError, match="unknown metric 'bleurt'"):
        training.load_metric("bleurt")


def test_once_per_message_filter(caplog):
    logger = logging.getLogger("hf_powernorm.test_once")
    logger.addFilter(training.OncePerMessage())
    with caplog.at_level(logging.WARNING, logger="hf_powernorm.test_once"):
        for word in ("period", "period", "comma", "period"):
            logger.warning("tokenized %s", word)
    assert [r.getMessage() for r in caplog.records] == ["tokenized period", "tokenized comma"]


def test_accuracy_f1_metric():
    metric = training.load_metric("accuracy_f1")
    result = metric.compute(predictions=[0, 1, 2, 2, 1], references=[0, 1, 1, 2, 2])
    assert result["accuracy"] == pytest.approx(3 / 5)
    # class 0: F1 1; class 1: tp 1, fp 1, fn 1 -> 0.5; class 2: tp 1, fp 1, fn 1 -> 0.5
    assert result["per_class_f1"] == pytest.approx([1.0, 0.5, 0.5])
    assert result["macro_f1"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# Checkpoints and averaging
# ---------------------------------------------------------------------------------------------

def _checkpoint(folder: Path, value: float, step: int, tokenizer) -> None:
    """A complete checkpoint: weights, config, tokenizer, a pickled optimizer state as Accelerate
    writes one, and the manifest."""
    folder.mkdir(parents=True)
    save_file({"weight": torch.full((2, 3), value), "half": torch.full((2,), value, dtype=torch.float16),
               "norm.num_batches_tracked": torch.tensor(step)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = PowerNormTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), powernorm_warmup_steps=step,
                                                    architectures=["PowerNormTransformerForCausalLM"])
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "optimizer.bin").write_bytes(b"state")
    (folder / "training_state.json").write_text(json.dumps({"step": step}))
    training.write_manifest(folder, step, {"run": "test"})


def test_average_checkpoints_keeps_integer_counters(bpe, tmp_path):
    for step, value in ((9, 1.0), (10, 2.0), (100, 6.0), (2, 50.0)):
        _checkpoint(tmp_path / f"step_{step}", value, step, bpe)
    assert training.latest_checkpoint(tmp_path).name == "step_100"  # numeric, not lexicographic order
    chosen = training.select_checkpoints(tmp_path, 3)
    assert [p.name for p in chosen] == ["step_9", "step_10", "step_100"]
    avg.main(["--checkpoint_dir", str(tmp_path), "--num_checkpoints", "3",
              "--output_dir", str(tmp_path / "averaged")])
    state = load_file(str(tmp_path / "averaged" / "model.safetensors"))
    assert torch.equal(state["weight"], torch.full((2, 3), 3.0))
    assert state["half"].dtype == torch.float16 and state["half"][0].item() == 3.0
    assert state["norm.num_batches_tracked"].item() == 100
    assert state["norm.num_batches_tracked"].dtype == torch.int64
    assert json.loads((tmp_path / "averaged" / "config.json").read_text())["powernorm_warmup_steps"] == 100
    assert not any((tmp_path / "averaged" / n).exists() for n in ("optimizer.bin", "training_state.json",
                                                                  "checkpoint.json"))
    with pytest.raises(ValueError, match=r"last 5 checkpoints.*holds 4 complete"):
        training.select_checkpoints(tmp_path, 5)


def test_checkpoint_listing_errors(bpe, tmp_path):
    _checkpoint(tmp_path / "epoch_1", 1.0, 1, bpe)
    _checkpoint(tmp_path / "step_5", 1.0, 5, bpe)
    with pytest.raises(ValueError, match=r"\['epoch', 'step'\]"):
        training.list_checkpoints(tmp_path)
    assert [p.name for p in training.list_checkpoints(tmp_path, prefix="step")] == ["step_5"]
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match=r"other.*model\.safetensors"):
        training.average_state_dicts([tmp_path / "step_5", tmp_path / "other"])


def test_metrics_load_offline_with_an_empty_cache(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    code = ("import evaluate; m = evaluate.load(%r); "
            "print(m.compute(predictions=['a b c d'], references=[['a b c d']])['score'])")
    out = subprocess.run([sys.executable, "-c", code % str(training.METRICS_DIR / "sacrebleu")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(100.0)


@pytest.mark.parametrize("name", training.SCHEDULER_TYPES)
def test_every_offered_schedule_builds_and_warms_up(name):
    optimizer = training.build_optimizer(torch.nn.Linear(2, 2), lr=1e-3)
    lrs = _lrs(training.build_scheduler(name, optimizer, 10, 100), optimizer, 100)
    assert all(0 <= lr <= 1e-3 + 1e-12 for lr in lrs)
    if name not in ("constant",):
        assert lrs[0] < lrs[10]  # a warmup


@pytest.mark.parametrize("main", [True, False])
def test_only_the_local_main_process_shows_library_bars_and_warnings(main):
    """Every rank converts and tokenizes alike; Transformers' and Datasets' bars (the calibration of
    `convert_norms`, a tokenizer's map) and warnings come from one of them."""
    import datasets
    import transformers

    from hf_powernorm.training.loop import quiet_other_processes

    hf_logging = transformers.utils.logging
    before = (hf_logging.get_verbosity(), datasets.utils.logging.get_verbosity())
    try:
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()
        quiet_other_processes(argparse.Namespace(is_local_main_process=main))
        assert hf_logging.is_progress_bar_enabled() is main
        assert datasets.is_progress_bar_enabled() is main
        after = (hf_logging.get_verbosity(), datasets.utils.logging.get_verbosity())
        assert after == (before if main else (hf_logging.ERROR, hf_logging.ERROR))
    finally:
        hf_logging.set_verbosity(before[0])
        datasets.utils.logging.set_verbosity(before[1])
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()
