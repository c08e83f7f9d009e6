"""Generation continued from a returned cache gives the cache of an uninterrupted run, for the
translation and the language-model heads, with LayerNorm and PN.

Transformers' common test `test_generate_continue_from_past_key_values` continues an
encoder-decoder with `decoder_input_ids` set to the returned sequences and the original
`decoder_attention_mask` padded with ones on the right. When the decoder prompt does not begin with
the start token, `generate` prepends it, and a 1 to the mask, in its first call; the returned
sequences begin with that start token, so the test's padded mask is then one position out of step
with the tokens. Where that mask holds a zero, the continued step masks another cached position
than the uninterrupted run did: the caches agree at every cached position and differ at the
continued one, from the second layer on, as much in float64 as in float32, for BART as for this
family. With the mask aligned (a 1 in front, as `generate` does), the caches are equal.
"""

import pytest
import torch

from hf_powernorm import (
    PowerNormTransformerConfig,
    PowerNormTransformerForCausalLM,
    PowerNormTransformerForConditionalGeneration,
)
from hf_powernorm.modeling_powernorm import _CACHE_FIELD

BATCH, PROMPT, VOCAB, PAD, START, NEW = 13, 7, 99, 1, 2, 4
HEADS = {"seq2seq": PowerNormTransformerForConditionalGeneration, "causal": PowerNormTransformerForCausalLM}
# Greedy to the last token: no end-of-sequence stop, so both runs take the same number of steps.
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD, use_cache=True, return_dict_in_generate=True)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(head: str, norm: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny model after a few updates, so PN's running statistics have left their initial values."""
    torch.manual_seed(0)
    config = PowerNormTransformerConfig.from_preset("tiny", encoder_norm_type=norm, decoder_norm_type=norm,
                                                    powernorm_warmup_steps=1, attn_implementation="eager")
    model = HEADS[head](config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for step in range(3):
        input_ids = prompt_ids(seed=10 + step)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.to(dtype).eval()


def prompt_ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(seed))


def prompts(head: str) -> dict[str, torch.Tensor]:
    """Padded prompts: a decoder prompt with padding inside (seq2seq) or left padding (causal)."""
    input_ids = prompt_ids(seed=1)
    if head == "causal":
        mask = torch.ones_like(input_ids)
        mask[::2, :2] = 0
        return {"input_ids": input_ids, "attention_mask": mask}
    decoder_input_ids = prompt_ids(seed=2)  # no row begins with the start token: generate prepends it
    decoder_input_ids[::3, 3] = PAD
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_input_ids.ne(PAD).long()}


def continued(model, head: str, inputs: dict, with_start: bool = True):
    """The first `NEW - 1` tokens, then one more from the returned cache. The mask of the tokens so
    far gets a 1 for each new token and, with `with_start`, one in front for the start token that
    `generate` put before the decoder prompt."""
    first = model.generate(**inputs, max_new_tokens=NEW - 1, **GREEDY)
    ids_key, mask_key = ("decoder_input_ids", "decoder_attention_mask") if head == "seq2seq" \
        else ("input_ids", "attention_mask")
    mask = inputs[mask_key]
    if head == "seq2seq" and with_start:
        mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
    mask = torch.nn.functional.pad(mask, (0, first.sequences.shape[1] - mask.shape[1]), value=1)
    inputs = {**inputs, ids_key: first.sequences, mask_key: mask, _CACHE_FIELD: getattr(first, _CACHE_FIELD)}
    return first, model.generate(**inputs, max_new_tokens=1, **GREEDY)


def cache_tensors(cache) -> dict[str, torch.Tensor]:
    """Every layer's keys and values: self-attention, and cross-attention in an encoder-decoder cache."""
    parts = {"self": getattr(cache, "self_attention_cache", cache)}
    if hasattr(cache, "cross_attention_cache"):
        parts["cross"] = cache.cross_attention_cache
    return {f"{part} {index} {kind}": getattr(layer, kind) for part, sub in parts.items()
            for index, layer in enumerate(sub.layers) for kind in ("keys", "values")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("norm", ["layernorm", "powernorm"])
@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_continued_cache_equals_the_uninterrupted_one(head, norm, dtype):
    model = make_model(head, norm, dtype)
    inputs = prompts(head)
    whole = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
    first, second = continued(model, head, inputs)
    prompt_length = PROMPT + (head == "seq2seq")  # the decoder prompt behind its start token
    assert first.sequences.shape[1] == prompt_length + NEW - 1
    assert torch.equal(second.sequences, whole.sequences)
    expected, got = cache_tensors(getattr(whole, _CACHE_FIELD)), cache_tensors(getattr(second, _CACHE_FIELD))
    assert got.keys() == expected.keys()
    # Left padding included: a padded query's fully masked row stays finite in float64 as in float32.
    assert all(tensor.isfinite().all() for tensor in expected.values())
    for name, tensor in expected.items():
        if dtype == torch.float64:
            assert torch.equal(got[name], tensor), name
        else:  # the tolerance of Transformers' test
            torch.testing.assert_close(got[name], tensor, msg=name)


@pytest.mark.parametrize("norm", ["layernorm", "powernorm"])
def test_a_decoder_mask_out_of_step_with_the_start_token_changes_the_continued_position_only(norm):
    """The mask Transformers' common test builds (no 1 for the start token): the caches are equal at
    every cached position and in the first layer, and differ at the continued position after it,
    in float64 too: the continued step reads the mask it is given, not a rounding difference."""
    model = make_model("seq2seq", norm, torch.float64)
    inputs = prompts("seq2seq")
    whole = model.generate(**inputs, max_new_tokens=NEW, **GREEDY)
    _, second = continued(model, "seq2seq", inputs, with_start=False)
    expected, got = cache_tensors(getattr(whole, _CACHE_FIELD)), cache_tensors(getattr(second, _CACHE_FIELD))
    for name, tensor in expected.items():
        assert torch.equal(got[name][:, :, :-1], tensor[:, :, :-1]), name
    assert torch.equal(got["self 0 keys"], expected["self 0 keys"])
    assert (got["self 1 keys"][:, :, -1] - expected["self 1 keys"][:, :, -1]).abs().max() > 1e-6
