// Backward of the main branch (docs/msa.md §4) in f32.
//
// Two passes, so that every gradient element has exactly one writer:
//   1. query-major: a (query row, KV group) task computes dQ of the group's G heads over
//      the blocks that row reads;
//   2. key-major: a (KV group, key block) task visits the queries that read the block
//      (the inverted selection, in ascending row order) and accumulates dK and dV of its
//      B keys in a private B x D buffer, then adds it to dk/dv once.
// P and dP are recomputed in pass 2 (about 7/5 of the flops of a one-pass backward). In
// exchange there are no atomics and no per-thread copies of dK/dV: scratch is O(G x B +
// B x D) per thread, and since each element is summed by one thread in a fixed order the
// gradients are bitwise identical for ANY thread count and schedule (a stronger form of
// the determinism cpu.h promises).
#include <algorithm>
#include <cmath>
#include <vector>

#include "block_readers.h"
#include "cpu.h"
#include "dot_kernels.h"

namespace msa::detail::cpu {

namespace {

// What the backward needs of the G query heads of one (query row, group), contiguous [G, D].
struct GroupRows {
  const float* q;
  const float* grad_o;
  const float* lse;    // [G]
  const float* delta;  // [G] rowsum(dO * O)
};

// P and dS = P (dP - Delta) of the G heads against `n` consecutive keys of one block.
// p and ds are [G, n] with row stride `ld`.
void probs_and_dscores(const GroupRows& rows, int64_t G, int64_t D, const float* keys,
                       const float* values, int64_t token_stride, int64_t n, float scale, float* p,
                       float* ds, int64_t ld) {
  score_block(rows.q, G, D, keys, token_stride, n, p, ld);
  score_block(rows.grad_o, G, D, values, token_stride, n, ds, ld);  // dP, turned into dS below
  for (int64_t r = 0; r < G; ++r) {
    const float lse = rows.lse[r], delta = rows.delta[r];
    float* p_row = p + r * ld;
    float* ds_row = ds + r * ld;
    for (int64_t t = 0; t < n; ++t) {
      p_row[t] = std::exp(scale * p_row[t] - lse);
      ds_row[t] = p_row[t] * (ds_row[t] - delta);
    }
  }
}

struct Problem {
  const float* q;
  const KeyBlocks<float>& k;
  const KeyBlocks<float>& v;
  const AttentionDims& dims;
  const Batch& batch;
  BlockSource source;
  float scale;
  const float* o;
  const float* lse;
  const float* grad_o;
};

// Per-thread scratch of the (row, group) kernels.
struct Scratch {
  std::vector<float> p, ds, delta;
  Scratch(int64_t G, int64_t B) : p(G * B), ds(G * B), delta(G) {}
};

GroupRows group_rows(const Problem& pb, int64_t row, int64_t group, float* delta) {
  const int64_t G = pb.dims.group_size(), D = pb.dims.head_dim;
  const int64_t at = (row * pb.dims.q_heads + group * G) * D;
  for (int64_t r = 0; r < G; ++r) delta[r] = dot(pb.grad_o + at + r * D, pb.o + at + r * D, D);
  return {pb.q + at, pb.grad_o + at, pb.lse + row * pb.dims.q_heads + group * G, delta};
}

// Pass 1: dQ of the G heads of (row, group); writes every element.
void query_gradients(const Problem& pb, int64_t row, int64_t group, Scratch& scratch, float* dq) {
  const int64_t G = pb.dims.group_size(), D = pb.dims.head_dim, B = pb.k.block_size;
  const int64_t seq = pb.batch.seq_of_query[row], last = pb.batch.last_key(row);
  float* dq_group = dq + (row * pb.dims.q_heads + group * G) * D;
  std::fill(dq_group, dq_group + G * D, 0.0f);
  const GroupRows rows = group_rows(pb, row, group, scratch.delta.data());
  const QueryBlocks blocks = blocks_read_by(pb.source, pb.batch, row, group, B);
  for (int64_t i = 0; i < blocks.count; ++i) {
    const int64_t n = visible_in_block(blocks[i], B, last);
    const float* keys = pb.k.block(seq, blocks[i], group);
    probs_and_dscores(rows, G, D, keys, pb.v.block(seq, blocks[i], group), pb.k.token_stride, n,
                      pb.scale, scratch.p.data(), scratch.ds.data(), B);
    for (int64_t r = 0; r < G; ++r)
      accumulate(scratch.ds.data() + r * B, 1, keys, pb.k.token_stride, n, dq_group + r * D, D);
  }
  for (int64_t i = 0; i < G * D; ++i) dq_group[i] *= pb.scale;
}

// Pass 2: dK, dV of one block of one KV group, from all its readers in row order.
void key_gradients(const Problem& pb, const Readers& readers, int64_t seq, int64_t block,
                   int64_t group, Scratch& scratch, std::vector<float>& dk_acc,
                   std::vector<float>& dv_acc, float* dk, float* dv) {
  const int64_t G = pb.dims.group_size(), D = pb.dims.head_dim, B = pb.k.block_size;
  const int64_t stride = pb.k.token_stride;
  const float* keys = pb.k.block(seq, block, group);
  const float* values = pb.v.block(seq, block, group);
  const int64_t n_keys = std::min(B, pb.batch.k_len[seq] - block * B);
  std::fill(dk_acc.begin(), dk_acc.begin() + n_keys * D, 0.0f);
  std::fill(dv_acc.begin(), dv_acc.begin() + n_keys * D, 0.0f);
  for (int64_t i = readers.begin; i < readers.end; ++i) {
    const int64_t row = readers[i];
    const int64_t n = std::min(n_keys, visible_in_block(block, B, pb.batch.last_key(row)));
    const GroupRows rows = group_rows(pb, row, group, scratch.delta.data());
    probs_and_dscores(rows, G, D, keys, values, stride, n, pb.scale, scratch.p.data(),
                      scratch.ds.data(), B);
    for (int64_t t = 0; t < n; ++t) {
      accumulate(scratch.p.data() + t, B, rows.grad_o, D, G, dv_acc.data() + t * D, D);
      accumulate(scratch.ds.data() + t, B, rows.q, D, G, dk_acc.data() + t * D, D);
    }
  }
  // The gradient of a key lives at the key's own offset (k's layout).
  float* dk_block = dk + (keys - pb.k.data);
  float* dv_block = dv + (keys - pb.k.data);
  for (int64_t t = 0; t < n_keys; ++t) {
    axpy(pb.scale, dk_acc.data() + t * D, dk_block + t * stride, D);
    axpy(1.0f, dv_acc.data() + t * D, dv_block + t * stride, D);
  }
}

}  // namespace

void attention_backward(const float* q, const KeyBlocks<float>& k, const KeyBlocks<float>& v,
                        const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                        float scale, const float* o, const float* lse, const float* grad_o,
                        float* dq, float* dk, float* dv) {
  const Problem pb{q, k, v, dims, batch, blocks, scale, o, lse, grad_o};
  const int64_t G = dims.group_size(), D = dims.head_dim, B = k.block_size;
  const int64_t groups = dims.kv_heads, total_q = batch.total_q();
  const std::vector<int64_t> first_block = first_global_blocks(batch, B);
  const int64_t total_blocks = first_block.back();
  const BlockReaderIndex index(blocks, batch, groups, first_block, B);

#pragma omp parallel
  {
    Scratch scratch(G, B);
    std::vector<float> dk_acc(B * D), dv_acc(B * D);

#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < total_q * groups; ++task)
      query_gradients(pb, task / groups, task % groups, scratch, dq);

#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < groups * total_blocks; ++task) {
      const int64_t group = task / total_blocks, global_block = task % total_blocks;
      // Global block -> (sequence, block): binary search of the sequences' first blocks.
      const int64_t seq = std::upper_bound(first_block.begin(), first_block.end(), global_block) -
                          first_block.begin() - 1;
      const int64_t block = global_block - first_block[seq];
      key_gradients(pb, index.readers(group, seq, block), seq, block, group, scratch, dk_acc,
                    dv_acc, dk, dv);
    }
  }
}

}  // namespace msa::detail::cpu
