// Bias add after a GEMM, optionally followed by the exact (erf) GELU, with a bf16 copy for
// the next GEMM (bias_gelu in kernels.h): the ViT's fc1 and the projector's linears. erff
// as model::gelu_erf's std::erf (the tanh form is not M3's: docs/vision.md).
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;

// Rows over blockIdx.y (grid-stride), columns over the threads of blockIdx.x: the bias
// index is the column, no division per element.
__global__ void bias_gelu_kernel(float* y, int64_t rows, int64_t cols, const float* bias, bool gelu,
                                 uint16_t* out_bf16, bool store_f32) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < cols; c += int64_t{gridDim.x} * blockDim.x) {
      const int64_t i = r * cols + c;
      float v = y[i] + bias[c];
      if (gelu) v = 0.5f * v * (1.0f + erff(v * kInvSqrt2));
      if (out_bf16) {
        const __nv_bfloat16 value = __float2bfloat16_rn(v);
        out_bf16[i] = *reinterpret_cast<const uint16_t*>(&value);
      }
      if (store_f32) y[i] = v;
    }
}

}  // namespace

void bias_gelu(float* y, int64_t rows, int64_t cols, const float* bias, bool gelu, uint16_t* out_bf16,
               bool store_f32, void* stream) {
  if (rows == 0 || cols == 0) return;
  // A few waves are plenty for this memory-bound pass.
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>((cols + kThreads - 1) / kThreads, 1, 64)),
                  static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 8192)));
  bias_gelu_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(y, rows, cols, bias, gelu, out_bf16,
                                                                            store_f32);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
