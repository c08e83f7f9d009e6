"""The benchmark suite runs end to end at its `--quick` size and writes well-formed tables (not speed)."""

import pytest

from hf_powernorm import benchmarks

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_suite_prints_every_table_and_rewrites_only_its_section(tmp_path, capsys):
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(f"# Benchmarks\n\nkept above\n\n{benchmarks.MARK_BEGIN}\nold figures\n{benchmarks.MARK_END}\n\nkept below\n")
    tables = benchmarks.main(["--quick", "--write", str(target)])
    titles = [title for title, _, _ in tables]
    assert len(titles) == 7 and titles[0] == benchmarks.ANSWER_TITLE
    for word in ("Allocator", "training step", "eval forward", "Memory", "Models", "First-call"):
        assert any(word in title for title in titles), word
    for title, header, rows in tables:
        assert rows, title
        assert all(len(row) == len(header) for row in rows), title
    answer, train, evaluation = tables[0][2], tables[2][2], tables[3][2]
    assert [row[0] for row in answer] == benchmarks.ANSWER_ROWS  # every norm has both a training and an eval row
    medians = {table: {row[0]: [cell.split(" ")[0] for cell in row[1:]] for row in rows}
               for table, rows in (("train", train), ("eval", evaluation))}
    for label, *cells in answer:  # each cell: that norm's two medians, from the two layer tables
        assert cells == [f"{t} / {e}" for t, e in zip(medians["train"][label], medians["eval"][label])]
    tables = tables[1:]
    layer = {row[0]: row[1:] for row in tables[1][2]}
    assert set(layer) == set(benchmarks.LAYER_CASES)
    assert all(cell.count("(") == 1 and cell.endswith(" ms") for cells in layer.values() for cell in cells)
    models = [row[0] for row in tables[4][2]]
    assert any("BART" in row and "train step" in row for row in models)
    assert sum("generate" in row for row in models) == 7 and any("fold_norms" in row for row in models)
    assert sum("our PN model / our LN model" in row for row in models) == 2
    memory = {row[0]: row for row in tables[3][2]}
    assert set(memory) == {"F.layer_norm", *benchmarks.MEMORY_CASES}
    assert all(row[3].endswith(" MiB") for row in memory.values())  # the peak, measured
    first_calls = {row[0]: row[1] for row in tables[5][2]}
    built = first_calls["build the C kernels (cc, empty cache)"]
    assert built == "no compiler" or float(built) > 0  # seconds; the C++ operator's minute is left out at --quick
    assert first_calls["build the C kernels and DyT's and Derf's C++ operator (cc, c++, empty cache)"] == \
        "not measured (--quick)"
    written = target.read_text()
    assert written.startswith("# Benchmarks\n\nkept above\n") and written.rstrip().endswith("kept below")
    assert "old figures" not in written and written.count(benchmarks.MARK_BEGIN) == 1
    assert "Command: `python -m hf_powernorm.benchmarks --quick" in written
    section = written[written.index(benchmarks.MARK_BEGIN):]
    assert section.splitlines()[1].startswith("Machine: ")  # date, machine and command, then the answer
    assert section.splitlines()[3] == f"#### {benchmarks.ANSWER_TITLE}"
    assert "| powernorm G=4 |" in capsys.readouterr().out


def test_norms_narrows_the_suite_to_those_rows_of_the_layer_tables():
    tables = benchmarks.main(["--quick", "--norms", "dyt", "derf"])
    assert [title.split(" / ")[0] for title, _, _ in tables] == [
        "Layer training step (forward + backward)", "Layer eval forward (no_grad)"]
    calls = [f"{name}, its two C calls alone (no module, no autograd)" for name in ("dyt", "derf")]
    for (title, header, rows), extra in zip(tables, (calls, [])):  # the training table: the kernels' share too
        assert [row[0] for row in rows] == ["dyt", "derf", *extra], title
        assert all(len(row) == len(header) and row[1].endswith(" ms") for row in rows)


def test_the_answer_table_reads_the_measured_medians_not_their_text():
    from hf_powernorm.benchmarks import suite

    header = ["norm", "1 thr, (8, 16)", "1 thr, (8, 32)"]
    result = {"ratio": 1.234, "low": 1.0, "high": 2.0, "ms": 0.5}
    train = {"dyt": [result, None], "derf": [{**result, "ratio": 0.5}, result], "not a row": [result, result]}
    evaluation = {"dyt": [{**result, "ratio": 2.0}, result], "derf": [result, result]}
    assert suite.answer_table(header, train, evaluation) == [["dyt", "1.23 / 2.00", "n/a / 1.23"],
                                                             ["derf", "0.50 / 1.23", "1.23 / 1.23"]]
    with pytest.raises(ValueError, match=r"have \[1\] cells a row; the header 2"):
        suite.answer_table(header, {"dyt": [result]}, evaluation)


@pytest.mark.parametrize("argv, message", [
    (["--norms", "dyt", "tanh"], "--norms tanh: not a norm of the layer tables; expected some of"),
    (["--norms", "dyt", "--write", "BENCHMARKS.md"], "--norms with --write"),
])
def test_norms_refuses_unknown_names_and_a_partial_write(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmarks.main(["--quick", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_model_table_traces_every_model_in_one_graph(capsys):
    """`benchmarks.compiled` at its quick size with `aot_eager` (tracing, no code generated): one graph and
    no graph break for the PN-encoder, PN-everywhere and LayerNorm models."""
    from hf_powernorm.benchmarks import compiled

    text = compiled.main(["--device", "cpu", "--backend", "aot_eager", "--quick"])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| PN") or line.startswith("| LayerNorm")]
    assert [row[0] for row in rows] == ["| PN encoder, LN decoder", "| PN in every layer", "| LayerNorm"]
    assert all(row[1:3] == ["1", "0"] for row in rows), rows


def test_study_step_times_and_profiles_the_study_lm_step(capsys):
    """`benchmarks.study_step`: a median step time, and with --profile every category and the step total."""
    from hf_powernorm.benchmarks import study_step

    assert study_step.main(["--norm", "layernorm", "--steps", "1"])["step"] > 0
    totals = study_step.main(["--norm", "dyt", "--steps", "1", "--profile"])
    assert set(totals) == {*study_step.CATEGORIES, "step"}
    assert totals["step"] == sum(totals[name] for name in study_step.CATEGORIES) > 0
    assert totals[study_step.CATEGORIES[0]] > 0 and totals[study_step.CATEGORIES[1]] > 0  # matmuls and the loss
    assert totals[study_step.CATEGORIES[4]] > 0  # DyT's autograd function, in the norms' category
    with pytest.raises(SystemExit):
        study_step.main(["--steps", "0"])
    assert "--steps must be at least 1; got 0" in capsys.readouterr().err


def test_study_step_against_another_norm_interleaves_the_two_models(capsys):
    from hf_powernorm.benchmarks import study_step

    result = study_step.main(["--norm", "dyt", "--against", "layernorm", "--steps", "2"])
    assert result["ratio"] > 0 and result["low"] <= result["ratio"] <= result["high"] and result["ms"] > 0
    assert capsys.readouterr().out.startswith("dyt / layernorm: ")
    for argv, message in ((["--against", "tanh"], "--against: unknown norm 'tanh'"),
                          (["--profile", "--against", "layernorm"], "one at a time")):
        with pytest.raises(SystemExit):
            study_step.main(argv)
        assert message in capsys.readouterr().err


def test_host_cost_times_each_norm_against_layer_norm_on_the_device():
    """`benchmarks.host_cost --quick` on the CPU: a row per norm, the step's time, its ratio to
    `F.layer_norm`'s, and the host's issue time, which cannot exceed the synchronised step's."""
    from hf_powernorm.benchmarks import host_cost

    text = host_cost.main(["--device", "cpu", "--quick"])
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = rows[0], rows[1:]
    assert header[0].strip() == "norm" and len(header) == 6
    assert [row[0].strip() for row in body] == ["F.layer_norm", *host_cost.CASES]
    for row in body:
        step, host = float(row[2]), float(row[4])
        assert 0 < host <= step, row
        assert float(row[3].split()[0]) > 0 and row[5].strip() == "-"  # no device ops off CUDA


def test_host_cost_profiles_pn_steps_on_the_host():
    """`--profile N`: PN's steps under cProfile, its own functions among the rows, N steps' calls."""
    from hf_powernorm.benchmarks import host_cost

    text = host_cost.main(["--device", "cpu", "--quick", "--profile", "4"])
    profile = text[text.index("Host profile of 4 steps of powernorm G=4"):]
    assert "tottime" in profile and "norm_dispatch.py" in profile
    calls = [line.split()[0] for line in profile.splitlines() if "(forward)" in line and "norm_dispatch.py" in line]
    assert calls and all(count == "4" for count in calls), profile  # one forward per step, 4 steps
    with pytest.raises(SystemExit):
        host_cost.main(["--device", "cpu", "--quick", "--profile", "-1"])


def test_help_time_measures_each_help_and_the_librarys_import_in_fresh_processes(capsys):
    from hf_powernorm.benchmarks import help_time

    rows = help_time.main(["--repeats", "1"])
    assert [r["command"] for r in rows] == ["`hf-powernorm --help`", "`hf-powernorm compare --help`",
                                            "`hf-powernorm studies --help`", "`import hf_powernorm`"]
    assert [r["imports torch"] for r in rows] == ["no", "no", "no", "yes"]
    assert all(float(r["CPU s"]) > 0 for r in rows) and "| `hf-powernorm compare --help` |" in capsys.readouterr().out
