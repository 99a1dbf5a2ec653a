// The tensor- / expert-parallel model on CUDA (docs/parallel.md) on one GPU: several ranks as
// threads of this process, each with its own stream and device copy of its part.
//   - the device in-process communicator's collectives against plain host loops (world 1..4,
//     zero rows from some ranks; the all-reduce bitwise the rank-order host sum);
//   - the NCCL communicator with one rank on this GPU, and two ranks over two GPUs when the
//     machine has them (skipped otherwise);
//   - ParallelModel on Device::cuda with 1, 2 and 4 ranks against the single-rank CUDA model
//     (Model::load(dir, Device::cuda)) over a prefill of three requests and three decode
//     steps: the norm-wise relative logit error below 1e-3 (bf16 weights and activations; the
//     ranks only change the order of the f32 sums: o_proj's and the MLPs' partial sums, the
//     all-reduce, the routed experts' GEMMs per (peer, expert) segment instead of per expert;
//     a rounding difference reaches the next bf16 GEMM input, so the logits differ by
//     ~1e-4, not 1e-7 as in the f32 CPU test), every rank's logits bitwise the same, and two
//     runs of 4 ranks bitwise equal;
//   - `msa run --tp 1 --device cuda` (the one-process-per-GPU path with one NCCL rank)
//     generates what `msa run --device cuda` does.
// Skipped (not failed) without a CUDA device; label "gpu".
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <thread>

#include "cli_runner.h"
#include "msa/communicator.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/parallel_model.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;
using testing::relative_error;

#define MSA_REQUIRE_CUDA() \
  if (!impl_available(Impl::cuda)) GTEST_SKIP() << "no CUDA device"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A device buffer that frees itself; the tests copy host vectors in and out.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (count_ > 0 && cudaMalloc(&data_, count_ * sizeof(T)) != cudaSuccess) throw Error("cudaMalloc failed");
  }
  DeviceArray(const std::vector<T>& values, cudaStream_t stream) : DeviceArray(values.size()) {
    if (count_ > 0) cudaMemcpyAsync(data_, values.data(), count_ * sizeof(T), cudaMemcpyHostToDevice, stream);
  }
  ~DeviceArray() {
    if (data_) cudaFree(data_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return data_; }
  std::vector<T> read(cudaStream_t stream) const {
    std::vector<T> host(count_);
    if (count_ > 0) cudaMemcpyAsync(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw Error("cudaStreamSynchronize failed");
    return host;
  }

 private:
  size_t count_;
  T* data_ = nullptr;
};

// A stream per rank thread.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) throw Error("cudaStreamCreate failed");
  }
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
  CommStream comm() const { return CommStream{s}; }
};

// Rank r's values for an all-reduce of `count` (seed by rank and call).
std::vector<float> rank_values(int rank, int64_t count, int call) {
  std::mt19937 gen(1000 * call + rank);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = value(gen) * (1.0f + static_cast<float>(rank));
  return v;
}

// The host version's sum: ((r0 + r1) + r2) + ..., element by element.
std::vector<float> rank_order_sum(int world, int64_t count, int call) {
  std::vector<float> sum = rank_values(0, count, call);
  for (int r = 1; r < world; ++r) {
    const std::vector<float> v = rank_values(r, count, call);
    for (int64_t i = 0; i < count; ++i) sum[i] += v[i];
  }
  return sum;
}

// Rows rank `from` sends rank `to` in all-to-all-v test `round`: 0..3, zero for some pairs.
int64_t pair_rows(int from, int to, int round) { return (3 * from + 2 * to + round) % 4; }

// The value of element `col` of row `row` that `from` sends `to`.
int32_t pair_value(int from, int to, int64_t row, int64_t col) {
  return static_cast<int32_t>(1000000 * from + 10000 * to + 100 * row + col);
}

// Every collective of one rank against host loops; failures name the rank and the element.
void check_collectives(Communicator& comm) {
  const int rank = comm.rank(), world = comm.world_size();
  Stream stream;
  for (int call = 0; call < 2; ++call)  // twice: the result buffer's reuse
    for (int64_t count : {0, 1, 37, 5000}) {
      DeviceArray<float> data(rank_values(rank, count, call), stream.s);
      comm.all_reduce_sum(data.get(), count, stream.comm());
      const std::vector<float> got = data.read(stream.s);
      const std::vector<float> want = rank_order_sum(world, count, call);
      for (int64_t i = 0; i < count; ++i)
        ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
            << "all_reduce_sum world " << world << " rank " << rank << " count " << count << " call " << call
            << " element " << i << ": got " << got[i] << ", the rank-order host sum is " << want[i];
    }
  for (int64_t rows : {0, 3}) {
    const int64_t width = 5;
    std::vector<int32_t> mine(rows * width);
    for (int64_t i = 0; i < rows * width; ++i) mine[i] = pair_value(rank, 0, i / width, i % width);
    DeviceArray<int32_t> send(mine, stream.s);
    DeviceArray<int32_t> recv(world * rows * width);
    comm.all_gather(send.get(), rows, width, DType::i32, recv.get(), stream.comm());
    const std::vector<int32_t> got = recv.read(stream.s);
    for (int r = 0; r < world; ++r)
      for (int64_t i = 0; i < rows * width; ++i)
        ASSERT_EQ(got[r * rows * width + i], pair_value(r, 0, i / width, i % width))
            << "all_gather world " << world << " rank " << rank << " rows " << rows << ": from rank " << r
            << " element " << i;
    // f32 rows too (the copies do not care, but the dtype check does).
    std::vector<float> f(rows * width, static_cast<float>(rank) + 0.5f);
    DeviceArray<float> fsend(f, stream.s);
    DeviceArray<float> frecv(world * rows * width);
    comm.all_gather(fsend.get(), rows, width, DType::f32, frecv.get(), stream.comm());
    const std::vector<float> fgot = frecv.read(stream.s);
    for (int r = 0; r < world; ++r)
      for (int64_t i = 0; i < rows * width; ++i)
        ASSERT_EQ(fgot[r * rows * width + i], static_cast<float>(r) + 0.5f)
            << "all_gather f32 world " << world << " rank " << rank << " from rank " << r;
  }
  for (int round = 0; round < 3; ++round) {
    const int64_t width = 7;
    std::vector<int64_t> send_rows(world), recv_rows(world);
    std::vector<int32_t> mine;
    for (int to = 0; to < world; ++to) {
      send_rows[to] = pair_rows(rank, to, round);
      recv_rows[to] = pair_rows(to, rank, round);
      for (int64_t row = 0; row < send_rows[to]; ++row)
        for (int64_t col = 0; col < width; ++col) mine.push_back(pair_value(rank, to, row, col));
    }
    int64_t received = 0;
    for (int64_t n : recv_rows) received += n;
    DeviceArray<int32_t> send(mine, stream.s);
    DeviceArray<int32_t> recv(received * width);
    comm.all_to_all_v(send.get(), send_rows, recv.get(), recv_rows, width, DType::i32, stream.comm());
    const std::vector<int32_t> got = recv.read(stream.s);
    int64_t at = 0;
    for (int from = 0; from < world; ++from)
      for (int64_t row = 0; row < recv_rows[from]; ++row)
        for (int64_t col = 0; col < width; ++col, ++at)
          ASSERT_EQ(got[at], pair_value(from, rank, row, col))
              << "all_to_all_v world " << world << " rank " << rank << " round " << round << ": row " << row
              << " from rank " << from << ", column " << col;
  }
  comm.barrier();
}

TEST(DeviceCommunicator, CollectivesMatchHostLoops) {
  MSA_REQUIRE_CUDA();
  for (int world : {1, 2, 3, 4}) {
    const auto comms = make_local_device_communicators(world);
    run_on_ranks(comms, [](Communicator& comm) { check_collectives(comm); });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(DeviceCommunicator, MismatchesThrowOnEveryRank) {
  MSA_REQUIRE_CUDA();
  const auto comms = make_local_device_communicators(2);
  const std::string error = error_of([&] {
    run_on_ranks(comms, [](Communicator& comm) {
      Stream stream;
      DeviceArray<float> data(8);
      comm.all_reduce_sum(data.get(), comm.rank() == 0 ? 8 : 4, stream.comm());
    });
  });
  EXPECT_NE(error.find("all_reduce_sum count differs"), std::string::npos) << error;
  EXPECT_NE(error_of([] { make_local_device_communicators(0); }).find("world_size"), std::string::npos);
}

// ---- NCCL ----

TEST(NcclCommunicator, OneRankOnThisGpu) {
  MSA_REQUIRE_CUDA();
  if (!nccl_available()) GTEST_SKIP() << "this build has no NCCL";
  const NcclUniqueId id = make_nccl_unique_id();
  std::unique_ptr<Communicator> comm = make_nccl_communicator(0, 1, id, 0);
  ASSERT_EQ(comm->world_size(), 1);
  check_collectives(*comm);  // world 1: all-reduce a copy, all-to-all-v with itself
  EXPECT_NE(error_of([&] { make_nccl_communicator(1, 1, id, 0); }).find("rank"), std::string::npos);
  EXPECT_NE(error_of([&] { make_nccl_communicator(0, 1, id, 4096); }).find("device"), std::string::npos);
}

TEST(NcclCommunicator, TwoRanksOverTwoGpus) {
  MSA_REQUIRE_CUDA();
  if (!nccl_available()) GTEST_SKIP() << "this build has no NCCL";
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices < 2) {
    std::printf("NcclCommunicator.TwoRanksOverTwoGpus: %d CUDA device(s), needs 2: skipped\n", devices);
    GTEST_SKIP() << devices << " CUDA device(s): two ranks need two";
  }
  const NcclUniqueId id = make_nccl_unique_id();
  // NCCL's sum order is its own: the all-reduce is checked against the rank-order sum within
  // f32 rounding of two addends (exact here: two values sum the same either way).
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        cudaSetDevice(r);
        std::unique_ptr<Communicator> comm = make_nccl_communicator(r, 2, id, r);
        check_collectives(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// ---- the sharded CUDA model ----

// The tiny-tp-cuda preset: tiny-tp's layout (8 query / 4 KV / 4 index heads, 8 experts top 2)
// at CUDA-capable widths: head dim 64, block 64, top-k 2 blocks (selection past 128 tokens);
// 1 dense + 2 MSA/MoE layers; on 4 ranks one KV head, 2 experts, 96 dense and 32 shared
// columns each.
const fs::path& cuda_tp_dir() {
  static const fs::path dir = [] {
    fs::path d = fresh_dir("cuda_tp");
    write_random_checkpoint(model_config_preset("tiny-tp-cuda"), d.string(), {.seed = 23, .dtype = DType::bf16});
    return d;
  }();
  return dir;
}

std::vector<int32_t> some_tokens(int64_t n, int32_t salt) {
  std::vector<int32_t> tokens;
  uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(salt + 1);
  for (int64_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    tokens.push_back(static_cast<int32_t>(3 + (state >> 33) % 509));
  }
  return tokens;
}

constexpr int64_t kPages = 16;  // 200 + 37 + 5 tokens and 3 decode steps: 4 + 1 + 1 pages of 64

// Runs the steps on any forward (the single-rank model's or a rank's): three requests of 200,
// 37 and 5 tokens in one prefill (every logit), then three decode steps of all three (fixed
// tokens, so every run sees the same inputs). The logits of each step.
template <class Forward>
std::vector<Tensor> run_steps(Forward&& forward) {
  std::vector<SequenceCache> sequences(3);
  const std::vector<std::vector<int32_t>> prompts = {some_tokens(200, 1), some_tokens(37, 2), some_tokens(5, 3)};
  std::vector<Tensor> logits;
  std::vector<ForwardRequest> requests;
  for (size_t b = 0; b < prompts.size(); ++b)
    requests.push_back({.sequence = &sequences[b], .tokens = prompts[b], .all_logits = true});
  logits.push_back(forward(requests));
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> next(prompts.size());
    requests.clear();
    for (size_t b = 0; b < prompts.size(); ++b) {
      next[b] = static_cast<int32_t>(5 + 17 * step + 101 * b);
      requests.push_back({.sequence = &sequences[b], .tokens = std::span(&next[b], 1)});
    }
    logits.push_back(forward(requests));
  }
  return logits;
}

std::vector<Tensor> single_rank_logits() {
  const Model model = Model::load(cuda_tp_dir().string(), Device::cuda);
  KvCache cache(model.config(), kPages, DType::bf16, Device::cuda);
  return run_steps([&](std::span<const ForwardRequest> requests) { return model.forward(requests, cache); });
}

// [rank][step] logits of the parallel model on `world` ranks of this GPU.
std::vector<std::vector<Tensor>> parallel_logits(int world) {
  const auto comms = make_local_device_communicators(world);
  std::vector<std::vector<Tensor>> logits(world);
  run_on_ranks(comms, [&](Communicator& comm) {
    const ParallelModel model = ParallelModel::load(cuda_tp_dir().string(), comm, Device::cuda);
    KvCache cache(model.rank_config(), kPages, DType::bf16, Device::cuda);
    logits[comm.rank()] =
        run_steps([&](std::span<const ForwardRequest> requests) { return model.forward(requests, cache); });
  });
  return logits;
}

// Where two logit tensors differ most, for failure messages.
std::string worst_difference(const Tensor& want, const Tensor& got) {
  double worst = -1, scale = 0;
  int64_t at = 0;
  const int64_t n = want.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(want.get(i) - got.get(i));
    scale = std::max(scale, std::fabs(want.get(i)));
    if (d > worst) {
      worst = d;
      at = i;
    }
  }
  std::ostringstream text;
  const int64_t cols = want.size(1);
  text << "max |diff| " << worst << " at row " << at / cols << " column " << at % cols << " (single rank "
       << want.get(at) << ", parallel " << got.get(at) << "), max |logit| " << scale;
  return text.str();
}

TEST(CudaParallelModel, LogitsOfOneTwoAndFourRanksMatchTheSingleRankModel) {
  MSA_REQUIRE_CUDA();
  const std::vector<Tensor> expected = single_rank_logits();
  for (int world : {1, 2, 4}) {
    const std::vector<std::vector<Tensor>> got = parallel_logits(world);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(got[r].size(), expected.size()) << "world " << world << " rank " << r;
      for (size_t s = 0; s < expected.size(); ++s) {
        ASSERT_EQ(got[r][s].shape(), expected[s].shape()) << "world " << world << " rank " << r << " step " << s;
        const double rel = relative_error(got[r][s], expected[s]);
        EXPECT_LT(rel, 1e-3) << "world " << world << " rank " << r << " step " << s << " (0: prefill): logits rel "
                             << rel << "; " << worst_difference(expected[s], got[r][s]);
        if (r == 0 && s == 0)
          std::printf("world %d: prefill logits rel %.3g; %s\n", world, rel,
                      worst_difference(expected[s], got[r][s]).c_str());
        // Every rank computes lm_head on the same rows (the all-reduce gives every rank the
        // same bits): the same logits.
        EXPECT_EQ(std::memcmp(got[r][s].raw(), got[0][s].raw(), got[0][s].nbytes()), 0)
            << "world " << world << " rank " << r << " step " << s << ": logits differ from rank 0's; "
            << worst_difference(got[0][s], got[r][s]);
      }
    }
  }
}

// Every tap of each step, in order (name, host copy).
using StepTaps = std::vector<std::pair<std::string, Tensor>>;

template <class Forward>
std::vector<StepTaps> tapped_steps(Forward&& forward) {
  std::vector<StepTaps> taps;
  run_steps([&](std::span<const ForwardRequest> requests) {
    StepTaps& step = taps.emplace_back();
    return forward(requests, [&](const std::string& name, const Tensor& value) {
      step.emplace_back(name, value.clone());
    });
  });
  return taps;
}

// Where a parallel model first departs from the single-rank one: every tap of every step
// (the residual stream after each layer, each all-reduced branch, rank 0's top-k rows against
// the single-rank model's rows of the same index heads). Prints; fails only where a tap is
// missing or shaped differently, so the report reaches the log whatever it finds.
TEST(CudaParallelModel, TapsOfEveryLayerAgainstTheSingleRankModel) {
  MSA_REQUIRE_CUDA();
  const Model single = Model::load(cuda_tp_dir().string(), Device::cuda);
  KvCache single_cache(single.config(), kPages, DType::bf16, Device::cuda);
  const std::vector<StepTaps> want = tapped_steps([&](std::span<const ForwardRequest> r, const ForwardTap& tap) {
    return single.forward(r, single_cache, tap);
  });
  for (int world : {1, 2}) {
    const auto comms = make_local_device_communicators(world);
    std::vector<StepTaps> got;
    int64_t rank_heads = 0;
    run_on_ranks(comms, [&](Communicator& comm) {
      const ParallelModel model = ParallelModel::load(cuda_tp_dir().string(), comm, Device::cuda);
      KvCache cache(model.rank_config(), kPages, DType::bf16, Device::cuda);
      auto forward = [&](std::span<const ForwardRequest> r, const ForwardTap& tap) {
        return model.forward(r, cache, comm.rank() == 0 ? tap : ForwardTap{});
      };
      std::vector<StepTaps> mine = tapped_steps(forward);
      if (comm.rank() == 0) {
        got = std::move(mine);
        rank_heads = model.rank_config().index_heads;
      }
    });
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < want.size(); ++s) {
      auto names = [](const StepTaps& taps) {
        std::string text;
        for (const auto& [name, value] : taps) text += name + " ";
        return text;
      };
      ASSERT_EQ(got[s].size(), want[s].size())
          << "world " << world << " step " << s << "\nsingle: " << names(want[s]) << "\nrank 0: " << names(got[s]);
      for (size_t i = 0; i < want[s].size(); ++i) {
        const auto& [name, w] = want[s][i];
        const Tensor& g = got[s][i].second;
        ASSERT_EQ(got[s][i].first, name) << "world " << world << " step " << s;
        if (w.dtype() == DType::i32) {
          // top-k [heads, T, k]: rank 0 holds heads [0, rank_heads); experts [T, k]: rank 0
          // holds its home rows [0, T / world).
          const bool topk = w.dim() == 3;
          const int64_t heads = topk ? rank_heads : 1;
          const int64_t T = topk ? w.size(1) : g.size(0), k = w.size(w.dim() - 1);
          if (topk) ASSERT_EQ(g.size(0), rank_heads);
          int64_t rows = 0, differ = 0;
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t t = 0; t < T; ++t, ++rows) {
              std::vector<int32_t> a(k), b(k);
              for (int64_t j = 0; j < k; ++j) {
                a[j] = static_cast<int32_t>(w.get((h * T + t) * k + j));
                b[j] = static_cast<int32_t>(g.get((h * T + t) * k + j));
              }
              std::sort(a.begin(), a.end());
              std::sort(b.begin(), b.end());
              if (a != b) {
                if (differ < 4) std::printf("    world %d step %zu %s head %lld row %lld: selections differ\n", world, s,
                                            name.c_str(), static_cast<long long>(h), static_cast<long long>(t));
                ++differ;
              }
            }
          std::printf("  world %d step %zu %-22s rows with other selections: %lld of %lld\n", world, s, name.c_str(),
                      static_cast<long long>(differ), static_cast<long long>(rows));
        } else {
          ASSERT_EQ(g.shape(), w.shape()) << name;
          const bool bitwise = std::memcmp(g.raw(), w.raw(), w.nbytes()) == 0;
          std::printf("  world %d step %zu %-22s rel %.3g%s; %s\n", world, s, name.c_str(), relative_error(g, w),
                      bitwise ? " (bitwise)" : "", bitwise ? "" : worst_difference(w, g).c_str());
        }
      }
    }
  }
}

TEST(CudaParallelModel, TwoRunsOfFourRanksAreBitwiseEqual) {
  MSA_REQUIRE_CUDA();
  const std::vector<std::vector<Tensor>> a = parallel_logits(4), b = parallel_logits(4);
  for (size_t s = 0; s < a[0].size(); ++s)
    EXPECT_EQ(std::memcmp(a[0][s].raw(), b[0][s].raw(), a[0][s].nbytes()), 0)
        << "step " << s << ": " << worst_difference(a[0][s], b[0][s]);
}

TEST(CudaParallelModel, ErrorsNameTheProblem) {
  MSA_REQUIRE_CUDA();
  const auto comms = make_local_device_communicators(3);  // 4 KV heads do not split over 3
  EXPECT_NE(error_of([&] {
              run_on_ranks(comms, [&](Communicator& comm) {
                ParallelModel::load(cuda_tp_dir().string(), comm, Device::cuda);
              });
            }).find("config.num_key_value_heads"),
            std::string::npos);
  const auto two = make_local_device_communicators(2);
  const std::string wrong_cache = error_of([&] {
    run_on_ranks(two, [&](Communicator& comm) {
      const ParallelModel model = ParallelModel::load(cuda_tp_dir().string(), comm, Device::cuda);
      KvCache cpu(model.rank_config(), 4);
      SequenceCache seq;
      const int32_t token = 5;
      const ForwardRequest request{.sequence = &seq, .tokens = std::span(&token, 1)};
      model.forward({&request, 1}, cpu);
    });
  });
  EXPECT_NE(wrong_cache.find("a cuda KV cache"), std::string::npos) << wrong_cache;
}

// ---- msa run --tp N --device cuda ----

// The generated ids: stdout's first line.
std::string generated_ids(const testing::CliResult& result) { return result.out.substr(0, result.out.find('\n')); }

TEST(CudaParallelCli, RunWithOneNcclRankGeneratesWhatTheSingleRankModelDoes) {
  MSA_REQUIRE_CUDA();
  if (!nccl_available()) GTEST_SKIP() << "this build has no NCCL";
  const std::string run = "run --model " + testing::shell_quote(cuda_tp_dir().string()) +
                          " --prompt-tokens 5,17,200,33,91,7,64,12 --max-tokens 6 --stop 0 --device cuda";
  const testing::CliResult single = testing::run_cli(run);
  ASSERT_EQ(single.exit_code, 0) << single.out;
  const testing::CliResult one = testing::run_cli(run + " --tp 1");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  // bf16 on both; only the sums' order differs: a different token would need a near tie.
  EXPECT_EQ(generated_ids(one), generated_ids(single)) << "--tp 1:\n" << one.out << "\nsingle:\n" << single.out;
  EXPECT_NE(one.out.find("cuda, 1 rank"), std::string::npos) << one.out;
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const testing::CliResult too_many = testing::run_cli(run + " --tp " + std::to_string(devices + 1));
  EXPECT_NE(too_many.exit_code, 0);
  EXPECT_NE(too_many.out.find("one GPU per rank"), std::string::npos) << too_many.out;
  if (devices >= 2) {  // the real thing: one process per GPU
    const testing::CliResult two = testing::run_cli(run + " --tp 2");
    ASSERT_EQ(two.exit_code, 0) << two.out;
    EXPECT_EQ(generated_ids(two), generated_ids(single)) << two.out;
  } else {
    std::printf("CudaParallelCli: %d CUDA device(s): --tp 2 over two processes not run\n", devices);
  }
}

}  // namespace
}  // namespace msa
