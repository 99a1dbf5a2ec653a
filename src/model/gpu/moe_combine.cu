// MoE combine: each token's output row gains its chosen experts' outputs, weighted, in
// choice order (deterministic: no atomics).
#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;

__global__ void moe_combine_kernel(const float* y_sorted, const float* entry_weight,
                                   const int32_t* entry_row, int64_t top_k, int64_t hidden,
                                   float* out) {
  const int64_t t = blockIdx.x;
  float* row = out + t * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = row[i];
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t entry = t * top_k + j;
      acc += entry_weight[entry] * y_sorted[static_cast<int64_t>(entry_row[entry]) * hidden + i];
    }
    row[i] = acc;
  }
}

}  // namespace

void moe_combine(const float* y_sorted, const float* entry_weight, const int32_t* entry_row,
                 int64_t tokens, int64_t top_k, int64_t hidden, float* out, void* stream) {
  if (tokens == 0) return;
  moe_combine_kernel<<<static_cast<unsigned>(tokens), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      y_sorted, entry_weight, entry_row, top_k, hidden, out);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
