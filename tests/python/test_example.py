"""The training example's smoke run (examples/train_msa_lm.py --preset smoke): a few seconds on
the CPU through MSAAttention, indexer, sparse attention, its backward and the KL. It must learn:
the answers' loss falls, the answers become mostly right, and the indexer (trained by the KL
alone) selects the needles' blocks of held-out long sequences far more often than chance."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))


def test_training_example_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    import train_msa_lm

    # One thread: the run is small, and on a shared 2-core runner more threads only contend
    # (4x slower seen). The CPU ops and torch share the OpenMP setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary, log = train_msa_lm.train(train_msa_lm.parse(["--preset", "smoke", "--out", str(tmp_path)]),
                                          progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["steps_run"] == 60
    assert all(math.isfinite(e["lm_loss"]) and math.isfinite(e["kl_loss"]) for e in log)
    assert all(0.0 <= e["recall"] <= 1.0 for e in log)
    # It learns: the loss starts near chance (ln 9 answers) and falls well below it.
    assert summary["first_lm_loss"] > 2.0
    assert summary["final_lm_loss"] < 0.5 * summary["first_lm_loss"], summary
    assert summary["final_answer_accuracy"] > 0.6, summary
    assert summary["final_recall"] > summary["chance_recall"] + 0.4, summary
    assert {e["phase"] for e in log} == {"warmup", "long"}
    for name in ("train_log.jsonl", "train_msa_lm.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["chance_recall"] > 0
