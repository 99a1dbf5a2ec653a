// Embedding gather: bf16 table rows -> f32 residual stream.
#include <cuda_bf16.h>

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

// Grid (tokens, column chunks): a thread widens 8 columns (one 16-byte load) when the rows
// allow, so one token's row spreads over several CTAs with independent loads.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    embed_rows_kernel(const uint16_t* table, int64_t hidden, const int32_t* tokens, float* x) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int64_t i = (blockIdx.y * int64_t{kThreads} + threadIdx.x) * kVec;
  if (i >= hidden) return;
  const uint16_t* row = table + static_cast<int64_t>(tokens[t]) * hidden + i;
  float* out = x + t * hidden + i;
  auto widen = [](uint32_t bits) { return __uint_as_float(bits << 16); };
  if constexpr (kVec == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(row);
    reinterpret_cast<float4*>(out)[0] = make_float4(widen(v.x & 0xffffu), widen(v.x >> 16), widen(v.y & 0xffffu),
                                                    widen(v.y >> 16));
    reinterpret_cast<float4*>(out)[1] = make_float4(widen(v.z & 0xffffu), widen(v.z >> 16), widen(v.w & 0xffffu),
                                                    widen(v.w >> 16));
  } else {
    out[0] = widen(row[0]);
  }
}

}  // namespace

void embed_rows(const uint16_t* table, int64_t hidden, const int32_t* tokens, int64_t count,
                float* x, void* stream) {
  if (count == 0) return;
  const bool vec8 = hidden % 8 == 0 && is_aligned(table, 16) && is_aligned(x, 16);
  const int64_t per_cta = vec8 ? 8 * kThreads : kThreads;
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>((hidden + per_cta - 1) / per_cta));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (vec8)
    launch_pdl(embed_rows_kernel<8>, grid, dim3(kThreads), 0, s, table, hidden, tokens, x);
  else
    launch_pdl(embed_rows_kernel<1>, grid, dim3(kThreads), 0, s, table, hidden, tokens, x);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
