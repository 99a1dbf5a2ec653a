// KL objective of the indexer (docs/msa.md §5) in f32, the loss summed in double.
//
// Same two-pass design as attention_backward_cpu.cpp, so every output has one writer:
//   1. query-major: a (query row, index head) task computes the student LSE over its
//      selected tokens, the teacher, its loss term and dqi (all of that row);
//   2. key-major: an index-key block task visits, head by head and in ascending row order,
//      the queries that selected the block and accumulates dki of its B keys privately.
// Loss terms are kept per (row, head) and summed in row order at the end. Everything is
// therefore bitwise identical for any thread count. Pass 2 recomputes the teacher (G dot
// products of length D per key) instead of storing [queries x selected keys] values.
#include <algorithm>
#include <cmath>
#include <vector>

#include "block_readers.h"
#include "cpu.h"
#include "dot_kernels.h"

namespace msa::detail::cpu {

namespace {

struct Problem {
  const float* q;
  const KeyBlocks<float>& k;
  const float* main_lse;
  const AttentionDims& dims;
  const float* qi;
  const KeyBlocks<float>& ki;
  int64_t index_dim;
  const Batch& batch;
  BlockSource selection;
  float scale;
  float logit_scale;  // index_scale / T: student logit per raw index score
  float grad_scale;   // logit_scale * c / (Hi * total_q)
  double norm;        // c / (Hi * total_q)
};

// Per-thread scratch: [G, B] scores, [B] probabilities, the student logits of a whole
// selection row ([slots * B], pass 1) or of one block (pass 2).
struct Scratch {
  std::vector<float> scores, teacher, student;
  Scratch(int64_t G, int64_t B, int64_t slots) : scores(G * B), teacher(B), student(slots * B) {}
};

// Teacher probabilities of `n` consecutive keys (KV head h) of one block: the group's
// main-branch probabilities averaged over its G heads.
void teacher_probs(const Problem& pb, int64_t row, int64_t h, const float* keys, int64_t n,
                   Scratch& scratch) {
  const int64_t G = pb.dims.group_size(), D = pb.dims.head_dim, B = pb.k.block_size;
  const float* q_group = pb.q + (row * pb.dims.q_heads + h * G) * D;
  const float* lse_group = pb.main_lse + row * pb.dims.q_heads + h * G;
  float* scores = scratch.scores.data();
  score_block(q_group, G, D, keys, pb.k.token_stride, n, scores, B);
  float* teacher = scratch.teacher.data();
  std::fill(teacher, teacher + n, 0.0f);
  for (int64_t r = 0; r < G; ++r)
    for (int64_t t = 0; t < n; ++t)
      teacher[t] += std::exp(pb.scale * scores[r * B + t] - lse_group[r]);
  for (int64_t t = 0; t < n; ++t) teacher[t] /= static_cast<float>(G);
}

// Student logits (iscale / T) qi . ki of `n` consecutive index keys of one block.
void student_logits(const Problem& pb, const float* qi_row, const float* index_keys, int64_t n,
                    float* out) {
  score_block(qi_row, 1, pb.index_dim, index_keys, pb.ki.token_stride, n, out, 0);
  for (int64_t t = 0; t < n; ++t) out[t] *= pb.logit_scale;
}

// Pass 1 for (row, h): writes dqi of the row and the student LSE; returns the loss term.
double query_pass(const Problem& pb, int64_t row, int64_t h, Scratch& scratch, float* dqi,
                  float* student_lse) {
  const int64_t Hi = pb.dims.kv_heads, Di = pb.index_dim, B = pb.k.block_size;
  const int64_t seq = pb.batch.seq_of_query[row], pos = pb.batch.pos(row);
  const float* qi_row = pb.qi + (row * Hi + h) * Di;
  float* dqi_row = dqi + (row * Hi + h) * Di;
  std::fill(dqi_row, dqi_row + Di, 0.0f);
  const QueryBlocks ids = blocks_read_by(pb.selection, pb.batch, row, h, B);
  const int64_t count = ids.count;

  // Student logits of every selected token, then their log-sum-exp.
  std::vector<float>& logits = scratch.student;
  int64_t n_logits = 0;
  float top = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = visible_in_block(ids[i], B, pos);
    student_logits(pb, qi_row, pb.ki.block(seq, ids[i], 0), n, logits.data() + n_logits);
    for (int64_t t = 0; t < n; ++t) top = std::max(top, logits[n_logits + t]);
    n_logits += n;
  }
  student_lse[h * pb.batch.total_q() + row] = -INFINITY;
  if (n_logits == 0) return 0;
  float sum = 0;
  for (int64_t i = 0; i < n_logits; ++i) sum += std::exp(logits[i] - top);
  const float lse = top + std::log(sum);
  student_lse[h * pb.batch.total_q() + row] = lse;

  double loss = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < count; ++i) {
    const float* keys = pb.k.block(seq, ids[i], h);
    const float* index_keys = pb.ki.block(seq, ids[i], 0);
    const int64_t n = visible_in_block(ids[i], B, pos);
    teacher_probs(pb, row, h, keys, n, scratch);
    for (int64_t t = 0; t < n; ++t, ++at) {
      const float p_teacher = scratch.teacher[t];
      const float log_p_student = logits[at] - lse;
      if (p_teacher > 0)
        loss += static_cast<double>(p_teacher) *
                (std::log(static_cast<double>(p_teacher)) - log_p_student);
      const float ds = std::exp(log_p_student) - p_teacher;
      axpy(ds, index_keys + t * pb.ki.token_stride, dqi_row, Di);
    }
  }
  for (int64_t d = 0; d < Di; ++d) dqi_row[d] *= pb.grad_scale;
  return pb.norm * loss;
}

// Pass 2: dki of one index-key block from every (head, row) that selected it.
void key_pass(const Problem& pb, const BlockReaderIndex& index, int64_t seq, int64_t block,
              const float* student_lse, Scratch& scratch, std::vector<float>& acc, float* dki) {
  const int64_t Hi = pb.dims.kv_heads, Di = pb.index_dim, B = pb.k.block_size;
  const int64_t istride = pb.ki.token_stride;
  const float* index_keys = pb.ki.block(seq, block, 0);
  const int64_t n_keys = std::min(B, pb.batch.k_len[seq] - block * B);
  std::fill(acc.begin(), acc.begin() + n_keys * Di, 0.0f);
  for (int64_t h = 0; h < Hi; ++h) {
    const float* keys = pb.k.block(seq, block, h);
    const Readers readers = index.readers(h, seq, block);
    for (int64_t i = readers.begin; i < readers.end; ++i) {
      const int64_t row = readers[i];
      const float* qi_row = pb.qi + (row * Hi + h) * Di;
      const float lse = student_lse[h * pb.batch.total_q() + row];
      const int64_t n = std::min(n_keys, visible_in_block(block, B, pb.batch.pos(row)));
      student_logits(pb, qi_row, index_keys, n, scratch.student.data());
      teacher_probs(pb, row, h, keys, n, scratch);
      for (int64_t t = 0; t < n; ++t) {
        const float ds = std::exp(scratch.student[t] - lse) - scratch.teacher[t];
        axpy(ds, qi_row, acc.data() + t * Di, Di);
      }
    }
  }
  float* dki_block = dki + (index_keys - pb.ki.data);  // dki has ki's layout
  for (int64_t t = 0; t < n_keys; ++t)
    axpy(pb.grad_scale, acc.data() + t * Di, dki_block + t * istride, Di);
}

}  // namespace

double indexer_kl(const float* q, const KeyBlocks<float>& k, const float* main_lse,
                  const AttentionDims& dims, const float* qi, const KeyBlocks<float>& ki,
                  int64_t index_dim, const Batch& batch, BlockSource selection,
                  const MsaParams& params, float scale, float index_scale, float* dqi, float* dki) {
  const int64_t Hi = dims.kv_heads, B = k.block_size, total_q = batch.total_q();
  const double norm = params.kl_coefficient / static_cast<double>(Hi * total_q);
  const float logit_scale = static_cast<float>(index_scale / params.temperature);
  const float grad_scale = static_cast<float>(logit_scale * norm);
  const Problem pb{q,     k,         main_lse, dims,        qi,         ki,  index_dim,
                   batch, selection, scale,    logit_scale, grad_scale, norm};
  const std::vector<int64_t> first_block = first_global_blocks(batch, B);
  const int64_t total_blocks = first_block.back();
  const BlockReaderIndex index(selection, batch, Hi, first_block, B);
  std::vector<float> student_lse(Hi * total_q);
  std::vector<double> loss_terms(total_q * Hi);

#pragma omp parallel
  {
    std::vector<float> acc(B * index_dim);
    Scratch scratch(dims.group_size(), B, selection.slots);

#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < total_q * Hi; ++task)
      loss_terms[task] = query_pass(pb, task / Hi, task % Hi, scratch, dqi, student_lse.data());

#pragma omp for schedule(dynamic, 1)
    for (int64_t global_block = 0; global_block < total_blocks; ++global_block) {
      const int64_t seq = std::upper_bound(first_block.begin(), first_block.end(), global_block) -
                          first_block.begin() - 1;
      key_pass(pb, index, seq, global_block - first_block[seq], student_lse.data(), scratch, acc,
               dki);
    }
  }

  double loss = 0;
  for (double term : loss_terms) loss += term;
  return loss;
}

}  // namespace msa::detail::cpu
