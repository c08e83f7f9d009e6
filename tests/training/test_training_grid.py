"""Study grids: finished cells are never redone, a killed cell is rerun from scratch, and cells run
in parallel fresh processes with the same results as in one process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def test_a_record_copied_without_its_cells_folder_is_refused_not_rerun(tmp_path):
    cells = [Cell(f"x{x}", {"x": x}) for x in range(2)]
    run_grid(cells[:1], square, tmp_path / "old")
    moved = tmp_path / "new"
    shutil.copytree(tmp_path / "old" / "cells", moved)  # the cells' folders, not `cells/` itself
    for report_only in (False, True):
        with pytest.raises(ValueError, match=r"holds 1 finished run\(s\) of this grid at its top level .*x0.*move them"):
            run_grid(cells, square, moved, report_only=report_only)
    assert not (moved / "cells").exists() and _calls(tmp_path / "old") == ["x0"]


def test_a_result_naming_another_cell_is_refused(tmp_path):
    run_grid([Cell("a", {"x": 2})], square, tmp_path)
    path = tmp_path / "cells" / "a" / "result.json"
    for name in ("../../../elsewhere", None):  # reports build paths from the name read back
        edited = {**json.loads(path.read_text()), "cell": name}
        path.write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=f"{path} names the cell {name!r}, not its folder's 'a'"):
            run_grid([Cell("a", {"x": 2})], square, tmp_path, report_only=True)
    assert _calls(tmp_path) == ["a"]


def sleeper(cell: Cell, folder: Path) -> dict:
    """A cell that says which process runs it, then outlasts any test."""
    (folder.parents[1] / f"{cell.name}.pid").write_text(str(os.getpid()))
    time.sleep(120)
    return {}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (an exited process nobody has reaped yet, a zombie, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # no /proc (macOS), or it exited meanwhile
        return True
    return not any(line.split()[1:2] == ["Z"] for line in status.splitlines() if line.startswith("State:"))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_workers_of_a_killed_grid_end_themselves(tmp_path):
    # A grid killed outright (the queue stopped, a session's end) cannot close its pool; its
    # workers must not go on writing cells that the resumed grid runs again.
    driver = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from test_training_grid import sleeper\n"
              "from hf_powernorm.training.grid import Cell, run_grid\n"
              f"run_grid([Cell('a', {{'x': 1}}), Cell('b', {{'x': 2}})], sleeper, {str(tmp_path)!r}, jobs=2)\n")
    grid = subprocess.Popen([sys.executable, "-c", driver])
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"{name}.pid").is_file() for name in "ab"):
            assert grid.poll() is None and time.monotonic() < deadline, "the grid's workers never started"
            time.sleep(0.2)
        workers = [int((tmp_path / f"{name}.pid").read_text()) for name in "ab"]
        assert all(_alive(pid) for pid in workers) and grid.pid not in workers
        grid.send_signal(signal.SIGKILL)
        grid.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers), "a worker outlived its killed grid"
    finally:
        grid.kill()
        for name in "ab":
            pid_file = tmp_path / f"{name}.pid"
            if pid_file.is_file() and _alive(int(pid_file.read_text())):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
