// `msa op` end to end: writes inputs with save_safetensors, runs the real binary, and
// compares its output file with calling the library directly.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "cli_runner.h"
#include "msa/ops.h"
#include "msa/quantized_index_keys.h"
#include "msa/quantized_kv_cache.h"
#include "msa/safetensors.h"
#include "msa/training.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using msa::testing::bitwise_equal;
using msa::testing::CliResult;
using msa::testing::cu_seqlens;
using msa::testing::random_normal;
using msa::testing::read_bytes;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Devices every op is run on (each must succeed and match the library).
const std::vector<std::string> kDevices = {"reference", "cpu"};

// A fresh directory per test (inputs, outputs, the tool's stdout and stderr).
class CliTest : public msa::testing::TempDirTest {
 protected:
  // `msa <args...>` (each one shell word), stdout and stderr apart, in this test's directory.
  CliResult run(const std::vector<std::string>& args) const {
    std::string words;
    for (const std::string& arg : args)
      words += (words.empty() ? "" : " ") + msa::testing::shell_quote(arg);
    return msa::testing::run_cli(words, dir_, /*merge_stderr=*/false);
  }
};

// ---- one small problem for every op: Hq=4, Hkv=Hi=2, D=Di=16, block 4, topk 3 ----

constexpr int64_t kQHeads = 4, kKvHeads = 2, kDim = 16, kIndexDim = 16;

MsaParams small_params() {
  MsaParams params;
  params.block_size = 4;
  params.topk = 3;
  return params;
}
const std::vector<std::string> kParamFlags = {"--block-size", "4", "--topk", "3"};

struct OpCase {
  NamedTensors inputs;
  std::function<NamedTensors(const NamedTensors&, Impl)> call;  // the library, directly
};

const Tensor& find(const NamedTensors& tensors, const std::string& name) {
  for (const auto& [key, tensor] : tensors)
    if (key == name) return tensor;
  throw Error("test: no input " + name);
}

NamedTensors attention_named(const AttentionOutput& out) { return {{"o", out.o}, {"lse", out.lse}}; }
NamedTensors grads_named(const AttentionGrads& out) {
  return {{"dq", out.dq}, {"dk", out.dk}, {"dv", out.dv}};
}

// Varlen inputs: two sequences, queries the suffix of their keys.
NamedTensors varlen_inputs() {
  const MsaParams params = small_params();
  const Tensor cu_q = cu_seqlens({6, 10}), cu_k = cu_seqlens({9, 14});
  const int64_t total_q = 16, total_k = 23;
  NamedTensors in = {{"q", random_normal({total_q, kQHeads, kDim})},
                     {"k", random_normal({total_k, kKvHeads, kDim})},
                     {"v", random_normal({total_k, kKvHeads, kDim})},
                     {"qi", random_normal({total_q, kKvHeads, kIndexDim})},
                     {"ki", random_normal({total_k, kIndexDim})},
                     {"cu_seqlens_q", cu_q},
                     {"cu_seqlens_k", cu_k},
                     {"extra_tensor_ignored", random_normal({3})}};
  const Tensor topk =
      indexer(find(in, "qi"), find(in, "ki"), cu_q, cu_k, params, Impl::reference).topk;
  in.emplace_back("topk", topk);
  const AttentionOutput forward = sparse_attention(find(in, "q"), find(in, "k"), find(in, "v"),
                                                   topk, cu_q, cu_k, params, Impl::reference);
  in.emplace_back("o", forward.o);
  in.emplace_back("lse", forward.lse);
  in.emplace_back("do", random_normal({total_q, kQHeads, kDim}));
  return in;
}

// Paged inputs: two requests (3 and 1 new queries) over 9 and 14 cached tokens, pages
// scattered over a cache of 8.
NamedTensors paged_inputs() {
  const MsaParams params = small_params();
  const int64_t pages = 8, block = params.block_size, total_q = 4;
  NamedTensors in = {
      {"q", random_normal({total_q, kQHeads, kDim})},
      {"qi", random_normal({total_q, kKvHeads, kIndexDim})},
      {"k_cache", random_normal({pages, kKvHeads, block, kDim})},
      {"v_cache", random_normal({pages, kKvHeads, block, kDim})},
      {"index_key_cache", random_normal({pages, block, kIndexDim})},
      {"page_table", Tensor::from_vector<int32_t>({5, 1, 7, -1, 0, 6, 2, 3}, {2, 4})},
      {"seq_lens", Tensor::from_vector<int32_t>({9, 14}, {2})},
      {"cu_seqlens_q", cu_seqlens({3, 1})}};
  PagedKvCache cache{find(in, "k_cache"), find(in, "v_cache"), find(in, "index_key_cache"),
                     find(in, "page_table"), find(in, "seq_lens")};
  in.emplace_back("topk", paged_indexer(find(in, "qi"), cache, find(in, "cu_seqlens_q"), params,
                                        Impl::reference)
                              .topk);
  return in;
}

PagedKvCache cache_of(const NamedTensors& in) {
  PagedKvCache cache;
  cache.k_cache = find(in, "k_cache");
  cache.v_cache = find(in, "v_cache");
  cache.index_key_cache = find(in, "index_key_cache");
  cache.page_table = find(in, "page_table");
  cache.seq_lens = find(in, "seq_lens");
  return cache;
}

OpCase make_case(const std::string& op) {
  const MsaParams p = small_params();
  using In = const NamedTensors&;
  const auto t = [](In in, const char* name) { return find(in, name); };
  if (op == "indexer")
    return {varlen_inputs(), [=](In in, Impl impl) -> NamedTensors {
              const auto out = indexer(t(in, "qi"), t(in, "ki"), t(in, "cu_seqlens_q"),
                                       t(in, "cu_seqlens_k"), p, impl);
              return {{"topk", out.topk}, {"lse", out.lse}};
            }};
  if (op == "sparse_attention")
    return {varlen_inputs(), [=](In in, Impl impl) {
              return attention_named(sparse_attention(t(in, "q"), t(in, "k"), t(in, "v"),
                                                      t(in, "topk"), t(in, "cu_seqlens_q"),
                                                      t(in, "cu_seqlens_k"), p, impl));
            }};
  if (op == "sparse_attention_backward")
    return {varlen_inputs(), [=](In in, Impl impl) {
              return grads_named(sparse_attention_backward(
                  t(in, "q"), t(in, "k"), t(in, "v"), t(in, "topk"), t(in, "o"), t(in, "lse"),
                  t(in, "do"), t(in, "cu_seqlens_q"), t(in, "cu_seqlens_k"), p, impl));
            }};
  if (op == "indexer_kl")
    return {varlen_inputs(), [=](In in, Impl impl) -> NamedTensors {
              const auto out = indexer_kl(t(in, "q"), t(in, "k"), t(in, "lse"), t(in, "qi"),
                                          t(in, "ki"), t(in, "topk"), t(in, "cu_seqlens_q"),
                                          t(in, "cu_seqlens_k"), p, impl);
              return {{"loss", out.loss}, {"dqi", out.dqi}, {"dki", out.dki}};
            }};
  if (op == "train_step")
    return {varlen_inputs(), [=](In in, Impl impl) -> NamedTensors {
              TrainingStepInputs step_in;
              step_in.q = t(in, "q");
              step_in.k = t(in, "k");
              step_in.v = t(in, "v");
              step_in.qi = t(in, "qi");
              step_in.ki = t(in, "ki");
              step_in.grad_o = t(in, "do");
              step_in.cu_seqlens_q = t(in, "cu_seqlens_q");
              step_in.cu_seqlens_k = t(in, "cu_seqlens_k");
              const TrainingStepOutput out = training_step(step_in, p, impl);
              return {{"topk", out.index.topk}, {"index_lse", out.index.lse},
                      {"o", out.attention.o},   {"lse", out.attention.lse},
                      {"dq", out.grads.dq},     {"dk", out.grads.dk},
                      {"dv", out.grads.dv},     {"loss", out.kl.loss},
                      {"dqi", out.kl.dqi},      {"dki", out.kl.dki}};
            }};
  if (op == "dense_attention")
    return {varlen_inputs(), [=](In in, Impl impl) {
              return attention_named(dense_attention(t(in, "q"), t(in, "k"), t(in, "v"),
                                                     t(in, "cu_seqlens_q"),
                                                     t(in, "cu_seqlens_k"), p, impl));
            }};
  if (op == "dense_attention_backward")
    return {varlen_inputs(), [=](In in, Impl impl) {
              return grads_named(dense_attention_backward(
                  t(in, "q"), t(in, "k"), t(in, "v"), t(in, "o"), t(in, "lse"), t(in, "do"),
                  t(in, "cu_seqlens_q"), t(in, "cu_seqlens_k"), p, impl));
            }};
  if (op == "paged_indexer")
    return {paged_inputs(), [=](In in, Impl impl) -> NamedTensors {
              return {{"topk",
                       paged_indexer(t(in, "qi"), cache_of(in), t(in, "cu_seqlens_q"), p, impl)
                           .topk}};
            }};
  if (op == "paged_sparse_attention")
    return {paged_inputs(), [=](In in, Impl impl) {
              return attention_named(paged_sparse_attention(
                  t(in, "q"), cache_of(in), t(in, "topk"), t(in, "cu_seqlens_q"), p, impl));
            }};
  if (op == "paged_dense_attention")
    return {paged_inputs(), [=](In in, Impl impl) {
              return attention_named(
                  paged_dense_attention(t(in, "q"), cache_of(in), t(in, "cu_seqlens_q"), p, impl));
            }};
  throw Error("test: unknown op " + op);
}

const std::vector<std::string> kOps = {"indexer",
                                       "sparse_attention",
                                       "sparse_attention_backward",
                                       "indexer_kl",
                                       "train_step",
                                       "dense_attention",
                                       "dense_attention_backward",
                                       "paged_indexer",
                                       "paged_sparse_attention",
                                       "paged_dense_attention"};

// ---- every op on every device ----

class CliOpTest : public CliTest,
                  public ::testing::WithParamInterface<std::tuple<std::string, std::string>> {};

TEST_P(CliOpTest, OutputMatchesTheLibrary) {
  const auto& [op, device] = GetParam();
  const OpCase op_case = make_case(op);
  save_safetensors(path("in.safetensors"), op_case.inputs);
  const std::string input_before = read_bytes(path("in.safetensors"));

  std::vector<std::string> args = {"op", op, "--in", path("in.safetensors"), "--out",
                                   path("out.safetensors"), "--device", device};
  args.insert(args.end(), kParamFlags.begin(), kParamFlags.end());
  const CliResult result = run(args);
  EXPECT_EQ(read_bytes(path("in.safetensors")), input_before);

  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out.find("msa op " + op + ": device " + device), 0u) << result.out;
  EXPECT_EQ(std::count(result.out.begin(), result.out.end(), '\n'), 1) << result.out;

  const SafetensorsFile output = SafetensorsFile::open(path("out.safetensors"));
  const NamedTensors expected = op_case.call(op_case.inputs, impl_from_name(device));
  EXPECT_EQ(output.names().size(), expected.size());
  for (const auto& [name, want] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(output.contains(name));
    const Tensor got = output.get(name);
    EXPECT_EQ(got.dtype(), want.dtype() == DType::i32 ? DType::i32 : DType::f32);
    if (device == "reference") {
      EXPECT_TRUE(bitwise_equal(got, want.dtype() == DType::f64 ? want.to(DType::f32) : want));
    } else {  // same implementation, same inputs; allow for non-deterministic reductions
      EXPECT_LE(msa::testing::max_abs_diff(got, want), 1e-5);
    }
  }
  const auto& metadata = output.metadata();
  EXPECT_EQ(metadata.at("op"), op);
  EXPECT_EQ(metadata.at("device"), device);
  EXPECT_EQ(metadata.at("block_size"), "4");
  EXPECT_EQ(metadata.at("topk"), "3");
  EXPECT_TRUE(metadata.count("msa_version"));
  if (op.find("attention") != std::string::npos) {
    EXPECT_EQ(std::stod(metadata.at("scale")), 0.25);  // 0 resolved to 1/sqrt(D = 16)
  }
}

// Quantized index-key caches reach paged_indexer through the optional index_key_scale input.
TEST_F(CliTest, PagedIndexerReadsQuantizedIndexKeys) {
  for (const IndexKeyFormat format : {IndexKeyFormat::fp8, IndexKeyFormat::fp4}) {
    SCOPED_TRACE(format == IndexKeyFormat::fp8 ? "fp8" : "fp4");
    NamedTensors in = paged_inputs();
    const QuantizedIndexKeys quantized = quantize_index_keys(find(in, "index_key_cache"), format);
    for (auto& [name, tensor] : in)
      if (name == "index_key_cache") tensor = quantized.codes;
    in.emplace_back("index_key_scale", quantized.scale);
    save_safetensors(path("in.safetensors"), in);
    std::vector<std::string> args = {"op", "paged_indexer", "--in", path("in.safetensors"), "--out",
                                     path("out.safetensors"), "--device", "cpu"};
    args.insert(args.end(), kParamFlags.begin(), kParamFlags.end());
    const CliResult result = run(args);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    PagedKvCache cache = cache_of(in);
    cache.index_key_scale = quantized.scale;
    const Tensor want =
        paged_indexer(find(in, "qi"), cache, find(in, "cu_seqlens_q"), small_params(), Impl::cpu).topk;
    EXPECT_TRUE(bitwise_equal(SafetensorsFile::open(path("out.safetensors")).get("topk"), want));
  }
}

// fp8 K/V caches reach the paged attention ops through the optional k_scale / v_scale inputs
// (per token and head, and per tensor).
TEST_F(CliTest, PagedAttentionReadsFp8KvCaches) {
  for (const bool per_tensor : {false, true}) {
    SCOPED_TRACE(per_tensor ? "per tensor" : "per token and head");
    NamedTensors in = paged_inputs();
    PagedKvCache cache = cache_of(in);
    for (const char* which : {"k", "v"}) {
      Tensor& values = std::string(which) == "k" ? cache.k_cache : cache.v_cache;
      const QuantizedKv kv = per_tensor ? quantize_kv_fp8(values, 0.01f) : quantize_kv_fp8(values);
      for (auto& [name, tensor] : in)
        if (name == std::string(which) + "_cache") tensor = kv.codes;
      in.emplace_back(std::string(which) + "_scale", kv.scale);
      values = kv.codes;
      (std::string(which) == "k" ? cache.k_scale : cache.v_scale) = kv.scale;
    }
    save_safetensors(path("in.safetensors"), in);
    for (const std::string op : {"paged_dense_attention", "paged_sparse_attention"}) {
      std::vector<std::string> args = {"op", op, "--in", path("in.safetensors"), "--out",
                                       path("out.safetensors"), "--device", "cpu"};
      args.insert(args.end(), kParamFlags.begin(), kParamFlags.end());
      const CliResult result = run(args);
      ASSERT_EQ(result.exit_code, 0) << result.err;
      const AttentionOutput want =
          op == "paged_dense_attention"
              ? paged_dense_attention(find(in, "q"), cache, find(in, "cu_seqlens_q"), small_params(), Impl::cpu)
              : paged_sparse_attention(find(in, "q"), cache, find(in, "topk"), find(in, "cu_seqlens_q"),
                                       small_params(), Impl::cpu);
      const SafetensorsFile out = SafetensorsFile::open(path("out.safetensors"));
      EXPECT_TRUE(bitwise_equal(out.get("o"), want.o)) << op;
      EXPECT_TRUE(bitwise_equal(out.get("lse"), want.lse)) << op;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, CliOpTest,
                         ::testing::Combine(::testing::ValuesIn(kOps),
                                            ::testing::ValuesIn(kDevices)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// bf16 floats and int64 indices (PyTorch's defaults) are accepted.
TEST_F(CliTest, AcceptsBf16FloatsAndInt64Indices) {
  const MsaParams params = small_params();
  const Tensor q = random_normal({6, kQHeads, kDim}, 1.0, DType::bf16);
  const Tensor k = random_normal({9, kKvHeads, kDim}, 1.0, DType::bf16);
  const Tensor v = random_normal({9, kKvHeads, kDim}, 1.0, DType::bf16);
  const Tensor cu_q = cu_seqlens({2, 4}), cu_k = cu_seqlens({4, 5});
  save_safetensors(path("in.safetensors"), {{"q", q}, {"k", k}, {"v", v},
                                            {"cu_seqlens_q", cu_q.to(DType::i64)},
                                            {"cu_seqlens_k", cu_k.to(DType::i64)}});
  std::vector<std::string> args = {"op", "dense_attention", "--in", path("in.safetensors"),
                                   "--out", path("out.safetensors"), "--device", "reference"};
  args.insert(args.end(), kParamFlags.begin(), kParamFlags.end());
  const CliResult result = run(args);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const AttentionOutput want = dense_attention(q, k, v, cu_q, cu_k, params, Impl::reference);
  const SafetensorsFile output = SafetensorsFile::open(path("out.safetensors"));
  EXPECT_TRUE(bitwise_equal(output.get("o"), want.o));
  EXPECT_TRUE(bitwise_equal(output.get("lse"), want.lse));
}

// ---- errors: exit 2, a message naming the problem, no output file, input untouched ----

class CliErrorTest : public CliTest {
 protected:
  void SetUp() override {
    CliTest::SetUp();
    NamedTensors inputs = varlen_inputs();
    save_safetensors(path("in.safetensors"), inputs);
    NamedTensors without_ki;
    for (auto& entry : inputs)
      if (entry.first != "ki") without_ki.push_back(entry);
    save_safetensors(path("no_ki.safetensors"), without_ki);
    input_before_ = read_bytes(path("in.safetensors"));
  }
  void expect_failure(const std::vector<std::string>& args, const std::string& phrase) {
    const CliResult result = run(args);
    EXPECT_EQ(result.exit_code, 2) << result.err;
    EXPECT_NE(result.err.find(phrase), std::string::npos)
        << "expected \"" << phrase << "\" in: " << result.err;
    EXPECT_EQ(result.out, "");
    EXPECT_FALSE(fs::exists(path("out.safetensors")));
    EXPECT_EQ(read_bytes(path("in.safetensors")), input_before_);
  }
  std::vector<std::string> indexer_args(const std::string& input) const {
    return {"op", "indexer", "--in", path(input), "--out", path("out.safetensors"),
            "--device", "reference", "--block-size", "4", "--topk", "3"};
  }
  std::string input_before_;
};

TEST_F(CliErrorTest, MissingInputTensorIsNamed) {
  expect_failure(indexer_args("no_ki.safetensors"), "msa op: error: op 'indexer': input tensor(s) 'ki'");
}

TEST_F(CliErrorTest, MalformedInputFile) {
  std::ofstream(path("bad.safetensors")) << "this is not a safetensors file";
  expect_failure(indexer_args("bad.safetensors"), "msa op: error: safetensors file");
  expect_failure(indexer_args("does_not_exist.safetensors"), "msa op: error: ");
}

TEST_F(CliErrorTest, BadUsage) {
  auto args = indexer_args("in.safetensors");
  args[1] = "no_such_op";
  expect_failure(args, "unknown op \"no_such_op\"");
  expect_failure({"op", "indexer", "--in", path("in.safetensors")}, "--out is required");
  expect_failure({"op", "--in", path("in.safetensors"), "--out", path("out.safetensors")},
                 "expected one op name");

  args = indexer_args("in.safetensors");
  args.back() = "three";
  expect_failure(args, "--topk: expected an integer");
  args.back() = "3.5";
  expect_failure(args, "--topk: expected an integer");
  args = indexer_args("in.safetensors");
  args.insert(args.end(), {"--scale", "big"});
  expect_failure(args, "--scale: expected a number in [-1e+06, 1e+06], got \"big\"");
  args = indexer_args("in.safetensors");
  args.insert(args.end(), {"--frobnicate", "1"});
  expect_failure(args, "unknown flag(s): --frobnicate");
  args = indexer_args("in.safetensors");
  args.push_back("--temperature");
  expect_failure(args, "--temperature: expected a value");
  args = indexer_args("in.safetensors");
  args.insert(args.end(), {"--topk", "4"});
  expect_failure(args, "--topk given twice");
  args = indexer_args("in.safetensors");
  args[7] = "tpu";
  expect_failure(args, "--device: expected cpu, reference or cuda");
}

TEST_F(CliErrorTest, InvalidParamsAndCudaAreLibraryErrors) {
  auto args = indexer_args("in.safetensors");
  args.insert(args.end(), {"--local-blocks", "0"});
  expect_failure(args, "--local-blocks: expected an integer in [1, 65536], got \"0\"");
  args = indexer_args("in.safetensors");  // each flag in range, the combination not
  args.insert(args.end(), {"--local-blocks", "3", "--init-blocks", "1"});
  expect_failure(args, "msa op: argument 'local_blocks + init_blocks'");
  args = indexer_args("in.safetensors");
  args[7] = "cuda";
  expect_failure(args, "msa op: error: impl 'cuda'");
}

// --bidirectional: the dense ops with MsaParams::causal = false (the library's result); the
// MSA ops refuse it naming the field.
TEST_F(CliTest, BidirectionalDenseAttention) {
  const NamedTensors in = varlen_inputs();
  save_safetensors(path("in.safetensors"), in);
  for (const std::string device : kDevices) {
    std::vector<std::string> args = {"op", "dense_attention", "--in", path("in.safetensors"), "--out",
                                     path("out.safetensors"), "--device", device, "--bidirectional"};
    args.insert(args.end(), kParamFlags.begin(), kParamFlags.end());
    const CliResult result = run(args);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    MsaParams params = small_params();
    params.causal = false;
    const AttentionOutput want = dense_attention(find(in, "q"), find(in, "k"), find(in, "v"), find(in, "cu_seqlens_q"),
                                                 find(in, "cu_seqlens_k"), params, impl_from_name(device));
    const SafetensorsFile out = SafetensorsFile::open(path("out.safetensors"));
    EXPECT_TRUE(bitwise_equal(out.get("o"), want.o)) << device;
    EXPECT_EQ(out.metadata().at("causal"), "0");
  }
  const CliResult refused = run({"op", "indexer", "--in", path("in.safetensors"), "--out", path("out2.safetensors"),
                                 "--bidirectional", "--block-size", "4", "--topk", "3"});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.err.find("argument 'causal': expected true for indexer"), std::string::npos) << refused.err;
}

TEST_F(CliTest, HelpAndVersion) {
  CliResult result = run({"--help"});
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.out.find("usage: msa"), std::string::npos);
  result = run({"op", "--help"});
  EXPECT_EQ(result.exit_code, 0);
  for (const std::string& op : kOps)
    EXPECT_NE(result.out.find("  " + op + ":"), std::string::npos) << op;
  EXPECT_NE(result.out.find("index_key_cache [pages,B,Di]"), std::string::npos);
  result = run({"version"});
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.out.rfind("msa ", 0), 0u);
  result = run({"frobnicate"});
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("unknown command"), std::string::npos);
  result = run({});
  EXPECT_EQ(result.exit_code, 2);
}

}  // namespace
}  // namespace msa
