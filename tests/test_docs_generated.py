"""The documents against their data: the exported tuned comparison keeps the blind rule (no tuning
run's cell holds a test score)."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELLS = ROOT / "studies" / "tuned_comparison" / "cells"


def test_no_tuning_cell_of_the_export_holds_a_test_score():
    results = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(CELLS.glob("*/result.json"))]
    tuning = [result for result in results if not result.get("final")]
    assert tuning and len(tuning) < len(results)
    scored = [result["cell"] for result in tuning if any(key.startswith("test") for key in result)]
    assert scored == []
    assert all(any(key.startswith("test_") for key in result) for result in results if result.get("final"))
