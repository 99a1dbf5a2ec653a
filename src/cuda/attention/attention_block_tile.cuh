// Warp-level attention math shared by the sparse (KV-block-major) and dense (flash) kernels.
//
// Tile plan: one warp owns 16 MMA rows (query-head pairs) and attends to a 64-key tile that
// sits in shared memory as bf16 rows of D elements, padded to D + 8 (conflict-free ldmatrix:
// consecutive rows shift by 16 bytes = 4 banks). Per 64-key tile a warp issues
//   S = Q K^T : (D/16) x 8 mma.m16n8k16   (K rows via ldmatrix, non-transposed)
//   O += P V  : 4 x (D/8) mma.m16n8k16    (V rows via ldmatrix.trans)
// with an online softmax in between (log2 domain, f32). P is rounded to bf16 for the PV
// MMA (as FA2 does); the row sums use the f32 probabilities.
//
// Registers per lane (D = 128): Q fragments 32, S 32, O 64, m/l 4 -> ~140 live values.
// Rows: lane holds rows lane/4 and lane/4 + 8 of the 16 ("row 0" and "row 1" below) and
// columns 2 * (lane % 4) + {0, 1} of each 8-wide n-tile (see mma_bf16_16816 in common.cuh).
#pragma once
#include "cuda/common/common.cuh"

namespace msa::cuda::attn {

constexpr int kKeyTile = 64;   // keys per attend step (block sizes 64 and 128 are multiples)
constexpr int kWarpRows = 16;  // MMA rows per warp
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared-memory row pitch in elements for a D-wide bf16 row.
template <int D>
constexpr int smem_pitch() {
  return D + 8;
}

// Asynchronously copies `rows` rows of D bf16 elements (global row r at src + r * stride)
// into shared memory at pitch D + 8. Rows >= valid_rows are zero-filled and never read from
// global memory (keys past the end of a sequence may lie outside the tensor, and a paged
// cache may hold garbage there: zeros keep P = 0 times V finite). Called by all threads of
// the CTA; the caller commits and waits.
template <int D, int kThreads>
__device__ __forceinline__ void load_rows_async(uint16_t* dst, const uint16_t* src, int64_t stride,
                                                int rows, int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < rows * kChunks; c += kThreads) {
    const int row = c / kChunks, col = (c % kChunks) * 8;
    const bool valid = row < valid_rows;
    const uint16_t* from = valid ? src + row * stride + col : src;
    cp_async_16(dst + row * smem_pitch<D>() + col, from, valid);
  }
}

// load_rows_async for kRows rows that the kThreads threads split evenly (exactly kThreads
// threads call it): a thread keeps one 16-byte column and steps its rows by kThreads / (D / 8),
// so the unrolled loop steps addresses instead of recomputing them per chunk (the decode
// kernel's K/V units: 8 chunks per thread, ~4x fewer instructions in the SASS).
template <int D, int kThreads, int kRows>
__device__ __forceinline__ void load_tile_rows_async(uint16_t* dst, const uint16_t* src, int64_t stride,
                                                     int valid_rows) {
  constexpr int kChunks = D / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "load_tile_rows_async: even split");
  const int row0 = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
  const uint16_t* from = src + row0 * stride + col;
  uint16_t* to = dst + row0 * smem_pitch<D>() + col;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const bool valid = row0 + i * kRowStep < valid_rows;
    cp_async_16(to + i * kRowStep * smem_pitch<D>(), valid ? from + i * kRowStep * stride : src, valid);
  }
}

__device__ __forceinline__ uint32_t load_bf16_pair(const uint16_t* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Q of the warp's 16 rows as m16n8k16 A fragments, straight from global memory (each row
// is D contiguous bf16). A null row pointer gives a zero row (padding).
template <int D>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[D / 16][4], const uint16_t* row0,
                                                 const uint16_t* row1) {
  const int col = 2 * (threadIdx.x % 4);
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    qf[k][0] = row0 ? load_bf16_pair(row0 + k * 16 + col) : 0u;
    qf[k][1] = row1 ? load_bf16_pair(row1 + k * 16 + col) : 0u;
    qf[k][2] = row0 ? load_bf16_pair(row0 + k * 16 + 8 + col) : 0u;
    qf[k][3] = row1 ? load_bf16_pair(row1 + k * 16 + 8 + col) : 0u;
  }
}

// The f32 accumulators of n-tiles 2 kk and 2 kk + 1 (16 rows x 16 columns) as the bf16 A
// fragment of k-step kk: an MMA's result feeds the next MMA without leaving registers.
template <int kN>
__device__ __forceinline__ void accumulator_a_fragment(uint32_t (&a)[4], const float (&c)[kN][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// tile_scores and accumulate_pv take a tile's first shared-memory row and compute the lane's
// ldmatrix row themselves, mma_abt_pair takes lane addresses: each as its callers had it
// inline (the other way round, ptxas keeps more addresses live: dense_flash_kernel<64> loses
// a CTA per SM, backward_kv_kernel<128> spills).

// s = Q K^T of the warp's 16 rows (Q as A fragments in registers) and the 64 keys at `keys`
// (D-wide bf16 rows, pitch D + 8). ldmatrix.x4 matrices: (keys 0-7, d 0-7), (keys 0-7,
// d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15) of a 16-key x 16-dim step.
// kKeys (a multiple of 16, default the 64-key tile) narrows the tile: the decode kernel's
// single-row-tile CTAs give each warp 16 keys of a unit.
template <int D, int kKeys = kKeyTile>
__device__ __forceinline__ void tile_scores(float (&s)[kKeys / 8][4], const uint32_t (&qf)[D / 16][4],
                                            const uint16_t* keys, int lane) {
  static_assert(kKeys % 16 == 0 && kKeys <= kKeyTile, "tile_scores: 16-key steps");
  constexpr int kPitch = smem_pitch<D>();
  constexpr int kNTiles = kKeys / 8;
#pragma unroll
  for (int n = 0; n < kNTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
  const uint16_t* key_row = keys + ((lane % 8) + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, key_row + np * 16 * kPitch + k * 16);
      mma_bf16_16816_x2(s[2 * np], s[2 * np + 1], qf[k], b);
    }
}

// o += P V of the warp's 16 rows and the 64 keys: P = the f32 accumulators p (n-tile n = keys
// 8n..8n+7, rounded to bf16), V = the D-wide bf16 rows at `values` (pitch D + 8).
// ldmatrix.x4.trans matrices: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
// (keys 8-15, d 8-15).
template <int D, int kKeys = kKeyTile>
__device__ __forceinline__ void accumulate_pv(float (&o)[D / 8][4], const float (&p)[kKeys / 8][4],
                                              const uint16_t* values, int lane) {
  constexpr int kPitch = smem_pitch<D>();
  const uint16_t* value_row = values + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    uint32_t a[4];
    accumulator_a_fragment(a, p, kk);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, value_row + kk * 16 * kPitch + dp * 16);
      mma_bf16_16816_x2(o[2 * dp], o[2 * dp + 1], a, b);
    }
  }
}

// c0 = A0 B0^T and c1 = A1 B1^T (fresh f32 accumulators) of 16 rows and 8 kN columns, D deep,
// the two products interleaved in one step loop. All operands are D-wide bf16 rows in shared
// memory at pitch D + 8, passed as the lane's ldmatrix address: a0 / a1 into the 16 A rows
// (row (lane % 8) + ((lane / 8) % 2) * 8, column (lane / 16) * 8), b0 / b1 into the first 16
// B rows (row (lane % 8) + (lane / 16) * 8, column ((lane / 8) % 2) * 8, as the keys in
// tile_scores).
template <int D, int kN>
__device__ __forceinline__ void mma_abt_pair(float (&c0)[kN][4], float (&c1)[kN][4], const uint16_t* a0,
                                             const uint16_t* a1, const uint16_t* b0, const uint16_t* b1) {
  constexpr int kPitch = smem_pitch<D>();
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) c0[n][i] = c1[n][i] = 0.0f;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    uint32_t x0[4], x1[4];
    ldmatrix_x4(x0, a0 + k * 16);
    ldmatrix_x4(x1, a1 + k * 16);
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b0 + np * 16 * kPitch + k * 16);
      mma_bf16_16816_x2(c0[2 * np], c0[2 * np + 1], x0, b);
      ldmatrix_x4(b, b1 + np * 16 * kPitch + k * 16);
      mma_bf16_16816_x2(c1[2 * np], c1[2 * np + 1], x1, b);
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Online-softmax state of one warp's 16 rows: unnormalised O, running max m (log2 domain,
// scaled logits) and the lane's share of the running sum l (quad-reduced in finish()).
template <int D>
struct WarpRowsState {
  float o[D / 8][4];
  float m[2];
  float l[2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    m[0] = m[1] = kNegInf;
    l[0] = l[1] = 0.0f;
  }

  // Attends to the kKeys (64, or a multiple of 16 below) keys at shared-memory rows `keys` /
  // `values` (pitch D + 8). With kMask, key i of the tile is visible to row 0 iff
  // i <= limit0 (row 1: limit1); the caller passes limits relative to the tile's first key
  // (any value >= kKeys - 1 = all visible, < 0 = none). With kScaled (fp8 K/V, the decode
  // kernel), key i's value is the tile row times key_scales[i] (value row: value_scales[i],
  // f32 in shared memory): the K scale multiplies score column i before the softmax, the V
  // scale probability column i of P.V only (l sums the unscaled probabilities).
  template <bool kMask, int kKeys = kKeyTile, bool kScaled = false>
  __device__ __forceinline__ void attend(const uint32_t (&qf)[D / 16][4], const uint16_t* keys,
                                         const uint16_t* values, float scale_log2, int limit0,
                                         int limit1, const float* key_scales = nullptr,
                                         const float* value_scales = nullptr) {
    constexpr int kNTiles = kKeys / 8;
    const int lane = threadIdx.x % 32;
    const int col = 2 * (lane % 4);

    float s[kNTiles][4];
    tile_scores<D, kKeys>(s, qf, keys, lane);
    if constexpr (kScaled) scale_columns<kNTiles>(s, key_scales, col);
    softmax_update<kMask, kNTiles>(s, scale_log2, scale_log2, limit0, limit1);

    if constexpr (kScaled) scale_columns<kNTiles>(s, value_scales, col);
    // O += P V (P = the S accumulators).
    accumulate_pv<D, kKeys>(o, s, values, lane);
  }

  // The online-softmax step of a tile's scores s (the lane's columns, kNTiles n-tiles): s
  // becomes the probabilities 2^(s * scale_r - m) (row r's scale: scale0 / scale1; masked
  // columns, key > limit_r, give 0), m and l are updated and O is rescaled by 2^(m_old - m).
  template <bool kMask, int kNTiles>
  __device__ __forceinline__ void softmax_update(float (&s)[kNTiles][4], float scale0, float scale1, int limit0,
                                                 int limit1) {
    const int col = 2 * (threadIdx.x % 4);
    // Scale, mask, row max over the tile.
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = s[n][i] * (i < 2 ? scale0 : scale1);
        if (kMask) {
          const int key = n * 8 + col + (i & 1);
          if (key > (i < 2 ? limit0 : limit1)) v = kNegInf;
        }
        s[n][i] = v;
        tile_max[i / 2] = fmaxf(tile_max[i / 2], v);
      }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(tile_max[r]));
      m_use[r] = m_new == kNegInf ? 0.0f : m_new;  // fully masked so far: keep p = 0, no NaN
      alpha[r] = exp2f(m[r] - m_use[r]);            // 0 on the first visible tile
      m[r] = m_new;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[n][i] - m_use[i / 2]);
        s[n][i] = p;
        l[i / 2] += p;
      }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
  }

  // s[n][i] *= scales[key] for the lane's keys n * 8 + col + {0, 1} (i = 0, 2 and 1, 3).
  template <int kNTiles>
  __device__ __forceinline__ static void scale_columns(float (&s)[kNTiles][4], const float* scales, int col) {
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      const float2 pair = *reinterpret_cast<const float2*>(scales + n * 8 + col);
      s[n][0] *= pair.x;
      s[n][1] *= pair.y;
      s[n][2] *= pair.x;
      s[n][3] *= pair.y;
    }
  }

  // Completes the row sums. inv = 1 / l (0 for an empty row), lse2 = log2-domain
  // log-sum-exp of the scaled logits (-inf for an empty row).
  __device__ __forceinline__ void finish(float (&inv)[2], float (&lse2)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(l[r]);
      inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
      lse2[r] = sum > 0.0f ? m[r] + log2f(sum) : kNegInf;
    }
  }

  // Writes this lane's columns of row `r` (0 or 1) of O * inv as bf16 to `row` (a
  // shared-memory row of D elements; the caller passes the lane's row, lane / 4 + 8 r).
  __device__ __forceinline__ void store_row_bf16_smem(uint16_t* row, int r, float inv) const {
    const int col = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(row + n * 8 + col) =
          pack_bf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }

  // Writes row `r` (0 or 1) of O * inv as f32 to `out` (D contiguous floats).
  __device__ __forceinline__ void store_row(float* out, int r, float inv) const {
    const int col = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(out + n * 8 + col) =
          make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }

  // Writes row `r` (0 or 1) of O * inv to the attention output row that starts at element
  // `first` of `out` (D contiguous f32 or bf16 values, store_output2).
  __device__ __forceinline__ void store_output_row(void* out, bool bf16, int64_t first, int r, float inv) const {
    const int col = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_output2(out, bf16, first + n * 8 + col, o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
  }
};

// Log-sum-exp merge of partials in the log2 domain (the decode kernel's warps, the decode
// merge kernel's splits). lse2_total: the total of partials whose maximum is `max2` and whose
// sum of 2^(lse2 - max2) is `sum` (-inf when every partial is empty). lse2_weight: a
// partial's share 2^(lse2 - total), 0 for an empty partial or total (no -inf - -inf).
__device__ __forceinline__ float lse2_total(float max2, float sum) {
  return max2 == kNegInf ? kNegInf : max2 + log2f(sum);
}
__device__ __forceinline__ float lse2_weight(float lse2, float total) {
  return (total == kNegInf || lse2 == kNegInf) ? 0.0f : exp2f(lse2 - total);
}

// Clamps a key limit (last visible key relative to a tile's first key) to an int.
__device__ __forceinline__ int tile_limit(int64_t pos, int64_t tile_first_key) {
  const int64_t rel = pos - tile_first_key;
  return static_cast<int>(rel < -1 ? -1 : (rel > kKeyTile ? kKeyTile : rel));
}

}  // namespace msa::cuda::attn
