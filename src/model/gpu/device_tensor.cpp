#include "device_tensor.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_buffer.h"

namespace msa::model::gpu {

DeviceMemory device_memory() {
  if (msa::cuda::device_count() < 1) throw Error("device cuda: no CUDA device is visible");
  DeviceMemory memory;
  MSA_CUDA_CHECK(cudaMemGetInfo(&memory.free_bytes, &memory.total_bytes));
  return memory;
}

Tensor device_zeros(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto buffer = std::make_shared<msa::cuda::DeviceBuffer>(bytes);
  buffer->fill_bytes(0);
  void* data = buffer->get();
  return Tensor::wrap(data, shape, dtype, std::move(buffer), Device::cuda);
}

std::string gib_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace msa::model::gpu
