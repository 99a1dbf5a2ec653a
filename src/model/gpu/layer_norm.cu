// LayerNorm with weight and bias over rows of the ViT's residual stream (layer_norm_rows in
// kernels.h): the math of model::layer_norm (mean, then the biased variance around it, both
// in f32 here; the CPU sums in f64: ~1e-7 relative apart over a 1280-wide row).
#include <cuda_bf16.h>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The sum of `value` over the CTA, the same in every thread (warp sums, then every thread
// adds the warps' in the same order). `scratch` is free again when this returns.
__device__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();  // every warp's sum is in shared memory
  float total = 0;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();  // everyone has read scratch before the next use overwrites it
  return total;
}

// One CTA per row: the mean, the variance around it (two passes over the cached row), then
// the outputs. Each thread writes only the elements it read, after both reductions: out_f32
// may alias x.
__global__ void __launch_bounds__(kThreads) layer_norm_kernel(const float* x, int64_t dim, const float* weight,
                                                              const float* bias, float eps, uint16_t* out_bf16,
                                                              float* out_f32) {
  __shared__ float scratch[kWarps];
  const int64_t r = blockIdx.x;
  const float* in = x + r * dim;
  float sum = 0;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += in[i];
  const float mean = block_sum(sum, scratch) / static_cast<float>(dim);
  float squares = 0;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) squares += (in[i] - mean) * (in[i] - mean);
  const float inv = 1.0f / sqrtf(block_sum(squares, scratch) / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float y = (in[i] - mean) * inv * weight[i] + bias[i];
    if (out_bf16) {
      const __nv_bfloat16 value = __float2bfloat16_rn(y);
      out_bf16[r * dim + i] = *reinterpret_cast<const uint16_t*>(&value);
    }
    if (out_f32) out_f32[r * dim + i] = y;
  }
}

}  // namespace

void layer_norm_rows(const float* x, int64_t rows, int64_t dim, const float* weight, const float* bias,
                     float eps, uint16_t* out_bf16, float* out_f32, void* stream) {
  if (rows == 0) return;
  MSA_CHECK_ARG(rows < (int64_t{1} << 31), "rows", "fewer than 2^31", rows);
  layer_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, dim, weight, bias, eps, out_bf16, out_f32);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
