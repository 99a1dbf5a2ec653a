// Merge of the sparse kernel's partials into the final O and LSE.
//
// One CTA (128 threads) per (KV group g, chunk-local query q): n = number of valid slots of
// the selection row (entries before its first -1). Phase 1, thread r < G: LSE2 = log2 sum_s
// 2^lse2_s over s < n, weights w_s = 2^(lse2_s - LSE2) into shared memory, LSE = LSE2 ln 2
// (-inf when n = 0). Phase 2: each thread owns 8-column (16-byte bf16) vectors of the G x D
// output and sums w_s * O_s in f32 in slot order (deterministic); n = 0 writes zeros.
// Rows flagged in `skip` (the query-major forward wrote them, attention.cu) are left alone.
// Shared memory: slots * 16 floats (dynamic). Registers: small.
// Bytes per (q, g): n x G x D x 2 (bf16 partials) + n x G x 4 read, G x D x 4 written; M3:
// 64 KB read + 8 KB written; 128K: 34 GB + 4.3 GB -> ~9 ms at ~4.2 TB/s. Bottleneck: HBM.
#pragma once
#include "cuda/attention/attention_sparse_kv_major.cuh"

namespace msa::cuda::attn {

struct MergeArgs {
  const int32_t* topk;  // [kv_heads, topk_rows, slots]
  int64_t topk_rows, q_begin, chunk_q, q_heads, kv_heads, group, slots;
  const PartialO* partial_o;  // [chunk_q, kv_heads, slots, group, D]
  const float* partial_lse;   // [chunk_q, kv_heads, slots, group]
  void* o;     // [total_q, q_heads, D], f32 or bf16 (o_bf16)
  bool o_bf16;
  float* lse;  // [total_q, q_heads]
  const uint8_t* skip = nullptr;  // [kv_heads, topk_rows] or null: rows (1) whose O another kernel wrote
};

constexpr int kMergeThreads = 128;

template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_partials_kernel(const __grid_constant__ MergeArgs a) {
  extern __shared__ float weights[];  // [slots][G]
  __shared__ int valid_slots;
  const int64_t g = blockIdx.x / a.chunk_q, ql = blockIdx.x % a.chunk_q;
  const int64_t q = a.q_begin + ql;
  const int G = static_cast<int>(a.group);
  if (a.skip != nullptr && a.skip[g * a.topk_rows + q] != 0) return;  // CTA-uniform
  if (threadIdx.x == 0) {
    const int32_t* row = a.topk + (g * a.topk_rows + q) * a.slots;
    int n = 0;
    while (n < a.slots && row[n] >= 0) ++n;
    valid_slots = n;
  }
  __syncthreads();
  const int n = valid_slots;
  const int64_t first_partial = (ql * a.kv_heads + g) * a.slots * G;  // slot 0, head 0
  if (threadIdx.x < G) {
    const int r = threadIdx.x;
    float max_lse = kNegInf;
    for (int s = 0; s < n; ++s) max_lse = fmaxf(max_lse, a.partial_lse[first_partial + s * G + r]);
    float sum = 0.0f;
    for (int s = 0; s < n; ++s) sum += exp2f(a.partial_lse[first_partial + s * G + r] - max_lse);
    // No visible key in any slot (max_lse = -inf): an empty row, O = 0 and LSE = -inf.
    const bool empty = max_lse == kNegInf;
    const float lse2 = empty ? kNegInf : max_lse + log2f(sum);
    for (int s = 0; s < n; ++s)
      weights[s * G + r] = empty ? 0.0f : exp2f(a.partial_lse[first_partial + s * G + r] - lse2);
    a.lse[q * a.q_heads + g * G + r] = empty ? kNegInf : lse2 * kLn2;
  }
  __syncthreads();
  constexpr int kVecs = D / 8;  // 16-byte bf16 vectors per row
  const uint4* partial = reinterpret_cast<const uint4*>(a.partial_o) + first_partial * kVecs;
  const int64_t out_first = (q * a.q_heads + g * G) * D;
  for (int i = threadIdx.x; i < G * kVecs; i += kMergeThreads) {
    const int r = i / kVecs;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int s = 0;
    // Two loads in flight per step; the sum stays in slot order.
    for (; s + 1 < n; s += 2) {
      const uint4 v0 = __ldcs(partial + static_cast<int64_t>(s) * G * kVecs + i);
      const uint4 v1 = __ldcs(partial + static_cast<int64_t>(s + 1) * G * kVecs + i);
      const float w0 = weights[s * G + r], w1 = weights[(s + 1) * G + r];
      float x0[8], x1[8];
      unpack_bf16x8(v0, x0);
      unpack_bf16x8(v1, x1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[j] += w0 * x0[j];
        acc[j] += w1 * x1[j];
      }
    }
    if (s < n) {
      const uint4 v0 = __ldcs(partial + static_cast<int64_t>(s) * G * kVecs + i);
      const float w0 = weights[s * G + r];
      float x0[8];
      unpack_bf16x8(v0, x0);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w0 * x0[j];
    }
    store_output8(a.o, a.o_bf16, out_first + int64_t{8} * i, acc);
  }
}

}  // namespace msa::cuda::attn
