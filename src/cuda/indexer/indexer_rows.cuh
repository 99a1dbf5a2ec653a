// Per-row kernels of the index branch, one warp per (query, index head) row:
// - select_rows_kernel: ranks a row's block maxima (from the split scans) and writes its
//   selection row. Exact, with the rule of topk_list.cuh (rank by value descending, equal
//   values to the lower id, NaN read as -inf), every comparison one u64 compare of entry keys:
//     1. lane l reads entries l, l + 32, ... (the first kRowRegRounds rounds stay in
//        registers) and keeps its best key;
//     2. threshold T = the `ranked`-th best of the 32 lane bests (every entry when fewer lanes
//        hold one): at least `ranked` entries reach it, so the whole top-`ranked` does;
//     3. the entries >= T go to the warp's candidate buffer (offsets by a warp prefix sum);
//        there are at most ranked x (entries per lane) of them, on random rows about 20-40;
//     4. each candidate's rank is the number of candidates with a larger key; ranks below
//        `ranked` are the selection, in order.
//   More than kRowCands candidates (adversarial rows: the best entries bunched in few lanes
//   of a long row) take the exact list scan instead: lane l offers its entries to a best-first
//   TopList, and the 32 lists are merged by warp argmax rounds.
//   Why: at 8K (32768 rows of <= 64 blocks, 15 ranked) the list scan alone cost 100 us under
//   Nsight Compute, more than the 84 us tile scan it follows: each offer was a dependent
//   shared-memory insertion, and the merge 15 rounds of 10 shuffles per row.
// - selected_lse_kernel: log sum exp(logit_scale * score) over the row's selected visible
//   tokens, recomputing at most k * B scores (training only). Forced-only mode: the forced
//   (init and local) blocks only, merged into the ranked blocks' LSE that the fused tile
//   scan (tile_scan_kernel<kDi, true>) left in lse_out.
#pragma once
#include "cuda/indexer/topk_list.cuh"

namespace msa::cuda::indexer_detail {

constexpr int kRowWarps = 4;  // rows per CTA of the per-row kernels
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kRowCands = 256;     // candidate keys per warp (select_rows_kernel)
constexpr int kRowRegRounds = 4;   // entries per lane kept in registers: 128 blocks per row

struct SelectPlan {
  const float* block_max = nullptr;  // rows [row_begin, row_end) of [total_q * Hi, block_max_stride]
  int64_t block_max_stride = 0;
  int64_t row_begin = 0, row_end = 0;  // this pass's rows (query * Hi + head), grid.x covers them
  int ranked = 0;      // list capacity k - local - init
  int list_pitch = 1;  // fallback lists: entries between two lanes' lists (odd: distinct banks)
};

// Dynamic shared memory of select_rows_kernel: the fallback's lists, then each warp's
// candidate keys, then its merged ids.
inline size_t select_smem_bytes(int list_pitch) {
  return size_t{kRowWarps} * (32 * size_t(list_pitch) * (sizeof(float) + sizeof(int32_t)) +
                              kRowCands * sizeof(uint64_t) + kMaxTopk * sizeof(int32_t));
}

__global__ void __launch_bounds__(kRowThreads)
    select_rows_kernel(const IndexerLaunch p, const SelectPlan plan) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = plan.row_begin + int64_t{blockIdx.x} * kRowWarps + warp;  // query * Hi + head
  if (row >= plan.row_end) return;  // warp-uniform; no CTA barriers below
  const size_t warp_entries = 32 * size_t(plan.list_pitch);
  uint64_t* cand = reinterpret_cast<uint64_t*>(smem) + warp * kRowCands;  // 8-byte aligned: first
  unsigned char* lists = smem + kRowWarps * kRowCands * sizeof(uint64_t);
  float* values = reinterpret_cast<float*>(lists) + warp * warp_entries;
  int32_t* ids = reinterpret_cast<int32_t*>(lists) + kRowWarps * warp_entries + warp * warp_entries;
  int32_t* merged = reinterpret_cast<int32_t*>(lists) + 2 * kRowWarps * warp_entries + warp * kMaxTopk;

  const int64_t query = row / p.heads;
  const int64_t head = row % p.heads;
  const RowGeometry geometry = row_geometry(p, query);
  const int32_t begin = geometry.cand_begin, end = geometry.cand_end;
  const float* maxima = plan.block_max + (row - plan.row_begin) * plan.block_max_stride;
  const int rounds = end > begin ? (end - begin + 31) / 32 : 0;
  const auto key_at = [&](int i) {
    const int32_t j = begin + lane + 32 * i;
    return j < end ? entry_key(order_bits(maxima[j]), j) : uint64_t{0};
  };

  int n_ranked = 0;
  if (plan.ranked > 0 && rounds > 0) {
    // 1. Every entry's key; the lane's best.
    uint64_t keys[kRowRegRounds];
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < kRowRegRounds; ++i) {
      keys[i] = i < rounds ? key_at(i) : 0;
      best = keys[i] > best ? keys[i] : best;
    }
    for (int i = kRowRegRounds; i < rounds; ++i) {
      const uint64_t key = key_at(i);
      best = key > best ? key : best;
    }
    // 2. The threshold: the ranked-th best lane best (lane bests are distinct or 0).
    cand[lane] = best;
    __syncwarp();
    int rank = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) rank += cand[l] > best;
    const int n_lanes = __popc(__ballot_sync(0xffffffffu, best != 0));
    const uint32_t at_threshold = __ballot_sync(0xffffffffu, best != 0 && rank == plan.ranked - 1);
    const uint64_t threshold =
        n_lanes < plan.ranked ? kEveryEntry : __shfl_sync(0xffffffffu, best, __ffs(at_threshold) - 1);
    __syncwarp();  // every lane read cand[0, 32) before it is overwritten
    // 3. Candidates: entries >= threshold, at the warp prefix of the lanes' counts.
    int mine = 0;
#pragma unroll
    for (int i = 0; i < kRowRegRounds; ++i) mine += keys[i] >= threshold;
    for (int i = kRowRegRounds; i < rounds; ++i) mine += key_at(i) >= threshold;
    int at = mine;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, at, offset);
      if (lane >= offset) at += other;
    }
    const int m = __shfl_sync(0xffffffffu, at, 31);
    at -= mine;
    if (m <= kRowCands) {
#pragma unroll
      for (int i = 0; i < kRowRegRounds; ++i)
        if (keys[i] >= threshold) cand[at++] = keys[i];
      for (int i = kRowRegRounds; i < rounds; ++i)
        if (const uint64_t key = key_at(i); key >= threshold) cand[at++] = key;
      __syncwarp();
      // 4. Exact ranks among the candidates (broadcast loads: every lane reads the same j).
      for (int i = lane; i < m; i += 32) {
        const uint64_t key = cand[i];
        int before = 0;
        for (int j = 0; j < m; ++j) before += cand[j] > key;
        if (before < plan.ranked) merged[before] = key_id(key);
      }
      n_ranked = min(m, plan.ranked);
    } else {
      // The exact list scan (ids ascend per lane, NaN read as -inf as in the keys above).
      TopList list;
      list.init(values + lane * plan.list_pitch, ids + lane * plan.list_pitch, plan.ranked);
      for (int32_t j = begin + lane; j < end; j += 32) list.offer(sanitize_score(maxima[j]), j);
      n_ranked = warp_merge_lists(list, plan.ranked, merged);
    }
  }
  __syncwarp();  // `merged` written by the ranking lanes (or lane 0)
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
