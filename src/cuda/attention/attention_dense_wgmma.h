// Host launcher of the warpgroup-MMA dense prefill (attention_dense_wgmma.cuh), called by
// attention.cu's dense path for head_dim 128 and 80 unless AttentionLaunch::dense_engine is mma_sync.
// Kept in its own translation unit so that attention.cu's compile time does not grow.
#pragma once
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

// Dense attention of `p` (topk null, head_dim 128 or 80; causal or bidirectional): dense_tile_plan with 128-row tiles
// into tile_start ([batch + 1] int64 of the dense workspace), then dense_wgmma_kernel; both
// on `stream` (a cudaStream_t), no host synchronisation.
void run_dense_wgmma(const AttentionLaunch& p, int64_t* tile_start, void* stream);

}  // namespace msa::cuda
