"""Every norm of a converted model accounted for: `convert_norms` converts it or lists it in
`report.kept` with the reason it is not a norm of the residual stream (QK-norm, latent projection
norm, SSM inner norm, gated norm, position-table norm, weightless L2 norm, a norm over a concatenation),
over tiny models of the families that hold such norms and of every family `test_converter_families` builds."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers as tf

import hf_powernorm
from test_converter_families import FAMILIES, QK_NORMS

H, VOCAB = 32, 99
SMALL = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
MLA = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=16,
           qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, num_key_value_heads=4)

OTHER_NORMS = {
    "mamba2": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=8, n_groups=1,
        expand=2, chunk_size=8)),
    "zamba2": lambda: tf.Zamba2ForCausalLM(tf.Zamba2Config(
        **SMALL, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, chunk_size=8,
        hybrid_layer_ids=[1], layers_block_type=["mamba", "hybrid"], num_key_value_heads=4, attention_head_dim=16)),
    "llama4": lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=37, num_local_experts=2)),
    "deepseek_v2": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**SMALL, **MLA)),
    "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**SMALL, **MLA, n_group=1, topk_group=1)),
    "jamba": lambda: tf.JambaForCausalLM(tf.JambaConfig(
        **SMALL, num_key_value_heads=2, num_experts=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4)),
    "deberta_v2": lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
        **SMALL, relative_attention=True, position_buckets=8, max_relative_positions=16, norm_rel_ebd="layer_norm",
        pos_att_type=["p2c", "c2p"])),
}
# The kept norms of each family, by the end of their module path, and a phrase their reason must hold.
KEPT = {
    "mamba2": {"mixer.norm": "a gated norm"},
    "zamba2": {"mamba.norm": "a gated norm", "shared_transformer.input_layernorm": "twice the hidden size"},
    "llama4": {"self_attn.qk_norm": "a weightless L2 norm inside Llama4TextAttention"},
    "deepseek_v2": {"q_a_layernorm": "a latent projection norm", "kv_a_layernorm": "a latent projection norm"},
    "deepseek_v3": {"q_a_layernorm": "a latent projection norm", "kv_a_layernorm": "a latent projection norm"},
    "jamba": {"dt_layernorm": "an SSM inner norm", "b_layernorm": "an SSM inner norm",
              "c_layernorm": "an SSM inner norm"},
    "deberta_v2": {"deberta.encoder.LayerNorm": "a position-table norm"},
    "qwen3_5": {"q_norm": "QK-norm", "k_norm": "QK-norm", "linear_attn.norm": "a gated norm"},
    "gemma4": {"q_norm": "QK-norm", "k_norm": "QK-norm", "v_norm": "value norm",
               "per_layer_projection_norm": "off the residual stream"},
    "axk2": {"input_layernorm": "a wrapper", "post_attention_layernorm": "a wrapper",
             "q_a_layernorm": "a latent projection norm", "kv_a_layernorm": "a latent projection norm",
             "indexer.k_norm": "off the residual stream"},
    **{name: {"q_norm": "QK-norm", "k_norm": "QK-norm"} for name in QK_NORMS - {"qwen3_5", "gemma4"}},
}
ALL = {**FAMILIES, **OTHER_NORMS}


def norm_like(model: torch.nn.Module) -> set[str]:
    """The module paths of every module whose class (or a base) is named as a norm layer is."""
    return {name for name, module in model.named_modules()
            if name and any(re.search(r"Norm(Gated)?$", cls.__name__) for cls in type(module).__mro__[:-1])}


def convert(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return hf_powernorm.convert_norms(model, "powernorm", **kwargs)


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_norm_is_converted_or_kept_with_its_reason(name):
    torch.manual_seed(0)
    model = ALL[name]()
    norms = norm_like(model)
    report = convert(model)
    converted, kept = set(report.modules), {path for path, _, _ in report.kept}
    assert not converted & kept
    assert converted | kept == norms, {"neither": norms - converted - kept, "not norms": (converted | kept) - norms}
    expected = KEPT.get(name, {})
    for path, cls, reason in report.kept:
        ends = [end for end in expected if path == end or path.endswith("." + end)]
        assert len(ends) == 1, f"{path} ({cls}) kept: {reason}"
        assert expected[ends[0]] in reason, (path, reason)
    assert {end for end in expected if any(p == end or p.endswith("." + end) for p in kept)} == set(expected)
    assert all("a per-head or QK-norm" not in reason for _, _, reason in report.kept)


def test_the_position_table_norm_of_deberta_v2_keeps_its_output():
    """DeBERTa-v2's `encoder.LayerNorm` normalizes the rows of the relative-position table, not tokens:
    kept, the token norms converted, and the converted model still runs."""
    torch.manual_seed(0)
    model = OTHER_NORMS["deberta_v2"]()
    encoder = model.deberta.encoder
    table = encoder.get_rel_embedding().detach().clone()
    report = convert(model)
    assert type(encoder.LayerNorm) is torch.nn.LayerNorm and len(report.replaced) == 6
    torch.testing.assert_close(encoder.get_rel_embedding(), table, atol=0, rtol=0)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits).all()


def test_a_gated_norm_selected_by_name_is_refused():
    model = OTHER_NORMS["mamba2"]()
    gated = type(model.get_submodule("backbone.layers.0.mixer.norm")).__name__  # MambaRMSNormGated, or
    # Mamba2RMSNormGated from Transformers 5.25: the class's own name, whichever the version calls it
    with pytest.raises(ValueError, match=rf"'backbone.layers.0.mixer.norm' \({gated}\): a gated norm"):
        convert(model, modules=r"mixer\.norm$")
