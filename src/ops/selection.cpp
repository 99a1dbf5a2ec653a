#include "selection.h"

#include <algorithm>
#include <limits>

namespace msa::detail {

ForcedBlocks forced_blocks(int64_t own_block, const MsaParams& params) {
  return {.init_end = std::min<int64_t>(params.init_blocks, own_block + 1),
          .local_begin = std::max<int64_t>(0, own_block - params.local_blocks + 1)};
}

namespace {
template <class Score>
void write_row(const Score* block_max, int64_t own_block, const MsaParams& params, int32_t* row,
               std::vector<int64_t>& candidates) {
  const ForcedBlocks forced = forced_blocks(own_block, params);
  int64_t slot = 0;
  for (int64_t j = 0; j < forced.init_end && j < forced.local_begin; ++j) row[slot++] = j;
  const int64_t local_count = own_block - forced.local_begin + 1;
  const int64_t ranked_slots = params.topk - slot - local_count;

  candidates.clear();
  for (int64_t j = forced.init_end; j < forced.local_begin; ++j) candidates.push_back(j);
  const int64_t take = std::min<int64_t>(ranked_slots, candidates.size());
  // Higher block max first; equal maxima: lower block id first. NaN ranks as -inf (as on
  // CUDA): the comparison must stay a strict weak order whatever the scores hold.
  auto score = [block_max](int64_t j) {
    const Score s = block_max[j];
    return s != s ? -std::numeric_limits<Score>::infinity() : s;
  };
  auto better = [&score](int64_t a, int64_t b) {
    const Score x = score(a), y = score(b);
    return x > y || (x == y && a < b);
  };
  std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end(), better);
  for (int64_t i = 0; i < take; ++i) row[slot++] = static_cast<int32_t>(candidates[i]);

  for (int64_t j = forced.local_begin; j <= own_block; ++j) row[slot++] = static_cast<int32_t>(j);
  for (; slot < params.topk; ++slot) row[slot] = -1;
}
}  // namespace

void write_selection_row(const float* block_max, int64_t own_block, const MsaParams& params,
                         int32_t* row, std::vector<int64_t>& scratch) {
  write_row(block_max, own_block, params, row, scratch);
}
void write_selection_row(const double* block_max, int64_t own_block, const MsaParams& params,
                         int32_t* row, std::vector<int64_t>& scratch) {
  write_row(block_max, own_block, params, row, scratch);
}

}  // namespace msa::detail
