// Dense causal GQA attention (topk == null), FA2-style with mma.sync, forward.
//
// Tile plan: a CTA (4 warps, 128 threads) owns 64 rows = (query, head) pairs of one KV group
// of one sequence, flattened query-major (row m -> query m / G, head m % G): 4 queries x 16
// heads for M3, 64 queries for G = 1, no padding for any G. Each warp owns 16 rows and keeps
// Q in registers as A fragments. The CTA walks 64-key tiles 0 .. (last row's pos) / 64 with a
// two-stage cp.async pipeline (K and V of tile t+1 load while tile t computes), an online
// softmax per row (attention_block_tile.cuh), the causal mask only on tiles that cross a
// warp's first position, and skips tiles past a warp's last position. O and LSE are written
// directly (no partials). A 64-key tile never straddles a KV block (B = 64 or 128), so paged
// and varlen layouts are addressed per tile via block_pointer.
// Scheduling: dense_tile_plan (one CTA) turns q_len into per-sequence tile offsets; grid.x is
// a host-side upper bound (total_q * G / 64 + batch), extra CTAs exit. Within a sequence
// the last (longest) tiles get the lowest CTA ids.
// Shared memory: 2 stages x (K + V) x 64 x (D + 8) x 2 bytes = 69,632 (D = 128), 36,864 (64).
// Registers: Q 32 + S 32 + O 64 + state (D = 128). Expected bottleneck: MMA issue rate and
// the K/V reloads from L2 (only 64 rows share each K/V tile).
#pragma once
#include <cub/block/block_scan.cuh>

#include "attention_block_tile.cuh"
#include "cuda/launch.h"

namespace msa::cuda::attn {

constexpr int kDenseWarps = 4;
constexpr int kDenseThreads = kDenseWarps * 32;
constexpr int kDenseRows = kDenseWarps * kWarpRows;  // rows per CTA
constexpr int kDenseStages = 2;
constexpr int kPlanThreads = 256;

template <int D>
__host__ __device__ constexpr size_t dense_smem_bytes() {
  return static_cast<size_t>(kDenseStages) * 2 * kKeyTile * smem_pitch<D>() * sizeof(uint16_t);
}

// tile_start[b] = first tile of sequence b, tile_start[batch] = total tiles. `static`: the
// backward (attention_backward.cu) includes this header too.
static __global__ void __launch_bounds__(kPlanThreads)
    dense_tile_plan(const int64_t* q_start, int64_t batch, int64_t group, int64_t* tile_start) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < batch; base += kPlanThreads) {
    const int64_t b = base + threadIdx.x;
    const int64_t tiles =
        b < batch ? ((q_start[b + 1] - q_start[b]) * group + kDenseRows - 1) / kDenseRows : 0;
    int64_t before = 0, total = 0;
    Scan(temp).ExclusiveSum(tiles, before, total);
    if (b < batch) tile_start[b] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[batch] = carry;
}

struct DenseArgs {
  const uint16_t* q;  // [total_q, q_heads, D]
  KeyLayout k, v;
  int64_t q_heads, kv_heads, group;
  const int64_t* q_start;
  const int64_t* k_len;
  int64_t batch;
  const int64_t* tile_start;  // [batch + 1]
  float scale_log2;
  float* o;    // [total_q, q_heads, D]
  float* lse;  // [total_q, q_heads]
};

template <int D>
__device__ __forceinline__ void load_kv_tile(const DenseArgs& a, uint16_t* k_dst, uint16_t* v_dst,
                                             int64_t seq, int64_t g, int64_t tile, int64_t k_len) {
  const int64_t first_key = tile * kKeyTile;
  const int64_t block = first_key / a.k.block_size, in_block = first_key % a.k.block_size;
  const int64_t left = k_len - first_key;
  const int valid = static_cast<int>(left < kKeyTile ? left : kKeyTile);
  load_rows_async<D, kDenseThreads>(k_dst, block_pointer(a.k, seq, block, g) + in_block * a.k.token_stride,
                                    a.k.token_stride, kKeyTile, valid);
  load_rows_async<D, kDenseThreads>(v_dst, block_pointer(a.v, seq, block, g) + in_block * a.v.token_stride,
                                    a.v.token_stride, kKeyTile, valid);
}

template <int D>
__global__ void __launch_bounds__(kDenseThreads)
    dense_flash_kernel(const __grid_constant__ DenseArgs a) {
  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  constexpr int kStageElems = 2 * kKeyTile * kPitch;  // K then V
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);

  const int64_t tile_id = blockIdx.x;
  if (tile_id >= a.tile_start[a.batch]) return;
  // Sequence: last b with tile_start[b] <= tile_id (empty sequences have equal starts).
  int64_t lo = 0, hi = a.batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (a.tile_start[mid] <= tile_id)
      lo = mid;
    else
      hi = mid;
  }
  const int64_t seq = lo;
  const int64_t tile = a.tile_start[seq + 1] - 1 - tile_id;  // longest tile first
  const int64_t g = blockIdx.y;
  const int G = static_cast<int>(a.group);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const int64_t first_q = a.q_start[seq];
  const int64_t q_len = a.q_start[seq + 1] - first_q;
  const int64_t k_len = a.k_len[seq];
  const int64_t pos0 = k_len - q_len;  // position of the sequence's first query
  const int64_t rows = q_len * G;
  const int64_t cta_first_row = tile * kDenseRows;
  const int64_t cta_last_row = (cta_first_row + kDenseRows < rows ? cta_first_row + kDenseRows : rows) - 1;
  const int64_t last_pos = pos0 + cta_last_row / G;

  // The warp's rows; padding rows mirror the CTA's last row (never stored).
  const int64_t warp_first_row = cta_first_row + warp * kWarpRows;
  const bool warp_active = warp_first_row <= cta_last_row;
  const int64_t warp_last_row =
      warp_first_row + kWarpRows - 1 < cta_last_row ? warp_first_row + kWarpRows - 1 : cta_last_row;
  const int64_t warp_min_pos = pos0 + (warp_active ? warp_first_row : cta_last_row) / G;
  const int64_t warp_max_pos = pos0 + (warp_active ? warp_last_row : cta_last_row) / G;
  bool valid[2];
  int64_t pos[2], out_row[2];
  const uint16_t* q_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t m = warp_first_row + lane / 4 + 8 * r;
    valid[r] = m <= cta_last_row;
    const int64_t mm = valid[r] ? m : cta_last_row;
    pos[r] = pos0 + mm / G;
    out_row[r] = (first_q + mm / G) * a.q_heads + g * G + mm % G;  // [q][head] index
    q_row[r] = valid[r] ? a.q + out_row[r] * D : nullptr;
  }

  const int64_t n_tiles = last_pos / kKeyTile + 1;
  load_kv_tile<D>(a, smem, smem + kKeyTile * kPitch, seq, g, 0, k_len);
  cp_async_commit();

  uint32_t qf[D / 16][4];
  load_q_fragments<D>(qf, q_row[0], q_row[1]);
  WarpRowsState<D> state;
  state.init();

  for (int64_t t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) {
      uint16_t* next = smem + ((t + 1) % kDenseStages) * kStageElems;
      load_kv_tile<D>(a, next, next + kKeyTile * kPitch, seq, g, t + 1, k_len);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* k_tile = smem + (t % kDenseStages) * kStageElems;
    const uint16_t* v_tile = k_tile + kKeyTile * kPitch;
    const int64_t first_key = t * kKeyTile;
    if (warp_active && first_key <= warp_max_pos) {  // warp-uniform
      if (first_key + kKeyTile - 1 > warp_min_pos)
        state.template attend<true>(qf, k_tile, v_tile, a.scale_log2, tile_limit(pos[0], first_key),
                                    tile_limit(pos[1], first_key));
      else
        state.template attend<false>(qf, k_tile, v_tile, a.scale_log2, kKeyTile, kKeyTile);
    }
    __syncthreads();  // the stage is refilled by the next iteration's loads
  }

  float inv[2], lse2[2];
  state.finish(inv, lse2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    state.store_row(a.o + out_row[r] * D, r, inv[r]);
    if (lane % 4 == 0) a.lse[out_row[r]] = lse2[r] * kLn2;
  }
}

}  // namespace msa::cuda::attn
