// Device memory for the host-side glue: an owning buffer, copies, and the device count.
// Host-only header (no CUDA headers); implemented in device_buffer.cu.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace msa::cuda {

int device_count();  // 0 when the driver or a device is missing

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }

  void upload(const void* host, size_t bytes);
  void download(void* host, size_t bytes) const;
  void fill_bytes(uint8_t value);  // poison or clear

  template <class T>
  static DeviceBuffer from(const std::vector<T>& values) {
    DeviceBuffer buffer(values.size() * sizeof(T));
    buffer.upload(values.data(), buffer.bytes());
    return buffer;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

void synchronize();  // waits for the device; throws msa::Error on a kernel fault

}  // namespace msa::cuda
