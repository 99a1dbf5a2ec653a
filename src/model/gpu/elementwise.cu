// Elementwise helpers of the forward: f32 -> bf16 (attention output -> o_proj input) and
// the residual add used when intermediates are observed.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t count) {
  // Grid-stride loops: a few waves are plenty for these memory-bound passes.
  return static_cast<unsigned>(std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, 65536));
}

__global__ void f32_to_bf16_kernel(const float* in, int64_t count, uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const __nv_bfloat16 value = __float2bfloat16_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&value);
  }
}

__global__ void add_in_place_kernel(float* x, const float* y, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    x[i] += y[i];
}

}  // namespace

void f32_to_bf16(const float* in, int64_t count, uint16_t* out, void* stream) {
  if (count == 0) return;
  f32_to_bf16_kernel<<<grid_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(in, count, out);
  MSA_CUDA_CHECK_LAUNCH();
}

void add_in_place(float* x, const float* y, int64_t count, void* stream) {
  if (count == 0) return;
  add_in_place_kernel<<<grid_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, y, count);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
