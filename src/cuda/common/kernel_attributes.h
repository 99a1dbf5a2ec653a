// Per-kernel launch attributes set once, not on every launch: cudaFuncSetAttribute is a
// driver call, and the launchers sit on the decode step's microsecond budget.
#pragma once
#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
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

// CTAs of `kernel` resident per SM on the current device at `threads` threads and `bytes` of
// dynamic shared memory (at least 1), with the limit raised as require_dynamic_smem does.
// Queried once per (device, kernel, threads, bytes): the occupancy calculator is a driver
// call, and the prefill indexer plans with it on every call.
template <class Kernel>
int resident_ctas_per_sm(Kernel kernel, int threads, size_t bytes) {
  require_dynamic_smem(kernel, bytes);
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> known;
  int device = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), threads, bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  int ctas = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, bytes));
  return known[key] = ctas > 0 ? ctas : 1;
}

}  // namespace msa::cuda
