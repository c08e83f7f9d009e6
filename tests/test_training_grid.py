"""Study grids: finished cells are never redone, a killed cell is rerun from scratch, and cells run
in parallel fresh processes with the same results as in one process."""

import json
import os
from pathlib import Path

import pytest

from hf_powernorm.training.grid import Cell, cell_result, run_grid


def square(cell: Cell, folder: Path) -> dict:
    """A cell that leaves a trace of every call in the grid's folder and a file in its own."""
    (folder / "work.txt").write_text("done")
    calls = folder.parents[1] / "calls"
    calls.mkdir(exist_ok=True)
    (calls / f"{cell.name}.{os.getpid()}.{len(list(calls.iterdir()))}").touch()
    return {"square": cell.options["x"] ** 2, "pid": os.getpid()}


def _calls(root: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in (root / "calls").iterdir()) if (root / "calls").exists() else []


def test_a_grid_resumes_without_redoing_finished_cells(tmp_path):
    cells = [Cell(f"x{x}", {"x": x}) for x in range(4)]
    run_grid(cells[:2], square, tmp_path)
    assert _calls(tmp_path) == ["x0", "x1"]
    # A cell killed midway: its folder exists without a result; it is cleared and run again.
    killed = tmp_path / "cells" / "x2"
    killed.mkdir()
    (killed / "half_written.bin").write_bytes(b"\0")
    results = run_grid(cells, square, tmp_path)
    assert [r["square"] for r in results] == [0, 1, 4, 9] and [r["x"] for r in results] == [0, 1, 2, 3]
    assert _calls(tmp_path) == ["x0", "x1", "x2", "x3"]  # x0 and x1 were not redone
    assert not (killed / "half_written.bin").exists() and (killed / "work.txt").is_file()
    assert cell_result(tmp_path, cells[3]) == results[3]
    assert json.loads((tmp_path / "cells" / "x3" / "result.json").read_text())["cell"] == "x3"


def test_cells_run_in_parallel_fresh_processes(tmp_path):
    cells = [Cell(f"x{x}", {"x": x}) for x in (2, 3)]
    results = run_grid(cells, square, tmp_path, jobs=2)
    assert [r["square"] for r in results] == [4, 9]
    assert os.getpid() not in {r["pid"] for r in results}
    assert len({r["pid"] for r in results}) == 2  # one fresh process per cell


def test_bad_grids_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"unique; repeated: \['a'\]"):
        run_grid([Cell("a"), Cell("a")], square, tmp_path)
    with pytest.raises(ValueError, match="plain folder name; got '../up'"):
        Cell("../up")
    with pytest.raises(ValueError, match="jobs must be at least 1; got 0"):
        run_grid([Cell("a", {"x": 1})], square, tmp_path, jobs=0)


def test_a_grid_never_mixes_runs_of_other_options(tmp_path):
    run_grid([Cell("a", {"x": 2, "budget": {"steps": 600}, "data": "/old/place"}, paths=("data",))], square, tmp_path)
    # The same cell read from a moved corpus is the same run ...
    moved = Cell("a", {"x": 2, "budget": {"steps": 600}, "data": "/new/place"}, paths=("data",))
    assert run_grid([moved], square, tmp_path)[0]["square"] == 4
    # ... another budget in the same folder is an error, for resuming and for reporting alike.
    longer = Cell("a", {"x": 2, "budget": {"steps": 1500}, "data": "/new/place"}, paths=("data",))
    with pytest.raises(ValueError, match=r"other options .*budget: ran with \{'steps': 600\}, asked \{'steps': 1500\}"):
        run_grid([longer], square, tmp_path)
    with pytest.raises(ValueError, match="budget"):
        cell_result(tmp_path, longer)
    # An option the finished run did not record (added to the study since) is not compared.
    assert cell_result(tmp_path, Cell("a", {"x": 2, "budget": {"steps": 600}, "new_option": 1}))["square"] == 4
    assert _calls(tmp_path) == ["a"]  # nothing was rerun or overwritten
    with pytest.raises(ValueError, match=r"paths \['data'\] are not among its options \['x'\]"):
        Cell("b", {"x": 1}, paths=("data",))


def test_report_only_returns_the_finished_cells_and_runs_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished run under"):
        run_grid([Cell("a", {"x": 1})], square, tmp_path, report_only=True)
    assert not (tmp_path / "cells").exists()
    cells = [Cell(f"x{x}", {"x": x}) for x in range(3)]
    run_grid(cells[1:2], square, tmp_path)
    assert [r["square"] for r in run_grid(cells, square, tmp_path, report_only=True)] == [1]
    assert _calls(tmp_path) == ["x1"]
