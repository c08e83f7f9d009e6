"""The tuned comparison at smoke size: every stage of the protocol on its three tasks, the picks made on
validation only, the CSV's columns, resuming and reporting."""

import csv
import json
import re
import shutil

import math
import types

import pytest

from hf_powernorm.studies import tuned_comparison
from hf_powernorm.training import reports
from hf_powernorm.training import statistics
from hf_powernorm.training.executors import ExecutorSettings

pytestmark = pytest.mark.usefixtures("reset_accelerate")


def read_rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


SMOKE = ["--smoke", "--seeds", "1", "2", "--long_seeds", "1", "2", "3"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The whole study at smoke size, once for the tests that read it: (argv, output folder, protocols)."""
    from accelerate.state import AcceleratorState

    output = tmp_path_factory.mktemp("smoke")
    argv = [*SMOKE, "--output_dir", str(output)]
    protocols = tuned_comparison.main(argv)
    AcceleratorState._reset_state(reset_partial_state=True)
    return argv, output, protocols


@pytest.mark.slow
def test_smoke_runs_every_stage_picks_on_validation_and_resumes(smoke):
    argv, tmp_path, protocols = smoke
    sizes = tuned_comparison.SIZES["smoke"]
    assert [protocol.task for protocol in protocols] == ["ptb", "multi30k", "tinyshakespeare"]
    for protocol in protocols[:2]:
        long_elementwise = ["recheck-elementwise"] if protocol.long in protocol.elementwise_budgets() else []
        assert list(protocol.stages) == ["lr", "alpha", "denominator", "recheck", "final", "lr-elementwise",
                                         "alpha_init", *long_elementwise]
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
        # Every arm is re-checked at the long budget, PN at the authors' alphas included.
        rechecked = [r for _, r in protocol.stages["recheck"]]
        assert {r["norm"] for r in rechecked} == set(tuned_comparison.RECHECKED)
        assert {r["updates"] for r in rechecked} == {protocol.long}
        authors = [r for r in rechecked if r["norm"] == tuned_comparison.AUTHORS]
        assert {(r["alpha_fwd"], r["alpha_bkw"], r["denominator"]) for r in authors} == {(0.9, 0.9, "running")}
        for norm in tuned_comparison.RECHECKED:
            best = (min if lower else max)([r for r in rechecked if r["norm"] == norm],
                                           key=lambda r: r["best_validation"])
            assert protocol.picks[f"{norm}@{protocol.long}"] == tuned_comparison._chosen(best)
        finals = [r for _, r in protocol.stages["final"]]
        arms = set(tuned_comparison.RECHECKED)
        expected = ({(n, protocol.short, s) for n in arms for s in (1, 2)}
                    | {(n, protocol.long, s) for n in arms | {tuned_comparison.ALPHA_ARM} for s in (1, 2, 3)})
        if protocol.task == "multi30k":
            expected |= {(tuned_comparison.EVERY_LAYER, u, s) for u in task_sizes["budgets"] for s in (1, 2)}
        # DyT and Derf at the seeds of the others: both budgets on PTB, the short one on Multi30k.
        expected |= {(n, u, s) for n in tuned_comparison.ELEMENTWISE for u in protocol.elementwise_budgets()
                     for s in ((1, 2) if u == protocol.short else (1, 2, 3))}
        assert {(r["norm"], r["updates"], r["seed"]) for r in finals} == expected
        alpha_arm = [r for r in finals if r["norm"] == tuned_comparison.ALPHA_ARM]
        assert {(r["alpha_fwd"], r["alpha_bkw"], r["learning_rate"], r["warmup"]) for r in alpha_arm} == {
            (0.9, 1.0, protocol.picks[f"powernorm@{protocol.long}"]["learning_rate"],
             protocol.picks[f"powernorm@{protocol.long}"]["warmup"])}
        # PN's warmup is the learning-rate warmup of its run.
        for result in finals:
            if result["norm"].startswith("powernorm"):
                config = json.loads(next((tmp_path / "cells" / result["cell"]).rglob("config.json")).read_text())
                assert config["powernorm_warmup_steps"] == result["warmup"]
    # The transfer task: PTB's picks, unchanged, on the second corpus, test scored once.
    ptb, _, transfer = protocols
    assert list(transfer.stages) == ["final"]
    assert {(r["norm"], r["updates"], r["seed"], r["learning_rate"], r["warmup"], r["alpha_fwd"], r["alpha_bkw"])
            for _, r in transfer.stages["final"]} == {
        (n, u, s, ptb.picks[f"{n}@{u}"]["learning_rate"], ptb.picks[f"{n}@{u}"]["warmup"],
         ptb.picks[f"{n}@{u}"]["alpha_fwd"], ptb.picks[f"{n}@{u}"]["alpha_bkw"])
        for n in tuned_comparison.NORMS for u in sizes["ptb"]["budgets"] for s in (1, 2)}
    rows = read_rows(tmp_path / "results.csv")
    assert tuple(rows[0]) == tuned_comparison.COLUMNS
    assert {row["stage"] for row in rows} == {"tune", "final"}
    assert {row["task"] for row in rows} == {"ptb", "multi30k", "tinyshakespeare"}
    assert {row["task"] for row in rows if row["split"] == "test"} == {"ptb", "multi30k", "tinyshakespeare"}
    assert all(row["dropout"] == "0.3" and row["label_smoothing"] == "0.1" for row in rows)
    pn = [row for row in rows if row["norm"].startswith("powernorm")]
    assert all(row["alpha_fwd"] and row["alpha_bkw"] and row["denominator"] for row in pn)
    assert all(not row["alpha_fwd"] for row in rows if row["norm"] == "layernorm")
    assert any(row["metric"] == "bleu_averaged" and row["split"] == "test" for row in rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "| ptb |" in summary and "| multi30k |" in summary and "| tinyshakespeare |" in summary
    assert "95% CI" in summary and "Holm" in summary
    assert (tmp_path / "curves_ptb_4.png").is_file() and (tmp_path / "curves_multi30k_4.png").is_file()
    picks = json.loads((tmp_path / "picks.json").read_text())
    assert set(picks) == {"ptb", "multi30k", "tinyshakespeare"}

    # Nothing reruns: each finished cell's result file is left as it was.
    stamps = {path: path.stat().st_mtime_ns for path in tmp_path.glob("cells/*/result.json")}
    tuned_comparison.main(argv)
    assert {path: path.stat().st_mtime_ns for path in tmp_path.glob("cells/*/result.json")} == stamps
    assert read_rows(tmp_path / "results.csv") == rows


@pytest.mark.slow
def test_tuning_runs_never_score_test(smoke):
    """The blind protocol: a tuning run's result, log and files hold no test score; finals alone
    score test, on the whole split, and run after every pick is fixed."""
    _, tmp_path, [ptb, multi30k, _] = smoke
    for protocol in (ptb, multi30k):
        tuning = [r for stage, cells in protocol.stages.items() if stage != "final" for _, r in cells]
        finals = [r for _, r in protocol.stages["final"]]
        assert tuning and finals
        for result in tuning:
            assert not result["final"] and not [key for key in result if key.startswith("test")], result["cell"]
            folder = tmp_path / "cells" / result["cell"]
            assert not list(folder.rglob("generated_predictions.txt"))
            log = next(folder.rglob("training_log.jsonl")).read_text().splitlines()
            assert log and not [line for line in log if any(k.startswith("test") for k in json.loads(line))]
        assert all(r["final"] and r["cell"].endswith("-final") and r["max_eval_samples"] is None for r in finals)
        assert all(any(key.startswith("test_") for key in r) for r in finals)
        # Each final's cell is a run of its own: no tuning run doubles as a final.
        assert not {r["cell"] for r in finals} & {r["cell"] for r in tuning}
    rows = read_rows(tmp_path / "results.csv")
    assert not [row for row in rows if row["stage"] == "tune" and row["split"] == "test"]
    test_rows = [row for row in rows if row["split"] == "test"]
    assert test_rows and all(row["stage"] == "final" for row in test_rows)
    # Examples: the whole test split for a final; tuning validation of Multi30k on its first sentences.
    smoke = tuned_comparison.SIZES["smoke"]["multi30k"]["max_eval_samples"]
    whole = {task: len([line for line in open(files["test"], encoding="utf-8") if line.strip()])
             for task, files in (("ptb", ptb.inputs["files"]), ("multi30k", multi30k.inputs["files"]))}
    assert {(row["task"], row["examples"]) for row in test_rows if row["task"] in whole} == {
        (t, str(n)) for t, n in whole.items()}
    assert {row["examples"] for row in rows if row["task"] == "multi30k" and row["stage"] == "tune"} == {str(smoke)}


@pytest.mark.parametrize("task", ["ptb", "multi30k"])
def test_a_tuning_run_reads_no_test_split_and_a_final_scores_the_whole_one(task, tmp_path):
    """The blind rule on one run of each kind: a tuning run gets no test split, so its result and log
    hold no test score and it writes no test translations; a final scores the whole test split."""
    args = tuned_comparison.parse_args(["--smoke", "--tasks", task, "--output_dir", str(tmp_path)])
    protocol = tuned_comparison.Protocol(task, args, tuned_comparison._inputs(task, args, tmp_path), tmp_path)
    chosen = tuned_comparison.setting("powernorm", protocol.sizes["learning_rates"][0], protocol.sizes["warmups"][0])
    tuning, final = protocol.cell(chosen, protocol.short), protocol.cell(chosen, protocol.short, 2, final=True)
    assert "test" not in tuned_comparison._scored_files(tuning.options)
    assert tuned_comparison._scored_files(final.options) == protocol.inputs["files"]
    tuned, scored = tuned_comparison.run_grid([tuning, final], tuned_comparison.run_cell, tmp_path)
    folder = tmp_path / "cells" / tuning.name
    assert not [key for key in tuned if key.startswith("test")]
    assert not list(folder.rglob("generated_predictions.txt"))
    assert not [line for line in next(folder.rglob("training_log.jsonl")).read_text().splitlines()
                if any(key.startswith("test") for key in json.loads(line))]
    assert [split for split, _, _ in tuned_comparison._evaluations(tuned)] == ["validation"] * len(
        tuned_comparison._evaluations(tuned))
    assert "test_bleu_averaged" in scored if task == "multi30k" else "test_perplexity" in scored
    lines = [line for line in open(protocol.inputs["files"]["test"], encoding="utf-8") if line.strip()]
    assert tuned_comparison._examples(scored, "test") == len(lines)
    limit = protocol.sizes.get("max_eval_samples")
    whole = tuned_comparison._examples(scored, "validation")
    assert tuned_comparison._examples(tuned, "validation") == (limit or whole) and (not limit or limit < whole)
    if task == "multi30k":  # each BLEU score's translations and references, whole, for the bootstrap
        for key in tuned_comparison.TRANSLATIONS:
            translations, references = tuned_comparison._translation_files(tmp_path, scored, key)
            assert len(translations.read_text().splitlines()) == len(references.read_text().splitlines()) == len(lines)


def test_a_tuning_run_of_the_first_protocol_shows_no_test_row():
    """Runs of the first protocol scored test while tuning: the report drops those scores."""
    result = {"cell": "c", "final": False, "best_validation": 30.0, "validation_bleu": 30.0, "test_bleu": 29.0,
              "sizes": {"max_eval_samples": 500}}
    assert [split for split, _, _ in tuned_comparison._evaluations(result)] == ["validation", "validation"]
    del result["final"]  # the first protocol's results do not say
    assert [split for split, _, _ in tuned_comparison._evaluations(result)] == ["validation", "validation"]
    assert ("test", "bleu", 29.0) in tuned_comparison._evaluations({**result, "final": True})


def test_report_only_stops_at_the_first_unfinished_stage(ptb_smoke, tmp_path):
    tmp_path = tmp_path / "out"
    shutil.copytree(ptb_smoke[0], tmp_path)  # every stage finished, DyT's and Derf's included
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


PTB_SMOKE = ["--smoke", "--tasks", "ptb", "--seeds", "1", "--long_seeds", "1"]


@pytest.fixture(scope="module")
def ptb_smoke(tmp_path_factory):
    """PTB's protocol at smoke size with DyT and Derf, once: (output folder, protocol)."""
    from accelerate.state import AcceleratorState

    output = tmp_path_factory.mktemp("ptb") / "out"
    [protocol] = tuned_comparison.main([*PTB_SMOKE, "--output_dir", str(output)])
    AcceleratorState._reset_state(reset_partial_state=True)
    return output, protocol


def test_dyt_and_derf_are_tuned_alike_after_every_other_final(ptb_smoke):
    output, protocol = ptb_smoke
    stages = list(protocol.stages)
    assert stages == ["lr", "alpha", "denominator", "recheck", "final", "replaced", "lr-elementwise", "alpha_init",
                      "recheck-elementwise"]
    sizes, grid = tuned_comparison.SIZES["smoke"]["ptb"], tuned_comparison.ALPHAS_INIT["smoke"]
    results = {stage: [result for _, result in cells] for stage, cells in protocol.stages.items()}
    for norm in tuned_comparison.ELEMENTWISE:
        # Stage 1's rate x warmup grid (and its edge rule), at the model family's initial alphas.
        lr = [r for r in results["lr-elementwise"] if r["norm"] == norm]
        assert {(r["learning_rate"], r["warmup"]) for r in lr} >= {
            (rate, warmup) for rate in sizes["learning_rates"] for warmup in sizes["warmups"]}
        assert {(r["alpha_init_attention"], r["alpha_init_other"]) for r in lr} == {(1.0, 1.0)}
        # The initial alphas at that pick: as many runs as PN's alpha stage at the real sizes.
        alpha = [r for r in results["alpha_init"] if r["norm"] == norm]
        pick = tuned_comparison._best("ptb", lr)
        grid_runs = len(grid["attention"]) * len(grid["other"])
        assert [(r["alpha_init_attention"], r["alpha_init_other"]) for r in alpha[:grid_runs]] == [
            (a, o) for a in grid["attention"] for o in grid["other"]]
        # The edge rule's runs after the grid: the other axis beyond its edge, the attention axis
        # (one value in the smoke grid) never.
        assert all(r["alpha_init_attention"] in grid["attention"] for r in alpha)
        assert all(r["alpha_init_other"] not in grid["other"] for r in alpha[grid_runs:])
        assert {(r["learning_rate"], r["warmup"]) for r in alpha} == {(pick["learning_rate"], pick["warmup"])}
        assert protocol.picks[f"{norm}@{protocol.short}"] == tuned_comparison._chosen(
            tuned_comparison._best("ptb", alpha))
        # Each run's model starts from its initial alphas: before attention, before the FFN and final.
        for result in alpha:
            config = json.loads(next((output / "cells" / result["cell"]).rglob("config.json")).read_text())
            assert (config["norm_alpha_init_attention"], config["norm_alpha_init_ffn"],
                    config["norm_alpha_init_final"]) == (result["alpha_init_attention"], result["alpha_init_other"],
                                                         result["alpha_init_other"])
        long_pick = protocol.picks[f"{norm}@{protocol.long}"]
        assert long_pick["alpha_init_attention"] == protocol.picks[f"{norm}@{protocol.short}"]["alpha_init_attention"]
        finals = [r for r in results["final"] if r["norm"] == norm]
        assert sorted((r["updates"], r["seed"]) for r in finals) == [(protocol.short, 1), (protocol.long, 1)]
        assert all(r["dropout_seed"] == 1 + tuned_comparison.FRESH_DRAW for r in finals)
    real = tuned_comparison.ALPHAS_INIT["real"]
    pn = tuned_comparison.SIZES["real"]["ptb"]
    assert len(real["attention"]) * len(real["other"]) == len(pn["alphas_fwd"]) * len(pn["alphas_bkw"])
    # Their tuning starts once every other final has finished, and scores no test.
    stamp = lambda r: (output / "cells" / r["cell"] / "result.json").stat().st_mtime_ns  # noqa: E731
    others = [r for r in results["final"] if r["norm"] not in tuned_comparison.ELEMENTWISE]
    assert max(map(stamp, others)) < min(map(stamp, results["lr-elementwise"]))
    rows = read_rows(output / "results.csv")
    assert not [row for row in rows if row["stage"] == "tune" and row["split"] == "test"]
    assert {row["norm"] for row in rows if row["stage"] == "final" and row["split"] == "test"} >= {"dyt", "derf"}
    assert {row["alpha_init_other"] for row in rows if row["norm"] == "dyt"} >= {"0.5", "1.0"}
    assert {row["alpha_init_other"] for row in rows if row["norm"] == "layernorm"} == {""}
    summary = (output / "summary.md").read_text()
    assert "| DyT | PN (its picks) |" in summary and "| Derf | LayerNorm |" in summary
    # Holm's count is of the comparisons it adjusts (those with an interval), not of every row.
    adjusted, made = map(int, re.search(r"Holm's adjustment over the (\d+) comparisons below that have 3 or more "
                                        r"paired seeds \(of (\d+)\)", summary).groups())
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| task | updates | score | arm | baseline |"))
    headline = [line.split(" | ") for line in lines[start + 2:lines.index("", start)]]
    assert made == len(headline) and adjusted == sum(row[9] != "-" for row in headline)


def test_elementwise_budgets_both_on_ptb_the_short_one_on_multi30k(tmp_path):
    args = tuned_comparison.parse_args(["--smoke", "--output_dir", str(tmp_path)])
    made = {task: tuned_comparison.Protocol(task, args, {}, tmp_path) for task in ("ptb", "multi30k")}
    assert made["ptb"].elementwise_budgets() == tuple(args.sizes["ptb"]["budgets"])
    assert made["multi30k"].elementwise_budgets() == (args.sizes["multi30k"]["budgets"][0],)
    transfer = tuned_comparison.Transfer("tinyshakespeare", args, {}, tmp_path, made["ptb"])
    assert transfer.elementwise_budgets() == () and transfer.tune_elementwise() is False


def test_export_is_a_record_that_resumes_the_study_elsewhere(ptb_smoke, tmp_path):
    argv = PTB_SMOKE
    shutil.copytree(ptb_smoke[0], tmp_path / "out")
    stale = tmp_path / "export" / "cells" / "a-run-since-removed"
    stale.mkdir(parents=True)
    (tmp_path / "export" / "curves_ptb_8.png").write_bytes(b"a figure the outputs no longer have")
    finished = sorted(path.parent.name for path in (tmp_path / "out").glob("cells/*/result.json"))
    # the CPU seconds of a run under way travel with the record; a finished run's old record does not
    under_way = tuned_comparison.cpu_record(tmp_path / "out" / "cells" / "ptb-layernorm-a-run-under-way")
    under_way.write_text('{"cpu_seconds": 812.5}')
    done = tuned_comparison.cpu_record(tmp_path / "export" / "cells" / finished[0])
    done.write_text('{"cpu_seconds": 3.0}')
    tuned_comparison.main([*argv, "--output_dir", str(tmp_path / "out"), "--report_only",
                           "--export_dir", str(tmp_path / "export")])
    export = tmp_path / "export"
    assert not stale.exists() and not done.exists()
    assert (export / "cells" / under_way.name).read_text() == '{"cpu_seconds": 812.5}'
    under_way.unlink()
    (export / "cells" / under_way.name).unlink()
    for name in (*tuned_comparison.OUTPUT_FILES, "curves_ptb_6.png"):
        assert (export / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name
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
    (["--smoke", "--tasks", "tinyshakespeare"], "add ptb to --tasks"),
    (["--data_dir", "/nonexistent", "--tasks", "ptb", "tinyshakespeare"], "--transfer_data_dir"),
    (["--data_dir", "/nonexistent", "--tasks", "ptb", "tinyshakespeare", "--transfer_data_dir", "/nonexistent"],
     "no .*train.txt"),
])
def test_bad_options_are_refused_before_any_run(argv, message, tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        tuned_comparison.parse_args([*argv, "--output_dir", str(tmp_path)])


def test_paired_verdicts_known_interval_and_holm():
    # PN minus LN per seed: 1, 2, 3 (mean 2, t interval 2 -/+ 4.3027 / sqrt 3, p = 1 - sqrt(12 / 14));
    # a second comparison at -0.4, -0.7, -0.2, -0.5, -0.6 (5 seeds) and a third at 2 seeds.
    ln = {1: 30.0, 2: 31.0, 3: 32.0, 4: 30.5, 5: 31.5}
    first = {1: 31.0, 2: 33.0, 3: 35.0}
    second = {seed: ln[seed] + d for seed, d in zip(range(1, 6), (-0.4, -0.7, -0.2, -0.5, -0.6))}
    verdicts = reports.paired_verdicts([(ln, first, False), (ln, second, False), (ln, {1: 40.0, 2: 41.0}, False)])
    one, two, three = verdicts
    assert one.differences == pytest.approx({1: 1.0, 2: 2.0, 3: 3.0})
    half = 4.302652730 / math.sqrt(3)
    assert (one.interval.low, one.interval.high) == pytest.approx((2 - half, 2 + half), abs=1e-8)
    p_one = 1 - math.sqrt(12 / 14)
    p_two = statistics.paired_t_interval([-0.4, -0.7, -0.2, -0.5, -0.6]).p_value
    assert p_two < 0.01 < p_one
    # Holm over the two comparisons with an interval: the smaller p times 2, the larger times 1.
    assert two.adjusted_p == pytest.approx(2 * p_two) and one.adjusted_p == pytest.approx(max(p_one, 2 * p_two))
    assert two.better == "baseline" and one.better == "neither"
    assert three.interval is None and three.better is None and three.adjusted_p is None
    assert reports.paired_cell(one) == "+2.00 [-0.48, +4.48]" and reports.paired_cell(three) == "-"
    # Lower is better: the same differences make the other side the better one.
    assert reports.paired_verdicts([(ln, second, True)])[0].better == "other"
    # The whole family: the third comparison (no interval yet) counts at p = 1, so the smaller p is
    # times 3, the larger times 2 (kept at least the smaller's); without it, as above.
    whole = reports.paired_verdicts([(ln, first, False), (ln, second, False), (ln, {1: 40.0, 2: 41.0}, False)],
                                    whole_family=True)
    assert whole[1].adjusted_p == pytest.approx(3 * p_two)
    assert whole[0].adjusted_p == pytest.approx(min(1.0, max(2 * p_one, 3 * p_two)))
    assert whole[2].adjusted_p is None
    [alone] = reports.paired_verdicts([(ln, second, False)], whole_family=True)
    assert alone.adjusted_p == pytest.approx(p_two)


def test_better_of_needs_three_seeds_a_side():
    assert reports.better_of([30.0, 31.0], [26.0, 27.0], lower_is_better=False) is None
    assert reports.better_of([30.0, 31.0, 32.0], [26.0, 27.0, 28.0], lower_is_better=False) == "baseline"
    assert reports.better_of([30.0, 31.0], [26.0, 27.0], lower_is_better=False, min_seeds=2) == "baseline"
    with pytest.raises(ValueError, match="min_seeds"):
        reports.better_of([1.0], [2.0], lower_is_better=True, min_seeds=1)


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


def test_the_headline_compares_every_arm_with_layernorm_paired_by_seed(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3])
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    results = [{"norm": norm, "updates": 2000, "seed": seed, "test_bleu_averaged": averaged + seed / 10 + noise,
                "test_bleu": best + seed / 10}
               for norm, averaged, best in (("layernorm", 25.0, 28.0), ("powernorm", 21.0, 28.1),
                                            ("rmsnorm", 24.0, 27.0))
               for seed, noise in ((1, 0.0), (2, 0.1), (3, -0.05))]
    results += [{"norm": "powernorm-all", "updates": 2000, "seed": seed, "test_bleu_averaged": 26.0,
                 "test_bleu": 29.0} for seed in (1, 2)]
    results += [{"norm": "dyt", "updates": 2000, "seed": seed, "test_bleu_averaged": 22.0 + seed / 10,
                 "test_bleu": 27.5 + seed / 10} for seed in (1, 2, 3)]
    protocol.stages["final"] = [(None, result) for result in results]
    rows = [line.split(" | ") for line in tuned_comparison.headline([protocol])[2:]]
    # Per score: PN, PN in every layer, RMSNorm and DyT against LayerNorm, then DyT against PN (arms
    # without finals have no row).
    assert [(row[2].split(" (")[0], row[3], row[4]) for row in rows] == [
        (score, name, baseline) for score in ("test bleu", "test bleu")
        for name, baseline in (("PN (its picks)", "LayerNorm"), ("PN in every layer", "LayerNorm"),
                               ("RMSNorm", "LayerNorm"), ("DyT", "LayerNorm"), ("DyT", "PN (its picks)"))]
    pn_averaged, every_layer, rms_averaged, _, dyt_pn_averaged, pn_best, _, rms_best, _, dyt_pn_best = rows
    assert pn_averaged[5:8] == ["25.22 ± 0.10 (3 seeds)", "21.22 ± 0.10 (3 seeds)", "3"]
    # Every PN seed is 4.00 below LayerNorm's: the interval is that one value, and LayerNorm better.
    assert pn_averaged[8] == "-4.00 [-4.00, -4.00]" and pn_averaged[10] == "LayerNorm better |"
    assert every_layer[7:] == ["2", "-", "-", "no verdict (fewer than 3 paired seeds) |"]
    assert pn_best[8] == "+0.10 [+0.10, +0.10]" and pn_best[10] == "PN (its picks) better |"
    # DyT against PN: paired with PN's seeds (differences 1.00, 0.90, 1.05: t interval with 2 degrees
    # of freedom), PN's scores the baseline's.
    assert dyt_pn_averaged[5] == pn_averaged[6]
    assert dyt_pn_averaged[8] == "+0.98 [+0.79, +1.17]" and dyt_pn_averaged[10] == "DyT better |"
    assert dyt_pn_best[8] == "-0.60 [-0.60, -0.60]" and dyt_pn_best[10] == "PN (its picks) better |"
    verdicts = [c["verdict"] for c in tuned_comparison.comparisons([protocol])]
    p_values = [v.interval.p_value for v in verdicts if v.interval is not None]
    assert [v.adjusted_p for v in verdicts if v.interval is not None] == pytest.approx(statistics.holm(p_values))
    assert float(rms_averaged[9]) == pytest.approx(verdicts[2].adjusted_p, abs=5e-4)
    assert rms_best[5] == "28.20 ± 0.10 (3 seeds)"


def test_every_arm_is_rechecked_alike_and_pns_warmup_edge_extended(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2)
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    protocol.picks = {"layernorm@2000": tuned_comparison.setting("layernorm", 6e-3, 600),
                      "rmsnorm@2000": tuned_comparison.setting("rmsnorm", 1.2e-2, 600),
                      "powernorm@2000": tuned_comparison.setting("powernorm", 3e-3, 1200, 0.95, 1.0),
                      "powernorm-authors@2000": tuned_comparison.setting("powernorm-authors", 3e-3, 1200)}
    # Stage 1 as it ran: every norm at 200 and 600, and at 1,200 by the warmup rule.
    stage_one = [{"norm": norm, "warmup": warmup} for norm in tuned_comparison.NORMS for warmup in (200, 600, 1200)]
    cells = tuned_comparison._recheck_cells(protocol, stage_one, tuned_comparison.RECHECKED)
    assert sorted((c.options["norm"], c.options["learning_rate"], c.options["warmup"]) for c in cells) == sorted(
        [("layernorm", rate, 600) for rate in (3e-3, 6e-3, 1.2e-2)]
        + [("rmsnorm", rate, 600) for rate in (6e-3, 1.2e-2, 2.4e-2)]
        + [(norm, rate, warmup) for norm in ("powernorm", "powernorm-authors") for warmup in (1200, 2400)
           for rate in (1.5e-3, 3e-3, 6e-3)])
    assert all(c.options["updates"] == 4000 and not c.options["final"] and c.options["max_eval_samples"] == 500
               for c in cells)
    authors = [c.options for c in cells if c.options["norm"] == "powernorm-authors"]
    assert {(o["alpha_fwd"], o["alpha_bkw"], o["denominator"]) for o in authors} == {(0.9, 0.9, "running")}
    # The first protocol's re-check runs keep their names (and results): only the new ones run.
    assert "multi30k-powernorm-lr0.006-w1200-a0.95-1-running-u4000-seed1" in {c.name for c in cells}
    # PTB has no warmup rule: the rates at the pick's warmup only, for every arm.
    ptb = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    ptb.picks = {f"{norm}@1500": tuned_comparison.setting(norm, 8e-3, 150) for norm in tuned_comparison.RECHECKED}
    cells = tuned_comparison._recheck_cells(ptb, [{"norm": n, "warmup": w} for n in tuned_comparison.NORMS
                                                  for w in (150, 500)], tuned_comparison.RECHECKED)
    assert len(cells) == 3 * len(tuned_comparison.RECHECKED) and {c.options["warmup"] for c in cells} == {150}


def test_finals_are_runs_of_their_own_on_the_whole_splits(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3],
                                               long_seeds=[1, 2, 3, 4, 5])
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    for norm in tuned_comparison.RECHECKED:
        for updates in (2000, 4000):
            protocol.picks[f"{norm}@{updates}"] = tuned_comparison.setting(norm, 6e-3, 600)
    protocol.picks["powernorm-fwd0.9@4000"] = tuned_comparison.setting("powernorm-fwd0.9", 6e-3, 600, 0.9, 1.0)
    cells = protocol.final_cells()
    counts = {}
    for cell in cells:
        key = (cell.options["norm"], cell.options["updates"])
        counts[key] = counts.get(key, 0) + 1
        fresh = key == ("powernorm-authors", 4000) and cell.options["seed"] == 1  # amendment 2
        assert cell.name.endswith("-final-draw1001" if fresh else "-final") and cell.options["final"]
        assert cell.options["max_eval_samples"] is None and ("dropout_seed" in cell.options) == fresh
    assert counts == {**{(n, 2000): 3 for n in tuned_comparison.RECHECKED},
                      **{(n, 4000): 5 for n in tuned_comparison.RECHECKED},
                      ("powernorm-fwd0.9", 4000): 5, ("powernorm-all", 2000): 3, ("powernorm-all", 4000): 3}
    assert len({cell.name for cell in cells}) == len(cells)


def test_a_seed_one_final_that_repeats_its_winning_tuning_run_draws_fresh_dropout(tmp_path):
    """Amendment 2: the finals of `FRESH_FINALS` at seed 1 differ from the tuning run that won their
    pick by their dropout draws alone (`--dropout_seed`, the seed's initialisation and batch order);
    every other final keeps its cell, and the old seed-1 finals are the record of what was replaced."""
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3],
                                               long_seeds=[1, 2, 3, 4, 5])
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    for norm in (*tuned_comparison.RECHECKED, *tuned_comparison.ELEMENTWISE):
        for updates in (1500, 4500):
            protocol.picks[f"{norm}@{updates}"] = tuned_comparison.setting(norm, 8e-3, 150)
    protocol.picks["powernorm-fwd0.9@4500"] = tuned_comparison.setting("powernorm-fwd0.9", 8e-3, 150, 0.9, 1.0)
    cells = protocol.final_cells() + protocol.elementwise_final_cells()
    fresh = {(c.options["norm"], c.options["updates"], c.options["seed"]) for c in cells if "dropout_seed" in c.options}
    assert fresh == {("dyt", 1500, 1), ("derf", 1500, 1), ("dyt", 4500, 1), ("derf", 4500, 1),
                     ("powernorm-authors", 4500, 1)}
    for cell in cells:
        if "dropout_seed" in cell.options:
            assert cell.options["dropout_seed"] == 1001 and cell.name.endswith("-seed1-final-draw1001")
            words = tuned_comparison._run_options({**cell.options, "sizes": tuned_comparison.SIZES["real"]["ptb"]})
            assert words["seed"] == 1 and words["dropout_seed"] == 1001
    replaced = protocol.replaced_cells(cells)
    assert sorted(c.name for c in replaced) == sorted(c.name.removesuffix("-draw1001") for c in cells
                                                      if "dropout_seed" in c.options)
    # The cell a fresh final replaces is the final as the study ran it before (same options).
    old = protocol.cell(protocol.picks["dyt@4500"], 4500, 1, final=True)
    assert old.name in {c.name for c in replaced} and old.options == next(c for c in replaced
                                                                          if c.name == old.name).options
    assert "dropout_seed" not in tuned_comparison._run_options({**old.options, "sizes": args.sizes["ptb"]})


def test_a_fresh_final_not_run_yet_leaves_the_old_one_in_its_row(tmp_path):
    """Amendment 2, in a report: until a fresh seed-1 final has run, the final it will replace stands
    in its row (and the summary says so); once it has run, the fresh one takes the row and the old
    one is the record of stage `replaced`."""
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2, 3],
                                               long_seeds=[1, 2, 3, 4, 5], report_only=True)
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    for norm in (*tuned_comparison.RECHECKED, *tuned_comparison.ELEMENTWISE):
        for updates in (1500, 4500):
            protocol.picks[f"{norm}@{updates}"] = tuned_comparison.setting(norm, 8e-3, 150)
    protocol.picks["powernorm-fwd0.9@4500"] = tuned_comparison.setting("powernorm-fwd0.9", 8e-3, 150, 0.9, 1.0)
    fresh = next(c for c in protocol.elementwise_final_cells() if "dropout_seed" in c.options)
    (old,) = protocol.replaced_cells([fresh])

    def finish(cell, value):
        folder = tmp_path / "cells" / cell.name
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({"cell": cell.name, **cell.options, "best_validation": value}))

    finish(old, 100.0)
    protocol.run_finals(elementwise=True)
    row = [entry for entry in protocol.stages["final"] if entry[1] is not None]
    assert [(cell.name, result["best_validation"]) for cell, result in row] == [(old.name, 100.0)]
    assert protocol.pending_fresh == [fresh.name] and protocol.stages["replaced"] == []
    assert "1 fresh seed-1 finals of amendment 2 have not run yet" in tuned_comparison.interim_note([protocol])[0]
    finish(fresh, 103.0)
    protocol.run_finals(elementwise=True)
    row = [entry for entry in protocol.stages["final"] if entry[1] is not None]
    assert [(cell.name, result["best_validation"]) for cell, result in row] == [(fresh.name, 103.0)]
    assert protocol.pending_fresh == [] and [c.name for c, _ in protocol.stages["replaced"]] == [old.name]


def test_an_initial_alpha_picked_at_an_edge_gets_the_next_value_beyond(tmp_path):
    """Amendment 2: the rate grid's edge rule on each initial-alpha axis, the other axis at the pick."""
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2,
                                               alphas_init=tuned_comparison.ALPHAS_INIT["real"])
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    ran = []

    def run(norm, attention, other, perplexity):
        chosen = {**tuned_comparison.setting(norm, 8e-3, 500), "alpha_init_attention": attention,
                  "alpha_init_other": other}
        cell = protocol.cell(chosen, protocol.short)
        ran.append({"cell": cell.name, **chosen, "best_validation": perplexity})

    def extension():
        return sorted((c.options["norm"], c.options["alpha_init_attention"], c.options["alpha_init_other"])
                      for c in tuned_comparison._alpha_init_extension(protocol, ran))

    grid = tuned_comparison.ALPHAS_INIT["real"]
    for attention in grid["attention"]:
        for other in grid["other"]:
            run("dyt", attention, other, 110.0 - attention - other)  # best at the 2 / 2 corner
            run("derf", attention, other, 110.0 - attention + abs(other - 0.5))  # best at 2 / 0.5
    assert extension() == [("derf", 4.0, 0.5), ("dyt", 2.0, 4.0), ("dyt", 4.0, 2.0)]
    run("dyt", 4.0, 2.0, 50.0)
    run("dyt", 2.0, 4.0, 90.0)
    run("derf", 4.0, 0.5, 200.0)
    # DyT's 4 before attention wins: 8 next (the other axis, 2, now lies inside 0.25-4); Derf's pick
    # stays at 2 / 0.5, whose attention value is no longer the edge.
    assert extension() == [("dyt", 8.0, 2.0)]
    run("dyt", 8.0, 2.0, 60.0)
    assert extension() == []
    # A pick inside both axes adds nothing.
    assert tuned_comparison._alpha_init_extension(
        protocol, [{**r, "best_validation": 1.0 if (r["alpha_init_attention"], r["alpha_init_other"]) == (1.0, 0.5)
                    else 100.0} for r in ran if r["norm"] == "derf"]) == []


def test_every_tasks_finals_are_queued_as_one_grid_in_task_order(tmp_path, monkeypatch):
    """A task's last finals and the next task's first run side by side: one grid, PTB's cells first."""
    grids = []

    def run_grid(cells, run_cell, output_dir, **options):
        grids.append(([cell.name for cell in cells], options))
        return [{"cell": cell.name} for cell in cells]

    monkeypatch.setattr(tuned_comparison, "run_grid", run_grid)
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2],
                                               long_seeds=[1, 2, 3], jobs=2, report_only=False)
    protocols = [tuned_comparison.Protocol(task, args, {}, tmp_path) for task in ("ptb", "multi30k")]
    for protocol in protocols:
        for norm in (*tuned_comparison.RECHECKED, tuned_comparison.ALPHA_ARM):
            for updates in (protocol.short, protocol.long):
                protocol.picks[f"{norm}@{updates}"] = tuned_comparison.setting(norm, 6e-3, 600)
    tuned_comparison.run_finals_together(protocols, extras=False)
    expected = [cell.name for protocol in protocols for cell in protocol.final_cells(extras=False)]
    assert grids[0] == (expected, {"desc": "finals", "resume_cells": True, "executor": ExecutorSettings(jobs=2)})
    assert expected[0].startswith("ptb-") and expected[-1].startswith("multi30k-")
    # then each task's stage reads its own finals, all of them done
    for protocol in protocols:
        assert [result["cell"] for _, result in protocol.stages["final"]] == [
            cell.name for cell in protocol.final_cells(extras=False)]
    grids.clear()
    tuned_comparison.run_finals_together(protocols, extras=True)
    assert set(grids[0][0]) == {cell.name for protocol in protocols for cell in protocol.final_cells(extras=True)}
    args.report_only = True  # a report runs nothing
    monkeypatch.setattr(tuned_comparison, "finished_results", lambda cells, output_dir: [])
    grids.clear()
    tuned_comparison.run_finals_together(protocols, extras=True)
    assert grids == []


def test_the_summary_says_its_verdicts_are_interim_until_every_final_is_in(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2)
    ptb, multi30k = (tuned_comparison.Protocol(task, args, {}, tmp_path) for task in ("ptb", "multi30k"))
    cell = lambda name: types.SimpleNamespace(name=name)  # noqa: E731
    ptb.stages["lr"] = [(cell("t"), None)]  # tuning, no final queued yet
    assert "no final has been queued: no test score exists" in tuned_comparison.interim_note([ptb])[0]
    ptb.stages["lr"] = [(cell("t"), {"cell": "t"})]  # tuned: finals queued
    ptb.stages["final"] = [(cell("a"), {"cell": "a"}), (cell("b"), None)]
    assert "1 of the 2 finals" in tuned_comparison.interim_note([ptb])[0]
    ptb.stages["final"][1] = (cell("b"), {"cell": "b"})
    assert tuned_comparison.interim_note([ptb]) == []
    multi30k.stages["lr"] = [(cell("c"), None)]  # a task still tuning: its finals are still to come
    assert "2 of the 2 finals" in tuned_comparison.interim_note([ptb, multi30k])[0]
    # every queued final in, but an arm added later still tuning on a task: its finals are to come
    ptb.stages["lr-elementwise"] = [(cell("d"), {"cell": "d"}), (cell("e"), None)]
    note = tuned_comparison.interim_note([ptb])[0]
    assert "2 of the 2 finals" in note and "Still tuning, their finals to come: ptb lr-elementwise." in note
    ptb.stages["lr-elementwise"][1] = (cell("e"), {"cell": "e"})
    assert tuned_comparison.interim_note([ptb]) == []


def test_the_summary_gives_each_finals_score_seed_by_seed(tmp_path):
    args = tuned_comparison.argparse.Namespace(sizes=tuned_comparison.SIZES["real"], extensions=2, seeds=[1, 2])
    protocol = tuned_comparison.Protocol("ptb", args, {}, tmp_path)
    protocol.stages["final"] = [(None, {"norm": norm, "updates": 1500, "seed": seed, "test_perplexity": value})
                                for norm, seed, value in (("layernorm", 1, 84.5), ("powernorm", 1, 85.25),
                                                          ("rmsnorm", 1, 84.0), ("layernorm", 2, 86.0),
                                                          ("powernorm", 2, 85.5), ("dyt", 2, 87.0))]
    rows = [line.split(" | ") for line in tuned_comparison.per_seed([protocol])[2:]]
    # LayerNorm, PN, PN (authors' alphas), PN (fwd 0.9), PN in every layer, RMSNorm, DyT, Derf, PN minus LN.
    assert [row[3:] for row in rows] == [["1", "84.50", "85.25", "-", "-", "-", "84.00", "-", "-", "+0.75 |"],
                                         ["2", "86.00", "85.50", "-", "-", "-", "-", "87.00", "-", "-0.50 |"]]
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


def test_bleu_bootstrap_per_seed_pairs_the_same_sentences(tmp_path):
    args = tuned_comparison.parse_args(["--smoke", "--tasks", "multi30k", "--output_dir", str(tmp_path)])
    protocol = tuned_comparison.Protocol("multi30k", args, {}, tmp_path)
    references = [f"a dog runs on the grass number {i} ." for i in range(40)]
    system = {"layernorm": [r if i % 3 else "a cat sits ." for i, r in enumerate(references)],
              "powernorm": [r if i % 5 else "a cat sits ." for i, r in enumerate(references)]}
    results = []
    for norm, translations in system.items():
        for seed in (1, 2, 3):
            cell = f"multi30k-{norm}-seed{seed}-final"
            result = {"cell": cell, "task": "multi30k", "norm": norm, "updates": 2, "seed": seed, "final": True,
                      "test_bleu": 30.0 + seed, "test_bleu_averaged": 31.0 + seed}
            for key in tuned_comparison.TRANSLATIONS:
                predictions, refs = tuned_comparison._translation_files(tmp_path, result, key)
                predictions.parent.mkdir(parents=True, exist_ok=True)
                predictions.write_text("".join(line + "\n" for line in translations))
                # Seed 3's PN run was scored against other references: no pair of sentences to resample.
                other = norm == "powernorm" and seed == 3
                refs.write_text("".join(line + ("!" if other else "") + "\n" for line in references))
            results.append(result)
    protocol.stages["final"] = [(None, result) for result in results]
    rows = [line.split(" | ") for line in tuned_comparison.bootstraps([protocol], tmp_path)[2:]]
    expected = statistics.paired_bootstrap_bleu(system["layernorm"], system["powernorm"], references,
                                                samples=tuned_comparison.BOOTSTRAP_SAMPLES)
    assert expected.mean > 0  # PN's translations miss fewer sentences
    # Both BLEU scores, seeds 1 and 2 (seed 3 left out), PN against LayerNorm only (no DyT finals).
    assert [(row[2].split(" (")[0], row[3], row[4], row[5]) for row in rows] == [
        ("test bleu", "PN (its picks)", "LayerNorm", seed) for seed in ("1", "2")] * 2
    for row in rows:
        assert row[6:] == ["40", f"{expected.mean:+.2f} [{expected.low:+.2f}, {expected.high:+.2f}]",
                           f"{expected.p_value:.3f} |"]


def _run_killed_cell(cell, output, crash):
    """A forked study process running `cell` that dies as a killed one would (`crash`: the
    checkpoints' test hook)."""
    import os

    import torch
    from accelerate.state import AcceleratorState

    from hf_powernorm.training import checkpoints
    from hf_powernorm.training.grid import run_grid

    os.environ[checkpoints.CRASH_AFTER_FILES_ENV] = crash
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(1)
    run_grid([cell], tuned_comparison.run_cell, output, resume_cells=True)


def test_a_killed_run_goes_on_from_its_last_checkpoint_to_the_unbroken_scores(ptb_smoke, tmp_path, monkeypatch,
                                                                               capsys):
    import multiprocessing
    import signal

    from hf_powernorm.training.grid import run_grid
    from hf_powernorm.training.run_log import read_run_log

    _, protocol = ptb_smoke
    cell, unbroken = next((cell, result) for cell, result in protocol.stages["final"]
                          if cell.options["updates"] == 6 and cell.options["norm"] == "powernorm")
    monkeypatch.setattr(tuned_comparison, "RESUME_EVERY", 2)  # the smoke run's 6 updates: checkpoints at 2 and 4
    folder = tmp_path / "cells" / cell.name
    folder.mkdir(parents=True)
    (folder / "training_log.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # an attempt killed before update 2
    tuned_comparison.cpu_record(folder).write_text('{"cpu_seconds": 100.0}')  # and the CPU it cost

    # Killed while writing update 4's checkpoint: update 2's is the newest complete one.
    child = multiprocessing.get_context("fork").Process(target=_run_killed_cell, args=(cell, tmp_path, "0@4"))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL
    assert (folder / "step_2").is_dir() and not (folder / "step_4").exists()
    assert not (folder / "result.json").exists()
    assert [r["loss"] for r in read_run_log(folder) if r.get("step") == 1] != [9.0]  # the older attempt cleared

    capsys.readouterr()
    [resumed] = run_grid([cell], tuned_comparison.run_cell, tmp_path, resume_cells=True)
    assert f"Resuming from {folder / 'step_2'}" in capsys.readouterr().out
    for key in ("best_step", "train_steps", "best_validation", "validation_perplexity", "test_perplexity"):
        assert resumed[key] == pytest.approx(unbroken[key], rel=1e-5), key
    assert [r["step"] for r in read_run_log(folder) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each update once
    assert not list(folder.glob("step_*")) and not list(folder.glob(".step_*"))  # the checkpoints served their end
    assert 100.0 < resumed["cpu_seconds"] < 100.0 + 300  # every attempt's CPU time, counted once
    assert not tuned_comparison.cpu_record(folder).exists()  # the result holds it
    assert 0 < unbroken["cpu_seconds"] < 300
    runs = tuned_comparison._finished_runs(protocol)
    hours = sum(r["cpu_seconds"] for r in runs) / 3600
    assert tuned_comparison.cpu_hours([protocol]) == f"ptb {hours:.1f} over {len(runs)} runs"


def test_a_killed_translation_run_goes_on_from_its_last_checkpoint(tmp_path, capsys):
    import multiprocessing
    import signal

    from hf_powernorm.training.grid import run_grid

    args = tuned_comparison.parse_args(["--smoke", "--tasks", "multi30k", "--output_dir", str(tmp_path)])
    protocol = tuned_comparison.Protocol("multi30k", args, tuned_comparison._inputs("multi30k", args, tmp_path),
                                         tmp_path)
    chosen = tuned_comparison.setting("powernorm", protocol.sizes["learning_rates"][0], protocol.sizes["warmups"][0])
    cell = protocol.cell(chosen, protocol.long)  # 4 updates, a checkpoint after each
    [unbroken] = run_grid([cell], tuned_comparison.run_cell, tmp_path / "unbroken")
    # An attempt killed before its first checkpoint, then one killed while writing update 3's.
    folder = tmp_path / "cells" / cell.name
    folder.mkdir(parents=True)
    (folder / "stale.txt").write_text("from the attempt before")
    child = multiprocessing.get_context("fork").Process(target=_run_killed_cell, args=(cell, tmp_path, "0@3"))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL and (folder / "run" / "step_2").is_dir()
    assert not (folder / "stale.txt").exists()  # nothing to go on from: cleared
    (folder / "averaged").mkdir()  # as if killed while averaging: the average is made again
    (folder / "averaged" / "stale.txt").write_text("from the attempt before")

    capsys.readouterr()
    [resumed] = run_grid([cell], tuned_comparison.run_cell, tmp_path, resume_cells=True)
    assert f"Resuming from {folder / 'run' / 'step_2'}" in capsys.readouterr().out
    numbers = {k: v for k, v in unbroken.items() if isinstance(v, float) and not k.endswith(("seconds", "per_second"))}
    assert "validation_bleu_averaged" in numbers
    assert {k: resumed[k] for k in numbers} == pytest.approx(numbers, rel=1e-5)
    assert not (folder / "averaged" / "stale.txt").exists() and not list((folder / "run").glob("step_*"))
