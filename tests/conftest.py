"""Keep every cache and temporary file inside the working tree, offline, before any HF import."""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1]
for _name, _sub in (("HF_HOME", ".cache/hf"), ("TMPDIR", ".cache/tmp"), ("HF_POWERNORM_CACHE", ".cache/kernels")):
    _path = _ROOT / _sub
    _path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(_name, str(_path))
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import tempfile  # noqa: E402

tempfile.tempdir = os.environ["TMPDIR"]

from collections.abc import Callable, Iterator  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


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
