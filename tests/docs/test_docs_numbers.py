"""The figures in the prose of the tuned comparison's answer against its data: STUDIES.md up to the
earlier studies, the README, docs/studies.md and the binding family's part of docs/tuned_comparison.md
(the protocols' records and the runs' log quote values of their own time, and stay as written).

Outside the generated sections, every paired interval quoted as `+X [+LO, +HI]` is one that
`results.csv` gives for some pair of arms at one task, budget and score; every `Holm p` is a Holm-adjusted
p-value of the binding family (45), protocol 2's (29) or the binding family without tinyshakespeare, at
the digits quoted (a value followed by `->`, what a verdict read before a change, excepted); and a
clause that says "every seed", "all five seeds" or "N of N seeds" beside an interval quotes a comparison whose per-seed differences all have one sign (five of them for "five").
The caveat on verdicts near 0.05 is checked figure by figure."""

import re
from pathlib import Path

import pytest

from hf_powernorm.studies import documents
from hf_powernorm.training.statistics import paired_t_interval

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = re.compile(r"[+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]")
HOLM = re.compile(r"\bHolm (?:p )?(\d\.\d+)(?!\d| ->)")  # "Holm 0.023 -> 0.065": a value before a change
EVERY_SEED = re.compile(r"\bevery seed\b|\ball (?:five|5) seeds\b|\b(\d) of \1 seeds\b")


def _prose(text: str) -> str:
    return " ".join(documents.SECTION.sub("", text).split())


def quoted_prose(root: Path = ROOT) -> dict[str, str]:
    """The prose whose figures are checked, by document."""
    studies = (root / "STUDIES.md").read_text(encoding="utf-8")
    page = (root / "docs" / "tuned_comparison.md").read_text(encoding="utf-8")
    return {"STUDIES.md": _prose(studies[:studies.index("## The earlier studies")]),
            "README.md": _prose((root / "README.md").read_text(encoding="utf-8")),
            "docs/studies.md": _prose((root / "docs" / "studies.md").read_text(encoding="utf-8")),
            "docs/tuned_comparison.md": _prose(page[:page.index("## Protocol 2's record")])}


def computed_intervals(finals: dict) -> dict[str, list[list[float]]]:
    """Every paired interval the data give (each pair of arms, both ways, at one task, budget and score),
    as quoted, -> the per-seed differences of each comparison that prints so."""
    found: dict[str, list[list[float]]] = {}
    by_cell: dict[tuple, dict[str, dict[int, float]]] = {}
    for (task, norm, updates, metric), values in finals.items():
        by_cell.setdefault((task, updates, metric), {})[norm] = values
    for arms in by_cell.values():
        for arm, other in arms.items():
            for against, base in arms.items():
                seeds = sorted(set(other) & set(base))
                if arm == against or len(seeds) < 2:
                    continue
                differences = [other[s] - base[s] for s in seeds]
                i = paired_t_interval(differences)
                found.setdefault(f"{i.mean:+.2f} [{i.low:+.2f}, {i.high:+.2f}]", []).append(differences)
    return found


def holm_values(finals: dict) -> list[float]:
    """The Holm-adjusted p-values of the binding family, protocol 2's 29 and the 45 less tinyshakespeare."""
    protocol_2 = [(arm, against) for arm, against in documents.COMPARED if arm not in documents.ELEMENTWISE]
    without = {key: value for key, value in finals.items() if key[0] != "tinyshakespeare"}
    return [c["verdict"].adjusted_p for c in [*documents.comparisons(finals),
                                              *documents.comparisons(finals, protocol_2),
                                              *documents.comparisons(without)]]


def misquoted(prose: dict[str, str], finals: dict) -> list[str]:
    """What the prose quotes that the data do not give, each as `document: quote`."""
    intervals, holm = computed_intervals(finals), holm_values(finals)
    wrong = []
    for name, text in prose.items():
        wrong += [f"{name}: {q}" for q in INTERVAL.findall(text) if q not in intervals]
        for value in HOLM.findall(text):
            digits = len(value.split(".")[1])
            if not any(f"{p:.{digits}f}" == value for p in holm):
                wrong.append(f"{name}: Holm {value}")
        for clause in re.split(r"(?<=[.;])\s", text):
            claim = EVERY_SEED.search(clause)
            for q in INTERVAL.findall(clause) if claim else []:
                n = 5 if re.search(r"five|5", claim.group(0)) else None
                if not any(len({d > 0 for d in ds}) == 1 and 0 not in ds and n in (None, len(ds))
                           for ds in intervals.get(q, [])):
                    wrong.append(f"{name}: '{claim.group(0)}' beside {q}")
    return wrong


@pytest.fixture(scope="module")
def finals() -> dict:
    return documents.read_finals(ROOT / "results" / "tuned_comparison" / "results.csv")


def test_the_prose_quotes_what_the_data_give(finals):
    prose = quoted_prose()
    assert sum(len(INTERVAL.findall(text)) for text in prose.values()) > 10
    assert misquoted(prose, finals) == []


@pytest.mark.parametrize("edit", [("+0.53 [+0.34, +0.72]", "+0.53 [+0.34, +0.73]"), ("Holm 0.0555", "Holm 0.0455"),
                                  ("+0.72 [+0.46, +0.98] on PTB at 4,500, behind on all five seeds",
                                   "+0.18 [-0.19, +0.54] on PTB at 4,500, behind on all five seeds")])
def test_a_hand_edited_figure_is_caught(finals, edit):
    prose = quoted_prose()
    old, new = edit
    assert old in prose["STUDIES.md"]
    prose["STUDIES.md"] = prose["STUDIES.md"].replace(old, new, 1)
    assert misquoted(prose, finals) != []


def fragility_misquoted(text: str, finals: dict) -> list[str]:
    """The caveat on verdicts near 0.05: each p-value it quotes is a Holm p of the three families (or,
    after "misses by", a distance of one from 0.05), and its range of detectable differences is the
    tinyshakespeare rows' (rounded)."""
    caveat = re.search(r"Fragility near 0\.05:\*? (.*?)(?:\n\n|$)", text, re.S).group(1)
    caveat = " ".join(caveat.split())
    holm = holm_values(finals)
    wrong = []
    for before, value in re.findall(r"(misses by )?(0\.0\d+)", caveat):
        digits = len(value.split(".")[1])
        candidates = [abs(p - 0.05) for p in holm] if before else holm
        if not any(f"{p:.{digits}f}" == value for p in candidates):
            wrong.append(f"{before}{value}")
    rows = [c for c in documents.comparisons(finals) if c["task"] == "tinyshakespeare"]
    detectable = [documents.detectable_difference(list(c["verdict"].differences.values()),
                                                  0.05 / (c["family"] - c["step"] + 1)) for c in rows]
    quoted = re.search(r"detectable differences are (\d+)-(\d+)", caveat)
    if quoted is None or quoted.groups() != (f"{min(detectable):.0f}", f"{max(detectable):.0f}"):
        wrong.append(f"detectable {quoted and quoted.group(0)} against {min(detectable):.0f}-{max(detectable):.0f}")
    return wrong


def test_the_caveat_on_verdicts_near_005_quotes_the_data(finals):
    text = (ROOT / "STUDIES.md").read_text(encoding="utf-8")
    assert fragility_misquoted(text, finals) == []
    assert fragility_misquoted(text.replace("(0.0497)", "(0.0487)"), finals) == ["0.0487"]
    assert fragility_misquoted(text.replace("misses by 0.0055", "misses by 0.0065"), finals) == ["misses by 0.0065"]
