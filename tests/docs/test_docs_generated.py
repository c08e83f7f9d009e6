"""The documents against their data: every generated section of `documents.DOCUMENTS` equals what
`python -m hf_powernorm.studies docs` writes from the files under `results/`; the tuned comparison's tables
agree with the study's own `summary.md`; STUDIES.md opens with the answer and PN's table (the README
with the same answer) and its tuned comparison quotes only intervals its tables hold; and the export
keeps the blind rule (no tuning run's cell holds a test score)."""

import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_powernorm.studies import documents
from hf_powernorm.training.statistics import t_quantile

ROOT = Path(__file__).resolve().parents[2]
TUNED = ROOT / "results" / "tuned_comparison"
STUDIES_MD = ROOT / "STUDIES.md"
TUNED_PAGE = ROOT / "docs" / "tuned_comparison.md"


def _headline(text: str) -> str:
    """STUDIES.md's answer and its tuned comparison, up to the earlier studies."""
    return text[:text.index("## The earlier studies")]


def _outside_generated(text: str) -> str:
    return documents.SECTION.sub("", text)


@pytest.mark.parametrize("name", documents.DOCUMENTS)
def test_each_document_equals_its_data(name):
    text = (ROOT / name).read_text(encoding="utf-8")
    assert documents.render(text, ROOT) == text, f"{name} differs from its data: run python -m hf_powernorm.studies docs"


def test_every_results_table_of_studies_md_that_has_a_summary_is_generated():
    names = documents.sections(STUDIES_MD.read_text(encoding="utf-8"))
    assert names[:2] == [documents.ANSWER, "tuned_comparison: PN against LayerNorm"]
    assert {"norm_comparison/summary.md#1", "pn_ablation/summary.md#1", "warmup_switch/summary.md#1"} <= set(names)
    page = documents.sections(TUNED_PAGE.read_text(encoding="utf-8"))
    assert page == ["tuned_comparison: binding family", "tuned_comparison: protocol 2"]


def test_studies_md_opens_with_the_answer_and_pns_table():
    lines = STUDIES_MD.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 900
    # protocol 3's verdicts, once it has them, open the answer in a paragraph of their own
    converged = documents.convergence_answer(ROOT, documents.read_finals(TUNED / "results.csv"))
    first = 40 + len(converged) + bool(converged)
    opening = "\n".join(lines[:first])
    answer = documents.section(documents.ANSWER, ROOT)
    table = documents.section("tuned_comparison: PN against LayerNorm", ROOT)
    assert answer in opening and table in opening and len(answer.splitlines()) <= first - 30
    assert len(converged) <= 8
    caveats = next(i for i, line in enumerate(lines) if line.startswith("Caveats."))
    assert lines.index("", caveats) <= first, f"the caveats end within the first {first} lines"
    assert "Fragility near 0.05" in opening and "docs/protocol_convergence.md" in opening
    assert answer in (ROOT / "README.md").read_text(encoding="utf-8")


def _copy_data(tmp_path: Path) -> Path:
    for name in documents.DOCUMENTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp_path / name)
    for path in [*(ROOT / "results").glob("*/summary.md"), *(ROOT / "docs").glob("*/report.md")]:
        (tmp_path / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, tmp_path / path.relative_to(ROOT))
    shutil.copyfile(TUNED / "results.csv", tmp_path / "results" / "tuned_comparison" / "results.csv")
    shutil.copyfile(ROOT / "results" / "convergence" / "results.csv", tmp_path / "results" / "convergence" / "results.csv")
    for path in (TUNED / "cells").glob("*/result.json"):  # the CPU-hours per run
        (tmp_path / path.relative_to(ROOT)).parent.mkdir(parents=True)
        shutil.copyfile(path, tmp_path / path.relative_to(ROOT))
    return tmp_path


def test_a_changed_data_file_changes_the_documents_and_the_check_fails(tmp_path, capsys):
    root = _copy_data(tmp_path)
    assert documents.main(["--check", "--root", str(root)]) == []
    results = root / "results" / "tuned_comparison" / "results.csv"
    lines = results.read_text(encoding="utf-8").splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith("ptb,powernorm,final,4500,")
                 and ",test,perplexity," in line)
    value = float(lines[index].rsplit(",", 1)[1])
    lines[index] = f"{lines[index].rsplit(',', 1)[0]},{value + 5}\n"
    results.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:
        documents.main(["--check", "--root", str(root)])
    assert stopped.value.code == 1 and "STUDIES.md" in capsys.readouterr().out
    assert documents.main(["--root", str(root)]) == ["STUDIES.md", "README.md", "docs/studies.md",
                                                      "docs/tuned_comparison.md"]
    assert documents.main(["--check", "--root", str(root)]) == []


def test_the_command_runs_from_the_studies_entry_point(tmp_path):
    root = _copy_data(tmp_path)
    completed = subprocess.run([sys.executable, "-m", "hf_powernorm.studies", "docs", "--check", "--root", str(root)],
                               capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert "every document equals its data" in completed.stdout


def test_an_unknown_section_name_is_refused():
    with pytest.raises(ValueError, match="unknown generated section 'nothing'"):
        documents.render("<!-- generated: nothing -->\n<!-- end generated -->", ROOT)
    with pytest.raises(ValueError, match="has 1 tables; expected #1 to #1"):
        documents.section("pn_ablation/summary.md#2", ROOT)


def test_the_convergence_table_pairs_each_seed_of_both_protocols(tmp_path):
    """Protocol 3's pairs beside protocol 2's at 4,500 updates, from the two results files: seeds both arms
    have, each seed's difference, the interval from two seeds on, and how many seeds PN is behind on."""
    tuned, converged = tmp_path / "results" / "tuned_comparison", tmp_path / "results" / "convergence"
    tuned.mkdir(parents=True)
    converged.mkdir(parents=True)
    header = ("task,norm,stage,updates,learning_rate,warmup,dropout,label_smoothing,alpha_fwd,alpha_bkw,denominator,"
              "alpha_init_attention,alpha_init_other,seed,split,metric,examples,value")
    finals = [("layernorm", 1, 60.0), ("layernorm", 2, 61.0), ("layernorm", 3, 62.0), ("powernorm", 1, 60.5),
              ("powernorm", 2, 62.0), ("powernorm", 3, 61.5), ("powernorm-authors", 1, 63.0)]
    tuned.joinpath("results.csv").write_text("\n".join(
        [header, *(f"ptb,{norm},final,4500,0.008,150,0.3,0.1,,,,,,{seed},test,perplexity,100,{value}"
                   for norm, seed, value in finals),
         "ptb,powernorm,tune,4500,0.008,150,0.3,0.1,,,,,,4,validation,perplexity,100,1.0"]) + "\n")
    converged.joinpath("results.csv").write_text(
        "arm,seed,stopped_at,stopped_by,best_update,best_validation_perplexity,test_perplexity,test_word_perplexity,"
        "cpu_hours\nlayernorm,1,12000,cap,12000,58,57.0,200,1.5\npowernorm,1,9000,rule,7000,59,57.25,201,1.2\n"
        "powernorm-authors,2,12000,cap,12000,60,59.0,210,1.4\n")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in documents.convergence_table(tmp_path)[2:]]
    assert rows == [
        ["PN (its picks)", "4,500 updates (protocol 2's finals)", "1, 2, 3", "+0.50, +1.00, -0.50",
         "+0.33 [-1.56, +2.23]", "2 of 3"],
        ["PN (its picks)", "until validation stops improving (protocol 3)", "1", "+0.25", "- (one seed)", "1 of 1"],
        ["PN, authors' alphas 0.9/0.9", "4,500 updates (protocol 2's finals)", "1", "+3.00", "- (one seed)", "1 of 1"],
        ["PN, authors' alphas 0.9/0.9", "until validation stops improving (protocol 3)", "none yet", "-", "-", "-"]]


def test_the_documents_name_protocol_threes_arms_runs_and_cap_as_the_study_does():
    from hf_powernorm.studies import convergence

    assert convergence.ARMS == ("layernorm", *documents.CONVERGENCE_ARMS)
    assert set(convergence.PICKS) == set(convergence.ARMS)  # every arm the documents name is a run of the study
    assert documents.CONVERGENCE_PLANNED == len(convergence.ARMS) * len(convergence.SEEDS)
    assert documents.CONVERGENCE_CAP == convergence.SIZES["real"]["cap"]


def _write_convergence(root: Path, rows: list[tuple]) -> None:
    folder = root / "results" / "convergence"
    folder.mkdir(parents=True, exist_ok=True)
    folder.joinpath("results.csv").write_text(
        "arm,seed,stopped_at,stopped_by,best_update,best_validation_perplexity,test_perplexity,test_word_perplexity,"
        "cpu_hours\n" + "".join(f"{arm},{seed},{stop},{by},{best},60,{test},200,1.0\n"
                                 for arm, seed, stop, by, best, test in rows))


def test_where_protocol_three_stands_is_written_from_its_results(tmp_path):
    """The runs finished, what stopped them and the verdicts, in words, from `convergence/results.csv`;
    no verdict under 3 paired seeds, and one per arm from 3 on, with Holm over the 2."""
    _write_convergence(tmp_path, [("layernorm", 1, 12000, "cap", 12000, 57.0), ("powernorm", 1, 12000, "cap", 12000, 57.5)])
    text = " ".join(documents.convergence_text(tmp_path))
    assert text.startswith("2 of 15 runs finished (LayerNorm: seed 1; PN (its picks): seed 1). Every one reached the "
                           "12,000-update cap with its best validation at its last")
    assert text.endswith("No verdict before 3 paired seeds of an arm and LayerNorm.")
    rows = [("layernorm", 1, 9000, "rule", 7000, 57.0), ("layernorm", 2, 12000, "cap", 12000, 58.0),
            ("layernorm", 3, 12000, "cap", 11000, 59.0), ("powernorm", 1, 12000, "cap", 12000, 58.0),
            ("powernorm", 2, 10500, "rule", 8500, 59.1), ("powernorm", 3, 12000, "cap", 12000, 59.9),
            ("powernorm-authors", 1, 12000, "cap", 12000, 60.0)]
    _write_convergence(tmp_path, rows)
    text = " ".join(documents.convergence_text(tmp_path))
    assert "7 of 15 runs finished (LayerNorm: seeds 1, 2, 3; PN (its picks): seeds 1, 2, 3; PN, authors' alphas " \
           "0.9/0.9: seed 1). 2 stopped by the rule (no better validation for 2,000 updates), 5 by the 12,000-update " \
           "cap, 4 of those with its best validation at its last." in text
    # PN minus LayerNorm: +1.0, +1.1, +0.9 (t 17.3 on 2 df, p 0.0033); the authors' arm has one pair, not
    # judged yet: the family is still 2, that arm at p = 1, so PN's p is doubled
    assert ("paired by seed, Holm over the 2 (the arm not judged yet counted at p = 1): PN (its picks) +1.00 [+0.75, "
            "+1.25] over 3 seeds, behind on 3, Holm p 0.007: LayerNorm better.") in text
    assert "authors' alphas 0.9/0.9 +" not in text
    rows += [("powernorm-authors", 2, 12000, "cap", 12000, 58.5), ("powernorm-authors", 3, 12000, "cap", 12000, 59.5)]
    _write_convergence(tmp_path, rows)
    text = " ".join(documents.convergence_text(tmp_path))  # authors minus LayerNorm: +3.0, +0.5, +0.5
    assert "Holm over the 2: PN (its picks) +1.00 [+0.75, +1.25] over 3 seeds, behind on 3, Holm p 0.007: LayerNorm " \
           "better; PN, authors' alphas 0.9/0.9 +1.33 [-2.25, +4.92] over 3 seeds, behind on 3, Holm p 0.251: no " \
           "difference shown." in text


def _summary_rows() -> list[list[str]]:
    table = documents.summary_table(ROOT, "tuned_comparison/summary.md#1")
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]


def test_the_binding_table_recomputes_every_row_of_the_studys_summary():
    finals = documents.read_finals(TUNED / "results.csv")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in documents.binding_table(finals)[2:47]]
    summary = _summary_rows()
    assert len(rows) == len(summary) == 45
    for row, expected in zip(rows, summary):
        # the summary's columns: ..., paired seeds, interval, Holm p, verdict
        assert row[6].split()[0] == expected[7] and row[7] == expected[8], (row, expected)
        assert row[11] == expected[9] and row[13] == expected[10], (row, expected)


def test_protocol_two_keeps_its_family_of_29():
    finals = documents.read_finals(TUNED / "results.csv")
    rows = documents.protocol_table(finals)[2:]
    assert len(rows) == 29 and not any("DyT" in row or "Derf" in row for row in rows)


def test_the_detectable_difference_has_the_power_it_claims():
    differences = [0.1, 0.5, 0.2, 0.9, 0.4]
    alpha = 0.05 / 45
    d = documents.detectable_difference(differences, alpha)
    n, mean = len(differences), sum(differences) / len(differences)
    spread = math.sqrt(sum((x - mean) ** 2 for x in differences) / (n - 1))
    critical = t_quantile(1 - alpha / 2, n - 1)
    assert documents._power(d * math.sqrt(n) / spread, n - 1, critical) == pytest.approx(0.8, abs=1e-4)
    # many seeds: the normal approximation (z quantiles of 1 - alpha/2 and of the power)
    many = [float(i % 7) for i in range(400)]
    normal = (2.241403 + 0.841621) * math.sqrt(sum((x - 3) ** 2 for x in many) / 399) / 20
    assert documents.detectable_difference(many, 0.025) == pytest.approx(normal, rel=0.01)
    with pytest.raises(ValueError, match="at least 2 paired differences, got 1"):
        documents.detectable_difference([1.0], 0.05)


def test_the_headline_quotes_only_intervals_that_its_tables_hold():
    text = STUDIES_MD.read_text(encoding="utf-8")
    headline = _headline(text)
    generated = "".join(documents.section(name, ROOT) for name in [documents.ANSWER, *documents.TABLES])
    interval = re.compile(r"[+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]")
    quoted = interval.findall(" ".join(_outside_generated(headline).split()))
    assert quoted and [q for q in quoted if q not in generated] == []


def test_the_tuned_comparison_never_words_no_difference_shown_as_equality():
    text = STUDIES_MD.read_text(encoding="utf-8")
    prose = " ".join(_outside_generated(_headline(text)).split())
    assert re.findall(r"\bno difference\b(?! (?:is )?shown)", prose) == []
    assert re.findall(r"(?<!top )(?<!word-)\blevel\b", prose) == []
    assert "WikiText-103" in _headline(text) and "over protocol 2's 29" in _headline(text)


def test_no_tuning_cell_of_the_export_holds_a_test_score():
    results = [json.loads(path.read_text(encoding="utf-8")) for path in sorted((TUNED / "cells").glob("*/result.json"))]
    tuning = [result for result in results if not result.get("final")]
    assert tuning and len(tuning) < len(results)
    scored = [result["cell"] for result in tuning if any(key.startswith("test") for key in result)]
    assert scored == []
    assert all(any(key.startswith("test_") for key in result) for result in results if result.get("final"))


def _result_rows() -> list[dict[str, str]]:
    with (TUNED / "results.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


RUN_KEYS = ("task", "norm", "updates", "learning_rate", "warmup", "alpha_fwd", "alpha_bkw", "denominator",
            "alpha_init_attention", "alpha_init_other", "seed")


def test_no_ptb_final_repeats_the_tuning_run_that_won_its_pick():
    """Amendment 2: on PTB (tuning and finals validate on the whole split, so a final that trains as a
    tuning run did has its validation score) no final of the tables equals a tuning run's training;
    each that did is kept as stage `replaced`, beside its fresh draw."""
    best = {}
    for row in _result_rows():
        if row["task"] == "ptb" and row["split"] == "validation" and row["metric"] == "best":
            best.setdefault(row["stage"], {})[tuple(row[key] for key in RUN_KEYS)] = row["value"]
    repeats = [run for run, value in best["final"].items() if best["tune"].get(run) == value]
    assert repeats == []
    replaced = {(run[1], run[2]) for run in best["replaced"]}
    assert replaced == {("dyt", "1500"), ("derf", "1500"), ("dyt", "4500"), ("derf", "4500"),
                        ("powernorm-authors", "4500")}
    assert all(best["replaced"][run] == best["tune"][run] for run in best["replaced"])


def test_the_initial_alphas_were_run_beyond_the_grids_edge_on_ptb_validation_only():
    rows = [row for row in _result_rows() if row["task"] == "ptb" and row["norm"] in ("dyt", "derf")
            and row["alpha_init_attention"] and float(row["alpha_init_attention"]) > 2]
    assert {row["norm"] for row in rows} == {"dyt", "derf"}
    assert {(row["stage"], row["split"]) for row in rows} == {("tune", "validation")}


def test_the_answer_opens_with_protocol_threes_verdicts_once_it_has_them(tmp_path):
    """Nothing before 3 paired seeds; then each judged arm beside its 4,500-update row, and an ordering
    of the means that changed opens the answer, which the README and STUDIES.md share."""
    (tmp_path / "results" / "tuned_comparison").mkdir(parents=True)
    shutil.copyfile(TUNED / "results.csv", tmp_path / "results" / "tuned_comparison" / "results.csv")
    finals = documents.read_finals(TUNED / "results.csv")
    tuned = "\n".join(documents.answer_text(finals)) + "\n"
    two = [("layernorm", seed, 12000, "cap", 12000, 60.0 + seed) for seed in (1, 2)]
    _write_convergence(tmp_path, [*two, *(("powernorm", seed, 12000, "cap", 12000, 59.0 + seed) for seed in (1, 2))])
    assert documents.section(documents.ANSWER, tmp_path) == tuned
    layernorm = [*two, ("layernorm", 3, 10000, "rule", 8000, 63.0)]
    behind = [("powernorm", seed, 12000, "cap", 12000, 60.0 + seed + d) for seed, d in ((1, 0.4), (2, 0.5), (3, 0.6))]
    _write_convergence(tmp_path, [*layernorm, *behind])
    converged, rest = documents.section(documents.ANSWER, tmp_path).split("\n\n")
    assert rest == tuned
    # +0.4, +0.5, +0.6: t 8.66 on 2 df, p 0.0131, doubled over the family of 2 (the authors' arm at p = 1)
    assert " ".join(converged.split()) == (
        "Protocol 3 (PTB trained until validation stops improving or for 12,000 updates; 6 of 15 runs finished, 5 of "
        "them stopped by the cap), PN minus LayerNorm in test perplexity per BPE token, paired by seed, Holm over the "
        "2 (the arm not judged yet counted at p = 1): PN (its picks) +0.50 [+0.25, +0.75] over 3 seeds, Holm p 0.026: "
        "LayerNorm better, against +0.53 [+0.34, +0.72] at 4,500 updates (no difference shown over the 45): the "
        "ordering of the means held.")
    _write_convergence(tmp_path, [*two, ("layernorm", 3, 12000, "cap", 12000, 63.0), *behind])
    assert "or for 12,000 updates; 6 of 15 runs finished, all of them stopped by the cap)" in " ".join(
        documents.section(documents.ANSWER, tmp_path).split())
    ahead = [("powernorm", seed, 12000, "cap", 12000, 60.0 + seed - d) for seed, d in ((1, 0.2), (2, 0.9), (3, 0.1))]
    authors = [("powernorm-authors", seed, 12000, "cap", 12000, 61.0 + 1.1 * seed) for seed in (1, 2, 3)]
    _write_convergence(tmp_path, [*layernorm, *ahead, *authors])
    converged = " ".join(documents.section(documents.ANSWER, tmp_path).split("\n\n")[0].split())
    assert converged.startswith("The ordering changed where training ends, for PN (its picks). Protocol 3 (PTB "
                                "trained until validation stops improving or for 12,000 updates; 9 of 15 runs "
                                "finished")
    assert "Holm over the 2: PN (its picks) -0.40 [" in converged
    assert "the ordering of the means reversed, PN now ahead; PN, authors' alphas 0.9/0.9 +1.20 [+0.95, +1.45]" \
        in converged and converged.endswith("(LayerNorm better over the 45): the ordering of the means held.")
