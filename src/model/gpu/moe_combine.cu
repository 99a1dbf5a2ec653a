// MoE combine: each token's output row gains its chosen experts' outputs, weighted, in
// choice order (deterministic: no atomics).
#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/workspace_layout.h"
#include "kernels.h"

namespace msa::model::gpu {

using msa::cuda::is_aligned;
using msa::cuda::launch_pdl;
using msa::cuda::pdl_launch_dependents;
using msa::cuda::pdl_wait;

namespace {

constexpr int kThreads = 256;

// Grid (tokens, column chunks): a thread owns kVec consecutive columns of one token (float4
// when the rows allow), so a decode step's one token spreads over hidden / (4 x 256) CTAs:
// one CTA looping over a 6144-wide row serialises its loads (~40 us measured on an H200). The k entries' loads are
// independent of the sum: unrolled, they are in flight together. Each column's sum runs in
// choice order, as before.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    moe_combine_kernel(const float* y_sorted, const float* entry_weight, const int32_t* entry_row, int64_t top_k,
                       int64_t hidden, float* out) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t i = (blockIdx.y * int64_t{kThreads} + threadIdx.x) * kVec;
  if (i >= hidden) return;
  float* row = out + t * hidden + i;
  float acc[kVec];
  if constexpr (kVec == 4) {
    const float4 v = *reinterpret_cast<const float4*>(row);
    acc[0] = v.x, acc[1] = v.y, acc[2] = v.z, acc[3] = v.w;
  } else {
    acc[0] = row[0];
  }
#pragma unroll 4
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t entry = t * top_k + j;
    const float w = entry_weight[entry];
    const float* y = y_sorted + static_cast<int64_t>(entry_row[entry]) * hidden + i;
    if constexpr (kVec == 4) {
      const float4 v = *reinterpret_cast<const float4*>(y);
      acc[0] += w * v.x, acc[1] += w * v.y, acc[2] += w * v.z, acc[3] += w * v.w;
    } else {
      acc[0] += w * y[0];
    }
  }
  if constexpr (kVec == 4) {
    *reinterpret_cast<float4*>(row) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
    row[0] = acc[0];
  }
}

}  // namespace

void moe_combine(const float* y_sorted, const float* entry_weight, const int32_t* entry_row,
                 int64_t tokens, int64_t top_k, int64_t hidden, float* out, void* stream) {
  if (tokens == 0) return;
  // float4 when every row starts 16-byte aligned (the buffers are).
  const bool vec4 = hidden % 4 == 0 && is_aligned(y_sorted, 16) && is_aligned(out, 16);
  const int64_t per_cta = vec4 ? 4 * kThreads : kThreads;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((hidden + per_cta - 1) / per_cta));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (vec4)
    launch_pdl(moe_combine_kernel<4>, grid, dim3(kThreads), 0, s, y_sorted, entry_weight, entry_row, top_k, hidden, out);
  else
    launch_pdl(moe_combine_kernel<1>, grid, dim3(kThreads), 0, s, y_sorted, entry_weight, entry_row, top_k, hidden, out);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
