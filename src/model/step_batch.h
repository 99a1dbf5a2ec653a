// The packed description of one forward step shared by the layers: every request's new
// tokens, their absolute positions and where each one lands in the paged cache.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "msa/model.h"
#include "msa/tensor.h"

namespace msa::model {

struct StepBatch {
  int64_t tokens = 0;               // T: new tokens of all requests
  std::vector<int64_t> positions;   // [T] absolute position of each new token
  std::vector<int64_t> slot;        // [T] page * B + offset of each token in the cache
  Tensor cu_seqlens_q;              // int32 [batch + 1]
  Tensor seq_lens;                  // int32 [batch]: cached + new tokens
  Tensor page_table;                // int32 [batch, max_pages]
};

// Checked visual rows of a step: `count` rows of `data` (f32 [count, hidden], the caller's
// memory) replace the embeddings of packed rows [row, row + count).
struct PackedVisualRows {
  int64_t row = 0;
  int64_t count = 0;
  const float* data = nullptr;
};

// A packed step and what the model needs beyond the layers' view of it.
struct PackedStep {
  StepBatch batch;
  std::vector<int32_t> tokens;       // [T] the new tokens, request after request
  std::vector<int64_t> logit_rows;   // rows of [T] whose logits are returned, in order
  std::vector<PackedVisualRows> visual;  // the requests' visual rows (ForwardRequest::visual)
};

// One request's ForwardRequest::visual checked against its tokens (visual_rows.cpp): each
// span inside the tokens, no token covered twice, every covered token an image or video
// placeholder of the config, rows f32 [n, hidden]; an msa::Error names `name`[i]. Returns
// them with packed row offsets (`first_row`: the request's first packed row).
std::vector<PackedVisualRows> check_visual_rows(std::span<const VisualRows> visual,
                                                std::span<const int32_t> tokens,
                                                const ModelConfig& config, const std::string& name,
                                                int64_t first_row);

// Checks the requests (non-null sequence, at least one token), grows their page lists in
// `cache` and packs the step. Sequence lengths are not advanced (advance_sequences does
// that once the step has run).
PackedStep pack_step(std::span<const ForwardRequest> requests, KvCache& cache,
                     const ModelConfig& config);
void advance_sequences(std::span<const ForwardRequest> requests);

}  // namespace msa::model
