// Synchronisation vocabulary of warp-specialised kernels (a producer warpgroup feeding
// consumer warpgroups, sm_90): shared-memory mbarriers (64-bit, at shared::cta addresses),
// the cp.async arrive that fires when a thread's copies land, named barriers over a subset
// of the CTA, and setmaxnreg (moving registers between warpgroups).
#pragma once
#include <cstdint>

namespace msa::cuda {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Orders the initialisations before later barrier operations of other threads (with the
// CTA barrier that follows).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive (release, CTA scope): this thread's earlier shared-memory accesses are done.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrive that fires once every cp.async this thread issued so far has landed; counts
// against the barrier's expected arrivals (noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Arrive (release) and expect `bytes` more from bulk copies completing on the barrier
// (tma.cuh): the phase ends once every arrival came and every expected byte landed.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits (acquire) for the completion of the barrier's phase of parity `parity`. A spin loop:
// not inside a wgmma chain (a back edge with an MMA in flight serialises them, wgmma.cuh).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_test(bar, parity)) {
  }
}

// bar.sync over `threads` threads (whole warps) on hardware barrier `id` (0: __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// bar.arrive on hardware barrier `id` (counting toward `threads`) without waiting: the signal
// half of a producer / consumer hand-off whose other side calls named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Per-thread register limits of the calling warpgroup (all its warps must call it).
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace msa::cuda
