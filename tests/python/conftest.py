"""Shared cases and a plain-PyTorch statement of docs/msa.md, against which the package's ops
(msa's C++ reference, its CPU ops and, on a GPU, its kernels) are checked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

import msa


def cuda_ready() -> bool:
    return msa.built_with_cuda() and torch.cuda.is_available()


gpu = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and a CUDA build of msa")


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qi: torch.Tensor
    ki: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    block: int
    topk: int
    lengths: List[tuple]

    def to(self, device=None, dtype=None) -> "Case":
        f = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        i = lambda t: t.to(device=device)  # noqa: E731
        return Case(f(self.q), f(self.k), f(self.v), f(self.qi), f(self.ki), i(self.cu_q), i(self.cu_k), self.block,
                    self.topk, self.lengths)


def make_case(lengths=((70, 200), (33, 33), (1, 90)), hq=4, hkv=2, d=16, di=8, block=16, topk=4, seed=0,
              dtype=torch.float64) -> Case:
    """Packed sequences of (q_len, k_len): queries are the last q_len of each sequence's keys."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    cu_q = torch.tensor([0] + list(torch.tensor([a for a, _ in lengths]).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor([b for _, b in lengths]).cumsum(0)), dtype=torch.int32)
    return Case(r(tq, hq, d), r(tk, hkv, d), r(tk, hkv, d), r(tq, hkv, di), r(tk, di), cu_q, cu_k, block, topk,
                list(lengths))


def positions(case: Case):
    """(sequence, query position, key start, query row) of every query."""
    out = []
    for b, (ql, kl) in enumerate(case.lengths):
        q0, k0 = int(case.cu_q[b]), int(case.cu_k[b])
        for i in range(ql):
            out.append((b, kl - ql + i, k0, q0 + i))
    return out


def ref_rows(qi, ki, case: Case, topk: int, block: int, local: int = 1, init: int = 0) -> torch.Tensor:
    """docs/msa.md §3.3 in plain PyTorch (f64): rows [Hi, total_q, topk], -1 padded."""
    qi, ki = qi.double(), ki.double()
    hi = qi.shape[1]
    rows = torch.full((hi, qi.shape[0], topk), -1, dtype=torch.int32)
    for b, pos, k0, row in positions(case):
        L = pos // block
        s = qi[row] @ ki[k0:k0 + pos + 1].T  # [Hi, pos + 1]
        for h in range(hi):
            forced_init = list(range(min(init, L + 1)))
            forced_local = list(range(max(0, L - local + 1), L + 1))
            forced = set(forced_init) | set(forced_local)
            cands = [j for j in range(L) if j not in forced]
            maxima = {j: float(s[h, j * block:(j + 1) * block].max()) for j in cands}
            keep = sorted(cands, key=lambda j: (-maxima[j], j))[:max(0, topk - len(forced))]
            ids = sorted(set(forced_init)) + keep + [j for j in sorted(forced_local) if j != L] + [L]
            ids = list(dict.fromkeys(ids))[:topk]
            rows[h, row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return rows


def key_sets(rows: torch.Tensor):
    return [[frozenset(int(x) for x in r if x >= 0) for r in head] for head in rows.cpu()]


def ref_attention(q, k, v, rows: Optional[torch.Tensor], case: Case, block: int, scale: Optional[float] = None):
    """docs/msa.md §4 (f64): o [total_q, Hq, D], lse [total_q, Hq]; rows None = dense causal."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    for b, pos, k0, row in positions(case):
        t = torch.arange(pos + 1)
        for r in range(hq):
            h = r // g
            if rows is not None:
                sel = [int(x) for x in rows[h, row] if x >= 0]
                mask = torch.isin(t // block, torch.tensor(sel, dtype=torch.long))
                tt = t[mask]
            else:
                tt = t
            if len(tt) == 0:
                continue
            logits = scale * (k[k0 + tt, h] @ q[row, r])
            lse[row, r] = torch.logsumexp(logits, 0)
            o[row, r] = torch.softmax(logits, 0) @ v[k0 + tt, h]
    return o, lse


def ref_kl(q, k, lse, qi, ki, rows, case: Case, block: int, scale=None, index_scale=None, temperature=1.0,
           coefficient=1.0):
    """docs/msa.md §5 in autograd-able PyTorch (f64): the loss, differentiable in qi and ki."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    di = qi.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    iscale = index_scale if index_scale is not None else 1.0 / math.sqrt(di)
    total = 0.0
    for b, pos, k0, row in positions(case):
        t = torch.arange(pos + 1)
        for h in range(hkv):
            sel = [int(x) for x in rows[h, row] if x >= 0]
            tt = t[torch.isin(t // block, torch.tensor(sel, dtype=torch.long))]
            if len(tt) == 0:
                continue
            teacher = sum(torch.exp(scale * (k[k0 + tt, h].double() @ q[row, r].double()) - lse[row, r].double())
                          for r in range(h * g, (h + 1) * g)) / g
            student_logits = iscale * (ki[k0 + tt] @ qi[row, h]) / temperature
            log_ps = student_logits - torch.logsumexp(student_logits, 0)
            pt = teacher.detach()
            term = torch.where(pt > 0, pt * (torch.log(pt.clamp_min(1e-300)) - log_ps), torch.zeros_like(pt))
            total = total + term.sum()
    return coefficient * total / (hkv * q.shape[0])
