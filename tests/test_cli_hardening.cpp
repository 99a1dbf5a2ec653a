// The `msa` tool against hostile and careless input (docs/hardening.md): every bad value of
// every numeric flag, outputs that would replace inputs, non-finite inputs and weights,
// malformed model files. Each failure must exit 2 with a message naming the flag, file or
// field, and leave every file as it was.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "cli_runner.h"
#include "msa/model_config.h"
#include "msa/model_random.h"
#include "msa/ops.h"
#include "msa/safetensors.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using msa::testing::CliResult;
using msa::testing::read_bytes;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Fixed inputs (no random seed): values from a formula.
Tensor ramp(const Shape& shape, double step = 0.37) {
  Tensor t = Tensor::zeros(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, std::sin(step * double(i + 1)));
  return t;
}
Tensor ints(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// Every file of `dir` (recursively) and its bytes.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    if (entry.is_regular_file()) files[entry.path().string()] = read_bytes(entry.path().string());
  return files;
}

class CliHardening : public msa::testing::TempDirTest {
 protected:
  CliResult run(const std::vector<std::string>& args) const {
    std::string words;
    for (const std::string& arg : args)
      words += (words.empty() ? "" : " ") + msa::testing::shell_quote(arg);
    fs::create_directories(dir_ / "cli");
    return msa::testing::run_cli(words, dir_ / "cli", /*merge_stderr=*/false);
  }
  // Runs `args`, expects exit 2 and `phrase` in stderr, and every file under dir_ unchanged.
  void expect_refused(const std::vector<std::string>& args, const std::string& phrase) {
    const auto before = snapshot(dir_ / "data");
    const CliResult result = run(args);
    std::string command;
    for (const auto& arg : args) command += arg + " ";
    EXPECT_EQ(result.exit_code, 2) << command << "\n" << result.err;
    EXPECT_NE(result.err.find(phrase), std::string::npos)
        << command << "\nexpected \"" << phrase << "\" in: " << result.err;
    EXPECT_EQ(snapshot(dir_ / "data"), before) << command;
  }
  std::string data(const std::string& name) const { return (dir_ / "data" / name).string(); }

  void SetUp() override {
    TempDirTest::SetUp();
    fs::create_directories(dir_ / "data");
  }

  // A small varlen problem: one sequence of 5 keys, 3 queries, Hq 2, Hkv 1, D 4.
  NamedTensors attention_inputs() const {
    return {{"q", ramp({3, 2, 4})},          {"k", ramp({5, 1, 4}, 0.51)},
            {"v", ramp({5, 1, 4}, 0.23)},    {"qi", ramp({3, 1, 4}, 0.11)},
            {"ki", ramp({5, 4}, 0.71)},      {"cu_seqlens_q", ints({0, 3})},
            {"cu_seqlens_k", ints({0, 5})}};
  }
  std::vector<std::string> op(const std::string& name, const std::string& in, const std::string& out) const {
    return {"op", name, "--in", in, "--out", out, "--block-size", "2", "--topk", "2"};
  }
  // The tiny model, written once per test that needs it.
  std::string tiny_model() const {
    const std::string dir = data("tiny");
    if (!fs::exists(dir))
      write_random_checkpoint(model_config_preset("tiny"), dir, {.seed = 5, .dtype = DType::f32});
    return dir;
  }
};

// ---- 1. every numeric flag is range-checked ----

TEST_F(CliHardening, EveryNumericFlagRefusesOutOfRangeValues) {
  save_safetensors(data("in.safetensors"), attention_inputs());
  const std::string model = tiny_model();
  const std::vector<std::string> op_base = {"op", "dense_attention", "--in", data("in.safetensors"),
                                            "--out", data("o.safetensors")};
  const std::vector<std::string> logits_base = {"logits", "--model", model, "--tokens", "1,2",
                                                "--out", data("l.safetensors")};
  const std::vector<std::string> run_base = {"run", "--model", model, "--prompt-tokens", "1,2"};
  const std::vector<std::string> make_base = {"make-model", "--config", "tiny", "--out", data("new")};
  const std::vector<std::string> bench_base = {"bench", "--contexts", "64"};
  const struct {
    const std::vector<std::string>* base;
    std::string flag, value;
  } cases[] = {
      {&op_base, "block-size", "0"},      {&op_base, "block-size", "100000"},
      {&op_base, "topk", "-1"},           {&op_base, "topk", "3.5"},
      {&op_base, "local-blocks", "0"},    {&op_base, "init-blocks", "-1"},
      {&op_base, "scale", "nan"},         {&op_base, "scale", "1e300"},
      {&op_base, "index-scale", "inf"},   {&op_base, "temperature", "0"},
      {&op_base, "temperature", "-2"},    {&op_base, "kl-coef", "1e9"},
      {&op_base, "threads", "10000"},     {&op_base, "threads", "-1"},
      {&logits_base, "chunk", "-1"},      {&logits_base, "threads", "10000"},
      {&run_base, "cache-tokens", "-100"}, {&run_base, "max-tokens", "0"},
      {&run_base, "max-tokens", "99999999999"}, {&run_base, "temperature", "-1"},
      {&run_base, "top-k", "-3"},         {&run_base, "top-p", "0"},
      {&run_base, "top-p", "1.5"},        {&run_base, "seed", "-1"},
      {&run_base, "chunk", "0"},          {&run_base, "threads", "10000"},
      {&make_base, "seed", "-5"},         {&make_base, "shard-mb", "-1"},
      {&bench_base, "chunk", "0"},        {&bench_base, "repeats", "0"},
      {&bench_base, "heads", "0"},        {&bench_base, "threads", "10000"},
      {&bench_base, "contexts", "0"},     {&bench_base, "contexts", "99999999999"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = *c.base;
    if (c.flag == "contexts") args.erase(args.begin() + 1, args.begin() + 3);
    args.insert(args.end(), {"--" + c.flag, c.value});
    expect_refused(args, "--" + c.flag + ": expected ");
  }
  EXPECT_FALSE(fs::exists(data("o.safetensors")));
  EXPECT_FALSE(fs::exists(data("new")));
}

TEST_F(CliHardening, ThreadsUpToTheCoreCountAreAccepted) {
  save_safetensors(data("in.safetensors"), attention_inputs());
  std::vector<std::string> args = op("dense_attention", data("in.safetensors"), (dir_ / "o.safetensors").string());
  args.insert(args.end(), {"--threads", std::to_string(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)))});
  const CliResult result = run(args);
  EXPECT_EQ(result.exit_code, 0) << result.err;
}

TEST_F(CliHardening, UnknownIndexComputeIsAUsageError) {
  save_safetensors(data("in.safetensors"), attention_inputs());
  for (const std::string value : {"fp4", "", "EXACT"}) {
    std::vector<std::string> args = op("indexer", data("in.safetensors"), (dir_ / "o.safetensors").string());
    args.insert(args.end(), {"--index-compute", value});
    expect_refused(args, "--index-compute: expected exact or fp8, got \"" + value + "\"");
  }
}

// ---- 2. outputs never replace inputs ----

TEST_F(CliHardening, OpOutputThatIsTheInputIsRefused) {
  save_safetensors(data("in.safetensors"), attention_inputs());
  expect_refused(op("dense_attention", data("in.safetensors"), data("in.safetensors")),
                 "--out: refusing to write");
  expect_refused(op("dense_attention", data("in.safetensors"), data("./sub/../in.safetensors")),
                 "same file as --in");
  fs::create_symlink(data("in.safetensors"), data("link.safetensors"));
  expect_refused(op("dense_attention", data("in.safetensors"), data("link.safetensors")), "same file as --in");
  fs::create_hard_link(data("in.safetensors"), data("hard.safetensors"));
  expect_refused(op("dense_attention", data("in.safetensors"), data("hard.safetensors")), "same file as --in");
  // An input directory (a model directory of tensors) protects everything inside it.
  fs::create_directories(data("dir"));
  save_safetensors(data("dir/model.safetensors"), attention_inputs());
  expect_refused(op("dense_attention", data("dir"), data("dir/out.safetensors")), "lies inside the directory --in");
  const CliResult fine = run(op("dense_attention", data("dir"), (dir_ / "o.safetensors").string()));
  EXPECT_EQ(fine.exit_code, 0) << fine.err;
}

TEST_F(CliHardening, LogitsNeverWriteIntoTheModel) {
  const std::string model = tiny_model();
  for (const std::string& out : {model + "/model.safetensors", model + "/config.json", model + "/new.safetensors", model})
    expect_refused({"logits", "--model", model, "--tokens", "1,2", "--out", out}, "--out: refusing to write");
  expect_refused({"logits", "--model", model, "--tokens", "1,2", "--out", (dir_ / "l.safetensors").string(),
                  "--dump", model + "/config.json"},
                 "--dump: refusing to write");
  expect_refused({"logits", "--model", model, "--tokens", "1,2", "--out", (dir_ / "l.safetensors").string(),
                  "--dump", (dir_ / "l.safetensors").string()},
                 "same file as --out");
  // The weights reached through a symlinked model directory are the same files.
  fs::create_directory_symlink(model, dir_ / "alias");
  expect_refused({"logits", "--model", (dir_ / "alias").string(), "--tokens", "1,2", "--out",
                  model + "/model.safetensors"},
                 "--out: refusing to write");
}

// The vision commands: --out / --dump never replace the model or the pixels file, --threads
// is range-checked, non-finite pixel values and malformed pixel files are refused.
TEST_F(CliHardening, VisionInputsAreGuarded) {
  const std::string model = data("tiny_vl");
  if (!fs::exists(model))
    write_random_checkpoint(model_config_preset("tiny-vl"), model, {.seed = 5, .dtype = DType::f32});
  const Tensor clean = testing::random_normal({4, 1176});
  Tensor pixels = clean.clone();
  const Tensor grid = Tensor::from_vector<int32_t>({1, 2, 2}, {1, 3});
  save_safetensors(data("p.safetensors"), {{"pixel_values", clean}, {"image_grid_thw", grid}});
  const std::string p = data("p.safetensors"), out = (dir_ / "e.safetensors").string();
  expect_refused({"vision-encode", "--model", model, "--pixels", p, "--out", p}, "--out: refusing to write");
  expect_refused({"vision-encode", "--model", model, "--pixels", p, "--out", model + "/x.safetensors"},
                 "--out: refusing to write");
  expect_refused({"vision-encode", "--model", model, "--pixels", p, "--out", out, "--dump", p},
                 "--dump: refusing to write");
  expect_refused({"vision-encode", "--model", model, "--pixels", p, "--out", out, "--threads", "10000"},
                 "--threads: expected ");
  expect_refused({"logits", "--model", model, "--tokens", "5,500,6", "--pixels", p, "--out", p},
                 "--out: refusing to write");
  pixels.set(7, std::nan(""));
  save_safetensors(data("nan.safetensors"), {{"pixel_values", pixels}, {"image_grid_thw", grid}});
  expect_refused({"vision-encode", "--model", model, "--pixels", data("nan.safetensors"), "--out", out},
                 "tensor 'pixel_values': expected finite values, got nan at index [0, 7]");
  write_text(data("junk.safetensors"), "not a safetensors file");
  expect_refused({"vision-encode", "--model", model, "--pixels", data("junk.safetensors"), "--out", out},
                 "junk.safetensors");
  save_safetensors(data("grid2d.safetensors"),
                   {{"pixel_values", clean}, {"image_grid_thw", Tensor::from_vector<int32_t>({1, 2}, {1, 2})}});
  expect_refused({"vision-encode", "--model", model, "--pixels", data("grid2d.safetensors"), "--out", out},
                 "expected shape [grids in 1..65536, 3]");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliHardening, MakeModelReplacesAnExistingModelOnlyWithForce) {
  const std::string model = tiny_model();
  expect_refused({"make-model", "--config", "tiny", "--out", model}, "--force");
  write_text(data("notes/readme.txt"), "mine");
  expect_refused({"make-model", "--config", "tiny", "--out", data("notes")}, "exists and is not empty");
  expect_refused({"make-model", "--config", "tiny", "--out", data("notes/readme.txt")}, "not a directory");
  const CliResult forced = run({"make-model", "--config", "tiny", "--out", model, "--seed", "9", "--force"});
  EXPECT_EQ(forced.exit_code, 0) << forced.err;
  fs::create_directories(data("empty"));
  const CliResult empty = run({"make-model", "--config", "tiny", "--out", data("empty")});
  EXPECT_EQ(empty.exit_code, 0) << empty.err;
}

// ---- 3. model files that cannot be right ----

TEST_F(CliHardening, MalformedModelFilesAreErrorsNotCrashes) {
  const std::string model = tiny_model();
  const std::string config = read_bytes(model + "/config.json");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"text_config\": " + std::string(100000, '[') + std::string(100000, ']') + "}", "nested deeper than 128"},
      {"[" + config + "]", "expected a JSON object"},
  };
  for (const auto& [text, phrase] : cases) {
    write_text(model + "/config.json", text);
    expect_refused({"run", "--model", model, "--prompt-tokens", "1,2"}, phrase);
  }
  write_text(model + "/config.json", config);
  write_text(model + "/tokenizer.json", "{\"model\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  expect_refused({"run", "--model", model, "--prompt", "hi"}, "nested deeper than 128");
}

TEST_F(CliHardening, NonFiniteWeightsAreNamedWithCheckWeightsAndNeverSilent) {
  const std::string model = tiny_model();
  const SafetensorsFile file = SafetensorsFile::open(model + "/model.safetensors");
  NamedTensors tensors;
  for (const std::string& name : file.names()) tensors.emplace_back(name, file.get(name).clone());
  for (auto& [name, tensor] : tensors)
    if (name == "language_model.model.norm.weight") tensor.set(3, std::nan(""));
  save_safetensors(model + "/model.safetensors", tensors);
  expect_refused({"logits", "--model", model, "--tokens", "1,2", "--out", (dir_ / "l.safetensors").string(),
                  "--check-weights"},
                 "tensor 'language_model.model.norm.weight' (f32 [64]): expected finite weights, got nan at index [3]");
  expect_refused({"logits", "--model", model, "--tokens", "1,2", "--out", (dir_ / "l.safetensors").string()},
                 "the logits are not finite");
  EXPECT_FALSE(fs::exists(dir_ / "l.safetensors"));
  expect_refused({"run", "--model", model, "--prompt-tokens", "1,2"}, "logits are not finite");
  expect_refused({"run", "--model", model, "--prompt-tokens", "1,2", "--check-weights"}, "norm.weight");
}

// ---- 5. NaN policy of msa op ----

TEST_F(CliHardening, OpRefusesNonFiniteInputsNamingTensorAndIndex) {
  const std::string out = (dir_ / "o.safetensors").string();
  NamedTensors inputs = attention_inputs();
  inputs[0].second.set(5, std::nan(""));  // q[0, 1, 1]
  save_safetensors(data("nan_q.safetensors"), inputs);
  // (Before: lse = -inf on --device cpu, NaN on --device reference.)
  for (const std::string device : {"cpu", "reference"}) {
    std::vector<std::string> args = op("dense_attention", data("nan_q.safetensors"), out);
    args.insert(args.end(), {"--device", device});
    expect_refused(args, "input tensor 'q': expected finite values, got nan at index [0, 1, 1] (flat 5)");
  }
  inputs = attention_inputs();
  inputs[3].second = Tensor::full({3, 1, 4}, DType::f32, std::nan(""));  // all-NaN qi
  save_safetensors(data("nan_qi.safetensors"), inputs);
  expect_refused(op("indexer", data("nan_qi.safetensors"), out), "input tensor 'qi': expected finite values");
  inputs = attention_inputs();
  inputs[1].second.set(2, -std::numeric_limits<double>::infinity());
  save_safetensors(data("inf_k.safetensors"), inputs);
  expect_refused(op("dense_attention", data("inf_k.safetensors"), out), "input tensor 'k'");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(CliHardening, OpLseMayHoldMinusInfinityButNotNan) {
  const std::string out = (dir_ / "o.safetensors").string();
  NamedTensors inputs = attention_inputs();
  MsaParams params;
  params.block_size = 2;
  params.topk = 2;
  const auto find = [&](const std::string& name) {
    for (const auto& [key, t] : inputs)
      if (key == name) return t;
    return Tensor();
  };
  const IndexerOutput sel = indexer(find("qi"), find("ki"), find("cu_seqlens_q"), find("cu_seqlens_k"), params, Impl::cpu);
  const AttentionOutput fwd = sparse_attention(find("q"), find("k"), find("v"), sel.topk, find("cu_seqlens_q"),
                                               find("cu_seqlens_k"), params, Impl::cpu);
  inputs.push_back({"topk", sel.topk});
  Tensor lse = fwd.lse.clone();
  inputs.push_back({"lse", lse});
  save_safetensors(data("kl.safetensors"), inputs);
  const CliResult ok = run(op("indexer_kl", data("kl.safetensors"), out));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  lse.set(1, std::nan(""));  // the KL loss stayed finite while its gradients were NaN
  save_safetensors(data("kl_nan.safetensors"), inputs);
  expect_refused(op("indexer_kl", data("kl_nan.safetensors"), out),
                 "input tensor 'lse': expected finite values (or -inf, an empty set's LSE), got nan");
  lse.set(1, -std::numeric_limits<double>::infinity());
  save_safetensors(data("kl_inf.safetensors"), inputs);
  const CliResult minus_inf = run(op("indexer_kl", data("kl_inf.safetensors"), out));
  EXPECT_EQ(minus_inf.err.find("input tensor 'lse'"), std::string::npos) << minus_inf.err;
}

// Paged caches are checked where the page table reaches: stale pages may hold anything.
TEST_F(CliHardening, PagedCachesAreCheckedOverTheSlotsInUse) {
  const std::string out = (dir_ / "o.safetensors").string();
  Tensor k_cache = ramp({3, 1, 2, 4}), v_cache = ramp({3, 1, 2, 4}, 0.4);
  // Request 0: 3 tokens in pages 2 then 0 (page 0 holds one). Page 1 is unused.
  const NamedTensors base = {{"q", ramp({1, 2, 4})},
                             {"page_table", Tensor::from_vector(std::vector<int32_t>{2, 0}, {1, 2})},
                             {"seq_lens", ints({3})},
                             {"cu_seqlens_q", ints({0, 1})}};
  const auto write_with = [&](const std::string& name, int64_t poisoned_flat) {
    Tensor k = k_cache.clone();
    if (poisoned_flat >= 0) k.set(poisoned_flat, std::nan(""));
    NamedTensors inputs = base;
    inputs.push_back({"k_cache", k});
    inputs.push_back({"v_cache", v_cache});
    save_safetensors(data(name), inputs);
  };
  write_with("unused_page.safetensors", 1 * 8 + 3);  // page 1: never reached
  write_with("unused_slot.safetensors", 0 * 8 + 4 + 1);  // page 0, slot 1: past seq_lens
  for (const char* name : {"unused_page.safetensors", "unused_slot.safetensors"}) {
    const CliResult result = run(op("paged_dense_attention", data(name), out));
    EXPECT_EQ(result.exit_code, 0) << name << ": " << result.err;
  }
  write_with("used_slot.safetensors", 0 * 8 + 2);  // page 0, slot 0: token 2
  expect_refused(op("paged_dense_attention", data("used_slot.safetensors"), out),
                 "input tensor 'k_cache': expected finite values, got nan at index [0, 0, 0, 2]");
}

}  // namespace
}  // namespace msa
