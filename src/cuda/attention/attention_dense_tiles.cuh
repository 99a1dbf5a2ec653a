// Tile plan and K/V pipeline shared by the dense forward (attention_dense_flash.cuh) and the
// dense dQ kernel (attention_backward_dq.cuh).
//
// A CTA (4 warps) owns 64 rows = (query, head) pairs of one KV group (blockIdx.y) of one
// sequence, flattened query-major (row m -> query m / G, head m % G); each warp owns 16 rows.
// dense_tile_plan (one CTA) turns q_len into per-sequence tile offsets; grid.x is a host-side
// upper bound (total_q * G / 64 + batch), extra CTAs exit. Within a sequence the last
// (longest) tiles get the lowest CTA ids. The CTA walks 64-key tiles 0 .. (last row's pos) /
// 64 with a two-stage cp.async pipeline (K and V of tile t+1 load while tile t computes).
#pragma once
#include <cub/block/block_scan.cuh>

#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/launch.h"

namespace msa::cuda::attn {

constexpr int kDenseWarps = 4;
constexpr int kDenseThreads = kDenseWarps * 32;
constexpr int kDenseRows = kDenseWarps * kWarpRows;  // rows per CTA
constexpr int kDenseStages = 2;
constexpr int kPlanThreads = 256;

// tile_start[b] = first tile of sequence b, tile_start[batch] = total tiles. `static`: both
// attention.cu and attention_backward.cu include this header. rows_per_tile: kDenseRows, or
// the wgmma dense kernel's 128 (attention_dense_wgmma.cuh).
static __global__ void __launch_bounds__(kPlanThreads)
    dense_tile_plan(const int64_t* q_start, int64_t batch, int64_t group, int64_t* tile_start,
                    int rows_per_tile = kDenseRows) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < batch; base += kPlanThreads) {
    const int64_t b = base + threadIdx.x;
    const int64_t tiles =
        b < batch ? ((q_start[b + 1] - q_start[b]) * group + rows_per_tile - 1) / rows_per_tile : 0;
    int64_t before = 0, total = 0;
    Scan(temp).ExclusiveSum(tiles, before, total);
    if (b < batch) tile_start[b] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[batch] = carry;
}

// The CTA's tile (blockIdx.x through tile_start) and its sequence. Causal rows sit at
// pos0 + m / G; bidirectional rows (causal = false) all sit at the sequence's last key, so
// that every kernel's causal mask and key-tile bound become the k_len bound.
struct DenseTile {
  bool valid;         // false: an extra CTA of the host-side grid bound
  int64_t seq;
  int64_t first_q;    // the sequence's first query row
  int64_t k_len;
  int64_t pos0;       // position of the sequence's first query
  int64_t first_row;  // the CTA's rows: first_row .. last_row
  int64_t last_row;
  int64_t last_pos;   // position of the last row's query
  bool causal;

  // The last key position row m of the sequence attends to.
  __device__ __forceinline__ int64_t row_pos(int64_t m, int G) const { return causal ? pos0 + m / G : k_len - 1; }
};

__device__ __forceinline__ DenseTile dense_tile(const int64_t* tile_start, int64_t batch,
                                                const int64_t* q_start, const int64_t* k_lens, int G,
                                                int rows_per_tile = kDenseRows, bool causal = true) {
  DenseTile t{};
  t.causal = causal;
  const int64_t tile_id = blockIdx.x;
  t.valid = tile_id < tile_start[batch];
  if (!t.valid) return t;
  // Sequence: last b with tile_start[b] <= tile_id (empty sequences have equal starts).
  int64_t lo = 0, hi = batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (tile_start[mid] <= tile_id)
      lo = mid;
    else
      hi = mid;
  }
  t.seq = lo;
  const int64_t tile = tile_start[t.seq + 1] - 1 - tile_id;  // longest tile first
  t.first_q = q_start[t.seq];
  const int64_t q_len = q_start[t.seq + 1] - t.first_q;
  t.k_len = k_lens[t.seq];
  t.pos0 = t.k_len - q_len;
  const int64_t rows = q_len * G;
  t.first_row = tile * rows_per_tile;
  t.last_row = (t.first_row + rows_per_tile < rows ? t.first_row + rows_per_tile : rows) - 1;
  t.last_pos = t.row_pos(t.last_row, G);
  return t;
}

// [query][head] index (in q, o, lse, ...) of row m of the sequence's rows of KV group g.
__device__ __forceinline__ int64_t dense_row_index(const DenseTile& t, int64_t m, int G, int64_t q_heads,
                                                   int64_t g) {
  return (t.first_q + m / G) * q_heads + g * G + m % G;
}

// The warp's 16 rows of the tile; padding rows mirror the CTA's last row (never stored).
struct DenseWarpRows {
  int64_t first_row;
  bool active;      // the warp has a row of the tile (warp-uniform)
  int64_t min_pos;  // positions of its first and last rows
  int64_t max_pos;
};

__device__ __forceinline__ DenseWarpRows dense_warp_rows(const DenseTile& t, int warp, int G) {
  DenseWarpRows w;
  w.first_row = t.first_row + warp * kWarpRows;
  w.active = w.first_row <= t.last_row;
  const int64_t last_row = w.first_row + kWarpRows - 1 < t.last_row ? w.first_row + kWarpRows - 1 : t.last_row;
  w.min_pos = t.row_pos(w.active ? w.first_row : t.last_row, G);
  w.max_pos = t.row_pos(w.active ? last_row : t.last_row, G);
  return w;
}

// Row r of the lane (MMA row lane / 4 + 8 r of the warp's 16).
struct DenseRow {
  bool valid;     // a row of the tile (else padding, computed as the tile's last row)
  int64_t pos;    // its query's position
  int64_t index;  // dense_row_index
};

__device__ __forceinline__ DenseRow dense_row(const DenseTile& t, const DenseWarpRows& w, int lane, int r, int G,
                                              int64_t q_heads, int64_t g) {
  const int64_t m = w.first_row + lane / 4 + 8 * r;
  DenseRow row;
  row.valid = m <= t.last_row;
  const int64_t mm = row.valid ? m : t.last_row;
  row.pos = t.row_pos(mm, G);
  row.index = dense_row_index(t, mm, G, q_heads, g);
  return row;
}

// The K/V stages: kDenseStages x (K, V) x 64 rows at pitch D + 8; key tile t uses stage
// t % kDenseStages.
template <int D>
struct DenseKvStages {
  static constexpr int kPitch = smem_pitch<D>();
  static constexpr int kStageElems = 2 * kKeyTile * kPitch;  // K then V

  const KeyLayout& k;
  const KeyLayout& v;
  uint16_t* smem;
  int64_t seq, g, k_len;

  __device__ __forceinline__ uint16_t* keys(int64_t tile) const {
    return smem + (tile % kDenseStages) * kStageElems;
  }
  __device__ __forceinline__ uint16_t* values(int64_t tile) const { return keys(tile) + kKeyTile * kPitch; }

  // K and V of key tile `tile` (64 keys; a tile never straddles a block) into its stage;
  // every thread, the caller commits.
  __device__ __forceinline__ void load(int64_t tile) const {
    uint16_t* k_dst = keys(tile);
    uint16_t* v_dst = k_dst + kKeyTile * kPitch;
    const int64_t first_key = tile * kKeyTile;
    const int64_t block = first_key / k.block_size, in_block = first_key % k.block_size;
    const int64_t left = k_len - first_key;
    const int valid = static_cast<int>(left < kKeyTile ? left : kKeyTile);
    load_rows_async<D, kDenseThreads>(k_dst, block_pointer(k, seq, block, g) + in_block * k.token_stride,
                                      k.token_stride, kKeyTile, valid);
    load_rows_async<D, kDenseThreads>(v_dst, block_pointer(v, seq, block, g) + in_block * v.token_stride,
                                      v.token_stride, kKeyTile, valid);
  }

  // The key-tile loop of the dense kernels: tiles 0 .. last_pos / 64, tile t + 1 loading into
  // the other stage while tile t computes (the caller issued and committed tile 0's loads);
  // visit(k_tile, v_tile, first_key) runs for the tiles at or before the warp's last
  // position (warp-uniform). Every thread of the CTA calls this.
  template <class Visit>
  __device__ __forceinline__ void for_each_tile(int64_t last_pos, const DenseWarpRows& w, Visit&& visit) const {
    const int64_t n_tiles = last_pos / kKeyTile + 1;
    for (int64_t t = 0; t < n_tiles; ++t) {
      if (t + 1 < n_tiles) {
        load(t + 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const int64_t first_key = t * kKeyTile;
      if (w.active && first_key <= w.max_pos) visit(keys(t), values(t), first_key);
      __syncthreads();  // the stage is refilled by the next iteration's loads
    }
  }
};

}  // namespace msa::cuda::attn
