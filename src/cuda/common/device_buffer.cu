#include "device_buffer.h"
#include "cuda/common/common.cuh"

namespace msa::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return count;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) MSA_CUDA_CHECK(cudaMalloc(&data_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes) {
  if (bytes > bytes_) MSA_FAIL("DeviceBuffer::upload: ", bytes, " bytes into a buffer of ", bytes_);
  if (bytes) MSA_CUDA_CHECK(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  if (bytes > bytes_)
    MSA_FAIL("DeviceBuffer::download: ", bytes, " bytes from a buffer of ", bytes_);
  if (bytes) MSA_CUDA_CHECK(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_bytes(uint8_t value) {
  if (bytes_) MSA_CUDA_CHECK(cudaMemset(data_, value, bytes_));
}

void synchronize() { MSA_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace msa::cuda
