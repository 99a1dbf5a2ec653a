// Backward of the main branch: the deterministic dQ paths and the row preprocessing.
//
// backward_rows_kernel: Delta = rowsum(dO * O) (f32) and LSE2 = LSE * log2(e) (+inf for an
//   empty row, so that P = exp2(s - LSE2) = 0) per (query, q-head) row; one warp per row.
//
// dense_dq_kernel (dense deterministic mode): query-major, FA2-style. A CTA (4 warps) owns 64
//   rows = (query, head) pairs of one KV group of one sequence, flattened query-major as the
//   dense forward (the tile plan and K/V pipeline of attention_dense_tiles.cuh); each warp
//   owns 16 rows. The CTA walks the 64-key tiles 0 .. (last row's pos) / 64 with a
//   two-stage cp.async pipeline and per warp recomputes
//     S = Q K^T, P = exp2(S scale log2e - LSE2) (0 where key > pos), dP = dO V^T,
//     dS = P (dP - Delta), dQ += dS K      (mma.sync m16n8k16, f32 accumulators)
//   then writes dQ = scale * acc once per row: one writer, a fixed order -> bitwise
//   reproducible. Q and dO stay in shared memory (ldmatrix per tile) to keep registers for
//   dQ (64) + S (32) + dP (32) at D = 128. Shared memory: Q, dO 2 x 64 x (D + 8) x 2 + K, V
//   2 stages x 2 x 64 x (D + 8) x 2 = 104,448 bytes (D = 128): two CTAs per SM.
//
// merge_dq_partials_kernel (sparse deterministic mode): dQ of (query, group) = the sum of its
//   per-slot partials (written by the KV-block-major kernel, scale applied) in slot order,
//   over the valid slots (before the row's first -1); an empty row gets zeros.
#pragma once
#include "cuda/attention/attention_dense_tiles.cuh"

namespace msa::cuda::attn {

constexpr int kRowsWarps = 8;  // backward_rows_kernel: rows per CTA (one warp each)

__global__ void __launch_bounds__(kRowsWarps * 32)
    backward_rows_kernel(const uint16_t* o, const uint16_t* grad_o, const float* lse, int64_t rows, int D,
                         float* delta, float* lse2) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float sum = 0.0f;
  for (int c = lane * 4; c < D; c += 32 * 4) {  // 4 bf16 (8 bytes) per lane and step
    const uint2 ov = *reinterpret_cast<const uint2*>(o + row * D + c);
    const uint2 gv = *reinterpret_cast<const uint2*>(grad_o + row * D + c);
    const uint32_t ow[2] = {ov.x, ov.y}, gw[2] = {gv.x, gv.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      sum += __uint_as_float(ow[i] << 16) * __uint_as_float(gw[i] << 16);
      sum += __uint_as_float(ow[i] & 0xffff0000u) * __uint_as_float(gw[i] & 0xffff0000u);
    }
  }
  sum = warp_sum(sum);
  if (lane == 0) {
    delta[row] = sum;
    const float l = lse[row];
    lse2[row] = l == kNegInf ? __builtin_huge_valf() : l * kLog2e;
  }
}

struct DenseDqArgs {
  const uint16_t* q;       // [total_q, q_heads, D]
  const uint16_t* grad_o;  // [total_q, q_heads, D]
  KeyLayout k, v;
  int64_t q_heads, kv_heads, group;
  const int64_t* q_start;
  const int64_t* k_len;
  int64_t batch;
  const int64_t* tile_start;  // [batch + 1] from dense_tile_plan
  const float* lse2;          // [total_q, q_heads]
  const float* delta;         // [total_q, q_heads]
  float scale, scale_log2;
  float* dq;  // [total_q, q_heads, D]
};

template <int D>
__host__ __device__ constexpr size_t dense_dq_smem_bytes() {
  return static_cast<size_t>(2 + kDenseStages * 2) * kKeyTile * smem_pitch<D>() * sizeof(uint16_t);
}

template <int D>
__global__ void __launch_bounds__(kDenseThreads)
    dense_dq_kernel(const __grid_constant__ DenseDqArgs a) {
  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  uint16_t* q_smem = reinterpret_cast<uint16_t*>(smem_raw);  // [64][kPitch]
  uint16_t* do_smem = q_smem + kDenseRows * kPitch;          // [64][kPitch]
  uint16_t* kv_smem = do_smem + kDenseRows * kPitch;         // [stage][K, V][64][kPitch]

  const int G = static_cast<int>(a.group);
  const DenseTile tile = dense_tile(a.tile_start, a.batch, a.q_start, a.k_len, G);
  if (!tile.valid) return;
  const int64_t g = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Q and dO rows of the CTA (zero rows past the end).
  {
    constexpr int kChunks = D / 8;
    for (int c = threadIdx.x; c < kDenseRows * kChunks; c += kDenseThreads) {
      const int r = c / kChunks, col = (c % kChunks) * 8;
      const int64_t m = tile.first_row + r;
      const bool valid = m <= tile.last_row;
      const int64_t off = valid ? dense_row_index(tile, m, G, a.q_heads, g) * D + col : 0;
      cp_async_16(q_smem + r * kPitch + col, a.q + off, valid);
      cp_async_16(do_smem + r * kPitch + col, a.grad_o + off, valid);
    }
  }
  const DenseKvStages<D> kv{a.k, a.v, kv_smem, tile.seq, g, tile.k_len};
  kv.load(0);
  cp_async_commit();

  const DenseWarpRows w = dense_warp_rows(tile, warp, G);
  DenseRow row[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row[r] = dense_row(tile, w, lane, r, G, a.q_heads, g);
    lse2[r] = row[r].valid ? a.lse2[row[r].index] : 0.0f;
    delta[r] = row[r].valid ? a.delta[row[r].index] : 0.0f;
    if (!row[r].valid) row[r].pos = -1;  // padding rows see no key (P = 0)
  }

  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;

  const uint16_t* q_a = q_smem + (warp * kWarpRows + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
  const uint16_t* do_a = do_smem + (warp * kWarpRows + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
  kv.for_each_tile(tile.last_pos, w, [&](const uint16_t* k_tile, const uint16_t* v_tile, int64_t first_key) {
    constexpr int kNTiles = kKeyTile / 8;
    // S = Q K^T, dP = dO V^T (K / V rows as non-transposed B operands).
    float s[kNTiles][4], dp[kNTiles][4];
    const int b_off = ((lane % 8) + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 8;
    mma_abt_pair<D>(s, dp, q_a, do_a, k_tile + b_off, v_tile + b_off);
    // P and dS; lane columns (keys) first_key + 8 n + 2 (lane % 4) + {0, 1}.
    const int limit[2] = {tile_limit(row[0].pos, first_key), tile_limit(row[1].pos, first_key)};
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i / 2;
        const int key = n * 8 + 2 * (lane % 4) + (i & 1);
        const float p = key <= limit[r] ? exp2f(s[n][i] * a.scale_log2 - lse2[r]) : 0.0f;
        dp[n][i] = p * (dp[n][i] - delta[r]);
      }
    // dQ += dS K: A = dS (bf16 from the accumulators), B = K rows (transposed ldmatrix), as
    // the forward's O += P V.
    accumulate_pv<D>(acc, dp, k_tile, lane);
  });

  const int col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row[r].valid) continue;
    float* out = a.dq + row[r].index * D + col;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(out + n * 8) = make_float2(acc[n][2 * r] * a.scale, acc[n][2 * r + 1] * a.scale);
  }
}

constexpr int kMergeDqThreads = 128;

struct MergeDqArgs {
  const int32_t* topk;  // [kv_heads, total_q, slots]
  int64_t total_q, q_begin, chunk_q, q_heads, kv_heads, group, head_dim, slots;
  const float* partial;  // [chunk_q, kv_heads, slots, group, head_dim]
  float* dq;             // [total_q, q_heads, head_dim]
};

// One CTA per (chunk-local query, group): blockIdx.x = ql * kv_heads + g.
__global__ void merge_dq_partials_kernel(const __grid_constant__ MergeDqArgs a) {
  const int64_t ql = blockIdx.x / a.kv_heads, g = blockIdx.x % a.kv_heads;
  const int64_t q = a.q_begin + ql;
  const int32_t* row = a.topk + (g * a.total_q + q) * a.slots;
  int n = 0;
  while (n < a.slots && row[n] >= 0) ++n;  // the same rule as build_selection_keys
  const int64_t span4 = a.group * a.head_dim / 4;  // one slot's G x D partial, in float4
  const float4* partial = reinterpret_cast<const float4*>(a.partial) + (ql * a.kv_heads + g) * a.slots * span4;
  float4* out = reinterpret_cast<float4*>(a.dq + (q * a.q_heads + g * a.group) * a.head_dim);
  for (int i = threadIdx.x; i < span4; i += kMergeDqThreads) {
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4* x = partial + i;
    for (int s = 0; s < n; ++s, x += span4) {
      const float4 v = *x;
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    out[i] = sum;
  }
}

}  // namespace msa::cuda::attn
