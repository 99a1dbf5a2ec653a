// DecodePlan (include/msa/cuda/decode_plan.h) in a CUDA graph: one plan per capacity set, the
// device buffers allocated once, run() captured ONCE (cudaStreamCaptureModeGlobal, in which
// any allocation, synchronous copy or synchronisation during capture fails the capture),
// then every round writes NEW lengths (1, B-1, B, B+1, kB-1, kB, kB+1, max; 1..max_queries
// queries; empty request slots) and new random q / qi / cache contents into the same
// buffers with cudaMemcpy outside the graph and replays it. Each replay is checked against
// the CPU ops (msa/ops.h, Impl::cpu) with the tolerances of test_cuda_ops.cpp; output rows
// beyond the step's queries must keep their poison. Also: lengths beyond the plan compute
// nothing and are reported by check_last_step(); bad plans and steps are refused on the
// host. The same over fp8 K/V caches (msa/quantized_kv_cache.h, both scale layouts): each
// round's cache quantized on the host, its codes and scales written into the step's fp8
// buffers, the CPU reading the same fp8 cache. Skipped without a CUDA device; ctest label "gpu".
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/common/cuda_check.h"
#include "msa/cuda/decode_plan.h"
#include "cuda/common/device_buffer.h"
#include "fp8_kv_cases.h"
#include "gpu_checks.h"

namespace msa::testing {
namespace {

using cuda::DecodeCapacities;
using cuda::DecodeDims;
using cuda::DecodePlan;
using cuda::DecodeStep;
using cuda::DeviceBuffer;

constexpr uint8_t kFloatPoison = 0xff;  // f32 NaN
constexpr uint8_t kTopkPoison = 0x7f;   // block id 0x7f7f7f7f: never a valid entry
constexpr uint8_t kCachePoison = 0xff;  // bf16 NaN in pages no request of a round uses
constexpr int64_t kSparePages = 3;

// The request slots of one step; q_len 0 leaves a slot empty (its k_len may still be > 0:
// a request that holds a cache but has no new token this step).
using Slots = std::vector<Seq>;

class Stream {
 public:
  Stream() { MSA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void synchronize() const { MSA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

class GraphExec {
 public:
  GraphExec() = default;
  ~GraphExec() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  cudaGraphExec_t* out() { return &exec_; }
  void launch(const Stream& stream) const { MSA_CUDA_CHECK(cudaGraphLaunch(exec_, stream.get())); }
  explicit operator bool() const { return exec_ != nullptr; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Captures plan.run(step) on `stream` in global mode; every node of the graph must be a
// kernel (no memset, memcpy or allocation node). Failures are reported; `exec` stays empty.
void capture_run(const DecodePlan& plan, const DecodeStep& step, const Stream& stream,
                 GraphExec& exec) {
  MSA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  std::string error;
  try {
    plan.run(step, stream.get());
  } catch (const std::exception& e) {
    error = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream.get(), &graph);
  cudaGetLastError();  // a refused call during capture leaves a non-sticky error behind
  EXPECT_EQ(error, "") << "run() threw during capture";
  EXPECT_EQ(end, cudaSuccess) << "capture failed (an allocation or a host synchronisation in "
                                 "run()?): "
                              << cudaGetErrorString(end);
  if (!error.empty() || end != cudaSuccess || graph == nullptr) {
    if (graph) cudaGraphDestroy(graph);
    return;
  }
  size_t count = 0;
  MSA_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  MSA_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  EXPECT_GT(count, 0u);
  for (size_t i = 0; i < count; ++i) {
    cudaGraphNodeType type{};
    MSA_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type));
    EXPECT_EQ(type, cudaGraphNodeTypeKernel) << "graph node " << i << " is not a kernel";
  }
  std::cout << "[ graph ] " << count << " kernel nodes\n";
  const cudaError_t instantiated = cudaGraphInstantiate(exec.out(), graph, 0);
  cudaGraphDestroy(graph);
  EXPECT_EQ(instantiated, cudaSuccess) << cudaGetErrorString(instantiated);
}

// One round's inputs: the active requests as a varlen case (slot order), their paged cache
// (what the CPU reference reads) and the slot arrays in the device layout.
struct HostRound {
  VarlenCase c;
  PagedRequests paged;
  std::vector<int32_t> cu_seqlens_q, seq_lens, page_table;
  int64_t total_q() const { return c.total_q(); }
};

// fp8 K/V of a graph case: none (bf16 caches), or the layout of the fp8 caches.
struct Fp8Cache {
  bool on = false;
  KvScaleLayout layout = KvScaleLayout::per_token_head;
};

HostRound make_round(const CaseShape& shape, const DecodeCapacities& caps, int64_t table_stride,
                     const Slots& slots, Fp8Cache fp8 = {}) {
  std::vector<Seq> active;
  for (const Seq& s : slots)
    if (s.q_len > 0) active.push_back(s);
  HostRound round{.c = gpu_case(shape, active)};
  round.paged = page_varlen_case(round.c, kSparePages);
  if (fp8.on) round.paged.cache = fp8_kv_cache(round.paged.cache, fp8.layout);  // what the CPU reads too
  const Tensor& table = round.paged.cache.page_table;  // [active, columns]
  const int64_t columns = table.size(1);
  EXPECT_LE(columns, table_stride);
  round.page_table.assign(static_cast<size_t>(caps.max_batch * table_stride), kUnusedPageColumn);
  round.cu_seqlens_q = {0};
  int64_t a = 0;
  for (int64_t slot = 0; slot < caps.max_batch; ++slot) {
    const Seq s = slot < static_cast<int64_t>(slots.size()) ? slots[slot] : Seq{};
    round.cu_seqlens_q.push_back(round.cu_seqlens_q.back() + static_cast<int32_t>(s.q_len));
    round.seq_lens.push_back(static_cast<int32_t>(s.k_len));
    if (s.q_len == 0) continue;
    for (int64_t j = 0; j < columns; ++j)
      round.page_table[slot * table_stride + j] = table.data<int32_t>()[a * columns + j];
    ++a;
  }
  return round;
}

// Everything one graph reads or writes, allocated once for the plan's capacities.
struct DeviceStep {
  CaseShape shape;
  DecodeCapacities caps;
  Fp8Cache fp8;
  int64_t pages = 0, table_stride = 0;
  DeviceBuffer q, qi, k_cache, v_cache, index_key_cache, page_table, cu_seqlens_q, seq_lens, o,
      lse, topk, workspace;
  DeviceBuffer k_codes, v_codes, k_scale, v_scale;  // fp8 K/V

  DeviceStep(const CaseShape& s, const DecodeCapacities& c, size_t workspace_bytes, Fp8Cache fp8_cache = {})
      : shape(s), caps(c), fp8(fp8_cache) {
    const int64_t B = s.params.block_size, H = s.kv_heads, D = s.head_dim, Di = s.index_dim;
    const int64_t rows = caps.max_total_queries;
    table_stride = (caps.max_context + B - 1) / B + 2;
    pages = caps.max_batch * ((caps.max_context + B - 1) / B) + kSparePages;
    q = DeviceBuffer(size_t(rows * s.q_heads() * D) * 2);
    qi = DeviceBuffer(size_t(rows * H * Di) * 2);
    k_cache = DeviceBuffer(size_t(pages * H * B * D) * 2);
    v_cache = DeviceBuffer(size_t(pages * H * B * D) * 2);
    index_key_cache = DeviceBuffer(size_t(pages * B * Di) * 2);
    page_table = DeviceBuffer(size_t(caps.max_batch * table_stride) * 4);
    cu_seqlens_q = DeviceBuffer(size_t(caps.max_batch + 1) * 4);
    seq_lens = DeviceBuffer(size_t(caps.max_batch) * 4);
    o = DeviceBuffer(size_t(rows * s.q_heads() * D) * 4);
    lse = DeviceBuffer(size_t(rows * s.q_heads()) * 4);
    topk = DeviceBuffer(size_t(H * rows * s.params.topk) * 4);
    workspace = DeviceBuffer(workspace_bytes);
    for (DeviceBuffer* b : {&q, &qi, &k_cache, &v_cache, &index_key_cache}) b->fill_bytes(kCachePoison);
    workspace.fill_bytes(0xff);  // run() must not depend on its contents
    if (fp8.on) {  // 0xff: the e4m3 NaN code and an f32 NaN scale in pages no request uses
      const size_t scales = fp8.layout == KvScaleLayout::per_tensor ? 1 : size_t(pages * H * B);
      k_codes = DeviceBuffer(size_t(pages * H * B * D));
      v_codes = DeviceBuffer(size_t(pages * H * B * D));
      k_scale = DeviceBuffer(scales * 4);
      v_scale = DeviceBuffer(scales * 4);
      for (DeviceBuffer* b : {&k_codes, &v_codes, &k_scale, &v_scale}) b->fill_bytes(kCachePoison);
    }
  }

  cuda::Fp8Kv fp8_kv(const DeviceBuffer& codes, const DeviceBuffer& scale) const {
    const float* data = scale.as<float>();
    return {.codes = codes.as<uint8_t>(),
            .scales = fp8.layout == KvScaleLayout::per_tensor
                          ? cuda::kv_scale_per_tensor(data)
                          : cuda::kv_scales_per_token_head(data, shape.kv_heads, shape.params.block_size)};
  }

  DecodeStep step() const {
    return {.q = q.as<uint16_t>(),
            .qi = qi.as<uint16_t>(),
            .k_cache = k_cache.as<uint16_t>(),
            .v_cache = v_cache.as<uint16_t>(),
            .index_key_cache = index_key_cache.as<uint16_t>(),
            .page_table = page_table.as<int32_t>(),
            .page_table_stride = table_stride,
            .num_pages = pages,
            .cu_seqlens_q = cu_seqlens_q.as<int32_t>(),
            .seq_lens = seq_lens.as<int32_t>(),
            .o = o.as<float>(),
            .lse = lse.as<float>(),
            .topk = topk.as<int32_t>(),
            .workspace = workspace.get(),
            .kv_format = fp8.on ? cuda::KvFormat::fp8 : cuda::KvFormat::bf16,
            .k_fp8 = fp8.on ? fp8_kv(k_codes, k_scale) : cuda::Fp8Kv{},
            .v_fp8 = fp8.on ? fp8_kv(v_codes, v_scale) : cuda::Fp8Kv{}};
  }

  // New lengths and contents, written outside the graph (synchronous copies).
  void write(const HostRound& round) {
    const auto upload_bf16 = [](DeviceBuffer& buffer, const Tensor& values) {
      const Tensor bf16 = values.to(DType::bf16);
      buffer.upload(bf16.raw(), bf16.nbytes());
    };
    upload_bf16(q, round.c.q);
    upload_bf16(qi, round.c.qi);
    if (fp8.on) {  // the codes and scales as stored (their pages' leading part of the buffers)
      const PagedKvCache& cache = round.paged.cache;
      for (const auto& [buffer, tensor] : {std::pair{&k_codes, &cache.k_cache}, {&v_codes, &cache.v_cache},
                                           {&k_scale, &cache.k_scale}, {&v_scale, &cache.v_scale}}) {
        EXPECT_LE(tensor->nbytes(), buffer->bytes());
        buffer->upload(tensor->raw(), std::min(tensor->nbytes(), buffer->bytes()));
      }
    } else {
      upload_bf16(k_cache, round.paged.cache.k_cache);
      upload_bf16(v_cache, round.paged.cache.v_cache);
    }
    upload_bf16(index_key_cache, round.paged.cache.index_key_cache);
    write_lengths(round.cu_seqlens_q, round.seq_lens);
    page_table.upload(round.page_table.data(), round.page_table.size() * 4);
  }
  void write_lengths(const std::vector<int32_t>& cu, const std::vector<int32_t>& lens) {
    cu_seqlens_q.upload(cu.data(), cu.size() * 4);
    seq_lens.upload(lens.data(), lens.size() * 4);
  }
  void poison_outputs() {
    o.fill_bytes(kFloatPoison);
    lse.fill_bytes(kFloatPoison);
    topk.fill_bytes(kTopkPoison);
  }
};

// The outputs over the whole capacity.
struct Outputs {
  Tensor o, lse, topk;  // [rows, Hq, D], [rows, Hq], [Hkv, rows, k]
  explicit Outputs(const DeviceStep& d) {
    const int64_t rows = d.caps.max_total_queries, Hq = d.shape.q_heads();
    o = Tensor::zeros({rows, Hq, d.shape.head_dim}, DType::f32);
    lse = Tensor::zeros({rows, Hq}, DType::f32);
    topk = Tensor::zeros({d.shape.kv_heads, rows, d.shape.params.topk}, DType::i32);
    d.o.download(o.raw(), o.nbytes());
    d.lse.download(lse.raw(), lse.nbytes());
    d.topk.download(topk.raw(), topk.nbytes());
  }
};

// First byte in [begin, end) of `t` that is not `poison`, or -1.
int64_t first_unpoisoned_byte(const Tensor& t, size_t begin, size_t end, uint8_t poison) {
  const auto* bytes = static_cast<const uint8_t*>(t.raw());
  for (size_t i = begin; i < end; ++i)
    if (bytes[i] != poison) return static_cast<int64_t>(i);
  return -1;
}

// Rows >= first_row of o / lse / every head's topk still hold their poison (all of topk when
// `topk_untouched`: dense plans never write it).
void expect_rows_untouched(const Outputs& out, int64_t first_row, bool topk_untouched,
                           const std::string& what) {
  const int64_t rows = out.o.size(0);
  const size_t o_row = out.o.nbytes() / rows, lse_row = out.lse.nbytes() / rows;
  EXPECT_EQ(first_unpoisoned_byte(out.o, first_row * o_row, out.o.nbytes(), kFloatPoison), -1)
      << what << ": o written beyond row " << first_row;
  EXPECT_EQ(first_unpoisoned_byte(out.lse, first_row * lse_row, out.lse.nbytes(), kFloatPoison), -1)
      << what << ": lse written beyond row " << first_row;
  const int64_t heads = out.topk.size(0), slots = out.topk.size(2);
  const int64_t from = topk_untouched ? 0 : first_row;
  for (int64_t h = 0; h < heads; ++h) {
    const size_t head_begin = size_t(h * rows * slots) * 4;
    EXPECT_EQ(first_unpoisoned_byte(out.topk, head_begin + size_t(from * slots) * 4,
                                    head_begin + size_t(rows * slots) * 4, kTopkPoison),
              -1)
        << what << ": topk of head " << h << " written beyond row " << from;
  }
}

std::vector<int64_t> iota_rows(int64_t n) {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  return rows;
}

// The step's rows against the CPU: selection rows as sets (near-ties allowed), then O / LSE
// against the CPU's sparse attention over the GPU's own rows (dense plans: dense attention).
void expect_round_matches_cpu(const HostRound& round, const Outputs& out, bool dense,
                              const std::string& what) {
  const VarlenCase& c = round.c;
  const PagedKvCache& cache = round.paged.cache;
  const MsaParams& p = c.params();
  const int64_t n = round.total_q();
  expect_rows_untouched(out, n, dense, what);
  const AttentionOutput got{out.o.slice0(0, n).clone(), out.lse.slice0(0, n).clone()};
  if (dense) {
    expect_attention_close(got, paged_dense_attention(c.q, cache, round.paged.cu_seqlens_q, p, Impl::cpu),
                           what + " dense");
    return;
  }
  const Tensor gpu_rows = gather_selection_rows(out.topk, iota_rows(n));
  const DoubleInputs in(c);
  const IndexerOutput cpu_rows = paged_indexer(c.qi, cache, round.paged.cu_seqlens_q, p, Impl::cpu);
  expect_indexer_close({gpu_rows, Tensor()}, cpu_rows, c, in, what);
  if (::testing::Test::HasFailure()) return;  // the rows must be valid to run attention on
  expect_attention_close(
      got, paged_sparse_attention(c.q, cache, gpu_rows, round.paged.cu_seqlens_q, p, Impl::cpu),
      what + " sparse");
}

std::string slots_string(const Slots& slots) {
  std::string out;
  for (const Seq& s : slots)
    out += "(" + std::to_string(s.q_len) + "q, " + std::to_string(s.k_len) + "k) ";
  return out;
}

struct GraphCase {
  std::string name;
  CaseShape shape;
  DecodeCapacities caps;
  std::vector<Slots> rounds;  // valid steps, replayed in order
  Fp8Cache fp8 = {};          // fp8 K/V caches in this layout
};

DecodeDims dims_of(const CaseShape& s) {
  return {.q_heads = s.q_heads(), .kv_heads = s.kv_heads, .head_dim = s.head_dim,
          .index_dim = s.index_dim};
}

std::vector<GraphCase> graph_cases() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init); B = 128, k = 4: kB = 512.
  const CaseShape g4 = make_shape(2, 4, 128, 128, 128, 4, 1, 0);
  const CaseShape g16 = make_shape(1, 16, 64, 64, 128, 4, 1, 1);
  const std::vector<Slots> sparse_rounds = {
      {{1, 1}, {4, 127}, {2, 128}, {3, 129}},     // all <= kB: every visible block selected
      {{4, 513}, {1, 4096}, {0, 0}, {2, 1000}},   // an empty slot between requests
      {{1, 4096}},                                // one request, three empty slots
      {{3, 3}, {4, 511}, {1, 512}, {4, 4096}},
      {{0, 1000}, {2, 2049}, {1, 300}},           // an idle request holding a cache
      {{1, 700}, {4, 4}, {1, 129}, {2, 2}},
  };
  const Fp8Cache per_token{.on = true, .layout = KvScaleLayout::per_token_head};
  const Fp8Cache per_tensor{.on = true, .layout = KvScaleLayout::per_tensor};
  const std::vector<Slots> dense_b64_rounds = {{{1, 1}, {4, 63}, {2, 64}, {3, 65}},
                                               {{4, 2048}, {0, 0}, {1, 2047}, {2, 129}},
                                               {{1, 2048}},
                                               {{0, 1000}, {4, 4}, {1, 127}, {3, 1500}}};
  return {
      // fp8 K/V: the same plans and rounds over e4m3 caches.
      {"SparseG4Fp8PerTokenHead", g4, {.max_batch = 4, .max_queries = 4, .max_context = 4096}, sparse_rounds,
       per_token},
      {"SparseG16Rows12Fp8PerTensor", g16,
       {.max_batch = 4, .max_queries = 4, .max_total_queries = 12, .max_context = 4096}, sparse_rounds, per_tensor},
      {"DenseG4Fp8PerTensor", g4, {.max_batch = 4, .max_queries = 4, .max_context = 512},
       {{{1, 1}, {4, 127}, {2, 128}, {3, 129}}, {{4, 512}, {0, 0}, {1, 511}, {2, 2}}, {{1, 300}}}, per_tensor},
      {"DenseG16B64Fp8PerTokenHead", make_shape(1, 16, 64, 64, 64, 32, 1, 1),
       {.max_batch = 4, .max_queries = 4, .max_context = 2048}, dense_b64_rounds, per_token},
      {"SparseG4", g4, {.max_batch = 4, .max_queries = 4, .max_context = 4096}, sparse_rounds},
      {"SparseG16Rows12", g16,
       {.max_batch = 4, .max_queries = 4, .max_total_queries = 12, .max_context = 4096},
       sparse_rounds},
      // max_context = kB: a dense plan (the indexer never runs, topk never written).
      {"DenseG4", g4, {.max_batch = 4, .max_queries = 4, .max_context = 512},
       {{{1, 1}, {4, 127}, {2, 128}, {3, 129}},
        {{4, 512}, {0, 0}, {1, 511}, {2, 2}},
        {{1, 300}}}},
      // Dense, kB = 2048 with B = 64: the dense decode kernel splits the 32 units of the
      // capacity 32 ways; shorter steps leave most splits empty (partials of -inf).
      {"DenseG16B64", make_shape(1, 16, 64, 64, 64, 32, 1, 1),
       {.max_batch = 4, .max_queries = 4, .max_context = 2048}, dense_b64_rounds},
  };
}

class DecodeGraph : public ::testing::TestWithParam<GraphCase> {};

TEST_P(DecodeGraph, ReplaysWithNewLengthsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const GraphCase& gc = GetParam();
  const DecodePlan plan(gc.caps, dims_of(gc.shape), gc.shape.params);
  EXPECT_EQ(plan.is_dense(), gc.name.rfind("Dense", 0) == 0);
  if (gc.fp8.on) std::cout << "[ plan ] fp8 K/V, " << layout_name(gc.fp8.layout) << " scales\n";
  const DecodeCapacities& caps = plan.capacities();
  std::cout << "[ plan ] " << gc.name << " " << gc.shape.describe() << ": "
            << (plan.is_dense() ? "dense" : "sparse") << ", workspace " << plan.workspace_bytes()
            << " bytes\n";
  DeviceStep device(gc.shape, caps, plan.workspace_bytes(), gc.fp8);
  const DecodeStep step = device.step();
  Stream stream;

  // Round 0 eagerly first (also loads the modules before capture), kept for the replay.
  HostRound round = make_round(gc.shape, caps, device.table_stride, gc.rounds[0], gc.fp8);
  device.write(round);
  device.poison_outputs();
  plan.run(step, stream.get());
  stream.synchronize();
  plan.check_last_step(step, stream.get());
  const Outputs eager(device);
  expect_round_matches_cpu(round, eager, plan.is_dense(), "eager round 0");

  GraphExec graph;
  capture_run(plan, step, stream, graph);
  ASSERT_TRUE(graph) << "no graph to replay";

  // Round 0 again through the graph: bitwise the eager result.
  device.poison_outputs();
  graph.launch(stream);
  stream.synchronize();
  plan.check_last_step(step, stream.get());
  {
    const Outputs replayed(device);
    EXPECT_TRUE(bitwise_equal(replayed.o, eager.o)) << "graph vs eager: o";
    EXPECT_TRUE(bitwise_equal(replayed.lse, eager.lse)) << "graph vs eager: lse";
    EXPECT_TRUE(bitwise_equal(replayed.topk, eager.topk)) << "graph vs eager: topk";
  }

  for (size_t r = 1; r < gc.rounds.size(); ++r) {
    const std::string what = "replay " + std::to_string(r) + ": " + slots_string(gc.rounds[r]);
    SCOPED_TRACE(what);
    round = make_round(gc.shape, caps, device.table_stride, gc.rounds[r], gc.fp8);
    device.write(round);
    device.poison_outputs();
    graph.launch(stream);
    stream.synchronize();
    plan.check_last_step(step, stream.get());
    expect_round_matches_cpu(round, Outputs(device), plan.is_dense(), what);
  }

  // A replay of the step as the device holds it now (outputs poisoned first): what
  // check_last_step then throws, or "" when it accepts the step.
  const auto replay_refusal = [&] {
    device.poison_outputs();
    graph.launch(stream);
    stream.synchronize();
    try {
      plan.check_last_step(step, stream.get());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };

  // Lengths beyond the plan: the replay computes nothing and check_last_step names them.
  const auto expect_refused = [&](std::vector<int32_t> cu, std::vector<int32_t> lens,
                                  const std::string& argument) {
    SCOPED_TRACE("refused: " + argument);
    device.write_lengths(cu, lens);
    const std::string what = replay_refusal();
    EXPECT_FALSE(what.empty()) << "check_last_step accepted a step beyond the plan";
    EXPECT_NE(what.find("'" + argument + "'"), std::string::npos) << what;
    expect_rows_untouched(Outputs(device), 0, true, "refused step");
  };
  std::vector<int32_t> lens = round.seq_lens;
  lens[1] = static_cast<int32_t>(caps.max_context + 1);
  expect_refused(round.cu_seqlens_q, lens, "seq_lens[1]");
  std::vector<int32_t> cu = round.cu_seqlens_q;
  for (size_t b = 3; b < cu.size(); ++b) cu[b] = cu[2] + static_cast<int32_t>(caps.max_queries) + 1;
  expect_refused(cu, round.seq_lens, "cu_seqlens_q[3] - cu_seqlens_q[2]");
  lens = round.seq_lens;
  lens[0] = round.cu_seqlens_q[1] - 1;  // fewer tokens than new queries
  expect_refused(round.cu_seqlens_q, lens, "seq_lens[0]");

  // Page ids out of the caches: each is found where a kernel reads it (the index scan, or
  // attention for the forced and the dense blocks), read as page 0 and named by
  // check_last_step. Without the check the step reads outside the caches (memcheck).
  device.write(round);
  int64_t slot = -1;  // the last request of the round with a context
  for (int64_t b = 0; b < caps.max_batch; ++b)
    if (round.cu_seqlens_q[b + 1] > round.cu_seqlens_q[b]) slot = b;
  ASSERT_GE(slot, 0);
  const int64_t last_block = (round.seq_lens[slot] - 1) / gc.shape.params.block_size;
  const auto expect_bad_page = [&](int64_t block, int32_t id) {
    const std::string entry = "page_table[" + std::to_string(slot) + ", " + std::to_string(block) + "]";
    SCOPED_TRACE("bad page: " + entry + " = " + std::to_string(id));
    std::vector<int32_t> table = round.page_table;
    table[slot * device.table_stride + block] = id;
    device.page_table.upload(table.data(), table.size() * 4);
    const std::string what = replay_refusal();
    EXPECT_FALSE(what.empty()) << "check_last_step accepted a step with a page id out of range";
    EXPECT_NE(what.find("'" + entry + "'"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(id)), std::string::npos) << what;
  };
  const int32_t pages = static_cast<int32_t>(device.pages);
  expect_bad_page(last_block, pages);  // the local block: attention reads it
  expect_bad_page(last_block, -1);
  expect_bad_page(0, INT32_MAX);  // the first block: scanned (sparse) or attended
  if (last_block >= 2) expect_bad_page(last_block / 2, INT32_MIN);

  // And valid lengths again.
  round = make_round(gc.shape, caps, device.table_stride, gc.rounds[0], gc.fp8);
  device.write(round);
  device.poison_outputs();
  graph.launch(stream);
  stream.synchronize();
  plan.check_last_step(step, stream.get());
  expect_round_matches_cpu(round, Outputs(device), plan.is_dense(), "valid after refused");
}

std::string case_name(const ::testing::TestParamInfo<GraphCase>& info) { return info.param.name; }
INSTANTIATE_TEST_SUITE_P(Plans, DecodeGraph, ::testing::ValuesIn(graph_cases()), case_name);

// The premise of the capture test: in global capture mode the runtime refuses an
// allocation and a stream synchronisation, so a graph captured from run() proves it made
// neither.
TEST(DecodeGraphPremise, GlobalCaptureRefusesAllocationAndSync) {
  MSA_REQUIRE_CUDA();
  Stream stream;
  const auto refused_during_capture = [&](const auto& call) {
    MSA_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    const cudaError_t status = call();
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream.get(), &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return status != cudaSuccess;
  };
  void* pointer = nullptr;
  EXPECT_TRUE(refused_during_capture([&] { return cudaMalloc(&pointer, 256); }));
  if (pointer) cudaFree(pointer);
  EXPECT_TRUE(refused_during_capture([&] { return cudaStreamSynchronize(stream.get()); }));
  EXPECT_TRUE(refused_during_capture([&] { return cudaDeviceSynchronize(); }));
  stream.synchronize();  // the stream works again
}

// Host-side refusals: plans the capacity-safe kernels cannot serve, steps that do not fit.
TEST(DecodePlanChecks, BadPlansAndStepsAreRefused) {
  MSA_REQUIRE_CUDA();
  const CaseShape shape = make_shape(2, 4, 128, 128, 128, 4, 1, 0);
  const DecodeDims dims = dims_of(shape);
  const auto refused = [&](const DecodeCapacities& caps, const MsaParams& params,
                           const std::string& argument) {
    try {
      const DecodePlan plan(caps, dims, params);
      ADD_FAILURE() << "accepted; expected a refusal naming " << argument;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    }
  };
  const DecodeCapacities good{.max_batch = 2, .max_queries = 2, .max_context = 1024};
  refused({.max_batch = 2, .max_queries = 17, .max_context = 1024}, shape.params, "max_queries");
  refused({.max_batch = 0, .max_queries = 1, .max_context = 1024}, shape.params, "max_batch");
  refused({.max_batch = 2, .max_queries = 2, .max_total_queries = 5, .max_context = 1024},
          shape.params, "max_total_queries");
  refused({.max_batch = 2, .max_queries = 2, .max_context = 0}, shape.params, "max_context");
  MsaParams no_ranked = shape.params;
  no_ranked.topk = 2;
  no_ranked.local_blocks = 1;
  no_ranked.init_blocks = 1;
  refused(good, no_ranked, "topk");  // sparse (1024 > 2 x 128) but nothing to rank

  const DecodePlan plan(good, dims, shape.params);
  DeviceStep device(shape, plan.capacities(), plan.workspace_bytes());
  const auto run_refused = [&](DecodeStep step, const std::string& argument) {
    try {
      plan.run(step, nullptr);
      ADD_FAILURE() << "run() accepted; expected a refusal naming " << argument;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    }
  };
  DecodeStep step = device.step();
  step.page_table_stride = 1024 / 128 - 1;
  run_refused(step, "page_table_stride");
  step = device.step();
  step.topk = nullptr;
  run_refused(step, "topk");
  step = device.step();
  step.workspace = static_cast<char*>(step.workspace) + 16;
  run_refused(step, "workspace");
  step = device.step();
  step.q = step.q + 1;
  run_refused(step, "q");
  step = device.step();
  step.num_pages = 0;
  run_refused(step, "num_pages");
}

}  // namespace
}  // namespace msa::testing
