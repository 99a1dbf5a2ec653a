"""The training example's smoke run (examples/train_msa_lm.py --preset smoke): a few seconds on
the CPU through MSAAttention, indexer, sparse attention, its backward and the KL; it must run,
stay finite and write its log, plot and summary. (The recall target is the H200 run's.)"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))


def test_training_example_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    import train_msa_lm

    summary, log = train_msa_lm.train(train_msa_lm.parse(["--preset", "smoke", "--out", str(tmp_path)]),
                                      progress=False)
    assert summary["steps_run"] == 30
    assert all(math.isfinite(e["lm_loss"]) and math.isfinite(e["kl_loss"]) for e in log)
    assert all(0.0 <= e["recall"] <= 1.0 for e in log)
    for name in ("train_log.jsonl", "train_msa_lm.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["chance_recall"] > 0
