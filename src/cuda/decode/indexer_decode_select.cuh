// Decode top-k: ranks one (query, index head) row's block maxima (written by
// decode_scan_kernel) and writes its selection row. Replaces select_rows_kernel on the
// decode path, whose one-warp scan paid an L2 round trip per 32 candidates.
//
// Plan: one CTA (256 threads) per row, exact, deterministic (rank by value descending,
// equal values to the lower id, NaN read as -inf): every comparison is one u64 compare of
// entry keys (order bits of the value, ~id; see entry_key), the order of ranks_before.
//   0. Loads: thread t's float4 chunks t, t + 256, ... (a "round" each) stay in registers
//      for both passes (8 rounds = 8192 blocks, 1M at B = 128; longer rows reload the rest).
//      The row's address needs no geometry, so round 0 (all 8 rounds for grids of few rows,
//      DecodeSelectPlan::speculative_rounds) is issued right after pdl_wait, under the
//      geometry's two round trips (q_start[batch] with seq_of_query[query], then q_start
//      and k_len of the sequence).
//   1. Threshold: each thread's best key; group l = lane l of every warp: warp 0 reduces
//      the 8 warps' bests to 32 group maxima (3-level tree) and takes the `ranked`-th best
//      of those 32 (ranked <= 31; 16 broadcast loads, no shuffle chain) as the threshold T.
//      At least `ranked` distinct entries reach T, so all of the true top-`ranked` do.
//   2. Candidates: entries with key >= T, appended to shared memory with one atomic per
//      thread. Their number is <= ranked x (entries per group): <= 15 x 32 at 128K; on
//      random data ~20-40.
//   3. Exact ranks: each candidate counts the candidates with a larger key (O(m^2), m
//      small; m <= 32 needs no barrier: warp 0 ranks and writes the row). More than
//      kSelectCap candidates (only adversarial data, e.g. the top blocks all in one group
//      at >= 4096 blocks) falls back to the exact one-warp list scan (TopList + warp merge).
// Latency, not bytes, bounds this kernel. A straightforward version (CPI ~14, ~7K active
// cycles per CTA at 128K) showed the chain in its SASS: 4 dependent global round trips before
// the first maximum was seen (q_start[batch] -> exit -> seq_of_query -> q_start/k_len ->
// maxima), at 1M 8 SERIAL maxima loads (ptxas kept each load behind the previous chunk's
// branchy ranks_before), a 7-step merge + 64 shuffles for the group rank, 4 barriers, a
// second pass reloading the row with per-entry warp-aggregated atomics, and a rank loop with
// serial shared loads. This one (SASS, sm_90a, CUDA 13.0): 2 round trips before the maxima
// (3 at 1M with many rows), branch-free key arithmetic (~9 instructions per entry), 3
// barriers (2 when m <= 32), 58 registers, no spills. Estimated chain ~2.6K cycles at 128K
// and ~3.5K at 1M, against ~5K and ~13K for that version; launch and drain are the same.
// Bytes: 4 B per block (4 KB per row at 128K, 32 KB at 1M), plus up to 32 KB per row read
// speculatively past a short row's end when the grid has <= one row per SM.
// Shared memory: 8 KB candidates + 2.3 KB: co-resides with the scan's CTAs.
// Graph safety: grid = total_q x heads (capacity); rows of queries >= q_start[batch] exit
// (after issuing their loads, which stay inside the workspace row). pdl_wait precedes
// every global access.
#pragma once
#include "cuda/common/pdl.cuh"
#include "cuda/indexer/topk_list.cuh"

namespace msa::cuda::indexer_detail {

constexpr int kSelectWarps = 8;
constexpr int kSelectThreads = kSelectWarps * 32;
constexpr int kSelectCap = 1024;     // candidate buffer (entries)
constexpr int kSelectRegRounds = 8;  // rounds of float4 chunks kept in registers: 8192 blocks

struct DecodeSelectPlan {
  const float* block_max = nullptr;  // [total_q * Hi, block_max_stride], stride % 4 == 0
  int64_t block_max_stride = 0;
  int ranked = 0;      // k - local - init (>= 1 on this path)
  int list_pitch = 1;  // fallback lists: entries between two lanes' lists (odd)
  // Rounds (of one float4 per thread) loaded before the row's length is known, up to the
  // row stride, 1..kSelectRegRounds. Reads past the row's end are wasted: the host allows
  // more than 1 only for few rows (latency-bound grids).
  int speculative_rounds = 1;
};

// Float4 chunk c of a row, or zeros at and beyond `limit` (no load).
__device__ __forceinline__ float4 load_chunk(const float4* maxima4, int32_t c, int32_t limit) {
  return c < limit ? __ldg(maxima4 + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Order bits of the entries id = 4c .. 4c + 3 of chunk c; 0 outside [begin, end).
__device__ __forceinline__ void chunk_orders(float4 v, int32_t c, int32_t begin, int32_t end,
                                             uint32_t (&order)[4]) {
  const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int32_t id = 4 * c + e;
    order[e] = id >= begin && id < end ? order_bits(values[e]) : 0u;
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    decode_select_kernel(const IndexerLaunch p, const DecodeSelectPlan plan) {
  pdl_wait();  // the block maxima come from decode_scan_kernel
  pdl_launch_dependents();
  __shared__ __align__(16) uint64_t cand_key[kSelectCap];  // also the fallback's lists
  __shared__ uint64_t thread_best[kSelectWarps][32];
  __shared__ __align__(16) uint64_t group_best[32];
  __shared__ int32_t merged[kMaxTopk];
  __shared__ uint64_t threshold;
  __shared__ int cand_count;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t row = blockIdx.x;  // = query * Hi + head (< 2^31, launcher)
  const uint32_t heads = static_cast<uint32_t>(p.heads);  // 32-bit division: rows < 2^31
  const int64_t query = row / heads, head = row % heads;
  const float* maxima = plan.block_max + int64_t{row} * plan.block_max_stride;
  const float4* maxima4 = reinterpret_cast<const float4*>(maxima);
  const int32_t chunk_begin = p.init_blocks / 4;  // begin = init_blocks: no load needed
  const int32_t row_chunks = static_cast<int32_t>(plan.block_max_stride / 4);
  const int32_t first_chunk = chunk_begin + static_cast<int32_t>(threadIdx.x);

  // The geometry's first round trip (q_start[batch] and seq_of_query together: the latter
  // is in bounds for every row of the grid), then the maxima, whose address needs no
  // geometry: all in flight at once.
  const int64_t q_end = p.batch.q_start[p.batch.batch];
  const int64_t seq = p.batch.seq_of_query[query];
  float4 raw[kSelectRegRounds];
#pragma unroll
  for (int i = 0; i < kSelectRegRounds; ++i)
    if (i < plan.speculative_rounds)
      raw[i] = load_chunk(maxima4, first_chunk + i * kSelectThreads, row_chunks);
  // Beyond the actual queries. (seq < 0 never holds for a real row: the test only keeps
  // ptxas from sinking the seq load below the exit, which serialised the round trips.)
  if (query >= q_end || seq < 0) return;
  const RowGeometry geometry = row_geometry(p, query, seq);
  const int32_t begin = geometry.cand_begin, end = geometry.cand_end;
  const int32_t chunk_end = end > begin ? (end + 3) / 4 : chunk_begin;
  const int rounds = (chunk_end - chunk_begin + kSelectThreads - 1) / kSelectThreads;
#pragma unroll
  for (int i = 0; i < kSelectRegRounds; ++i)  // all independent: one more round trip
    if (i >= plan.speculative_rounds && i < rounds)
      raw[i] = load_chunk(maxima4, first_chunk + i * kSelectThreads, chunk_end);

  // 1. Per-thread best key (ids ascend over a thread's entries: strictly greater keeps the
  // lower id), then the 32 group maxima and the threshold.
  uint32_t order[kSelectRegRounds][4];
  uint32_t best_order = 0;
  int32_t best_id = kNoBlock;
  const auto keep_best = [&](const uint32_t (&o)[4], int32_t c) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (o[e] > best_order) {
        best_order = o[e];
        best_id = 4 * c + e;
      }
  };
#pragma unroll
  for (int i = 0; i < kSelectRegRounds; ++i)
    if (i < rounds) {
      const int32_t c = first_chunk + i * kSelectThreads;
      chunk_orders(raw[i], c, begin, end, order[i]);
      keep_best(order[i], c);
    }
  for (int i = kSelectRegRounds; i < rounds; ++i) {  // rows beyond the registers: reloaded
    const int32_t c = first_chunk + i * kSelectThreads;
    uint32_t o[4];
    chunk_orders(load_chunk(maxima4, c, chunk_end), c, begin, end, o);
    keep_best(o, c);
  }
  thread_best[warp][lane] = best_order != 0 ? entry_key(best_order, best_id) : 0;
  if (threadIdx.x == 0) cand_count = 0;
  __syncthreads();
  if (warp == 0) {
    // Group l = lane l of every warp: a 3-level tree over the 8 warps' bests.
    uint64_t best[kSelectWarps];
#pragma unroll
    for (int w = 0; w < kSelectWarps; ++w) best[w] = thread_best[w][lane];
#pragma unroll
    for (int width = kSelectWarps / 2; width > 0; width /= 2)
#pragma unroll
      for (int w = 0; w < width; ++w) best[w] = best[w] > best[w + width] ? best[w] : best[w + width];
    const uint64_t group = best[0];
    group_best[lane] = group;
    __syncwarp();
    // Rank among the 32 group maxima: 16 independent broadcast loads (no shuffle chain).
    int rank = 0;
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const ulonglong2 pair = reinterpret_cast<const ulonglong2*>(group_best)[j / 2];
      rank += (pair.x > group) + (pair.y > group);
    }
    // The ranked-th best group maximum: at least `ranked` distinct entries reach it. With
    // fewer valid groups than slots, every entry is a candidate. (A group with no entry
    // has key 0 and ranks after every valid one: the writer below is unique.)
    const int n_groups = __popc(__ballot_sync(0xffffffffu, group != 0));
    if (n_groups < plan.ranked) {
      if (lane == 0) threshold = kEveryEntry;
    } else if (rank == plan.ranked - 1) {
      threshold = group;
    }
  }
  __syncthreads();

  // 2. Candidates: entries whose key reaches the threshold (entries outside the row have
  // keys < 2^32 <= threshold). One shared atomic per thread for its register rounds.
  const uint64_t t = threshold;
  const auto count_chunk = [&](const uint32_t (&o)[4], int32_t c) {
    int n = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) n += entry_key(o[e], 4 * c + e) >= t;
    return n;
  };
  const auto store_chunk = [&](const uint32_t (&o)[4], int32_t c, int& at) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint64_t key = entry_key(o[e], 4 * c + e);
      if (key >= t) {
        if (at < kSelectCap) cand_key[at] = key;
        ++at;
      }
    }
  };
  int n_mine = 0;
#pragma unroll
  for (int i = 0; i < kSelectRegRounds; ++i)
    if (i < rounds) n_mine += count_chunk(order[i], first_chunk + i * kSelectThreads);
  if (n_mine > 0) {
    int at = atomicAdd(&cand_count, n_mine);
#pragma unroll
    for (int i = 0; i < kSelectRegRounds; ++i)
      if (i < rounds) store_chunk(order[i], first_chunk + i * kSelectThreads, at);
  }
  for (int i = kSelectRegRounds; i < rounds; ++i) {
    const int32_t c = first_chunk + i * kSelectThreads;
    uint32_t o[4];
    chunk_orders(load_chunk(maxima4, c, chunk_end), c, begin, end, o);
    const int n = count_chunk(o, c);
    if (n > 0) {
      int at = atomicAdd(&cand_count, n);
      store_chunk(o, c, at);
    }
  }
  __syncthreads();

  // 3. Exact ranks of the candidates (or the fallback scan); warp 0 writes the row.
  const int m = cand_count;
  int n_ranked = 0;
  if (m <= kSelectCap) {
    for (int i = threadIdx.x; i < m; i += kSelectThreads) {
      const uint64_t key = cand_key[i];
      int rank = 0;
      for (int base = 0; base < m; base += 16)  // 8 independent loads, then the compares
#pragma unroll
        for (int j = base; j < base + 16; j += 2) {  // in bounds: m <= kSelectCap, 16 | cap
          const ulonglong2 pair = reinterpret_cast<const ulonglong2*>(cand_key)[j / 2];
          rank += (j < m && pair.x > key) + (j + 1 < m && pair.y > key);
        }
      if (rank < plan.ranked) merged[rank] = key_id(key);
    }
    if (m > 32) __syncthreads();  // (CTA-uniform) else only warp 0 ranked: i < m <= 32
    n_ranked = min(m, plan.ranked);
  } else if (warp == 0) {
    // Exact one-warp scan (select_rows_kernel's method); the lists reuse the buffer.
    float* list_values = reinterpret_cast<float*>(cand_key);
    int32_t* list_ids = reinterpret_cast<int32_t*>(cand_key) + kSelectCap;
    TopList list;
    list.init(list_values + lane * plan.list_pitch, list_ids + lane * plan.list_pitch, plan.ranked);
    for (int32_t j = begin + lane; j < end; j += 32) list.offer(sanitize_score(maxima[j]), j);
    n_ranked = warp_merge_lists(list, plan.ranked, merged);  // the same on every lane
  }
  if (warp != 0) return;
  __syncwarp();
  int32_t* out = p.topk_out + (head * p.batch.total_q + query) * p.topk;
  if (lane < p.topk)  // topk <= kMaxTopk = 32
    out[lane] = selection_slot(lane, p, geometry.own_block, merged, n_ranked);
}

}  // namespace msa::cuda::indexer_detail
