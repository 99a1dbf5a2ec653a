// Packing a forward step: positions, cache slots, page table and lengths of every request
// (shared by the CPU and the CUDA forward).
#include "step_batch.h"

#include <algorithm>
#include <string>

namespace msa::model {

PackedStep pack_step(std::span<const ForwardRequest> requests, KvCache& cache,
                     const ModelConfig& c) {
  if (requests.empty()) throw_arg_error("requests", "at least one request", 0);
  if (cache.page_size() != c.block_size)
    throw_arg_error("cache", "pages of " + std::to_string(c.block_size) + " tokens",
                    cache.page_size());
  const int64_t batch_size = static_cast<int64_t>(requests.size());
  PackedStep step;
  StepBatch& batch = step.batch;
  std::vector<int32_t> cu_q{0}, lens;
  int64_t max_pages = 1;
  for (int64_t b = 0; b < batch_size; ++b) {
    const ForwardRequest& r = requests[b];
    if (!r.sequence) throw_arg_error("requests[" + std::to_string(b) + "].sequence", "non-null", "null");
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    if (n < 1) throw_arg_error("requests[" + std::to_string(b) + "].tokens", "at least one token", 0);
    SequenceCache& seq = *r.sequence;
    const int64_t first_row = static_cast<int64_t>(step.tokens.size());
    for (const PackedVisualRows& rows :
         check_visual_rows(r.visual, r.tokens, c, "requests[" + std::to_string(b) + "].visual", first_row))
      step.visual.push_back(rows);
    cache.reserve(seq, seq.length + n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = seq.length + i;
      batch.positions.push_back(pos);
      batch.slot.push_back(int64_t{seq.pages[pos / c.block_size]} * c.block_size + pos % c.block_size);
      step.tokens.push_back(r.tokens[i]);
      if (r.all_logits || i == n - 1) step.logit_rows.push_back(first_row + i);
    }
    cu_q.push_back(static_cast<int32_t>(step.tokens.size()));
    lens.push_back(static_cast<int32_t>(seq.length + n));
    max_pages = std::max<int64_t>(max_pages, cache.pages_for(seq.length + n));
  }
  batch.tokens = static_cast<int64_t>(step.tokens.size());
  batch.cu_seqlens_q = Tensor::from_vector(cu_q, {batch_size + 1});
  batch.seq_lens = Tensor::from_vector(lens, {batch_size});
  std::vector<int32_t> table(batch_size * max_pages, 0);
  for (int64_t b = 0; b < batch_size; ++b) {
    const SequenceCache& seq = *requests[b].sequence;
    const int64_t used = cache.pages_for(lens[b]);
    std::copy_n(seq.pages.begin(), used, table.begin() + b * max_pages);
  }
  batch.page_table = Tensor::from_vector(table, {batch_size, max_pages});
  return step;
}

void advance_sequences(std::span<const ForwardRequest> requests) {
  for (const ForwardRequest& request : requests)
    request.sequence->length += static_cast<int64_t>(request.tokens.size());
}

}  // namespace msa::model
