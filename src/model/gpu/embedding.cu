// Embedding gather: bf16 table rows -> f32 residual stream.
#include <cuda_bf16.h>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

constexpr int kThreads = 256;

// One CTA per token; threads stride over the row.
__global__ void embed_rows_kernel(const uint16_t* table, int64_t hidden, const int32_t* tokens,
                                  float* x) {
  const int64_t t = blockIdx.x;
  const uint16_t* row = table + static_cast<int64_t>(tokens[t]) * hidden;
  float* out = x + t * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    out[i] = __uint_as_float(static_cast<uint32_t>(row[i]) << 16);
}

}  // namespace

void embed_rows(const uint16_t* table, int64_t hidden, const int32_t* tokens, int64_t count,
                float* x, void* stream) {
  if (count == 0) return;
  embed_rows_kernel<<<static_cast<unsigned>(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      table, hidden, tokens, x);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
