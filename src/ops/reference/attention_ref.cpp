// Attention over a set of blocks, forward and backward, as plain loops in f64.
#include <cmath>
#include <limits>
#include <vector>

#include "reference.h"

namespace msa::detail::ref {

namespace {
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The keys query `row` of `group` attends to: t <= last in each block it reads, where last
// is the query's position (causal) or its sequence's last key (bidirectional).
std::vector<int64_t> visible_keys(const Batch& batch, int64_t row, int64_t group,
                                  int64_t block_size, BlockSource blocks) {
  const int64_t last = batch.last_key(row);
  std::vector<int64_t> block_ids;
  if (blocks.topk) {
    const int32_t* entries = blocks.topk + (group * batch.total_q() + row) * blocks.slots;
    for (int64_t slot = 0; slot < blocks.slots && entries[slot] >= 0; ++slot)
      block_ids.push_back(entries[slot]);
  } else {
    for (int64_t j = 0; j <= last / block_size; ++j) block_ids.push_back(j);
  }
  std::vector<int64_t> keys;
  for (int64_t j : block_ids)
    for (int64_t t = j * block_size; t < (j + 1) * block_size && t <= last; ++t) keys.push_back(t);
  return keys;
}

double dot(const double* a, const double* b, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}
}  // namespace

void attention_forward(const double* q, const KeyBlocks<double>& k, const KeyBlocks<double>& v,
                       const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                       double scale, double* o, double* lse) {
  const int64_t D = dims.head_dim;
  for (int64_t row = 0; row < batch.total_q(); ++row) {
    const int64_t seq = batch.seq_of_query[row];
    for (int64_t head = 0; head < dims.q_heads; ++head) {
      const int64_t group = head / dims.group_size();
      const double* q_row = q + (row * dims.q_heads + head) * D;
      double* o_row = o + (row * dims.q_heads + head) * D;
      const std::vector<int64_t> keys = visible_keys(batch, row, group, k.block_size, blocks);
      std::vector<double> logits;
      double max_logit = kNegInf;
      for (int64_t t : keys) {
        logits.push_back(scale * dot(q_row, k.token(seq, t, group), D));
        max_logit = std::max(max_logit, logits.back());
      }
      double sum = 0;
      for (double logit : logits) sum += std::exp(logit - max_logit);
      for (int64_t d = 0; d < D; ++d) o_row[d] = 0;
      for (size_t i = 0; i < keys.size(); ++i) {
        const double p = std::exp(logits[i] - max_logit) / sum;
        const double* v_row = v.token(seq, keys[i], group);
        for (int64_t d = 0; d < D; ++d) o_row[d] += p * v_row[d];
      }
      lse[row * dims.q_heads + head] = keys.empty() ? kNegInf : max_logit + std::log(sum);
    }
  }
}

void attention_backward(const double* q, const KeyBlocks<double>& k, const KeyBlocks<double>& v,
                        const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                        double scale, const double* o, const double* lse, const double* grad_o,
                        double* dq, double* dk, double* dv) {
  const int64_t D = dims.head_dim;
  // dk/dv share k's layout: the gradient of a key lives at the key's own offset.
  auto grad_at = [&](double* grad, const double* key) { return grad + (key - k.data); };

  for (int64_t row = 0; row < batch.total_q(); ++row) {
    const int64_t seq = batch.seq_of_query[row];
    for (int64_t head = 0; head < dims.q_heads; ++head) {
      const int64_t group = head / dims.group_size();
      const int64_t at = (row * dims.q_heads + head) * D;
      const double* q_row = q + at;
      const double* do_row = grad_o + at;
      double* dq_row = dq + at;
      for (int64_t d = 0; d < D; ++d) dq_row[d] = 0;
      const double row_lse = lse[row * dims.q_heads + head];
      const double delta = dot(do_row, o + at, D);  // rowsum(dO * O)
      for (int64_t t : visible_keys(batch, row, group, k.block_size, blocks)) {
        const double* k_row = k.token(seq, t, group);
        const double* v_row = v.token(seq, t, group);
        const double p = std::exp(scale * dot(q_row, k_row, D) - row_lse);
        const double dp = dot(do_row, v_row, D);
        const double ds = p * (dp - delta);
        double* dk_row = grad_at(dk, k_row);
        double* dv_row = dv + (dk_row - dk);
        for (int64_t d = 0; d < D; ++d) {
          dq_row[d] += scale * ds * k_row[d];
          dk_row[d] += scale * ds * q_row[d];
          dv_row[d] += p * do_row[d];
        }
      }
    }
  }
}

}  // namespace msa::detail::ref
