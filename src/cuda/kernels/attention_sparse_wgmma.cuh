// Sparse attention, KV-block-major, forward on Hopper warpgroup MMA (wgmma) for D = B = 128.
//
// Same plan, work items and partial outputs as sparse_kv_major_kernel
// (attention_sparse_kv_major.cuh: sorted selection keys -> items of one (group, block,
// sequence) and up to 1024 rows; attention_merge.cuh combines the partials); only the tile
// engine differs. The mma.sync kernel gives each warp 16 rows (one query's 16 heads), runs 8
// warps per SM and is latency bound (Nsight Compute, 32K prefill: issue slots 42% busy,
// tensor pipe 28%). Here an m-tile is 64 rows (4 queries x 16 heads for M3) and one
// warpgroup runs it as two wgmma chains:
//   S = Q K^T   8 x m64n128k16, Q and K from shared memory (128B-swizzled K-major tiles);
//   softmax     in registers: mask keys after the row's position, row max / sum over the
//               block's 128 keys (one block per entry: no online rescaling), P = 2^(S - m);
//   O = P V     8 x m64n128k16, P from registers (the S accumulator layout is the A fragment
//               layout), V [keys x D] from shared memory read transposed (MN-major).
// CTA: two warpgroups (256 threads), one CTA per SM, persistent over items. The item's K and
// V (2 x 32 KB) are double buffered across items (cp.async by all threads); each warpgroup
// gathers its next m-tile's 64 Q rows (16 KB, cp.async) while it computes the current one,
// and the two warpgroups' MMA and softmax phases interleave on the SM's tensor and ALU pipes.
// Shared memory: 1 KB alignment + 2 x 64 KB K/V + 2 warpgroups x (2 x 16 KB Q + 3 x 1,280 B
// row tables) = 205,312 B.
// Each tile's rows are decoded once into a shared-memory row table (Q row, partial row,
// visible key limit), O / l is staged through the consumed Q tile for 16-byte stores, and the
// softmax uses ex2.approx with the scale folded into one FMA.
// Measured on the H200 (M3 shape, one sequence, indexer selections; bench/results/
// 2026-11-29-h200-round5.md): 32K 12.11 ms = 171 TFLOP/s, 128K 49.16 ms = 172 TFLOP/s, 1M
// 414.7 ms, against the mma.sync kernel's 14.21 / 58.04 ms in the same session. The default
// for D = B = 128 since then (MSA_SPARSE_WGMMA=0 selects the mma.sync kernel); both are tested
// (GpuSparseWgmma) and compute-sanitizer clean on the small cases. A first version without the
// row table and staged stores took 66.1 ms at 128K (Nsight Compute: 33% issue-slot use, 0.44
// eligible warps per scheduler, 30% excess global sectors). Next steps (22% of the matmul
// peak today): overlap S of tile i+1 with the softmax of tile i, and a producer warp with TMA
// for K/V.
#pragma once
#include "attention_sparse_kv_major.cuh"
#include "wgmma.cuh"

namespace msa::cuda::attn {

struct SparseWgmmaTraits {
  static constexpr int kD = 128, kB = 128;
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kTileRows = 64;  // rows of one warpgroup m-tile
  static constexpr int kKeyBytes = kB * kD * 2;         // one K (or V) block: 32 KB
  static constexpr int kQBytes = kTileRows * kD * 2;    // one Q tile: 16 KB
  static constexpr size_t kRowTableBytes = kTileRows * (8 + 8 + 4);
  // 1 KB alignment, K/V double buffer, 2 Q slots and 3 row tables per warpgroup.
  static constexpr size_t kSmemBytes =
      1024 + 2 * 2 * size_t{kKeyBytes} + 2 * 2 * size_t{kQBytes} + 2 * 3 * kRowTableBytes;
};

// K and V of the item's block into one buffer in the swizzled layout (rows past the
// sequence end zero-filled; their scores are masked anyway).
__device__ __forceinline__ void load_item_kv_swizzled(const SparseArgs& a, const ItemInfo& info,
                                                      unsigned char* k_dst, unsigned char* v_dst) {
  using T = SparseWgmmaTraits;
  const int64_t keys_left = a.k_len[info.seq] - info.block * T::kB;
  const int valid_rows = static_cast<int>(keys_left < T::kB ? keys_left : T::kB);
  const uint16_t* k_src = block_pointer(a.k, info.seq, info.block, info.g);
  const uint16_t* v_src = block_pointer(a.v, info.seq, info.block, info.g);
  for (int i = threadIdx.x; i < T::kB * 16; i += T::kThreads) {
    const int row = i / 16, chunk = i % 16;
    const bool valid = row < valid_rows;
    const uint32_t at = swizzled_offset(row, chunk, T::kB);
    cp_async_16(k_dst + at, valid ? k_src + row * a.k.token_stride + chunk * 8 : k_src, valid);
    cp_async_16(v_dst + at, valid ? v_src + row * a.v.token_stride + chunk * 8 : v_src, valid);
  }
}

// What a tile needs to know about each of its 64 rows, decoded once (row m of the item is
// entry m / G, head m % G): where its Q row is, where its partial goes (-1: padding row),
// and the last key column of the block it may see.
struct TileRows {
  int64_t q_offset[SparseWgmmaTraits::kTileRows];
  int64_t partial[SparseWgmmaTraits::kTileRows];
  int32_t limit[SparseWgmmaTraits::kTileRows];
};
static_assert(sizeof(TileRows) == SparseWgmmaTraits::kRowTableBytes);

__device__ __forceinline__ void warpgroup_barrier(int warpgroup) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(warpgroup + 1) : "memory");
}

// Decodes the rows [tile_row, tile_row + 64) of the item into `rows`, then the warpgroup
// gathers their Q rows into `dst` (zero rows past the item). Ends with a warpgroup barrier
// before the copies, so it also orders every earlier read of `rows` and `dst`.
__device__ __forceinline__ void prefetch_tile(const SparseArgs& a, const ItemInfo& info, int tile_row,
                                              int G, TileRows& rows, unsigned char* dst) {
  using T = SparseWgmmaTraits;
  const int wtid = threadIdx.x % 128;
  if (wtid < T::kTileRows) {
    const int m = tile_row + wtid;
    const bool valid = m < info.rows;
    const int mm = valid ? m : info.rows - 1;  // padding rows mirror the last row
    const Entry e = decode_entry(a, a.keys[info.first + mm / G], info.pos_offset);
    const int64_t limit = e.pos - info.block * T::kB;
    rows.limit[wtid] = static_cast<int32_t>(limit < T::kB ? limit : T::kB - 1);
    rows.q_offset[wtid] = valid ? (e.q * a.q_heads + info.g * G + mm % G) * T::kD : -1;
    rows.partial[wtid] =
        valid ? ((e.q - a.q_begin) * a.kv_heads + info.g) * a.slots * G + e.slot * G + mm % G : -1;
  }
  warpgroup_barrier(threadIdx.x / 128);
  const int chunk = wtid % 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = wtid / 16 + 8 * j;
    const int64_t offset = rows.q_offset[row];
    cp_async_16(dst + swizzled_offset(row, chunk, T::kTileRows), offset >= 0 ? a.q + offset + chunk * 8 : a.q,
                offset >= 0);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__global__ void __launch_bounds__(SparseWgmmaTraits::kThreads, 1)
    sparse_wgmma_kernel(const __grid_constant__ SparseArgs a) {
  using T = SparseWgmmaTraits;
  extern __shared__ uint4 smem_raw[];  // same declaration as the other kernels of this namespace
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* kv_smem = smem;  // [2 buffers][K, V] 32 KB each
  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  unsigned char* q_smem = smem + 4 * T::kKeyBytes + warpgroup * 2 * T::kQBytes;  // [2 slots]
  // Three row tables per warpgroup: the one being filled for the next tile was last read two
  // tiles ago, with a warpgroup barrier in between.
  TileRows* tables = reinterpret_cast<TileRows*>(smem + 4 * T::kKeyBytes + 4 * T::kQBytes) + warpgroup * 3;
  const int G = static_cast<int>(a.group);
  constexpr int kStride = 2 * T::kTileRows;  // rows between a warpgroup's m-tiles

  const unsigned n_items = *a.item_count;
  unsigned it = blockIdx.x;
  if (it >= n_items) return;

  // cp.async group order per thread (as in sparse_kv_major_kernel, the waits count on it):
  //   KV(item 0), Q(first tile of item 0) | per item j: KV(j + 1), [Q(first tile of j + 1)
  //   if the warpgroup has no tile in j], then per tile i: Q(tile i + 1 or first of j + 1).
  // Tile number t (per warpgroup) uses Q slot t % 2 and row table t % 3.
  int tile_seq = 0;
  ItemInfo cur = decode_item(a, it, G);
  load_item_kv_swizzled(a, cur, kv_smem, kv_smem + T::kKeyBytes);
  cp_async_commit();
  if (warpgroup * T::kTileRows < cur.rows)
    prefetch_tile(a, cur, warpgroup * T::kTileRows, G, tables[0], q_smem);
  cp_async_commit();
  cp_async_wait<1>();
  fence_async_shared();
  __syncthreads();

  int buf = 0;
  for (;;) {
    const unsigned next_it = it + gridDim.x;
    const bool has_next = next_it < n_items;
    ItemInfo nxt{};
    if (has_next) {
      nxt = decode_item(a, next_it, G);
      unsigned char* k_next = kv_smem + (1 - buf) * 2 * T::kKeyBytes;
      load_item_kv_swizzled(a, nxt, k_next, k_next + T::kKeyBytes);
    }
    cp_async_commit();
    const bool next_q = has_next && warpgroup * T::kTileRows < nxt.rows;
    if (warpgroup * T::kTileRows >= cur.rows) {  // no tile here: prefetch the next item's first
      if (next_q)
        prefetch_tile(a, nxt, warpgroup * T::kTileRows, G, tables[tile_seq % 3],
                      q_smem + (tile_seq % 2) * T::kQBytes);
      cp_async_commit();
    }

    const uint32_t k_addr = smem_address(kv_smem + buf * 2 * T::kKeyBytes);
    const uint32_t v_addr = k_addr + T::kKeyBytes;
    bool first_tile = true;
    for (int tile_row = warpgroup * T::kTileRows; tile_row < cur.rows; tile_row += kStride, ++tile_seq) {
      unsigned char* q_tile = q_smem + (tile_seq % 2) * T::kQBytes;
      unsigned char* q_next = q_smem + ((tile_seq + 1) % 2) * T::kQBytes;
      TileRows& next_rows = tables[(tile_seq + 1) % 3];
      if (tile_row + kStride < cur.rows)
        prefetch_tile(a, cur, tile_row + kStride, G, next_rows, q_next);
      else if (next_q)
        prefetch_tile(a, nxt, warpgroup * T::kTileRows, G, next_rows, q_next);
      cp_async_commit();

      if (first_tile)
        cp_async_wait<2>();  // pending: KV(next item), Q(next tile)
      else
        cp_async_wait<1>();  // pending: Q(next tile)
      first_tile = false;
      fence_async_shared();  // this thread's Q copies -> the async proxy
      warpgroup_barrier(warpgroup);

      // S = Q K^T
      const uint32_t q_addr = smem_address(q_tile);
      float s[64];
      wgmma_fence();
      wgmma_m64n128k128_ss(s, q_addr, T::kTileRows, k_addr, T::kB);
      wgmma_commit();

      // This thread's rows (warp w owns rows 16w..16w+15 of the accumulator).
      const TileRows& rows = tables[tile_seq % 3];
      const int row0 = warp * 16 + lane / 4;
      const int limit[2] = {rows.limit[row0], rows.limit[row0 + 8]};
      // Rows are ordered by query: the tile needs masks only where its first row does.
      const bool masked = rows.limit[0] < T::kB - 1;
      wgmma_wait<0>();
      fence_operands(s);

      // Softmax over the block's keys in the log2 domain; P packed as bf16 A fragments.
      float m[2] = {kNegInf, kNegInf};
      if (masked) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
          if (col > limit[(i % 4) / 2]) s[i] = kNegInf;
        }
      }
#pragma unroll
      for (int i = 0; i < 64; ++i) m[(i % 4) / 2] = fmaxf(m[(i % 4) / 2], s[i]);
      float l[2], m_scaled[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
        m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
        m_scaled[r] = m[r] == kNegInf ? 0.0f : m[r] * a.scale_log2;  // no visible key: p = 0
        l[r] = 0.0f;
      }
      uint32_t p[8][4];
#pragma unroll
      for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = j % 2;
          const float p0 = fast_exp2(fmaf(s[8 * k + 2 * j], a.scale_log2, -m_scaled[r]));
          const float p1 = fast_exp2(fmaf(s[8 * k + 2 * j + 1], a.scale_log2, -m_scaled[r]));
          l[r] += p0 + p1;
          p[k][j] = pack_bf16(p0, p1);
        }

      // O = P V
      float o[64];
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < T::kB / 16; ++k)
        wgmma_m64n128k16_rs_tb(o, p[k], wgmma_descriptor(v_addr + k * 16 * 128, T::kKeyBytes / 2, 1024),
                               k > 0);
      wgmma_commit();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
      }
      wgmma_wait<0>();
      fence_operands(o);

      // Partials: lse2 = m + log2 l, and O / l as bf16, staged in the consumed Q tile (each
      // warp its own 16 rows, swizzled) and written as 16-byte chunks of whole rows.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int64_t partial = rows.partial[row];
        if (lane % 4 == 0 && partial >= 0) a.partial_lse[partial] = l[r] > 0.0f ? m_scaled[r] + log2f(l[r]) : kNegInf;
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<uint32_t*>(q_tile + swizzled_offset(row, n, T::kTileRows) + 4 * (lane % 4)) =
              pack_bf16(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
      __syncwarp();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int row = warp * 16 + 2 * j + lane / 16, chunk = lane % 16;
        const int64_t partial = rows.partial[row];
        if (partial >= 0)
          *reinterpret_cast<uint4*>(a.partial_o + partial * T::kD + chunk * 8) =
              *reinterpret_cast<const uint4*>(q_tile + swizzled_offset(row, chunk, T::kTileRows));
      }
    }
    if (!has_next) break;
    cp_async_wait<1>();  // KV(next item) landed (only the warpgroup's next Q tile may be pending)
    fence_async_shared();
    __syncthreads();     // both warpgroups are done with `buf` and see the next K/V
    it = next_it;
    cur = nxt;
    buf ^= 1;
  }
  cp_async_wait<0>();
}

}  // namespace msa::cuda::attn
