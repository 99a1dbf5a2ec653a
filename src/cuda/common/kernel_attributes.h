// Per-kernel launch attributes set once, not on every launch: cudaFuncSetAttribute is a
// driver call, and the launchers sit on the decode step's microsecond budget.
#pragma once
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common/cuda_check.h"

namespace msa::cuda {

// Raises `kernel`'s dynamic shared memory limit on the current device to at least `bytes`
// (a permission, not a reservation: occupancy follows each launch's own size). Thread-safe;
// after the first launch of a size, a map lookup.
template <class Kernel>
void require_dynamic_smem(Kernel kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, size_t> granted;  // (device, kernel) -> bytes
  int device = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& limit = granted[key];
  if (bytes <= limit) return;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  limit = bytes;
}

}  // namespace msa::cuda
