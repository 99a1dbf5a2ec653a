#!/usr/bin/env python3
"""Benchmarks of the msa Python package (docs/python.md, "Benchmark"):

1. Per-call overhead in eager mode, host time per call on tiny inputs: msa._ext's own share
   (DLPack import of every argument, checks, params; measured as the sizing call, which builds
   the whole launch and stops before it), the full _ext call (+ the C++ launch), and the
   msa.torch op (+ torch.library custom-op dispatch, output / workspace allocation).
2. A 128K-token decode step (MiniMax-M3 layer: Hq 64, Hkv 4, D 128, top-16 of 128) through
   msa.torch.DecodeStep captured in a torch.cuda.graph, CUDA-event timed over replays, against
   the same step of the C++ benchmark on the same machine: `--cpp-json` names the JSON rows of
   an `msa bench --device cuda` run (its decode rows, batch 1, Q 1); without it the column is
   left empty.
3. The vLLM-layout functions (msa.vllm) against the native-layout paged ops (msa.torch) at 32K /
   128K prefill and 128K / 1M decode.

CPU-only machines run part 1 on the CPU path. Writes a Markdown table (--out)."""

from __future__ import annotations

import argparse
import math
import time

import torch

import msa
import msa.torch as mt
import msa.vllm as mv
from msa import _ext
from msa.torch import _common as c


def host_us(fn, reps=2000, warm=50):
    for _ in range(warm):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def gpu_ms(fn, reps=10, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def overhead(device, lines):
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    kw = dict(device=device, dtype=dt)
    q, k, v = torch.randn(128, 16, 128, **kw), torch.randn(128, 2, 128, **kw), torch.randn(128, 2, 128, **kw)
    cu = torch.tensor([0, 128], dtype=torch.int32, device=device)
    o = torch.empty_like(q)
    lse = torch.empty(128, 16, dtype=torch.float32, device=device)
    impl = c.IMPL_CUDA if device == "cuda" else c.IMPL_CPU
    stream = c.stream_of(q.device) if device == "cuda" else 0
    dl = c.dl
    if device == "cuda":
        ws = torch.empty(_ext.attention(dl(q), dl(k), dl(v), None, dl(cu), dl(cu), None, None, dl(o), dl(lse), None,
                                        128, 0.0, 128, 128, stream, impl), dtype=torch.uint8, device=device)
        sizing = host_us(lambda: _ext.attention(dl(q), dl(k), dl(v), None, dl(cu), dl(cu), None, None, dl(o), dl(lse),
                                                None, 128, 0.0, 128, 128, stream, impl))
        full = host_us(lambda: _ext.attention(dl(q), dl(k), dl(v), None, dl(cu), dl(cu), None, None, dl(o), dl(lse),
                                              dl(ws), 128, 0.0, 128, 128, stream, impl))
        torch.cuda.synchronize()
        op = host_us(lambda: mt.dense_attention(q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128))
        torch.cuda.synchronize()
        capsules = host_us(lambda: [dl(t) for t in (q, k, v, cu, cu, o, lse, ws)])
        lines.append("| dense attention, 128 tokens (cuda) | "
                     f"{capsules:.1f} | {sizing:.1f} | {full:.1f} | {op:.1f} |")
    else:
        capsules = host_us(lambda: [dl(t) for t in (q, k, v, cu, cu, o, lse)])
        full = host_us(lambda: _ext.attention(dl(q), dl(k), dl(v), None, dl(cu), dl(cu), None, None, dl(o), dl(lse),
                                              None, 128, 0.0, 0, 0, 0, impl), reps=200)
        op = host_us(lambda: mt.dense_attention(q, k, v, cu, cu), reps=200)
        lines.append(f"| dense attention, 128 tokens (cpu: includes the computation) | {capsules:.1f} | - | "
                     f"{full:.1f} | {op:.1f} |")


M3 = dict(q_heads=64, kv_heads=4, head_dim=128, index_dim=128)


def decode_graph(context, lines, batch=1):
    pages = math.ceil(context / 128)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(pages * batch, 4, 128, 128, **kw)
    v_cache = torch.randn(pages * batch, 4, 128, 128, **kw)
    ik = torch.randn(pages * batch, 128, 128, **kw)
    table = torch.arange(pages * batch, dtype=torch.int32, device="cuda").view(batch, pages)
    step = mt.DecodeStep(max_batch=batch, max_context=context, device="cuda", **M3)
    q = torch.randn(batch, 64, 128, **kw)
    qi = torch.randn(batch, 4, 128, **kw)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    args = (q, qi, k_cache, v_cache, ik, table, cu, lens)
    step.run(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(*args)
    graph_us = gpu_ms(graph.replay, reps=200, warm=20) * 1e3
    eager_us = gpu_ms(lambda: step.run(*args), reps=200, warm=20) * 1e3
    reference = CPP_DECODE_US.get(context)
    ref = f"{reference:.1f}" if reference else "-"
    ratio = f"{graph_us / reference:.2f}x" if reference else "-"
    lines.append(f"| {context // 1024}K decode, batch {batch} | {graph_us:.1f} | {eager_us:.1f} | {ref} | {ratio} |")


# MSA decode step (us) of the C++ benchmark by context, batch 1, Q 1 (--cpp-json).
CPP_DECODE_US: dict = {}


def load_cpp_decode(path):
    import json
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "decode" and row.get("batch") == 1 and row.get("queries") == 1 and "msa_ms" in row:
                CPP_DECODE_US[int(row["context"])] = float(row["msa_ms"]) * 1e3


def vllm_vs_native(lines):
    kw = dict(device="cuda", dtype=torch.bfloat16)
    for mode, context, q_len in (("prefill", 32768, 32768), ("prefill", 131072, 131072),
                                 ("decode", 131072, 1), ("decode", 1048576, 1)):
        pages = math.ceil(context / 128)
        kv = torch.randn(pages, 4, 128, 256, **kw)                  # vLLM's K|V cache
        k_cache, v_cache = kv[..., :128].contiguous(), kv[..., 128:].contiguous()
        ik = torch.randn(pages, 128, 128, **kw)
        table = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
        seq = torch.tensor([context], dtype=torch.int32, device="cuda")
        prefix = seq - q_len
        cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
        q = torch.randn(q_len, 64, 128, **kw)
        qi = torch.randn(q_len, 4, 128, **kw)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(128)

        if mode == "prefill":
            def vllm():
                rows = mv.minimax_m3_index_prefill(qi, ik, table, cu, seq, prefix, q_len, context, 4, 16, 0, 1)
                mv.minimax_m3_sparse_attn(q, kv, rows, table, cu, seq, prefix, q_len, 4, scale, out,
                                          max_seq_len=context)
        else:
            def vllm():
                rows = mv.minimax_m3_index_decode(qi, ik, table, seq, context, 16, 0, 1, 4, 1)
                mv.minimax_m3_sparse_attn_decode(q, kv, rows, table, seq, 4, scale, out, 1, max_seq_len=context)

        def native():
            rows, _ = mt.paged_indexer(qi, ik, table, seq, cu, topk=16, max_seqlen_q=q_len, max_seqlen_k=context)
            mt.paged_sparse_attention(q, k_cache, v_cache, table, seq, rows, cu, scale, max_seqlen_q=q_len,
                                      max_seqlen_k=context)

        reps = 5 if mode == "prefill" else 100
        t_vllm, t_native = gpu_ms(vllm, reps=reps), gpu_ms(native, reps=reps)
        unit, f = ("ms", 1.0) if mode == "prefill" else ("us", 1e3)
        lines.append(f"| {mode} {context // 1024}K | {t_vllm * f:.1f} {unit} | {t_native * f:.1f} {unit} | "
                     f"{t_vllm / t_native:.2f}x |")
        del kv, k_cache, v_cache, ik, q, qi, out
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the Markdown tables here")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--cpp-json", default=None,
                   help="JSON rows of an `msa bench --device cuda` run on this machine (the decode comparison)")
    args = p.parse_args()
    if args.cpp_json:
        load_cpp_decode(args.cpp_json)
    cuda = msa.built_with_cuda() and torch.cuda.is_available()
    lines = [f"# msa Python package benchmark ({torch.cuda.get_device_name() if cuda else 'CPU'}, torch "
             f"{torch.__version__})", "",
             "## Per-call host overhead (us per call, eager)", "",
             "| op | 8 DLPack capsules | _ext sizing call (binding's share) | _ext call with launch | "
             "msa.torch op (custom-op dispatch, allocation) |", "|---|---|---|---|---|"]
    overhead("cpu", lines)
    if cuda:
        overhead("cuda", lines)
        lines += ["", "## Decode step in a CUDA graph (MiniMax-M3 layer, us per step)", "",
                  "| case | msa.torch graph replay | eager run() | C++ msa bench (--cpp-json) | ratio |",
                  "|---|---|---|---|---|"]
        decode_graph(131072, lines)
        decode_graph(8192, lines)
        if not args.skip_vllm:
            lines += ["", "## vLLM layouts (msa.vllm) vs native layouts (msa.torch paged ops), indexer + attention",
                      "", "| case | msa.vllm | msa.torch paged | ratio |", "|---|---|---|---|"]
            vllm_vs_native(lines)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
