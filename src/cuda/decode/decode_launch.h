// The decode path of the launchers (<= 16 queries per sequence: decode and multi-token
// prediction): indexer() and attention() (src/cuda/indexer/indexer.cu,
// src/cuda/attention/attention.cu) hand such calls to these. Grids and workspace come from
// host-known capacities only (launch.h's contract), so a captured step replays with any
// lengths within them. Host-only header.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

constexpr int64_t kDecodeMaxQueries = 16;  // queries per sequence on the decode path
// Workspace cap of the indexer's block-max paths (decode and split tiles): 512 MiB.
constexpr size_t kMaxBlockMaxBytes = size_t{512} << 20;

// ---- index branch: decode_scan_kernel (split-K over blocks) -> decode_select_kernel ----

struct DecodeIndexPlan {
  int row_tiles = 1, chunks = 1, chunk_blocks = 1;  // the scan's grid (DecodeScanPlan)
  int64_t ctas = 0;
  int64_t block_max_stride = 0;  // padded to 4 (the select reads float4)
  int select_speculative_rounds = 1;
  size_t block_max_bytes = 0;  // the workspace: the block maxima of every row
};

// The decode index plan of `p` over rows of `max_blocks` blocks. block_max_bytes is set in
// any case; the function returns false where the block maxima exceed kMaxBlockMaxBytes.
bool plan_decode_index(const IndexerLaunch& p, int64_t max_blocks, DecodeIndexPlan& plan);
// Launches the scan and the select (both PDL) with the block maxima at `block_max`; `ranked`
// = topk - local - init > 0 candidates per row, kept in lists of `list_pitch`.
void launch_decode_index(const IndexerLaunch& p, const DecodeIndexPlan& plan, int ranked,
                         int list_pitch, float* block_max, void* stream);

// ---- main branch: decode_attention_kernel (split-K) -> decode_merge_kernel ----

// Whether attention() takes the decode path (max_q_len <= 16 and grids within limits).
bool attention_decode_applies(const AttentionLaunch& p);
size_t attention_decode_workspace_bytes(const AttentionLaunch& p);
void launch_attention_decode(const AttentionLaunch& p, void* workspace, void* stream);

}  // namespace msa::cuda
