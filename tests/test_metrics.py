"""The training metrics (ortflow.training.metrics, run_summary.py): metrics.json is strict JSON."""

from __future__ import annotations

import json

from ortflow.training.run_summary import strict


def test_metrics_are_strict_json():
    summary = strict({"samples_per_s": float("nan"), "eval": {"loss": float("inf")}, "history": [1.5]})
    assert summary == {"samples_per_s": None, "eval": {"loss": None}, "history": [1.5]}
    json.dumps(summary, allow_nan=False)
