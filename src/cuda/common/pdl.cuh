// Programmatic dependent launch (PDL, sm_90): lets a kernel's CTAs be scheduled while the
// previous kernel of the stream is still running, hiding the launch gap (~1-3 us per kernel
// boundary, which is most of a 128K decode step's budget).
//
// Contract for every kernel launched through launch_pdl():
// - EVERY CTA calls pdl_wait() before its first global-memory access (read or write), and
//   before it exits: griddepcontrol.wait returns once all prerequisite grids have completed
//   and their writes are visible. A CTA that skipped it could let this grid complete before
//   its predecessor, and break the transitive ordering the next kernel relies on.
// - pdl_launch_dependents() may be called anywhere (we call it right after pdl_wait()): it
//   only lets the NEXT kernel's CTAs be scheduled early; that kernel still waits for this
//   grid's completion in its own pdl_wait(). No deadlock: dependents are released only once
//   every CTA of this grid is resident (has called it) or has exited.
// Launched without the attribute (or captured into a graph), the instructions are no-ops /
// plain stream order.
#pragma once
#include <utility>

#include "cuda/common/common.cuh"

namespace msa::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialisation.
template <class... KernelArgs, class... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  MSA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace msa::cuda
