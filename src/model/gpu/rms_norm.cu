// Gemma RMSNorm over rows of the residual stream: y = x * rsqrt(mean(x^2) + eps) * (1 + w),
// f32 math (as src/model/tensor_math.cpp), bf16 and/or f32 outputs.
#include <cuda_bf16.h>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// One CTA per output row: sum of squares (warp sums, then the first warp sums the warps),
// then a second pass over the (cached) row writes the outputs.
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const float* x, const int64_t* source_rows,
                                                            int64_t dim, const float* weight, float eps,
                                                            uint16_t* out_bf16, float* out_f32) {
  __shared__ float warp_sums[kWarps];
  const int64_t r = blockIdx.x;
  const float* in = x + (source_rows ? source_rows[r] : r) * dim;
  float sum = 0;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += in[i] * in[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();  // every warp's sum is in shared memory
  float total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];  // same order in every thread
  const float inv = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float y = (in[i] * inv) * (1.0f + weight[i]);
    if (out_bf16) {
      const __nv_bfloat16 value = __float2bfloat16_rn(y);
      out_bf16[r * dim + i] = *reinterpret_cast<const uint16_t*>(&value);
    }
    if (out_f32) out_f32[r * dim + i] = y;
  }
}

}  // namespace

void rms_norm_rows(const float* x, const int64_t* source_rows, int64_t rows, int64_t dim,
                   const float* weight, float eps, uint16_t* out_bf16, float* out_f32,
                   void* stream) {
  if (rows == 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, source_rows, dim, weight, eps, out_bf16, out_f32);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
