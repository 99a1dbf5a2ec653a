#!/usr/bin/env python3
"""Per-layer share plot of an `msa attn-map` run (docs/attention-maps.md).

Reads the run's attention_map.json and draws, per measured layer, the share of the text
queries' attention that lands on the span (bars: dense and MSA layers in two colours), on MSA
layers the share of selected blocks that hold span tokens (dots), and the share uniform
attention over the visible keys would give (dashed line): the level that means "no preference
for the span".

    python scripts/plot_attn_map.py OUT/attention_map.json [--out OUT/layer_shares.png]

Needs matplotlib (pinned in tests/python/requirements.txt; scripts/test_python.sh installs it
into build/python-venv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    for key in ("layers", "span", "grid", "queries", "uniform_visual_share"):
        if key not in doc:
            raise ValueError(f"{path}: not an msa attn-map document (no '{key}')")
    return doc


def plot(doc, out_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = doc["layers"]
    ids = [layer["layer"] for layer in layers]
    x = list(range(len(layers)))
    colours = {"dense": "tab:blue", "msa": "tab:orange"}
    fig, ax = plt.subplots(figsize=(max(6.5, 0.3 * len(layers) + 3), 4.8))
    for kind, label in (("dense", "dense layer"), ("msa", "MSA layer")):
        xs = [i for i, layer in zip(x, layers) if layer["kind"] == kind]
        ys = [100 * layers[i]["visual_mass_share"] for i in xs]
        if xs:
            ax.bar(xs, ys, color=colours[kind], label=f"{label}: attention on the span")
    msa = [(i, layer["selected_visual_block_share"]) for i, layer in zip(x, layers)
           if layer["kind"] == "msa" and layer["selected_visual_block_share"] is not None]
    if msa:
        ax.plot([i for i, _ in msa], [100 * s for _, s in msa], "o", color="black", markersize=4,
                label="MSA: selected blocks holding span tokens")
    ax.axhline(100 * doc["uniform_visual_share"], color="gray", linestyle="--", linewidth=1,
               label="uniform attention over visible keys")
    ax.set_xticks(x)
    ax.set_xticklabels([str(i) for i in ids], fontsize=8 if len(ids) > 30 else 10)
    ax.set_xlabel("layer")
    ax.set_ylabel("% (mean over heads and text queries)")
    ax.set_ylim(0, 100)
    span, grid, queries = doc["span"], doc["grid"], doc["queries"]
    ax.set_title(f"Text queries {queries['begin']}-{queries['end'] - 1} attending to tokens "
                 f"{span['begin']}-{span['end'] - 1} ({grid['rows']} x {grid['cols']} grid)", fontsize=11)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="attention_map.json written by msa attn-map")
    parser.add_argument("--out", help="the plot (PNG); default: layer_shares.png beside the JSON")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.json)), "layer_shares.png")
    try:
        doc = load(args.json)
    except (OSError, ValueError) as error:
        print(f"plot_attn_map: {error}", file=sys.stderr)
        return 2
    plot(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
