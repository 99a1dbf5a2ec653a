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
#include "common.cuh"

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

  // Attends to the 64 keys at shared-memory rows `keys` / `values` (pitch D + 8). With
  // kMask, key i of the tile is visible to row 0 iff i <= limit0 (row 1: limit1); the
  // caller passes limits relative to the tile's first key (any value >= 63 = all visible,
  // < 0 = none).
  template <bool kMask>
  __device__ __forceinline__ void attend(const uint32_t (&qf)[D / 16][4], const uint16_t* keys,
                                         const uint16_t* values, float scale_log2, int limit0,
                                         int limit1) {
    constexpr int kPitch = smem_pitch<D>();
    constexpr int kNTiles = kKeyTile / 8;
    const int lane = threadIdx.x % 32;
    const int col = 2 * (lane % 4);

    float s[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;

    // S = Q K^T. ldmatrix.x4 matrices: (keys 0-7, d 0-7), (keys 0-7, d 8-15),
    // (keys 8-15, d 0-7), (keys 8-15, d 8-15) of a 16-key x 16-dim step.
    const uint16_t* key_row = keys + ((lane % 8) + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, key_row + np * 16 * kPitch + k * 16);
        const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
        mma_bf16_16816(s[2 * np], qf[k], b_lo);
        mma_bf16_16816(s[2 * np + 1], qf[k], b_hi);
      }

    // Scale, mask, row max over the tile.
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = s[n][i] * scale_log2;
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

    // O += P V. The S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of key step kk.
    // ldmatrix.x4.trans matrices: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
    // (keys 8-15, d 8-15).
    const uint16_t* value_row =
        values + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                             pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, value_row + kk * 16 * kPitch + dp * 16);
        const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
        mma_bf16_16816(o[2 * dp], a, b_lo);
        mma_bf16_16816(o[2 * dp + 1], a, b_hi);
      }
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
};

// Clamps a key limit (last visible key relative to a tile's first key) to an int.
__device__ __forceinline__ int tile_limit(int64_t pos, int64_t tile_first_key) {
  const int64_t rel = pos - tile_first_key;
  return static_cast<int>(rel < -1 ? -1 : (rel > kKeyTile ? kKeyTile : rel));
}

}  // namespace msa::cuda::attn
