"""`convert_norms(..., preserve_function=True)` on LayerNorm families: the residual stream centred
(`centring.py`), every LayerNorm of a pre-LN model converted exactly to PN and to RMSNorm, in eval
and in the first training forward; a training step, save and reload; post-LN models reported
approximate; and the calibrated statistic taken over real tokens only."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf

import hf_powernorm
from hf_powernorm.benchmarks.conversion_families import FAMILIES, batch, build, convert, real_logits
from hf_powernorm.centring import writer_candidates
from hf_powernorm.converter import CENTRED_TOLERANCE, MaskAwareNorm

EXACT = [name for name, family in FAMILIES.items() if family.exact]
APPROXIMATE = [name for name, family in FAMILIES.items() if not family.exact]
AUTO_CLASSES = {"vit": tf.AutoModelForImageClassification, "bart": tf.AutoModelForSeq2SeqLM,
                "whisper": tf.AutoModelForSpeechSeq2Seq, "bert": tf.AutoModelForMaskedLM,
                "modernbert": tf.AutoModelForMaskedLM}


def relative_change(output: torch.Tensor, expected: torch.Tensor) -> float:
    return float((output - expected).abs().max() / expected.square().mean().sqrt())


@pytest.mark.parametrize("norm_type", ["powernorm", "rmsnorm"])
@pytest.mark.parametrize("name", EXACT)
def test_pre_ln_families_convert_exactly_train_save_and_reload(name, norm_type, tmp_path):
    inputs = batch(name)
    with torch.no_grad():
        expected = real_logits(build(name), inputs)
    model, report = convert(name, norm_type)
    assert report.preserves_function and not report.approximate, str(report)
    assert report.centring.writers and not report.centring.rejected
    assert len(report.replaced) == sum(1 for m in model.modules() if isinstance(m, MaskAwareNorm))
    with torch.no_grad():
        assert relative_change(real_logits(model, inputs), expected) < 1e-5
    model.train()
    first = real_logits(model, inputs)  # PN's first training forward divides by its calibrated statistic
    assert relative_change(first, expected) < 1e-5

    model(**batch(name, labels=True)).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, AUTO_CLASSES.get(name, tf.AutoModelForCausalLM))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(real_logits(loaded, inputs), real_logits(model, inputs), atol=0, rtol=0)


@pytest.mark.parametrize("name", APPROXIMATE)
def test_norms_whose_input_is_not_centred_are_reported_approximate(name):
    model, report = convert(name, "powernorm")
    assert report.approximate and not report.preserves_function
    assert all(ratio > CENTRED_TOLERANCE for _, ratio in report.approximate)
    assert "approximate" in str(report) and all(path in str(report) for path, _ in report.approximate)
    fitted = {path for path, _ in report.approximate}
    assert set(report.modules) - fitted or name != "whisper"  # Whisper's decoder converts exactly
    if name == "whisper":  # its convolutions feed a GELU: centring them would change the function
        assert all(path.startswith("model.encoder.") for path in fitted)
        assert report.centring.rejected == ["model.encoder.conv1", "model.encoder.conv2"]


def test_bert_is_approximate_but_its_embedding_norm_is_exact():
    """Post-LN: every block's norm reads the previous norm's output, which no weight centres; the
    embeddings' norm reads only embeddings, which are centred."""
    _, report = convert("bert", "powernorm")
    fitted = {path for path, _ in report.approximate}
    assert "bert.embeddings.LayerNorm" not in fitted
    assert fitted == set(report.modules) - {"bert.embeddings.LayerNorm"}
    assert report.centring.untied == "cls.predictions.decoder"


def test_the_tied_head_keeps_the_uncentred_table_and_reloads_untied(tmp_path):
    source = build("gpt2")
    table = source.transformer.wte.weight.detach().clone()
    model, report = convert("gpt2", "powernorm")
    assert report.centring.untied == "lm_head" and model.config.tie_word_embeddings is False
    assert model.lm_head.weight is not model.transformer.wte.weight
    torch.testing.assert_close(model.lm_head.weight, table, atol=0, rtol=0)
    centred = model.transformer.wte.weight.detach().double()
    assert float(centred.mean(-1).abs().max()) < 1e-6 * float(centred.abs().max())
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, tf.AutoModelForCausalLM)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    torch.testing.assert_close(loaded.lm_head.weight, table, atol=0, rtol=0)


def test_readers_of_the_stream_are_not_centred():
    """ViT's query, key and value projections write the hidden size but read through a norm; its
    patch convolution, CLS token and position table are writers."""
    model, report = convert("vit", "powernorm")
    candidates = {w.name for w in writer_candidates(build("vit"), 32)}
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings",
            "vit.embeddings.patch_embeddings.projection"} <= set(report.centring.writers)
    projections = {name for name in candidates if name.endswith(("q_proj", "k_proj", "v_proj"))}
    assert len(projections) == 6 and not projections & set(report.centring.writers)
    assert not report.centring.rejected  # told apart by what they read, not by trying them


def test_without_centring_layernorm_sources_are_fitted():
    """`centre_stream=False` leaves the weights as they are; the norms are fitted and say so."""
    source = build("gpt2")
    model, report = convert("gpt2", "powernorm", centre_stream=False)
    assert report.centring is None and len(report.approximate) == len(report.replaced)
    torch.testing.assert_close(model.transformer.wte.weight, source.transformer.wte.weight, atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        unmeasured = hf_powernorm.convert_norms(build("gpt2"), "rmsnorm", preserve_function=True)
    assert {ratio for _, ratio in unmeasured.approximate} == {None} and "not measured" in str(unmeasured)


# ----------------------------------------------------------------------------------------------
# The calibrated statistic counts real tokens only


LLAMA = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=37, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def _llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).eval()


def _padded(extra: int, pad_id: int) -> dict:
    """Rows of 7, 5 and 3 real tokens, right-padded with `pad_id` to `7 + extra`."""
    ids = torch.randint(5, 99, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 7 + extra, dtype=torch.long)
    mask[0, 7:], mask[1, 5:], mask[2, 3:] = 0, 0, 0
    padded = torch.full((3, 7 + extra), pad_id)
    padded[:, :7] = ids
    return {"input_ids": padded.masked_fill(mask == 0, pad_id), "attention_mask": mask}


def _calibrated(inputs: dict) -> dict[str, torch.Tensor]:
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, "powernorm", preserve_function=True, calibration_batches=[inputs])
    return {name: module.norm.running_phi.clone() for name, module in model.named_modules()
            if isinstance(module, MaskAwareNorm)}


def _masked_mean_square(inputs: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per norm, the mean of `RMS(x)^2` per channel over the real tokens, and over every token."""
    model, captured = _llama(), {}
    hooks = [module.register_forward_hook(lambda m, a, o, name=name: captured.__setitem__(name, a[0].double()))
             for name, module in model.named_modules() if type(module).__name__ == "LlamaRMSNorm"]
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    real = inputs["attention_mask"].bool()
    eps = model.config.rms_norm_eps
    scaled = {name: (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).square() for name, x in captured.items()}
    return ({name: z[real].mean(0) for name, z in scaled.items()},
            {name: z.reshape(-1, z.shape[-1]).mean(0) for name, z in scaled.items()})


def test_the_calibrated_statistic_is_the_mean_over_real_tokens_only():
    inputs = _padded(0, 0)
    real, every = _masked_mean_square(inputs)
    calibrated = _calibrated(inputs)
    assert set(calibrated) == set(real)
    for name, phi in calibrated.items():
        torch.testing.assert_close(phi.double(), real[name], atol=1e-6, rtol=1e-5)
        assert not torch.allclose(phi.double(), every[name], atol=1e-4, rtol=1e-3)  # padding would show
    for extra, pad_id in ((9, 0), (9, 77)):  # more padding, another pad id
        for name, phi in _calibrated(_padded(extra, pad_id)).items():
            torch.testing.assert_close(phi, calibrated[name], atol=1e-6, rtol=1e-5)


def test_the_families_table_lists_each_family_with_its_result():
    """docs/conversion_families.md holds the table `python -m hf_powernorm.benchmarks.conversion_families`
    prints: a row per family, its result the one the tests above check."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "conversion_families.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "|---" not in line]
    results = {cells[0].strip(): cells[2].strip() for cells in rows if len(cells) == 8 and cells[0].strip() != "family"}
    assert results == {name: "exact" if family.exact else "approximate" for name, family in FAMILIES.items()}
