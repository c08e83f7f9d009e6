"""Tests of `convert_norms` / `load_converted` on tiny random BERT, GPT-2, Llama, BART and T5 models."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

import hf_powernorm
from hf_powernorm.converter import MaskAwareNorm, apply_conversion, find_norms, is_norm_candidate

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 99, 32, 4, 3, 7
LENGTHS, DECODER_LENGTHS = (7, 4, 2), (5, 3, 5)
PAD = 0


def _bert():
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD))


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=37,
                                        pad_token_id=PAD))


def _bart():
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None))


def _t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=37, num_layers=2,
                                               num_heads=HEADS, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=1,
                                               decoder_start_token_id=PAD))


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "bart": _bart, "t5": _t5}
SEQ2SEQ = ("bart", "t5")
GENERATORS = ("gpt2", "llama", "bart", "t5")


def build(name: str, norm_type: str = "powernorm", seed: int = 0, **options):
    torch.manual_seed(seed)
    model = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the causal-model warning has its own test
        report = hf_powernorm.convert_norms(model, norm_type, **options)
    return model, report


def _padded(lengths, seq: int, seed: int, pad_id: int = PAD, left: bool = False):
    """`(ids, mask)` of rows with the given real lengths, padded to `seq` with `pad_id`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=generator)
    positions = torch.arange(seq).expand(len(lengths), seq)
    real = torch.tensor(lengths)[:, None]
    mask = (positions >= seq - real) if left else (positions < real)
    return ids.masked_fill(~mask, pad_id), mask.long()


def _extend(ids: torch.Tensor, mask: torch.Tensor, extra: int, pad_id: int):
    pad = torch.full((ids.shape[0], extra), pad_id)
    return torch.cat([ids, pad], 1), torch.cat([mask, torch.zeros_like(pad)], 1)


def batch_inputs(name: str, extra_padding: int = 0, pad_id: int = PAD) -> dict:
    """A right-padded batch (encoder and decoder for encoder-decoder models), with `extra_padding`
    more padding columns of `pad_id`."""
    ids, mask = _extend(*_padded(LENGTHS, SEQ, seed=1, pad_id=pad_id), extra_padding, pad_id)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name in SEQ2SEQ:
        decoder = _extend(*_padded(DECODER_LENGTHS, SEQ - 1, seed=2, pad_id=pad_id), extra_padding, pad_id)
        inputs.update(decoder_input_ids=decoder[0], decoder_attention_mask=decoder[1])
    return inputs


def row_inputs(inputs: dict, row: int) -> dict:
    """Row `row` of a batch without its padding."""
    out = {}
    for prefix in ("", "decoder_"):
        if f"{prefix}input_ids" in inputs:
            length = int(inputs[f"{prefix}attention_mask"][row].sum())
            out[f"{prefix}input_ids"] = inputs[f"{prefix}input_ids"][row:row + 1, :length]
    return out


def outputs(model, inputs: dict) -> torch.Tensor:
    result = model(**inputs)
    return result.last_hidden_state if hasattr(result, "last_hidden_state") else result.logits


def real_mask(inputs: dict) -> torch.Tensor:
    return inputs.get("decoder_attention_mask", inputs["attention_mask"]).bool()


def converted_norms(model) -> dict[str, nn.Module]:
    return {name: module.norm for name, module in model.named_modules() if isinstance(module, MaskAwareNorm)}


def train_step(model, inputs: dict, optimizer=None) -> None:
    model.train()
    logits = outputs(model, inputs)
    loss = (logits.float() * real_mask(inputs)[..., None]).square().mean()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()


# ----------------------------------------------------------------------------------------------
# Finding and replacing


@pytest.mark.parametrize("name", list(MODELS))
def test_every_norm_replaced(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    before = {n: type(m).__name__ for n, m in model.named_modules() if is_norm_candidate(m)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = hf_powernorm.convert_norms(model)
    assert before and report.modules == list(before)
    assert [(path, old) for path, old, _ in report.replaced] == list(before.items())
    assert not any(is_norm_candidate(m) for _, m in model.named_modules())
    assert all(type(norm).__name__ == "PowerNorm" and norm.group_num == HEADS
               for norm in converted_norms(model).values())
    conversion = model.config.powernorm_conversion
    assert {k: conversion[k] for k in ("norm_type", "options", "modules", "preserve_function")} == {
        "norm_type": "powernorm", "options": {"group_num": HEADS}, "modules": list(before), "preserve_function": False}
    assert list(conversion["norms"]) == list(before) and not report.kept
    source_kind = "layernorm" if name in ("bert", "gpt2", "bart") else "rmsnorm"
    for path, entry in conversion["norms"].items():
        eps = model.get_submodule(path).norm.eps
        assert entry == {"size": HIDDEN, "source": source_kind, "options": {"eps": eps, "group_num": HEADS}}


@pytest.mark.parametrize("name,same_kind", [("bert", "layernorm"), ("gpt2", "layernorm"), ("llama", "rmsnorm"),
                                            ("bart", "layernorm"), ("t5", "rmsnorm")])
def test_converting_to_the_same_kind_keeps_the_outputs(name, same_kind):
    """Weights and biases map: a model converted to its own norm computes what it computed before."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        for _, module in model.named_modules():
            if is_norm_candidate(module):
                module.weight.normal_(1.0, 0.3)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, 0.3)
    inputs = batch_inputs(name)
    expected = outputs(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hf_powernorm.convert_norms(model, same_kind)
    torch.testing.assert_close(outputs(model, inputs), expected, atol=1e-5, rtol=1e-5)


class _TripledLayerNorm(nn.LayerNorm):
    def forward(self, hidden_states):
        return 3 * super().forward(hidden_states)  # neither w nor 1 + w (w = 1) gives it


class _OffsetRMSNorm(nn.Module):
    """An RMS norm scaling by `1 + weight` (as Gemma's does)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size) * 0.1)
        self.eps = 1e-6

    def forward(self, hidden_states):
        return hidden_states * torch.rsqrt(hidden_states.square().mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_structural_rule_on_transformers_norm_classes():
    llama, t5 = _llama(), _t5()
    llama_norms = find_norms(llama, HIDDEN)
    assert {type(llama.get_submodule(n)).__name__ for n in llama_norms} == {"LlamaRMSNorm"}
    assert {s.kind for s in llama_norms.values()} == {"rmsnorm"}
    kinds = {n: s.kind for n, s in find_norms(t5, HIDDEN).items()}
    assert set(kinds.values()) == {"rmsnorm"} and type(t5.get_submodule(next(iter(kinds)))).__name__ == "T5LayerNorm"
    assert {s.kind for s in find_norms(_gpt2(), HIDDEN).values()} == {"layernorm"}
    assert not is_norm_candidate(hf_powernorm.build_norm("layernorm", HIDDEN))
    offset = _OffsetRMSNorm(HIDDEN)
    (source,) = find_norms(nn.ModuleDict({"norm": offset}), HIDDEN).values()
    assert source.kind == "rmsnorm_offset"
    torch_norms = find_norms(nn.ModuleDict({"ln": nn.LayerNorm(HIDDEN), "rms": nn.RMSNorm(HIDDEN)}), HIDDEN)
    assert [(s.kind, s.eps) for s in torch_norms.values()] == [("layernorm", 1e-5),
                                                               ("rmsnorm", torch.finfo(torch.float32).eps)]


def test_a_norm_that_cannot_convert_is_named():
    model = _bert()
    model.encoder.layer[1].output.LayerNorm = _TripledLayerNorm(HIDDEN)
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.LayerNorm.*_TripledLayerNorm"):
        hf_powernorm.convert_norms(model)
    model = _bert()
    model.pooler.LayerNorm = nn.LayerNorm(HIDDEN)
    model.pooler.LayerNorm.weight = nn.Parameter(torch.ones(HIDDEN, 2))
    with pytest.raises(ValueError, match=r"pooler\.LayerNorm.*shape \(32, 2\), expected \(32,\)"):
        hf_powernorm.convert_norms(model)


def test_a_norm_over_another_size_is_kept_and_reported():
    model = _bert()
    model.pooler.LayerNorm = nn.LayerNorm(HIDDEN // 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = hf_powernorm.convert_norms(model)
    assert report.kept == [("pooler.LayerNorm", "LayerNorm", "normalizes 16 channels, not the hidden size 32: "
                                                             "off the residual stream")]
    assert type(model.pooler.LayerNorm) is nn.LayerNorm and "pooler.LayerNorm" not in report.modules
    assert "1 norms kept" in str(report) and "pooler.LayerNorm: LayerNorm (normalizes 16" in str(report)


def test_bad_arguments_raise():
    model, _ = build("bert")
    with pytest.raises(ValueError, match="already converted"):
        hf_powernorm.convert_norms(model)
    with pytest.raises(ValueError, match="unknown norm 'pwrnorm'"):
        hf_powernorm.convert_norms(_bert(), "pwrnorm")
    with pytest.raises(TypeError, match="does not take option"):
        hf_powernorm.convert_norms(_bert(), "layernorm", alpha_fwd=0.9)
    with pytest.raises(TypeError, match="convert_norms expects a Transformers PreTrainedModel"):
        hf_powernorm.convert_norms(nn.Sequential(nn.LayerNorm(HIDDEN)))


def test_device_and_dtype_follow_the_model_and_buffers_stay_float32():
    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16)
    hf_powernorm.convert_norms(model)
    for norm in converted_norms(model).values():
        assert norm.weight.dtype == torch.bfloat16 and norm.running_phi.dtype == torch.float32
    model.train()
    logits = model(**batch_inputs("llama")).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


# ----------------------------------------------------------------------------------------------
# The padding mask


@pytest.mark.parametrize("name", list(MODELS))
def test_padding_invariance_against_unpadded_rows(name):
    """Real tokens' outputs of a padded batch equal each row run alone, in train mode (PN after its
    warmup, whose output does not depend on the batch) and in eval mode."""
    model, _ = build(name)
    inputs = batch_inputs(name)
    train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    mask = real_mask(inputs)
    for mode in ("train", "eval"):
        model.train(mode == "train")
        batched = outputs(copy.deepcopy(model), inputs)
        for row in range(BATCH):
            alone = outputs(copy.deepcopy(model), row_inputs(inputs, row))[0]
            torch.testing.assert_close(batched[row][mask[row]], alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_padding_never_reaches_the_statistics(name):
    """During warmup (batch statistics): other padding values and more padding change neither a real
    token's output nor a running buffer (forward and backward statistics)."""
    model, _ = build(name, warmup_steps=5)
    model.train()
    short, long = copy.deepcopy(model), copy.deepcopy(model)
    inputs_short, inputs_long = batch_inputs(name), batch_inputs(name, extra_padding=3, pad_id=7)
    out_short, out_long = outputs(short, inputs_short), outputs(long, inputs_long)
    mask_short, mask_long = real_mask(inputs_short), real_mask(inputs_long)
    torch.testing.assert_close(out_short[mask_short], out_long[mask_long], atol=2e-5, rtol=1e-4)
    out_short[mask_short].square().mean().backward()
    out_long[mask_long].square().mean().backward()
    for (key, a), (_, b) in zip(short.state_dict().items(), long.state_dict().items()):
        if "running" in key:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "bart"])
def test_no_mask_means_every_token_is_real(name):
    """Without a mask (a decoder fed `decoder_input_ids` alone too) every token counts, in warmup."""
    model, _ = build(name, warmup_steps=5)
    model.train()
    mask_name = "decoder_attention_mask" if name in SEQ2SEQ else "attention_mask"
    inputs = {k: v for k, v in batch_inputs(name).items() if k != mask_name}
    ones = torch.ones_like(inputs.get("decoder_input_ids", inputs["input_ids"]))
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    torch.testing.assert_close(outputs(first, inputs), outputs(second, {**inputs, mask_name: ones}))


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_and_decoder_norms_get_their_own_mask(name):
    model, _ = build(name)
    inputs = batch_inputs(name)
    seen = {}
    for name, norm in converted_norms(model).items():
        norm.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: seen.update({name: kwargs["attention_mask"]}), with_kwargs=True)
    model(**inputs)
    for name, mask in seen.items():
        expected = inputs["attention_mask"] if name.startswith(("encoder.", "model.encoder.")) \
            else inputs["decoder_attention_mask"]
        assert torch.equal(mask, expected), name
    assert len(seen) == len(converted_norms(model))
    assert model._powernorm_mask_context._stack == []


def test_the_mask_is_cleared_after_a_failed_forward():
    model, _ = build("gpt2")
    with pytest.raises(Exception):
        model(torch.full((2, 3), VOCAB + 5), attention_mask=torch.ones(2, 3))
    assert model._powernorm_mask_context._stack == []


# ----------------------------------------------------------------------------------------------
# Training, generation, saving


@pytest.mark.parametrize("name", list(MODELS))
def test_buffers_update_once_per_training_step(name):
    model, _ = build(name)
    inputs = batch_inputs(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        train_step(model, inputs, optimizer)
    for path, norm in converted_norms(model).items():
        assert int(norm.num_batches_tracked) == 2, path
        assert not torch.equal(norm.running_phi, torch.ones_like(norm.running_phi)), path
        assert norm.running_nu.abs().sum() > 0, path


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_activation_checkpointing_recomputes_with_the_same_mask(name):
    """Layers run again in the backward pass see the mask of their forward: same gradients and buffers."""
    model, _ = build(name, warmup_steps=5)
    model.train()
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)
    (enable or checkpointed.gradient_checkpointing_enable)()
    inputs = batch_inputs(name)
    for each in (plain, checkpointed):
        outputs(each, inputs)[real_mask(inputs)].square().mean().backward()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[key], value, atol=1e-7, rtol=1e-5)
    for (key, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("name", GENERATORS)
def test_generation_with_cache_equals_without(name):
    model, _ = build(name)
    train_step(model, batch_inputs(name), torch.optim.SGD(model.parameters(), lr=0.1))
    model.eval()
    ids, mask = _padded(LENGTHS, SEQ, seed=3, left=name not in SEQ2SEQ)
    masks_seen = []
    norm = next(iter(converted_norms(model).values())) if name not in SEQ2SEQ else converted_norms(model)[
        next(n for n in converted_norms(model) if "decoder" in n)]
    norm.register_forward_pre_hook(
        lambda module, args, kwargs: masks_seen.append((args[0].shape[:2], kwargs["attention_mask"])),
        with_kwargs=True)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with_cache = model.generate(ids, use_cache=True, **settings)
    without_cache = model.generate(ids, use_cache=False, **settings)
    assert torch.equal(with_cache, without_cache)
    cached_steps = masks_seen[: len(masks_seen) // 2]
    assert all(m is None or tuple(m.shape) == tuple(shape) for shape, m in masks_seen)
    if name not in SEQ2SEQ:  # the decoder sees one new token a step, and its mask is that column
        assert [tuple(shape)[1] for shape, _ in cached_steps] == [SEQ, 1, 1, 1]
        assert torch.equal(cached_steps[0][1], mask) and all(bool(m.all()) for _, m in cached_steps[1:])


@pytest.mark.parametrize("name", list(MODELS))
def test_save_and_load_round_trip(name, tmp_path):
    model, report = build(name)
    inputs = batch_inputs(name)
    train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    buffers = [k for k, _ in model.named_buffers() if k.rsplit(".", 1)[-1] in
               ("running_phi", "running_nu", "num_batches_tracked")]
    assert len(buffers) == 3 * len(report.replaced) and set(buffers) <= set(saved)
    assert json.loads((tmp_path / "config.json").read_text())["powernorm_conversion"]["modules"] == report.modules
    auto_class = AutoModel if name == "bert" else AutoModelForSeq2SeqLM if name in SEQ2SEQ else AutoModelForCausalLM
    loaded = hf_powernorm.load_converted(tmp_path, auto_class)
    assert type(loaded) is type(model)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    model.eval()
    torch.testing.assert_close(outputs(loaded, inputs), outputs(model, inputs), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_apply_conversion_replays_the_record_on_the_meta_device(name):
    """The record alone rebuilds the converted modules: on `meta` (no value read), then with the
    trained state loaded into a model built for real, the same outputs."""
    model, report = build(name)
    inputs = batch_inputs(name)
    train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    record = json.loads(json.dumps(model.config.powernorm_conversion))
    with torch.device("meta"):
        fresh = MODELS[name]()
    replayed = apply_conversion(fresh, record)
    assert replayed.replaced == report.replaced and not replayed.kept
    assert all(t.is_meta for norm in converted_norms(fresh).values() for t in norm.state_dict().values())
    assert fresh.config.powernorm_conversion == record
    torch.manual_seed(1)
    real = MODELS[name]()
    apply_conversion(real, record)
    real.load_state_dict(model.state_dict())
    model.eval(), real.eval()
    torch.testing.assert_close(outputs(real, inputs), outputs(model, inputs), atol=0, rtol=0)


def test_apply_conversion_refuses_a_bad_record():
    model, _ = build("llama")
    record = model.config.powernorm_conversion
    with pytest.raises(ValueError, match="keys 'norm_type', 'options', 'modules'"):
        apply_conversion(_llama(), {"norm_type": "powernorm"})
    with pytest.raises(ValueError, match="module 'model.layers.9.input_layernorm'"):
        apply_conversion(_llama(), {**record, "modules": ["model.layers.9.input_layernorm"]})
    with pytest.raises(ValueError, match="already converted"):
        apply_conversion(model, record)


def test_a_record_without_norms_still_applies():
    """Records written before `norms` existed take size and epsilon from the module."""
    model, _ = build("gpt2")
    record = {k: model.config.powernorm_conversion[k] for k in ("norm_type", "options", "modules")}
    fresh = _gpt2()
    apply_conversion(fresh, record)
    assert {n: (m.hidden_size, m.eps) for n, m in converted_norms(fresh).items()} == {
        n: (m.hidden_size, m.eps) for n, m in converted_norms(model).items()}


@pytest.mark.parametrize("name", ["gpt2", "bart"])
def test_load_converted_takes_a_model_class(name, tmp_path):
    """A model class (`GPT2LMHeadModel`) loads a converted folder as its Auto class does."""
    model, _ = build(name)
    inputs = batch_inputs(name)
    train_step(model, inputs, torch.optim.SGD(model.parameters(), lr=0.1))
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, type(model))
    assert type(loaded) is type(model)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    model.eval()
    torch.testing.assert_close(outputs(loaded, inputs), outputs(model, inputs), atol=0, rtol=0)


def test_load_converted_in_bfloat16_keeps_float32_statistics(tmp_path):
    model, _ = build("llama")
    train_step(model, batch_inputs("llama"), torch.optim.SGD(model.parameters(), lr=0.1))
    model.save_pretrained(tmp_path)
    loaded = hf_powernorm.load_converted(tmp_path, AutoModelForCausalLM, dtype=torch.bfloat16)
    for path, norm in converted_norms(loaded).items():
        assert norm.weight.dtype == torch.bfloat16 and norm.running_phi.dtype == torch.float32, path
        assert torch.equal(norm.running_phi, converted_norms(model)[path].running_phi), path


def test_load_converted_refuses_a_folder_without_conversion(tmp_path):
    _llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no powernorm_conversion"):
        hf_powernorm.load_converted(tmp_path, AutoModelForCausalLM)


# ----------------------------------------------------------------------------------------------
# The causal-model warning


@pytest.mark.parametrize("norm_type,options", [("batchnorm", {}), ("powernorm_v", {}), ("mabn", {}),
                                               ("batchrenorm", {}), ("powernorm", {"warmup_steps": 3})])
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_causal_models_with_position_mixing_norms_warn(name, norm_type, options):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=f"converted to {norm_type} leak future tokens"):
        hf_powernorm.convert_norms(MODELS[name](), norm_type, **options)


@pytest.mark.parametrize("name,norm_type", [("gpt2", "powernorm"), ("llama", "layernorm"), ("bert", "batchnorm"),
                                            ("bert", "powernorm_v")])
def test_no_leak_warning_where_nothing_leaks(name, norm_type):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        hf_powernorm.convert_norms(MODELS[name](), norm_type)
