"""The studies at smoke size: each runs end to end on the embedded corpus, writes its CSV, PNG and
markdown summary, and a second call resumes without redoing a finished run."""

import csv
import math

import pytest
import torch

from hf_powernorm.studies import (
    batch_size,
    batch_statistics,
    converted_models,
    long_run,
    norm_comparison,
    phrasebank_norms,
    pn_ablation,
    warmup_switch,
)
from hf_powernorm.studies.runs import STUDY_LM

pytestmark = pytest.mark.usefixtures("reset_accelerate")


def test_warmup_switch_smoke_writes_its_outputs_and_resumes(tmp_path):
    settings = ["layernorm", "pn-cumulative", "pn-reference-ramp"]
    argv = ["--smoke", "--seeds", "1", "--settings", *settings, "--output_dir", str(tmp_path)]
    results = warmup_switch.main(argv)
    assert [r["setting"] for r in results] == settings
    with open(tmp_path / "results.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["setting"] for r in rows] == settings
    for row in rows:
        assert float(row["test_perplexity"]) < 120  # below a uniform guess over the 120-token vocabulary
        assert float(row["loss_peak_excess"]) >= float(row["loss_jump"]) - 1e-9 or row["loss_jump"] == "nan"
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {s} |" in summary for s in settings)
    assert (tmp_path / "loss_at_switch.png").stat().st_size > 10_000
    # The PN runs used the options of their setting (the ramp is counted in forward passes).
    config = (tmp_path / "cells" / "pn-reference-ramp-seed1" / "best_model" / "config.json").read_text()
    assert '"powernorm_warmup_statistic": "reference"' in config and '"powernorm_warmup_ramp_steps": 2' in config
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*/result.json")}
    again = warmup_switch.main(argv)
    assert again == results and {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing redone


def test_loss_jump_is_measured_around_the_first_update_after_warmup():
    losses = {s: 5.0 for s in range(1, 21)} | {s: 6.0 for s in range(21, 31)} | {s: 5.5 for s in range(31, 71)}
    jump = warmup_switch.loss_jump(losses, warmup_steps=20)
    assert jump == {"loss_jump": pytest.approx(1.0), "loss_peak_excess": pytest.approx(1.0)}


@pytest.mark.slow  # four recipe processes: about 30 s on an idle 2-core machine, minutes on a busy one
def test_converted_models_smoke_runs_both_norms_from_the_same_weights(tmp_path):
    results = converted_models.main(["--smoke", "--seeds", "1", "--output_dir", str(tmp_path)])
    assert sorted((r["task"], r["norm"]) for r in results) == sorted(
        (task, norm) for task in converted_models.TASKS for norm in ("layernorm", "powernorm"))
    assert all(r["train_steps"] == 3 for r in results)
    for result in results:
        config = (tmp_path / "cells" / result["cell"] / "run" / "config.json").read_text()
        assert f'"norm_type": "{result["norm"]}"' in config
    summary = (tmp_path / "summary.md").read_text()
    assert "| bert-classification (test_accuracy) | powernorm |" in summary


def test_batch_statistics_smoke_records_every_norm_and_resumes(tmp_path):
    argv = ["--smoke", "--seeds", "1", "--output_dir", str(tmp_path)]
    results = batch_statistics.main(argv)
    assert [(r["model"], r["norm"]) for r in results] == [
        *(("lm", norm) for norm in batch_statistics.LM_NORMS), ("cnn", "batchnorm")]
    by_run = {f"{r['model']}-{r['norm']}": r for r in results}
    # Running-mean distances exist for batch norms only; the quadratic-mean ones for PN-V and PN only.
    assert by_run["lm-batchnorm"]["rel_dist_mean_median"] > 0 and by_run["cnn-batchnorm"]["rel_dist_var_median"] > 0
    assert math.isnan(by_run["lm-powernorm"]["rel_dist_mean_median"]) and by_run["lm-powernorm"]["rel_dist_psi2_median"] > 0
    assert by_run["cnn-batchnorm"]["first_layer"] == "norm1"
    assert by_run["lm-layernorm"]["first_layer"].endswith("layers.0.self_attn_norm")
    for norm in batch_statistics.LM_NORMS:
        run = by_run[f"lm-{norm}"]
        values = (tmp_path / "cells" / run["cell"] / "singular_values.csv").read_text().splitlines()[1:]
        assert len(values) == min(120, STUDY_LM["hidden_size"])  # (vocabulary, hidden) embeddings
        assert float(values[0].split(",")[1]) == 1.0 and 1 < run["effective_rank"] <= len(values)
        assert run["test_perplexity"] < 120
    with open(tmp_path / "statistics.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["run"] for r in rows} == set(by_run)
    assert {int(r["step"]) for r in rows if r["run"] == "lm-powernorm"} == {2, 4, 6, 8, 10, 12}
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {run} |" in summary for run in by_run)
    for figure in ("figure2_3", "figure4", "figure6", "figure7"):
        assert (tmp_path / f"{figure}.png").stat().st_size > 10_000
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*/result.json")}
    assert batch_statistics.main(argv) == results
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing redone


def test_singular_value_summary_of_a_known_spectrum():
    matrix = torch.diag(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    values = batch_statistics.normalized_singular_values(matrix)
    assert values == pytest.approx([1.0, 0.5, 0.25, 0.25])
    summary = batch_statistics.singular_value_summary([1.0] * 8)
    assert summary["sv_8"] == 1.0 and summary["effective_rank"] == pytest.approx(8.0)


def test_norm_comparison_smoke_runs_both_tasks_and_reports_partial_grids(tmp_path):
    argv = ["--smoke", "--seeds", "1", "--settings", "layernorm", "powernorm", "--output_dir", str(tmp_path)]
    results = norm_comparison.main(argv)
    assert [(r["task"], r["setting"]) for r in results] == [
        ("ptb", "layernorm"), ("ptb", "powernorm"), ("multi30k", "layernorm"), ("multi30k", "powernorm")]
    for result in results:
        folder = tmp_path / "cells" / result["cell"]
        config = ((folder / "run") if result["task"] == "multi30k" else folder / "best_model") / "config.json"
        norm = "powernorm" if result["setting"] == "powernorm" else "layernorm"
        assert f'"encoder_norm_type": "{norm}"' in config.read_text()
        assert norm_comparison.validation_curve(tmp_path, result)  # the curve of every run is read back
    assert all(r["test_perplexity"] < 120 for r in results if r["task"] == "ptb")
    assert all(0 <= r["test_bleu"] <= 100 for r in results if r["task"] == "multi30k")
    summary = (tmp_path / "summary.md").read_text()
    assert "| powernorm | 1 |" in summary and (tmp_path / "curves_ptb.png").stat().st_size > 10_000
    assert summary.count("validation change, last quarter (%)") == 2  # a column in both tasks' tables
    with open(tmp_path / "curves.csv", encoding="utf-8") as handle:
        assert {(r["task"], r["setting"]) for r in csv.DictReader(handle)} == {
            (r["task"], r["setting"]) for r in results}
    # A grid with unfinished runs reports the finished ones and runs nothing.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*/result.json")}
    partial = norm_comparison.main([*argv[:-2], "--seeds", "1", "2", "--report_only", "--output_dir", str(tmp_path)])
    assert partial == results and {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert not any((tmp_path / "cells").glob("*seed2"))
    # Another budget over the same folder is refused, not mixed in (nor described as the runs' budget).
    with pytest.raises(ValueError, match=r"ptb-layernorm-seed1 finished with other options .*'max_train_steps': 9"):
        norm_comparison.main([*argv, "--ptb_steps", "9", "--report_only"])
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_last_quarter_change_measures_whether_validation_has_flattened():
    change = norm_comparison.last_quarter_change
    assert change([(250, 1.0), (500, 10.0), (750, 20.0), (1000, 22.0)]) == pytest.approx(10.0)  # 750 -> 1000
    # 1,500 updates validated every 150: 1,050 and 1,200 are as near to 1,125; the later one counts.
    curve = [(step, 300.0 - step / 10) for step in range(150, 1501, 150)]
    assert change(curve) == pytest.approx(100 * (150.0 - 180.0) / 180.0)
    assert change([(600, 5.0), (1200, 5.0)]) == 0.0 and math.isnan(change([(600, 5.0)]))


def test_pn_ablation_smoke_changes_one_option_at_a_time(tmp_path):
    settings = ["layernorm", "pn-default", "warmup=0", "alpha_bkw=0.99", "cumulative-ramp"]
    results = pn_ablation.main(["--smoke", "--seeds", "1", "--settings", *settings, "--output_dir", str(tmp_path)])
    assert [r["setting"] for r in results] == settings
    configs = {r["setting"]: (tmp_path / "cells" / r["cell"] / "best_model" / "config.json").read_text()
               for r in results}
    assert '"encoder_norm_type": "layernorm"' in configs["layernorm"]
    assert '"powernorm_warmup_steps": 4' in configs["pn-default"] and '"powernorm_warmup_steps": 0' in configs["warmup=0"]
    assert '"powernorm_alpha_bkw": 0.99' in configs["alpha_bkw=0.99"] and '"powernorm_alpha_bkw": 0.9' in configs["pn-default"]
    assert '"powernorm_warmup_ramp_steps": 2' in configs["cumulative-ramp"]
    by_setting = {r["setting"]: r for r in results}
    assert math.isnan(by_setting["warmup=0"]["loss_jump"]) and math.isfinite(by_setting["pn-default"]["loss_jump"])
    summary = (tmp_path / "summary.md").read_text()
    assert f"`{pn_ablation.best_setting(results)}`" in summary and (tmp_path / "ablation.png").stat().st_size > 5_000
    assert "| pn-default | 1 |" in summary
    # A grid with unfinished runs reports the finished ones and runs nothing.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*/result.json")}
    partial = pn_ablation.main(["--smoke", "--seeds", "1", "2", "--settings", *settings, "--report_only",
                                "--output_dir", str(tmp_path)])
    assert partial == results and {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert not any((tmp_path / "cells").glob("*seed2")) and "seeds [1];" in (tmp_path / "summary.md").read_text()


def test_pn_ablation_warmup_settings_follow_the_run_size():
    sizes = {"warmup_steps": 150, "max_train_steps": 600}
    assert pn_ablation.setting_argv("warmup=half-run", sizes) == (
        ["--norm_type", "powernorm", "--powernorm_warmup_steps", "300"], 300)
    flags, warmup = pn_ablation.setting_argv("cumulative-ramp", sizes)
    assert warmup == 150 and flags[flags.index("--powernorm_warmup_ramp_steps") + 1] == "75"
    assert pn_ablation.setting_argv("layernorm", sizes) == (["--norm_type", "layernorm"], 150)


def test_pn_ablation_runs_settings_that_coincide_at_the_budget_once(tmp_path):
    assert pn_ablation.same_runs(pn_ablation.parse_args([])) == {"warmup=half-run": "warmup=double"}
    assert pn_ablation.same_runs(pn_ablation.parse_args(["--max_train_steps", "1500"])) == {}
    # 8 smoke updates: half the run is PN's default warmup of 4 updates.
    results = pn_ablation.main(["--smoke", "--max_train_steps", "8", "--seeds", "1", "--settings", "pn-default",
                                "warmup=half-run", "--output_dir", str(tmp_path)])
    assert [r["setting"] for r in results] == ["pn-default"] and not any((tmp_path / "cells").glob("warmup*"))
    with open(tmp_path / "results.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["setting"], r["same_runs_as"]) for r in rows] == [("pn-default", ""), ("warmup=half-run", "pn-default")]
    assert rows[0]["test_perplexity"] == rows[1]["test_perplexity"]
    assert "| warmup=half-run (the runs of pn-default) | 1 |" in (tmp_path / "summary.md").read_text()


def test_batch_size_smoke_keeps_the_update_and_varies_the_statistics_batch(tmp_path):
    argv = ["--smoke", "--seeds", "1", "--norms", "layernorm", "powernorm", "--accumulations", "8", "1",
            "--output_dir", str(tmp_path)]
    results = batch_size.main(argv)
    assert [(r["norm"], r["mini_batch"], r["accumulation"]) for r in results] == [
        ("layernorm", 16, 8), ("powernorm", 16, 8), ("layernorm", 128, 1), ("powernorm", 128, 1)]
    for result in results:
        folder = tmp_path / "cells" / result["cell"]
        assert result["train_steps"] == 8 and sum("loss" in line for line in open(folder / "training_log.jsonl")) == 8
    # PN's warmup counts forward passes: the same 2 updates are 16 passes of 16 tokens.
    config = lambda cell: (tmp_path / "cells" / cell / "best_model" / "config.json").read_text()  # noqa: E731
    assert '"powernorm_warmup_steps": 16' in config("powernorm-mb16-seed1")
    assert '"powernorm_warmup_steps": 2' in config("powernorm-mb128-seed1")
    assert "| powernorm |" in (tmp_path / "summary.md").read_text()
    # Reporting with a norm none of whose runs has finished leaves it out of the figure and the table's cells.
    (tmp_path / "batch_size.png").unlink()
    partial = batch_size.main([*argv[:4], "layernorm", "powernorm", "batchnorm", *argv[6:], "--report_only"])
    assert partial == results and not any((tmp_path / "cells").glob("batchnorm*"))
    assert "| batchnorm | - | - |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "batch_size.png").stat().st_size > 5_000
    with pytest.raises(ValueError, match="--accumulations 3"):
        batch_size.parse_args(["--smoke", "--accumulations", "3"])


def test_long_run_smoke_trains_in_both_precisions(tmp_path):
    argv = ["--smoke", "--seeds", "1", "--settings", "pn-no-group-scaling", "--hidden_size", "64", "--layers", "1",
            "--precisions", "fp32", "bf16", "--output_dir", str(tmp_path)]
    results = long_run.main(argv)
    assert [(r["setting"], r["precision"]) for r in results] == [("pn-no-group-scaling", "fp32"),
                                                                  ("pn-no-group-scaling", "bf16")]
    assert all(r["first_nonfinite_update"] is None and r["train_steps"] == 10 for r in results)
    config = (tmp_path / "cells" / results[0]["cell"] / "best_model" / "config.json").read_text()
    assert '"powernorm_group_num": null' in config
    assert all(f'"{key}": {value}' in config for key, value in (("hidden_size", 64), ("decoder_layers", 1),
                                                                ("num_attention_heads", 2), ("intermediate_size", 256)))
    with pytest.raises(ValueError, match="--hidden_size must be a positive multiple of 32; got 48"):
        long_run.main([*argv, "--hidden_size", "48"])
    losses = [long_run.training_losses(tmp_path / "cells" / r["cell"]) for r in results]
    assert losses[0].keys() == losses[1].keys() and losses[0] != losses[1]  # bf16 autocast changed the numbers
    assert "| pn-no-group-scaling | bf16 | 1 | none |" in (tmp_path / "summary.md").read_text()


def test_long_run_stability_finds_the_first_nonfinite_update():
    losses = {1: 5.0, 2: 4.0, 3: 6.0, 4: None, 5: 3.0}
    assert long_run.stability(losses, warmup_steps=1) == {
        "first_nonfinite_update": 4, "max_loss_after_warmup": 6.0, "final_train_loss": 4.5}
    assert long_run.stability({1: 5.0, 2: 4.0}, warmup_steps=1)["first_nonfinite_update"] is None


def test_mean_std_leaves_out_missing_runs_and_shows_diverged_ones():
    from hf_powernorm.training.reports import mean_std

    assert mean_std([1.0, 2.0], 3) == "1.500 ± 0.707" and mean_std([1.0]) == "1.00"
    assert mean_std([1.234e-5, 1.3e-5, None], 3, significant=True) == "1.27e-05 ± 4.7e-07"
    assert mean_std([None, float("nan")]) == "-"
    assert mean_std([float("inf"), 1.0]) == "inf ± nan"  # a diverged seed is not averaged away


def test_write_rows_keeps_chosen_columns_in_order_and_leaves_missing_cells_empty(tmp_path):
    from hf_powernorm.training.reports import write_rows

    rows = [{"seed": 1, "setting": "pn", "loss": 2.5, "noise": "x"}, {"setting": "ln", "seed": 2, "extra": 7}]
    write_rows(rows, tmp_path / "all.csv", leave_out=["noise"])
    with open(tmp_path / "all.csv", newline="", encoding="utf-8") as handle:
        assert list(csv.reader(handle)) == [["seed", "setting", "loss", "extra"], ["1", "pn", "2.5", ""],
                                             ["2", "ln", "", "7"]]
    write_rows(rows, tmp_path / "chosen.csv", columns=["setting", "loss", "seed", "noise"], leave_out=["noise"])
    with open(tmp_path / "chosen.csv", newline="", encoding="utf-8") as handle:
        assert list(csv.reader(handle)) == [["setting", "loss", "seed"], ["pn", "2.5", "1"], ["ln", "", "2"]]


def test_seeds_of_lists_each_seed_with_a_run_once_in_order():
    from hf_powernorm.training.reports import seeds_of

    assert seeds_of([{"seed": 3}, {"seed": 1}, {"seed": 3}, {"seed": 2}]) == [1, 2, 3]
    assert seeds_of([]) == []


# --------------------------------------------------------------------------------------------
# Data as users give it: no default corpus path, the recipes' data options
# --------------------------------------------------------------------------------------------

def _text_files(folder, sizes=(("train", 120), ("validation", 20), ("test", 20))):
    from hf_powernorm.training import synthetic_lm_corpus

    corpus = synthetic_lm_corpus(dict(sizes), seed=7)
    files = {}
    for split, part in corpus.items():
        files[split] = folder / f"{split}.txt"
        files[split].write_text("".join(line + "\n" for line in part["text"]), encoding="utf-8")
    return files


def test_lm_study_trains_on_the_users_files_or_a_load_dataset_folder(tmp_path):
    files = _text_files(tmp_path)
    argv = ["--smoke", "--seeds", "1", "--settings", "layernorm", "--max_train_steps", "2"]
    given = ["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
             "--test_file", str(files["test"])]
    [result] = warmup_switch.main([*argv, *given, "--output_dir", str(tmp_path / "files")])
    assert result["files"] == {split: str(path.resolve()) for split, path in files.items()}
    # `--dataset_name` takes whatever `datasets.load_dataset` reads: here a local folder of text files.
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text(files["train"].read_text(encoding="utf-8"), encoding="utf-8")
    [result] = warmup_switch.main([*argv, "--dataset_name", str(folder), "--output_dir", str(tmp_path / "hub")])
    assert sorted(result["files"]) == ["test", "train", "validation"]  # carved out of train
    assert result["test_perplexity"] > 1


def test_study_without_data_options_names_them_and_only_smoke_uses_the_embedded_corpus(tmp_path):
    from hf_powernorm.studies.runs import lm_split_files

    with pytest.raises(ValueError, match="--data_dir .*--train_file/--validation_file/--test_file.*--dataset_name"):
        warmup_switch.main(["--seeds", "1", "--output_dir", str(tmp_path / "none")])
    assert not (tmp_path / "none" / "cells").exists()
    with pytest.raises(ValueError, match="also pass --test_file"):
        lm_split_files(None, tmp_path, False, data_files={"train": "a.txt", "validation": "b.txt"})
    assert lm_split_files(None, tmp_path, True)["train"].endswith("smoke.train.txt")
    with pytest.raises(ValueError, match="--tasks multi30k needs --data_dir"):
        norm_comparison.parse_args(["--tasks", "multi30k"])
    with pytest.raises(ValueError, match="no PTB data: pass --data_dir"):
        norm_comparison.parse_args(["--tasks", "ptb"])
    with pytest.raises(ValueError, match="pass --phrasebank_file .* or --data_dir"):
        phrasebank_norms.parse_args([])
    from hf_powernorm.benchmarks import data as bench_data

    with pytest.raises(SystemExit):
        bench_data.main([])


def test_no_study_or_benchmark_defaults_to_a_path_outside_the_project():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("recipes/**/*.py"), *root.glob("hf_powernorm/**/*.py")]
    assert sources
    assert not [str(p.relative_to(root)) for p in sources if "../shared" in p.read_text(encoding="utf-8")]
