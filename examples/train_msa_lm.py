#!/usr/bin/env python3
"""Train a small decoder-only LM whose attention is msa.torch.MSAAttention on a synthetic
long-context retrieval task, and watch the indexer learn, through its KL loss alone, to select
the block that holds the needle.

Task (associative recall). A sequence is random filler tokens with `needles` needles scattered
over it; a needle is two adjacent tokens, KEY_k VALUE_v. The sequence ends with `queries` query
tokens QUERY_k; at each one the model must output the value of the needle with key k (the LM
loss is the cross-entropy of these answers). Why this design:
  * retrieval is content-based: the query's q matches the key of the value token, which knows
    its key through a token shift (each token also sees the previous one). No positional
    encoding is needed, and one layer does it;
  * small vocabularies (16 filler, 4 keys, 8 values): every token is seen often. Keys and
    values are separate tokens so that "find key k" is learnt once per key, not once per
    (key, value) pair: with one token per pair, some pairs never got retrieved;
  * a quarter of the queries ask a key that has no needle (answer: "none"), so an answer can't
    be inferred from a needle's absence (else the LM leaves one value per key unretrieved,
    and the indexer is never taught to find those needles);
  * needles never sit in the queries' block or the block before it, so in long sequences the
    answer is reachable only if the indexer puts the needle's block among the top-k.

Two phases, one model and one optimizer:
  1. warm-up: short sequences (warmup_len / 2 .. warmup_len tokens, at most topk * block_size,
     so every block is selected and MSA is dense attention). Over 64-128 tokens the LM finds
     the needles within a few dozen steps (over 1-2K tokens, dense or sparse, it was still at
     chance after 300), and the KL (docs/msa.md §5), whose teacher is then the full attention,
     teaches the index projections where it looks;
  2. long: sequences of min_len .. max_len tokens, many more blocks than topk. The LM sees a
     needle only if the indexer selected its block; the KL keeps training the indexer.

Recall. For each query (of a key that has a needle) of a held-out batch of long sequences and
each KV group, whether the indexer's row holds the needle's block; averaged over queries,
groups and layers (one layer here: with more, only layers whose attention looks at the needles
are taught to select them). A random ranking gives chance = (topk - 1) / (blocks before the
query's own); recall rises from there to 1 within the warm-up, and stays there on the long
sequences, where the answers are then right too.

    python examples/train_msa_lm.py --preset cpu                      # ~1.5 min on a CPU core
    python examples/train_msa_lm.py --preset h200 --stop-at-target    # 8K-32K tokens, one H200
    python examples/train_msa_lm.py --preset cpu --kl-weight 0        # no KL: recall stays at chance

Writes OUT/train_log.jsonl (one line per logged step), OUT/train_msa_lm.png (loss and recall)
and OUT/summary.json. Results: examples/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import msa.torch as mt

PRESETS = {
    # Seconds: the pytest smoke run (mostly warm-up; the LM loss must fall).
    "smoke": dict(device="cpu", steps=60, warmup_steps=50, min_len=384, max_len=512, tokens_per_step=4096,
                  eval_tokens=2048, block_size=32, topk=4, lr=1e-2, log_every=5),
    # ~1.5 minutes on one CPU core: needles in 1K-2K tokens, blocks of 64, top-4 (chance ~0.13).
    "cpu": dict(device="cpu", steps=300, warmup_steps=150, min_len=1024, max_len=2048, tokens_per_step=8192,
                block_size=64, topk=4, lr=5e-3),
    # One H200, bf16: needles in 8K-32K tokens, M3's block (128), top-16 and head dims (128), a
    # GQA group of 2 (chance ~0.1). The CPU run's schedule (steps, warm-up, lr, warm-up data);
    # d_model 128 with these heads learns as fast on the CPU (examples/results/README.md).
    "h200": dict(device="cuda", steps=300, warmup_steps=150, warmup_tokens=16384, min_len=8192, max_len=32768,
                 tokens_per_step=131072, eval_tokens=262144, d_model=128, q_heads=4, kv_heads=2,
                 head_dim=128, index_dim=128, block_size=128, topk=16, lr=5e-3),
}


@dataclass
class Config:
    device: str = "cpu"
    steps: int = 300
    warmup_steps: int = 150    # steps on sequences of warmup_len // 2 .. warmup_len tokens
    warmup_len: int = 128      # <= topk * block_size: MSA is dense there
    warmup_tokens: int = 0     # tokens per warm-up step (0: tokens_per_step)
    min_len: int = 1024        # then sequences of min_len .. max_len tokens
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
    needles: int = 2           # per sequence, distinct keys
    keys: int = 4
    values: int = 8
    filler: int = 16           # filler token ids
    queries: int = 16          # query tokens at each sequence's end
    absent: float = 0.25       # share of queries that ask a key with no needle (answer: none)
    lr: float = 5e-3
    kl_weight: float = 1.0
    log_every: int = 10
    eval_tokens: int = 16384   # the held-out batch of long sequences (recall, accuracy)
    seed: int = 0
    target_recall: float = 0.9
    stop_at_target: bool = False
    out: str = "runs/train_msa_lm"


# ---- data ----

class Vocab:
    """filler | needle keys | needle values | queries (one per key)."""

    def __init__(self, c: Config):
        self.key0 = c.filler
        self.value0 = self.key0 + c.keys
        self.query0 = self.value0 + c.values
        self.size = self.query0 + c.keys


def make_batch(c: Config, vocab: Vocab, gen: torch.Generator, device, lengths, tokens=0):
    """Packed sequences of random lengths in `lengths` ([low, high]) filling ~`tokens` (default
    tokens_per_step). Returns tokens, cu_seqlens, the longest length, the query rows, their
    answers and the block of the asked needle (-1 where the asked key has no needle)."""
    low = max(lengths[0], c.queries + 2 * c.needles)
    high = max(lengths[1], low)
    lens = []
    while sum(lens) < (tokens or c.tokens_per_step) or not lens:
        lens.append(int(torch.randint(low, high + 1, (), generator=gen)))
    seqs = torch.randint(0, c.filler, (sum(lens),), generator=gen)
    query_rows, answers, needle_blocks = [], [], []
    start = 0
    for length in lens:
        keys = torch.randperm(c.keys, generator=gen)  # the first `needles` get a needle
        values = torch.randint(0, c.values, (c.needles,), generator=gen)
        # Needles before the queries' block and the block before it (in short warm-up
        # sequences, where every block is selected anyway: anywhere before the queries), at
        # even offsets: KEY VALUE never straddles a block boundary.
        limit = ((length - c.queries) // c.block_size - 1) * c.block_size
        if limit < 2 * c.needles:
            limit = length - c.queries
        at = start + torch.randperm(limit // 2, generator=gen)[:c.needles] * 2
        seqs[at] = vocab.key0 + keys[:c.needles]
        seqs[at + 1] = vocab.value0 + values
        asked = torch.randperm(c.queries, generator=gen) % c.needles  # every needle is asked
        q_keys, q_answers, q_blocks = keys[asked], values[asked], (at[asked] + 1 - start) // c.block_size
        if c.needles < c.keys:  # some queries ask a key with no needle: answer "none" (id `values`)
            absent = torch.rand(c.queries, generator=gen) < c.absent
            other = keys[c.needles + torch.randint(0, c.keys - c.needles, (c.queries,), generator=gen)]
            q_keys = torch.where(absent, other, q_keys)
            q_answers = torch.where(absent, c.values, q_answers)
            q_blocks = torch.where(absent, -1, q_blocks)
        rows = start + length - c.queries + torch.arange(c.queries)
        seqs[rows] = vocab.query0 + q_keys
        query_rows.append(rows)
        answers.append(q_answers)
        needle_blocks.append(q_blocks)
        start += length
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return (seqs.to(device), cu.to(device), max(lens), torch.cat(query_rows).to(device),
            torch.cat(answers).to(device), torch.cat(needle_blocks).to(device))


# ---- model ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Pre-norm attention (the model's own q, k, v, o; MSAAttention holds the index branch and
    computes the attention and the KL) and MLP. No positional encoding: the task needs none."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.norm1, self.norm2 = RMSNorm(c.d_model), RMSNorm(c.d_model)
        self.q = nn.Linear(c.d_model, c.q_heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.q_heads * c.head_dim, c.d_model, bias=False)
        # The index projections read the block's normalised input, detached: only the KL
        # trains them, and the KL does not reach the rest of the model.
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
        self.shift = nn.Linear(c.d_model, c.d_model, bias=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.values + 1, bias=False)  # the answers: the values and "none"

    def forward(self, tokens, cu, max_len, query_rows):
        """Answer logits at query_rows, the summed KL of the layers, and each layer's rows."""
        x = self.embed(tokens)
        # Token shift (a causal convolution of width 2): every token also sees the previous
        # one of its sequence, so a needle's VALUE token carries its KEY.
        prev = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
        prev[cu[:-1].long()] = 0
        x = x + self.shift(prev)
        kl_total, rows = 0.0, []
        for block in self.blocks:
            x, kl, r = block(x, cu, max_len)
            kl_total = kl_total + kl
            rows.append(r)
        return self.head(self.norm(x[query_rows])).float(), kl_total, rows


def recall_and_chance(rows, query_rows, needle_blocks, cu, block_size, topk):
    """Recall: the share of (layer, KV group, query) rows that hold the asked needle's block,
    over the queries whose key has a needle. Chance: what a random ranking of the candidate
    blocks gives, (topk - 1) / (blocks before the query's own block), at most 1."""
    present = needle_blocks >= 0
    query_rows, needle_blocks = query_rows[present], needle_blocks[present]
    hits = []
    for r in rows:
        sel = r[:, query_rows, :].long()  # [Hkv, queries, topk]
        hits.append((sel == needle_blocks.view(1, -1, 1)).any(-1).float().mean())
    seq = torch.searchsorted(cu.long(), query_rows, right=True) - 1
    own_block = (query_rows - cu.long()[seq]) // block_size
    chance = ((topk - 1) / own_block.clamp(min=1).float()).clamp(max=1.0).mean()
    return float(torch.stack(hits).mean()), float(chance)


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
    ax1.set_ylim(bottom=0)
    ax2 = ax1.twinx()
    ax2.plot(steps, [e["recall"] for e in log], color="tab:red", label="needle-block recall (long seqs)")
    ax2.plot(steps, [e["answer_accuracy"] for e in log], color="tab:orange", label="answer accuracy (long seqs)",
             alpha=0.6)
    ax2.plot(steps, [e["chance"] for e in log], color="gray", linestyle=":", label="recall by chance")
    ax2.axhline(c.target_recall, color="tab:red", linestyle=":", linewidth=1)
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("recall, accuracy")
    if c.warmup_steps:
        ax1.axvspan(0, min(c.warmup_steps, steps[-1]), color="gray", alpha=0.08, label="warm-up: short seqs (dense)")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="center right", fontsize=8)
    k = lambda n: f"{n // 1024}K" if n >= 1024 else str(n)  # noqa: E731
    ax1.set_title(f"MSA LM: needles in {k(c.min_len)}-{k(c.max_len)} tokens, top-{c.topk} of "
                  f"{c.block_size}-token blocks ({c.device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(c: Config, progress: bool = True):
    torch.manual_seed(c.seed)
    gen = torch.Generator().manual_seed(c.seed)
    device = torch.device(c.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    vocab = Vocab(c)
    model = TinyLM(c, vocab).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=c.lr)
    # lr: 20 steps of linear warm-up, then a cosine decay to lr / 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / c.steps))))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    long_lengths = (c.min_len, c.max_len)
    # Recall and answer accuracy: on one held-out batch of long sequences, in both phases.
    held_out = make_batch(c, vocab, torch.Generator().manual_seed(c.seed + 1), device, long_lengths, c.eval_tokens)

    def evaluate():
        e_tokens, e_cu, e_max, e_q, e_answers, e_blocks = held_out
        with torch.no_grad(), autocast:
            e_logits, _, e_rows = model(e_tokens, e_cu, e_max, e_q)
        rec, chance = recall_and_chance(e_rows, e_q, e_blocks, e_cu, c.block_size, c.topk)
        return rec, chance, float((e_logits.argmax(-1) == e_answers).float().mean())

    os.makedirs(c.out, exist_ok=True)
    log, start = [], time.time()
    log_file = open(os.path.join(c.out, "train_log.jsonl"), "w")
    try:
        from tqdm import tqdm
        bar = tqdm(range(c.steps), disable=not progress, dynamic_ncols=True)
    except ImportError:  # tqdm is optional for the smoke test
        bar = range(c.steps)
    reached_at = None
    for step in bar:
        warm = step < c.warmup_steps
        lengths = (c.warmup_len // 2, c.warmup_len) if warm else long_lengths
        tokens, cu, max_len, qrows, answers, _ = make_batch(c, vocab, gen, device, lengths,
                                                            c.warmup_tokens if warm else 0)
        with autocast:
            logits, kl, _ = model(tokens, cu, max_len, qrows)
        lm = F.cross_entropy(logits, answers)
        loss = lm + c.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % c.log_every == 0 or step == c.steps - 1:
            rec, chance, acc = evaluate()
            entry = dict(step=step, phase="warmup" if warm else "long", lm_loss=lm.item(), kl_loss=kl.item(),
                         recall=rec, answer_accuracy=acc, chance=chance, tokens=int(tokens.numel()),
                         lr=sched.get_last_lr()[0], seconds=round(time.time() - start, 2))
            log.append(entry)
            log_file.write(json.dumps(entry) + "\n")
            log_file.flush()
            line = (f"step {step:4d} {entry['phase']:6s} LM loss {entry['lm_loss']:.4f}  KL {entry['kl_loss']:.4f}  "
                    f"recall {rec:.3f} (chance {chance:.3f})  answers {acc:.3f}  {entry['seconds']:.1f} s")
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(phase=entry["phase"], loss=f"{entry['lm_loss']:.3f}", kl=f"{entry['kl_loss']:.3f}",
                                recall=f"{rec:.3f}", acc=f"{acc:.2f}")
                if progress:
                    bar.write(line)
            if reached_at is None and rec >= c.target_recall:
                reached_at = step
            if c.stop_at_target and len(log) >= 3 and all(
                    e["recall"] >= c.target_recall and e["phase"] == "long" for e in log[-3:]):
                break
    log_file.close()
    plot(log, os.path.join(c.out, "train_msa_lm.png"), c)
    last = log[-min(3, len(log)):]  # the start: the first logged step (before any update)
    mean = lambda key: sum(e[key] for e in last) / len(last)  # noqa: E731
    summary = dict(config=asdict(c), steps_run=log[-1]["step"] + 1, seconds=round(time.time() - start, 1),
                   first_lm_loss=log[0]["lm_loss"], final_lm_loss=mean("lm_loss"),
                   first_recall=log[0]["recall"], final_recall=mean("recall"),
                   chance_recall=log[0]["chance"], final_answer_accuracy=mean("answer_accuracy"),
                   recall_target_reached_at_step=reached_at,
                   device_name=torch.cuda.get_device_name(device) if cuda else "cpu")
    with open(os.path.join(c.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary, log


def parse(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for field, default in asdict(Config()).items():
        if type(default) is bool:
            p.add_argument("--" + field.replace("_", "-"), action="store_true", default=None)
        else:
            p.add_argument("--" + field.replace("_", "-"), type=type(default), default=None)
    args = p.parse_args(argv)
    values = dict(PRESETS[args.preset])
    for field in asdict(Config()):
        if getattr(args, field) is not None:
            values[field] = getattr(args, field)
    if values.get("device") == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device (use --preset cpu)")
    return Config(**values)


def main(argv=None):
    c = parse(argv)
    print(f"msa LM: {c.layers} layer(s), d_model {c.d_model}, heads {c.q_heads}/{c.kv_heads}, warm-up "
          f"{c.warmup_steps} steps of <= {c.warmup_len} tokens, then {c.min_len}-{c.max_len} tokens, "
          f"top-{c.topk} x {c.block_size}, {c.steps} steps on {c.device}", flush=True)
    summary, _ = train(c)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
