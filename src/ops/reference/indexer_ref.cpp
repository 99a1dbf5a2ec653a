// The index branch (docs/msa.md §3) and its KL objective (§5), as plain loops in f64.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../selection.h"
#include "reference.h"

namespace msa::detail::ref {

namespace {
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double dot(const double* a, const double* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Keys t <= pos inside the blocks of a selection row.
std::vector<int64_t> selected_keys(const int32_t* row, int64_t slots, int64_t pos,
                                   int64_t block_size) {
  std::vector<int64_t> keys;
  for (int64_t slot = 0; slot < slots && row[slot] >= 0; ++slot)
    for (int64_t t = row[slot] * block_size; t < (row[slot] + 1) * block_size && t <= pos; ++t)
      keys.push_back(t);
  return keys;
}

double log_sum_exp(const std::vector<double>& values) {
  double top = kNegInf;
  for (double value : values) top = std::max(top, value);
  if (top == kNegInf) return kNegInf;
  double sum = 0;
  for (double value : values) sum += std::exp(value - top);
  return top + std::log(sum);
}
}  // namespace

void indexer(const double* qi, int64_t index_heads, int64_t index_dim,
             const KeyBlocks<double>& ki, const Batch& batch, const MsaParams& params,
             double index_scale, int32_t* topk, double* lse, const RankingInputs* ranking) {
  const double* rank_qi = ranking ? ranking->qi : qi;
  const KeyBlocks<double>& rank_ki = ranking ? *ranking->ki : ki;
  const int64_t B = params.block_size;
  std::vector<int64_t> scratch;
  for (int64_t row = 0; row < batch.total_q(); ++row) {
    const int64_t seq = batch.seq_of_query[row];
    const int64_t pos = batch.pos(row);
    const int64_t own_block = pos / B;
    for (int64_t h = 0; h < index_heads; ++h) {
      const double* q_row = qi + (row * index_heads + h) * index_dim;
      const double* rank_row = rank_qi + (row * index_heads + h) * index_dim;
      // Block max of the raw scores over the visible keys (no scale, no exp).
      std::vector<double> block_max(own_block + 1, kNegInf);
      for (int64_t t = 0; t <= pos; ++t)
        block_max[t / B] =
            std::max(block_max[t / B], dot(rank_row, rank_ki.token(seq, t, 0), index_dim));
      int32_t* out_row = topk + (h * batch.total_q() + row) * params.topk;
      write_selection_row(block_max.data(), own_block, params, out_row, scratch);
      if (lse) {
        std::vector<double> logits;
        for (int64_t t : selected_keys(out_row, params.topk, pos, B))
          logits.push_back(index_scale * dot(q_row, ki.token(seq, t, 0), index_dim) /
                           params.temperature);
        lse[h * batch.total_q() + row] = log_sum_exp(logits);
      }
    }
  }
}

double indexer_kl(const double* q, const KeyBlocks<double>& k, const double* main_lse,
                  const AttentionDims& dims, const double* qi, const KeyBlocks<double>& ki,
                  int64_t index_dim, const Batch& batch, BlockSource selection,
                  const MsaParams& params, double scale, double index_scale, double* dqi,
                  double* dki) {
  const int64_t index_heads = dims.kv_heads;
  const int64_t G = dims.group_size();
  const int64_t D = dims.head_dim;
  const double norm = params.kl_coefficient / static_cast<double>(index_heads * batch.total_q());
  // d(student logit)/d(score) = iscale / T; the loss is scaled by `norm`.
  const double grad_scale = index_scale / params.temperature * norm;
  double loss = 0;
  for (int64_t row = 0; row < batch.total_q(); ++row) {
    const int64_t seq = batch.seq_of_query[row];
    const int64_t pos = batch.pos(row);
    for (int64_t h = 0; h < index_heads; ++h) {
      const double* qi_row = qi + (row * index_heads + h) * index_dim;
      double* dqi_row = dqi + (row * index_heads + h) * index_dim;
      for (int64_t d = 0; d < index_dim; ++d) dqi_row[d] = 0;
      const int32_t* sel = selection.topk + (h * batch.total_q() + row) * selection.slots;
      const std::vector<int64_t> keys = selected_keys(sel, selection.slots, pos, k.block_size);
      if (keys.empty()) continue;

      std::vector<double> student_logits;
      for (int64_t t : keys)
        student_logits.push_back(index_scale * dot(qi_row, ki.token(seq, t, 0), index_dim) /
                                 params.temperature);
      const double student_lse = log_sum_exp(student_logits);

      for (size_t i = 0; i < keys.size(); ++i) {
        // Teacher: the group's main-branch probabilities of this key, averaged over heads.
        double p_teacher = 0;
        for (int64_t r = h * G; r < (h + 1) * G; ++r)
          p_teacher += std::exp(scale * dot(q + (row * dims.q_heads + r) * D,
                                            k.token(seq, keys[i], h), D) -
                                main_lse[row * dims.q_heads + r]);
        p_teacher /= static_cast<double>(G);
        const double log_p_student = student_logits[i] - student_lse;
        const double p_student = std::exp(log_p_student);
        if (p_teacher > 0) loss += norm * p_teacher * (std::log(p_teacher) - log_p_student);

        const double ds = grad_scale * (p_student - p_teacher);
        const double* ki_row = ki.token(seq, keys[i], 0);
        double* dki_row = dki + (ki_row - ki.data);
        for (int64_t d = 0; d < index_dim; ++d) {
          dqi_row[d] += ds * ki_row[d];
          dki_row[d] += ds * qi_row[d];
        }
      }
    }
  }
  return loss;
}

}  // namespace msa::detail::ref
