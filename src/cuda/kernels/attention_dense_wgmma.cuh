// Dense causal GQA attention (topk == null), prefill forward on Hopper warpgroup MMA (wgmma),
// D = 128 only. The default for D = 128 (src/cuda/attention.cu; MSA_DENSE_WGMMA=0 selects the
// mma.sync kernel, attention_dense_flash.cuh). Measured on an H200 (round 7): 310-330 TFLOP/s
// at 8K-32K against the mma.sync kernel's 223 and cuDNN's 600-650.
//
// Rows: as the mma.sync kernel, a CTA owns rows = (query, head) pairs of one KV group
// (blockIdx.y) of one sequence, flattened query-major (row m -> query m / G, head m % G), but
// 128 of them (dense_tile_plan / dense_tile with rows_per_tile = 128): 8 queries x 16 heads
// for M3, 128 queries for G = 1. Why flattened rows rather than one head per CTA: every row
// of a 64-row tile is real work for any G in 1..16 (no padding heads), each K/V tile is
// shared by 128 rows whatever G is, and the causal diagonal of a CTA spans 128 / G query
// positions, so for M3 only the last key tile needs a mask. Two warpgroups, 64 rows each;
// warp w (0..7) owns rows 16 w .. 16 w + 15 (dense_warp_rows / dense_row with the CTA-wide
// warp index).
// Per 128-key tile, each warpgroup runs (as attention_sparse_wgmma.cuh, whose operand
// layouts and wgmma.cuh helpers this reuses):
//   S = Q K^T   8 x m64n128k16, Q and K from shared memory (128B-swizzled K-major tiles);
//   softmax     online, in registers: scale, causal mask (only on tiles past the warpgroup's
//               first position), row max over the tile, rescale O and l by 2^(m_old - m_new),
//               P = 2^(S - m) rounded to bf16 (the row sums use the f32 values);
//   O += P V    8 x m64n128k16, P from registers, V [keys x D] read MN-major.
// Each MMA chain is waited for before the code goes on (nothing in flight across the key
// loop's back edge: ptxas C7514); the two warpgroups' phases interleave on the SM's tensor
// and ALU pipes between the CTA barriers.
// Pipeline: three K/V stages; K/V of key tile t + 2 load (cp.async by all 256 threads,
// zero-filled past k_len) while tile t computes, so a tile's 64 KB has two tiles' time to
// arrive from L2. One CTA barrier per tile: after it, tile t has landed for everyone and
// every warpgroup is done with tile t - 1, whose stage takes tile t + 2. (M3 at 128 rows per
// CTA reads 64 KB of K/V per 8.4 MFLOP: ~128 FLOP per L2 byte, so the loads must stay well
// ahead.) A 128-key tile is one block (B = 128) or two (B = 64): each 64-key half is
// addressed through block_pointer once, so varlen and paged layouts work as in the mma.sync
// kernel.
// Registers: O 64 + S 64 + P 32 + row state; __launch_bounds__(256, 1).
// Shared memory: 1 KB alignment + 3 stages x (K + V) x 32 KB + 2 warpgroups x 16 KB Q
// = 230,400 B: one CTA (8 warps) per SM.
// Next steps if it misses the goal: a producer warp with TMA and mbarriers (the CTA barrier
// ties the warpgroups' phases together once per tile), S(t + 1) issued during softmax(t) as
// the sparse kernel does.
#pragma once
#include "attention_dense_flash.cuh"
#include "wgmma.cuh"

namespace msa::cuda::attn {

struct DenseWgmmaTraits {
  static constexpr int kD = 128;
  static constexpr int kKeys = 128;               // keys per tile
  static constexpr int kThreads = 256;            // two warpgroups
  static constexpr int kWarpgroupRows = 64;       // rows of one warpgroup's m-tile
  static constexpr int kRows = 2 * kWarpgroupRows;  // rows per CTA
  static constexpr int kStages = 3;
  static constexpr int kKvBytes = kKeys * kD * 2;           // one K (or V) tile: 32 KB
  static constexpr int kQBytes = kWarpgroupRows * kD * 2;   // one warpgroup's Q: 16 KB
  // 1 KB alignment, K/V stages, Q of both warpgroups.
  static constexpr size_t kSmemBytes = 1024 + kStages * 2 * size_t{kKvBytes} + 2 * size_t{kQBytes};
};
static_assert(DenseWgmmaTraits::kSmemBytes <= 227 * 1024, "one CTA per SM");
static_assert(DenseWgmmaTraits::kRows == (DenseWgmmaTraits::kThreads / 32) * kWarpRows,
              "dense_warp_rows with the CTA-wide warp index");

// K and V of key tile `tile` (keys 128 tile ..) into k_dst / v_dst in the swizzled layout;
// keys at or past k_len are zero-filled and not read. Every thread; the caller commits.
__device__ __forceinline__ void load_dense_kv_swizzled(const DenseArgs& a, int64_t seq, int64_t g,
                                                       int64_t k_len, int64_t tile, unsigned char* k_dst,
                                                       unsigned char* v_dst) {
  using T = DenseWgmmaTraits;
  const int64_t first_key = tile * T::kKeys;  // < k_len for every tile the kernel visits
  const uint16_t* k_half[2];
  const uint16_t* v_half[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // A half past the end needs only a valid address (nothing is read): the first half's,
    // and its page-table entry may not exist.
    const int64_t key = first_key + 64 * h < k_len ? first_key + 64 * h : first_key;
    const int64_t block = key / a.k.block_size, in_block = key % a.k.block_size;
    k_half[h] = block_pointer(a.k, seq, block, g) + in_block * a.k.token_stride;
    v_half[h] = block_pointer(a.v, seq, block, g) + in_block * a.v.token_stride;
  }
  const int chunk = threadIdx.x % 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = threadIdx.x / 16 + 16 * j;  // 0..127, half j / 4
    const int in_half = row % 64;
    const bool valid = first_key + row < k_len;
    const uint32_t at = swizzled_offset(row, chunk, T::kKeys);
    cp_async_16(k_dst + at, valid ? k_half[j / 4] + in_half * a.k.token_stride + chunk * 8 : k_half[0], valid);
    cp_async_16(v_dst + at, valid ? v_half[j / 4] + in_half * a.v.token_stride + chunk * 8 : v_half[0], valid);
  }
}

// Q of the warpgroup's 64 rows (CTA rows 64 wg ..) into `dst` in the swizzled layout; rows
// past the tile are zero-filled. The warpgroup's threads; the caller commits.
__device__ __forceinline__ void load_dense_q_swizzled(const DenseArgs& a, const DenseTile& t, int G, int64_t g,
                                                      int wg, unsigned char* dst) {
  using T = DenseWgmmaTraits;
  const int wtid = threadIdx.x % 128, chunk = wtid % 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = wtid / 16 + 8 * j;  // 0..63
    const int64_t m = t.first_row + wg * T::kWarpgroupRows + row;
    const bool valid = m <= t.last_row;
    const uint16_t* src = valid ? a.q + dense_row_index(t, m, G, a.q_heads, g) * T::kD + chunk * 8 : a.q;
    cp_async_16(dst + swizzled_offset(row, chunk, T::kWarpgroupRows), src, valid);
  }
}

// Last visible key of a row relative to a tile's first key, clamped to [-1, 127].
__device__ __forceinline__ int dense_wgmma_limit(int64_t pos, int64_t first_key) {
  const int64_t rel = pos - first_key;
  return static_cast<int>(rel < -1 ? -1 : (rel > DenseWgmmaTraits::kKeys - 1 ? DenseWgmmaTraits::kKeys - 1 : rel));
}

// Online-softmax state of one thread's two rows (lane / 4 and lane / 4 + 8 of its warp's 16)
// in the wgmma accumulator layout: o[4n + 2r + {0, 1}] is row r, columns 8n + 2 (lane % 4)
// + {0, 1}. m: running max of the scaled (log2-domain) logits; l: the lane's share of the
// running sum (quad-reduced at the end).
struct DenseWgmmaRows {
  float o[64];
  float m[2];
  float l[2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    m[0] = m[1] = kNegInf;
    l[0] = l[1] = 0.0f;
  }

  // One key tile: S = Q K^T (q_addr: the warpgroup's Q, k_addr / v_addr: the stage), the
  // online softmax, O += P V. With `masked`, key column c is visible to row r iff c <=
  // limit[r]. Warpgroup-uniform; returns with no MMA in flight.
  __device__ __forceinline__ void attend(uint32_t q_addr, uint32_t k_addr, uint32_t v_addr, float scale_log2,
                                         bool masked, const int (&limit)[2]) {
    using T = DenseWgmmaTraits;
    const int lane = threadIdx.x % 32;
    float s[64];
    wgmma_fence();
    wgmma_m64n128k128_ss(s, q_addr, T::kWarpgroupRows, k_addr, T::kKeys);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(s);

    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int r = (i % 4) / 2;
      float v = s[i] * scale_log2;
      if (masked) {
        const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
        if (col > limit[r]) v = kNegInf;
      }
      s[i] = v;
      tile_max[r] = fmaxf(tile_max[r], v);
    }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(tile_max[r]));
      m_use[r] = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: p = 0, no NaN
      alpha[r] = fast_exp2(m[r] - m_use[r]);       // 0 while m is -inf
      m[r] = m_new;
      l[r] *= alpha[r];
    }
    uint32_t p[8][4];  // P as bf16 A fragments, k step k = keys 16k .. 16k + 15
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = j % 2;
        const float p0 = fast_exp2(s[8 * k + 2 * j] - m_use[r]);
        const float p1 = fast_exp2(s[8 * k + 2 * j + 1] - m_use[r]);
        l[r] += p0 + p1;
        p[k][j] = pack_bf16(p0, p1);
      }
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= alpha[(i % 4) / 2];
    fence_operands(o);  // the rescale stays before the MMAs that accumulate into o

    wgmma_fence();
#pragma unroll
    for (int k = 0; k < T::kKeys / 16; ++k)
      wgmma_m64n128k16_rs_tb(o, p[k], wgmma_descriptor(v_addr + k * 16 * 128, T::kKvBytes / 2, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o);
  }

  // O / l as f32 and the natural-log LSE of row r, only where the row is part of the tile.
  __device__ __forceinline__ void store(const DenseArgs& a, const DenseRow (&row)[2]) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(l[r]);  // every lane: shuffles
      if (!row[r].valid) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      float* out = a.o + row[r].index * DenseWgmmaTraits::kD;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<float2*>(out + 8 * n + 2 * (lane % 4)) =
            make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      if (lane % 4 == 0) a.lse[row[r].index] = sum > 0.0f ? (m[r] + log2f(sum)) * kLn2 : kNegInf;
    }
  }
};

__global__ void __launch_bounds__(DenseWgmmaTraits::kThreads, 1)
    dense_wgmma_kernel(const __grid_constant__ DenseArgs a) {
  using T = DenseWgmmaTraits;
  extern __shared__ uint4 smem_raw[];  // same declaration as the other kernels of this namespace
  // Aligned by an offset from smem_raw, so that the pointers stay in the shared window.
  const uint32_t align_pad = (1024u - (smem_address(smem_raw) & 1023u)) & 1023u;
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw) + align_pad;  // [stage][K, V], Q[2]

  const int G = static_cast<int>(a.group);
  const DenseTile tile = dense_tile(a.tile_start, a.batch, a.q_start, a.k_len, G, T::kRows);
  if (!tile.valid) return;  // CTA-uniform
  const int64_t g = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;

  // The warpgroup's rows: which key tiles it visits, which need the causal mask.
  const int64_t wg_first = tile.first_row + wg * T::kWarpgroupRows;
  const bool wg_active = wg_first <= tile.last_row;
  const int64_t wg_last = wg_first + T::kWarpgroupRows - 1 < tile.last_row ? wg_first + T::kWarpgroupRows - 1
                                                                          : tile.last_row;
  const int64_t wg_min_pos = tile.pos0 + (wg_active ? wg_first : tile.last_row) / G;
  const int64_t wg_max_pos = tile.pos0 + (wg_active ? wg_last : tile.last_row) / G;

  const DenseWarpRows w = dense_warp_rows(tile, warp, G);
  DenseRow row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row[r] = dense_row(tile, w, lane, r, G, a.q_heads, g);

  unsigned char* q_smem = smem + T::kStages * 2 * T::kKvBytes + wg * T::kQBytes;
  const auto stage = [&](int64_t t) { return smem + (t % T::kStages) * 2 * T::kKvBytes; };
  // cp.async groups: {Q, K/V of tile 0}, {tile 1}, then one per tile t: {tile t + 2} (empty
  // past the last tile, so that "all but the newest group" is always tile t and older).
  const int64_t n_tiles = tile.last_pos / T::kKeys + 1;
  load_dense_q_swizzled(a, tile, G, g, wg, q_smem);
  load_dense_kv_swizzled(a, tile.seq, g, tile.k_len, 0, stage(0), stage(0) + T::kKvBytes);
  cp_async_commit();
  if (n_tiles > 1) load_dense_kv_swizzled(a, tile.seq, g, tile.k_len, 1, stage(1), stage(1) + T::kKvBytes);
  cp_async_commit();

  DenseWgmmaRows state;
  state.init();
  const uint32_t q_addr = smem_address(q_smem);
  for (int64_t t = 0; t < n_tiles; ++t) {
    cp_async_wait<1>();    // this thread's copies of Q and tiles <= t landed
    fence_async_shared();  // ... and are visible to the async proxy (wgmma)
    // Tile t is complete for every warpgroup, and every warpgroup has finished tile t - 1,
    // whose stage (t + 2) % 3 the loads below refill.
    __syncthreads();
    if (t + 2 < n_tiles)
      load_dense_kv_swizzled(a, tile.seq, g, tile.k_len, t + 2, stage(t + 2), stage(t + 2) + T::kKvBytes);
    cp_async_commit();
    const int64_t first_key = t * T::kKeys;
    if (wg_active && first_key <= wg_max_pos) {  // warpgroup-uniform
      const int limit[2] = {dense_wgmma_limit(row[0].pos, first_key), dense_wgmma_limit(row[1].pos, first_key)};
      const uint32_t k_addr = smem_address(stage(t));
      state.attend(q_addr, k_addr, k_addr + T::kKvBytes, a.scale_log2, first_key + T::kKeys - 1 > wg_min_pos,
                   limit);
    }
  }
  state.store(a, row);
}

}  // namespace msa::cuda::attn
