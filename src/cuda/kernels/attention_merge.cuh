// Merge of the sparse kernel's partials into the final O and LSE.
//
// One CTA (128 threads) per (KV group g, query q): n = number of valid slots of the
// selection row (entries before its first -1). Phase 1, thread r < G: LSE2 = log2 sum_s
// 2^lse2_s over s < n, weights w_s = 2^(lse2_s - LSE2) into shared memory, LSE = LSE2 ln 2
// (-inf when n = 0). Phase 2: each thread owns float4 columns of the G x D output and sums
// w_s * O_s in slot order (deterministic); n = 0 writes zeros.
// Shared memory: slots * 16 floats (dynamic). Registers: small. Bottleneck: reading the
// partial O (slots x G x D f32 per (q, g)), a pure bandwidth kernel.
#pragma once
#include "attention_sparse_kv_major.cuh"

namespace msa::cuda::attn {

struct MergeArgs {
  const int32_t* topk;  // [kv_heads, total_q, slots]
  int64_t total_q, q_heads, kv_heads, group, slots;
  const PartialO* partial_o;
  const float* partial_lse;
  float* o;    // [total_q, q_heads, D]
  float* lse;  // [total_q, q_heads]
};

constexpr int kMergeThreads = 128;

template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_partials_kernel(const __grid_constant__ MergeArgs a) {
  extern __shared__ float weights[];  // [slots][G]
  __shared__ int valid_slots;
  const int64_t g = blockIdx.x / a.total_q, q = blockIdx.x % a.total_q;
  const int G = static_cast<int>(a.group);
  if (threadIdx.x == 0) {
    const int32_t* row = a.topk + (g * a.total_q + q) * a.slots;
    int n = 0;
    while (n < a.slots && row[n] >= 0) ++n;
    valid_slots = n;
  }
  __syncthreads();
  const int n = valid_slots;
  const int64_t first_partial = (q * a.kv_heads + g) * a.slots * G;  // slot 0, head 0
  if (threadIdx.x < G) {
    const int r = threadIdx.x;
    float max_lse = kNegInf;
    for (int s = 0; s < n; ++s) max_lse = fmaxf(max_lse, a.partial_lse[first_partial + s * G + r]);
    float sum = 0.0f;
    for (int s = 0; s < n; ++s) sum += exp2f(a.partial_lse[first_partial + s * G + r] - max_lse);
    const float lse2 = n > 0 ? max_lse + log2f(sum) : kNegInf;
    for (int s = 0; s < n; ++s)
      weights[s * G + r] = exp2f(a.partial_lse[first_partial + s * G + r] - lse2);
    a.lse[q * a.q_heads + g * G + r] = n > 0 ? lse2 * kLn2 : kNegInf;
  }
  __syncthreads();
  constexpr int kVecs = D / 4;
  const float4* partial = reinterpret_cast<const float4*>(a.partial_o) + first_partial * kVecs;
  float4* out = reinterpret_cast<float4*>(a.o) + (q * a.q_heads + g * G) * kVecs;
  for (int i = threadIdx.x; i < G * kVecs; i += kMergeThreads) {
    const int r = i / kVecs;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < n; ++s) {
      const float w = weights[s * G + r];
      const float4 x = partial[static_cast<int64_t>(s) * G * kVecs + i];
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    out[i] = acc;
  }
}

}  // namespace msa::cuda::attn
