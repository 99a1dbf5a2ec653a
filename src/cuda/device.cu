// The CUDA backend's device queries (kernels arrive with the Hopper issue).
#include <cuda_runtime.h>

namespace msa::cuda {

// Number of visible CUDA devices; 0 when the driver or a device is missing.
int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

}  // namespace msa::cuda
