// The device communicator's reduce kernel (see device_reduce.h).
#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "parallel/gpu/device_reduce.h"

namespace msa::parallel {
namespace {

__global__ void sum_peers_kernel(PeerPointers peers, int world, int64_t count, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = peers.at[0][i];
    for (int r = 1; r < world; ++r) acc = __fadd_rn(acc, peers.at[r][i]);
    out[i] = acc;
  }
}

}  // namespace

void sum_peers_on_device(const PeerPointers& peers, int world, int64_t count, float* out, void* stream) {
  if (count <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, 4096);
  sum_peers_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      peers, world, count, out);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::parallel
