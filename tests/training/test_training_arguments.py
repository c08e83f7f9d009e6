"""The recipes' norm options come from the norm classes: every config field a norm of the registry reads
has its flag, and the flags' choices are the registry's."""

import argparse

import pytest

from hf_powernorm import NORM_CLASSES, PowerNormTransformerConfig
from hf_powernorm.configuration_powernorm import NORM_SITES
from hf_powernorm.normalization import BACKWARD_DENOMINATORS, WARMUP_STATISTICS
from hf_powernorm.training import add_recipe_args, check_args
from hf_powernorm.training.arguments import ELEMENTWISE_NORM_OPTIONS, PN_OPTIONS


def _parser() -> argparse.ArgumentParser:
    return add_recipe_args(argparse.ArgumentParser())


def _flag(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(action for action in parser._actions if action.dest == dest)


def test_every_config_field_of_a_norm_option_is_a_recipe_option():
    fields = {field for cls in NORM_CLASSES.values() for field in cls.config_options.values()}
    fields |= {f"{prefix}_{site}" for cls in NORM_CLASSES.values() for prefix in cls.site_options.values()
               for site in NORM_SITES}
    assert "powernorm_alpha_fwd" in fields and "norm_alpha_init_ffn" in fields
    # `powernorm_sync_stats` has its own flag, decided with the number of processes
    assert set(PN_OPTIONS) == fields - {"powernorm_sync_stats"} | {"embed_scale_learnable"}
    assert len(PN_OPTIONS) == len(set(PN_OPTIONS))
    assert set(ELEMENTWISE_NORM_OPTIONS) <= set(PN_OPTIONS)
    parser, config = _parser(), PowerNormTransformerConfig()
    for field in PN_OPTIONS:
        assert hasattr(config, field), field
        assert _flag(parser, field).option_strings[0] == f"--{field}"
        assert _flag(parser, field).default is None  # the preset's value unless given


def test_choices_of_the_flags_are_the_registrys():
    parser = _parser()
    assert tuple(_flag(parser, "powernorm_backward_denominator").choices) == BACKWARD_DENOMINATORS
    assert tuple(_flag(parser, "powernorm_warmup_statistic").choices) == WARMUP_STATISTICS
    args = parser.parse_args(["--powernorm_backward_denominator", BACKWARD_DENOMINATORS[-1]])
    assert args.powernorm_backward_denominator == BACKWARD_DENOMINATORS[-1]
    with pytest.raises(SystemExit):
        parser.parse_args(["--powernorm_backward_denominator", "exact"])


@pytest.mark.parametrize("option", ["norm_type", "encoder_norm_type", "decoder_norm_type"])
def test_norm_flags_take_any_spelling_and_name_a_bad_one(option):
    args = _parser().parse_args([f"--{option}", "Power-Norm"])
    check_args(args)
    assert getattr(args, option) == "powernorm"
    args = _parser().parse_args([f"--{option}", "powrnorm"])
    with pytest.raises(ValueError, match=f"--{option}: unknown norm 'powrnorm'; valid names: .*'layernorm'"):
        check_args(args)
