"""Keep every cache and temporary file inside the working tree, offline, one thread, before any HF import.

Remote-code modules are written to a dynamic-module cache private to this test session
(`HF_MODULES_CACHE`), so that no `transformers_modules` package left by an earlier run is on any
path a test looks at.
"""

import atexit
import os
import pathlib
import shutil
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
for _name, _sub in (("HF_HOME", ".cache/hf"), ("TMPDIR", ".cache/tmp"), ("HF_POWERNORM_CACHE", ".cache/kernels")):
    _path = _ROOT / _sub
    _path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(_name, str(_path))
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
# One intra-op thread, here and in every process a test starts: the suite runs a process per core, and torch's
# threads spin-wait for a core the other process holds, which made tiny models' steps several times slower.
# A test of threading sets its own count (torch.set_num_threads). A count the user set is left to OpenMP.
_SET_HERE = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tempfile  # noqa: E402

tempfile.tempdir = os.environ["TMPDIR"]
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)

from collections.abc import Callable, Iterator  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if _SET_HERE:
    torch.set_num_threads(1)  # where a plugin imported torch before the variable was set


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest, and several threads crawl when the cores are busy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def reset_accelerate() -> Iterator[Callable[[], None]]:
    """Accelerate's state is one per process: forget it after the test, and when the test calls
    the returned function, so that the next in-process run starts afresh (e.g. another precision)."""
    yield _reset_accelerate_state
    _reset_accelerate_state()


class HubRecorder:
    """Stands in for the Hub (no Hub server is reachable from the tests): records the repositories
    `HfApi.create_repo` creates and the files `HfApi.create_commit` sends."""

    def __init__(self):
        self.repos, self.commits = [], []

    def create_repo(self, api, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        self.repos.append((repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, **kwargs):
        from huggingface_hub import CommitInfo

        files = {}
        for operation in operations:
            with operation.as_file() as handle:
                files[operation.path_in_repo] = handle.read()
        self.commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{'0' * 40}", commit_message="",
                          commit_description="", oid="0" * 40)


@pytest.fixture
def hub() -> Iterator[HubRecorder]:
    """A `HubRecorder` in place of `HfApi.create_repo` and `HfApi.create_commit` during the test."""
    recorder = HubRecorder()
    with mock.patch.multiple(
        "huggingface_hub.HfApi",
        create_repo=lambda api, repo_id, **kw: recorder.create_repo(api, repo_id, **kw),
        create_commit=lambda api, repo_id, operations, **kw: recorder.create_commit(api, repo_id, operations, **kw),
    ):
        yield recorder


def sys_path_without_the_package() -> list[str]:
    """`sys.path` for a fresh `python -S` process in which `hf_powernorm` must not be importable.

    Only the directories of installed distributions (those holding a `*.dist-info`), never one that
    holds `hf_powernorm`: everything else this process put on its path at run time stays out - the
    project root on PYTHONPATH, pytest's test folders, `recipes/`, and the dynamic-module caches
    that transformers, evaluate and datasets append once they have loaded a module. Such a cache
    may hold a `transformers_modules` package of its own, which would shadow the child's and fail
    its remote-code import with `No module named 'transformers_modules.<dir>'`.
    """
    kept = []
    for entry in sys.path:
        path = pathlib.Path(entry) if entry else None
        if path is None or not path.is_dir() or (path / "hf_powernorm").exists():
            continue
        if next(path.glob("*.dist-info"), None) is not None:
            kept.append(str(path))
    return kept


@pytest.fixture
def run_without_the_package(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """Returns `run(source, hf_home, workdir=None, timeout=300)`: runs `source` in a fresh
    interpreter (`python -S`, no site hooks, so no editable-install finder) where `hf_powernorm`
    cannot be imported, offline, with its own `HF_HOME`, one thread and no standard input (a
    `trust_remote_code` prompt fails instead of waiting)."""

    def run(source: str, hf_home: pathlib.Path, workdir: pathlib.Path | None = None,
            timeout: int = 300) -> subprocess.CompletedProcess:
        workdir = workdir or tmp_path / "fresh_process"
        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / "child.py"
        script.write_text(
            f"import sys\nsys.path.extend({sys_path_without_the_package()!r})\n"
            "import importlib.util\n"
            "assert importlib.util.find_spec('hf_powernorm') is None, 'hf_powernorm must not be importable here'\n"
            + source
        )
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "HF_HOME": str(hf_home),
               "TMPDIR": str(workdir), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
        return subprocess.run([sys.executable, "-S", str(script)], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def job_environment(monkeypatch, request) -> Iterator[None]:
    """What the jobs of `--executor submitit` or `ray` inherit: this checkout, the tests' helpers and
    the requesting test's module importable, one thread each; Ray's session folder short (its
    sockets' paths must stay under the 107 bytes of AF_UNIX, which a checkout's deep TMPDIR can
    pass), removed afterwards."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(_ROOT), str(_ROOT / "tests"), str(request.path.parent)]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    yield
    shutil.rmtree(ray_dir, ignore_errors=True)
