// The packed description of one forward step shared by the layers: every request's new
// tokens, their absolute positions and where each one lands in the paged cache.
#pragma once
#include <cstdint>
#include <vector>

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

}  // namespace msa::model
