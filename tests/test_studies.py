"""The studies at smoke size: each runs end to end on the embedded corpus, writes its CSV, PNG and
markdown summary, and a second call resumes without redoing a finished run."""

import csv

import pytest

from recipe_scripts import load_recipe

warmup_switch = load_recipe("studies/warmup_switch")

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


converted_models = load_recipe("studies/converted_models")


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
