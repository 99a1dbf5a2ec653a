// Collectives between the ranks of a tensor- / expert-parallel model (docs/parallel.md).
//
// One Communicator per rank. Every rank calls the same collectives in the same order with
// matching sizes; each call returns when this rank's output is complete. The operations map
// one to one onto NCCL so that a device implementation is a thin wrapper:
//
//   all_reduce_sum  -> ncclAllReduce(ncclFloat32, ncclSum)
//   all_gather      -> ncclAllGather (equal rows from every rank)
//   all_to_all_v    -> ncclGroupStart; per peer ncclSend + ncclRecv; ncclGroupEnd
//   barrier         -> an all-reduce of one value (NCCL has no barrier)
//
// Buffers are host pointers for the in-process communicator and device pointers for a device
// one; `stream` is the device's stream (cudaStream_t) as an opaque handle, ignored on the host.
//
// Determinism: all_reduce_sum adds the ranks' values in rank order, ((r0 + r1) + r2) + ...,
// so a given world size gives bitwise the same result on every rank and in every run.
//
//   std::vector<std::unique_ptr<msa::Communicator>> comms = msa::make_local_communicators(4);
//   msa::run_on_ranks(comms, [&](msa::Communicator& comm) { ... comm.all_reduce_sum(x, n); });
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "msa/dtype.h"

namespace msa {

// A device stream (cudaStream_t) as an opaque handle; null: the default stream / the host.
struct CommStream {
  void* handle = nullptr;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // data[0, count) <- the sum over ranks (rank order) of every rank's data[0, count), in place.
  // Every rank passes the same count.
  virtual void all_reduce_sum(float* data, int64_t count, CommStream stream = {}) = 0;

  // recv [world * rows, row_elements] <- every rank's send [rows, row_elements], in rank
  // order. Every rank passes the same rows, row_elements and dtype (f32, bf16, i32 or i64).
  virtual void all_gather(const void* send, int64_t rows, int64_t row_elements, DType dtype,
                          void* recv, CommStream stream = {}) = 0;

  // Variable all-to-all: send holds send_rows[p] rows for peer p, peer after peer; recv
  // receives recv_rows[p] rows from peer p, peer after peer. Each side's counts must agree
  // (recv_rows[p] on this rank == send_rows[this rank] on rank p); rows of row_elements
  // elements of dtype (the same on every rank). Rows to oneself are copied.
  virtual void all_to_all_v(const void* send, std::span<const int64_t> send_rows, void* recv,
                            std::span<const int64_t> recv_rows, int64_t row_elements, DType dtype,
                            CommStream stream = {}) = 0;

  // Returns when every rank has entered it.
  virtual void barrier() = 0;
};

// The counts a rank receives in an all_to_all_v with these send counts: recv_rows[p] =
// send_rows[rank] of peer p (one all_gather of the count vectors).
std::vector<int64_t> exchange_counts(Communicator& comm, std::span<const int64_t> send_rows);

// N ranks in one process (N threads, one communicator each, sharing one rendezvous): what the
// parallel model's CPU tests and `msa run --tp N` use. Mismatched calls (different
// collectives, sizes, dtypes or counts between ranks) throw msa::Error on every rank instead
// of hanging; so does a collective that a failed or finished rank (run_on_ranks) never joins.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int world_size);

// N ranks as N threads on the current CUDA device, each with its own stream (CommStream):
// the same rendezvous as make_local_communicators, over device buffers. A collective waits
// for the rank's stream (cudaStreamSynchronize), exchanges the buffers' addresses, copies the
// peers' rows (cudaMemcpyAsync) or sums the peers' values with a small kernel in rank order
// (bitwise the host version's sums), waits for those reads and meets the peers again; the
// all-reduce writes its result back in order on the rank's stream, so it returns before that
// copy has run. Host buffers work in all_gather / all_to_all_v (the copies are
// cudaMemcpyDefault), not in all_reduce_sum. What one GPU uses to test the parallel CUDA model
// (several ranks, one device). Throws msa::Error in a build without CUDA.
std::vector<std::unique_ptr<Communicator>> make_local_device_communicators(int world_size);

// One rank of an NCCL communicator on CUDA device `device` (one process per GPU, or several
// ranks of one process on different devices): collectives on device buffers, ordered on the
// CommStream (no host sync). `id` is make_nccl_unique_id()'s, made by one rank and passed to
// all (a file or a pipe). NVLink SHARP multicast stays off (NCCL_NVLS_ENABLE=0 unless the
// process environment already sets it). Throws msa::Error in a build without NCCL, and with
// ncclGetErrorString's text when NCCL fails.
struct NcclUniqueId {
  unsigned char bytes[128] = {};
};
bool nccl_available();  // whether this build has NCCL
NcclUniqueId make_nccl_unique_id();
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size, const NcclUniqueId& id, int device);

// Runs fn(comm) for every communicator of make_local_communicators (or
// make_local_device_communicators) on its own thread and
// waits for all. When a rank throws, the others' pending and later collectives throw too
// ("rank R failed: ..."), and the first rank's error (lowest rank among the originals) is
// rethrown here. `threads_per_rank` > 0 sets each rank thread's OpenMP team size (0: leave the
// default, which on a small machine oversubscribes the cores N times).
void run_on_ranks(std::span<const std::unique_ptr<Communicator>> comms,
                  const std::function<void(Communicator&)>& fn, int threads_per_rank = 0);

}  // namespace msa
