// Gemma RMSNorm over rows of the residual stream: y = x * rsqrt(mean(x^2) + eps) * (1 + w),
// f32 math (as src/model/tensor_math.cpp), bf16 and/or f32 outputs.
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
constexpr int kWarps = kThreads / 32;
constexpr int kCached = 8;  // float4 chunks a thread keeps: rows of up to 8192 in one read

__device__ __forceinline__ uint16_t to_bf16(float value) {
  const __nv_bfloat16 b = __float2bfloat16_rn(value);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// One CTA per output row. A thread's chunks c = tid + 256 k (float4) are loaded together
// into registers (a decode step has one row: a loop of dependent load-then-add per element
// costs ~13 us of latency for it), summed, the warps' sums combined in shared
// memory in a fixed order, and the outputs written from the registers. Rows longer than
// 8192, or not float4-aligned, go through the plain loop (kVec4 = false).
template <bool kVec4>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const float* x, const int64_t* source_rows,
                                                            int64_t dim, const float* weight, float eps,
                                                            uint16_t* out_bf16, float* out_f32) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  __shared__ float warp_sums[kWarps];
  const int64_t r = blockIdx.x;
  const float* in = x + (source_rows ? source_rows[r] : r) * dim;
  float sum = 0;
  float4 cached[kCached], gain[kCached];  // the weights load with x: one round trip, not two
  const int64_t chunks = dim / 4;
  if constexpr (kVec4) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t c = threadIdx.x + int64_t{kThreads} * k;
      cached[k] = c < chunks ? reinterpret_cast<const float4*>(in)[c] : make_float4(0, 0, 0, 0);
      gain[k] = c < chunks ? reinterpret_cast<const float4*>(weight)[c] : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kCached; ++k)
      sum += cached[k].x * cached[k].x + cached[k].y * cached[k].y + cached[k].z * cached[k].z +
             cached[k].w * cached[k].w;
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += in[i] * in[i];
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();  // every warp's sum is in shared memory
  float total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];  // same order in every thread
  const float inv = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  if constexpr (kVec4) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t c = threadIdx.x + int64_t{kThreads} * k;
      if (c >= chunks) break;
      const float4 g = gain[k];
      const float4 v = cached[k];
      const float4 y = make_float4((v.x * inv) * (1.0f + g.x), (v.y * inv) * (1.0f + g.y),
                                   (v.z * inv) * (1.0f + g.z), (v.w * inv) * (1.0f + g.w));
      if (out_bf16) {
        const uint2 packed = make_uint2(to_bf16(y.x) | (static_cast<uint32_t>(to_bf16(y.y)) << 16),
                                        to_bf16(y.z) | (static_cast<uint32_t>(to_bf16(y.w)) << 16));
        reinterpret_cast<uint2*>(out_bf16 + r * dim)[c] = packed;
      }
      if (out_f32) reinterpret_cast<float4*>(out_f32 + r * dim)[c] = y;
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
      const float y = (in[i] * inv) * (1.0f + weight[i]);
      if (out_bf16) out_bf16[r * dim + i] = to_bf16(y);
      if (out_f32) out_f32[r * dim + i] = y;
    }
  }
}

}  // namespace

void rms_norm_rows(const float* x, const int64_t* source_rows, int64_t rows, int64_t dim,
                   const float* weight, float eps, uint16_t* out_bf16, float* out_f32,
                   void* stream) {
  if (rows == 0) return;
  // Vector path: whole float4 chunks, rows and outputs 16-byte (bf16: 8-byte) aligned.
  const bool vec4 = dim % 4 == 0 && dim <= int64_t{4} * kThreads * kCached && is_aligned(x, 16) &&
                    is_aligned(weight, 16) && (!out_f32 || is_aligned(out_f32, 16)) && is_aligned(out_bf16, 8);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (vec4)
    launch_pdl(rms_norm_kernel<true>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, s, x, source_rows, dim,
               weight, eps, out_bf16, out_f32);
  else
    launch_pdl(rms_norm_kernel<false>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, s, x, source_rows, dim,
               weight, eps, out_bf16, out_f32);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
