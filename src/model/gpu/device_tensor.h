// Device memory for the CUDA text model as msa::Tensor views (Device::cuda), and the
// device's free memory for clear "does not fit" errors. Host-only header.
#pragma once
#include <cstddef>

#include "msa/tensor.h"

namespace msa::model::gpu {

struct DeviceMemory {
  size_t free_bytes = 0, total_bytes = 0;
};
// The current device's memory; throws msa::Error when no CUDA device is usable.
DeviceMemory device_memory();

// A zero-filled contiguous device tensor (Device::cuda); the tensor co-owns the memory.
Tensor device_zeros(const Shape& shape, DType dtype);

std::string gib_text(double bytes);  // "1.25 GiB"

}  // namespace msa::model::gpu
