// MSA_CUDA_CHECK: turns a failed CUDA runtime call into an msa::Error naming the call, the
// file and line and the runtime's message. Usable from host .cpp files and .cu files alike.
#pragma once
#include <cuda_runtime.h>

#include "msa/error.h"

#define MSA_CUDA_CHECK(call)                                                           \
  do {                                                                                 \
    const cudaError_t msa_cuda_status = (call);                                        \
    if (msa_cuda_status != cudaSuccess)                                                \
      MSA_FAIL("CUDA error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",          \
               cudaGetErrorString(msa_cuda_status));                                   \
  } while (0)

// After a launch: configuration errors surface here, not at the next sync.
#define MSA_CUDA_CHECK_LAUNCH() MSA_CUDA_CHECK(cudaGetLastError())
