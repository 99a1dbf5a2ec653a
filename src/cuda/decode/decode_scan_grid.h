// The decode index scan's grid (indexer.cu, decode_scan_kernel): every (request, row tile)
// splits its blocks into `chunks` contiguous chunks of `chunk_blocks`, one CTA each, aiming
// at one wave of the resident CTAs (2 per SM). Plain C++ (no CUDA) so CPU tests check it.
//
// The chunk count rounds DOWN: rounding up (ceil(resident / per_chunk)) gives batch 64 five
// chunks, 320 CTAs for 264 resident slots: a second wave of 56 CTAs, each as long as the
// first wave's, with the GPU mostly idle. Measured with bf16 keys, that ran batch 64 at 128K
// at 69% of the read ceiling, against 90% for the same bytes at 1M batch 8, whose 264 CTAs
// are exactly one wave (bench/results/history.md).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/common/workspace_layout.h"  // ceil_div

namespace msa::cuda {

struct DecodeScanGrid {
  int64_t chunks = 1;        // CTAs per (request, row tile)
  int64_t chunk_blocks = 1;  // blocks per CTA; chunks * chunk_blocks >= max_blocks
};

// work_items: requests x row tiles; max_blocks: blocks of the longest request (>= 1);
// resident_ctas: CTAs the GPU runs at once (2 x SMs). Chunks of >= min_chunk_blocks blocks.
inline DecodeScanGrid decode_scan_grid(int64_t work_items, int64_t max_blocks, int64_t resident_ctas,
                                       int64_t min_chunk_blocks) {
  work_items = std::max<int64_t>(1, work_items);
  max_blocks = std::max<int64_t>(1, max_blocks);
  const int64_t max_chunks = std::max<int64_t>(1, ceil_div(max_blocks, std::max<int64_t>(1, min_chunk_blocks)));
  // Whole waves: as many chunks as fit beside the other work items in one wave (>= 1; with
  // more work items than resident CTAs, one chunk each and several waves are unavoidable).
  const int64_t wanted = std::clamp<int64_t>(resident_ctas / work_items, 1, max_chunks);
  DecodeScanGrid grid;
  grid.chunk_blocks = std::max<int64_t>(1, ceil_div(max_blocks, wanted));
  grid.chunks = std::max<int64_t>(1, ceil_div(max_blocks, grid.chunk_blocks));
  return grid;
}

}  // namespace msa::cuda
