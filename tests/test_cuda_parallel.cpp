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
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "cli_runner.h"
#include "msa/communicator.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/parallel_model.h"
#include "gpu_checks.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;
using testing::relative_error;

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
const fs::path& cuda_tp_dir() { return testing::made_model_dir("cuda_tp", "tiny-tp-cuda", 23, DType::bf16); }

constexpr int64_t kPages = 16;  // 200 + 37 + 5 tokens and 3 decode steps: 4 + 1 + 1 pages of 64
const std::vector<int64_t> kPromptLengths = {200, 37, 5};
constexpr int kDecodeSteps = 3;

// One step's output: its logits and every tap (name, host copy) in the order they came.
struct StepOutput {
  Tensor logits;
  std::vector<std::pair<std::string, Tensor>> taps;
};

// Runs the steps on a forward(requests, tap): three requests of 200, 37 and 5 tokens in one
// prefill (every logit), then three decode steps of all three (fixed tokens, so every run
// sees the same inputs).
template <class Forward>
std::vector<StepOutput> run_steps(Forward&& forward, bool tapped) {
  std::vector<SequenceCache> sequences(kPromptLengths.size());
  std::vector<std::vector<int32_t>> prompts;
  for (size_t b = 0; b < kPromptLengths.size(); ++b)
    prompts.push_back(testing::some_tokens(kPromptLengths[b], 512, static_cast<int32_t>(b + 1)));
  std::vector<StepOutput> steps;
  auto step = [&](std::span<const ForwardRequest> requests) {
    StepOutput& out = steps.emplace_back();
    ForwardTap tap;
    if (tapped) tap = [&](const std::string& name, const Tensor& value) { out.taps.emplace_back(name, value.clone()); };
    out.logits = forward(requests, tap);
  };
  std::vector<ForwardRequest> requests;
  for (size_t b = 0; b < prompts.size(); ++b)
    requests.push_back({.sequence = &sequences[b], .tokens = prompts[b], .all_logits = true});
  step(requests);
  for (int d = 0; d < kDecodeSteps; ++d) {
    std::vector<int32_t> next(prompts.size());
    requests.clear();
    for (size_t b = 0; b < prompts.size(); ++b) {
      next[b] = static_cast<int32_t>(5 + 17 * d + 101 * b);
      requests.push_back({.sequence = &sequences[b], .tokens = std::span(&next[b], 1)});
    }
    step(requests);
  }
  return steps;
}

std::vector<StepOutput> single_rank_steps(bool tapped) {
  const Model model = Model::load(cuda_tp_dir().string(), Device::cuda);
  KvCache cache(model.config(), kPages, DType::bf16, Device::cuda);
  return run_steps([&](std::span<const ForwardRequest> r, const ForwardTap& tap) { return model.forward(r, cache, tap); },
                   tapped);
}

// [rank][step] of the parallel model on `world` ranks of this GPU.
std::vector<std::vector<StepOutput>> parallel_steps(int world, bool tapped) {
  const auto comms = make_local_device_communicators(world);
  std::vector<std::vector<StepOutput>> out(world);
  run_on_ranks(comms, [&](Communicator& comm) {
    const ParallelModel model = ParallelModel::load(cuda_tp_dir().string(), comm, Device::cuda);
    KvCache cache(model.rank_config(), kPages, DType::bf16, Device::cuda);
    out[comm.rank()] = run_steps(
        [&](std::span<const ForwardRequest> r, const ForwardTap& tap) { return model.forward(r, cache, tap); }, tapped);
  });
  return out;
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
  const int64_t cols = want.size(want.dim() - 1);
  text << "max |diff| " << worst << " at row " << at / cols << " column " << at % cols << " (single rank "
       << want.get(at) << ", parallel " << got.get(at) << "), max |value| " << scale;
  return text.str();
}

// A step's rows as (request, position): the prefill's rows request by request, a decode
// step's one row per request.
std::vector<std::pair<int, int64_t>> step_rows(size_t step) {
  std::vector<std::pair<int, int64_t>> rows;
  for (size_t b = 0; b < kPromptLengths.size(); ++b) {
    if (step == 0)
      for (int64_t p = 0; p < kPromptLengths[b]; ++p) rows.emplace_back(static_cast<int>(b), p);
    else
      rows.emplace_back(static_cast<int>(b), kPromptLengths[b] + static_cast<int64_t>(step) - 1);
  }
  return rows;
}

// The discrete decisions of one step, whole-model: a layer's top-k [index heads, T, k]
// (every rank taps its own heads: concatenated in rank order) or experts [T, k] (every rank
// taps its home rows: concatenated). None for the float taps.
std::optional<Tensor> whole_decision(const std::vector<std::vector<StepOutput>>& ranks, size_t step, size_t tap) {
  const Tensor& first = ranks[0][step].taps[tap].second;
  if (first.dtype() != DType::i32) return std::nullopt;
  const bool topk = first.dim() == 3;
  std::vector<int32_t> values;
  int64_t outer = 0;
  for (const auto& rank : ranks) {
    const Tensor& part = rank[step].taps[tap].second;
    const auto span = part.span<int32_t>();
    values.insert(values.end(), span.begin(), span.end());
    outer += part.size(0);
  }
  Tensor whole = Tensor::zeros(topk ? Shape{outer, first.size(1), first.size(2)} : Shape{outer, first.size(1)},
                               DType::i32);
  std::copy(values.begin(), values.end(), whole.span<int32_t>().begin());
  return whole;
}

// How many heads of row t of the decision tensors select a different set.
int64_t decisions_differing(const Tensor& want, const Tensor& got, int64_t t) {
  const bool topk = want.dim() == 3;
  const int64_t heads = topk ? want.size(0) : 1, T = topk ? want.size(1) : want.size(0);
  const int64_t k = want.size(want.dim() - 1);
  int64_t differ = 0;
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<int32_t> a(k), b(k);
    for (int64_t j = 0; j < k; ++j) {
      a[j] = static_cast<int32_t>(want.get((h * T + t) * k + j));
      b[j] = static_cast<int32_t>(got.get((h * T + t) * k + j));
    }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    differ += a != b;
  }
  return differ;
}

// The parity of the sharded model with the single-rank one. Both run with taps, so the
// single-rank model adds each branch to the residual stream as a separate f32 add, as a rank
// does after its all-reduce (untapped, its GEMMs accumulate into the stream instead).
//
// The made model is sensitive: that one f32 rounding difference (untapped against tapped,
// the same model) moves its prefill logits by about 1.3e-3 (H200), because bf16 roundings of
// the activations that flip amplify through three layers. That is the noise floor of any
// reordering of sums; the test measures it and bounds the parallel model by 4x it (and at
// least 1e-3): the ranks reorder every layer's partial sums, not one add.
//
// What must hold:
//  * one rank is the single-rank model: its prefill bitwise (the same kernels on the same
//    shapes); its decode steps within 3e-3 (the expert-parallel MoE runs the experts as
//    GEMMs where the single-rank model's decode runs its small-step kernel: other bf16
//    roundings of the activations);
//  * every rank returns the same logits, bitwise;
//  * 2 and 4 ranks sum partial products in another order, so a top-k block or expert choice
//    that is a near tie may go the other way (the made model's index scores and router
//    logits have many). Such a flip at (request, position) legitimately changes that row
//    and, through the K/V it writes, every later row of the request. So: rows whose request
//    saw no different decision up to their position (every layer, every head, every earlier
//    step) must match within the bound (logits rel over those rows); at most 1% of the decisions may
//    flip, each flip is printed, and at least half the rows must be left to compare.
TEST(CudaParallelModel, OneTwoAndFourRanksMatchTheSingleRankModel) {
  MSA_REQUIRE_CUDA();
  const std::vector<StepOutput> want = single_rank_steps(true);
  const double noise = relative_error(single_rank_steps(false)[0].logits, want[0].logits);
  const double bound = std::max(1e-3, 4 * noise);
  std::printf("the single-rank model untapped against tapped: prefill logits rel %.3g; bound %.3g\n", noise, bound);
  EXPECT_LT(noise, 2e-3) << "the made model is more sensitive than it was when the bound was set";
  for (int world : {1, 2, 4}) {
    const std::vector<std::vector<StepOutput>> got = parallel_steps(world, true);
    std::vector<int64_t> tainted_from(kPromptLengths.size(), std::numeric_limits<int64_t>::max());
    int64_t rows_total = 0, rows_tainted = 0, decisions = 0, flipped = 0;
    for (size_t s = 0; s < want.size(); ++s) {
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(got[r].size(), want.size());
        EXPECT_EQ(std::memcmp(got[r][s].logits.raw(), got[0][s].logits.raw(), got[0][s].logits.nbytes()), 0)
            << "world " << world << " rank " << r << " step " << s << ": logits differ from rank 0's; "
            << worst_difference(got[0][s].logits, got[r][s].logits);
        ASSERT_EQ(got[r][s].taps.size(), want[s].taps.size()) << "world " << world << " rank " << r << " step " << s;
      }
      const auto rows = step_rows(s);
      // The decisions, layer by layer.
      for (size_t i = 0; i < want[s].taps.size(); ++i) {
        const std::optional<Tensor> decided = whole_decision(got, s, i);
        if (!decided) continue;
        const Tensor& whole = *decided;
        const Tensor& w = want[s].taps[i].second;
        ASSERT_EQ(whole.shape(), w.shape()) << want[s].taps[i].first;
        decisions += w.numel() / w.size(w.dim() - 1);
        for (size_t t = 0; t < rows.size(); ++t)
          if (const int64_t differ = decisions_differing(w, whole, static_cast<int64_t>(t))) {
            const auto [b, p] = rows[t];
            flipped += differ;
            std::printf("  world %d step %zu %s: request %d position %lld decides otherwise\n", world, s,
                        want[s].taps[i].first.c_str(), b, static_cast<long long>(p));
            tainted_from[b] = std::min(tainted_from[b], p);
          }
      }
      // The logits of the rows no flip reached.
      const Tensor& wl = want[s].logits;
      const Tensor& gl = got[0][s].logits;
      ASSERT_EQ(gl.shape(), wl.shape());
      const int64_t V = wl.size(1);
      double diff2 = 0, ref2 = 0;
      int64_t clean = 0;
      for (size_t t = 0; t < rows.size(); ++t) {
        const auto [b, p] = rows[t];
        ++rows_total;
        if (p >= tainted_from[b]) {
          ++rows_tainted;
          continue;
        }
        ++clean;
        for (int64_t v = 0; v < V; ++v) {
          const double d = gl.get(static_cast<int64_t>(t) * V + v) - wl.get(static_cast<int64_t>(t) * V + v);
          diff2 += d * d;
          ref2 += wl.get(static_cast<int64_t>(t) * V + v) * wl.get(static_cast<int64_t>(t) * V + v);
        }
      }
      const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : 0;
      const bool bitwise = std::memcmp(gl.raw(), wl.raw(), wl.nbytes()) == 0;
      std::printf("world %d step %zu: logits rel %.3g over %lld of %zu rows (the rows no flip reached)%s\n", world, s,
                  rel, static_cast<long long>(clean), rows.size(), bitwise ? ", bitwise" : "");
      if (world == 1 && s == 0)
        EXPECT_TRUE(bitwise) << "one rank's prefill: " << worst_difference(wl, gl);
      EXPECT_LT(rel, bound) << "world " << world << " step " << s << " (max over all rows: "
                            << worst_difference(wl, gl) << ")";
    }
    std::printf("world %d: %lld of %lld decisions (a row's top-k of one index head, or its experts) flipped; "
                "%lld of %lld rows follow a flip\n",
                world, static_cast<long long>(flipped), static_cast<long long>(decisions),
                static_cast<long long>(rows_tainted), static_cast<long long>(rows_total));
    if (world == 1) EXPECT_EQ(flipped, 0) << "one rank decides as the single-rank model";
    EXPECT_LE(flipped * 100, decisions) << "world " << world << ": more than 1% of the decisions flipped";
    EXPECT_LE(rows_tainted * 2, rows_total) << "world " << world << ": too few rows left to compare";
  }
}

// Every layer's taps of rank 0 against the single-rank model's, printed (where the ranks
// depart from the single-rank model, for a failing parity above).
TEST(CudaParallelModel, TapsOfEveryLayerAgainstTheSingleRankModel) {
  MSA_REQUIRE_CUDA();
  const std::vector<StepOutput> want = single_rank_steps(true);
  for (int world : {1, 2}) {
    const std::vector<std::vector<StepOutput>> got = parallel_steps(world, true);
    for (size_t s = 0; s < want.size(); ++s)
      for (size_t i = 0; i < want[s].taps.size(); ++i) {
        const auto& [name, w] = want[s].taps[i];
        ASSERT_EQ(got[0][s].taps.at(i).first, name);
        if (w.dtype() == DType::i32) continue;  // the decisions: the parity test above
        const Tensor& g = got[0][s].taps[i].second;
        ASSERT_EQ(g.shape(), w.shape()) << name;
        const bool bitwise = std::memcmp(g.raw(), w.raw(), w.nbytes()) == 0;
        std::printf("  world %d step %zu %-18s rel %.3g%s\n", world, s, name.c_str(), relative_error(g, w),
                    bitwise ? " (bitwise)" : "");
      }
  }
}

TEST(CudaParallelModel, TwoRunsOfFourRanksAreBitwiseEqual) {
  MSA_REQUIRE_CUDA();
  const auto a = parallel_steps(4, false), b = parallel_steps(4, false);
  for (size_t s = 0; s < a[0].size(); ++s)
    EXPECT_EQ(std::memcmp(a[0][s].logits.raw(), b[0][s].logits.raw(), a[0][s].logits.nbytes()), 0)
        << "step " << s << ": " << worst_difference(a[0][s].logits, b[0][s].logits);
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
