"""Config fields, defaults, presets, validation and serialisation."""

import re

import pytest
from transformers import AutoConfig

from hf_powernorm import PRESETS, PowerNormTransformerConfig


def test_defaults_follow_the_paper_translation_setting():
    config = PowerNormTransformerConfig()
    assert config.model_type == "powernorm_transformer"
    assert config.normalize_before is True
    assert (config.encoder_norm_type, config.decoder_norm_type) == ("powernorm", "layernorm")
    assert (config.powernorm_alpha_fwd, config.powernorm_alpha_bkw) == (0.9, 0.9)
    assert config.powernorm_group_num == config.num_attention_heads
    assert config.powernorm_backward_denominator == "running"
    assert (config.powernorm_warmup_statistic, config.powernorm_warmup_ramp_steps) == ("reference", 0)
    assert config.num_hidden_layers == config.decoder_layers


def test_group_num_follows_heads_unless_given():
    assert PowerNormTransformerConfig(num_attention_heads=16, hidden_size=64).powernorm_group_num == 16
    assert PowerNormTransformerConfig(powernorm_group_num=2).powernorm_group_num == 2
    assert PowerNormTransformerConfig(powernorm_group_num=None).powernorm_group_num is None


@pytest.mark.parametrize("name, expected", [
    ("iwslt14-small", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, encoder_layers=6,
                           decoder_layers=6, encoder_norm_type="powernorm", decoder_norm_type="layernorm")),
    ("wmt14-big", dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                       powernorm_group_num=16)),
    ("lm-small", dict(encoder_layers=0, decoder_norm_type="powernorm", is_encoder_decoder=False)),
    ("tiny", dict(vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=37, encoder_layers=2)),
])
def test_presets(name, expected):
    config = PowerNormTransformerConfig.from_preset(name)
    for key, value in expected.items():
        assert getattr(config, key) == value, key


def test_preset_overrides_and_unknown_preset():
    assert PowerNormTransformerConfig.from_preset("iwslt14-small", vocab_size=123).vocab_size == 123
    with pytest.raises(ValueError, match="'nope'"):
        PowerNormTransformerConfig.from_preset("nope")
    assert set(PRESETS) >= {"iwslt14-small", "wmt14-big", "lm-small", "tiny"}


def test_norm_names_are_canonicalised():
    config = PowerNormTransformerConfig(encoder_norm_type="Power-Norm", decoder_norm_type="PN-V")
    assert (config.encoder_norm_type, config.decoder_norm_type) == ("powernorm", "powernorm_v")


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("hidden_size", 30), ("vocab_size", -1), ("encoder_layers", -1),
    ("num_attention_heads", 2.5), ("intermediate_size", 0), ("dropout", 1.5), ("attention_dropout", -0.1),
    ("activation_dropout", "high"), ("activation_function", "swishy"), ("position_embedding_type", "rotary"),
    ("encoder_norm_type", "superNorm"), ("decoder_norm_type", 3), ("powernorm_alpha_fwd", 1.1),
    ("powernorm_alpha_bkw", -0.5), ("powernorm_warmup_steps", -3), ("powernorm_group_num", 3),
    ("powernorm_group_num", 0), ("powernorm_backward_denominator", "exact"), ("norm_eps", 0.0),
    ("powernorm_warmup_statistic", "ema"), ("powernorm_warmup_statistic", None), ("powernorm_warmup_ramp_steps", -1),
    ("powernorm_warmup_ramp_steps", 2.5),
    ("init_std", -1.0), ("normalize_before", "yes"), ("max_position_embeddings", 0),
])
def test_bad_values_raise_value_error_naming_them(field, value):
    with pytest.raises(ValueError) as error:
        PowerNormTransformerConfig(**{field: value})
    message = str(error.value)
    assert message.startswith(field), message  # about this field, not one that merely mentions it
    assert repr(value) in message or f"{field}={value}" in message, message


@pytest.mark.parametrize("field", ["pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"])
@pytest.mark.parametrize("value", [99, -1, 1000, [2, 99]])
def test_special_token_ids_outside_the_vocabulary_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be None or a token id in \[0, vocab_size=99\), "
                                         rf"got {re.escape(repr(value))}"):
        PowerNormTransformerConfig.from_preset("tiny", **{field: value})
    assert getattr(PowerNormTransformerConfig.from_preset("tiny", **{field: 98}), field) == 98
    assert getattr(PowerNormTransformerConfig.from_preset("tiny", **{field: None}), field) is None


def test_warmup_statistic_error_names_the_valid_values():
    with pytest.raises(ValueError, match=r"powernorm_warmup_statistic must be one of \('cumulative', 'reference'\), "
                                         r"got 'ema'"):
        PowerNormTransformerConfig(powernorm_warmup_statistic="ema")


def test_norm_kwargs_map_config_options_onto_each_norm():
    config = PowerNormTransformerConfig(powernorm_alpha_fwd=0.95, powernorm_alpha_bkw=0.99, powernorm_warmup_steps=7,
                                        powernorm_group_num=2, powernorm_backward_denominator="batch",
                                        powernorm_warmup_statistic="reference", powernorm_warmup_ramp_steps=5,
                                        norm_eps=1e-6)
    assert config.norm_kwargs("powernorm") == dict(eps=1e-6, alpha_fwd=0.95, alpha_bkw=0.99, warmup_steps=7,
                                                   warmup_statistic="reference", warmup_ramp_steps=5,
                                                   group_num=2, backward_denominator="batch", sync_stats=False)
    assert config.norm_kwargs("PN-V") == dict(eps=1e-6, alpha_fwd=0.95)
    assert config.norm_kwargs("groupnorm") == dict(eps=1e-6, group_num=2)
    assert config.norm_kwargs("batchnorm") == dict(eps=1e-6)
    assert config.norm_kwargs("brn") == dict(eps=1e-6)
    assert config.norm_kwargs("mabn") == dict(eps=1e-6)
    assert config.norm_kwargs("layernorm") == dict(eps=1e-6)


def test_round_trip_through_json_and_auto_config(tmp_path):
    config = PowerNormTransformerConfig.from_preset("tiny", powernorm_group_num=None, decoder_norm_type="rmsnorm",
                                                    powernorm_warmup_steps=11, powernorm_warmup_statistic="reference",
                                                    powernorm_warmup_ramp_steps=4)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, PowerNormTransformerConfig)
    assert loaded.powernorm_group_num is None
    assert (loaded.powernorm_warmup_statistic, loaded.powernorm_warmup_ramp_steps) == ("reference", 4)
    assert loaded.to_diff_dict() == config.to_diff_dict()
