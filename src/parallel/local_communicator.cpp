// The in-process communicator over host buffers (the protocol: rendezvous_communicator.h),
// the collectives' shared argument checks, exchange_counts and run_on_ranks.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include "msa/communicator.h"
#include "msa/error.h"
#include "parallel/rendezvous_communicator.h"

namespace msa {
namespace parallel {
namespace {

void check_dtype(DType dtype, const char* op) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::i32 && dtype != DType::i64)
    throw_arg_error(std::string(op) + " dtype", "f32, bf16, i32 or i64", dtype_name(dtype));
}

}  // namespace

void RendezvousCommunicator::all_reduce_sum(float* data, int64_t count, CommStream stream) {
  MSA_CHECK_ARG(count >= 0, "all_reduce_sum count", "a non-negative count", count);
  MSA_CHECK_ARG(data != nullptr || count == 0, "all_reduce_sum data", "a buffer", "null");
  buffers_ready(stream);
  Post& mine = begin(Op::all_reduce_sum);
  mine.count = count;
  mine.send = data;
  const std::vector<Post>& posts = exchange();
  for (int r = 1; r < world_size(); ++r)
    if (posts[r].count != posts[0].count) mismatch("all_reduce_sum count", r, posts[r].count, posts[0].count);
  // Rank order, every element: the same bits on every rank and in every run.
  std::vector<const float*> peers(world_size());
  for (int r = 0; r < world_size(); ++r) peers[r] = static_cast<const float*>(posts[r].send);
  if (count > 0) sum_peers(peers, count, stream);
  reads_done(stream);
  rendezvous_->arrive_and_wait();  // every peer has read `data`
  if (count > 0) write_sum(data, count, stream);
}

void RendezvousCommunicator::all_gather(const void* send, int64_t rows, int64_t row_elements, DType dtype,
                                        void* recv, CommStream stream) {
  MSA_CHECK_ARG(rows >= 0, "all_gather rows", "a non-negative count", rows);
  MSA_CHECK_ARG(row_elements >= 0, "all_gather row_elements", "a non-negative count", row_elements);
  check_dtype(dtype, "all_gather");
  const bool empty = rows == 0 || row_elements == 0;
  MSA_CHECK_ARG(send != nullptr || empty, "all_gather send", "a buffer", "null");
  MSA_CHECK_ARG(recv != nullptr || empty, "all_gather recv", "a buffer", "null");
  buffers_ready(stream);
  Post& mine = begin(Op::all_gather);
  mine.count = rows;
  mine.row_elements = row_elements;
  mine.dtype = dtype;
  mine.send = send;
  const std::vector<Post>& posts = exchange();
  for (int r = 1; r < world_size(); ++r) {
    if (posts[r].count != posts[0].count) mismatch("all_gather rows", r, posts[r].count, posts[0].count);
    if (posts[r].row_elements != posts[0].row_elements)
      mismatch("all_gather row_elements", r, posts[r].row_elements, posts[0].row_elements);
    if (posts[r].dtype != posts[0].dtype)
      mismatch("all_gather dtype", r, dtype_name(posts[r].dtype), dtype_name(posts[0].dtype));
  }
  const size_t bytes = static_cast<size_t>(rows * row_elements) * dtype_size(dtype);
  for (int r = 0; r < world_size(); ++r)
    if (bytes > 0) copy(static_cast<char*>(recv) + r * bytes, posts[r].send, bytes, stream);
  reads_done(stream);
  rendezvous_->arrive_and_wait();
}

void RendezvousCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_rows, void* recv,
                                          std::span<const int64_t> recv_rows, int64_t row_elements, DType dtype,
                                          CommStream stream) {
  const int world = world_size();
  MSA_CHECK_ARG(static_cast<int64_t>(send_rows.size()) == world, "all_to_all_v send_rows",
                std::to_string(world) + " counts (one per rank)", send_rows.size());
  MSA_CHECK_ARG(static_cast<int64_t>(recv_rows.size()) == world, "all_to_all_v recv_rows",
                std::to_string(world) + " counts (one per rank)", recv_rows.size());
  MSA_CHECK_ARG(row_elements >= 0, "all_to_all_v row_elements", "a non-negative count", row_elements);
  check_dtype(dtype, "all_to_all_v");
  int64_t sent = 0, received = 0;
  for (int p = 0; p < world; ++p) {
    MSA_CHECK_ARG(send_rows[p] >= 0, "all_to_all_v send_rows[" + std::to_string(p) + "]", "a non-negative count",
                  send_rows[p]);
    MSA_CHECK_ARG(recv_rows[p] >= 0, "all_to_all_v recv_rows[" + std::to_string(p) + "]", "a non-negative count",
                  recv_rows[p]);
    sent += send_rows[p];
    received += recv_rows[p];
  }
  MSA_CHECK_ARG(send != nullptr || sent * row_elements == 0, "all_to_all_v send", "a buffer", "null");
  MSA_CHECK_ARG(recv != nullptr || received * row_elements == 0, "all_to_all_v recv", "a buffer", "null");
  buffers_ready(stream);
  Post& mine = begin(Op::all_to_all_v);
  mine.row_elements = row_elements;
  mine.dtype = dtype;
  mine.send = send;
  mine.send_rows.assign(send_rows.begin(), send_rows.end());
  mine.recv_rows.assign(recv_rows.begin(), recv_rows.end());
  const std::vector<Post>& posts = exchange();
  for (int r = 1; r < world; ++r) {
    if (posts[r].row_elements != posts[0].row_elements)
      mismatch("all_to_all_v row_elements", r, posts[r].row_elements, posts[0].row_elements);
    if (posts[r].dtype != posts[0].dtype)
      mismatch("all_to_all_v dtype", r, dtype_name(posts[r].dtype), dtype_name(posts[0].dtype));
  }
  // The whole count matrix, on every rank: each sees the same first disagreement.
  for (int to = 0; to < world; ++to)
    for (int from = 0; from < world; ++from)
      if (posts[to].recv_rows[from] != posts[from].send_rows[to])
        throw Error("communicator: all_to_all_v counts disagree: rank " + std::to_string(from) + " sends " +
                    std::to_string(posts[from].send_rows[to]) + " rows to rank " + std::to_string(to) +
                    ", which expects " + std::to_string(posts[to].recv_rows[from]));
  const size_t row_bytes = static_cast<size_t>(row_elements) * dtype_size(dtype);
  char* out = static_cast<char*>(recv);
  for (int from = 0; from < world; ++from) {
    int64_t offset = 0;  // rows before the part for this rank in the sender's buffer
    for (int p = 0; p < rank_; ++p) offset += posts[from].send_rows[p];
    const size_t bytes = static_cast<size_t>(recv_rows[from]) * row_bytes;
    if (bytes > 0) copy(out, static_cast<const char*>(posts[from].send) + offset * row_bytes, bytes, stream);
    out += bytes;
  }
  reads_done(stream);
  rendezvous_->arrive_and_wait();
}

void RendezvousCommunicator::barrier() {
  begin(Op::barrier);
  exchange();
}

// This rank's slot, reset for a new collective (nobody reads it until phase A).
Post& RendezvousCommunicator::begin(Op op) {
  Post& mine = rendezvous_->post(rank_);
  mine = Post{};
  mine.op = op;
  return mine;
}

// Phase A, then the check every collective shares: all ranks called the same one.
const std::vector<Post>& RendezvousCommunicator::exchange() {
  rendezvous_->arrive_and_wait();
  const std::vector<Post>& posts = rendezvous_->posts();
  for (int r = 1; r < world_size(); ++r)
    if (posts[r].op != posts[0].op)
      throw Error(std::string("communicator: rank 0 called ") + op_name(posts[0].op) + " while " + rank_text(r) +
                  " called " + op_name(posts[r].op));
  return posts;
}

template <class T>
void RendezvousCommunicator::mismatch(const std::string& what, int rank, const T& got, const T& first) {
  throw Error(detail::concat("communicator: ", what, " differs between ranks: rank 0 passed ", first, ", ",
                             rank_text(rank), " passed ", got));
}

// Host buffers: plain copies and a loop (the stream is ignored).
class HostCommunicator final : public RendezvousCommunicator {
 public:
  using RendezvousCommunicator::RendezvousCommunicator;

 protected:
  void buffers_ready(CommStream) override {}
  void sum_peers(const std::vector<const float*>& peers, int64_t count, CommStream) override {
    sum_.assign(static_cast<size_t>(count), 0.0f);
    std::copy_n(peers[0], count, sum_.data());
    for (size_t r = 1; r < peers.size(); ++r)
      for (int64_t i = 0; i < count; ++i) sum_[i] += peers[r][i];
  }
  void write_sum(float* data, int64_t count, CommStream) override { std::copy_n(sum_.data(), count, data); }
  void copy(void* dst, const void* src, size_t bytes, CommStream) override { std::memcpy(dst, src, bytes); }
  void reads_done(CommStream) override {}

 private:
  std::vector<float> sum_;
};

}  // namespace parallel

#ifndef MSA_WITH_CUDA
std::vector<std::unique_ptr<Communicator>> make_local_device_communicators(int) {
  throw Error("make_local_device_communicators: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
}
#endif

#ifndef MSA_WITH_NCCL
bool nccl_available() { return false; }
NcclUniqueId make_nccl_unique_id() {
  throw Error("NCCL: this build of msa has no NCCL (configure with -DMSA_CUDA=ON and the CUDA toolkit's NCCL)");
}
std::unique_ptr<Communicator> make_nccl_communicator(int, int, const NcclUniqueId&, int) {
  throw Error("NCCL: this build of msa has no NCCL (configure with -DMSA_CUDA=ON and the CUDA toolkit's NCCL)");
}
#endif

std::vector<int64_t> exchange_counts(Communicator& comm, std::span<const int64_t> send_rows) {
  const int world = comm.world_size();
  MSA_CHECK_ARG(static_cast<int64_t>(send_rows.size()) == world, "send_rows",
                std::to_string(world) + " counts (one per rank)", send_rows.size());
  std::vector<int64_t> matrix(static_cast<size_t>(world) * world);
  comm.all_gather(send_rows.data(), 1, world, DType::i64, matrix.data());
  std::vector<int64_t> recv_rows(world);
  for (int p = 0; p < world; ++p) recv_rows[p] = matrix[static_cast<size_t>(p) * world + comm.rank()];
  return recv_rows;
}

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int world_size) {
  // Threads of one process: more than a few hundred ranks is a mistake, not a machine.
  constexpr int kMaxLocalRanks = 256;
  MSA_CHECK_ARG(world_size >= 1 && world_size <= kMaxLocalRanks, "world_size",
                "a rank count in [1, " + std::to_string(kMaxLocalRanks) + "]", world_size);
  auto rendezvous = std::make_shared<parallel::Rendezvous>(world_size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world_size; ++r) comms.push_back(std::make_unique<parallel::HostCommunicator>(rendezvous, r));
  return comms;
}

void run_on_ranks(std::span<const std::unique_ptr<Communicator>> comms,
                  const std::function<void(Communicator&)>& fn, int threads_per_rank) {
  MSA_CHECK_ARG(!comms.empty(), "comms", "at least one communicator", 0);
  MSA_CHECK_ARG(threads_per_rank >= 0, "threads_per_rank", "a non-negative count", threads_per_rank);
  std::vector<parallel::RendezvousCommunicator*> local;
  for (size_t r = 0; r < comms.size(); ++r) {
    auto* comm = dynamic_cast<parallel::RendezvousCommunicator*>(comms[r].get());
    if (!comm || comm->rank() != static_cast<int>(r) ||
        comm->world_size() != static_cast<int>(comms.size()) ||
        &comm->rendezvous() != &dynamic_cast<parallel::RendezvousCommunicator&>(*comms[0]).rendezvous())
      throw_arg_error("comms[" + std::to_string(r) + "]",
                      "rank " + std::to_string(r) + " of one make_local_communicators(" +
                          std::to_string(comms.size()) + ") set, in rank order",
                      comm ? "another communicator" : "not an in-process communicator");
    local.push_back(comm);
  }
  local[0]->rendezvous().start_run();
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      parallel::RendezvousCommunicator& comm = *local[r];
      try {
        if (threads_per_rank > 0) omp_set_num_threads(threads_per_rank);
        fn(comm);
        comm.rendezvous().leave(static_cast<int>(r));
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        comm.rendezvous().abort(parallel::rank_text(static_cast<int>(r)) + " failed: " + e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        comm.rendezvous().abort(parallel::rank_text(static_cast<int>(r)) + " failed");
      }
    });
  for (std::thread& thread : threads) thread.join();
  // The cause first: a rank's own error rather than another's "rank R failed".
  std::exception_ptr first_aborted;
  for (const std::exception_ptr& error : errors) {
    if (!error) continue;
    try {
      std::rethrow_exception(error);
    } catch (const parallel::RendezvousAborted&) {
      if (!first_aborted) first_aborted = error;
    } catch (...) {
      std::rethrow_exception(error);
    }
  }
  if (first_aborted) std::rethrow_exception(first_aborted);
}

}  // namespace msa
