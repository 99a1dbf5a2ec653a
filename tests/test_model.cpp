// The MiniMax-M3 text runtime: config parsing, checkpoint checks, forward-step invariants
// (chunked prefill, batching), the engine, sampling and the CLI. Parity with transformers
// is tests/parity/test_m3_parity.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "cli_runner.h"
#include "made_checkpoints.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/quantized_kv_cache.h"
#include "msa/safetensors.h"
#include "released_config.h"
#include "test_util.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::CliResult;
using testing::error_of;
using testing::fresh_dir;
using testing::run_cli;

// One tiny f32 checkpoint shared by the tests (written once).
const fs::path& tiny_model_dir() { return testing::made_model_dir("tiny", "tiny", 3, DType::f32); }

const Model& tiny_model() {
  static const Model model = Model::load(tiny_model_dir().string());
  return model;
}

std::vector<int32_t> some_tokens(int64_t n, int32_t salt = 0) {
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>((i * 37 + salt * 11 + 5) % 509 + 3));
  return tokens;
}

double max_abs_diff(const Tensor& a, const Tensor& b, int64_t a_row = 0, int64_t b_row = 0,
                    int64_t rows = -1) {
  const int64_t cols = a.size(1);
  if (rows < 0) rows = a.size(0);
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      worst = std::max(worst, std::abs(static_cast<double>(a.data<float>()[(a_row + r) * cols + c]) -
                                       b.data<float>()[(b_row + r) * cols + c]));
  return worst;
}

Tensor prefill(const Model& model, const std::vector<int32_t>& tokens, int64_t chunk,
               DType cache_dtype = DType::f32) {
  KvCache cache(model.config(), 64, cache_dtype);
  SequenceCache sequence;
  const int64_t n = static_cast<int64_t>(tokens.size()), V = model.config().vocab_size;
  Tensor logits = Tensor::zeros({n, V}, DType::f32);
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    const ForwardRequest request{.sequence = &sequence,
                                 .tokens = std::span(tokens).subspan(begin, end - begin),
                                 .all_logits = true};
    const Tensor part = model.forward({&request, 1}, cache);
    std::copy_n(part.data<float>(), part.numel(), logits.data<float>() + begin * V);
  }
  return logits;
}

// ---- config ----

TEST(ModelConfig, ReadsTheReleasedSpelling) {
  const ModelConfig c = parse_model_config(kReleasedConfigJson, "released");
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.rotary_dim, 8);
  EXPECT_EQ(c.rope_theta, 10000);
  EXPECT_EQ(c.sparse_layers, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(c.block_size, 32);
  EXPECT_EQ(c.topk_blocks, 8);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.shared_intermediate_size, 24);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{7});
}

TEST(ModelConfig, ReadsTheTransformersSpellingAndItsRotaryRule) {
  // transformers derives the rotated width from partial_rotary_factor and ignores rotary_dim.
  const ModelConfig c = parse_model_config(R"({"text_config": {
      "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 64,
      "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
      "layer_types": ["full_attention", "minimax_m3_sparse"], "mlp_layer_types": ["dense", "sparse"],
      "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 16, "index_topk_blocks": 4,
      "intermediate_size": 8, "dense_intermediate_size": 8, "num_local_experts": 4,
      "num_experts_per_tok": 2}})",
                                           "transformers");
  EXPECT_EQ(c.rotary_dim, 8);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.sparse_layers, (std::vector<bool>{false, true}));
  EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true}));
  EXPECT_EQ(c.block_size, 16);
}

TEST(ModelConfig, NamesTheBadField) {
  const std::string base = R"("vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "layer_types": ["minimax_m3_sparse"],
      "mlp_layer_types": ["dense"], "dense_intermediate_size": 8, "index_head_dim": 16, )";
  EXPECT_NE(error_of([&] { parse_model_config("{" + base + R"("index_n_heads": 3})", "c"); })
                .find("index_n_heads"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_model_config("{" + base + R"("rope_parameters": {"rope_type": "yarn"}})", "c");
            }).find("rope_type"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_model_config(R"({"hidden_size": 4})", "c"); }).find("vocab_size"),
            std::string::npos);
}

// A head width whose rotated fraction is no exact double (8 / 98): the written factor must
// still read back as the same rotary_dim (found by fuzz_config).
TEST(ModelConfig, RotaryWidthRoundTripsThroughTheFactor) {
  ModelConfig c = model_config_preset("tiny");
  c.head_dim = 98;
  c.rotary_dim = 8;
  c.validate();
  EXPECT_EQ(static_cast<int64_t>(98 * (8.0 / 98)), 7);  // the plain quotient falls short
  EXPECT_EQ(parse_model_config(model_config_to_json(c), "round trip").rotary_dim, 8);
}

TEST(ModelConfig, PresetsRoundTripThroughJson) {
  for (const std::string& name : model_config_preset_names()) {
    const ModelConfig preset = model_config_preset(name);
    const ModelConfig back = parse_model_config(model_config_to_json(preset), name);
    EXPECT_EQ(back.hidden_size, preset.hidden_size) << name;
    EXPECT_EQ(back.rotary_dim, preset.rotary_dim) << name;
    EXPECT_EQ(back.sparse_layers, preset.sparse_layers) << name;
    EXPECT_EQ(back.moe_layers, preset.moe_layers) << name;
    EXPECT_EQ(back.topk_blocks, preset.topk_blocks) << name;
    EXPECT_EQ(back.num_experts, preset.num_experts) << name;
  }
}

// ---- checkpoint ----

// Rewrites the tiny checkpoint with `edit` applied to its tensor list.
fs::path edited_checkpoint(const std::string& name,
                           const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  return testing::edited_checkpoint(tiny_model_dir(), name, edit);
}

TEST(ModelWeights, MissingTensorIsNamed) {
  const std::string name = "language_model.model.layers.1.self_attn.index_k_proj.weight";
  const fs::path dir = edited_checkpoint("missing", [&](auto& tensors) {
    std::erase_if(tensors, [&](const auto& entry) { return entry.first == name; });
  });
  const std::string error = error_of([&] { Model::load(dir.string()); });
  EXPECT_NE(error.find("missing tensor '" + name + "'"), std::string::npos) << error;
}

TEST(ModelWeights, ExtraTensorIsNamed) {
  const fs::path dir = edited_checkpoint("extra", [](auto& tensors) {
    tensors.emplace_back("language_model.model.layers.7.mlp.up_proj.weight",
                         Tensor::zeros({2, 2}, DType::f32));
    tensors.emplace_back("vision_tower.vision_model.pre_layrnorm.weight",  // ignored: vision
                         Tensor::zeros({2}, DType::f32));
  });
  const std::string error = error_of([&] { Model::load(dir.string()); });
  EXPECT_NE(error.find("unexpected tensor 'language_model.model.layers.7.mlp.up_proj.weight'"),
            std::string::npos)
      << error;
}

TEST(ModelWeights, MisShapedTensorIsNamedWithBothShapes) {
  const std::string name = "language_model.model.layers.0.self_attn.q_norm.weight";
  const fs::path dir = edited_checkpoint("shape", [&](auto& tensors) {
    for (auto& entry : tensors)
      if (entry.first == name) entry.second = Tensor::zeros({15}, DType::f32);
  });
  const std::string error = error_of([&] { Model::load(dir.string()); });
  EXPECT_NE(error.find(name), std::string::npos) << error;
  EXPECT_NE(error.find("expected shape [16], got [15]"), std::string::npos) << error;
}

// ---- MXFP8 (float8_e4m3fn + one UE8M0 scale per 32 input channels) ----

bool is_quantized_linear(const std::string& name, const Tensor& t) {
  return name.starts_with("language_model.model.layers.") && name.ends_with(".weight") && t.dim() == 2 &&
         (name.find("_proj.weight") != std::string::npos || name.ends_with(".w1.weight") ||
          name.ends_with(".w2.weight") || name.ends_with(".w3.weight"));
}

// codes and UE8M0 exponents of `w` (per row, 32 channels a block), written here with plain
// loops: the exponent makes the block's largest |value| fit e4m3's 448.
std::pair<Tensor, Tensor> quantize_mxfp8(const Tensor& w) {
  const Tensor x = w.to(DType::f32);
  const int64_t rows = x.size(0), in = x.size(1), blocks = (in + 31) / 32;
  Tensor codes = Tensor::zeros({rows, in}, DType::e4m3), scale = Tensor::zeros({rows, blocks}, DType::u8);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      double amax = 0;
      for (int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i)
        amax = std::max(amax, std::abs(static_cast<double>(x.data<float>()[r * in + i])));
      const int u = amax > 0 ? std::clamp(127 + static_cast<int>(std::ceil(std::log2(amax / 448))), 0, 254) : 127;
      scale.data<uint8_t>()[r * blocks + b] = static_cast<uint8_t>(u);
      for (int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i)
        static_cast<uint8_t*>(codes.raw())[r * in + i] = float_to_e4m3(std::ldexp(x.data<float>()[r * in + i], 127 - u));
    }
  return {codes, scale};
}

Tensor dequantized_twin(const Tensor& codes, const Tensor& scale) {
  const int64_t rows = codes.size(0), in = codes.size(1), blocks = scale.size(1);
  Tensor out = Tensor::zeros({rows, in}, DType::bf16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i)
      static_cast<uint16_t*>(out.raw())[r * in + i] = float_to_bf16(std::ldexp(
          e4m3_to_float(static_cast<const uint8_t*>(codes.raw())[r * in + i]),
          scale.data<uint8_t>()[r * blocks + i / 32] - 127));
  return out;
}

// The tiny checkpoint with every projection of the layers as MXFP8 (`mxfp8`) or as the bf16
// values those codes stand for (the twin); `edit` then changes the MXFP8 tensor list.
fs::path mxfp8_checkpoint(const std::string& name, bool mxfp8,
                          const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit = {}) {
  return edited_checkpoint(name, [&](auto& tensors) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (auto& [tensor_name, tensor] : tensors) {
      if (!is_quantized_linear(tensor_name, tensor)) {
        out.emplace_back(tensor_name, tensor);
        continue;
      }
      auto [codes, scale] = quantize_mxfp8(tensor);
      if (mxfp8) {
        out.emplace_back(tensor_name, codes);
        out.emplace_back(tensor_name + "_scale_inv", scale);
      } else {
        out.emplace_back(tensor_name, dequantized_twin(codes, scale));
      }
    }
    if (edit) edit(out);
    tensors = std::move(out);
  });
}

TEST(ModelWeights, Mxfp8CheckpointEqualsItsDequantizedBf16Twin) {
  const Model mxfp8 = Model::load(mxfp8_checkpoint("mxfp8", true).string());
  const Model twin = Model::load(mxfp8_checkpoint("mxfp8_twin", false).string());
  EXPECT_EQ(mxfp8.weights().layers[0].q_proj.dtype(), DType::bf16);
  EXPECT_TRUE(testing::bitwise_equal(mxfp8.weights().layers[1].experts[0].down,
                                     twin.weights().layers[1].experts[0].down));
  const std::vector<int32_t> tokens = some_tokens(40);
  EXPECT_TRUE(testing::bitwise_equal(prefill(mxfp8, tokens, 16), prefill(twin, tokens, 16)));
}

TEST(ModelWeights, Mxfp8ErrorsNameTheTensor) {
  const std::string weight = "language_model.model.layers.0.self_attn.o_proj.weight";
  const auto error_with = [&](const std::string& dir_name, const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
    return error_of([&] { Model::load(mxfp8_checkpoint(dir_name, true, edit).string()); });
  };
  const auto replace = [&](const std::string& name, const std::function<Tensor(const Tensor&)>& change) {
    return [=](auto& tensors) {
      for (auto& entry : tensors)
        if (entry.first == name) entry.second = change(entry.second);
    };
  };
  std::string e = error_with("mx_shape", replace(weight + "_scale_inv", [](const Tensor& s) {
    return Tensor::zeros({s.size(0), s.size(1) + 1}, DType::u8);
  }));
  EXPECT_NE(e.find(weight + "_scale_inv"), std::string::npos) << e;
  EXPECT_NE(e.find("expected"), std::string::npos) << e;
  e = error_with("mx_nan", replace(weight + "_scale_inv", [](const Tensor& s) {
    Tensor t = s.clone();
    t.data<uint8_t>()[1] = 255;
    return t;
  }));
  EXPECT_NE(e.find("255 (NaN)"), std::string::npos) << e;
  e = error_with("mx_no_scale", [&](auto& tensors) {
    std::erase_if(tensors, [&](const auto& entry) { return entry.first == weight + "_scale_inv"; });
  });
  EXPECT_NE(e.find("tensor '" + weight + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("float8_e4m3fn with"), std::string::npos) << e;
  e = error_with("mx_orphan", [&](auto& tensors) {
    tensors.emplace_back("language_model.model.norm.weight_scale_inv", Tensor::zeros({1}, DType::u8));
  });
  EXPECT_NE(e.find("an MXFP8 scale whose weight"), std::string::npos) << e;
}

TEST(ModelWeights, ShardedBf16CheckpointLoadsAndStaysMapped) {
  const fs::path dir = fresh_dir("sharded");
  write_random_checkpoint(model_config_preset("tiny"), dir.string(),
                          {.seed = 3, .dtype = DType::bf16, .shard_bytes = 64 << 10});
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  const Model model = Model::load(dir.string());
  EXPECT_EQ(model.weights().layout, "released");
  EXPECT_EQ(model.weights().layers[1].experts[0].gate.dtype(), DType::bf16);  // not converted
  // Same seed, f32 vs bf16 weights: logits agree to bf16 precision.
  const std::vector<int32_t> tokens = some_tokens(40);
  const Tensor a = prefill(model, tokens, 40), b = prefill(tiny_model(), tokens, 40);
  double scale = 0;
  for (float v : b.span<float>()) scale = std::max(scale, static_cast<double>(std::abs(v)));
  EXPECT_LT(max_abs_diff(a, b), 0.1 * scale);
}

// ---- forward ----

TEST(ModelForward, ChunkedPrefillEqualsOnePrefill) {
  const std::vector<int32_t> tokens = some_tokens(150);  // > k*B = 64: selection active
  const Tensor whole = prefill(tiny_model(), tokens, 150);
  for (int64_t chunk : {1, 7, 16, 64}) {
    const Tensor chunked = prefill(tiny_model(), tokens, chunk);
    EXPECT_LT(max_abs_diff(whole, chunked), 1e-4) << "chunk " << chunk;
  }
}

TEST(ModelForward, BatchedRequestsEqualSeparateOnes) {
  const Model& model = tiny_model();
  const std::vector<int32_t> a = some_tokens(90, 1), b = some_tokens(23, 2), c = some_tokens(130, 3);
  KvCache cache(model.config(), 32);
  SequenceCache sa, sb, sc;
  const ForwardRequest requests[] = {{.sequence = &sa, .tokens = a, .all_logits = true},
                                     {.sequence = &sb, .tokens = b, .all_logits = false},
                                     {.sequence = &sc, .tokens = c, .all_logits = true}};
  const Tensor batched = model.forward(requests, cache);
  ASSERT_EQ(batched.size(0), 90 + 1 + 130);
  EXPECT_LT(max_abs_diff(batched, prefill(model, a, 90), 0, 0, 90), 1e-4);
  EXPECT_LT(max_abs_diff(batched, prefill(model, b, 23), 90, 22, 1), 1e-4);
  EXPECT_LT(max_abs_diff(batched, prefill(model, c, 130), 91, 0, 130), 1e-4);
  EXPECT_EQ(sa.length, 90);
  EXPECT_EQ(sc.length, 130);
}

TEST(ModelForward, TokenOutOfVocabularyIsAnError) {
  KvCache cache(tiny_model().config(), 4);
  SequenceCache sequence;
  const std::vector<int32_t> tokens = {1, 512};
  const ForwardRequest request{.sequence = &sequence, .tokens = tokens};
  EXPECT_NE(error_of([&] { tiny_model().forward({&request, 1}, cache); }).find("tokens[1]"),
            std::string::npos);
}

// ---- engine ----

std::vector<int32_t> generate_alone(const GenerationRequest& request) {
  Engine engine(tiny_model(), {.cache_tokens = 1024});
  engine.submit(request);
  std::vector<int32_t> out;
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) out.push_back(event.token);
  return out;
}

TEST(ModelEngine, ConcurrentRequestsMatchRunningAlone) {
  std::vector<GenerationRequest> requests;
  requests.push_back({.prompt = some_tokens(100, 1), .max_tokens = 12});
  requests.push_back({.prompt = some_tokens(9, 2), .max_tokens = 20});
  requests.push_back({.prompt = some_tokens(70, 3), .max_tokens = 5,
                      .sampling = {.temperature = 0.8, .top_k = 20, .top_p = 0.9, .seed = 5}});
  // Small chunks and a small step budget: prefill chunks and decodes share steps.
  Engine engine(tiny_model(), {.cache_tokens = 1024, .prefill_chunk = 32, .max_step_tokens = 48});
  std::map<int64_t, std::vector<int32_t>> outputs;
  std::map<int64_t, FinishReason> finish;
  for (const auto& request : requests) engine.submit(request);
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) {
      outputs[event.request].push_back(event.token);
      if (event.finish != FinishReason::none) finish[event.request] = event.finish;
    }
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(outputs[i], generate_alone(requests[i])) << "request " << i;
    EXPECT_EQ(static_cast<int64_t>(outputs[i].size()), requests[i].max_tokens);
    EXPECT_EQ(finish[i], FinishReason::max_tokens);
  }
  EXPECT_EQ(engine.cache().free_pages(), engine.cache().num_pages());  // all released
}

TEST(ModelEngine, StopTokenEndsGeneration) {
  GenerationRequest request{.prompt = some_tokens(20), .max_tokens = 10};
  const std::vector<int32_t> free_run = generate_alone(request);
  ASSERT_EQ(free_run.size(), 10u);
  request.stop_tokens = {free_run[3]};
  const std::vector<int32_t> stopped = generate_alone(request);
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[3]) - free_run.begin();
  EXPECT_EQ(stopped, std::vector<int32_t>(free_run.begin(), free_run.begin() + first + 1));
}

TEST(ModelEngine, RequestsWaitForCacheRoomAndOversizedOnesAreRefused) {
  // 8 pages of 16 tokens: one request of 100 tokens at a time.
  Engine engine(tiny_model(), {.cache_tokens = 128});
  const std::string error = error_of([&] {
    engine.submit({.prompt = some_tokens(120), .max_tokens = 16});
  });
  EXPECT_NE(error.find("does not fit in the KV cache"), std::string::npos) << error;
  engine.submit({.prompt = some_tokens(90, 1), .max_tokens = 6});
  engine.submit({.prompt = some_tokens(90, 2), .max_tokens = 6});
  int64_t tokens = 0;
  while (!engine.idle()) tokens += static_cast<int64_t>(engine.step().size());
  EXPECT_EQ(tokens, 12);
}

// ---- sampling ----

TEST(ModelSampling, GreedyTopKAndTopPAndSeeds) {
  const std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f};
  EXPECT_EQ(Sampler({}).sample(logits), 1);
  EXPECT_EQ(Sampler({.temperature = 5, .top_k = 1}).sample(logits), 1);
  EXPECT_EQ(Sampler({.temperature = 5, .top_p = 0.01}).sample(logits), 1);
  Sampler a({.temperature = 1, .seed = 9}), b({.temperature = 1, .seed = 9});
  std::vector<int> counts(4);
  for (int i = 0; i < 4000; ++i) {
    const int32_t token = a.sample(logits);
    EXPECT_EQ(token, b.sample(logits));
    ++counts[token];
  }
  // softmax(logits): 0.078, 0.52, 0.47, 0.019 (roughly).
  EXPECT_GT(counts[1], counts[0]);
  EXPECT_GT(counts[2], counts[3]);
  EXPECT_GT(counts[3], 0);
  Sampler top2({.temperature = 1, .top_k = 2, .seed = 1});
  for (int i = 0; i < 200; ++i) {
    const int32_t token = top2.sample(logits);
    EXPECT_TRUE(token == 1 || token == 2);
  }
  EXPECT_NE(error_of([] { Sampler({.top_p = 0}); }).find("top_p"), std::string::npos);
}

// ---- CLI ----

TEST(ModelCli, LogitsAndRunWork) {
  const std::string model = tiny_model_dir().string();
  const fs::path out = fresh_dir("cli_logits") / "logits.safetensors";
  CliResult logits = run_cli("logits --model " + model + " --tokens 5,6,7,8 --out " + out.string());
  ASSERT_EQ(logits.exit_code, 0) << logits.out;
  const Tensor got = SafetensorsFile::open(out.string()).get("logits");
  EXPECT_EQ(got.shape(), (Shape{4, 512}));
  EXPECT_LT(max_abs_diff(got, prefill(tiny_model(), {5, 6, 7, 8}, 4)), 1e-5);

  CliResult generated =
      run_cli("run --model " + model + " --prompt-tokens 5,6,7,8 --max-tokens 6 --stop 9999");
  ASSERT_EQ(generated.exit_code, 0) << generated.out;
  EXPECT_NE(generated.out.find("decode"), std::string::npos);
  std::vector<int32_t> expected = generate_alone({.prompt = {5, 6, 7, 8}, .max_tokens = 6});
  std::string line;
  for (int32_t token : expected) line += (line.empty() ? "" : " ") + std::to_string(token);
  EXPECT_NE(generated.out.find(line), std::string::npos) << generated.out;
}

TEST(ModelCli, ErrorsAreClear) {
  const std::string model = tiny_model_dir().string();
  CliResult text = run_cli("run --model " + model + " --prompt hello");
  EXPECT_EQ(text.exit_code, 2);
  EXPECT_NE(text.out.find("tokenizer"), std::string::npos) << text.out;
  CliResult cache =
      run_cli("run --model " + model + " --prompt-tokens 1,2,3 --max-tokens 100 --cache-tokens 32");
  EXPECT_EQ(cache.exit_code, 2);
  EXPECT_NE(cache.out.find("does not fit in the KV cache"), std::string::npos) << cache.out;
  CliResult preset = run_cli("make-model --config huge --out /tmp/never");
  EXPECT_EQ(preset.exit_code, 2);
  EXPECT_NE(preset.out.find("--config"), std::string::npos) << preset.out;
}

// ---- bf16 KV cache ----

double max_abs(const Tensor& t) {
  double worst = 0;
  for (float v : t.span<float>()) worst = std::max(worst, static_cast<double>(std::abs(v)));
  return worst;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(ModelKvCache, Bf16HalvesThePagesAndTheSizeErrorSaysSo) {
  const ModelConfig& c = tiny_model().config();
  const int64_t f32_page = KvCache::bytes_per_page(c), bf16_page = KvCache::bytes_per_page(c, DType::bf16);
  // tiny: 3 layers x K+V [2 heads, 16 tokens, 16] + 2 MSA layers x index keys [16, 16].
  EXPECT_EQ(f32_page, (3 * 2 * 2 * 16 * 16 + 2 * 16 * 16) * 4);
  EXPECT_EQ(bf16_page * 2, f32_page);
  const KvCache cache(c, 4, DType::bf16);
  EXPECT_EQ(cache.dtype(), DType::bf16);
  EXPECT_EQ(cache.k(0).dtype(), DType::bf16);
  EXPECT_EQ(cache.index_keys(1).dtype(), DType::bf16);
  // Far more than any machine: the error states the bf16 size, not the f32 one.
  const int64_t pages = (int64_t{1} << 50) / bf16_page;
  char expected[64];
  std::snprintf(expected, sizeof expected, "needs %.2f GiB",
                static_cast<double>(bf16_page) * static_cast<double>(pages) / (1 << 30));
  const std::string error = error_of([&] { KvCache(c, pages, DType::bf16); });
  EXPECT_NE(error.find(expected), std::string::npos) << error;
  EXPECT_NE(error.find("(bf16, " + std::to_string(bf16_page) + " bytes per page)"), std::string::npos)
      << error;
  const std::string f32_error = error_of([&] { KvCache(c, pages); });
  EXPECT_NE(f32_error.find("(f32, " + std::to_string(f32_page) + " bytes per page)"), std::string::npos)
      << f32_error;
  EXPECT_NE(f32_error.find("--cache-dtype bf16"), std::string::npos) << f32_error;
  EXPECT_NE(error_of([&] { KvCache(c, 4, DType::f16); }).find("kv cache dtype"), std::string::npos);
}

// One all-logits prefill of `tokens` into `sequence` of `cache`.
Tensor prefill_into(const Model& model, std::span<const int32_t> tokens, KvCache& cache, SequenceCache& sequence,
                    const ForwardTap& tap = nullptr) {
  const ForwardRequest request{.sequence = &sequence, .tokens = tokens, .all_logits = true};
  return model.forward({&request, 1}, cache, tap);
}

TEST(ModelForward, Bf16CacheHoldsRoundedValuesThatTheOpsReadInPlace) {
  const Model& model = tiny_model();
  const ModelConfig& c = model.config();
  const std::vector<int32_t> tokens = some_tokens(150);  // selection active on the MSA layers
  KvCache f32_cache(c, 16), bf16_cache(c, 16, DType::bf16);
  SequenceCache a, b;
  const Tensor exact = prefill_into(model, tokens, f32_cache, a);
  const Tensor rounded = prefill_into(model, tokens, bf16_cache, b);
  ASSERT_EQ(a.pages, b.pages);
  // Layer 0 (dense) sees the same input, so its keys are the f32 keys rounded to nearest even.
  const Tensor& k32 = f32_cache.k(0);
  const Tensor& k16 = bf16_cache.k(0);
  for (int64_t i = 0; i < k32.numel(); ++i)
    ASSERT_EQ(static_cast<const uint16_t*>(k16.raw())[i], float_to_bf16(k32.data<float>()[i])) << i;
  // Every layer: the paged ops on the bf16 cache equal (bitwise) the ops on its f32 copy.
  const MsaParams params = c.msa_params();
  const Tensor cu_q = Tensor::from_vector<int32_t>({0, 150}, {2});
  const Tensor page_table = Tensor::from_vector<int32_t>(
      std::vector<int32_t>(b.pages.begin(), b.pages.end()), {1, static_cast<int64_t>(b.pages.size())});
  const Tensor seq_lens = Tensor::from_vector<int32_t>({150}, {1});
  int64_t salt = 0;
  const auto some_queries = [&](const Shape& shape) {
    Tensor t = Tensor::zeros(shape, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::sin(0.37 * i + ++salt);
    return t;
  };
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const PagedKvCache in_place{.k_cache = bf16_cache.k(layer), .v_cache = bf16_cache.v(layer),
                                .index_key_cache = bf16_cache.index_keys(layer),
                                .page_table = page_table, .seq_lens = seq_lens};
    PagedKvCache widened = in_place;
    widened.k_cache = in_place.k_cache.to(DType::f32);
    widened.v_cache = in_place.v_cache.to(DType::f32);
    const Tensor q = some_queries({150, c.num_heads, c.head_dim});
    if (c.sparse_layers[layer]) {
      widened.index_key_cache = in_place.index_key_cache.to(DType::f32);
      const Tensor qi = some_queries({150, c.index_heads, c.index_head_dim});
      const IndexerOutput s1 = paged_indexer(qi, in_place, cu_q, params, Impl::cpu);
      const IndexerOutput s2 = paged_indexer(qi, widened, cu_q, params, Impl::cpu);
      ASSERT_TRUE(bitwise_equal(s1.topk, s2.topk)) << "layer " << layer;
      EXPECT_TRUE(bitwise_equal(paged_sparse_attention(q, in_place, s1.topk, cu_q, params, Impl::cpu).o,
                                paged_sparse_attention(q, widened, s1.topk, cu_q, params, Impl::cpu).o))
          << "layer " << layer;
    } else {
      EXPECT_TRUE(bitwise_equal(paged_dense_attention(q, in_place, cu_q, params, Impl::cpu).o,
                                paged_dense_attention(q, widened, cu_q, params, Impl::cpu).o))
          << "layer " << layer;
    }
  }
  // The logits move by the bf16 rounding of K/V (relative 2^-9 per element) carried through
  // three layers: under 1% of the largest logit (measured 0.16%). Only the first k*B = 64
  // tokens are compared: past them the indexer picks blocks, and in this random model a few
  // near-tied block scores flip (4 and 11 of 1200 top-k entries on the two MSA layers),
  // which changes those rows' attention outright (up to ~60% of the logit range).
  const int64_t all_selected = int64_t{c.topk_blocks} * c.block_size;
  EXPECT_LT(max_abs_diff(rounded, exact, 0, 0, all_selected), 1e-2 * max_abs(exact));
  EXPECT_GT(max_abs_diff(rounded, exact), 0);  // the cache really is bf16
  // Chunked prefill over a bf16 cache agrees with one bf16 prefill.
  // Not to f32's 1e-4: a last-bit difference of the chunked ops can move a key across a bf16
  // rounding boundary, one bf16 ulp (measured 0.02% of the largest logit).
  EXPECT_LT(max_abs_diff(prefill(model, tokens, 37, DType::bf16), rounded, 0, 0, all_selected),
            5e-3 * max_abs(exact));
}

// A greedy continuation through the engine over a cache of `dtype`: 12 valid tokens, every page
// back in the free list at the end.
std::vector<int32_t> greedy_continuation(const GenerationRequest& request, DType dtype) {
  Engine engine(tiny_model(), {.cache_tokens = 256, .cache_dtype = dtype});
  EXPECT_EQ(engine.cache().dtype(), dtype);
  engine.submit(request);
  std::vector<int32_t> out;
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) out.push_back(event.token);
  EXPECT_EQ(out.size(), 12u);
  for (int32_t token : out) EXPECT_TRUE(token >= 0 && token < 512) << token;
  EXPECT_EQ(engine.cache().free_pages(), engine.cache().num_pages());
  return out;
}

TEST(ModelEngine, Bf16CacheGreedyContinuationRuns) {
  const GenerationRequest request{.prompt = some_tokens(80, 4), .max_tokens = 12};
  const std::vector<int32_t> out = greedy_continuation(request, DType::bf16);
  ASSERT_FALSE(out.empty());
  // Greedy over logits within 1% of the f32 cache's: the first token agrees.
  EXPECT_EQ(out.front(), generate_alone(request).front());
}

TEST(ModelCli, CacheDtypeFlag) {
  const std::string model = tiny_model_dir().string();
  const fs::path out = fresh_dir("cli_bf16") / "logits.safetensors";
  CliResult logits =
      run_cli("logits --model " + model + " --tokens 5,6,7,8,9 --cache-dtype bf16 --out " +
              out.string());
  ASSERT_EQ(logits.exit_code, 0) << logits.out;
  EXPECT_LT(max_abs_diff(SafetensorsFile::open(out.string()).get("logits"),
                         prefill(tiny_model(), {5, 6, 7, 8, 9}, 5, DType::bf16)),
            1e-5);
  CliResult generated =
      run_cli("run --model " + model + " --prompt-tokens 5,6,7,8 --max-tokens 4 --cache-dtype bf16");
  EXPECT_EQ(generated.exit_code, 0) << generated.out;
  CliResult bad = run_cli("run --model " + model + " --prompt-tokens 5,6 --cache-dtype f16");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.out.find("--cache-dtype: expected f32, bf16 or fp8"), std::string::npos) << bad.out;
  CliResult fp8 = run_cli("run --model " + model + " --prompt-tokens 5,6,7,8 --max-tokens 4 --cache-dtype fp8");
  EXPECT_EQ(fp8.exit_code, 0) << fp8.out;
}

// ---- fp8 K/V caches (e4m3 codes, per-token-and-head scales) ----

TEST(ModelKvCache, Fp8PagesHoldCodesScalesAndBf16IndexKeys) {
  const ModelConfig& c = tiny_model().config();
  // tiny: 3 layers x K+V [2 heads, 16 tokens] x (16 codes + one f32 scale) + 2 MSA layers x
  // bf16 index keys [16, 16].
  EXPECT_EQ(KvCache::bytes_per_page(c, DType::e4m3), 3 * 2 * 2 * 16 * (16 + 4) + 2 * 16 * 16 * 2);
  const KvCache cache(c, 4, DType::e4m3);
  EXPECT_EQ(cache.k(0).dtype(), DType::e4m3);
  EXPECT_EQ(cache.k_scale(0).shape(), (Shape{4, 2, 16}));
  EXPECT_EQ(cache.v_scale(2).dtype(), DType::f32);
  EXPECT_EQ(cache.index_keys(1).dtype(), DType::bf16);
  EXPECT_FALSE(KvCache(c, 4, DType::bf16).k_scale(0).defined());
}

// The fp8 cache holds exactly what quantize_kv_fp8 makes of the f32 cache's K and V (the same
// forward, so layer 0 sees the same input; unused slots stay zero in both), and the attention
// moves by the e4m3 rounding of K/V: layer 0's attention output by a relative L2 of 2.9%
// (measured), as the ops' fp8 tests find on random inputs (docs/msa.md §6.6). Through the
// later layers of this random model (the MoE's routing and the indexer's near ties flip) the
// logits move by 12% (relative L2, measured).
TEST(ModelForward, Fp8CacheHoldsTheQuantizedValues) {
  const Model& model = tiny_model();
  const ModelConfig& c = model.config();
  const std::vector<int32_t> tokens = some_tokens(150);  // selection active on the MSA layers
  KvCache f32_cache(c, 16), fp8_cache(c, 16, DType::e4m3);
  SequenceCache a, b;
  Tensor attention_f32, attention_fp8;
  const auto keep = [](Tensor& out) {
    return [&out](const std::string& name, const Tensor& value) {
      if (name == "layers.0.attn_heads") out = value.to(DType::f32);
    };
  };
  const Tensor exact = prefill_into(model, tokens, f32_cache, a, keep(attention_f32));
  const Tensor quantized = prefill_into(model, tokens, fp8_cache, b, keep(attention_fp8));
  ASSERT_EQ(a.pages, b.pages);
  for (const auto& [values, codes, scale] :
       {std::tuple{&f32_cache.k(0), &fp8_cache.k(0), &fp8_cache.k_scale(0)},
        std::tuple{&f32_cache.v(0), &fp8_cache.v(0), &fp8_cache.v_scale(0)}}) {
    const QuantizedKv want = quantize_kv_fp8(*values);
    EXPECT_TRUE(bitwise_equal(*codes, want.codes));
    EXPECT_TRUE(bitwise_equal(*scale, want.scale));
  }
  const double attention_moved = testing::relative_error(attention_fp8, attention_f32);
  const double logits_moved = testing::relative_error(quantized, exact);
  std::cout << "[ fp8 cache ] relative L2 against the f32 cache: layer 0 attention " << attention_moved
            << ", logits " << logits_moved << "\n";
  EXPECT_LT(attention_moved, 0.06);
  EXPECT_GT(attention_moved, 0.0);  // the cache really is fp8
  EXPECT_LT(logits_moved, 0.25);
  // Chunked prefill over an fp8 cache: every token's K/V is quantized on its own (per-token
  // scales), so chunks write the same codes up to last-bit differences of the chunked ops
  // (measured 5e-7 of the largest logit).
  EXPECT_LT(max_abs_diff(prefill(model, tokens, 37, DType::e4m3), quantized), 1e-4 * max_abs(exact));
}

TEST(ModelEngine, Fp8CacheGreedyContinuationRuns) {
  greedy_continuation({.prompt = some_tokens(80, 4), .max_tokens = 12}, DType::e4m3);
}

// ---- the tokenizer make-model writes ----

#ifdef MSA_WITH_TOKENIZER
TEST(ModelTokenizer, MadeTokenizerRoundTripsAndHasTheM3SpecialTokens) {
  const ModelConfig c = model_config_preset("tiny");
  const fs::path dir = fresh_dir("tokenizer");
  write_random_tokenizer(c, dir.string());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(dir.string());
  EXPECT_EQ(tokenizer.vocab_size(), static_cast<size_t>(c.vocab_size));
  for (int32_t id = 0; id < c.vocab_size; ++id) EXPECT_NO_THROW(tokenizer.id_to_token(id)) << id;
  EXPECT_EQ(tokenizer.token_to_id("]~!b["), c.bos_token_id);
  EXPECT_EQ(tokenizer.token_to_id("[e~["), c.eos_token_ids.front());
  for (const char* special : {"]~!b[", "[e~[", "]~b]", "]!p~["}) {
    ASSERT_TRUE(tokenizer.token_to_id(special).has_value()) << special;
    EXPECT_TRUE(tokenizer.is_special(*tokenizer.token_to_id(special))) << special;
  }
  const std::string valid = "Hello, wörld! 你好 🙂\n\ttabs  and   spaces, digits 12345, code: f(x) = x*2; — ünïcödé";
  for (const std::string& s : {valid, std::string("hello world"), std::string(" leading space"),
                               std::string("")}) {
    const std::vector<int32_t> ids = tokenizer.encode(s);
    EXPECT_EQ(tokenizer.decode(ids), s);
    const std::vector<int32_t> with_bos = tokenizer.encode(s, /*add_special_tokens=*/true);
    ASSERT_FALSE(with_bos.empty());
    EXPECT_EQ(with_bos.front(), c.bos_token_id);
    EXPECT_EQ(tokenizer.decode(with_bos, /*skip_special_tokens=*/true), s);
  }
  EXPECT_LT(tokenizer.encode("hello world").size(), std::string("hello world").size());  // merges
  // Special tokens inside text are single ids.
  const std::vector<int32_t> turn = tokenizer.encode("]~b]user\nhi[e~[");
  EXPECT_EQ(turn.front(), *tokenizer.token_to_id("]~b]"));
  EXPECT_EQ(turn.back(), c.eos_token_ids.front());
  const ChatMessage messages[] = {{"system", "Be brief."}, {"user", "hi"}, {"assistant", "hello"}};
  EXPECT_EQ(tokenizer.apply_chat_template(messages, /*add_generation_prompt=*/true),
            "]~!b[]~b]system\nBe brief.[e~[\n]~b]user\nhi[e~[\n]~b]ai\nhello[e~[\n]~b]ai\n");
  ModelConfig small = c;
  small.vocab_size = 200;
  EXPECT_NE(error_of([&] { write_random_tokenizer(small, fresh_dir("tokenizer_small").string()); })
                .find("vocab_size"),
            std::string::npos);
}
#endif

TEST(ModelCli, MadeModelRunsFromText) {
  const fs::path dir = fresh_dir("made_text");
  CliResult made = run_cli("make-model --config tiny --out " + dir.string());
  ASSERT_EQ(made.exit_code, 0) << made.out;
  EXPECT_TRUE(fs::exists(dir / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(dir / "tokenizer_config.json"));
  CliResult generated =
      run_cli("run --model " + dir.string() + " --prompt \"hello world\" --max-tokens 8");
#ifdef MSA_WITH_TOKENIZER
  ASSERT_EQ(generated.exit_code, 0) << generated.out;
  const Model model = Model::load(dir.string());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(dir.string());
  Engine engine(model, {.cache_tokens = 64});
  engine.submit({.prompt = tokenizer.encode("hello world", true), .max_tokens = 8,
                 .stop_tokens = model.config().eos_token_ids});
  std::vector<int32_t> expected;
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) expected.push_back(event.token);
  std::string line;
  for (int32_t token : expected) line += (line.empty() ? "" : " ") + std::to_string(token);
  EXPECT_NE(generated.out.find(line + "\n"), std::string::npos) << generated.out;
  EXPECT_NE(generated.out.find(tokenizer.decode(expected, true) + "\n"), std::string::npos)
      << generated.out;
  EXPECT_EQ(expected.size(), 8u);
#else
  EXPECT_EQ(generated.exit_code, 2);
  EXPECT_NE(generated.out.find("tokenizer"), std::string::npos) << generated.out;
#endif
}

}  // namespace
}  // namespace msa
