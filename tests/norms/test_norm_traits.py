"""Each norm's traits (`mixes_positions`, `mixing_options`, `has_running_stats`, `foldable`,
`config_options`, `site_options`, `learnable_embed_scale`) checked against what the norm does, and
the lists derived from them.

The model, the converter, the model card and the recipes read these traits through
`NORM_CLASSES`; a norm whose trait lies would get a wrong card warning, a missing-statistics
warning, or a fold that changes its outputs.
"""

import copy
import inspect
import re

import pytest
import torch

from hf_powernorm import NORM_CLASSES, PowerNormTransformerConfig, PowerNormTransformerForCausalLM, build_norm
from hf_powernorm.converter import causal_norms, mixes_positions
from hf_powernorm.modeling_powernorm import FOLDABLE_NORMS, RUNNING_BUFFERS
from hf_powernorm.normalization import group_scale

BATCH, SEQ, HIDDEN = 3, 7, 12
NORMS = sorted(NORM_CLASSES)
# Options that make the smallest instances valid or quick to leave their first phase.
OPTIONS = {"groupnorm": {"group_num": 3}, "powernorm": {"group_num": 3}}


def make_norm(name: str, **options) -> torch.nn.Module:
    return build_norm(name, HIDDEN, **{**OPTIONS.get(name, {}), **options})


def batch(seed: int = 0) -> torch.Tensor:
    # A standard deviation past BatchRenorm's rmax=3: unclipped, its output is the running statistics'
    # normalization and depends on no other token; clipped, it does.
    return torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 5 + 0.5


def claims_to_mix(name: str, options: dict) -> bool:
    """The trait read by hand, independently of `converter.mixes_positions`."""
    cls = NORM_CLASSES[name]
    return cls.mixes_positions and (not cls.mixing_options or any(options.get(o, 0) > 0 for o in cls.mixing_options))


def _mixing_cases():
    for name in NORMS:
        yield name, {}
        for option in NORM_CLASSES[name].mixing_options:
            yield name, {option: 2}


@pytest.mark.parametrize("name, options", list(_mixing_cases()))
def test_mixes_positions_matches_the_training_output(name, options):
    norm = make_norm(name, **options).train()
    x = batch()
    in_batch = copy.deepcopy(norm)(x)[0]
    alone = copy.deepcopy(norm)(x[:1])[0]
    same = torch.allclose(in_batch, alone, atol=1e-6, rtol=1e-5)
    assert same is not claims_to_mix(name, options)
    assert mixes_positions(name, options) is claims_to_mix(name, options)


@pytest.mark.parametrize("name", NORMS)
def test_has_running_stats_matches_the_buffers(name):
    norm = make_norm(name).train()
    before = {key: value.clone() for key, value in norm.named_buffers()}
    norm(batch())
    changed = [key for key, value in norm.named_buffers() if not torch.equal(value, before[key])]
    assert bool(changed) is NORM_CLASSES[name].has_running_stats
    assert set(before) <= set(RUNNING_BUFFERS)  # every buffer is known to the loader's warning


@pytest.mark.parametrize("name", NORMS)
def test_foldable_norms_fold_to_the_same_output(name):
    norm = make_norm(name).train()
    for step in range(3):
        norm(batch(seed=1 + step))
    norm.eval()
    assert hasattr(norm, "affine_after_group_scale") is NORM_CLASSES[name].foldable
    if not NORM_CLASSES[name].foldable:
        return
    x = batch(seed=9)
    scale, shift = norm.affine_after_group_scale()
    folded = group_scale(x, getattr(norm, "group_num", None)) * scale + shift
    torch.testing.assert_close(folded, norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NORMS)
def test_config_options_name_constructor_options_and_config_fields(name):
    cls = NORM_CLASSES[name]
    accepted = inspect.signature(cls.__init__).parameters
    config = PowerNormTransformerConfig.from_preset("tiny")
    for option, field in cls.config_options.items():
        assert option in accepted and hasattr(config, field), (option, field)
    build_norm(name, config.hidden_size, **config.norm_kwargs(name))


@pytest.mark.parametrize("name", NORMS)
def test_site_options_reach_the_norm_of_each_site(name):
    """Each per-site option is a constructor option and names one config field per site, and the
    model's norm at that site is built with that field's value."""
    cls = NORM_CLASSES[name]
    accepted = inspect.signature(cls.__init__).parameters
    sites = {"attention": 0.7, "ffn": 0.4, "final": 0.2}
    fields = {f"{prefix}_{site}": value for prefix in cls.site_options.values() for site, value in sites.items()}
    config = PowerNormTransformerConfig.from_preset("tiny", decoder_norm_type=name, is_encoder_decoder=False, **fields)
    decoder = PowerNormTransformerForCausalLM(config).model.decoder
    for option, prefix in cls.site_options.items():
        assert option in accepted, option
        for site, norm in (("attention", decoder.layers[0].self_attn_norm), ("ffn", decoder.layers[0].ffn_norm),
                           ("final", decoder.final_norm)):
            assert getattr(norm, option) == getattr(config, f"{prefix}_{site}"), (option, site)


@pytest.mark.parametrize("name", NORMS)
def test_learnable_embed_scale_matches_the_model(name):
    config = PowerNormTransformerConfig.from_preset("tiny", decoder_norm_type=name, is_encoder_decoder=False)
    scale = PowerNormTransformerForCausalLM(config).model.decoder.embeddings.embed_scale
    assert isinstance(scale, torch.nn.Parameter) is NORM_CLASSES[name].learnable_embed_scale


def test_derived_lists_follow_the_traits():
    assert set(FOLDABLE_NORMS) == {name for name, cls in NORM_CLASSES.items() if cls.foldable}
    named = {word for word in re.findall(r"[a-z_]+", causal_norms()) if word in NORM_CLASSES}
    assert named == {name for name in NORM_CLASSES if not mixes_positions(name, {})}
