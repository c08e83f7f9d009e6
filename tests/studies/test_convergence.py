"""The convergence study (protocol 3) at smoke size: its runs seed by seed, each arm at the tuned
comparison's 4,500-update picks, a seed-1 run drawing its dropout afresh, early stopping by patience,
the verdicts over the family of 2, resuming and the export; and its picks held equal to the tuned
comparison's record."""

import csv
import json
from pathlib import Path

import pytest

from hf_powernorm.studies import convergence, tuned_comparison

pytestmark = pytest.mark.usefixtures("reset_accelerate")
ROOT = Path(__file__).resolve().parents[2]


def test_the_picks_are_the_tuned_comparisons_ptb_picks_at_4500_updates():
    picks = json.loads((ROOT / "results" / "tuned_comparison" / "picks.json").read_text(encoding="utf-8"))["ptb"]
    for arm in convergence.ARMS:
        assert convergence.PICKS[arm] == picks[f"{arm}@4500"], arm


def test_smoke_runs_every_arm_and_seed_verdicts_resume_and_export(tmp_path, monkeypatch):
    output, export = tmp_path / "out", tmp_path / "export"
    argv = ["--smoke", "--seeds", "1", "2", "3", "--output_dir", str(output), "--export_dir", str(export)]
    results = convergence.main(argv)
    assert [(r["norm"], r["seed"]) for r in results] == [(arm, seed) for seed in (1, 2, 3) for arm in convergence.ARMS]
    sizes = convergence.SIZES["smoke"]
    for result in results:
        assert result["final"] and result["updates"] == sizes["cap"] and "test_perplexity" in result
        assert result.get("dropout_seed") == (1001 if result["seed"] == 1 else None)
    with open(output / convergence.RESULTS_CSV, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 9 and {row["stopped_by"] for row in rows} <= {"rule", "cap"}
    summary = (output / convergence.SUMMARY_MD).read_text(encoding="utf-8")
    assert "9 of 9 runs finished" in summary and summary.count("| 3 | ") >= 2  # two verdict rows of 3 pairs
    assert (output / convergence.FIGURE).is_file()
    assert sorted(p.name for p in (export / "cells").iterdir()) == sorted(r["cell"] for r in results)
    # Resumed: nothing runs again, the same outputs come back.
    monkeypatch.setattr(convergence, "run_cell", lambda cell, folder: pytest.fail(f"{cell.name} ran again"))
    assert convergence.main(argv) == results
    assert (output / convergence.SUMMARY_MD).read_text(encoding="utf-8") == summary


def _run(arm, seed, test, stopped=12000, best=9000):
    return {"norm": arm, "seed": seed, "train_steps": stopped, "best_step": best, "best_validation": test + 5,
            "test_perplexity": test, "test_word_perplexity": 3 * test, "cpu_seconds": 3600.0}


def test_the_stopping_rule_and_the_cap_are_told_apart():
    sizes = convergence.SIZES["real"]
    assert convergence.stopped_by(_run("layernorm", 1, 70, stopped=8500, best=6500), sizes) == "rule"
    assert convergence.stopped_by(_run("layernorm", 1, 70, stopped=12000, best=11500), sizes) == "cap"
    # At the cap with its best 2,000 updates behind: the rule would have stopped it there too.
    assert convergence.stopped_by(_run("layernorm", 1, 70, stopped=12000, best=10000), sizes) == "rule"


def test_verdicts_are_paired_by_seed_with_holm_over_the_two_arms():
    pn, authors = convergence.ARMS[1:]
    runs = ([_run("layernorm", s, 70 + s) for s in range(1, 6)]
            + [_run(pn, s, 70.5 + s + 0.01 * s) for s in range(1, 6)]  # behind on every seed
            + [_run(authors, s, 70 + s + (-1) ** s * 0.3) for s in range(1, 6)])  # no difference shown
    found = {v["arm"]: v for v in convergence.verdicts(convergence.rows(runs, convergence.SIZES["real"]))}
    assert found[pn]["verdict"].better == "baseline" and found[authors]["verdict"].better == "neither"
    assert found[pn]["verdict"].interval.mean == pytest.approx(0.53)
    assert found[pn]["detectable"] is not None and found[pn]["detectable"] > 0
    # Holm over the 2: the smaller p-value is doubled.
    p_values = sorted(v["verdict"].interval.p_value for v in found.values())
    assert min(v["verdict"].adjusted_p for v in found.values()) == pytest.approx(min(1.0, 2 * p_values[0]))
    # Two pairs are fewer than a verdict needs: none, and no detectable difference.
    few = convergence.verdicts(convergence.rows(runs[:2] + runs[5:7], convergence.SIZES["real"]))
    assert few[0]["verdict"].better is None and few[0]["detectable"] is None


def test_protocol_and_study_agree():
    protocol = (ROOT / "docs" / "protocol_convergence.md").read_text(encoding="utf-8")
    sizes = convergence.SIZES["real"]
    assert f"every {sizes['eval_steps']} updates" in protocol
    assert f"{sizes['patience'] * sizes['eval_steps']:,} updates" in protocol
    assert f"{sizes['cap']:,} updates" in protocol
    assert convergence.SEEDS == (1, 2, 3, 4, 5) and tuned_comparison.FRESH_DRAW == 1000
