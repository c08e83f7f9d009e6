"""The mutation run's anchors stay current: each mutation's text occurs exactly once in its source
file (a changed line makes `tests/mutation/run_mutations.py` report it as a stale anchor and fail)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mutation" / "run_mutations.py"


def _script():
    spec = importlib.util.spec_from_file_location("run_mutations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


RUN_MUTATIONS = _script()
MUTATIONS = RUN_MUTATIONS.MUTATIONS


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_anchor_occurs_once_and_the_mutation_changes_it(mutation):
    assert RUN_MUTATIONS._anchor_count(mutation, ROOT) == 1, f"{mutation.name}: stale anchor in {mutation.path}"
    assert mutation.replacement != mutation.anchor
    assert all((ROOT / test.split("::")[0]).is_file() for test in mutation.tests)
