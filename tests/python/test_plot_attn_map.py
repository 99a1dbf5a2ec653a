"""scripts/plot_attn_map.py on a hand-written `msa attn-map` document: the per-layer share
plot is written as a PNG, and a file that is not such a document is refused."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def document():
    layer = lambda i, kind, share, blocks: {  # noqa: E731
        "layer": i, "kind": kind, "visual_mass_share": share, "selected_visual_block_share": blocks,
        "heatmap": [[share / 4, share / 4], [share / 4, share / 4]], "png": f"layer_{i}.png"}
    return {"span": {"begin": 1, "end": 5}, "grid": {"rows": 2, "cols": 2},
            "queries": {"begin": 5, "end": 9}, "uniform_visual_share": 0.55, "heads": [0, 1],
            "layers": [layer(0, "dense", 0.6, None), layer(3, "msa", 0.3, 0.5), layer(4, "msa", 0.7, 1.0)]}


def test_share_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_attn_map

    source = tmp_path / "attention_map.json"
    source.write_text(json.dumps(document()))
    assert plot_attn_map.main([str(source)]) == 0
    written = tmp_path / "layer_shares.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert written.stat().st_size > 5000  # axes, bars and text, not an empty canvas


def test_other_files_are_refused(tmp_path, capsys):
    import plot_attn_map

    source = tmp_path / "other.json"
    source.write_text(json.dumps({"layers": []}))
    assert plot_attn_map.main([str(source)]) == 2
    assert "not an msa attn-map document" in capsys.readouterr().err
    assert plot_attn_map.main([str(tmp_path / "missing.json")]) == 2
