// The clamped SwiGLU-OAI activation of M3's MLPs and experts, over a fused gate|up GEMM
// output (f32), written as the bf16 input of the down projection.
#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "kernels.h"

namespace msa::model::gpu {

using msa::cuda::launch_pdl;
using msa::cuda::pdl_launch_dependents;
using msa::cuda::pdl_wait;
namespace {

constexpr int kThreads = 256;

__global__ void swiglu_kernel(const float* gate_up, int64_t rows, int64_t inter, float alpha,
                              float limit, uint16_t* act) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  const int64_t count = rows * inter;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float gate = gate_up[r * 2 * inter + c], up = gate_up[r * 2 * inter + inter + c];
    const float g = fminf(gate, limit);
    const float u = fminf(fmaxf(up, -limit), limit);
    const float glu = g / (1.0f + expf(-alpha * g));  // g * sigmoid(alpha * g)
    const __nv_bfloat16 value = __float2bfloat16_rn((u + 1.0f) * glu);
    act[i] = *reinterpret_cast<const uint16_t*>(&value);
  }
}

}  // namespace

void swiglu_oai(const float* gate_up, int64_t rows, int64_t inter, float alpha, float limit,
                uint16_t* act, void* stream) {
  const int64_t count = rows * inter;
  if (count == 0) return;
  const unsigned grid = static_cast<unsigned>(std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, 65536));
  launch_pdl(swiglu_kernel, dim3(grid), dim3(kThreads), 0, static_cast<cudaStream_t>(stream), gate_up, rows, inter,
             alpha, limit, act);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
