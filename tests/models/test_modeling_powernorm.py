"""Model tests in the style of Transformers' common tests, on tiny odd-sized configs."""

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

from hf_powernorm import (
    NORM_CLASSES,
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
    PowerNormTransformerModel,
    PowerNormV,
)
from hf_powernorm.modeling_powernorm import GroupScale, RUNNING_BUFFERS
from hf_powernorm.normalization import float32_buffers, running_buffers
from tiny_models import BATCH, SEQ, VOCAB, ids, inputs_for, make_config, make_model

NORMS = sorted(NORM_CLASSES)
HEADS = ["seq2seq", "causal", "classifier"]
AUTO_CLASSES = {
    "seq2seq": AutoModelForSeq2SeqLM,
    "causal": AutoModelForCausalLM,
    "classifier": AutoModelForSequenceClassification,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def train_steps(model, head: str, steps: int = 3) -> None:
    """A few SGD steps so that weights and running statistics are no longer at their initial values."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        loss = model(**inputs_for(head, ids(seed=10 + step), with_labels=True)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def logits(model, head: str, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    return model(**inputs_for(head, input_ids, attention_mask)).logits


# ---------------------------------------------------------------------------------------------
# Shapes, loss, gradients, determinism


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_forward_shapes_loss_and_finite_gradient_for_every_parameter(head, norm):
    model = make_model(head, norm).train()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    out = model(**inputs_for(head, ids(), mask, with_labels=True))
    expected = (BATCH, 3) if head == "classifier" else (BATCH, SEQ, VOCAB)
    assert out.logits.shape == expected
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{name} got a non-finite gradient"
        assert parameter.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_base_model_hidden_states_and_attentions():
    model = PowerNormTransformerModel(make_config(attn_implementation="eager")).eval()
    out = model(input_ids=ids(), decoder_input_ids=ids(seed=2, seq=5), output_hidden_states=True,
                output_attentions=True)
    assert out.last_hidden_state.shape == (BATCH, 5, 32)
    assert out.encoder_last_hidden_state.shape == (BATCH, SEQ, 32)
    assert len(out.encoder_hidden_states) == 3 and len(out.decoder_hidden_states) == 3
    assert out.encoder_attentions[0].shape == (BATCH, 4, SEQ, SEQ)
    assert out.cross_attentions[1].shape == (BATCH, 4, 5, SEQ)


@pytest.mark.parametrize("head", HEADS)
def test_eval_is_deterministic_and_leaves_buffers_alone(head):
    model = make_model(head, "powernorm", dropout=0.3, attention_dropout=0.2)
    train_steps(model, head, steps=1)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    first, second = logits(model, head, ids()), logits(model, head, ids())
    assert torch.equal(first, second)
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())


def test_source_reaches_the_decoder():
    model = make_model("seq2seq")
    train_steps(model, "seq2seq")
    decoder_input_ids = ids(seed=3)
    a = model(input_ids=ids(seed=1), decoder_input_ids=decoder_input_ids).logits
    b = model(input_ids=ids(seed=2), decoder_input_ids=decoder_input_ids).logits
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("norm", ["powernorm", "batchnorm", "layernorm"])
def test_sdpa_and_eager_agree(norm):
    model = make_model("seq2seq", norm)
    train_steps(model, "seq2seq")
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    sdpa = logits(model, "seq2seq", ids(), mask)
    model.config._attn_implementation = "eager"
    eager = logits(model, "seq2seq", ids(), mask)
    torch.testing.assert_close(sdpa, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize_before", [True, False])
def test_pre_and_post_norm_layouts(normalize_before):
    model = make_model("seq2seq", normalize_before=normalize_before)
    layer = model.model.encoder.layers[0]
    assert layer.normalize_before is normalize_before
    assert (model.model.encoder.final_norm is not None) is normalize_before
    out = model(**inputs_for("seq2seq", ids(), with_labels=True))
    assert torch.isfinite(out.loss)


def _record_layer(layer) -> tuple[dict, list]:
    """Hooks that record a layer's arguments, its output, and the output of each of its norms."""
    seen = {}
    handles = [
        layer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(args=args), with_kwargs=True),
        layer.register_forward_hook(lambda module, args, output: seen.update(output=output[0])),
    ]
    for name in ("self_attn_norm", "cross_attn_norm", "ffn_norm"):
        if hasattr(layer, name):
            handles.append(getattr(layer, name).register_forward_hook(
                lambda module, args, output, name=name: seen.update({name: output})))
    return seen, handles


@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("norm", ["powernorm", "layernorm"])
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_every_sublayer_composes_norm_block_and_residual_in_the_configured_order(stack, norm, normalize_before):
    """Post-norm: `norm(x + block(x))`; pre-norm: `x + block(norm(x))`, for self-attention,
    cross-attention and feed-forward, rebuilt by hand from the layer's own submodules."""
    model = make_model("seq2seq", norm, normalize_before=normalize_before, attn_implementation="eager")
    train_steps(model, "seq2seq")  # trained weights and running statistics, then eval
    layer = getattr(model.model, stack).layers[1]
    seen, handles = _record_layer(layer)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    with torch.no_grad():
        model(**inputs_for("seq2seq", ids(), mask), use_cache=False)
        for handle in handles:
            handle.remove()
        if stack == "encoder":
            hidden_states, attn_mask, padding_mask = seen["args"]
            blocks = [("self_attn_norm", lambda h: layer.self_attn(h, attention_mask=attn_mask)[0])]
        else:
            hidden_states, attn_mask, encoder_hidden_states, cross_mask, padding_mask = seen["args"]
            blocks = [
                ("self_attn_norm", lambda h: layer.self_attn(h, attention_mask=attn_mask)[0]),
                ("cross_attn_norm", lambda h: layer.encoder_attn(h, attention_mask=cross_mask,
                                                                 key_value_states=encoder_hidden_states)[0]),
            ]
        blocks.append(("ffn_norm", layer.ffn))
        expected = hidden_states
        for name, block in blocks:
            norm_module = getattr(layer, name)
            if normalize_before:
                normed = norm_module(expected, padding_mask)
                torch.testing.assert_close(seen[name], normed, atol=1e-6, rtol=1e-6, msg=name)
                expected = expected + block(normed)
            else:
                expected = norm_module(expected + block(expected), padding_mask)
                torch.testing.assert_close(seen[name], expected, atol=1e-6, rtol=1e-6, msg=name)
    assert len(blocks) == (3 if stack == "decoder" else 2)
    torch.testing.assert_close(seen["output"], expected, atol=1e-6, rtol=1e-6)


def test_norm_placement_follows_the_config():
    model = make_model("seq2seq", encoder_norm_type="powernorm", decoder_norm_type="layernorm",
                       powernorm_group_num=2, powernorm_alpha_fwd=0.95, powernorm_warmup_steps=5)
    encoder_layer, decoder_layer = model.model.encoder.layers[0], model.model.decoder.layers[1]
    for norm in (encoder_layer.self_attn_norm, encoder_layer.ffn_norm, model.model.encoder.final_norm):
        assert type(norm).__name__ == "PowerNorm"
        assert (norm.group_num, norm.alpha_fwd, norm.warmup_steps) == (2, 0.95, 5)
    for norm in (decoder_layer.self_attn_norm, decoder_layer.cross_attn_norm, decoder_layer.ffn_norm):
        assert type(norm).__name__ == "LayerNorm"


def test_tied_embeddings_and_untied_option():
    tied = make_model("seq2seq")
    embedding = tied.model.encoder.embeddings.embed_tokens.weight
    assert tied.lm_head.weight is embedding
    assert tied.model.decoder.embeddings.embed_tokens.weight is embedding
    untied = make_model("seq2seq", tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.encoder.embeddings.embed_tokens.weight


@pytest.mark.parametrize("borrowed", [False, True])
def test_only_a_pad_of_its_own_is_an_untrained_zero_row(borrowed):
    """A pad id of its own is the embedding's padding row (zero, untrained by its lookups); a pad
    borrowed from the end token (a tokenizer without a pad, as run_clm pads) is not: that token's row
    learns from its use as an input, even with an untied head."""
    pad, eos = (2, 2) if borrowed else (1, 2)
    model = make_model("causal", "layernorm", pad_token_id=pad, eos_token_id=eos, tie_word_embeddings=False)
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == (None if borrowed else pad)
    assert (embedding.weight[eos].abs().sum() > 0) and (embedding.weight[pad].abs().sum() > 0) == borrowed
    tokens = ids()
    tokens[:, 3] = eos
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert embedding.weight.grad[eos].abs().sum() > 0  # the end token's row learns from its use as an input


def test_learned_positions_reject_too_long_inputs():
    model = make_model("causal", position_embedding_type="learned", max_position_embeddings=8).eval()
    assert model(input_ids=ids(seq=8)).logits.shape == (BATCH, 8, VOCAB)
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(input_ids=ids(seq=9))


# ---------------------------------------------------------------------------------------------
# Padding


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_padding_never_changes_a_real_tokens_output(head, norm):
    """Training mode (batch statistics in use: PN during warmup, PN-V, BN) and eval mode."""
    model = make_model(head, norm, powernorm_warmup_steps=10)
    train_steps(model, head, steps=1)
    input_ids = ids()
    padded = torch.cat([input_ids, torch.full((BATCH, 4), 1)], dim=1)
    mask = torch.cat([torch.ones(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, 4, dtype=torch.long)], dim=1)
    # Different garbage in the padding must not matter either.
    padded[:, SEQ:] = ids(seed=5, seq=4)
    for training in (True, False):
        reference, candidate = copy.deepcopy(model).train(training), copy.deepcopy(model).train(training)
        expected = logits(reference, head, input_ids)
        got = logits(candidate, head, padded, mask)
        got = got if head == "classifier" else got[:, :SEQ]
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        for (name, a), (_, b) in zip(reference.named_buffers(), candidate.named_buffers()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{name} saw the padding")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("norm", NORMS)
def test_left_padded_causal_batch_matches_unpadded(norm, attn):
    model = make_model("causal", norm, attn_implementation=attn)
    train_steps(model, "causal")
    input_ids = ids()
    lengths = [SEQ, SEQ - 2, SEQ - 4]
    padded = torch.full((BATCH, SEQ), 1)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, length in enumerate(lengths):
        padded[row, SEQ - length:] = input_ids[row, :length]
        mask[row, SEQ - length:] = 1
    batch_logits = model(input_ids=padded, attention_mask=mask).logits
    for row, length in enumerate(lengths):
        alone = model(input_ids=input_ids[row:row + 1, :length]).logits[0]
        torch.testing.assert_close(batch_logits[row, SEQ - length:], alone, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Causal models and batch statistics


def _earlier_outputs_change(model, warm_forwards: int) -> bool:
    """Change the last token; do the training-mode outputs of earlier positions change?"""
    model.train()
    for step in range(warm_forwards):
        model(input_ids=ids(seed=20 + step))
    input_ids = ids()
    changed = input_ids.clone()
    changed[:, -1] = (changed[:, -1] + 7) % VOCAB
    a = copy.deepcopy(model)(input_ids=input_ids).logits[:, :-1]
    b = copy.deepcopy(model)(input_ids=changed).logits[:, :-1]
    return not torch.allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm", [n for n in NORMS
                                  if NORM_CLASSES[n].mixes_positions and not NORM_CLASSES[n].mixing_options])
def test_batch_statistics_leak_future_tokens_in_a_causal_model(norm):
    assert _earlier_outputs_change(make_model("causal", norm), warm_forwards=3)


def test_powernorm_leaks_during_warmup_only():
    model = make_model("causal", "powernorm", powernorm_warmup_steps=2)
    assert _earlier_outputs_change(copy.deepcopy(model), warm_forwards=0)
    assert not _earlier_outputs_change(model, warm_forwards=2)


@pytest.mark.parametrize("norm", [n for n in NORMS if not NORM_CLASSES[n].mixes_positions])
def test_per_token_norms_never_leak(norm):
    assert not _earlier_outputs_change(make_model("causal", norm), warm_forwards=0)


# ---------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("norm", ["powernorm", "batchnorm", "layernorm", "powernorm_v"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_seq2seq_generation_with_and_without_cache(norm, num_beams):
    model = make_model("seq2seq", norm)
    train_steps(model, "seq2seq")
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[2, -3:] = 0
    options = dict(attention_mask=mask, max_new_tokens=6, num_beams=num_beams, do_sample=False,
                   length_penalty=0.6, return_dict_in_generate=True, output_scores=True)
    cached = model.generate(ids(), use_cache=True, **options)
    uncached = model.generate(ids(), use_cache=False, **options)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert cached.sequences.shape[1] > 1
    assert (cached.sequences[:, 0] == model.config.decoder_start_token_id).all()
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_post_norm_seq2seq_generation_with_and_without_cache(num_beams):
    model = make_model("seq2seq", "powernorm", normalize_before=False)
    train_steps(model, "seq2seq")
    options = dict(max_new_tokens=6, num_beams=num_beams, do_sample=False)
    assert torch.equal(model.generate(ids(), use_cache=True, **options),
                       model.generate(ids(), use_cache=False, **options))


@pytest.mark.parametrize("norm", ["powernorm", "rmsnorm"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_causal_generation_with_and_without_cache(norm, num_beams):
    model = make_model("causal", norm)
    train_steps(model, "causal")
    options = dict(max_new_tokens=6, num_beams=num_beams, do_sample=False, eos_token_id=None)
    cached = model.generate(ids(seq=4), use_cache=True, **options)
    uncached = model.generate(ids(seq=4), use_cache=False, **options)
    assert cached.shape == (BATCH, 10)
    assert torch.equal(cached, uncached)


def test_left_padded_causal_generation_matches_each_prompt_alone():
    model = make_model("causal", "powernorm")
    train_steps(model, "causal")
    prompts = [ids(seed=1, batch=1, seq=5)[0], ids(seed=2, batch=1, seq=3)[0]]
    padded = torch.full((2, 5), 1)
    mask = torch.zeros(2, 5, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, 5 - len(prompt):], mask[row, 5 - len(prompt):] = prompt, 1
    batch = model.generate(padded, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=5, do_sample=False, eos_token_id=None)
        assert torch.equal(batch[row, 5:], alone[0, len(prompt):])


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _buffers(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.named_buffers() if k.rsplit(".", 1)[-1] in RUNNING_BUFFERS}


@pytest.mark.parametrize("norm", ["powernorm", "powernorm_v", "batchnorm", "layernorm"])
@pytest.mark.parametrize("head", HEADS)
def test_save_and_load_give_identical_buffers_and_outputs(head, norm, tmp_path):
    model = make_model(head, norm, powernorm_warmup_steps=2)
    train_steps(model, head)
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    buffers = _buffers(model)
    assert bool(buffers) == (norm != "layernorm")
    for name, buffer in buffers.items():
        assert name in stored, f"{name} is not in model.safetensors"
        assert torch.equal(stored[name], buffer)
    loaded = AUTO_CLASSES[head].from_pretrained(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    for name, buffer in _buffers(loaded).items():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, dict(model.named_parameters())[name]), name
    assert torch.equal(logits(loaded, head, ids()), logits(model, head, ids()))


@pytest.mark.parametrize("head", HEADS)
def test_bfloat16_loading_keeps_running_statistics_float32(head, tmp_path):
    model = make_model(head, "powernorm", decoder_norm_type="batchnorm")
    train_steps(model, head)
    model.save_pretrained(tmp_path)
    loaded = AUTO_CLASSES[head].from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.get_input_embeddings().weight.dtype == torch.bfloat16
    for name, buffer in _buffers(model).items():
        got = dict(loaded.named_buffers())[name]
        assert got.dtype == buffer.dtype, f"{name} became {got.dtype}"
        assert torch.equal(got, buffer), name
    out = logits(loaded, head, ids())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # Each loaded norm maps a float32 input as the trained one does with its weight and bias rounded
    # to bfloat16: to float32 precision, which a running statistic rounded to bfloat16 (relative error
    # up to 2**-9) would break.
    trained = dict(model.named_modules())
    x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(3))
    checked = 0
    for name, norm in loaded.named_modules():
        if not hasattr(norm, "affine_after_group_scale"):
            continue
        reference = copy.deepcopy(trained[name]).eval()
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).float())
        torch.testing.assert_close(norm(x), reference(x), atol=1e-6, rtol=1e-6, msg=name)
        checked += 1
    assert checked == {"seq2seq": 12, "causal": 5, "classifier": 5}[head]


def test_loading_a_checkpoint_without_buffers_warns_by_name_and_initialises_them(tmp_path):
    model = make_model("seq2seq", "powernorm", decoder_norm_type="batchnorm")
    train_steps(model, "seq2seq")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k.rsplit(".", 1)[-1] not in RUNNING_BUFFERS},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"model\.encoder\.layers\.0\.self_attn_norm\.running_phi") as record:
        loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    message = str(record[0].message)
    assert "running_nu" in message and "running_var" in message and "num_batches_tracked" in message
    initial = {"running_phi": 1.0, "running_nu": 0.0, "running_mean": 0.0, "running_var": 1.0,
               "num_batches_tracked": 0}
    for name, buffer in _buffers(loaded).items():
        assert torch.equal(buffer, torch.full_like(buffer, initial[name.rsplit(".", 1)[-1]])), name
    # Loaded weights are the trained ones.
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


class PeakNorm(PowerNormV):
    """A throwaway norm of the registry with a buffer no other norm has, starting at a value neither 0
    nor 1 (it tracks nothing: the model must carry it whatever it holds)."""

    _running_buffers = {**PowerNormV._running_buffers, "running_peak": 0.25}

    def forward(self, hidden_states, attention_mask=None):
        if self.training:
            with torch.no_grad():
                self.running_peak.copy_(torch.maximum(self.running_peak, hidden_states.detach().abs().reshape(-1, self.hidden_size).amax(0)))
        return super().forward(hidden_states, attention_mask)


def test_a_registered_norm_with_a_new_buffer_needs_nothing_else(monkeypatch, tmp_path):
    """One class and one registry line: the model family builds it, initialises its new buffer, keeps
    it float32, saves and reloads it, and warns about it by name when a checkpoint lacks it."""
    monkeypatch.setitem(NORM_CLASSES, "peak_norm", PeakNorm)
    assert running_buffers()["running_peak"] == 0.25 and "running_peak" in float32_buffers()
    model = make_model("seq2seq", "PeakNorm", decoder_norm_type="layernorm")
    assert model.config.encoder_norm_type == "peak_norm"
    peaks = {k: v for k, v in model.named_buffers() if k.endswith("running_peak")}
    assert len(peaks) == 5 and all(torch.equal(v, torch.full((32,), 0.25)) for v in peaks.values())
    train_steps(model, "seq2seq")
    trained = {k: v.clone() for k, v in model.named_buffers() if k.endswith("running_peak")}
    assert all(v.max() > 0.25 for v in trained.values())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    for name, value in trained.items():
        assert torch.equal(dict(loaded.named_buffers())[name], value), name
    assert torch.equal(logits(loaded, "seq2seq", ids()), logits(model, "seq2seq", ids()))
    half = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(dict(half.named_buffers())[name].dtype == torch.float32 for name in trained)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith("running_peak")}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"self_attn_norm\.running_peak.*running_peak=0\.25") as record:
        bare = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert "running_phi" not in str(record[0].message).split(";")[0]  # only what is missing is named
    for name in trained:  # built on the meta device: the value comes from the model's initialisation
        assert torch.equal(dict(bare.named_buffers())[name], torch.full((32,), 0.25)), name
        assert torch.equal(dict(bare.named_buffers())[name.replace("peak", "phi")],
                           dict(model.named_buffers())[name.replace("peak", "phi")])


def test_translation_checkpoint_loads_its_encoder_into_the_classifier(tmp_path):
    model = make_model("seq2seq")
    train_steps(model, "seq2seq")
    model.save_pretrained(tmp_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert isinstance(classifier, PowerNormTransformerForSequenceClassification)
    expected = model.model.encoder.state_dict()
    for name, tensor in classifier.model.encoder.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


# ---------------------------------------------------------------------------------------------
# Folding norms for inference


@pytest.mark.parametrize("encoder_norm, decoder_norm, folded", [
    ("powernorm", "layernorm", 4), ("powernorm", "powernorm", 10), ("batchnorm", "powernorm_v", 10),
])
@pytest.mark.parametrize("head", HEADS)
def test_fold_norms_keeps_outputs_and_reloads(head, encoder_norm, decoder_norm, folded, tmp_path):
    model = make_model(head, encoder_norm_type=encoder_norm, decoder_norm_type=decoder_norm)
    train_steps(model, head)
    with torch.no_grad():  # make every affine map non-trivial
        for module in model.modules():
            if hasattr(module, "affine_after_group_scale"):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.5)
    embedding = model.get_input_embeddings().weight.detach().clone()
    expected = logits(model, head, ids())
    expected_count = {"seq2seq": folded, "causal": 0 if decoder_norm == "layernorm" else 4, "classifier": 4}[head]
    if expected_count == 0:
        with pytest.raises(ValueError, match="no foldable norm"):
            model.fold_norms()
        return
    count = model.fold_norms()
    assert count == expected_count
    assert model.config.norms_folded
    assert sum(isinstance(m, GroupScale) for m in model.modules()) == count
    torch.testing.assert_close(logits(model, head, ids()), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    if head != "classifier":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    loaded = AUTO_CLASSES[head].from_pretrained(tmp_path)
    assert loaded.config.norms_folded
    torch.testing.assert_close(logits(loaded, head, ids()), expected, atol=1e-5, rtol=1e-5)


def test_fold_norms_refuses_what_it_cannot_fold():
    with pytest.raises(ValueError, match="normalize_before"):
        make_model("seq2seq", normalize_before=False).fold_norms()
    with pytest.raises(ValueError, match="no foldable norm"):
        make_model("seq2seq", "layernorm").fold_norms()
    model = make_model("seq2seq")
    model.eval().fold_norms()
    with pytest.raises(ValueError, match="already folded"):
        model.fold_norms()


# ---------------------------------------------------------------------------------------------
# Initialisation and activation checkpointing


@pytest.mark.parametrize("norm", NORMS)
def test_init_weights_resets_every_norm_parameter_and_buffer(norm):
    model = make_model("seq2seq", norm)
    train_steps(model, "seq2seq")
    norms = [m for m in model.modules() if type(m).__name__ in {c.__name__ for c in NORM_CLASSES.values()}]
    assert norms
    initial = {"weight": 1.0, "bias": 0.0, "running_phi": 1.0, "running_nu": 0.0, "running_mean": 0.0,
               "running_var": 1.0, "num_batches_tracked": 0}
    for module in norms:
        with torch.no_grad():
            for name in initial:
                if getattr(module, name, None) is not None:
                    getattr(module, name).fill_(7)
        model._init_weights(module)
        for name, value in initial.items():
            tensor = getattr(module, name, None)
            if tensor is not None:
                assert torch.equal(tensor, torch.full_like(tensor, value)), (type(module).__name__, name)


def test_activation_checkpointing_updates_running_statistics_once_per_step():
    model = make_model("seq2seq", "powernorm", decoder_norm_type="batchnorm").train()
    # Transformers 5.23 renamed gradient_checkpointing_enable; 5.17 has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model(**inputs_for("seq2seq", ids(), with_labels=True)).loss.backward()
    counters = [m.num_batches_tracked for m in model.modules() if hasattr(m, "num_batches_tracked")]
    assert counters and all(int(c) == 1 for c in counters)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("norm", ["powernorm", "batchnorm", "powernorm_v"])
def test_ignored_labels_are_padding_for_the_decoder_norms(norm):
    """With labels only, decoder positions fed from -100 labels stay out of the batch statistics."""
    model = make_model("seq2seq", "layernorm", decoder_norm_type=norm, powernorm_warmup_steps=10).train()
    input_ids, labels = ids(), ids(seed=4, seq=5)
    padded_labels = torch.cat([labels, torch.full((BATCH, 3), -100)], dim=1)
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    expected = reference(input_ids=input_ids, labels=labels)
    got = candidate(input_ids=input_ids, labels=padded_labels)
    torch.testing.assert_close(got.logits[:, :5], expected.logits, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads", [1, 2, 8])
@pytest.mark.parametrize("head", HEADS)
def test_attention_head_counts_and_group_scaling_follow_them(head, num_heads):
    """The attention weights are those of `num_heads` heads of `hidden / num_heads` channels, and
    each of the `num_heads` channel groups of a PN output has a root mean square of 1 up to the
    epsilons (fresh norm: weight 1, bias 0, running_phi 1, so the eval output is the group scaling)."""
    model = make_model(head, "powernorm", num_attention_heads=num_heads, attn_implementation="eager")
    assert model.config.powernorm_group_num == num_heads
    layer = model.model.encoder.layers[0] if head != "causal" else model.model.decoder.layers[0]
    assert layer.ffn_norm.group_num == num_heads
    seen = {}
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda module, args: seen.update(attn_input=args[0])),
        layer.self_attn.register_forward_hook(lambda module, args, output: seen.update(weights=output[1])),
        layer.ffn_norm.register_forward_hook(
            lambda module, args, output: seen.update(norm_in=args[0], norm_out=output)),
    ]
    with torch.no_grad():
        model.eval()(**inputs_for(head, ids()))
    for handle in handles:
        handle.remove()
    x, attention = seen["attn_input"].double(), layer.self_attn
    head_dim = 32 // num_heads
    query, key = (torch.nn.functional.linear(x, proj.weight.double(), proj.bias.double())
                  .view(BATCH, SEQ, num_heads, head_dim).transpose(1, 2)
                  for proj in (attention.q_proj, attention.k_proj))
    scores = query @ key.transpose(-1, -2) / head_dim**0.5  # (batch, heads, seq, seq)
    if head == "causal":
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    assert seen["weights"].shape == (BATCH, num_heads, SEQ, SEQ)
    torch.testing.assert_close(seen["weights"].double(), scores.softmax(-1), atol=1e-6, rtol=1e-5)
    group_rms = seen["norm_out"].double().view(BATCH, SEQ, num_heads, head_dim).square().mean(-1).sqrt()
    # 1, but for the two epsilons: sqrt(ms / (ms + 1e-5)) / sqrt(1 + eps), ms the group's input mean square.
    input_ms = seen["norm_in"].double().view(BATCH, SEQ, num_heads, head_dim).square().mean(-1)
    expected = (input_ms / (input_ms + 1e-5)).sqrt() / (1 + model.config.norm_eps) ** 0.5
    assert (expected - 1).abs().max() < 0.02
    torch.testing.assert_close(group_rms, expected, atol=1e-5, rtol=0)
    model.train()
    out = model(**inputs_for(head, ids(), with_labels=True))
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("head", HEADS)
def test_resize_token_embeddings_keeps_ties(head):
    model = make_model(head)
    model.resize_token_embeddings(VOCAB + 6)
    embedding = model.get_input_embeddings().weight
    assert embedding.shape == (VOCAB + 6, 32) and model.config.vocab_size == VOCAB + 6
    if head != "classifier":
        assert model.get_output_embeddings().weight is embedding
    if head == "seq2seq":
        assert model.model.decoder.get_input_embeddings().weight is embedding
    out = model.eval()(**inputs_for(head, torch.full((2, 4), VOCAB + 5)))
    assert torch.isfinite(out.logits).all()


def test_importing_the_package_registers_every_auto_class():
    import transformers

    assert isinstance(transformers.AutoConfig.for_model("powernorm_transformer"), PowerNormTransformerConfig)
    expected = {
        "AutoModel": PowerNormTransformerModel,
        "AutoModelForSeq2SeqLM": PowerNormTransformerForConditionalGeneration,
        "AutoModelForCausalLM": PowerNormTransformerForCausalLM,
        "AutoModelForSequenceClassification": PowerNormTransformerForSequenceClassification,
    }
    for auto_name, model_class in expected.items():
        assert type(getattr(transformers, auto_name).from_config(make_config())) is model_class, auto_name


@pytest.mark.parametrize("head", ["seq2seq", "causal"])
def test_incremental_decoding_with_a_cache_matches_the_full_forward(head):
    from transformers import DynamicCache, EncoderDecoderCache

    model = make_model(head, "powernorm", decoder_norm_type="powernorm")
    train_steps(model, head)
    tokens = ids(seed=6, seq=6)
    if head == "seq2seq":
        cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        extra, key = {"input_ids": ids()}, "decoder_input_ids"
    else:
        cache, extra, key = DynamicCache(config=model.config), {}, "input_ids"
    full = model(**extra, **{key: tokens}).logits
    pieces = []
    for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6)):
        out = model(**extra, **{key: tokens[:, start:stop]}, past_key_values=cache, use_cache=True)
        assert out.past_key_values is cache
        pieces.append(out.logits)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_casting_to_bfloat16_keeps_running_statistics_float32():
    model = make_model("seq2seq", "powernorm", decoder_norm_type="batchnorm")
    train_steps(model, "seq2seq")
    before = {k: v.clone() for k, v in _buffers(model).items()}
    model.to(torch.bfloat16)
    for name, buffer in _buffers(model).items():
        assert buffer.dtype == before[name].dtype and torch.equal(buffer, before[name]), name
    assert torch.isfinite(logits(model, "seq2seq", ids())).all()


# ---------------------------------------------------------------------------------------------
# Bad inputs are refused before any statistic moves


def _assert_refused(model, pattern: str, **batch) -> None:
    before = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(ValueError, match=pattern):
        model(**batch)
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())


@pytest.mark.parametrize("head, key, shape, expected", [
    ("seq2seq", "decoder_attention_mask", (BATCH, 3), r"decoder_attention_mask must have shape \(3, 2\).*\(3, 3\)"),
    ("seq2seq", "attention_mask", (BATCH, SEQ + 1), r"attention_mask must have shape \(3, 7\).*\(3, 8\)"),
    ("causal", "attention_mask", (BATCH, 6), r"attention_mask must have shape \(3, 4\).*\(3, 6\)"),
    ("classifier", "attention_mask", (BATCH, SEQ - 2), r"attention_mask must have shape \(3, 7\).*\(3, 5\)"),
])
def test_a_mask_of_the_wrong_length_is_refused_naming_it(head, key, shape, expected):
    model = make_model(head, decoder_norm_type="powernorm").train()
    batch = {"input_ids": ids(seq=4 if head == "causal" else SEQ)}
    if head == "seq2seq":
        batch["decoder_input_ids"] = ids(seed=2, seq=2)
    batch[key] = torch.ones(shape, dtype=torch.long)
    _assert_refused(model, expected, **batch)


@pytest.mark.parametrize("value", [2.0, -1.0, float("nan")])
@pytest.mark.parametrize("head, key", [("seq2seq", "decoder_attention_mask"), ("seq2seq", "attention_mask"),
                                       ("causal", "attention_mask"), ("classifier", "attention_mask")])
def test_mask_values_other_than_zero_and_one_are_refused(head, key, value):
    model = make_model(head, decoder_norm_type="powernorm").train()
    batch = inputs_for(head, ids(), torch.ones(BATCH, SEQ))
    batch[key] = torch.ones(BATCH, SEQ)
    batch[key][1, 2] = value
    _assert_refused(model, rf"{key} must hold only 0 \(padding\) and 1 \(real token\), got the values "
                           rf"\[{value}\]", **batch)


def test_a_mask_with_the_cached_tokens_is_accepted_during_generation():
    model = make_model("causal").eval()
    out = model.generate(ids(seq=4), attention_mask=torch.ones(BATCH, 4, dtype=torch.long), max_new_tokens=3,
                         do_sample=False)
    assert out.shape == (BATCH, 7)


# ---------------------------------------------------------------------------------------------
# The decoder's padding without a decoder mask


def test_collator_batches_without_a_decoder_mask_equal_the_labels_path():
    from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                        pad_token="t1", eos_token="t2", bos_token="t0", unk_token="t3")
    model = make_model("seq2seq", "layernorm", decoder_norm_type="powernorm", powernorm_warmup_steps=10).train()
    features = [{"input_ids": ids(seed=s, batch=1, seq=n)[0].tolist(),
                 "labels": ids(seed=s + 5, batch=1, seq=m)[0].tolist() + [2]}
                for s, n, m in ((1, 7, 5), (2, 4, 2), (3, 6, 3))]
    batch = DataCollatorForSeq2Seq(tokenizer, model=model)(features)
    assert "decoder_input_ids" in batch and "decoder_attention_mask" not in batch
    reference, candidate = copy.deepcopy(model), copy.deepcopy(model)
    expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    got = candidate(**batch)
    torch.testing.assert_close(got.logits, expected.logits)
    for (name, buffer), other in zip(candidate.named_buffers(), reference.buffers()):
        torch.testing.assert_close(buffer, other, msg=name)
    # Without labels, trailing pad tokens of the decoder inputs are its padding (the start token is not).
    no_labels = copy.deepcopy(model)
    decoder_input_ids = batch["decoder_input_ids"]
    mask = torch.ones_like(decoder_input_ids)
    mask[1, 4:], mask[2, 5:] = 0, 0
    assert torch.equal(decoder_input_ids[mask == 0], torch.full(((mask == 0).sum(),), 1))
    explicit = copy.deepcopy(model)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    decoder_input_ids=decoder_input_ids, decoder_attention_mask=mask)
    derived = no_labels(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=decoder_input_ids)
    torch.testing.assert_close(derived.logits, explicit.logits)


def test_a_start_token_equal_to_the_pad_token_is_not_padding():
    from hf_powernorm.modeling_powernorm import decoder_padding_mask

    tokens = torch.tensor([[1, 5, 1, 6, 1, 1], [1, 7, 8, 9, 4, 5]])
    assert torch.equal(decoder_padding_mask(tokens, 1), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]))
    assert decoder_padding_mask(tokens[1:], 1) is None


# ---------------------------------------------------------------------------------------------
# Static cache


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("head", ["seq2seq", "causal"])
def test_static_cache_generation_equals_the_dynamic_cache(head, num_beams):
    model = make_model(head, "powernorm", decoder_norm_type="powernorm")
    train_steps(model, head)
    input_ids = ids(seed=8, seq=6)
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0  # left padding: the positions and the attention mask must follow it
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=num_beams,
                   return_dict_in_generate=True, output_scores=True, pad_token_id=1)
    dynamic = model.generate(input_ids, **options)
    static = model.generate(input_ids, cache_implementation="static", **options)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# AutoModel of each checkpoint kind


@pytest.mark.parametrize("head", HEADS)
def test_auto_model_of_each_checkpoint_is_its_own_base_model_with_hidden_states(head, tmp_path, recwarn):
    from transformers import AutoModel

    model = make_model(head, "powernorm", decoder_norm_type="powernorm")
    train_steps(model, head)
    model.save_pretrained(tmp_path)
    base, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(base) is PowerNormTransformerModel
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert not [w for w in recwarn if "running statistics" in str(w.message)]
    assert ((base.encoder is not None), (base.decoder is not None)) == {
        "seq2seq": (True, True), "causal": (False, True), "classifier": (True, False)}[head]
    input_ids, mask = ids(), torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    batch = inputs_for(head, input_ids, mask)
    with torch.no_grad():
        out = base.eval()(**batch, output_hidden_states=True)
        stack = model.model if head == "seq2seq" else model.model.decoder if head == "causal" else model.model.encoder
        expected = stack(**{k: v for k, v in batch.items() if head == "seq2seq" or not k.startswith("decoder")})
    assert out.last_hidden_state.shape == (BATCH, SEQ, 32)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state)
    hidden_states = out.decoder_hidden_states if head == "seq2seq" else out.hidden_states
    assert len(hidden_states) == 3


def test_a_classifier_config_saved_as_encoder_decoder_still_builds_the_encoder_only_base():
    config = make_config(architectures=["PowerNormTransformerForSequenceClassification"])
    assert config.is_encoder_decoder
    base = PowerNormTransformerModel(config)
    assert base.encoder is not None and base.decoder is None
    # A head builds the stacks it needs whatever the config's architectures say.
    seq2seq = PowerNormTransformerForConditionalGeneration(config)
    assert seq2seq.model.encoder is not None and seq2seq.model.decoder is not None


# ---------------------------------------------------------------------------------------------
# A config that disagrees with its weights


def _edit_config(directory, **changes) -> None:
    import json

    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, saved, position", [
    (dict(encoder_norm_type="layernorm"), {}, "model.encoder.layers.0.self_attn_norm"),
    (dict(encoder_norm_type="batchnorm"), {}, "model.encoder.final_norm"),
    (dict(decoder_norm_type="rmsnorm"), {}, "model.decoder.layers.1.ffn_norm"),
    (dict(norms_folded=True), {}, "model.encoder.layers.1.ffn_norm"),
    (dict(norms_folded=False), dict(folded=True), "model.encoder.layers.0.self_attn_norm"),
])
def test_a_config_that_disagrees_with_the_weights_refuses_to_load(changes, saved, position, tmp_path):
    model = make_model("seq2seq", "powernorm", decoder_norm_type="layernorm")
    if saved.get("folded"):
        model.eval().fold_norms()
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=r"config\.json disagrees with the weights at the norm positions") as error:
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    message = str(error.value)
    assert f"'{position}'" in message and f"{position}: config builds" in message, message
    for field, value in changes.items():
        assert f"{field}={value!r}" in message, message


def test_dropout_of_the_model_keeps_1_minus_p_scaled_and_routes_its_gradient_through_the_mask():
    """The CPU mask (uniform numbers >= p): the kept fraction is 1 - p, kept values are scaled by
    1 / (1 - p), the gradient is the same mask; the same seed gives the same mask; nothing is dropped
    in eval or at p = 0."""
    from hf_powernorm.modeling_powernorm import apply_dropout

    x = torch.randn(64, 256, requires_grad=True)
    torch.manual_seed(3)
    y = apply_dropout(x, 0.3, training=True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(y[kept], x[kept] / 0.7)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / 0.7)
    torch.manual_seed(3)
    assert torch.equal(apply_dropout(x, 0.3, training=True) != 0, kept)
    assert apply_dropout(x, 0.3, training=False) is x and apply_dropout(x, 0.0, training=True) is x
    assert (apply_dropout(x, 1.0, training=True) == 0).all()
    half = apply_dropout(torch.ones(256, 1024, dtype=torch.bfloat16), 0.3, training=True)
    assert half.dtype == torch.bfloat16 and abs((half != 0).float().mean().item() - 0.7) < 0.003
