"""A converted model saved with `save_pretrained` loads right anywhere: through the Auto classes with
`trust_remote_code=True` (in this process and in a fresh one without the package), through every
Auto class the original supports (another head loads as it would from the original's folder), through
`load_converted`, never silently as the unconverted model."""

from __future__ import annotations

import copy
import json
import pickle
import textwrap
import warnings

import pytest
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    AutoModelForTextEncoding,
    BertConfig,
    BertModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

import hf_powernorm
from hf_powernorm.modeling_converted import MODEL_TYPE_PREFIX, auto_map, is_converted_class, original_class

VOCAB, HIDDEN, HEADS, PAD = 99, 32, 4, 0


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=37,
                                        pad_token_id=PAD))


def _neox():
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                            num_attention_heads=HEADS, intermediate_size=37, pad_token_id=PAD,
                                            hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False))


def _bert():
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=37, num_layers=2,
                                               num_heads=HEADS, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=1,
                                               decoder_start_token_id=PAD))


MODELS = {"llama": (_llama, AutoModelForCausalLM), "gpt_neox": (_neox, AutoModelForCausalLM),
          "bert": (_bert, AutoModel), "t5": (_t5, AutoModelForSeq2SeqLM)}


def _inputs(name: str) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 3:] = 0, 0
    inputs = {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (3, 5), generator=generator)
    return inputs


def _outputs(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        output = model(**inputs)
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _trained(name: str, **options):
    """A converted model after two training steps (so its running statistics differ from their start)."""
    torch.manual_seed(0)
    model = MODELS[name][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, "powernorm", **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(2):
        inputs = _inputs(name)
        output = model(**inputs)
        loss = output.logits.float().square().mean() if hasattr(output, "logits") else output.last_hidden_state.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _assert_same(loaded, model, name: str) -> None:
    expected = model.state_dict()
    got = loaded.state_dict()
    buffers = [key for key, _ in model.named_buffers() if key.endswith(("running_phi", "running_nu"))]
    assert buffers and all(torch.equal(got[key], expected[key]) for key in buffers)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    torch.testing.assert_close(_outputs(loaded, _inputs(name)), _outputs(model, _inputs(name)), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_class_with_remote_code_loads_the_converted_model(name, tmp_path):
    model = _trained(name)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    base_type = original_class(type(model.config)).model_type
    assert saved["model_type"] == MODEL_TYPE_PREFIX + base_type
    assert saved["auto_map"]["AutoConfig"] == f"modeling_converted.{type(model.config).__name__}"
    assert saved["auto_map"][MODELS[name][1].__name__] == f"modeling_converted.{type(model).__name__}"
    copied = {p.name for p in tmp_path.glob("*.py")}
    assert {"modeling_converted.py", "converted_norms.py", "normalization.py"} <= copied and "converter.py" not in copied
    assert model.config.model_type == base_type  # in memory the config keeps its type (PEFT and others key on it)

    loaded = MODELS[name][1].from_pretrained(tmp_path, trust_remote_code=True)
    assert type(loaded).__module__.startswith("transformers_modules.")
    assert type(loaded).__name__ == type(model).__name__
    _assert_same(loaded, model, name)
    _assert_same(hf_powernorm.load_converted(tmp_path, MODELS[name][1]), model, name)
    _assert_same(hf_powernorm.load_converted(tmp_path, type(loaded)), model, name)  # the remote class, too


@pytest.mark.parametrize("trust", [None, False])
def test_loading_without_remote_code_raises_instead_of_loading_another_model(trust, tmp_path):
    _trained("llama").save_pretrained(tmp_path)
    with pytest.raises((ValueError, OSError), match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=trust)
    with pytest.raises((ValueError, OSError), match="trust_remote_code"):
        AutoConfig.from_pretrained(tmp_path, trust_remote_code=trust)


def test_gpt_neox_keeps_transformers_key_names_and_reloads(tmp_path):
    """GPT-NeoX saves `lm_head` as `embed_out` (Transformers renames it on save and back on load): the
    converted class follows the same renaming, so its folder reloads, and so does one saved by the
    original class before the converted classes existed (a record without per-norm entries)."""
    from safetensors import safe_open

    model = _trained("gpt_neox")
    model.save_pretrained(tmp_path / "new")
    with safe_open(str(tmp_path / "new" / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    _assert_same(hf_powernorm.load_converted(tmp_path / "new", GPTNeoXForCausalLM), model, "gpt_neox")

    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_bytes((tmp_path / "new" / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    del config["auto_map"], config["powernorm_conversion"]["norms"]
    (old / "config.json").write_text(json.dumps(config))
    _assert_same(hf_powernorm.load_converted(old, AutoModelForCausalLM), model, "gpt_neox")


def test_a_reloaded_model_saves_and_reloads_again(tmp_path):
    model = _trained("llama")
    model.save_pretrained(tmp_path / "first")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "first", trust_remote_code=True)
    loaded.save_pretrained(tmp_path / "second")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "second", trust_remote_code=True)
    _assert_same(again, model, "llama")
    _assert_same(hf_powernorm.load_converted(tmp_path / "second", LlamaForCausalLM), model, "llama")


def test_converted_models_copy_and_pickle():
    """Conversion keeps a model copyable and picklable whenever Transformers' own model is: with the
    `kernels` package installed, upstream models hold local function-module classes that pickle refuses,
    and the converted model then fails alike (never worse)."""
    model = _trained("llama")
    clones = [copy.deepcopy(model)]
    try:
        pickle.dumps(MODELS["llama"][0]())
    except (AttributeError, pickle.PicklingError) as error:
        with pytest.raises(type(error)):
            pickle.dumps(model)
    else:
        clones.append(pickle.loads(pickle.dumps(model)))
    for clone in clones:
        assert type(clone) is type(model)
        _assert_same(clone.eval(), model, "llama")


def test_fresh_process_without_the_package_loads_the_converted_folder(tmp_path, run_without_the_package):
    model = _trained("llama")
    folder = tmp_path / "converted"
    model.save_pretrained(folder)
    torch.save({"logits": _outputs(model, _inputs("llama")), "inputs": _inputs("llama"),
                "buffers": {k: v for k, v in model.named_buffers() if k.endswith("running_phi")}},
               tmp_path / "expected.pt")
    child = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        buffers = dict(model.named_buffers())
        assert all(torch.equal(buffers[k], v) for k, v in expected["buffers"].items())
        with torch.no_grad():
            logits = model(**expected["inputs"]).logits
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
        print("OK", len(expected["buffers"]))
    """)
    result = run_without_the_package(child, tmp_path / "hf_home")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"OK {len([k for k, _ in model.named_buffers() if k.endswith('running_phi')])}"


# ----------------------------------------------------------------------------------------------
# Every Auto class the original supports


def _vit():
    return ViTForImageClassification(ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                               intermediate_size=37, image_size=12, patch_size=4, num_labels=3,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _whisper():
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
        max_source_positions=6, max_target_positions=16, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def _converted_and_saved(build, folder, **options):
    torch.manual_seed(0)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, "powernorm", **options)
    model.save_pretrained(folder)
    return model.eval()


def _loaded(auto, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = auto.from_pretrained(folder, trust_remote_code=True).eval()
    assert is_converted_class(type(model)) and type(model).__module__.startswith("transformers_modules."), type(model)
    return model


def test_auto_map_lists_every_auto_class_of_the_model_type_and_each_builds_the_converted_class(tmp_path):
    model = _converted_and_saved(_llama, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert saved == {"AutoConfig": "modeling_converted.LlamaConfig", **auto_map("llama")}
    assert {"AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
            "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"} <= set(saved)
    for auto, reference in saved.items():
        if auto != "AutoConfig":
            loaded = _loaded(getattr(transformers, auto), tmp_path)
            assert type(loaded).__name__ == reference.rpartition(".")[2]
            wrapped = [m for m in loaded.modules() if type(m).__name__ == "MaskAwareNorm"]
            assert len(wrapped) == len(model.config.powernorm_conversion["modules"]) == 5, auto
    inputs = _inputs("llama")
    base = _loaded(AutoModel, tmp_path)  # the converted base model, statistics and all
    with torch.no_grad():
        torch.testing.assert_close(base(**inputs).last_hidden_state, model.model(**inputs).last_hidden_state,
                                   atol=0, rtol=0)
    assert base.config.powernorm_conversion["modules"][0].startswith("layers.")  # in the base model's own paths


def test_vit_loads_through_image_classification_and_whisper_through_speech_seq2seq(tmp_path):
    pixels = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    vit = _converted_and_saved(_vit, tmp_path / "vit")
    with torch.no_grad():
        torch.testing.assert_close(_loaded(AutoModelForImageClassification, tmp_path / "vit")(pixel_values=pixels).logits,
                                   vit(pixel_values=pixels).logits, atol=0, rtol=0)
        torch.testing.assert_close(_loaded(AutoModel, tmp_path / "vit")(pixel_values=pixels).last_hidden_state,
                                   vit.vit(pixel_values=pixels).last_hidden_state, atol=0, rtol=0)

    whisper = _converted_and_saved(_whisper, tmp_path / "whisper")
    features = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(2))
    decoder_ids = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    loaded = _loaded(AutoModelForSpeechSeq2Seq, tmp_path / "whisper")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_features=features, decoder_input_ids=decoder_ids).logits,
                                   whisper(input_features=features, decoder_input_ids=decoder_ids).logits,
                                   atol=0, rtol=0)


def test_a_class_holding_none_of_the_converted_norms_raises_naming_load_converted(tmp_path):
    """T5 with only its decoder's norms converted: the encoder-only class would be the unconverted model."""
    _converted_and_saved(_t5, tmp_path, modules=r"^decoder\.")
    assert "AutoModelForTextEncoding" in json.loads((tmp_path / "config.json").read_text())["auto_map"]
    with pytest.raises(ValueError, match=r"T5EncoderModel holds none of the .* norms .*hf_powernorm\.load_converted"):
        AutoModelForTextEncoding.from_pretrained(tmp_path, trust_remote_code=True)
