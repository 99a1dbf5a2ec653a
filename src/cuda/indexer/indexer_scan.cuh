// Index scan for prefill (many queries per sequence): block maxima of qi . ki on tensor
// cores with the top-k list update fused into the epilogue (docs/msa.md §3; §3.7: no exp).
//
// Tile plan (kDi = 128, B = 128; per CTA, 8 warps = 256 threads, 1 CTA per SM):
//   rows  = one tile of 256 (query, index head) rows of ONE sequence: 256 / Hi consecutive
//           queries (M3: 64 queries x 4 heads). Rows are contiguous in qi [total_q, Hi, Di].
//   warp w owns rows [32w, 32w + 32): two m16 tiles whose A fragments (2 x 8 k-steps x 4
//           regs = 64 registers) stay in registers for the whole scan.
//   keys  = the sequence's index-key blocks, streamed through a kStages-deep cp.async ring;
//           every warp multiplies its 32 rows by all B keys of a block, 64 keys at a time
//           (64 f32 accumulators), so each ldmatrix'd K fragment feeds 2 MMAs and each
//           K block read from L2 serves 256 rows.
//   epilogue per block: fmax over the accumulators, a 3-shuffle quad reduce-scatter that
//           leaves lane (group, quad) with the max of exactly one row, then one compare of
//           that max against the row's list threshold (the common case once lists fill).
// Shared memory: kStages x 128 keys x (Di + 8) bf16 = 3 x 34 KB = 102 KB of K ring (the
//   +8 pad puts the 8 rows of each ldmatrix in distinct banks) + 256 rows x pitch x 8 B of
//   top lists (pitch = odd >= k - local - init, so the 32 lanes' lists hit distinct banks):
//   30 KB for M3 (k 16), at most 62 KB (k 32). Total 132..164 KB, 1 CTA (8 warps) per SM.
// Registers (ptxas, sm_90a): 206 (Di 128), 170 (Di 64); the training variant (kLse, below)
//   238 / 179 (CUDA 13.0 ptxas; 204 / 162 there for the inference one); no spills, no stack.
// Blocks scanned: [init, L_last - local + 1) where L_last is the own block of the tile's
//   last query: exactly the candidates of some row, all fully visible (no causal mask).
//   A row ignores blocks >= its own candidate end.
// Expected bottleneck: mma.sync issue together with shared-memory bandwidth. Each 256 B K
//   fragment feeds 2 MMAs (128 B per 4096-flop MMA): at the wgmma peak (4096 flop/clk/SM)
//   that would be all 128 B/clk of shared memory, so at mma.sync rates (~2/3 of it)
//   ldmatrix uses ~2/3 of the bandwidth. The epilogue (~130 FMNMX + 3 SHFL per thread per
//   block, vs 256 MMAs per warp) is not overlapped with the next block's MMAs here; the
//   wgmma scan (indexer_scan_producer.cuh: B from shared memory, 64-row warpgroup tiles, two
//   consumer warpgroups fed by a producer) overlaps it and is the default without lse_out.
//
// Two modes: fused (plan.block_max == null: lists in shared memory, rows written here) and
// split (grid.y splits a tile's blocks into chunks, block maxima go to plan.block_max and
// select_rows_kernel ranks them): split balances short contexts, where a few long tiles
// would otherwise decide the runtime.
//
// Training variant (kLse = true, fused mode only): the epilogue also computes, per (row,
// block), sumexp = sum over the block's keys of exp(logit_scale (s - block max)) with an
// online (max, sum) per lane over the 64-key steps merged in the quad reduce-scatter, and
// keeps it in the row's list next to the block's max and id (payload, 256 x pitch x 4 B more
// shared memory: 15 KB for M3, at most 195 KB in all). At the end each row writes the LSE of its ranked blocks to lse_out
// (docs/msa.md §3.6; candidates are fully visible, so no mask); selected_lse_kernel (forced-only
// mode) then adds the init and local blocks. Needs logit_scale > 0 (the block max of the raw
// score is then the block max of the logit). Costs 1 ex2 + 1 FFMA + 1 FADD per score.
#pragma once
#include <climits>

#include "cuda/indexer/ranking_passes.h"
#include "cuda/indexer/topk_list.cuh"

namespace msa::cuda::indexer_detail {

template <int kDi>
struct TileScanTraits {
  static_assert(kDi % 16 == 0 && kDi <= 128, "index head dim: multiple of 16, at most 128");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = 32;  // two m16 tiles share each K fragment
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static constexpr int kMaxBlock = 128;
  static constexpr int kKeysPerStep = 64;  // keys per accumulator pass: 2 x 8 n-tiles
  static constexpr int kKSteps = kDi / 16;
  static constexpr int kKeyPitch = kDi + 8;  // elements per key row in shared memory
  static constexpr int kStages = 3;
  static constexpr int kStageElems = kMaxBlock * kKeyPitch;
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageElems * sizeof(uint16_t);
  // with_sumexp: the training variant's per-entry sum-exp payload.
  static size_t smem_bytes(int list_pitch, bool with_sumexp = false) {
    const size_t entry = sizeof(float) + sizeof(int32_t) + (with_sumexp ? sizeof(float) : 0);
    return kPipelineBytes + size_t{kRows} * list_pitch * entry;
  }
};

// Host-computed plan of the tile kernel.
struct TileScanPlan {
  const int64_t* tile_prefix = nullptr;  // [batch + 1]: first tile of each sequence
  int queries_per_tile = 0;
  int ranked = 0;      // list capacity k - local - init
  int list_pitch = 1;  // entries between two rows' lists (odd)
  int chunk_blocks = 0;  // split mode: blocks per CTA (grid.y = chunk)
  float* block_max = nullptr;  // split mode: [pass queries * Hi, block_max_stride]; null = fused
  int64_t block_max_stride = 0;
  // Split mode: this pass's queries [query_begin, query_end) (the host bounds the maxima a
  // pass writes); query q's rows are rows (q - query_begin) * Hi + head of block_max. Tiles
  // without such a query exit; a tile across a pass boundary runs in both passes, each
  // writing its own rows.
  int64_t query_begin = 0, query_end = 0;
  // Split mode: [2 * passes] tile ranges (tile_prefix_kernel) and this pass; the pass's grid.x
  // covers its range (pass_tile_bound).
  const int64_t* pass_tiles = nullptr;
  int64_t pass = 0;
  float logit_scale_log2 = 0;  // training variant: logit_scale * log2(e)
};

// tile_prefix[b] = sum over sequences before b of ceil(q_len / queries_per_tile), and
// tile_prefix[batch] = the number of tiles. One CTA of kPrefixThreads; chunked block scan.
// With pass_tiles (split mode), also each pass's tile range (pass_tile_range): pass i's
// queries [i * pass_queries, min(total_q, (i + 1) * pass_queries)) lie in the tiles
// [pass_tiles[2i], pass_tiles[2i + 1]].
constexpr int kPrefixThreads = 1024;
__global__ void __launch_bounds__(kPrefixThreads)
    tile_prefix_kernel(const BatchLayout batch, int queries_per_tile, int64_t* tile_prefix,
                       int64_t pass_queries, int64_t* pass_tiles) {
  __shared__ int64_t warp_totals[kPrefixThreads / 32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < batch.batch; base += kPrefixThreads) {
    const int64_t seq = base + threadIdx.x;
    const int64_t tiles =
        seq < batch.batch
            ? (batch.q_start[seq + 1] - batch.q_start[seq] + queries_per_tile - 1) / queries_per_tile
            : 0;
    int64_t inclusive = tiles;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      int64_t total = warp_totals[lane];
      for (int offset = 1; offset < 32; offset *= 2) {
        const int64_t up = __shfl_up_sync(0xffffffffu, total, offset);
        if (lane >= offset) total += up;
      }
      warp_totals[lane] = total;
    }
    __syncthreads();
    if (warp > 0) inclusive += warp_totals[warp - 1];
    if (seq < batch.batch) tile_prefix[seq] = carry + inclusive - tiles;
    __syncthreads();  // every thread has read carry and warp_totals of this chunk
    if (threadIdx.x == kPrefixThreads - 1) carry += inclusive;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_prefix[batch.batch] = carry;
  if (pass_tiles == nullptr) return;
  __syncthreads();  // the block's global writes of tile_prefix are visible to the block
  const int64_t passes = (batch.total_q + pass_queries - 1) / pass_queries;
  for (int64_t pass = threadIdx.x; pass < passes; pass += kPrefixThreads) {
    const int64_t q_lo = pass * pass_queries;
    const int64_t q_hi = min64(batch.total_q, q_lo + pass_queries) - 1;
    const TileRange r =
        pass_tile_range(batch.q_start, batch.seq_of_query, tile_prefix, queries_per_tile, q_lo, q_hi);
    pass_tiles[2 * pass] = r.first;
    pass_tiles[2 * pass + 1] = r.last;
  }
}

// The tile a CTA owns and the blocks it scans (shared by the mma.sync and wgmma kernels).
struct TileGeometry {
  bool valid = false;  // false: no tile or no blocks for this CTA
  int64_t seq = 0, first_query = 0, first_pos = 0;
  int n_queries = 0, n_rows = 0;
  int32_t scan_begin = 0, scan_end = 0;  // blocks [scan_begin, scan_end)
  // Split mode: the tile's rows [row_lo, row_hi) are this pass's, tile row r at maxima row
  // maxima_row0 + r. Fused: every row of the tile.
  int row_lo = 0, row_hi = 0;
  int64_t maxima_row0 = 0;
};

// blockIdx.x -> tile in reverse order (the last, longest tiles of each sequence first) of all
// tiles, or in split mode of the pass's tiles; blockIdx.y -> chunk of blocks in split mode.
__device__ __forceinline__ TileGeometry tile_geometry(const IndexerLaunch& p,
                                                      const TileScanPlan& plan) {
  TileGeometry g;
  int64_t tile;
  if (plan.pass_tiles == nullptr) {
    const int64_t n_tiles = plan.tile_prefix[p.batch.batch];
    if (blockIdx.x >= n_tiles) return g;
    tile = n_tiles - 1 - blockIdx.x;
  } else {
    tile = plan.pass_tiles[2 * plan.pass + 1] - blockIdx.x;
    if (tile < plan.pass_tiles[2 * plan.pass]) return g;
  }
  int64_t lo = 0, hi = p.batch.batch;  // the sequence: last lo with tile_prefix[lo] <= tile
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (plan.tile_prefix[mid] <= tile) lo = mid; else hi = mid;
  }
  g.seq = lo;
  const int64_t q_begin = p.batch.q_start[g.seq], q_end = p.batch.q_start[g.seq + 1];
  g.first_query = q_begin + (tile - plan.tile_prefix[g.seq]) * plan.queries_per_tile;
  g.n_queries = static_cast<int>(min64(plan.queries_per_tile, q_end - g.first_query));
  g.n_rows = g.n_queries * static_cast<int>(p.heads);
  g.first_pos = p.batch.k_len[g.seq] - (q_end - q_begin) + (g.first_query - q_begin);
  const int32_t last_own_block =
      static_cast<int32_t>((g.first_pos + g.n_queries - 1) / p.block_size);
  g.scan_begin = p.init_blocks;
  g.scan_end = last_own_block - p.local_blocks + 1;
  g.row_hi = g.n_rows;
  if (plan.block_max == nullptr) {  // fused
    if (plan.ranked == 0) g.scan_end = g.scan_begin;  // nothing is ranked: rows only
  } else {
    if (g.first_query + g.n_queries <= plan.query_begin || g.first_query >= plan.query_end)
      return g;
    g.maxima_row0 = (g.first_query - plan.query_begin) * p.heads;
    g.row_lo = static_cast<int>(g.maxima_row0 < 0 ? -g.maxima_row0 : 0);
    g.row_hi = static_cast<int>(min64(g.n_rows, (plan.query_end - g.first_query) * p.heads));
    g.scan_begin += static_cast<int32_t>(blockIdx.y) * plan.chunk_blocks;
    g.scan_end = min(g.scan_end, g.scan_begin + plan.chunk_blocks);
    if (g.scan_begin >= g.scan_end) return g;
  }
  g.valid = true;
  return g;
}

// exp2 on the MUFU unit (ex2.approx.ftz: ~2 ulp; results below 2^-126 flush to zero,
// which a sum of terms <= 1 that includes a 1 never notices).
__device__ __forceinline__ float index_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (max, sum) pairs of one row: sum = sum of exp2(scale_log2 (s - max)) over the row's
// scores. Merges `other` into (max, sum); both maxima finite.
__device__ __forceinline__ void merge_max_sum(float& max, float& sum, float other_max,
                                              float other_sum, float scale_log2) {
  const float merged = fmaxf(max, other_max);
  sum = sum * index_exp2((max - merged) * scale_log2) +
        other_sum * index_exp2((other_max - merged) * scale_log2);
  max = merged;
}

// A row's block statistics: the max of its scores over the block's keys and (kLse only)
// sumexp = sum over the keys of exp2(scale_log2 (s - max)).
struct BlockStats {
  float max;
  float sumexp;
};

// Statistics over one block's keys of the 32 rows of this warp, returned to the lane that
// owns the row: lane (group = lane / 4, quad = lane % 4) gets row
// (quad >> 1) * 16 + group + 8 * (quad & 1) of the warp. The max is the same with and
// without kLse (fmaxf is exact), so both variants rank identically.
template <int kDi, bool kLse>
__device__ __forceinline__ BlockStats warp_block_stats(const uint32_t (&qa)[2][kDi / 16][4],
                                                       const uint16_t* keys, int block_size,
                                                       float scale_log2) {
  using T = TileScanTraits<kDi>;
  const int lane = threadIdx.x % 32;
  // ldmatrix.x4 over a 16-key x 16-dim tile: matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15);
  // lane l addresses key (l / 16) * 8 + l % 8, dims ((l / 8) % 2) * 8, which gives
  // {b0, b1} of n-tile 0 in regs 0-1 and of n-tile 1 in regs 2-3.
  const uint16_t* lane_keys = keys + ((lane / 16) * 8 + lane % 8) * T::kKeyPitch + ((lane / 8) % 2) * 8;
  float row_max[4] = {kNegInf, kNegInf, kNegInf, kNegInf};  // [m * 2 + h]: row m*16 + group + 8h
  float row_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // kLse: this lane's columns, relative to row_max
#pragma unroll 1
  for (int key0 = 0; key0 < block_size; key0 += T::kKeysPerStep) {
    float acc[2][8][4] = {};
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t frag[4];
        ldmatrix_x4(frag, lane_keys + (key0 + np * 16) * T::kKeyPitch + ks * 16);
        const uint32_t b_lo[2] = {frag[0], frag[1]}, b_hi[2] = {frag[2], frag[3]};
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_bf16_16816(acc[m][2 * np], qa[m][ks], b_lo);
          mma_bf16_16816(acc[m][2 * np + 1], qa[m][ks], b_hi);
        }
      }
    }
    if constexpr (kLse) {
      // Online (max, sum) of this lane's 16 columns of each row in this 64-key step.
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int m = r / 2, h = r % 2;
        float step_max = kNegInf;
#pragma unroll
        for (int n = 0; n < 8; ++n)
          step_max = fmaxf(step_max, fmaxf(acc[m][n][2 * h], acc[m][n][2 * h + 1]));
        const float new_max = fmaxf(row_max[r], step_max);
        const float shift = new_max * scale_log2;
        // The first step has no previous sum (and -inf * scale must not meet a 0 sum).
        float sum = row_max[r] == kNegInf ? 0.0f
                                          : row_sum[r] * index_exp2(fmaf(row_max[r], scale_log2, -shift));
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          sum += index_exp2(fmaf(acc[m][n][2 * h], scale_log2, -shift));
          sum += index_exp2(fmaf(acc[m][n][2 * h + 1], scale_log2, -shift));
        }
        row_max[r] = new_max;
        row_sum[r] = sum;
      }
    } else {
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          row_max[2 * m] = fmaxf(row_max[2 * m], fmaxf(acc[m][n][0], acc[m][n][1]));
          row_max[2 * m + 1] = fmaxf(row_max[2 * m + 1], fmaxf(acc[m][n][2], acc[m][n][3]));
        }
    }
  }
  // Quad reduce-scatter: 4 values per lane -> lane `quad` keeps the quad's max of value
  // `quad`. Step 1 (partner quad ^ 2): keep the pair {2p, 2p+1}, p = quad >> 1, send the
  // other pair. Step 2 (partner quad ^ 1): keep element quad & 1 of the pair.
  const int quad = lane % 4;
  const bool upper = quad >> 1, odd = quad & 1;
  if constexpr (kLse) {
    // The same exchange on (max, sum) pairs.
    float w_max[2], w_sum[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float sent_max = upper ? row_max[j] : row_max[2 + j];
      const float sent_sum = upper ? row_sum[j] : row_sum[2 + j];
      w_max[j] = upper ? row_max[2 + j] : row_max[j];
      w_sum[j] = upper ? row_sum[2 + j] : row_sum[j];
      merge_max_sum(w_max[j], w_sum[j], __shfl_xor_sync(0xffffffffu, sent_max, 2),
                    __shfl_xor_sync(0xffffffffu, sent_sum, 2), scale_log2);
    }
    BlockStats stats{odd ? w_max[1] : w_max[0], odd ? w_sum[1] : w_sum[0]};
    merge_max_sum(stats.max, stats.sumexp,
                  __shfl_xor_sync(0xffffffffu, odd ? w_max[0] : w_max[1], 1),
                  __shfl_xor_sync(0xffffffffu, odd ? w_sum[0] : w_sum[1], 1), scale_log2);
    return stats;
  } else {
    const float w0 = fmaxf(upper ? row_max[2] : row_max[0],
                           __shfl_xor_sync(0xffffffffu, upper ? row_max[0] : row_max[2], 2));
    const float w1 = fmaxf(upper ? row_max[3] : row_max[1],
                           __shfl_xor_sync(0xffffffffu, upper ? row_max[1] : row_max[3], 2));
    return {fmaxf(odd ? w1 : w0, __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 1)), 0.0f};
  }
}

// LSE (natural log) of the ranked blocks in a training-variant list: with M the largest
// block max (the list's first entry), logit_scale M + log(sum_b sumexp_b exp(logit_scale
// (max_b - M))); -inf for an empty list.
__device__ __forceinline__ float ranked_blocks_lse(const TopList& list, float logit_scale,
                                                   float scale_log2) {
  if (list.count == 0) return kNegInf;
  const float top = list.values[0];
  float total = 0.0f;
  for (int i = 0; i < list.count; ++i)
    total += list.payload[i] * index_exp2((list.values[i] - top) * scale_log2);
  return logit_scale * top + logf(total);
}

// grid = (tile bound, chunks): blockIdx.x -> tile (longest first), blockIdx.y -> chunk.
// kLse (fused mode only, p.lse_out set, logit_scale > 0): also the ranked blocks' LSE.
template <int kDi, bool kLse>
__global__ void __launch_bounds__(TileScanTraits<kDi>::kThreads, 1)
    tile_scan_kernel(const IndexerLaunch p, const TileScanPlan plan) {
  using T = TileScanTraits<kDi>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* list_values = reinterpret_cast<float*>(smem + T::kPipelineBytes);
  int32_t* list_ids = reinterpret_cast<int32_t*>(list_values + T::kRows * plan.list_pitch);
  float* list_sumexp = reinterpret_cast<float*>(list_ids + T::kRows * plan.list_pitch);  // kLse

  const TileGeometry tile = tile_geometry(p, plan);
  if (!tile.valid) return;  // uniform over the CTA: before any barrier
  const int64_t seq = tile.seq, first_query = tile.first_query, first_pos = tile.first_pos;
  const int n_rows = tile.n_rows, heads = static_cast<int>(p.heads), block_size = p.block_size;
  const bool fused = plan.block_max == nullptr;
  const int32_t scan_begin = tile.scan_begin, scan_end = tile.scan_end;
  const int n_blocks = max(0, scan_end - scan_begin);

  // ---- this thread: MMA fragment coordinates and the row it owns after the reduce.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int warp_row0 = warp * T::kRowsPerWarp;
  const bool warp_active = warp_row0 < n_rows;  // warp-uniform
  const int own_row = warp_row0 + (quad >> 1) * 16 + group + 8 * (quad & 1);
  const bool own_valid = own_row < n_rows;
  const int64_t own_query = first_query + own_row / heads;
  const int own_head = own_row % heads;
  const int32_t own_block = static_cast<int32_t>((first_pos + own_row / heads) / block_size);
  // Rows of another pass (split mode) offer nothing.
  const int32_t own_cand_end = own_valid && own_row >= tile.row_lo && own_row < tile.row_hi
                                   ? own_block - p.local_blocks + 1
                                   : INT_MIN;
  TopList list;
  list.init(list_values + own_row * plan.list_pitch, list_ids + own_row * plan.list_pitch,
            plan.ranked, kLse ? list_sumexp + own_row * plan.list_pitch : nullptr);

  // ---- A fragments of the warp's 32 rows (zeros past the tile): a0/a1 rows group and
  // group + 8 at k = 2 * quad, a2/a3 the same rows at k + 8 (PTX mma.m16n8k16 layout).
  uint32_t qa[2][T::kKSteps][4];
  const uint16_t* tile_q = p.qi + first_query * p.heads * kDi;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + m * 16 + group + 8 * h;
      const uint32_t* q_row = reinterpret_cast<const uint32_t*>(tile_q + int64_t{row} * kDi);
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks) {
        qa[m][ks][h] = row < n_rows ? q_row[ks * 8 + quad] : 0u;
        qa[m][ks][2 + h] = row < n_rows ? q_row[ks * 8 + 4 + quad] : 0u;
      }
    }

  // ---- K ring: block scan_begin + i lives in stage i % kStages.
  const auto load_block = [&](int i) {
    const uint16_t* src = block_pointer(p.ki, seq, scan_begin + i, 0);
    uint16_t* dst = ring + (i % T::kStages) * T::kStageElems;
    constexpr int kChunksPerKey = kDi / 8;  // 16-byte copies per key
    for (int c = threadIdx.x; c < block_size * kChunksPerKey; c += T::kThreads) {
      const int key = c / kChunksPerKey, part = c % kChunksPerKey;
      cp_async_16(dst + key * T::kKeyPitch + part * 8, src + key * p.ki.token_stride + part * 8);
    }
  };
#pragma unroll
  for (int i = 0; i < T::kStages - 1; ++i) {
    if (i < n_blocks) load_block(i);
    cp_async_commit();  // always commit: the wait below counts groups
  }
  for (int i = 0; i < n_blocks; ++i) {
    cp_async_wait<T::kStages - 2>();
    // Block i has landed for every thread's copies, and every warp is done with block
    // i - 1, whose stage the load below overwrites.
    __syncthreads();
    if (i + T::kStages - 1 < n_blocks) load_block(i + T::kStages - 1);
    cp_async_commit();
    if (!warp_active) continue;
    const BlockStats stats = warp_block_stats<kDi, kLse>(
        qa, ring + (i % T::kStages) * T::kStageElems, block_size, plan.logit_scale_log2);
    const int32_t block = scan_begin + i;
    if (own_valid && block < own_cand_end) {
      if (fused)
        list.offer<kLse>(stats.max, block, stats.sumexp);
      else
        plan.block_max[(tile.maxima_row0 + own_row) * plan.block_max_stride + block] = stats.max;
    }
  }

  if (!fused || !own_valid) return;
  int32_t* out = p.topk_out + (own_head * p.batch.total_q + own_query) * p.topk;
  for (int slot = 0; slot < p.topk; ++slot)
    out[slot] = selection_slot(slot, p, own_block, list.ids, list.count);
  // Every row of the tile is owned by one lane: each row's partial LSE is written (-inf
  // without ranked blocks), for selected_lse_kernel's forced-only pass to merge into.
  if constexpr (kLse)
    p.lse_out[own_head * p.batch.total_q + own_query] =
        ranked_blocks_lse(list, p.logit_scale, plan.logit_scale_log2);
}

}  // namespace msa::cuda::indexer_detail
