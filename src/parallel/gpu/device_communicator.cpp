// The in-process communicator over device buffers (make_local_device_communicators): the
// rendezvous of rendezvous_communicator.h with cudaMemcpyAsync copies and a reduce kernel
// (device_reduce.cu).
// Ranks are threads on one device (one context), so a peer's device pointer is readable here
// as it is; each rank's work goes on its own stream.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device_buffer.h"
#include "msa/communicator.h"
#include "parallel/gpu/device_reduce.h"
#include "parallel/rendezvous_communicator.h"

namespace msa {
namespace parallel {
namespace {

cudaStream_t stream_of(CommStream stream) { return static_cast<cudaStream_t>(stream.handle); }

class DeviceCommunicator final : public RendezvousCommunicator {
 public:
  using RendezvousCommunicator::RendezvousCommunicator;

 protected:
  void buffers_ready(CommStream stream) override { MSA_CUDA_CHECK(cudaStreamSynchronize(stream_of(stream))); }
  void sum_peers(const std::vector<const float*>& peers, int64_t count, CommStream stream) override {
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (sum_.bytes() < bytes) {
      // The previous result may still be in flight to its destination on this stream.
      MSA_CUDA_CHECK(cudaStreamSynchronize(stream_of(stream)));
      sum_ = cuda::DeviceBuffer();
      sum_ = cuda::DeviceBuffer(bytes);
    }
    PeerPointers pointers{};
    for (size_t r = 0; r < peers.size(); ++r) pointers.at[r] = peers[r];
    sum_peers_on_device(pointers, static_cast<int>(peers.size()), count, sum_.as<float>(), stream.handle);
  }
  void write_sum(float* data, int64_t count, CommStream stream) override {
    MSA_CUDA_CHECK(cudaMemcpyAsync(data, sum_.get(), static_cast<size_t>(count) * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream_of(stream)));
  }
  void copy(void* dst, const void* src, size_t bytes, CommStream stream) override {
    MSA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(stream)));
  }
  void reads_done(CommStream stream) override { MSA_CUDA_CHECK(cudaStreamSynchronize(stream_of(stream))); }

 private:
  cuda::DeviceBuffer sum_;  // this rank's all-reduce result before it is written back
};

}  // namespace
}  // namespace parallel

std::vector<std::unique_ptr<Communicator>> make_local_device_communicators(int world_size) {
  MSA_CHECK_ARG(world_size >= 1 && world_size <= parallel::kMaxDeviceRanks, "world_size",
                "a rank count in [1, " + std::to_string(parallel::kMaxDeviceRanks) + "]", world_size);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    throw Error("make_local_device_communicators: no CUDA device");
  }
  auto rendezvous = std::make_shared<parallel::Rendezvous>(world_size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world_size; ++r)
    comms.push_back(std::make_unique<parallel::DeviceCommunicator>(rendezvous, r));
  return comms;
}

}  // namespace msa
