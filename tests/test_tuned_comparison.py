"""The tuned comparison at smoke size: every stage of the protocol on both tasks, the picks made on
validation only, the CSV's columns, resuming and reporting."""

import csv
import json
import shutil

import pytest

from hf_powernorm.studies import tuned_comparison

pytestmark = pytest.mark.usefixtures("reset_accelerate")


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_smoke_runs_every_stage_picks_on_validation_and_resumes(tmp_path):
    argv = ["--smoke", "--seeds", "1", "2", "--output_dir", str(tmp_path)]
    protocols = tuned_comparison.main(argv)
    sizes = tuned_comparison.SIZES["smoke"]
    for protocol in protocols:
        finals = [r for _, r in protocol.stages["final"]]
        checks = tuned_comparison._win_checks(protocol, finals)  # only where a PN row won
        assert list(protocol.stages) == ["lr", "alpha", "denominator", "recheck", "final"] + (["check"] if checks else [])
        assert [cell.name for cell, _ in protocol.stages.get("check", [])] == [cell.name for cell in checks]
        assert all(result is not None for cells in protocol.stages.values() for _, result in cells)
        task_sizes = sizes[protocol.task]
        base = 3 * len(task_sizes["learning_rates"]) * len(task_sizes["warmups"])
        lr_runs = [r for _, r in protocol.stages["lr"]]
        # A pick at the edge of the first grid adds the next rate beyond it, at every warmup.
        for norm in ("layernorm", "powernorm", "rmsnorm"):
            first = [r for r in lr_runs[:base] if r["norm"] == norm]
            rates = sorted(task_sizes["learning_rates"])
            picked = (min if tuned_comparison.LOWER_IS_BETTER[protocol.task] else max)(
                first, key=lambda r: r["best_validation"])["learning_rate"]
            added = {r["learning_rate"] for r in lr_runs[base:] if r["norm"] == norm}
            expected = {picked * 2} if picked == rates[-1] else {picked / 2} if picked == rates[0] else set()
            assert added == expected, (protocol.task, norm, added, expected)
        assert len(lr_runs) == base + len(task_sizes["warmups"]) * sum(
            1 for norm in ("layernorm", "powernorm", "rmsnorm") if any(r["norm"] == norm for r in lr_runs[base:]))
        # Each pick is the best validation of its stage, never a test score.
        lower = tuned_comparison.LOWER_IS_BETTER[protocol.task]
        for norm in ("layernorm", "rmsnorm"):
            runs = [r for r in lr_runs if r["norm"] == norm]
            best = (min if lower else max)(runs, key=lambda r: r["best_validation"])
            assert protocol.picks[f"{norm}@{protocol.short}"] == tuned_comparison._chosen(best)
        denominators = [r for _, r in protocol.stages["denominator"]]
        assert {r["denominator"] for r in denominators} == {"running", "batch"}
        assert protocol.picks[f"powernorm@{protocol.short}"] == tuned_comparison._chosen(
            (min if lower else max)(denominators, key=lambda r: r["best_validation"]))
        finals = [r for _, r in protocol.stages["final"]]
        norms = {"layernorm", "powernorm", "rmsnorm"} | ({"powernorm-all"} if protocol.task == "multi30k" else set())
        assert {(r["norm"], r["updates"], r["seed"]) for r in finals} == {
            (n, u, s) for n in norms for u in task_sizes["budgets"] for s in (1, 2)}
        # PN's warmup is the learning-rate warmup of its run.
        for _, result in protocol.stages["final"]:
            if result["norm"].startswith("powernorm"):
                config = json.loads(next((tmp_path / "cells" / result["cell"]).rglob("config.json")).read_text())
                assert config["powernorm_warmup_steps"] == result["warmup"]
    rows = read_rows(tmp_path / "results.csv")
    assert tuple(rows[0]) == tuned_comparison.COLUMNS
    assert {row["stage"] for row in rows} == {"tune", "final"}
    assert {row["task"] for row in rows} == {"ptb", "multi30k"}
    assert all(row["dropout"] == "0.3" and row["label_smoothing"] == "0.1" for row in rows)
    pn = [row for row in rows if row["norm"] == "powernorm"]
    assert all(row["alpha_fwd"] and row["alpha_bkw"] and row["denominator"] for row in pn)
    assert all(not row["alpha_fwd"] for row in rows if row["norm"] == "layernorm")
    assert any(row["metric"] == "bleu_averaged" and row["split"] == "test" for row in rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "| ptb |" in summary and "| multi30k |" in summary and "verdict" in summary
    assert (tmp_path / "curves_ptb_4.png").is_file() and (tmp_path / "curves_multi30k_4.png").is_file()
    picks = json.loads((tmp_path / "picks.json").read_text())
    assert set(picks) == {"ptb", "multi30k"}

    # Nothing reruns: each finished cell's result file is left as it was.
    stamps = {path: path.stat().st_mtime_ns for path in tmp_path.glob("cells/*/result.json")}
    tuned_comparison.main(argv)
    assert {path: path.stat().st_mtime_ns for path in tmp_path.glob("cells/*/result.json")} == stamps
    assert read_rows(tmp_path / "results.csv") == rows


def test_report_only_stops_at_the_first_unfinished_stage(tmp_path):
    tuned_comparison.main(["--smoke", "--tasks", "ptb", "--seeds", "1", "--output_dir", str(tmp_path)])
    # Remove one alpha-stage run: the later stages cannot be chosen, and report_only runs nothing.
    [protocol] = tuned_comparison.main(["--smoke", "--tasks", "ptb", "--seeds", "1", "--output_dir", str(tmp_path),
                                         "--report_only"])
    cell, _ = next(pair for pair in protocol.stages["alpha"] if pair[0].options["alpha_bkw"] == 1.0)
    (tmp_path / "cells" / cell.name / "result.json").unlink()
    [partial] = tuned_comparison.main(["--smoke", "--tasks", "ptb", "--seeds", "1", "--output_dir", str(tmp_path),
                                        "--report_only"])
    assert list(partial.stages) == ["lr", "alpha"]
    assert not (tmp_path / "cells" / cell.name / "result.json").exists()
    assert "alpha 1/2" in (tmp_path / "summary.md").read_text()


def test_export_is_a_record_that_resumes_the_study_elsewhere(tmp_path):
    argv = ["--smoke", "--tasks", "ptb", "--seeds", "1"]
    tuned_comparison.main([*argv, "--output_dir", str(tmp_path / "out")])
    stale = tmp_path / "export" / "cells" / "a-run-since-removed"
    stale.mkdir(parents=True)
    (tmp_path / "export" / "curves_ptb_8.png").write_bytes(b"a figure the outputs no longer have")
    tuned_comparison.main([*argv, "--output_dir", str(tmp_path / "out"), "--report_only",
                           "--export_dir", str(tmp_path / "export")])
    export = tmp_path / "export"
    assert not stale.exists()
    for name in (*tuned_comparison.OUTPUT_FILES, "curves_ptb_6.png"):
        assert (export / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name
    finished = sorted(path.parent.name for path in (tmp_path / "out").glob("cells/*/result.json"))
    assert sorted(path.parent.name for path in export.glob("cells/*/result.json")) == finished
    # Only validation records are kept: no checkpoints, no training-loss lines.
    assert {path.name for path in export.rglob("*") if path.is_file()} == {
        *tuned_comparison.OUTPUT_FILES, "curves_ptb_4.png", "curves_ptb_6.png", "result.json", "training_log.jsonl"}
    assert all('"validation"' in line for path in export.glob("cells/*/training_log.jsonl")
               for line in path.read_text().splitlines())

    # The record's cells in a new output folder: nothing reruns, the same outputs come back.
    shutil.copytree(export / "cells", tmp_path / "elsewhere" / "cells")
    stamps = {path: path.stat().st_mtime_ns for path in (tmp_path / "elsewhere").glob("cells/*/result.json")}
    tuned_comparison.main([*argv, "--output_dir", str(tmp_path / "elsewhere")])
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "elsewhere").glob("cells/*/result.json")} == stamps
    for name in ("results.csv", "curves.csv", "picks.json"):
        assert (tmp_path / "elsewhere" / name).read_bytes() == (export / name).read_bytes(), name


def test_a_budget_without_finals_loses_its_old_figure(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["smoke"], extensions=1, seeds=[1])
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    old = [tmp_path / f"curves_ptb_{updates}.png" for updates in protocol.sizes["budgets"]]
    for path in old:
        path.write_bytes(b"from finals a changed protocol no longer asks for")
    tuned_comparison._plot(protocol, tmp_path)
    assert not any(path.exists() for path in old)


def test_export_into_the_output_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--export_dir must differ"):
        tuned_comparison.parse_args(["--smoke", "--output_dir", str(tmp_path), "--export_dir", str(tmp_path / ".")])


@pytest.mark.parametrize("argv, message", [
    ([], "--data_dir"),
    (["--smoke", "--seeds", "2", "3"], "must include 1"),
    (["--data_dir", "/nonexistent", "--tasks", "multi30k"], "no Multi30k files"),
])
def test_bad_options_are_refused_before_any_run(argv, message, tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        tuned_comparison.parse_args([*argv, "--output_dir", str(tmp_path)])


def test_verdict_needs_a_difference_beyond_the_seed_spread():
    verdict = tuned_comparison.verdict
    assert verdict([100.0, 101.0, 102.0], [95.0, 96.0, 97.0], lower_is_better=True) == "PN better"
    assert verdict([100.0, 101.0, 102.0], [99.0, 101.0, 103.0], lower_is_better=True).startswith("tie")
    assert verdict([30.0, 31.0, 32.0], [26.0, 27.0, 28.0], lower_is_better=False) == "LN better"
    assert verdict([30.0], [26.0, 27.0], lower_is_better=False).startswith("fewer than 2 seeds")


def test_warmup_edge_rule_extends_the_warmup_then_the_rates_at_it(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2)
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    ran = []

    def run(norm, rate, warmup, bleu):
        cell = protocol.cell(tuned_comparison.setting(norm, rate, warmup), protocol.short)
        ran.append({"cell": cell.name, "norm": norm, "learning_rate": rate, "warmup": warmup, "best_validation": bleu})

    def extension():
        return sorted((c.options["norm"], c.options["learning_rate"], c.options["warmup"])
                      for c in tuned_comparison._warmup_extension(protocol, ran))

    for norm in tuned_comparison.NORMS:
        for rate in (1.5e-3, 3e-3, 6e-3):
            for warmup in (200, 600):
                run(norm, rate, warmup, 10.0 + rate * 1000 + warmup / 100 if norm != "rmsnorm" else 30.0 - warmup / 100)
    # LayerNorm and PN pick 6e-3 at 600, the longest warmup: that rate and its neighbours at 1,200;
    # RMSNorm (level across rates: the first in grid order) picks 1.5e-3 at the shortest, 200: at 100.
    assert extension() == sorted([(norm, rate, 1200) for norm in ("layernorm", "powernorm")
                                  for rate in (3e-3, 6e-3, 1.2e-2)]
                                 + [("rmsnorm", rate, 100) for rate in (7.5e-4, 1.5e-3, 3e-3)])
    for norm in ("layernorm", "powernorm"):
        for rate, bleu in ((3e-3, 20.0), (6e-3, 25.0), (1.2e-2, 40.0 if norm == "layernorm" else 22.0)):
            run(norm, rate, 1200, bleu)
    for rate in (7.5e-4, 1.5e-3, 3e-3):
        run("rmsnorm", rate, 100, 1.0)
    # 2,400 would not be below the 2,000-update budget; LayerNorm's pick at 1,200 is the highest rate
    # run there: one more beyond it; PN's (6e-3 at 1,200) lies inside; RMSNorm's stays at 200.
    assert extension() == [("layernorm", 2.4e-2, 1200)]
    run("layernorm", 2.4e-2, 1200, 39.0)
    assert extension() == []
    # One warmup in the grid (the smoke sizes): no edge to extend.
    smoke = tuned_comparison.Protocol("multi30k", tuned_comparison.argparse.Namespace(
        sizes=tuned_comparison.SIZES["smoke"], extensions=1), {}, tmp_path)
    assert tuned_comparison._warmup_extension(smoke, ran) == []
    assert tuned_comparison.WARMUP_EDGE_TASKS == ("multi30k",)


def test_a_pn_win_is_checked_without_pns_own_tuning(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3])
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    tuned = tuned_comparison.setting("powernorm", 3e-3, 1200, 0.99, 1.0, "batch")
    protocol.picks = {"powernorm@2000": tuned, "powernorm@4000": {**tuned, "alpha_fwd": 0.9, "alpha_bkw": 0.9,
                                                                   "denominator": "running"}}

    def finals(updates, averaged, best=None):  # test BLEU of the averaged and of the best checkpoint
        best = best or averaged
        return [{"norm": norm, "updates": updates, "seed": seed, "test_bleu_averaged": averaged[norm] + seed / 10,
                 "test_bleu": best[norm] + seed / 10} for norm in averaged for seed in (1, 2, 3)]

    # At 2,000 updates PN beats LayerNorm beyond the seed spread and PN in every layer ties; at 4,000
    # PN wins too, but its pick there has stage 1's options already: nothing to check.
    results = finals(2000, {"layernorm": 25.0, "powernorm": 27.0, "powernorm-all": 25.1}) + finals(
        4000, {"layernorm": 25.0, "powernorm": 28.0})
    checks = tuned_comparison._win_checks(protocol, results)
    assert [(c.options["norm"], c.options["updates"], c.options["seed"], c.options["learning_rate"],
             c.options["warmup"], c.options["alpha_fwd"], c.options["alpha_bkw"], c.options["denominator"])
            for c in checks] == [("powernorm", 2000, seed, 3e-3, 1200, 0.9, 0.9, "running") for seed in (1, 2, 3)]
    # LayerNorm ahead, or a tie: no check.
    assert tuned_comparison._win_checks(protocol, finals(2000, {"layernorm": 27.0, "powernorm": 25.0})) == []
    assert tuned_comparison._win_checks(protocol, finals(2000, {"layernorm": 25.0, "powernorm": 25.05})) == []
    # A win on either headline score is checked: here on the best checkpoint's only.
    checks = tuned_comparison._win_checks(protocol, finals(2000, {"layernorm": 25.0, "powernorm": 24.0},
                                                           {"layernorm": 25.0, "powernorm": 27.0}))
    assert [(c.options["norm"], c.options["seed"]) for c in checks] == [("powernorm", seed) for seed in (1, 2, 3)]
    # A row is checked only once its finals and LayerNorm's are in at every seed: a verdict on two
    # seeds may still turn. Rows still running do not hold back a row that is in.
    won = finals(2000, {"layernorm": 25.0, "powernorm": 27.0})
    assert tuned_comparison._win_checks(protocol, [r for r in won if (r["norm"], r["seed"]) != ("powernorm", 3)]) == []
    assert tuned_comparison._win_checks(protocol, [r for r in won if (r["norm"], r["seed"]) != ("layernorm", 1)]) == []
    running = finals(2000, {"powernorm-all": 30.0})[:2]  # PN in every layer: 2 seeds of 3, far ahead
    checks = tuned_comparison._win_checks(protocol, won + running)
    assert [(c.options["norm"], c.options["seed"]) for c in checks] == [("powernorm", seed) for seed in (1, 2, 3)]


def test_the_multi30k_headline_scores_the_average_and_the_best_checkpoint(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3])
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    results = [{"norm": norm, "updates": 2000, "seed": seed, "test_bleu_averaged": averaged + seed / 10,
                "test_bleu": best + seed / 10}
               for norm, averaged, best in (("layernorm", 25.0, 28.0), ("powernorm", 21.0, 28.1),
                                            ("rmsnorm", 24.0, 27.0)) for seed in (1, 2, 3)]
    protocol.stages["final"] = [(None, result) for result in results]
    lines = tuned_comparison.headline([protocol])
    assert len(lines) == 4  # the header, its rule and one row per score (no 4,000-update finals)
    averaged, best = (line.split(" | ") for line in lines[2:])
    assert "average of the last checkpoints" in averaged[3] and averaged[4:7] == [
        "25.20 ± 0.10 (3 seeds)", "21.20 ± 0.10 (3 seeds)", "24.20 ± 0.10 (3 seeds)"]
    assert averaged[7:] == ["-4.00", "LN better |"]
    assert "best validated checkpoint" in best[3] and best[7:] == ["+0.10", "tie (within seed spread) |"]
    # PN in every layer and stage 6's checks: a row each under each score, against the same LayerNorm.
    more = [{"norm": norm, "updates": 2000, "seed": seed, "test_bleu_averaged": 26.0 + seed / 10,
             "test_bleu": 29.0 + seed / 10} for norm in ("powernorm-all", "powernorm") for seed in (1, 2, 3)]
    protocol.stages["final"] += [(None, result) for result in more[:3]]
    protocol.stages["check"] = [(None, result) for result in more[3:]]
    rows = [line.split(" | ") for line in tuned_comparison.headline([protocol])[2:]]
    assert [(row[2].startswith("as above"), row[4], row[7], row[8]) for row in rows] == [
        (False, "25.20 ± 0.10 (3 seeds)", "-4.00", "LN better |"),
        (True, "25.20 ± 0.10 (3 seeds)", "+1.00", "PN better |"),
        (True, "25.20 ± 0.10 (3 seeds)", "+1.00", "PN better |"),
        (False, "28.20 ± 0.10 (3 seeds)", "+0.10", "tie (within seed spread) |"),
        (True, "28.20 ± 0.10 (3 seeds)", "+1.00", "PN better |"),
        (True, "28.20 ± 0.10 (3 seeds)", "+1.00", "PN better |")]
    assert "every layer" in rows[1][2] and "stage 1's options" in rows[2][2] and rows[1][6] == "-"


def test_the_summary_gives_each_finals_score_seed_by_seed(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2])
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    protocol.stages["final"] = [(None, {"norm": norm, "updates": 1500, "seed": seed, "test_perplexity": value})
                                for norm, seed, value in (("layernorm", 1, 84.5), ("powernorm", 1, 85.25),
                                                          ("rmsnorm", 1, 84.0), ("layernorm", 2, 86.0),
                                                          ("powernorm", 2, 85.5))]
    rows = [line.split(" | ") for line in tuned_comparison.per_seed([protocol])[2:]]
    assert [row[3:] for row in rows] == [["1", "84.50", "85.25", "84.00", "-", "+0.75 |"],
                                         ["2", "86.00", "85.50", "-", "-", "-0.50 |"]]
    assert all(row[1] == "1500" and "test perplexity" in row[2] for row in rows)


def test_a_long_budget_pick_at_the_edge_of_its_rechecked_rates_gets_the_next_rate(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2)
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    pn = tuned_comparison.setting("powernorm", 3e-3, 1200, 0.95, 1.0, "running")
    ln = tuned_comparison.setting("layernorm", 6e-3, 600)
    ran = []

    def run(chosen, rate, bleu):
        cell = protocol.cell({**chosen, "learning_rate": rate}, protocol.long)
        ran.append({"cell": cell.name, **chosen, "learning_rate": rate, "best_validation": bleu})

    def extension():
        return [(c.options["norm"], c.options["learning_rate"], c.options["warmup"], c.options["alpha_fwd"],
                 c.options["updates"]) for c in tuned_comparison._recheck_extension(protocol, ran)]

    # Multi30k's re-check as it ran: LayerNorm's middle rate best, PN's highest.
    for rate, bleu in ((3e-3, 33.39), (6e-3, 34.31), (1.2e-2, 32.09)):
        run(ln, rate, bleu)
    for rate, bleu in ((1.5e-3, 30.33), (3e-3, 33.86), (6e-3, 34.78)):
        run(pn, rate, bleu)
    assert extension() == [("powernorm", 1.2e-2, 1200, 0.95, 4000)]
    run(pn, 1.2e-2, 35.0)  # better again: one more beyond
    assert extension() == [("powernorm", 2.4e-2, 1200, 0.95, 4000)]
    run(pn, 2.4e-2, 20.0)  # worse: the pick lies inside its rates now
    assert extension() == []
    # The lowest rate picked: half of it; the same rule for LayerNorm.
    ran[:3] = []
    for rate, bleu in ((3e-3, 35.0), (6e-3, 34.31), (1.2e-2, 32.09)):
        run(ln, rate, bleu)
    assert extension() == [("layernorm", 1.5e-3, 600, None, 4000)]
