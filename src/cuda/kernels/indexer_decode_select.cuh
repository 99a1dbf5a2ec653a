// Decode top-k: ranks one (query, index head) row's block maxima (written by
// decode_scan_kernel) and writes its selection row. Replaces select_rows_kernel on the
// decode path, whose one-warp scan paid an L2 round trip per 32 candidates (~32 serial
// loads at 128K, 256 at 1M) plus per-lane insertion sorts: ~10-15 us at 128K batch 1.
//
// Plan: one CTA (256 threads) per row, exact, deterministic (rank by value descending,
// equal values to the lower id: ranks_before, a strict total order on (value, id) once NaN
// is read as -inf).
//   1. Threshold: thread t reads float4 chunks t, t + 256, ... of the row (all loads of a
//      thread independent: one L2 round trip at 128K, a few at 1M) and keeps its best entry;
//      group l = lane l of every warp: warp 0 reduces the 8 warps' bests to 32 group maxima
//      and takes the `ranked`-th best of those 32 (ranked <= 31) as the threshold T. At
//      least `ranked` distinct entries rank at or before T, so every entry of the true
//      top-`ranked` does too.
//   2. Candidates: entries ranking at or before T are appended to shared memory (order
//      irrelevant). Their number is <= ranked x (entries per group): <= 15 x 32 at 128K; on
//      random data ~20-40.
//   3. Exact ranks: each candidate counts the candidates ranking before it (O(m^2), m
//      small); rank r < ranked writes ranked slot r. More than kSelectCap candidates (only
//      adversarial data, e.g. the top blocks all in one group at >= 1M) falls back to the
//      exact one-warp list scan (TopList + warp merge) over the row.
// Bytes: 4 B per block (4 KB per row at 128K, 32 KB at 1M); time ~1 us at 128K batch 1
// (one L2 round trip for the maxima, two barriers, a ~40 x 40 rank), launch hidden by PDL.
// Shared memory: 8 KB candidates + 2 KB group maxima: co-resides with the scan's CTAs.
// Graph safety: grid = total_q x heads (capacity); rows of queries >= q_start[batch] exit.
#pragma once
#include "cuda/kernels/pdl.cuh"
#include "cuda/kernels/topk_list.cuh"

namespace msa::cuda::indexer_detail {

constexpr int kSelectWarps = 8;
constexpr int kSelectThreads = kSelectWarps * 32;
constexpr int kSelectCap = 1024;  // candidate buffer (entries)

struct DecodeSelectPlan {
  const float* block_max = nullptr;  // [total_q * Hi, block_max_stride], stride % 4 == 0
  int64_t block_max_stride = 0;
  int ranked = 0;      // k - local - init (>= 1 on this path)
  int list_pitch = 1;  // fallback lists: entries between two lanes' lists (odd)
};

__device__ __forceinline__ float sanitize_score(float value) {
  return value != value ? kNegInf : value;  // NaN ranks last (a total order)
}

// Calls visit(value, id) for the entries id = 4c .. 4c + 3 of float4 chunk c of a row of
// block maxima (one 16-byte load) that lie in [begin, end); NaN values read as -inf.
template <class Visit>
__device__ __forceinline__ void visit_chunk(const float4* maxima4, int32_t c, int32_t begin, int32_t end,
                                            Visit&& visit) {
  const float4 v = __ldg(maxima4 + c);
  const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int32_t id = 4 * c + e;
    const float value = sanitize_score(values[e]);
    if (id >= begin && id < end) visit(value, id);
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    decode_select_kernel(const IndexerParams p, const DecodeSelectPlan plan) {
  pdl_wait();  // the block maxima come from decode_scan_kernel
  pdl_launch_dependents();
  __shared__ float cand_value[kSelectCap];
  __shared__ int32_t cand_id[kSelectCap];
  __shared__ float group_value[kSelectWarps][32];
  __shared__ int32_t group_id[kSelectWarps][32];
  __shared__ int32_t merged[kMaxTopk];
  __shared__ float threshold_value;
  __shared__ int32_t threshold_id;
  __shared__ int cand_count, ranked_count;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x;  // = query * Hi + head
  const int64_t query = row / p.heads, head = row % p.heads;
  if (query >= p.batch.q_start[p.batch.batch]) return;  // beyond the actual queries
  const RowGeometry geometry = row_geometry(p, query);
  const int32_t begin = geometry.cand_begin, end = geometry.cand_end;
  const float* maxima = plan.block_max + row * plan.block_max_stride;
  const float4* maxima4 = reinterpret_cast<const float4*>(maxima);
  const int32_t chunk_begin = begin / 4, chunk_end = end > begin ? (end + 3) / 4 : chunk_begin;

  // 1. Per-thread best, then the 32 group maxima and the threshold.
  float best_value = kNegInf;
  int32_t best_id = kNoBlock;
#pragma unroll 4
  for (int32_t c = chunk_begin + threadIdx.x; c < chunk_end; c += kSelectThreads)
    visit_chunk(maxima4, c, begin, end, [&](float value, int32_t id) {
      if (ranks_before(value, id, best_value, best_id)) {
        best_value = value;
        best_id = id;
      }
    });
  group_value[warp][lane] = best_value;
  group_id[warp][lane] = best_id;
  if (threadIdx.x == 0) cand_count = 0;
  __syncthreads();
  if (warp == 0) {
    float value = group_value[0][lane];
    int32_t id = group_id[0][lane];
#pragma unroll
    for (int w = 1; w < kSelectWarps; ++w)
      if (ranks_before(group_value[w][lane], group_id[w][lane], value, id)) {
        value = group_value[w][lane];
        id = group_id[w][lane];
      }
    int rank = 0;
    for (int other = 0; other < 32; ++other) {
      const float other_value = __shfl_sync(0xffffffffu, value, other);
      const int32_t other_id = __shfl_sync(0xffffffffu, id, other);
      rank += ranks_before(other_value, other_id, value, id);
    }
    const int n_groups = __popc(__ballot_sync(0xffffffffu, id != kNoBlock));
    if (n_groups < plan.ranked) {
      if (lane == 0) {  // fewer valid groups than slots: every entry is a candidate
        threshold_value = kNegInf;
        threshold_id = kNoBlock;
      }
    } else if (rank == plan.ranked - 1) {
      threshold_value = value;
      threshold_id = id;
    }
  }
  __syncthreads();

  // 2. Candidates: entries ranking at or before the threshold.
  const float t_value = threshold_value;
  const int32_t t_id = threshold_id;
  for (int32_t c = chunk_begin + threadIdx.x; c < chunk_end; c += kSelectThreads)
    visit_chunk(maxima4, c, begin, end, [&](float value, int32_t id) {
      if (id == t_id || ranks_before(value, id, t_value, t_id)) {
        const int at = atomicAdd(&cand_count, 1);
        if (at < kSelectCap) {
          cand_value[at] = value;
          cand_id[at] = id;
        }
      }
    });
  __syncthreads();

  // 3. Exact ranks of the candidates (or the fallback scan).
  const int m = cand_count;
  if (m <= kSelectCap) {
    for (int i = threadIdx.x; i < m; i += kSelectThreads) {
      const float value = cand_value[i];
      const int32_t id = cand_id[i];
      int rank = 0;
      for (int j = 0; j < m; ++j) rank += ranks_before(cand_value[j], cand_id[j], value, id);
      if (rank < plan.ranked) merged[rank] = id;
    }
    if (threadIdx.x == 0) ranked_count = min(m, plan.ranked);
  } else if (warp == 0) {
    // Exact one-warp scan (select_rows_kernel's method); the lists reuse the buffer.
    TopList list;
    list.init(cand_value + lane * plan.list_pitch, cand_id + lane * plan.list_pitch, plan.ranked);
    for (int32_t j = begin + lane; j < end; j += 32) list.offer(sanitize_score(maxima[j]), j);
    const int n = warp_merge_lists(list, plan.ranked, merged);
    if (lane == 0) ranked_count = n;
  }
  __syncthreads();
  const int n_ranked = ranked_count;
  int32_t* out = p.topk_out + (head * p.batch.total_q + query) * p.topk;
  for (int slot = threadIdx.x; slot < p.topk; slot += kSelectThreads)
    out[slot] = selection_slot(slot, p, geometry.own_block, merged, n_ranked);
}

}  // namespace msa::cuda::indexer_detail
