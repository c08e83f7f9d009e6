"""`hf-powernorm compare`'s arms differ in their norms alone: one pipeline for every arm (the residual
stream centred and a tied head untied in the baseline too), the invariants recorded per run, the
A/A run (the baseline against itself) on a tied GPT-2, an OPT, an untied GPT-NeoX, a Llama and a BART, and
`--keep_tied_head`."""

import json
from pathlib import Path

import pytest
import torch

from hf_powernorm import compare
from hf_powernorm.training import synthetic_lm_corpus
from test_compare import TINY, _save_tiny, _tokenizer, bart_case  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def trained_like(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every bias and every norm weight moved off 0 and 1, as training leaves them: a centring that
    skips a writer's bias, or a conversion that drops a norm's weight, then shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or ("norm" in name.lower() or ".ln_" in name) and parameter.ndim == 1:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def _lm_files(folder: Path) -> list[str]:
    corpus = synthetic_lm_corpus({"train": 60, "validation": 12, "test": 12}, seed=5)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, part in corpus.items():
        files[split] = folder / f"{split}.txt"
        files[split].write_text("".join(line + "\n" for line in part["text"]), encoding="utf-8")
    return ["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
            "--test_file", str(files["test"]), "--block_size", "16", "--max_tokens", "64"]


def _save_lm(kind: str, folder: Path) -> tuple[str, list[str]]:
    """A tiny causal LM of `kind` (GPT-2 and OPT tie their head; GPT-NeoX and Llama do not), trained-like,
    saved with a BPE of the corpus; the model folder and the data options."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )

    data = _lm_files(folder)
    tokenizer = _tokenizer(synthetic_lm_corpus({"train": 60}, seed=5)["train"]["text"])
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
               "eos_token_id": tokenizer.eos_token_id}
    model_class, config = {
        "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4,
                                                     n_positions=40, **special)),
        "opt": (OPTForCausalLM, lambda: OPTConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                                  ffn_dim=37, num_attention_heads=4, max_position_embeddings=40,
                                                  word_embed_proj_dim=32, **special)),
        "gpt_neox": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=32,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               intermediate_size=37, max_position_embeddings=40,
                                                               **special)),
        "llama": (LlamaForCausalLM, lambda: LlamaConfig(vocab_size=len(tokenizer), hidden_size=32,
                                                        intermediate_size=37, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2,
                                                        max_position_embeddings=40, **special)),
    }[kind]
    torch.manual_seed(0)
    trained_like(model_class(config())).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return str(folder / "model"), data


@pytest.fixture(scope="module")
def tied_gpt2(tmp_path_factory) -> tuple[str, list[str]]:
    return _save_lm("gpt2", tmp_path_factory.mktemp("tied-gpt2"))


def _results(output: Path) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in sorted((output / "cells").glob("*/result.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        found.setdefault(result["norm"], []).append(result)
    return found


def test_every_arm_of_a_tied_gpt2_holds_the_baselines_parameters_and_head(tied_gpt2, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_powernorm import load_converted

    model, data = tied_gpt2
    output = tmp_path / "compare"
    compare.main(["--model_name_or_path", model, *data, "--norms", "layernorm", "powernorm", "rmsnorm",
                  "--seeds", "1", *TINY, "--save_models", "--output_dir", str(output)])
    results = _results(output)
    held = {norm: runs[0]["invariants"] for norm, runs in results.items()}
    done = {norm: runs[0]["conversion"] for norm, runs in results.items()}
    # The baseline went through the same centring: its head untied like the converted arms', its
    # parameters outside the norms theirs.
    assert {d["head"] for d in done.values()} == {"untied"} and {h["head_tied"] for h in held.values()} == {False}
    assert len({d["centred_writers"] for d in done.values()}) == 1 and done["layernorm"]["centred_writers"] > 0
    assert len({h["trainable_outside_norms"] for h in held.values()}) == 1
    for key in ("updates", "train_tokens", "first_batches", "eval_tokens", "schedule"):
        assert len({json.dumps(h[key]) for h in held.values()}) == 1, key
    assert done["powernorm"]["exact"] and done["rmsnorm"]["exact"] and done["layernorm"]["to"] is None
    report = (output / "report.md").read_text(encoding="utf-8")
    assert "## The arms" in report and "differs from the baseline's" not in report
    assert "Every seed is checked; the table shows each arm's run at its first seed (seed 1)." in report
    assert f"| {held['layernorm']['trainable_outside_norms']:,} |" in report
    # The kept models: the baseline's trainable parameters outside the norms, and the same untied head.
    def outside_norms(kept) -> int:
        return sum(p.numel() for name, p in kept.named_parameters() if ".ln_" not in name and "norm" not in name)

    baseline = AutoModelForCausalLM.from_pretrained(output / "models" / "layernorm")
    converted = {norm: load_converted(output / "models" / norm, AutoModelForCausalLM)
                 for norm in ("powernorm", "rmsnorm")}
    for kept in (baseline, *converted.values()):
        assert kept.lm_head.weight is not kept.get_input_embeddings().weight
        assert outside_norms(kept) == outside_norms(baseline)


@pytest.mark.parametrize("kind", ["gpt2", "opt", "gpt_neox", "llama"])
def test_the_aa_run_gives_identical_scores_and_no_verdict(kind, tied_gpt2, tmp_path):
    model, data = tied_gpt2 if kind == "gpt2" else _save_lm(kind, tmp_path / kind)
    seeds = ["1", "2"] if kind == "gpt2" else ["1"]
    output = tmp_path / "aa"
    compare.main(["--model_name_or_path", model, *data, "--norms", "layernorm", "layernorm", "--seeds", *seeds,
                  *TINY, "--output_dir", str(output)])
    results = _results(output)
    assert set(results) == {"layernorm", "layernorm-again"}
    for first, again in zip(results["layernorm"], results["layernorm-again"]):
        assert first["seed"] == again["seed"] and first["scores"] == again["scores"]
        assert first["invariants"] == again["invariants"] and first["conversion"] == again["conversion"]
    report = (output / "report.md").read_text(encoding="utf-8")
    assert "- layernorm-again: the same function as" in report and "so no verdict" in report
    assert "better |" not in report
    # A LayerNorm model has its stream centred in both arms; a head that was never tied stays separate.
    head = results["layernorm"][0]["conversion"]["head"]
    assert head == {"gpt2": "untied", "opt": "untied", "gpt_neox": "separate", "llama": "separate"}[kind]


def test_the_aa_run_of_a_seq2seq_model(bart_case, tmp_path):
    model, task, data = bart_case
    output = tmp_path / "aa"
    compare.main(["--model_name_or_path", model, "--task", task, *data, "--norms", "layernorm", "layernorm",
                  "--seeds", "1", *TINY, "--save_models", "--output_dir", str(output)])
    results = _results(output)
    assert results["layernorm"][0]["scores"] == results["layernorm-again"][0]["scores"]
    # The kept baselines, centred with their head untied, load with their shared table and equal weights.
    from transformers import AutoModelForSeq2SeqLM

    from hf_powernorm import load_converted

    kept = [load_converted(output / "models" / norm, AutoModelForSeq2SeqLM) for norm in ("layernorm", "layernorm-again")]
    for loaded in kept:
        shared = loaded.model.shared.weight
        assert loaded.model.encoder.embed_tokens.weight is shared and loaded.model.decoder.embed_tokens.weight is shared
        assert loaded.lm_head.weight is not shared
    first, again = (loaded.state_dict() for loaded in kept)
    assert [key for key in first if not torch.equal(first[key], again[key])] == []
    assert results["layernorm"][0]["invariants"] == results["layernorm-again"][0]["invariants"]
    assert results["layernorm"][0]["conversion"]["head"] == "untied"  # BART's shared table, centred
    report = (output / "report.md").read_text(encoding="utf-8")
    # Two updates of a tiny BART decode nothing (BLEU 0): flagged, and equal either way; never a winner.
    assert "better |" not in report and "differs from the baseline's" not in report


def test_keep_tied_head_keeps_it_tied_in_every_arm_and_says_the_conversion_is_approximate(tied_gpt2, tmp_path):
    model, data = tied_gpt2
    output = tmp_path / "tied"
    compare.main(["--model_name_or_path", model, *data, "--norms", "layernorm", "powernorm", "--seeds", "1",
                  *TINY, "--keep_tied_head", "--output_dir", str(output)])
    results = _results(output)
    assert {runs[0]["invariants"]["head_tied"] for runs in results.values()} == {True}
    assert {runs[0]["conversion"]["centred_writers"] for runs in results.values()} == {0}
    pn = results["powernorm"][0]["conversion"]
    assert pn["exact"] is False and pn["approximate"] and all(ratio > 0 for _, ratio in pn["approximate"])
    assert "to powernorm, approximate" in (output / "report.md").read_text(encoding="utf-8")


def test_the_norms_option_takes_the_baseline_twice_and_nothing_else_twice():
    assert compare.check_norms(["layernorm", "layernorm"]) == ["layernorm", "layernorm-again"]
    with pytest.raises(ValueError, match="names a norm twice"):
        compare.check_norms(["layernorm", "powernorm", "pn"])
