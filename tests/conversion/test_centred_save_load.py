"""A model converted with `preserve_function=True` and calibration batches (its residual stream centred,
a tied head untied: `centring.py`) saves and reloads as it was: every tensor equal, the same ties
(BART's encoder and decoder embeddings stay the shared table, BERT's decoder bias its prediction
bias), the same logits. Transformers 5 applies a model's `_tied_weights_keys` only while
`tie_word_embeddings` is true, so untying the head must not lose the model's other ties on reload."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf

import hf_powernorm
from hf_powernorm.converter import is_norm_candidate

# Odd sizes throughout: a hidden size of 30 in 3 heads of 10, a vocabulary of 97, FFNs of 37.
VOCAB, HIDDEN, HEADS, FFN, POSITIONS, SEQ = 97, 30, 3, 37, 61, 7

FAMILIES = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_inner=FFN, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, word_embed_proj_dim=HIDDEN, num_hidden_layers=2,
        num_attention_heads=HEADS, ffn_dim=FFN, max_position_embeddings=POSITIONS, dropout=0.0,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=POSITIONS, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
    "bert_masked_lm": lambda: tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
    "bert_sequence_classification": lambda: tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)),
    # RMSNorm sources: nothing is centred and the head stays tied, through the save and the load too.
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=1, intermediate_size=FFN, max_position_embeddings=POSITIONS, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
UNTIED = {"gpt2": "lm_head", "opt": "lm_head", "bart": "lm_head", "bert_masked_lm": "cls.predictions.decoder"}


def build(name: str):
    """The family's tiny model with every bias random and its norms' weights away from 1."""
    torch.manual_seed(0)
    model = FAMILIES[name]()
    with torch.no_grad():
        for module in model.modules():
            if is_norm_candidate(module) and getattr(module, "weight", None) is not None:
                module.weight.mul_(torch.empty_like(module.weight).uniform_(0.5, 1.5))
            if isinstance(getattr(module, "bias", None), torch.nn.Parameter):
                module.bias.normal_(0.0, 0.3)
        if hasattr(model, "final_logits_bias"):  # BART's bias of the logits, a buffer
            model.final_logits_bias.normal_(0.0, 0.3)
    return model


def batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 3:] = 0, 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def ties(model) -> list[list[str]]:
    """The groups of parameter names that share one tensor."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_centred_conversion_saves_and_reloads_as_it_was(name, tmp_path):
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = hf_powernorm.convert_norms(model, "powernorm", preserve_function=True,
                                            calibration_batches=[batch(2), batch(3)])
    assert (report.centring.untied if report.centring else None) == UNTIED.get(name)
    _assert_reloads_as_it_was(model, tmp_path)


def _assert_reloads_as_it_was(model, folder):
    """`model` saved to `folder` and loaded with `load_converted`: the same ties, every tensor (by name
    and order) equal, the same logits. Returns the loaded model."""
    model.eval()
    inputs = batch(1)
    with torch.no_grad():
        expected = model(**inputs).logits
    model.save_pretrained(folder)
    loaded = hf_powernorm.load_converted(folder, type(model))
    assert ties(loaded) == ties(model)
    state, reloaded = model.state_dict(), loaded.state_dict()
    assert list(reloaded) == list(state)
    assert [key for key in state if not torch.equal(reloaded[key], state[key])] == []
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected)
    return loaded


@pytest.mark.parametrize("name", list(UNTIED))
def test_a_centred_model_not_converted_reloads_with_load_converted(name, tmp_path):
    """A comparison's baseline: its stream centred and its head untied (`centre_stream`), its norms kept.
    Its Transformers class alone would leave the kept ties' names unfilled (BART's embeddings, BERT's
    decoder bias); `load_converted` gives it back with every tensor, tie and logit."""
    from hf_powernorm.converter import centre_stream

    model = build(name)
    centre_stream(model, [batch(2), batch(3)])
    assert type(_assert_reloads_as_it_was(model, tmp_path)) is type(model)


@pytest.mark.parametrize("name", ["bart", "gpt2"])
def test_the_base_model_of_a_converted_folder_loads_without_the_head(name, tmp_path):
    """`load_converted(folder, AutoModel)` on a converted LM, as `from_pretrained` loads a base model
    from a head's checkpoint: the head's weights left out with a warning naming them, every norm loaded,
    the base model's outputs those of the saved model's."""
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, "powernorm", preserve_function=True, calibration_batches=[batch(2)])
    model.eval()
    inputs = batch(1)
    with torch.no_grad():
        expected = model.base_model(**inputs).last_hidden_state
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"left out \[.*'lm_head.weight'"):
        loaded = hf_powernorm.load_converted(tmp_path, tf.AutoModel)
    assert type(loaded).__name__ == type(model.base_model).__name__
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).last_hidden_state, expected)


def test_a_norms_missing_tensor_raises_whatever_the_head(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, "powernorm", preserve_function=True, calibration_batches=[batch(2)])
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = next(key for key in weights if key.startswith("transformer.h.0.ln_1") and "running" in key)
    save_file({k: v for k, v in weights.items() if k != dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    for model_class in (tf.GPT2LMHeadModel, tf.AutoModel):
        with pytest.raises(ValueError, match="does not match the converted model"):
            hf_powernorm.load_converted(tmp_path, model_class)
