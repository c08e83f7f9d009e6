"""`convert_norms` on tiny random models of the Transformers families people fine-tune today: the
default conversion (QK-norms kept and reported), a training step, save and reload with
`load_converted`; `preserve_function=True` (RMSNorm sources exact, LayerNorm sources closer than a
plain conversion); `modules=` as a regular expression and as a predicate; kernel patches."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import transformers as tf

import hf_powernorm
from hf_powernorm.converter import MaskAwareNorm, is_norm_candidate

VOCAB, HIDDEN, HEADS, HEAD_DIM, SEQ = 99, 32, 4, 8, 7
DECODER_ONLY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                    num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER_ONLY)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**DECODER_ONLY)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER_ONLY)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**DECODER_ONLY, head_dim=HEAD_DIM)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**DECODER_ONLY, head_dim=HEAD_DIM)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**DECODER_ONLY, head_dim=HEAD_DIM)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**DECODER_ONLY)),
    # Qwen3.5 and Gemma 4: a linear-attention layer beside a full one; Gemma 4's value norms and
    # per-layer input norm too.
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
        **DECODER_ONLY, head_dim=HEAD_DIM, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)),
    "gemma4": lambda: tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**DECODER_ONLY, head_dim=HEAD_DIM)),
    # Falcon-H1 sets a non-persistent buffer of its Mamba mixers in its model's `_init_weights`.
    "falcon_h1": lambda: tf.FalconH1ForCausalLM(tf.FalconH1Config(
        **DECODER_ONLY, head_dim=HEAD_DIM, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_chunk_size=8)),
    # AXK2: gated RMSNorms (an RMSNorm, then a gate computed from its output) before attention and
    # the MoE FFN, latent norms of its multi-head latent attention, a LayerNorm in its indexer.
    "axk2": lambda: tf.AXK2ForCausalLM(tf.AXK2Config(
        **{**DECODER_ONLY, "num_key_value_heads": HEADS}, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=HEAD_DIM, head_dim=HEAD_DIM, index_topk=8, index_head_dim=8, index_n_heads=2,
        gated_norm_rank=4)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**DECODER_ONLY)),
    "nemotron": lambda: tf.NemotronForCausalLM(tf.NemotronConfig(**DECODER_ONLY)),  # LN(x) * (1 + w) + b
    "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=37,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, pad_token_id=0)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=37,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_DIM, d_ff=37, num_layers=2, num_heads=HEADS, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
    "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None)),
}
AUTO_CLASSES = {"bert": tf.AutoModelForMaskedLM, "t5": tf.AutoModelForSeq2SeqLM, "bart": tf.AutoModelForSeq2SeqLM}
QK_NORMS = {"qwen3", "gemma3", "olmo2", "qwen3_5", "gemma4"}  # carry q_norm / k_norm in each attention block
# The norms a default conversion keeps besides QK-norms: Gemma 4's per-head value norms and the norm of
# its per-layer inputs (over their own size), Qwen3.5's gated norm in its linear attention.
ALSO_KEPT = {"gemma4": ("v_norm", "per_layer_projection_norm"), "qwen3_5": ("norm",)}
# Families whose default conversion keeps other norms: the kept norms' last names, each with a word
# of the reason the report must give.
KEPT = {"axk2": {"input_layernorm": "wrapper", "post_attention_layernorm": "wrapper", "q_a_layernorm": "12 channels",
                 "kv_a_layernorm": "8 channels", "k_norm": "8 channels"}}
LAYERNORM_SOURCES = ("gpt_neox", "gpt2", "bert", "bart", "nemotron")
RMSNORM_SOURCES = tuple(name for name in FAMILIES if name not in LAYERNORM_SOURCES)


def build(name: str, seed: int = 0):
    """The family's tiny model with its norms' weights drawn away from 1 and every bias (the norms', the
    writers' into the residual stream, the heads') away from 0, so a conversion that drops or
    misplaces one shows."""
    torch.manual_seed(seed)
    model = FAMILIES[name]()
    with torch.no_grad():
        for _, module in model.named_modules():
            if is_norm_candidate(module) and getattr(module, "weight", None) is not None:
                if module.weight.abs().max() == 0:  # Gemma's (1 + w) starts at w = 0
                    module.weight.normal_(0.0, 0.3)
                else:
                    module.weight.mul_(torch.empty_like(module.weight).uniform_(0.5, 1.5))
            if isinstance(getattr(module, "bias", None), torch.nn.Parameter):
                module.bias.normal_(0.0, 0.3)
    return model


def batch(name: str, seed: int = 1) -> dict:
    """Right-padded inputs (3, 7), labels included; a decoder side for T5 and BART."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 3:] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if name in ("t5", "bart"):
        inputs["labels"] = torch.randint(3, VOCAB, (3, SEQ - 2), generator=generator)
    return inputs


def convert(model, norm_type: str = "powernorm", **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return hf_powernorm.convert_norms(model, norm_type, **kwargs)


def logits(model, inputs: dict) -> torch.Tensor:
    return model(**inputs).logits


# ----------------------------------------------------------------------------------------------
# Default conversion, a training step, save and reload


@pytest.mark.parametrize("name", list(FAMILIES))
def test_default_conversion_trains_saves_and_reloads(name, tmp_path):
    model = build(name)
    hidden = model.config.get_text_config().hidden_size
    report = convert(model)
    kept = {path for path, _, _ in report.kept}
    assert report.replaced and all(model.get_submodule(path).norm.hidden_size == hidden for path in report.modules)
    if name in QK_NORMS:
        qk = {path for path in kept if path.rsplit(".", 1)[-1] in ("q_norm", "k_norm")}
        assert qk and all(path.rsplit(".", 1)[-1] in ALSO_KEPT.get(name, ()) for path in kept - qk)
        assert all("QK-norm" in reason for path, _, reason in report.kept if path in qk)
        assert all(path in str(report) for path in kept)
    elif name in KEPT:
        assert {path.rsplit(".", 1)[-1] for path in kept} == set(KEPT[name])
        assert all(KEPT[name][path.rsplit(".", 1)[-1]] in reason for path, _, reason in report.kept)
        wrappers = [path for path, _, reason in report.kept if "wrapper" in reason]
        assert all(f"{path}.norm" in report.modules for path in wrappers)  # the norm inside converts
    else:
        assert not kept
    assert not any(is_norm_candidate(m) and n not in kept for n, m in model.named_modules() if n)
    inputs = batch(name)
    model.train()
    loss = model(**inputs).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss)
    assert all(m.norm.num_batches_tracked == 1 for m in model.modules() if isinstance(m, MaskAwareNorm))
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, AUTO_CLASSES.get(name, tf.AutoModelForCausalLM))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# preserve_function


@pytest.mark.parametrize("name", RMSNORM_SOURCES)
def test_preserve_function_keeps_the_logits_of_rmsnorm_sources(name):
    model = build(name)
    inputs = batch(name)
    model.eval()
    with torch.no_grad():
        expected = logits(model, inputs)
    calibration = [batch(name, seed) for seed in (2, 3)]
    report = convert(model, preserve_function=True, calibration_batches=calibration)
    norms = [m.norm for m in model.modules() if isinstance(m, MaskAwareNorm)]
    assert report.preserve_function and report.start_gap < 1e-4
    assert all(n.group_num == 1 and n.warmup_steps == 0 and n.num_batches_tracked == 0 for n in norms)
    assert not all(torch.equal(n.running_phi, torch.ones_like(n.running_phi)) for n in norms)  # calibrated
    with torch.no_grad():
        torch.testing.assert_close(logits(model, inputs), expected, atol=1e-4, rtol=0)
    model.train()
    first = logits(model, inputs)  # the first training forward divides by the calibrated statistic
    torch.testing.assert_close(first.detach(), expected, atol=1e-4, rtol=0)
    assert all(n.num_batches_tracked == 1 for n in norms)


def logit_change(model, expected: list[torch.Tensor], batches: list[dict]) -> float:
    """Root mean square change of the logits over the real tokens of `batches` (eval mode)."""
    model.eval()
    with torch.no_grad():
        changes = [(logits(model, inputs) - reference)[inputs["attention_mask"].bool()]
                   for inputs, reference in zip(batches, expected)]
    return float(torch.cat(changes).square().mean().sqrt())


@pytest.mark.parametrize("name", LAYERNORM_SOURCES)
def test_preserve_function_brings_layernorm_sources_closer(name):
    """Closer than a plain conversion: exact where the residual stream is centred, a fit where it is
    not (post-LN BERT and BART; tests/conversion/test_centring.py)."""
    source = build(name).eval()
    held_out = [{k: v for k, v in batch(name, seed).items() if k != "labels"} for seed in (100, 101, 102)]
    with torch.no_grad():
        expected = [logits(source, inputs) for inputs in held_out]
    plain, fitted = copy.deepcopy(source), source
    convert(plain)
    report = convert(fitted, preserve_function=True, calibration_batches=[batch(name, seed) for seed in (2, 3)])
    assert logit_change(fitted, expected, held_out) < logit_change(plain, expected, held_out)
    assert report.start_gap > 0


def test_preserve_function_without_calibration_keeps_the_function():
    model = build("gemma3").eval()
    inputs = batch("gemma3")
    with torch.no_grad():
        expected = logits(model, inputs)
    report = convert(model, preserve_function=True)
    assert report.start_gap is None
    with torch.no_grad():
        torch.testing.assert_close(logits(model, inputs), expected, atol=1e-4, rtol=0)
    plain = build("gemma3")
    report = convert(plain, calibration_batches=[batch("gemma3", 2)])  # measures the gap only
    assert not report.preserve_function and report.start_gap > 1e-3
    assert all(torch.equal(m.norm.running_phi, torch.ones_like(m.norm.running_phi))
               for m in plain.modules() if isinstance(m, MaskAwareNorm))


def test_preserve_function_refuses_what_it_cannot_keep():
    with pytest.raises(ValueError, match="cannot keep the function with norm 'batchnorm'"):
        convert(build("llama"), "batchnorm", preserve_function=True)
    with pytest.raises(ValueError, match=r"sets warmup_steps=0 .*got warmup_steps=100"):
        convert(build("llama"), preserve_function=True, warmup_steps=100)
    with pytest.raises(ValueError, match=r"norm 'model.layers.0.input_layernorm' \(rmsnorm\) with layernorm"):
        convert(build("llama"), "layernorm", preserve_function=True)
    with pytest.raises(ValueError, match="calibration_batches is empty"):
        convert(build("llama"), preserve_function=True, calibration_batches=[])


def test_calibration_counts_its_batches_under_the_transformers_bar(capsys):
    """The calibration pass shows Transformers' bar, which Transformers' own switch turns off."""
    shown = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.enable_progress_bar()
    try:
        convert(build("qwen3"), preserve_function=True, calibration_batches=[batch("qwen3", s) for s in (2, 3)])
        err = capsys.readouterr().err
        assert "Calibrating the converted norms:   0%" in err and "0/2" in err  # it counts the 2 batches
        tf.utils.logging.disable_progress_bar()
        convert(build("qwen3"), preserve_function=True, calibration_batches=[batch("qwen3", 2)])
        assert "Calibrating" not in capsys.readouterr().err
    finally:
        (tf.utils.logging.enable_progress_bar if shown else tf.utils.logging.disable_progress_bar)()


def test_preserve_function_reloads_with_its_statistics(tmp_path):
    model = build("qwen3")
    convert(model, preserve_function=True, calibration_batches=[batch("qwen3", 2)])
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, tf.AutoModelForCausalLM)
    assert loaded.config.powernorm_conversion["preserve_function"] is True
    eps = model.config.rms_norm_eps
    assert {m.norm.group_eps for m in loaded.modules() if isinstance(m, MaskAwareNorm)} == {eps}
    model.eval()
    inputs = batch("qwen3")
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# modules=


def test_modules_regex_converts_qk_norms_too(tmp_path):
    model = build("qwen3")
    report = convert(model, modules=r"norm$")
    assert not report.kept and any(path.endswith("self_attn.q_norm") for path in report.modules)
    q_norm = model.get_submodule("model.layers.0.self_attn.q_norm").norm
    assert q_norm.hidden_size == HEAD_DIM and q_norm.group_num == 1
    entry = model.config.powernorm_conversion["norms"]["model.layers.0.self_attn.q_norm"]
    assert entry["size"] == HEAD_DIM and entry["source"] == "rmsnorm"
    inputs = batch("qwen3")
    model.train()
    model(**inputs).loss.backward()
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, tf.AutoModelForCausalLM)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), atol=0, rtol=0)


def _gemma3_with_vision(seed: int = 0):
    """A tiny Gemma 3 with its vision tower as wide as its language model (so width alone does not
    tell their norms apart), and a batch of text with 4 image tokens per image."""
    torch.manual_seed(seed)
    text = dict(DECODER_ONLY, vocab_size=VOCAB + 3, head_dim=HEAD_DIM)
    vision = dict(hidden_size=HIDDEN, intermediate_size=37, num_hidden_layers=1, num_attention_heads=HEADS,
                  image_size=28, patch_size=7)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=VOCAB,
        eoi_token_index=VOCAB + 1, image_token_index=VOCAB + 2))
    inputs = batch("gemma3")
    inputs["input_ids"][:, 1:5] = VOCAB + 2  # the image's 4 tokens, real in every row
    inputs["labels"] = inputs["labels"].masked_fill(inputs["input_ids"] == VOCAB + 2, -100)
    inputs["token_type_ids"] = (inputs["input_ids"] == VOCAB + 2).long()
    inputs["pixel_values"] = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(seed))
    return model, inputs


def test_a_composite_model_converts_its_language_model_only_by_default(tmp_path):
    """Gemma 3's vision tower sees 16 patches per image, which the tokens' padding mask does not
    describe: by default its norms (and the projector's) are kept; selected by `modules=`, they
    convert and take every patch as real."""
    model, inputs = _gemma3_with_vision()
    report = convert(model)
    assert report.modules and all(path.startswith("model.language_model.") for path in report.modules)
    outside = {path for path, _, reason in report.kept if "outside the language model" in reason}
    assert {path.split(".")[1] for path in outside} == {"vision_tower", "multi_modal_projector"}
    model.train()
    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.norm.num_batches_tracked == 1 for m in model.modules() if isinstance(m, MaskAwareNorm))

    model, inputs = _gemma3_with_vision()
    report = convert(model, modules=r"vision_tower\.|language_model\.norm$")
    vision = [path for path in report.modules if path.startswith("model.vision_tower.")]
    assert vision and "model.language_model.norm" in report.modules
    assert {model.get_submodule(path).role for path in vision} == {"unmasked"}
    assert model.get_submodule("model.language_model.norm").role == "main"
    model.train()
    model(**inputs).loss.backward()  # the patches' norms run without the tokens' mask
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, tf.AutoModelForImageTextToText)
    assert {loaded.get_submodule(path).role for path in vision} == {"unmasked"}
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), atol=0, rtol=0)


def test_modules_regex_selects_the_encoder_only():
    model = build("bart")
    report = convert(model, modules=r"^model\.encoder\.")
    assert report.modules and all(path.startswith("model.encoder.") for path in report.modules)
    assert {path for path, _, _ in report.kept} == {n for n, m in model.named_modules() if is_norm_candidate(m)}
    assert all(path.startswith("model.decoder.") and "not selected" in reason for path, _, reason in report.kept)


def test_modules_predicate_selects_layers_from_one_on():
    model = build("llama")
    report = convert(model, modules=lambda name, module: name.startswith("model.layers.1."))
    assert report.modules == ["model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm"]
    assert [path for path, _, _ in report.kept] == ["model.layers.0.input_layernorm",
                                                    "model.layers.0.post_attention_layernorm", "model.norm"]


def test_a_selected_wrapper_names_the_norm_it_holds():
    """`modules=` that picks AXK2's gated RMSNorm itself (not its RMSNorm) is refused with the path to select."""
    refused = (r"'model\.layers\.0\.input_layernorm' \(AXK2GatedRMSNorm\): it has submodules.*"
               r"select the norm it holds: model\.layers\.0\.input_layernorm\.norm\)")
    with pytest.raises(ValueError, match=refused):
        convert(build("axk2"), modules=r"input_layernorm$")
    report = convert(build("axk2"), modules=r"input_layernorm\.norm$")
    assert report.modules == ["model.layers.0.input_layernorm.norm", "model.layers.1.input_layernorm.norm"]


def test_bad_modules_raise():
    with pytest.raises(ValueError, match=r"modules='\(' is not a regular expression"):
        convert(build("llama"), modules="(")
    with pytest.raises(TypeError, match="modules must be None, a regular expression string or a callable"):
        convert(build("llama"), modules=3)


# ----------------------------------------------------------------------------------------------
# Kernel patches


def test_hub_kernels_leave_converted_norms_alone():
    """`kernelize` replaces the forward of modules whose class carries `kernel_layer_name` (what
    `@use_kernel_forward_from_hub` sets); the converted norms' classes carry none."""
    model = build("llama")
    convert(model)
    for module in model.modules():
        if isinstance(module, MaskAwareNorm):
            assert not hasattr(type(module), "kernel_layer_name")
            assert not hasattr(type(module.norm), "kernel_layer_name")


def test_a_patched_converted_norm_is_refused_by_name():
    """Liger's `apply_liger_kernel_to_*(model=...)` binds its forward on each norm instance it finds
    (as `kernels.kernelize` does): the next forward names the patched norm instead of running it."""
    model = build("llama")
    convert(model)
    inputs = batch("llama")
    model(**inputs)

    def liger_rms_norm_forward(self, hidden_states):
        return hidden_states

    norm = model.model.layers[1].input_layernorm
    norm.__dict__["forward"] = types.MethodType(liger_rms_norm_forward, norm)
    with pytest.raises(RuntimeError, match=r"'model.layers.1.input_layernorm' \(PowerNorm\).*liger_rms_norm_forward"):
        model(**inputs)


# ----------------------------------------------------------------------------------------------
# The recipes' options


def test_recipe_options_select_norms_and_keep_the_function(tmp_path):
    """`--convert_modules`, `--preserve_function` and `--calibration_batches` reach `convert_norms`:
    the selected norms convert, calibrated on the first training batches, and the logits stay."""
    from accelerate import PartialState

    from hf_powernorm.training.batching import PaddingCollator
    from hf_powernorm.training.language_modeling import parse_args
    from hf_powernorm.training.models import load_and_convert

    PartialState(cpu=True)  # the recipes log through Accelerate
    source = build("llama")
    source.save_pretrained(tmp_path / "llama")
    args = parse_args(["--model_name_or_path", str(tmp_path / "llama"), "--convert_norms", "PowerNorm",
                       "--convert_modules", r"layers\.1\.", "--preserve_function", "--calibration_batches", "2",
                       "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "out")])
    generator = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=generator).tolist()} for _ in range(5)]

    class Tokenizer:
        def __len__(self):
            return VOCAB

    model = load_and_convert(args, tf.AutoModelForCausalLM, Tokenizer(), 1, calibration=(rows, PaddingCollator(0)))
    conversion = model.config.powernorm_conversion
    assert conversion["modules"] == ["model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm"]
    assert conversion["preserve_function"] and conversion["options"]["warmup_steps"] == 0
    norm = model.get_submodule("model.layers.1.input_layernorm").norm
    assert not torch.equal(norm.running_phi, torch.ones_like(norm.running_phi))  # calibrated
    inputs = batch("llama")
    source.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(model, inputs), logits(source, inputs), atol=1e-4, rtol=0)


def test_recipe_conversion_options_need_convert_norms(tmp_path):
    from hf_powernorm.training.language_modeling import parse_args

    with pytest.raises(ValueError, match="--preserve_function shape --convert_norms: give --convert_norms too"):
        parse_args(["--preserve_function", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--convert_modules '\(' is not a regular expression"):
        parse_args(["--model_name_or_path", str(tmp_path), "--convert_norms", "powernorm", "--convert_modules", "(",
                    "--output_dir", str(tmp_path)])
    converting = ["--model_name_or_path", str(tmp_path), "--convert_norms", "powernorm", "--preserve_function",
                  "--output_dir", str(tmp_path)]
    for flag, value in (("--powernorm_warmup_steps", "100"), ("--powernorm_warmup_ramp_steps", "10"),
                        ("--powernorm_group_num", "4")):
        with pytest.raises(ValueError, match=rf"--preserve_function converts to powernorm .*leave out {flag} {value}"):
            parse_args([*converting, flag, value])
    assert parse_args([*converting, "--powernorm_warmup_steps", "0", "--powernorm_group_num", "1"]).preserve_function
