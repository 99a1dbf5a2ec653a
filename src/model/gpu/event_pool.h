// CUDA events for timing (the CUDA text model's StepProfile, the vision tower's
// VisionProfile), created on first use and reused: a caller resets `next` at the start of a
// timed call, and each record() takes the next event of the pool. Host-only header.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "cuda/common/cuda_check.h"

namespace msa::model::gpu {

struct EventPool {
  std::vector<cudaEvent_t> events;
  size_t next = 0;

  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
  cudaEvent_t record(cudaStream_t stream) {
    if (next == events.size()) {
      cudaEvent_t e = nullptr;
      MSA_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
    cudaEvent_t e = events[next++];
    MSA_CUDA_CHECK(cudaEventRecord(e, stream));
    return e;
  }
};

}  // namespace msa::model::gpu
