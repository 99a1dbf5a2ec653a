// The current device's SM count (grid sizing of the launchers).
#pragma once
#include "cuda/common/cuda_check.h"

namespace msa::cuda {

inline int sm_count() {
  int device = 0, count = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  MSA_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace msa::cuda
