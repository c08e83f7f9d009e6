"""The task registry: each task found by its name, an unknown name refused with the valid ones,
registration guarded, each task's own input paths and Auto class, and tasks built from typed
options exactly as from their command line."""

import argparse

import pytest

from hf_powernorm import compare
from hf_powernorm.training import TASK_REGISTRY, Task, get_task, register_task, task_names
from hf_powernorm.training.classification import Classification
from hf_powernorm.training.language_modeling import LanguageModelling
from hf_powernorm.training.translation import Translation


def test_every_task_is_found_by_its_name_and_compare_offers_them_all():
    assert task_names() == ["causal-lm", "classification", "seq2seq"]
    assert [get_task(name) for name in task_names()] == [LanguageModelling, Classification, Translation]
    assert all(get_task(name).name == name for name in task_names())
    [task_option] = [a for a in compare.build_parser()._actions if a.dest == "task"]
    assert list(task_option.choices) == task_names()


def test_an_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown task 'translation'; valid tasks: \['causal-lm', 'classification'"):
        get_task("translation")
    with pytest.raises(TypeError, match="a task name is a string"):
        get_task(3)


def test_registration_refuses_a_second_class_under_a_name_and_a_non_task():
    with pytest.raises(ValueError, match="'causal-lm' is already registered as LanguageModelling"):
        register_task("causal-lm")(type("Other", (Task,), {}))
    with pytest.raises(TypeError, match="takes a Task subclass"):
        register_task("not-a-task")(dict)
    assert register_task("causal-lm")(LanguageModelling) is LanguageModelling  # the same class again: kept
    assert "not-a-task" not in TASK_REGISTRY


def test_each_task_declares_its_own_input_paths_and_auto_class():
    assert Classification.input_path_options[-1] == "phrasebank_file"
    assert "phrasebank_file" not in LanguageModelling.input_path_options + Translation.input_path_options
    assert [get_task(n).auto_model_class().__name__ for n in task_names()] == [
        "AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoModelForSeq2SeqLM"]
    # The recipes check only their task's files: a phrasebank path is not looked at for a language model.
    args = argparse.Namespace(**{**vars(LanguageModelling.build_parser().parse_args([])), "phrasebank_file": "/nowhere"})
    assert LanguageModelling.check_options(args) is args
    with pytest.raises(FileNotFoundError, match="--phrasebank_file /nowhere: not found"):
        Classification.from_options(phrasebank_file="/nowhere")


def test_options_in_code_give_the_arguments_of_the_same_command_line(tmp_path):
    options = {"output_dir": str(tmp_path), "learning_rate": 3e-3, "powernorm_alpha_bkw": 1, "dropout": 0.1,
               "checkpointing_steps": 2, "max_length": 9, "encoder_norm_type": "PowerNorm", "overwrite_output_dir": True}
    task = Translation.from_options(**options)
    argv = ["--output_dir", str(tmp_path), "--learning_rate", "0.003", "--powernorm_alpha_bkw", "1", "--dropout",
            "0.1", "--checkpointing_steps", "2", "--max_length", "9", "--encoder_norm_type", "PowerNorm",
            "--overwrite_output_dir"]
    assert vars(task.args) == vars(Translation.check_options(Translation.build_parser().parse_args(argv)))
    assert task.args.max_source_length == 9 and task.args.encoder_norm_type == "powernorm"
    assert task.command_line == argv  # the model card's command
    with pytest.raises(TypeError, match=r"unknown options \['block_size'\]"):
        Translation.from_options(block_size=8)
