// The selection rule of docs/msa.md §3, shared by every implementation: given the block
// maxima of one (query, index head), build its row of k block ids.
#pragma once
#include <cstdint>
#include <vector>

#include "msa/ops.h"

namespace msa::detail {

// Forced blocks of a query whose own block is `own_block`: init blocks [0, init) and local
// blocks [own_block - local + 1, own_block], clamped to [0, own_block].
struct ForcedBlocks {
  int64_t init_end = 0;     // init blocks are [0, init_end)
  int64_t local_begin = 0;  // local blocks are [local_begin, own_block]
  bool forced(int64_t block) const { return block < init_end || block >= local_begin; }
};
ForcedBlocks forced_blocks(int64_t own_block, const MsaParams& params);

// Writes the row (k = params.topk slots): init blocks ascending, then the best ranked
// candidates (block max descending, ties to the lower id), then the other local blocks
// ascending, then own_block; -1 fills the rest. `block_max[j]` is read for j < own_block
// that are not forced. `scratch` avoids reallocation between rows.
void write_selection_row(const float* block_max, int64_t own_block, const MsaParams& params,
                         int32_t* row, std::vector<int64_t>& scratch);
void write_selection_row(const double* block_max, int64_t own_block, const MsaParams& params,
                         int32_t* row, std::vector<int64_t>& scratch);

// Number of valid entries in a row: min(k, own_block + 1).
inline int64_t selection_count(int64_t own_block, const MsaParams& params) {
  return own_block + 1 < params.topk ? own_block + 1 : params.topk;
}

}  // namespace msa::detail
