// The rendezvous that the in-process communicators share (src/parallel/local_communicator.cpp
// for host buffers, src/parallel/gpu/device_communicator.cu for device buffers): N ranks as N
// threads of one process.
//
// Every collective is two barrier phases. Each rank first posts its arguments (pointers and
// sizes) into its own slot and waits for all (phase A); then every rank checks all posts the
// same way (so a mismatch throws on every rank, never hangs), reads what it needs straight
// from its peers' buffers and waits again (phase B) so that no peer reuses a buffer that is
// still being read. An all-reduce sums into a private buffer and writes it back after phase B
// (the ranks' inputs are their outputs). A failed rank (or one that returned from
// run_on_ranks' function) aborts the rendezvous: the other ranks' waits throw.
//
// RendezvousCommunicator holds the protocol and the checks; what moves the bytes (host
// memcpy and loops, or device copies and a reduce kernel) is a subclass's.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "msa/communicator.h"
#include "msa/error.h"

namespace msa::parallel {

// Thrown in the ranks that did not fail themselves once another rank aborted the rendezvous.
class RendezvousAborted : public Error {
 public:
  using Error::Error;
};

enum class Op { all_reduce_sum, all_gather, all_to_all_v, barrier };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce_sum: return "all_reduce_sum";
    case Op::all_gather: return "all_gather";
    case Op::all_to_all_v: return "all_to_all_v";
    case Op::barrier: return "barrier";
  }
  return "?";
}

// One rank's arguments to the current collective.
struct Post {
  Op op = Op::barrier;
  int64_t count = 0;         // all_reduce_sum: values; all_gather: rows
  int64_t row_elements = 0;  // all_gather, all_to_all_v
  DType dtype = DType::f32;
  const void* send = nullptr;
  std::vector<int64_t> send_rows, recv_rows;  // all_to_all_v
};

class Rendezvous {
 public:
  explicit Rendezvous(int world) : world_(world), posts_(world), departed_(world, false) {}

  int world() const { return world_; }
  Post& post(int rank) { return posts_[rank]; }
  const std::vector<Post>& posts() const { return posts_; }

  // Waits until every rank has arrived; throws when the rendezvous is (or gets) aborted or
  // when a rank has left, since that rank will never arrive.
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw RendezvousAborted(reason_);
    for (int r = 0; r < world_; ++r)
      if (departed_[r]) abort_locked("rank " + std::to_string(r) + " returned without joining this collective");
    if (aborted_) throw RendezvousAborted(reason_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      ready_.notify_all();
      return;
    }
    ready_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw RendezvousAborted(reason_);
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_locked(reason);
  }

  // A new run_on_ranks: every rank is present again (an aborted rendezvous stays aborted).
  void start_run() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::fill(departed_.begin(), departed_.end(), false);
  }

  // A rank that has finished: ranks waiting for it now, or later, would wait forever.
  void leave(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    departed_[rank] = true;
    if (arrived_ > 0) abort_locked("rank " + std::to_string(rank) + " returned without joining this collective");
  }

 private:
  void abort_locked(const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      reason_ = "communicator: " + reason;
    }
    ready_.notify_all();
  }

  const int world_;
  std::vector<Post> posts_;  // slot r is written by rank r only, before phase A
  std::mutex mutex_;
  std::condition_variable ready_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string reason_;
  std::vector<bool> departed_;
};


inline std::string rank_text(int rank) { return "rank " + std::to_string(rank); }

class RendezvousCommunicator : public Communicator {
 public:
  RendezvousCommunicator(std::shared_ptr<Rendezvous> rendezvous, int rank)
      : rendezvous_(std::move(rendezvous)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return rendezvous_->world(); }
  Rendezvous& rendezvous() { return *rendezvous_; }

  void all_reduce_sum(float* data, int64_t count, CommStream stream) final;
  void all_gather(const void* send, int64_t rows, int64_t row_elements, DType dtype, void* recv,
                  CommStream stream) final;
  void all_to_all_v(const void* send, std::span<const int64_t> send_rows, void* recv,
                    std::span<const int64_t> recv_rows, int64_t row_elements, DType dtype,
                    CommStream stream) final;
  void barrier() final;

 protected:
  // Before this rank posts its buffers: they must hold their values when a peer reads them
  // (a device implementation waits for `stream`).
  virtual void buffers_ready(CommStream stream) = 0;
  // A private buffer <- peers[0] + peers[1] + ... (element by element, in this order).
  virtual void sum_peers(const std::vector<const float*>& peers, int64_t count, CommStream stream) = 0;
  // data <- the private buffer (after phase B: no peer reads data any more).
  virtual void write_sum(float* data, int64_t count, CommStream stream) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes, CommStream stream) = 0;
  // Before phase B: every read of a peer's buffer this rank started has completed.
  virtual void reads_done(CommStream stream) = 0;

 private:
  Post& begin(Op op);
  const std::vector<Post>& exchange();
  template <class T>
  [[noreturn]] void mismatch(const std::string& what, int rank, const T& got, const T& first);

  std::shared_ptr<Rendezvous> rendezvous_;
  const int rank_;
};

}  // namespace msa::parallel
