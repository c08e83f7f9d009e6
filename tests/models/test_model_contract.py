"""The model contract of Transformers' own common tests (`ModelTesterMixin`, `GenerationTesterMixin`),
written for this family: every head, with LayerNorm, PN and BatchNorm.

Where the family deliberately differs from a Transformers convention, the test says why.
"""

import pytest
import torch
from safetensors.torch import load_file

from hf_powernorm import (
    NORM_CLASSES,
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
    PowerNormTransformerForSequenceClassification,
)
from hf_powernorm.modeling_powernorm import _CACHE_FIELD, PowerNormTransformerPreTrainedModel

BATCH, SEQ, VOCAB, LAYERS, HEADS_ = 2, 6, 99, 2, 4
NORMS = ["layernorm", "powernorm", "batchnorm"]
HEADS = ["seq2seq", "causal", "classifier"]
GENERATIVE = ["seq2seq", "causal"]
HEAD_CLASSES = {
    "seq2seq": PowerNormTransformerForConditionalGeneration,
    "causal": PowerNormTransformerForCausalLM,
    "classifier": PowerNormTransformerForSequenceClassification,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(head: str, norm: str, seed: int = 0, train: bool = True, **overrides):
    """A tiny model whose weights and running statistics have left their initial values."""
    options = dict(encoder_norm_type=norm, decoder_norm_type=norm, num_labels=3, attn_implementation="eager",
                   powernorm_warmup_steps=1)
    options.update(overrides)
    torch.manual_seed(seed)
    model = HEAD_CLASSES[head](PowerNormTransformerConfig.from_preset("tiny", **options))
    if train:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model.train()
        for step in range(3):
            model(**batch_for(head, ids(seed=10 + step), labels=True)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.eval()


def ids(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def batch_for(head: str, input_ids: torch.Tensor, labels: bool = False) -> dict:
    mask = torch.ones_like(input_ids)
    mask[0, -2:] = 0
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if head == "seq2seq":
        batch["decoder_input_ids"] = torch.cat([torch.full_like(input_ids[:, :1], 2), input_ids[:, :-1]], dim=1)
    if labels:
        batch["labels"] = torch.arange(input_ids.shape[0]) % 3 if head == "classifier" else input_ids
    return batch


def hidden_keys(head: str) -> list[str]:
    return ["encoder_hidden_states", "decoder_hidden_states"] if head == "seq2seq" else ["hidden_states"]


def attention_keys(head: str) -> list[str]:
    return ["encoder_attentions", "decoder_attentions", "cross_attentions"] if head == "seq2seq" else ["attentions"]


# ---------------------------------------------------------------------------------------------
# Outputs: config flags, keywords, tuples


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_output_flags_come_from_the_config_unless_a_keyword_overrides_them(head, norm):
    model = make_model(head, norm)
    batch = batch_for(head, ids())
    with torch.no_grad():
        plain = model(**batch)
        assert all(plain[key] is None if key in plain else True for key in hidden_keys(head) + attention_keys(head))
        model.config.output_hidden_states = True
        model.config.output_attentions = True
        flagged = model(**batch)
        for key in hidden_keys(head) + attention_keys(head):
            assert getattr(flagged, key) is not None, key
        overridden = model(**batch, output_hidden_states=False, output_attentions=False)
        for key in hidden_keys(head) + attention_keys(head):
            assert getattr(overridden, key) is None, key
    torch.testing.assert_close(flagged.logits, plain.logits)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_return_dict_false_returns_the_model_outputs_tuple(head, norm):
    model = make_model(head, norm)
    batch = dict(batch_for(head, ids(), labels=True), use_cache=False)
    with torch.no_grad():
        output = model(**batch, output_hidden_states=True)
        as_tuple = model(**batch, output_hidden_states=True, return_dict=False)
        model.config.return_dict = False
        from_config = model(**batch, output_hidden_states=True)
        forced = model(**batch, output_hidden_states=True, return_dict=True)
    assert isinstance(as_tuple, tuple) and isinstance(from_config, tuple)
    assert not isinstance(forced, tuple) and forced.logits is not None
    expected = output.to_tuple()
    for got in (as_tuple, from_config):
        assert len(got) == len(expected)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("head", HEADS)
def test_attention_and_hidden_state_shapes(head):
    model = make_model(head, "powernorm")
    batch = batch_for(head, ids())
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True, output_attentions=True)
    for key in hidden_keys(head):
        states = getattr(out, key)
        assert len(states) == LAYERS + 1, key  # the embeddings, then each layer's output
        assert all(s.shape == (BATCH, SEQ, 32) for s in states), key
    for key in attention_keys(head):
        weights = getattr(out, key)
        assert len(weights) == LAYERS, key
        assert all(w.shape == (BATCH, HEADS_, SEQ, SEQ) for w in weights), key
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(BATCH, HEADS_, SEQ))


# ---------------------------------------------------------------------------------------------
# Generation: equal with and without the cache in every mode


GENERATION_MODES = {
    "greedy": dict(do_sample=False, num_beams=1),
    "sample": dict(do_sample=True, num_beams=1, top_k=5),
    "beam": dict(do_sample=False, num_beams=3),
    "beam_sample": dict(do_sample=True, num_beams=3, top_k=5),
}


def generate(model, head: str, use_cache: bool, seed: int = 0, batch: int = BATCH, **options) -> torch.Tensor:
    input_ids = ids(seq=4, batch=batch)
    mask = torch.ones_like(input_ids)
    if head == "causal" and batch > 1:
        mask[0, :1] = 0  # left padding
    torch.manual_seed(seed)
    return model.generate(input_ids, attention_mask=mask, max_new_tokens=5, use_cache=use_cache,
                          eos_token_id=None, pad_token_id=1, **options)


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", GENERATIVE)
def test_generation_is_the_same_with_and_without_the_cache(head, norm, mode):
    model = make_model(head, norm)
    options = dict(GENERATION_MODES[mode], return_dict_in_generate=True, output_scores=True)
    cached = generate(model, head, True, **options)
    uncached = generate(model, head, False, **options)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert cached.sequences.shape[1] == (6 if head == "seq2seq" else 9)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(uncached.scores), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", GENERATIVE)
def test_assisted_decoding_gives_the_models_own_greedy_tokens(head, norm):
    model = make_model(head, norm)
    assistant = make_model(head, norm, seed=5)
    # Transformers' assisted decoding takes one sequence at a time.
    greedy = generate(model, head, True, batch=1, do_sample=False)
    assisted = generate(model, head, True, batch=1, do_sample=False, assistant_model=assistant)
    # Sampling from the top token only is greedy: assisted sampling must also give it.
    assisted_sample = generate(model, head, True, batch=1, do_sample=True, top_k=1, assistant_model=assistant)
    assert torch.equal(assisted, greedy) and torch.equal(assisted_sample, greedy)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", GENERATIVE)
def test_generation_from_inputs_embeds_equals_generation_from_ids(head, norm):
    model = make_model(head, norm)
    input_ids = ids(seq=4)
    embeds = model.get_input_embeddings()(input_ids)
    options = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    from_ids = model.generate(input_ids, **options)
    from_embeds = model.generate(inputs_embeds=embeds, **options)
    # A decoder-only model returns the new tokens only when it is given embeddings.
    expected = from_ids[:, input_ids.shape[1]:] if head == "causal" else from_ids
    assert torch.equal(from_embeds, expected)


@pytest.mark.parametrize("norm", NORMS)
def test_generation_continues_from_a_returned_cache(norm):
    model = make_model("causal", norm)
    input_ids = ids(seq=4)
    options = dict(do_sample=False, eos_token_id=None, pad_token_id=1)
    whole = model.generate(input_ids, max_new_tokens=6, **options)
    first = model.generate(input_ids, max_new_tokens=3, return_dict_in_generate=True, **options)
    cache = getattr(first, _CACHE_FIELD)
    assert cache is not None and cache.get_seq_length() == 4 + 3 - 1
    continued = model.generate(first.sequences, max_new_tokens=3, **{_CACHE_FIELD: cache}, **options)
    assert torch.equal(continued, whole)


# ---------------------------------------------------------------------------------------------
# Weights: save and load, embeddings, ties, checkpointing, fp32 modules


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_save_and_load_round_trip(head, norm, tmp_path):
    model = make_model(head, norm)
    model.save_pretrained(tmp_path)
    loaded = HEAD_CLASSES[head].from_pretrained(tmp_path).eval()
    batch = batch_for(head, ids())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)
    assert loaded.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("head", HEADS)
def test_resize_token_embeddings_grows_both_ends_and_keeps_old_rows(head):
    model = make_model(head, "powernorm")
    before = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 5)
    after = model.get_input_embeddings().weight
    assert after.shape == (VOCAB + 5, 32) and model.config.vocab_size == VOCAB + 5
    torch.testing.assert_close(after[:VOCAB], before)
    if head != "classifier":
        assert model.get_output_embeddings().weight.shape == (VOCAB + 5, 32)
    with torch.no_grad():
        assert model(**batch_for(head, torch.full((2, 3), VOCAB + 4))).logits.isfinite().all()


@pytest.mark.parametrize("head", GENERATIVE)
def test_tied_output_projection_shares_the_embedding_and_is_saved_once(head, tmp_path):
    model = make_model(head, "powernorm", train=False)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved
    untied = make_model(head, "powernorm", train=False, tie_word_embeddings=False)
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight


def _saved_bytes(model, batch) -> tuple[int, torch.Tensor, dict]:
    """Bytes autograd keeps for the backward, the loss, and the gradients."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return sum(saved), loss.detach(), grads


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("head", HEADS)
def test_gradient_checkpointing_changes_memory_not_results(head, norm):
    model = make_model(head, norm, train=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    batch = batch_for(head, ids(seq=12), labels=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    plain_bytes, plain_loss, plain_grads = _saved_bytes(model, batch)
    model.load_state_dict(state)  # the same running statistics for both passes
    # Transformers 5.23 renamed gradient_checkpointing_enable (now deprecated); 5.17 has only the old name.
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    checkpointed_bytes, checkpointed_loss, checkpointed_grads = _saved_bytes(model, batch)
    assert checkpointed_bytes < 0.8 * plain_bytes
    torch.testing.assert_close(checkpointed_loss, plain_loss)
    assert checkpointed_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_keep_in_fp32_modules_name_buffers_that_exist():
    with_statistics = [norm for norm, cls in NORM_CLASSES.items() if cls.has_running_stats]
    assert len(with_statistics) >= 5
    names = {name.rsplit(".", 1)[-1] for norm in with_statistics
             for name, _ in make_model("seq2seq", norm, train=False).named_buffers()}
    kept = set(PowerNormTransformerPreTrainedModel._keep_in_fp32_modules_strict)
    assert kept <= names, kept - names
    # Every float statistic a norm keeps stays float32 under dtype=bfloat16 loading.
    floats = {name.rsplit(".", 1)[-1] for norm in with_statistics
              for name, buffer in make_model("seq2seq", norm, train=False).named_buffers() if buffer.is_floating_point()}
    assert floats <= kept, floats - kept
    assert {"running_phi", "running_nu", "running_mean", "running_var"} <= kept


def test_weights_that_disagree_with_the_config_refuse_to_load(tmp_path):
    """Deliberate difference: Transformers loads mismatched weights with a warning and initialises
    the rest. A PN checkpoint loaded into a LayerNorm config (or the reverse) would run with
    initialised norms and no running statistics, silently giving other outputs, so it is refused."""
    make_model("causal", "powernorm", train=False).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="disagrees with the weights"):
        PowerNormTransformerForCausalLM.from_pretrained(tmp_path, decoder_norm_type="layernorm")


@pytest.mark.parametrize("norm", NORMS)
def test_generation_continues_from_inputs_embeds_and_a_returned_cache(norm):
    model = make_model("causal", norm)
    embeds = model.get_input_embeddings()(ids(seq=4))
    options = dict(do_sample=False, eos_token_id=None, pad_token_id=1, return_dict_in_generate=True)
    whole = model.generate(inputs_embeds=embeds, max_new_tokens=4, **options)
    first = model.generate(inputs_embeds=embeds, max_new_tokens=3, **options)
    continued = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
    second = model.generate(inputs_embeds=continued, max_new_tokens=1, **{_CACHE_FIELD: getattr(first, _CACHE_FIELD)},
                            **options)
    assert torch.equal(torch.cat([first.sequences, second.sequences], dim=1), whole.sequences)
