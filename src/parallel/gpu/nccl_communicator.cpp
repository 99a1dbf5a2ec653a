// The NCCL communicator (make_nccl_communicator): every collective of msa/communicator.h as
// the NCCL call it maps onto, enqueued on the rank's stream; nothing waits on the host.
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/common/cuda_check.h"
#include "msa/communicator.h"

namespace msa {
namespace {

#define MSA_NCCL_CHECK(call)                                                                         \
  do {                                                                                               \
    const ncclResult_t msa_nccl_status = (call);                                                     \
    if (msa_nccl_status != ncclSuccess)                                                              \
      MSA_FAIL("NCCL error at ", __FILE__, ":", __LINE__, ": ", #call, ": ", ncclGetErrorString(msa_nccl_status), \
               " (", static_cast<int>(msa_nccl_status), ")");                                        \
  } while (0)

ncclDataType_t nccl_type(DType dtype, const char* op) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    default: break;
  }
  throw_arg_error(std::string(op) + " dtype", "f32, bf16, i32 or i64", dtype_name(dtype));
}

// The GPU machines are shared and NVLink SHARP multicast (NVLS) must stay off on them. NCCL
// reads NCCL_NVLS_ENABLE from the environment (once, cached): it is set before any NCCL call
// of this process unless the environment already says otherwise (overwrite = 0). A fixed part
// of the communicator's setup, not an engine switch.
void keep_nvls_off() { setenv("NCCL_NVLS_ENABLE", "0", 0); }

cudaStream_t stream_of(CommStream stream) { return static_cast<cudaStream_t>(stream.handle); }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world, const NcclUniqueId& id, int device) : rank_(rank), world_(world), device_(device) {
    MSA_CUDA_CHECK(cudaSetDevice(device));
    ncclUniqueId unique;
    static_assert(sizeof(unique.internal) == sizeof(id.bytes));
    std::memcpy(unique.internal, id.bytes, sizeof(id.bytes));
    MSA_NCCL_CHECK(ncclCommInitRank(&comm_, world, unique, rank));
    MSA_CUDA_CHECK(cudaMalloc(&one_, sizeof(float)));
  }
  ~NcclCommunicator() override {
    if (one_) cudaFree(one_);
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // NCCL's sum order over ranks is its own (ring / tree): deterministic for a given world size
  // and topology, not necessarily the rank order of the in-process communicators.
  void all_reduce_sum(float* data, int64_t count, CommStream stream) override {
    MSA_CHECK_ARG(count >= 0, "all_reduce_sum count", "a non-negative count", count);
    MSA_CHECK_ARG(data != nullptr || count == 0, "all_reduce_sum data", "a buffer", "null");
    if (count == 0) return;
    MSA_NCCL_CHECK(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_,
                                 stream_of(stream)));
  }

  void all_gather(const void* send, int64_t rows, int64_t row_elements, DType dtype, void* recv,
                  CommStream stream) override {
    MSA_CHECK_ARG(rows >= 0, "all_gather rows", "a non-negative count", rows);
    MSA_CHECK_ARG(row_elements >= 0, "all_gather row_elements", "a non-negative count", row_elements);
    const ncclDataType_t type = nccl_type(dtype, "all_gather");
    const size_t count = static_cast<size_t>(rows * row_elements);
    if (count == 0) return;
    MSA_CHECK_ARG(send != nullptr && recv != nullptr, "all_gather send / recv", "device buffers", "null");
    MSA_NCCL_CHECK(ncclAllGather(send, recv, count, type, comm_, stream_of(stream)));
  }

  void all_to_all_v(const void* send, std::span<const int64_t> send_rows, void* recv,
                    std::span<const int64_t> recv_rows, int64_t row_elements, DType dtype,
                    CommStream stream) override {
    MSA_CHECK_ARG(static_cast<int64_t>(send_rows.size()) == world_, "all_to_all_v send_rows",
                  std::to_string(world_) + " counts (one per rank)", send_rows.size());
    MSA_CHECK_ARG(static_cast<int64_t>(recv_rows.size()) == world_, "all_to_all_v recv_rows",
                  std::to_string(world_) + " counts (one per rank)", recv_rows.size());
    MSA_CHECK_ARG(row_elements >= 0, "all_to_all_v row_elements", "a non-negative count", row_elements);
    const ncclDataType_t type = nccl_type(dtype, "all_to_all_v");
    for (int p = 0; p < world_; ++p) {
      MSA_CHECK_ARG(send_rows[p] >= 0, "all_to_all_v send_rows[" + std::to_string(p) + "]", "a non-negative count",
                    send_rows[p]);
      MSA_CHECK_ARG(recv_rows[p] >= 0, "all_to_all_v recv_rows[" + std::to_string(p) + "]", "a non-negative count",
                    recv_rows[p]);
    }
    const size_t row_bytes = static_cast<size_t>(row_elements) * dtype_size(dtype);
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    // Unlike the in-process communicators, NCCL cannot check that the peers' counts agree: a
    // disagreement hangs or fails inside NCCL. The counts come from one all_gather
    // (exchange_counts or the model's), so they agree by construction.
    MSA_NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < world_; ++p) {
      const size_t sent = static_cast<size_t>(send_rows[p]) * row_elements;
      const size_t received = static_cast<size_t>(recv_rows[p]) * row_elements;
      if (sent > 0) MSA_NCCL_CHECK(ncclSend(in, sent, type, p, comm_, stream_of(stream)));
      if (received > 0) MSA_NCCL_CHECK(ncclRecv(out, received, type, p, comm_, stream_of(stream)));
      in += static_cast<size_t>(send_rows[p]) * row_bytes;
      out += static_cast<size_t>(recv_rows[p]) * row_bytes;
    }
    MSA_NCCL_CHECK(ncclGroupEnd());
  }

  // NCCL has no barrier: an all-reduce of one value, waited for on the host.
  void barrier() override {
    MSA_CUDA_CHECK(cudaSetDevice(device_));
    MSA_NCCL_CHECK(ncclAllReduce(one_, one_, 1, ncclFloat32, ncclSum, comm_, nullptr));
    MSA_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

 private:
  const int rank_, world_, device_;
  ncclComm_t comm_ = nullptr;
  float* one_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }

NcclUniqueId make_nccl_unique_id() {
  keep_nvls_off();
  ncclUniqueId unique;
  MSA_NCCL_CHECK(ncclGetUniqueId(&unique));
  NcclUniqueId id;
  std::memcpy(id.bytes, unique.internal, sizeof(id.bytes));
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size, const NcclUniqueId& id, int device) {
  MSA_CHECK_ARG(world_size >= 1, "world_size", "at least one rank", world_size);
  MSA_CHECK_ARG(rank >= 0 && rank < world_size, "rank", "a rank in [0, " + std::to_string(world_size) + ")", rank);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  MSA_CHECK_ARG(device >= 0 && device < devices, "device",
                "a CUDA device index in [0, " + std::to_string(devices) + ")", device);
  keep_nvls_off();
  return std::make_unique<NcclCommunicator>(rank, world_size, id, device);
}

}  // namespace msa
