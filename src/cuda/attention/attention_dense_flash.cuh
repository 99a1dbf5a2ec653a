// Dense GQA attention (topk == null), FA2-style with mma.sync, forward: causal, or
// bidirectional (DenseArgs::causal false: every row at its sequence's last key, DenseTile).
// D = 64, 80 (the vision tower's: 5 k-steps of 16, 10 n-tiles of 8) or 128.
//
// Tile plan (attention_dense_tiles.cuh, shared with the dense dQ kernel): a CTA (4 warps, 128
// threads) owns 64 rows = (query, head) pairs of one KV group of one sequence, flattened
// query-major (row m -> query m / G, head m % G): 4 queries x 16 heads for M3, 64 queries for
// G = 1, no padding for any G. Each warp owns 16 rows and keeps Q in registers as A
// fragments. The CTA walks 64-key tiles 0 .. (last row's pos) / 64 with a two-stage cp.async
// pipeline (K and V of tile t+1 load while tile t computes), an online softmax per row
// (attention_block_tile.cuh), the causal mask only on tiles that cross a warp's first
// position, and skips tiles past a warp's last position. O and LSE are written directly (no
// partials). A 64-key tile never straddles a KV block (B = 64 or 128), so paged and varlen
// layouts are addressed per tile via block_pointer.
// Shared memory: 2 stages x (K + V) x 64 x (D + 8) x 2 bytes = 69,632 (D = 128), 45,056 (80),
// 36,864 (64).
// Registers: Q 32 + S 32 + O 64 + state (D = 128). Expected bottleneck: MMA issue rate and
// the K/V reloads from L2 (only 64 rows share each K/V tile).
#pragma once
#include "cuda/attention/attention_dense_tiles.cuh"

namespace msa::cuda::attn {

template <int D>
__host__ __device__ constexpr size_t dense_smem_bytes() {
  return static_cast<size_t>(kDenseStages) * 2 * kKeyTile * smem_pitch<D>() * sizeof(uint16_t);
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
  bool causal;  // false: bidirectional (DenseTile::row_pos)
  void* o;     // [total_q, q_heads, D], f32 or bf16 (o_bf16)
  bool o_bf16;
  float* lse;  // [total_q, q_heads]
};

template <int D>
__global__ void __launch_bounds__(kDenseThreads)
    dense_flash_kernel(const __grid_constant__ DenseArgs a) {
  extern __shared__ uint4 smem_raw[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);

  const int G = static_cast<int>(a.group);
  const DenseTile tile = dense_tile(a.tile_start, a.batch, a.q_start, a.k_len, G, kDenseRows, a.causal);
  if (!tile.valid) return;
  const int64_t g = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const DenseWarpRows w = dense_warp_rows(tile, warp, G);
  DenseRow row[2];
  const uint16_t* q_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row[r] = dense_row(tile, w, lane, r, G, a.q_heads, g);
    q_row[r] = row[r].valid ? a.q + row[r].index * D : nullptr;
  }

  const DenseKvStages<D> kv{a.k, a.v, smem, tile.seq, g, tile.k_len};
  kv.load(0);
  cp_async_commit();

  uint32_t qf[D / 16][4];
  load_q_fragments<D>(qf, q_row[0], q_row[1]);
  WarpRowsState<D> state;
  state.init();

  kv.for_each_tile(tile.last_pos, w, [&](const uint16_t* k_tile, const uint16_t* v_tile, int64_t first_key) {
    if (first_key + kKeyTile - 1 > w.min_pos)
      state.template attend<true>(qf, k_tile, v_tile, a.scale_log2, tile_limit(row[0].pos, first_key),
                                  tile_limit(row[1].pos, first_key));
    else
      state.template attend<false>(qf, k_tile, v_tile, a.scale_log2, kKeyTile, kKeyTile);
  });

  float inv[2], lse2[2];
  state.finish(inv, lse2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row[r].valid) continue;
    state.store_output_row(a.o, a.o_bf16, row[r].index * D, r, inv[r]);
    if (lane % 4 == 0) a.lse[row[r].index] = lse2[r] * kLn2;
  }
}

}  // namespace msa::cuda::attn
