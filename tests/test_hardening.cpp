// Hardening of the library against hostile and careless input (docs/hardening.md): the
// depth-limited JSON parse behind every reader, config and tokenizer ranges, the
// chat-template renderer's limits, the non-finite checks and the NaN behaviour of the ops.
// Every input here is fixed (no random seeds): each case is one of the classes the fuzz
// targets in tests/fuzz cover by the million.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/json_parse.h"
#include "msa/model.h"
#include "msa/model_config.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/ops.h"
#include "msa/safetensors.h"
#include "test_util.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using msa::testing::error_of;
using msa::testing::expect_error;
using HardeningTest = msa::testing::TempDirTest;

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string safetensors_with_header(const std::string& header) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t(header.size()) >> (8 * i));
  return out + header;
}

// ---- JSON: one depth-limited parse ----

TEST(HardeningJson, DepthIsBoundedAtParseTime) {
  EXPECT_NO_THROW(parse_json_limited(nested(kMaxJsonDepth)));
  const std::string too_deep = error_of([] { parse_json_limited(nested(kMaxJsonDepth + 1)); });
  EXPECT_NE(too_deep.find("nested deeper than 128"), std::string::npos) << too_deep;
  // 100,000 levels: the crash of the issue (now a clean error, quickly).
  EXPECT_THROW(parse_json_limited(nested(100000)), JsonParseError);
  EXPECT_THROW(parse_json_limited(std::string(100000, '{')), JsonParseError);
  EXPECT_THROW(parse_ordered_json_limited("{\"a\": " + nested(100000) + "}"), JsonParseError);
  EXPECT_THROW(parse_json_limited("{\"a\": 1"), JsonParseError);
}

TEST(HardeningJson, IntegralReadsRefuseFractionsBoolsAndOverflow) {
  EXPECT_EQ(json_integral(json::parse("64")), 64);
  EXPECT_EQ(json_integral(json::parse("64.0")), 64);
  EXPECT_EQ(json_integral(json::parse("64.5")), std::nullopt);
  EXPECT_EQ(json_integral(json::parse("true")), std::nullopt);
  EXPECT_EQ(json_integral(json::parse("\"64\"")), std::nullopt);
  EXPECT_EQ(json_integral(json::parse("18446744073709551615")), std::nullopt);
  EXPECT_EQ(json_integral(json::parse("1e300")), std::nullopt);
  EXPECT_EQ(json_integral(json::parse("1099511627776")), int64_t{1} << 40);
}

// ---- safetensors ----

TEST_F(HardeningTest, DeepSafetensorsHeaderAndIndexAreErrors) {
  // Terminated nesting (valid JSON) is the case that used to overflow the stack while the
  // error message dumped it.
  for (const std::string& header : {nested(100000), "{\"x\": " + nested(100000) + "}",
                                    "{\"__metadata__\": " + nested(5000) + "}"}) {
    write_text(dir_ / "deep.safetensors", safetensors_with_header(header));
    const std::string error = error_of([&] { SafetensorsFile::open(path("deep.safetensors")); });
    EXPECT_NE(error.find("nested deeper than 128"), std::string::npos) << error;
  }
  fs::create_directories(dir_ / "model");
  write_text(dir_ / "model" / "model.safetensors.index.json",
             "{\"weight_map\": " + nested(100000) + "}");
  const std::string error = error_of([&] { SafetensorsModel::open(path("model")); });
  EXPECT_NE(error.find("model.safetensors.index.json"), std::string::npos) << error;
  EXPECT_NE(error.find("nested deeper"), std::string::npos) << error;
}

TEST_F(HardeningTest, IndexThatIsAFifoOrADeviceIsRefusedWithoutHanging) {
  fs::create_directories(dir_ / "fifo");
  ASSERT_EQ(::mkfifo((dir_ / "fifo" / "model.safetensors.index.json").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { SafetensorsModel::open(path("fifo")); }).find("regular file"),
            std::string::npos);
  fs::create_directories(dir_ / "dev");
  fs::create_symlink("/dev/zero", dir_ / "dev" / "model.safetensors.index.json");
  EXPECT_NE(error_of([&] { SafetensorsModel::open(path("dev")); }).find("regular file"),
            std::string::npos);
}

TEST_F(HardeningTest, SavingNeverTouchesAnExistingTmpFileOrItsSymlinkTarget) {
  write_text(dir_ / "out.safetensors.tmp", "the user's own file");
  write_text(dir_ / "target.txt", "another file of the user's");
  fs::create_symlink(dir_ / "target.txt", dir_ / "out.safetensors.tmp.0");
  save_safetensors(path("out.safetensors"), {{"x", Tensor::zeros({2}, DType::f32)}});
  EXPECT_EQ(msa::testing::read_bytes(path("out.safetensors.tmp")), "the user's own file");
  EXPECT_EQ(msa::testing::read_bytes(path("target.txt")), "another file of the user's");
  EXPECT_EQ(SafetensorsFile::open(path("out.safetensors")).get("x").numel(), 2);
}

// ---- config.json ----

const char* kReleased = R"({"text_config": {
  "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8, "rope_theta": 10000,
  "intermediate_size": 32, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
  "num_local_experts": 8, "num_experts_per_tok": 2, "moe_layer_freq": [0, 1, 1],
  "eos_token_id": 7, "bos_token_id": 6,
  "sparse_attention_config": {"use_sparse_attention": true, "sparse_attention_freq": [0, 0, 1],
    "sparse_num_index_heads": 2, "sparse_index_dim": 16, "sparse_block_size": 32,
    "sparse_topk_blocks": 8, "sparse_local_block": 1}}})";

// The released config with `pointer` set to `value` (or removed when value is discarded).
std::string config_with(const std::string& pointer, const json& value) {
  json config = json::parse(kReleased);
  config[json::json_pointer(pointer)] = value;
  return config.dump();
}

TEST(HardeningConfig, TheIssuesConfigsAreErrorsNamingTheField) {
  EXPECT_NO_THROW(parse_model_config(kReleased, "c"));
  const struct {
    std::string pointer;
    json value;
    std::string words;
  } cases[] = {
      {"/text_config/rope_theta", 0, "field 'rope_theta': expected a number in (1, 1e+15]"},
      {"/text_config/rope_theta", -5, "rope_theta"},
      {"/text_config/rms_norm_eps", 0, "field 'rms_norm_eps'"},
      {"/text_config/rms_norm_eps", -1e-6, "field 'rms_norm_eps'"},
      {"/text_config/rms_norm_eps", 1e30, "field 'rms_norm_eps': expected a number in (0, 0.1]"},
      {"/text_config/swiglu_limit", -1, "field 'swiglu_limit'"},
      {"/text_config/swiglu_alpha", 0, "field 'swiglu_alpha'"},
      {"/text_config/routed_scaling_factor", 1e300, "field 'routed_scaling_factor'"},
      {"/text_config/hidden_size", 64.5, "field 'hidden_size': expected an integer in [1, 1048576], got number 64.5"},
      {"/text_config/hidden_size", "64", "field 'hidden_size'"},
      {"/text_config/vocab_size", true, "field 'vocab_size'"},
      {"/text_config/num_hidden_layers", int64_t{1} << 40, "field 'num_hidden_layers'"},
      {"/text_config/eos_token_id", 1000, "field 'eos_token_id': expected token ids in [0, vocab_size = 1000)"},
      {"/text_config/eos_token_id", json::array({2, int64_t{1} << 40}), "field 'eos_token_id'"},
      {"/text_config/bos_token_id", -1, "field 'bos_token_id'"},
      {"/text_config/index_topk_blocks", 4,
       "fields 'index_topk_blocks' (4) and 'sparse_attention_config.sparse_topk_blocks' (8) are one setting and disagree"},
      {"/text_config/index_block_size", 16, "'sparse_attention_config.sparse_block_size' (32)"},
      {"/text_config/layer_types", json::array({"full_attention", "minimax_m3_sparse", "minimax_m3_sparse"}),
       "'layer_types' and 'sparse_attention_config.sparse_attention_freq'"},
      {"/text_config/mlp_layer_types", json::array({"dense", "dense", "sparse"}), "'mlp_layer_types' and 'moe_layer_freq'"},
      {"/text_config/rope_parameters", json{{"rope_theta", 20000}}, "'rope_parameters.rope_theta' and 'rope_theta'"},
      {"/text_config/rope_scaling", json{{"type", "linear"}, {"factor", 2}}, "rope_scaling.type"},
      {"/text_config/moe_layer_freq", json::array({0, 2, 1}), "field 'moe_layer_freq'"},
      {"/text_config/sparse_attention_config", "none", "field 'sparse_attention_config': expected an object"},
      {"/text_config/num_attention_heads", 0, "field 'num_attention_heads'"},
      {"/text_config/partial_rotary_factor", 1.5, "field 'partial_rotary_factor'"},
  };
  for (const auto& c : cases) {
    const std::string error = error_of([&] { parse_model_config(config_with(c.pointer, c.value), "cfg"); });
    EXPECT_NE(error.find(c.words), std::string::npos) << c.pointer << " = " << c.value << ": " << error;
  }
}

TEST(HardeningConfig, HeadDimFallbackNeverDividesByZeroOrTruncates) {
  json config = json::parse(kReleased);
  config["text_config"].erase("head_dim");
  config["text_config"]["num_attention_heads"] = 0;  // was SIGFPE (hidden_size / 0)
  EXPECT_NE(error_of([&] { parse_model_config(config.dump(), "c"); }).find("num_attention_heads"),
            std::string::npos);
  config["text_config"]["num_attention_heads"] = 3;  // 64 / 3 is not a head size
  EXPECT_NE(error_of([&] { parse_model_config(config.dump(), "c"); }).find("head_dim"),
            std::string::npos);
}

TEST(HardeningConfig, DeepAndMalformedConfigsAreErrors) {
  EXPECT_NE(error_of([] { parse_model_config("{\"text_config\": " + nested(100000) + "}", "c"); })
                .find("nested deeper"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_model_config("[1]", "c"); }).find("expected a JSON object"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_model_config(R"({"text_config": 5, "vocab_size": 3})", "c"); })
                .find("text_config"),
            std::string::npos);
}

TEST(HardeningConfig, ValidateChecksProgrammaticConfigsToo) {
  ModelConfig config = model_config_preset("tiny");
  config.rms_norm_eps = std::nan("");
  EXPECT_NE(error_of([&] { config.validate(); }).find("rms_norm_eps"), std::string::npos);
  config = model_config_preset("tiny");
  config.eos_token_ids = {int32_t(config.vocab_size)};
  EXPECT_NE(error_of([&] { config.validate(); }).find("eos_token_id[0]"), std::string::npos);
  config = model_config_preset("tiny");
  config.swiglu_limit = -1;
  EXPECT_NE(error_of([&] { config.validate(); }).find("swiglu_limit"), std::string::npos);
}

// ---- tokenizer.json ----

#ifdef MSA_WITH_TOKENIZER
json byte_tokenizer() {
  json vocab = json::object();
  int id = 0;
  for (char c = 'a'; c <= 'z'; ++c) vocab[std::string(1, c)] = id++;
  vocab["ab"] = id++;
  return {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b"})}}},
          {"added_tokens", json::array({{{"id", 100}, {"content", "<s>"}, {"special", true}}})}};
}

std::string tokenizer_error(const std::string& pointer, const json& value) {
  json config = byte_tokenizer();
  config[json::json_pointer(pointer)] = value;
  return error_of([&] { Tokenizer::from_json_string(config.dump()); });
}

TEST(HardeningTokenizer, IdsBeyond2To31OrSharedAreErrors) {
  EXPECT_NO_THROW(Tokenizer::from_json_string(byte_tokenizer().dump()));
  // 2^40 used to wrap to 0 silently.
  EXPECT_NE(tokenizer_error("/model/vocab/ab", int64_t{1} << 40).find("id of 'ab': expected an integer in [0, 2^31 - 1]"),
            std::string::npos);
  EXPECT_NE(tokenizer_error("/model/vocab/ab", 2.5).find("'ab'"), std::string::npos);
  EXPECT_NE(tokenizer_error("/model/vocab/ab", 0).find("share id 0"), std::string::npos);
  EXPECT_NE(tokenizer_error("/added_tokens/0/id", int64_t{1} << 33).find("added_tokens[0].id"),
            std::string::npos);
  EXPECT_NE(tokenizer_error("/added_tokens/0/id", 1).find("is the id of 'b' in model.vocab"),
            std::string::npos);
  json two = byte_tokenizer();
  two["added_tokens"].push_back({{"id", 100}, {"content", "</s>"}, {"special", true}});
  EXPECT_NE(error_of([&] { Tokenizer::from_json_string(two.dump()); }).find("already the id of added token '<s>'"),
            std::string::npos);
  json post = byte_tokenizer();
  post["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}})},
      {"special_tokens", {{"<s>", {{"ids", json::array({int64_t{1} << 40})}}}}}};
  EXPECT_NE(error_of([&] { Tokenizer::from_json_string(post.dump()); }).find("special_tokens.<s>.ids"),
            std::string::npos);
  EXPECT_NE(error_of([] { Tokenizer::from_json_string("{\"model\": " + nested(100000) + "}"); })
                .find("nested deeper"),
            std::string::npos);
}

// ---- chat templates ----

std::string render(const std::string& source, const std::string& context = "{}") {
  return ChatTemplate::from_string(source).render_json(context);
}

TEST(HardeningChatTemplate, NestingIsBoundedAtParseTime) {
  expect_error([] { render("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}"); },
               "expression nested deeper than");
  expect_error([] { render("{{ " + std::string(100000, '-') + "1 }}"); }, "nested deeper");
  expect_error([] { render("{{ " + std::string(50000, '[') + std::string(50000, ']') + " }}"); }, "nested deeper");
  std::string chain = "{{ 'a'";
  for (int i = 0; i < 5000; ++i) chain += " ~ 'a'";
  expect_error([&] { render(chain + " }}"); }, "counting chains");
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if true %}";
  for (int i = 0; i < 5000; ++i) blocks += "{% endif %}";
  expect_error([&] { render(blocks); }, "blocks nested deeper than 100");
  expect_error([] { render("{{ x }}", "{\"x\": " + nested(100000) + "}"); }, "nested deeper");
  // Real nesting still works.
  EXPECT_EQ(render("{{ ((1 + 2) * (3 - (4 // 2))) }}"), "3");
}

TEST(HardeningChatTemplate, ValuesStayAcyclicAndShallow) {
  expect_error([] { render("{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns.self }}"); },
               "holding a namespace");
  expect_error([] { render("{% set ns = namespace(a=1) %}{% set ns.l = [1, {'x': ns}] %}"); },
               "holding a namespace");
  expect_error([] {
    render("{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = [ns.l] %}{% endfor %}");
  }, "nested deeper than 256");
  EXPECT_EQ(render("{% set ns = namespace(l=[]) %}{% for i in range(3) %}{% set ns.l = ns.l + [i] %}"
                   "{% endfor %}{{ ns.l }}"),
            "[0, 1, 2]");
}

TEST(HardeningChatTemplate, WorkIsBounded) {
  for (const std::string& source : {
           "{% for i in range(10**12) %}x{% endfor %}",
           "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
           "{{ 'abc' * 1000000000000 }}",
           "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}",
           // Shared lists: 12 lines, 4^12 elements to print.
           "{% set a = [1, 1, 1, 1] %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}"
           "{% set d = [c, c, c, c] %}{% set e = [d, d, d, d] %}{% set f = [e, e, e, e] %}"
           "{% set g = [f, f, f, f] %}{% set h = [g, g, g, g] %}{% set i = [h, h, h, h] %}"
           "{% set j = [i, i, i, i] %}{% set k = [j, j, j, j] %}{% set l = [k, k, k, k] %}{{ l }}",
       })
    expect_error([&] { render(source); }, "chat template");
  expect_error([] { render("{{ range(10) | tojson(indent=100000) }}"); }, "indent in [0, 64]");
}

TEST(HardeningChatTemplate, IntegerArithmeticNeverOverflows) {
  expect_error([] { render("{{ 9223372036854775807 + 1 }}"); }, "integer overflow");
  expect_error([] { render("{{ -(-9223372036854775807 - 1) }}"); }, "integer overflow");
  expect_error([] { render("{{ (-9223372036854775807 - 1) // -1 }}"); }, "integer overflow");
  expect_error([] { render("{{ (-9223372036854775807 - 1) | abs }}"); }, "integer overflow");
  expect_error([] { render("{{ 99999999999999999999 }}"); }, "beyond 64 bits");
  expect_error([] { render("{{ (9223372036854775807 * 2.0) | int }}"); }, "cannot convert");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ 'abcdef'[::9223372036854775807] }}"), "a");
  EXPECT_EQ(render("{{ [1, 2, 3][2::-9223372036854775807] }}"), "[3]");
  EXPECT_EQ(render("{{ -7 // 2 }} {{ -7 % 2 }}"), "-4 1");
  // A fuzz finding: the empty string repeated 2^54 times looped 2^54 times.
  EXPECT_EQ(render("{{ '' * 23372036854775807 }}|{{ 'ab' * -3 }}"), "|");
}
#endif  // MSA_WITH_TOKENIZER

// ---- non-finite values ----

TEST(HardeningFinite, FirstNonFiniteInEveryFloatDtype) {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    Tensor t = Tensor::zeros({2, 3}, dtype);
    EXPECT_EQ(first_non_finite(t), -1) << dtype_name(dtype);
    t.set(4, -inf);
    EXPECT_EQ(first_non_finite(t), 4) << dtype_name(dtype);
    EXPECT_EQ(first_non_finite(t, /*allow_negative_infinity=*/true), -1) << dtype_name(dtype);
    t.set(2, nan);
    EXPECT_EQ(first_non_finite(t, true), 2) << dtype_name(dtype);
    t.set(1, inf);
    EXPECT_EQ(first_non_finite(t, true), 1) << dtype_name(dtype);
    EXPECT_EQ(first_non_finite(t, 3, 3, true), -1) << dtype_name(dtype);
  }
  Tensor e4m3 = Tensor::zeros({4}, DType::e4m3);
  static_cast<uint8_t*>(e4m3.raw())[3] = 0xff;  // e4m3fn NaN (it has no infinity)
  EXPECT_EQ(first_non_finite(e4m3), 3);
  EXPECT_EQ(first_non_finite(Tensor::full({3}, DType::i32, -1)), -1);
  EXPECT_EQ(index_string({2, 3, 4}, 23), "[1, 2, 3]");
}

// NaN inputs give unspecified values, never invalid selections (msa/ops.h): all-NaN qi still
// selects distinct in-range blocks, the own block last.
TEST(HardeningFinite, NanIndexQueriesStillGiveValidSelections) {
  MsaParams params;
  params.block_size = 2;
  params.topk = 3;
  const Tensor cu_q = Tensor::from_vector(std::vector<int32_t>{0, 4}, {2});
  const Tensor cu_k = Tensor::from_vector(std::vector<int32_t>{0, 9}, {2});
  const Tensor qi = Tensor::full({4, 1, 4}, DType::f32, std::nan(""));
  const Tensor ki = Tensor::full({9, 4}, DType::f32, 0.5);
  for (Impl impl : {Impl::reference, Impl::cpu}) {
    const IndexerOutput out = indexer(qi, ki, cu_q, cu_k, params, impl);
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t own = (9 - 4 + i) / 2;
      const int32_t* row = out.topk.data<int32_t>() + i * 3;
      std::set<int32_t> seen;
      int64_t valid = 0;
      for (int64_t s = 0; s < 3; ++s) {
        if (row[s] < 0) continue;
        ++valid;
        EXPECT_LE(row[s], own) << impl_name(impl);
        EXPECT_TRUE(seen.insert(row[s]).second) << impl_name(impl);
      }
      EXPECT_EQ(valid, std::min<int64_t>(3, own + 1)) << impl_name(impl);
      EXPECT_EQ(row[valid - 1], own) << impl_name(impl);
    }
  }
}

TEST_F(HardeningTest, CheckWeightsNamesANanWeightAndTheEngineRefusesNanLogits) {
  write_random_checkpoint(model_config_preset("tiny"), path("m"), {.seed = 1, .dtype = DType::f32});
  const SafetensorsFile file = SafetensorsFile::open(path("m/model.safetensors"));
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::string poisoned = "language_model.model.layers.1.self_attn.o_proj.weight";
  for (const std::string& name : file.names()) {
    Tensor t = file.get(name).clone();
    if (name == poisoned) t.set(17, std::nan(""));
    tensors.emplace_back(name, t);
  }
  save_safetensors(path("m/model.safetensors"), tensors);
  const std::string error = error_of([&] { Model::load(path("m"), Device::cpu, /*check_weights=*/true); });
  EXPECT_NE(error.find("tensor '" + poisoned + "'"), std::string::npos) << error;
  EXPECT_NE(error.find("expected finite weights, got nan at index [0, 17]"), std::string::npos) << error;

  const Model model = Model::load(path("m"));  // unchecked: loads; the engine notices
  Engine engine(model, EngineOptions{});
  engine.submit({.prompt = {3, 4, 5}, .max_tokens = 2});
  const std::string run_error = error_of([&] { engine.step(); });
  EXPECT_NE(run_error.find("logits are not finite"), std::string::npos) << run_error;
}

}  // namespace
}  // namespace msa
