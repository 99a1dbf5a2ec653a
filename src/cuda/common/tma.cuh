// The bulk tensor copy engine (TMA, sm_90): a box of a tensor map (tensor_map.h, a
// __grid_constant__ kernel parameter) into shared memory, completing on an mbarrier whose
// phase expects the box's bytes (mbar_arrive_expect_tx).
#pragma once
#include <cuda.h>

#include <cstdint>

namespace msa::cuda {

// Box at (column c0, row c1) of a 2D map into shared address `dst` (1024-byte aligned for the
// 128-byte swizzle: the pattern follows the address bits); rows past the map read as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap& map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Brings the map's descriptor into the cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

}  // namespace msa::cuda
