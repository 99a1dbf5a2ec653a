#!/usr/bin/env python3
"""Train a small decoder-only LM whose attention is msa.torch.MSAAttention on a synthetic
long-context retrieval task, and watch the indexer learn (through its KL loss alone) to select
the block that holds the needle.

Task. A sequence is random filler tokens with `needles` needle tokens scattered over it, each
encoding a (key, value) pair; its last `needles` tokens are queries, one per needle key in random
order. At each query the model must output the value of the needle with that key (the LM loss
is the cross-entropy of those answers). Needles never sit in the queries' own blocks, so the
answer is only reachable if the indexer selects the needle's block among the top-k.

Recall. For every (query, KV group) row of the indexer, whether it holds the block of the
queried needle; averaged. At the start it is about chance (topk / blocks); the KL objective
(docs/msa.md §5) teaches the index projections to imitate where the main attention looks, and
recall rises to > 0.9 while the LM loss falls.

    python examples/train_msa_lm.py --preset cpu            # ~1 min on 2 cores
    python examples/train_msa_lm.py --preset h200           # 8K-32K tokens on one H200
    python examples/train_msa_lm.py --preset h200 --steps 400 --out runs/h200

Writes OUT/train_log.jsonl (one line per logged step), OUT/train_msa_lm.png (loss and recall)
and OUT/summary.json. Device: --device (cuda when available unless the preset says cpu).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import msa.torch as mt

PRESETS = {
    # A few seconds: the pytest smoke run (the loss falls; no recall target).
    "smoke": dict(device="cpu", steps=30, min_len=256, max_len=384, tokens_per_step=1536, d_model=64, layers=1,
                  q_heads=2, kv_heads=1, head_dim=32, index_dim=32, block_size=32, topk=4, needles=2, keys=8,
                  values=8, lr=1e-2, log_every=5),
    # The CPU run: ~1-2 minutes on 2 cores.
    "cpu": dict(device="cpu", steps=300, min_len=1024, max_len=2048, tokens_per_step=8192, d_model=64, layers=1,
                q_heads=2, kv_heads=1, head_dim=32, index_dim=32, block_size=64, topk=4, needles=1, keys=16,
                values=16, lr=1e-2, log_every=10, warmup_steps=150, warmup_len=256),
    # The H200 run: needles in 8K-32K tokens, M3's block (128) and top-16, wgmma shapes (D = 128).
    "h200": dict(device="cuda", steps=600, min_len=8192, max_len=32768, tokens_per_step=131072, d_model=256,
                 layers=2, q_heads=4, kv_heads=2, head_dim=128, index_dim=128, block_size=128, topk=16, needles=2,
                 keys=64, values=32, lr=3e-3, log_every=10, warmup_steps=300, warmup_len=2048),
}


@dataclass
class Config:
    device: str = "cpu"
    steps: int = 300
    min_len: int = 1024
    max_len: int = 2048
    tokens_per_step: int = 8192
    d_model: int = 64
    layers: int = 1
    q_heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    index_dim: int = 32
    block_size: int = 64
    topk: int = 4
    needles: int = 4
    keys: int = 16
    values: int = 16
    filler: int = 64
    queries: int = 8           # query tokens at each sequence's end (each asks one needle's key)
    warmup_steps: int = 0      # first steps on sequences of warmup_len tokens (<= topk * block_size:
    warmup_len: int = 0        # every block selected, MSA = dense, the KL sees every token)
    eval_every: int = 0        # recall measured on a fresh long batch (min_len..max_len) every N steps
    lr: float = 5e-3
    kl_weight: float = 1.0
    log_every: int = 10
    seed: int = 0
    target_recall: float = 0.9
    stop_at_target: bool = False
    out: str = "runs/train_msa_lm"


# ---- data ----

class Vocab:
    """filler | needles (key, value) | queries (key) | answers (value)."""

    def __init__(self, c: Config):
        self.filler = c.filler
        self.needle0 = c.filler
        self.query0 = self.needle0 + c.keys * c.values
        self.answer0 = self.query0 + c.keys
        self.size = self.answer0 + c.values
        self.values = c.values


def make_batch(c: Config, vocab: Vocab, rng: random.Random, device, lengths=None):
    """Packed sequences of random lengths in [min_len, max_len] filling ~tokens_per_step.
    Returns tokens, cu_seqlens, answer rows / targets, and for recall the needle blocks."""
    tokens, cu, query_rows, targets, needle_blocks = [], [0], [], [], []
    total = 0
    while total < c.tokens_per_step or not tokens:
        low, high = lengths or (c.min_len, c.max_len)
        length = max(rng.randint(low, high), 3 * c.block_size + 2 * c.queries)
        seq = [rng.randrange(vocab.filler) for _ in range(length)]
        keys = rng.sample(range(c.keys), c.needles)
        values = [rng.randrange(c.values) for _ in range(c.needles)]
        # needles: anywhere before the queries' own block (and the block before it)
        limit = ((length - c.queries) // c.block_size - 1) * c.block_size
        spots = rng.sample(range(limit), c.needles)
        for key, value, at in zip(keys, values, spots):
            seq[at] = vocab.needle0 + key * c.values + value
        order = [i % c.needles for i in range(c.queries)]
        rng.shuffle(order)
        for i, n in enumerate(order):
            row = length - c.queries + i
            seq[row] = vocab.query0 + keys[n]
            query_rows.append(total + row)
            targets.append(values[n])
            needle_blocks.append(spots[n] // c.block_size)
        tokens.extend(seq)
        total += length
        cu.append(total)
    as_t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    return (as_t(tokens), as_t(cu, torch.int32), as_t(query_rows), as_t(targets), as_t(needle_blocks), max_len)


# ---- model ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.norm1, self.norm2 = RMSNorm(c.d_model), RMSNorm(c.d_model)
        self.q = nn.Linear(c.d_model, c.q_heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.q_heads * c.head_dim, c.d_model, bias=False)
        self.attn = mt.MSAAttention(c.d_model, c.kv_heads, c.index_dim, topk=c.topk, block_size=c.block_size)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model))

    def forward(self, x, cu, max_len):
        c = self.c
        h = self.norm1(x)
        q = self.q(h).view(-1, c.q_heads, c.head_dim)
        k = self.k(h).view(-1, c.kv_heads, c.head_dim)
        v = self.v(h).view(-1, c.kv_heads, c.head_dim)
        out = self.attn(h, q, k, v, cu, max_len)
        x = x + self.o(out.o.reshape(x.shape[0], -1))
        x = x + self.mlp(self.norm2(x))
        return x, out.kl_loss, out.rows


class TinyLM(nn.Module):
    def __init__(self, c: Config, vocab: Vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab.size, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, vocab.values, bias=False)  # answers only

    def forward(self, tokens, cu, max_len, rows_of_interest):
        x = self.embed(tokens)
        kl_total, rows = 0.0, []
        for block in self.blocks:
            x, kl, r = block(x, cu, max_len)
            kl_total = kl_total + kl
            rows.append(r)
        return self.head(self.norm(x[rows_of_interest])), kl_total, rows


def recall_of(rows, query_rows, needle_blocks):
    """Share of (layer, KV group, query) selection rows that hold the queried needle's block."""
    hits = []
    for r in rows:
        sel = r[:, query_rows, :]  # [Hkv, queries, topk]
        hits.append((sel == needle_blocks.view(1, -1, 1).to(sel.dtype)).any(-1).float().mean())
    return torch.stack(hits).mean()


def plot(log, path, c: Config):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig, ax1 = plt.subplots(figsize=(8, 4.5))
    ax1.plot(steps, [e["lm_loss"] for e in log], color="tab:blue", label="LM loss (answers)")
    ax1.plot(steps, [e["kl_loss"] for e in log], color="tab:cyan", label="indexer KL", alpha=0.7)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax2 = ax1.twinx()
    ax2.plot(steps, [e["recall"] for e in log], color="tab:red", label="needle-block recall")
    ax2.axhline(c.target_recall, color="tab:red", linestyle=":", linewidth=1)
    ax2.axhline(log[0]["chance"], color="gray", linestyle=":", linewidth=1)
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("recall")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="center right")
    ax1.set_title(f"MSA LM, {c.min_len // 1024 if c.min_len >= 1024 else c.min_len}"
                  f"{'K' if c.min_len >= 1024 else ''}-{c.max_len // 1024 if c.max_len >= 1024 else c.max_len}"
                  f"{'K' if c.max_len >= 1024 else ''} tokens, top-{c.topk} of {c.block_size}-token blocks "
                  f"({c.device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(c: Config, progress: bool = True):
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    device = torch.device(c.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    vocab = Vocab(c)
    model = TinyLM(c, vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    os.makedirs(c.out, exist_ok=True)
    log, start = [], time.time()
    log_file = open(os.path.join(c.out, "train_log.jsonl"), "w")
    try:
        from tqdm import tqdm
        bar = tqdm(range(c.steps), disable=not progress, dynamic_ncols=True)
    except ImportError:  # tqdm is optional for the smoke test
        bar = range(c.steps)
    avg_tokens = (c.min_len + c.max_len) / 2
    chance = min(1.0, c.topk / (avg_tokens / c.block_size))
    reached_at = None
    eval_rng = random.Random(c.seed + 1)
    for step in bar:
        warm = step < c.warmup_steps
        tokens, cu, qrows, targets, blocks, max_len = make_batch(
            c, vocab, rng, device, (max(c.warmup_len // 2, 1), c.warmup_len) if warm else None)
        logits, kl, rows = model(tokens, cu, max_len, qrows)
        lm = F.cross_entropy(logits.float(), targets)
        loss = lm + c.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % c.log_every == 0 or step == c.steps - 1:
            with torch.no_grad():
                rec = float(recall_of(rows, qrows, blocks))
                acc = float((logits.argmax(-1) == targets).float().mean())
                if warm or c.eval_every:  # recall where selection matters: a fresh long batch
                    e_tokens, e_cu, e_q, e_t, e_blocks, e_max = make_batch(c, vocab, eval_rng, device)
                    e_logits, _, e_rows = model(e_tokens, e_cu, e_max, e_q)
                    rec = float(recall_of(e_rows, e_q, e_blocks))
                    acc = float((e_logits.argmax(-1) == e_t).float().mean())
            entry = dict(step=step, phase="warmup" if warm else "long", lm_loss=lm.item(),
                         kl_loss=float(kl.detach()), recall=rec, answer_accuracy=acc,
                         chance=chance, tokens=int(tokens.numel()), seconds=round(time.time() - start, 2))
            log.append(entry)
            log_file.write(json.dumps(entry) + "\n")
            log_file.flush()
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{entry['lm_loss']:.3f}", kl=f"{entry['kl_loss']:.3f}",
                                recall=f"{rec:.3f}", acc=f"{acc:.2f}")
            else:
                print(f"step {step} loss {entry['lm_loss']:.3f} kl {entry['kl_loss']:.3f} recall {rec:.3f}", flush=True)
            if reached_at is None and rec >= c.target_recall:
                reached_at = step
            if (c.stop_at_target and not warm and len(log) >= 3
                    and all(e["recall"] >= c.target_recall and e["phase"] == "long" for e in log[-3:])):
                break
    log_file.close()
    plot(log, os.path.join(c.out, "train_msa_lm.png"), c)
    first = log[: max(1, len(log) // 10)]
    last = log[-max(1, len(log) // 10):]
    summary = dict(config=asdict(c), steps_run=log[-1]["step"] + 1, seconds=round(time.time() - start, 1),
                   chance_recall=chance, first_lm_loss=sum(e["lm_loss"] for e in first) / len(first),
                   final_lm_loss=sum(e["lm_loss"] for e in last) / len(last),
                   final_recall=sum(e["recall"] for e in last) / len(last),
                   final_answer_accuracy=sum(e["answer_accuracy"] for e in last) / len(last),
                   recall_target_reached_at_step=reached_at, device_name=(torch.cuda.get_device_name(device)
                                                                          if device.type == "cuda" else "cpu"))
    with open(os.path.join(c.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary, log


def parse(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for field, default in asdict(Config()).items():
        kind = type(default)
        if kind is bool:
            p.add_argument("--" + field.replace("_", "-"), action="store_true", default=None)
        else:
            p.add_argument("--" + field.replace("_", "-"), type=kind, default=None)
    args = p.parse_args(argv)
    values = dict(PRESETS[args.preset])
    for field in asdict(Config()):
        given = getattr(args, field)
        if given is not None:
            values[field] = given
    if values.get("device") == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device (use --preset cpu)")
    return Config(**values)


def main(argv=None):
    c = parse(argv)
    print(f"msa LM: {c.layers} layer(s), d_model {c.d_model}, heads {c.q_heads}/{c.kv_heads}, "
          f"{c.min_len}-{c.max_len} tokens, top-{c.topk} x {c.block_size}, {c.steps} steps on {c.device}", flush=True)
    summary, _ = train(c)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
