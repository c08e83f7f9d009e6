"""The options module the recipes and `compare` share: its copies of the library's choices, one parser
per option for both commands, the options the library reads held by every command line, the main
process, and bad input told apart from bugs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hf_powernorm.training import options


def test_the_choices_written_here_are_the_librarys():
    from hf_powernorm.configuration_powernorm import NORM_SITES
    from hf_powernorm.normalization import BACKWARD_DENOMINATORS, WARMUP_STATISTICS
    from hf_powernorm.training.optimization import SCHEDULER_TYPES

    assert options.SCHEDULES == SCHEDULER_TYPES and options.NORM_SITES == NORM_SITES
    assert (options.BACKWARD_DENOMINATORS, options.WARMUP_STATISTICS) == (BACKWARD_DENOMINATORS, WARMUP_STATISTICS)


def test_the_norm_options_are_the_registrys():
    from hf_powernorm.normalization import PowerNorm
    from hf_powernorm.training.arguments import ELEMENTWISE_NORM_OPTIONS

    groups: dict[str, list[str]] = {}
    for spec in dataclasses.fields(options.RecipeOptions):
        groups.setdefault(spec.metadata["group"], []).append(spec.name)
    assert set(groups["powernorm"]) == {*PowerNorm.config_options.values(), "sync_stats"} - {"powernorm_sync_stats"}
    assert tuple(groups["elementwise"]) == ELEMENTWISE_NORM_OPTIONS


def test_each_shared_option_is_parsed_by_the_same_declaration():
    from hf_powernorm.compare import build_parser
    from hf_powernorm.training.arguments import add_recipe_args

    recipe = {a.dest: a for a in add_recipe_args(argparse.ArgumentParser())._actions}
    ours = {a.dest: a for a in build_parser()._actions}
    assert recipe["powernorm_group_num"].type is ours["powernorm_group_num"].type is options.group_num
    shared = set(recipe) & set(ours) - {"help"}
    assert all(ours[name].option_strings == recipe[name].option_strings for name in shared)
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'none'"):
        options.group_num("0")
    assert (options.group_num("None"), options.group_num("4")) == ("none", 4)


def test_every_recipe_command_line_holds_what_the_library_reads():
    from hf_powernorm.training.tasks import get_task, task_names

    for name in task_names():
        args = get_task(name).build_parser().parse_args([])
        assert set(options.NOT_GIVEN) <= set(vars(args)), name
    lm = get_task("causal-lm").build_parser().parse_args([])
    assert (lm.block_size, lm.keep_linebreaks, lm.text_column) == (64, True, None)  # a task's own default wins


def test_is_main_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")
    assert options.is_main_process()  # one process: the main one, whatever RANK says
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not options.is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert options.is_main_process()


def test_bad_input_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    from hf_powernorm import cli

    assert issubclass(options.BadInput, ValueError) and issubclass(options.MissingInput, FileNotFoundError)

    def refused(argv):
        raise options.MissingInput("--train_file x.txt: not\nfound")

    with pytest.raises(SystemExit) as stopped:
        cli.run_command("compare", refused, [])
    assert stopped.value.code == 2 and capsys.readouterr().err == "hf-powernorm compare: error: --train_file " \
                                                                   "x.txt: not found\n"

    def bug(argv):
        raise ValueError("not the user's")

    with pytest.raises(ValueError, match="not the user's"):
        cli.run_command("compare", bug, [])
