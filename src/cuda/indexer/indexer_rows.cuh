// Per-row kernels of the index branch, one warp per (query, index head) row:
// - select_rows_kernel: ranks a row's block maxima (from the split or decode scans) and
//   writes its selection row. Lane l scans candidates l, l + 32, ... (ascending, so its
//   TopList is exact), then the 32 lists are merged by warp argmax rounds.
// - selected_lse_kernel: log sum exp(logit_scale * score) over the row's selected visible
//   tokens, recomputing at most k * B scores (training only). Forced-only mode: the forced
//   (init and local) blocks only, merged into the ranked blocks' LSE that the fused tile
//   scan (tile_scan_kernel<kDi, true>) left in lse_out.
#pragma once
#include "cuda/indexer/topk_list.cuh"

namespace msa::cuda::indexer_detail {

constexpr int kRowWarps = 4;  // rows per CTA of the per-row kernels
constexpr int kRowThreads = kRowWarps * 32;

struct SelectPlan {
  const float* block_max = nullptr;  // [total_q * Hi, block_max_stride]
  int64_t block_max_stride = 0;
  int ranked = 0;      // list capacity k - local - init
  int list_pitch = 1;  // entries between two lanes' lists (odd: distinct banks)
};

// Dynamic shared memory of select_rows_kernel.
inline size_t select_smem_bytes(int list_pitch) {
  return size_t{kRowWarps} * (32 * size_t(list_pitch) * (sizeof(float) + sizeof(int32_t)) +
                              kMaxTopk * sizeof(int32_t));
}

__global__ void __launch_bounds__(kRowThreads)
    select_rows_kernel(const IndexerLaunch p, const SelectPlan plan) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kRowWarps + warp;  // = query * Hi + head
  if (row >= p.batch.total_q * p.heads) return;  // warp-uniform; no CTA barriers below
  const size_t warp_entries = 32 * size_t(plan.list_pitch);
  float* values = reinterpret_cast<float*>(smem) + warp * warp_entries;
  int32_t* ids = reinterpret_cast<int32_t*>(smem) + kRowWarps * warp_entries + warp * warp_entries;
  int32_t* merged = reinterpret_cast<int32_t*>(smem) + 2 * kRowWarps * warp_entries + warp * kMaxTopk;

  const int64_t query = row / p.heads;
  const int64_t head = row % p.heads;
  const RowGeometry geometry = row_geometry(p, query);
  TopList list;
  list.init(values + lane * plan.list_pitch, ids + lane * plan.list_pitch, plan.ranked);
  if (plan.ranked > 0) {
    const float* maxima = plan.block_max + row * plan.block_max_stride;
    for (int32_t j = geometry.cand_begin + lane; j < geometry.cand_end; j += 32)
      list.offer(maxima[j], j);
  }
  const int n_ranked = warp_merge_lists(list, plan.ranked, merged);
  __syncwarp();  // lane 0 wrote `merged`
  int32_t* out = p.topk_out + (head * p.batch.total_q + query) * p.topk;
  for (int slot = lane; slot < p.topk; slot += 32)
    out[slot] = selection_slot(slot, p, geometry.own_block, merged, n_ranked);
}

// Needs the rows in p.topk_out. Lane l takes tokens l, l + 32, ... of each selected block
// (a whole qi row in registers as f32), keeps an online (max, sum), and the warp merges.
// forced_only: skips the ranked candidates [cand_begin, cand_end) and log-add-exps the
// result into p.lse_out's existing value (the ranked blocks' LSE, -inf if none).
template <int kDi>
__global__ void __launch_bounds__(kRowThreads)
    selected_lse_kernel(const IndexerLaunch p, bool forced_only) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kRowWarps + warp;
  if (row >= p.batch.total_q * p.heads) return;
  const int64_t query = row / p.heads;
  const int64_t head = row % p.heads;
  const RowGeometry geometry = row_geometry(p, query);

  float q[kDi];
  const uint4* q_src = reinterpret_cast<const uint4*>(p.qi + row * kDi);
#pragma unroll
  for (int c = 0; c < kDi / 8; ++c) {
    float part[8];
    unpack_bf16x8(q_src[c], part);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[8 * c + e] = part[e];
  }

  const int32_t* selected = p.topk_out + (head * p.batch.total_q + query) * p.topk;
  float running_max = kNegInf, sum = 0.0f;
  for (int slot = 0; slot < p.topk; ++slot) {
    const int32_t block = selected[slot];
    if (block < 0) break;  // -1 suffix
    if (forced_only && block >= geometry.cand_begin && block < geometry.cand_end) continue;
    const int64_t visible = min64(p.block_size, geometry.pos - int64_t{block} * p.block_size + 1);
    const uint16_t* keys = block_pointer(p.ki, geometry.seq, block, 0);
    for (int64_t t = lane; t < visible; t += 32) {
      const uint4* key = reinterpret_cast<const uint4*>(keys + t * p.ki.token_stride);
      float dot = 0.0f;
#pragma unroll
      for (int c = 0; c < kDi / 8; ++c) {
        float k8[8];
        unpack_bf16x8(key[c], k8);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[8 * c + e], k8[e], dot);
      }
      const float logit = p.logit_scale * dot;
      if (logit > running_max) {
        sum = sum * expf(running_max - logit) + 1.0f;
        running_max = logit;
      } else {
        sum += expf(logit - running_max);
      }
    }
  }
  const float row_max = warp_max(running_max);
  const float total = warp_sum(running_max == kNegInf ? 0.0f : sum * expf(running_max - row_max));
  if (lane != 0) return;
  float* out = p.lse_out + head * p.batch.total_q + query;
  float lse = total > 0.0f ? row_max + logf(total) : kNegInf;
  if (forced_only) {  // log(exp(lse) + exp(ranked)), either may be -inf
    // Ternaries, not fmaxf: an unwritten (NaN-poisoned) ranked LSE must stay NaN.
    const float ranked = *out;
    const float high = lse > ranked ? lse : ranked, low = lse > ranked ? ranked : lse;
    lse = high == kNegInf ? kNegInf : high + log1pf(expf(low - high));
  }
  *out = lse;
}

}  // namespace msa::cuda::indexer_detail
