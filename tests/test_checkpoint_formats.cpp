// Checkpoint formats (docs/model.md "Checkpoint formats"): NVFP4 dequantization by hand, made
// MXFP8 / NVFP4 checkpoints against their dequantized bf16 twins, sharded output, rank-local
// NVFP4 slices, corrupt files, the quantization_config, and the full-size m3-full preset
// (config, sizes and the 8-rank plan only: its weights are never written here).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "made_checkpoints.h"
#include "model/mxfp8.h"
#include "model/nvfp4.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/quantized_index_keys.h"
#include "msa/safetensors.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;
using testing::NamedTensors;

Tensor bytes_tensor(const Shape& shape, DType dtype, std::initializer_list<uint8_t> bytes) {
  Tensor t = Tensor::zeros(shape, dtype);
  EXPECT_EQ(t.nbytes(), bytes.size());
  std::memcpy(t.raw(), bytes.begin(), bytes.size());
  return t;
}

Tensor scalar(float value, const Shape& shape = {}) {
  Tensor t = Tensor::zeros(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value;
  return t;
}

float bf16_at(const Tensor& t, int64_t i) { return bf16_to_float(static_cast<const uint16_t*>(t.raw())[i]); }

// ---- NVFP4 by hand ----

TEST(Nvfp4, NibbleOrderAndScalesByHand) {
  // Row 0, bytes 0x2A 0x71 then zeros: element 0 = low nibble 0xA = -1.0, element 1 = high
  // nibble 0x2 = 1.0, element 2 = 0x1 = 0.5, element 3 = 0x7 = 6. Row 1: 0xF5 -> element 0 =
  // 0x5 = 3, element 1 = 0xF = -6. Scales: row 0 e4m3 0x38 = 1.0, row 1 0x40 = 2.0 (one block
  // of 16 each); global 0.5.
  const Tensor codes = bytes_tensor({2, 8}, DType::u8, {0x2A, 0x71, 0, 0, 0, 0, 0, 0,  //
                                                          0xF5, 0, 0, 0, 0, 0, 0, 0x80});
  const Tensor scale = bytes_tensor({2, 1}, DType::e4m3, {0x38, 0x40});
  const Tensor w = model::dequantize_nvfp4(codes, scale, scalar(0.5f), "w");
  ASSERT_EQ(w.shape(), (Shape{2, 16}));
  ASSERT_EQ(w.dtype(), DType::bf16);
  const float expected_row0[4] = {-0.5f, 0.5f, 0.25f, 3.0f};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(bf16_at(w, i), expected_row0[i]) << i;
  for (int i = 4; i < 16; ++i) EXPECT_EQ(bf16_at(w, i), 0.0f) << i;
  EXPECT_EQ(bf16_at(w, 16), 3.0f * 2 * 0.5f);
  EXPECT_EQ(bf16_at(w, 17), -6.0f * 2 * 0.5f);
  EXPECT_EQ(bf16_at(w, 30), 0.0f);
  EXPECT_TRUE(std::signbit(bf16_at(w, 31)));  // 0x8 in the high nibble: -0
  // The library's one e2m1 table agrees with the nibbles above.
  EXPECT_EQ(e2m1_to_float(0xA), -1.0f);
  EXPECT_EQ(e2m1_to_float(0x7), 6.0f);
  EXPECT_EQ(float_to_e2m1(-6.0f), 0xF);
  // The largest value, 6 * 448 * scale_2: ModelOpt's scale_2 = amax / (6 * 448) gives amax.
  const Tensor big = model::dequantize_nvfp4(bytes_tensor({1, 8}, DType::u8, {0x07, 0, 0, 0, 0, 0, 0, 0}),
                                             bytes_tensor({1, 1}, DType::e4m3, {0x7e}),
                                             scalar(1.0f / (6 * 448)), "big");
  EXPECT_NEAR(bf16_at(big, 0), 1.0f, 1.0f / 256);
  // Row slices of codes and scales (views) dequantize to the whole matrix's rows.
  const Tensor row1 = model::dequantize_nvfp4(codes.slice0(1, 2), scale.slice0(1, 2), scalar(0.5f, {1}), "w");
  for (int i = 0; i < 16; ++i) EXPECT_EQ(bf16_at(row1, i), bf16_at(w, 16 + i));
}

TEST(Nvfp4, BadInputsNameTheTensor) {
  const Tensor codes = Tensor::zeros({2, 8}, DType::u8), scale = Tensor::zeros({2, 1}, DType::e4m3);
  const auto error = [](const std::function<void()>& body) { return error_of(body); };
  std::string e = error([&] { model::dequantize_nvfp4(codes, Tensor::zeros({2, 2}, DType::e4m3), scalar(1), "x.weight"); });
  EXPECT_NE(e.find("'x.weight_scale'"), std::string::npos) << e;
  EXPECT_NE(e.find("[2, 1]"), std::string::npos) << e;
  e = error([&] { model::dequantize_nvfp4(codes, Tensor::zeros({2, 1}, DType::u8), scalar(1), "x.weight"); });
  EXPECT_NE(e.find("float8_e4m3fn"), std::string::npos) << e;
  e = error([&] { model::dequantize_nvfp4(codes, bytes_tensor({2, 1}, DType::e4m3, {0x38, 0xff}), scalar(1), "x.weight"); });
  EXPECT_NE(e.find("'x.weight_scale' at [1, 0]"), std::string::npos) << e;
  EXPECT_NE(e.find("NaN"), std::string::npos) << e;
  e = error([&] { model::dequantize_nvfp4(Tensor::zeros({2, 4}, DType::u8), scale, scalar(1), "x.weight"); });
  EXPECT_NE(e.find("multiple of 16"), std::string::npos) << e;
  e = error([&] { model::dequantize_nvfp4(Tensor::zeros({2, 8}, DType::bf16), scale, scalar(1), "x.weight"); });
  EXPECT_NE(e.find("uint8"), std::string::npos) << e;
  for (float bad : {std::nanf(""), INFINITY, 0.0f, -1.0f}) {
    e = error([&] { model::dequantize_nvfp4(codes, scale, scalar(bad), "x.weight"); });
    EXPECT_NE(e.find("'x.weight_scale_2'"), std::string::npos) << e;
    EXPECT_NE(e.find("positive finite"), std::string::npos) << e;
  }
  e = error([&] { model::dequantize_nvfp4(codes, scale, scalar(1, {2}), "x.weight"); });
  EXPECT_NE(e.find("one value"), std::string::npos) << e;
  e = error([&] {
    model::dequantize_nvfp4(bytes_tensor({1, 8}, DType::u8, {7, 0, 0, 0, 0, 0, 0, 0}),
                            bytes_tensor({1, 1}, DType::e4m3, {0x7e}), scalar(1e37f), "x.weight");
  });
  EXPECT_NE(e.find("overflow"), std::string::npos) << e;
}

// ---- streamed writing ----

TEST(CheckpointFormats, StreamedWritingGivesSaveSafetensorsBytesWhateverTheChunk) {
  const fs::path dir = fresh_dir("streamed");
  NamedTensors tensors = {{"a", Tensor::zeros({3, 5}, DType::bf16)}, {"b", Tensor::zeros({7}, DType::f32)},
                          {"c", Tensor::zeros({2, 9}, DType::u8)}, {"d", scalar(2.5f)}};
  for (auto& [name, t] : tensors)
    for (size_t i = 0; i < t.nbytes(); ++i) static_cast<uint8_t*>(t.raw())[i] = static_cast<uint8_t>(i * 7 + name[0]);
  save_safetensors((dir / "whole.safetensors").string(), tensors, {{"format", "pt"}});
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.dtype(), t.shape()});
  for (int64_t chunk : {8, 16, 64 << 20}) {
    int64_t calls = 0;
    save_safetensors_streamed((dir / "streamed.safetensors").string(), entries, {{"format", "pt"}},
                              [&](size_t index, int64_t offset, void* data, int64_t bytes) {
                                ++calls;
                                EXPECT_LE(bytes, chunk);
                                std::memcpy(data, static_cast<const char*>(tensors[index].second.raw()) + offset,
                                            static_cast<size_t>(bytes));
                              }, chunk);
    EXPECT_EQ(testing::read_bytes(dir / "streamed.safetensors"), testing::read_bytes(dir / "whole.safetensors")) << chunk;
    EXPECT_GE(calls, chunk == 8 ? 12 : 4) << chunk;
  }
  EXPECT_NE(error_of([&] { save_safetensors_streamed((dir / "x").string(), entries, {}, nullptr, 12); }).find("chunk_bytes"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "x"));
}

// ---- made checkpoints ----

fs::path made(const std::string& name, const std::string& preset, CheckpointFormat format,
              int64_t shard_bytes = 0, uint64_t seed = 7) {
  return testing::made_checkpoint(name, preset, format, shard_bytes, seed);
}

bool is_quantization_scale(const std::string& name) {
  return name.ends_with("_scale") || name.ends_with("_scale_2") || name.ends_with("input_scale") ||
         name.ends_with("_scale_inv");
}

// The checkpoint in `dir` with every quantized matrix replaced by its dequantized bf16
// values (the dequantizers of model/: what the loader uses) and no quantization_config.
fs::path dequantized_twin(const fs::path& dir, const std::string& name) {
  const fs::path twin = fresh_dir(name);
  ModelConfig config = load_model_config(dir.string());
  config.quantization.clear();
  std::ofstream(twin / "config.json") << model_config_to_json(config);
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  NamedTensors tensors;
  for (const std::string& tensor : file.names()) {
    if (is_quantization_scale(tensor)) continue;
    const Tensor t = file.get(tensor);
    if (t.dtype() == DType::u8)
      tensors.emplace_back(tensor, model::dequantize_nvfp4(t, file.get(tensor + "_scale"),
                                                           file.get(tensor + "_scale_2"), tensor));
    else if (t.dtype() == DType::e4m3)
      tensors.emplace_back(tensor, model::dequantize_mxfp8(t, file.get(tensor + "_scale_inv"), tensor));
    else
      tensors.emplace_back(tensor, t.clone());
  }
  save_safetensors((twin / "model.safetensors").string(), tensors);
  return twin;
}

std::vector<int32_t> some_tokens(int64_t n) {
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>((i * 37 + 5) % 509 + 3));
  return tokens;
}

Tensor prefill(const Model& model, const std::vector<int32_t>& tokens) {
  KvCache cache(model.config(), 64, DType::f32);
  SequenceCache sequence;
  const ForwardRequest request{.sequence = &sequence, .tokens = tokens, .all_logits = true};
  return model.forward({&request, 1}, cache).clone();
}

double max_relative_error(const Tensor& a, const Tensor& b) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b.data<float>()[i])));
  }
  return diff / scale;
}

TEST(CheckpointFormats, Nvfp4ExpertsAndMxfp8LayersAsTheReleasesStoreThem) {
  const SafetensorsModel nvfp4 = SafetensorsModel::open(made("fmt_nvfp4_names", "tiny", CheckpointFormat::nvfp4).string());
  const std::string expert = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.";
  EXPECT_EQ(nvfp4.get(expert + "weight").dtype(), DType::u8);
  EXPECT_EQ(nvfp4.get(expert + "weight").shape(), (Shape{64, 16}));  // [H, I / 2]
  EXPECT_EQ(nvfp4.get(expert + "weight_scale").dtype(), DType::e4m3);
  EXPECT_EQ(nvfp4.get(expert + "weight_scale").shape(), (Shape{64, 2}));  // [H, I / 16]
  EXPECT_EQ(nvfp4.get(expert + "weight_scale_2").shape(), Shape{});
  EXPECT_EQ(nvfp4.get(expert + "input_scale").dtype(), DType::f32);
  // Everything but the routed experts stays bf16 (the router f32).
  EXPECT_EQ(nvfp4.get("language_model.model.layers.1.self_attn.q_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(nvfp4.get("language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(nvfp4.get("language_model.model.layers.1.block_sparse_moe.gate.weight").dtype(), DType::f32);
  EXPECT_EQ(nvfp4.get("language_model.lm_head.weight").dtype(), DType::bf16);
  for (const std::string& name : nvfp4.names()) {  // no NaN scale code
    if (!name.ends_with("_scale")) continue;
    const Tensor scale = nvfp4.get(name);
    for (int64_t i = 0; i < scale.numel(); ++i)
      ASSERT_NE(static_cast<const uint8_t*>(scale.raw())[i] & 0x7f, 0x7f) << name;
  }
  EXPECT_EQ(load_model_config(nvfp4.path()).quantization, "nvfp4");
  const nlohmann::json quant = nlohmann::json::parse(testing::read_bytes(fs::path(nvfp4.path()) / "hf_quant_config.json"));
  EXPECT_EQ(quant["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(quant["quantization"]["group_size"], 16);

  const SafetensorsModel mxfp8 = SafetensorsModel::open(made("fmt_mxfp8_names", "tiny", CheckpointFormat::mxfp8).string());
  for (const char* name : {"layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight",
                           "layers.1.self_attn.index_q_proj.weight", "layers.1.block_sparse_moe.experts.0.w1.weight",
                           "layers.1.block_sparse_moe.shared_experts.gate_proj.weight"}) {
    const std::string full = std::string("language_model.model.") + name;
    EXPECT_EQ(mxfp8.get(full).dtype(), DType::e4m3) << full;
    EXPECT_EQ(mxfp8.get(full + "_scale_inv").dtype(), DType::u8) << full;
    EXPECT_EQ(mxfp8.get(full + "_scale_inv").size(1), (mxfp8.get(full).size(1) + 31) / 32) << full;
  }
  EXPECT_EQ(mxfp8.get("language_model.model.embed_tokens.weight").dtype(), DType::bf16);
  EXPECT_EQ(mxfp8.get("language_model.model.layers.1.block_sparse_moe.gate.weight").dtype(), DType::f32);
  EXPECT_EQ(load_model_config(mxfp8.path()).quantization, "mxfp8");
}

TEST(CheckpointFormats, QuantizedCheckpointsGiveTheLogitsOfTheirDequantizedBf16Twins) {
  for (const CheckpointFormat format : {CheckpointFormat::nvfp4, CheckpointFormat::mxfp8}) {
    const std::string tag = format == CheckpointFormat::nvfp4 ? "nvfp4" : "mxfp8";
    const fs::path dir = made("fmt_twin_" + tag, "tiny", format);
    const Model quantized = Model::load(dir.string());
    const Model twin = Model::load(dequantized_twin(dir, "fmt_twin_bf16_" + tag).string());
    const LayerWeights& moe = quantized.weights().layers[1];
    EXPECT_EQ(moe.experts[5].gate.dtype(), DType::bf16) << tag;
    EXPECT_TRUE(testing::bitwise_equal(moe.experts[5].down, twin.weights().layers[1].experts[5].down)) << tag;
    // The random codes have about the float weights' spread (1 / sqrt(in)).
    double sum = 0;
    for (int64_t i = 0; i < moe.experts[5].gate.numel(); ++i) sum += std::pow(moe.experts[5].gate.get(i), 2);
    const double rms = std::sqrt(sum / static_cast<double>(moe.experts[5].gate.numel()));
    EXPECT_GT(rms, 0.4 / 8) << tag;
    EXPECT_LT(rms, 2.5 / 8) << tag;
    const std::vector<int32_t> tokens = some_tokens(80);  // past k * B = 64: selection runs
    const Tensor a = prefill(quantized, tokens), b = prefill(twin, tokens);
    bool finite = true;
    for (int64_t i = 0; i < a.numel(); ++i) finite = finite && std::isfinite(a.data<float>()[i]);
    EXPECT_TRUE(finite) << tag;
    EXPECT_LE(max_relative_error(a, b), 1e-6) << tag;
  }
}

TEST(CheckpointFormats, ShardedOutputLoadsTheSameAsOneFile) {
  const fs::path one = made("fmt_one", "tiny", CheckpointFormat::nvfp4);
  const fs::path sharded = made("fmt_sharded", "tiny", CheckpointFormat::nvfp4, 24 << 10);
  const nlohmann::json index = nlohmann::json::parse(testing::read_bytes(sharded / "model.safetensors.index.json"));
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : index["weight_map"].items()) shards.insert(shard.get<std::string>());
  EXPECT_GE(shards.size(), 4u);
  EXPECT_TRUE(shards.count("model-00001-of-" + std::string(5 - std::to_string(shards.size()).size(), '0') +
                           std::to_string(shards.size()) + ".safetensors"));
  // A quantized weight's tensors share a shard.
  const std::string w = "language_model.model.layers.2.block_sparse_moe.experts.6.w3.";
  EXPECT_EQ(index["weight_map"][w + "weight"], index["weight_map"][w + "weight_scale"]);
  EXPECT_EQ(index["weight_map"][w + "weight"], index["weight_map"][w + "weight_scale_2"]);
  EXPECT_EQ(index["weight_map"][w + "weight"], index["weight_map"][w + "input_scale"]);
  const SafetensorsModel a = SafetensorsModel::open(one.string()), b = SafetensorsModel::open(sharded.string());
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) ASSERT_TRUE(testing::bitwise_equal(a.get(name), b.get(name))) << name;
  const Model ma = Model::load(one.string()), mb = Model::load(sharded.string());
  const std::vector<int32_t> tokens = some_tokens(20);
  EXPECT_TRUE(testing::bitwise_equal(prefill(ma, tokens), prefill(mb, tokens)));
}

// Element (r, c) of a [rows, cols] matrix of any float dtype.
double element(const Tensor& t, int64_t r, int64_t c) { return t.get(r * t.size(1) + c); }

bool same_slice(const Tensor& part, const Tensor& whole, int64_t row0, int64_t col0) {
  for (int64_t r = 0; r < part.size(0); ++r)
    for (int64_t j = 0; j < part.size(1); ++j)
      if (element(part, r, j) != element(whole, row0 + r, col0 + j)) return false;
  return true;
}

// Every rank's weights of `dir` equal the slices of the single-rank load.
void expect_rank_slices(const fs::path& dir, std::initializer_list<int> worlds) {
  const ModelConfig c = load_model_config(dir.string());
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  const ModelWeights full = load_model_weights(file, c);
  const int64_t D = c.head_dim;
  for (int world : worlds)
    for (int r = 0; r < world; ++r) {
      const ShardPlan p = make_shard_plan(c, r, world);
      const ModelWeights mine = load_model_weights(file, c, p);
      const LayerWeights &dense = mine.layers[0], &dense_full = full.layers[0];
      const LayerWeights &moe = mine.layers[1], &moe_full = full.layers[1];
      EXPECT_TRUE(same_slice(dense.q_proj, dense_full.q_proj, p.q_begin * D, 0)) << world << " " << r;
      EXPECT_TRUE(same_slice(dense.o_proj, dense_full.o_proj, 0, p.q_begin * D)) << world << " " << r;
      EXPECT_TRUE(same_slice(dense.mlp.gate, dense_full.mlp.gate, p.dense_begin, 0)) << world << " " << r;
      EXPECT_TRUE(same_slice(dense.mlp.down, dense_full.mlp.down, 0, p.dense_begin)) << world << " " << r;
      EXPECT_TRUE(same_slice(moe.shared_expert.down, moe_full.shared_expert.down, 0, p.shared_begin));
      ASSERT_EQ(static_cast<int64_t>(moe.experts.size()), p.experts);
      for (int64_t e = 0; e < p.experts; ++e) {
        EXPECT_TRUE(testing::bitwise_equal(moe.experts[e].gate, moe_full.experts[p.expert_begin + e].gate));
        EXPECT_TRUE(testing::bitwise_equal(moe.experts[e].down, moe_full.experts[p.expert_begin + e].down));
      }
    }
}

TEST(CheckpointFormats, RankLocalNvfp4EqualsSlicesOfTheSingleRankMatrices) {
  // The made layout: NVFP4 experts, each rank's whole experts.
  expect_rank_slices(made("fmt_tp_nvfp4", "tiny-tp", CheckpointFormat::nvfp4), {2, 4});
  // Every projection NVFP4 (codes from the made experts' random bytes pattern, scales varying
  // by row and block): o_proj's and down's column slices are whole 16-column groups on 2 and
  // 4 ranks, and not for the shared expert's down (32 columns: 8 per rank on 4) - both paths.
  const fs::path source = made("fmt_tp_bf16", "tiny-tp", CheckpointFormat::floats);
  const fs::path dir = fresh_dir("fmt_tp_all_nvfp4");
  fs::copy_file(source / "config.json", dir / "config.json");
  const SafetensorsModel file = SafetensorsModel::open(source.string());
  NamedTensors tensors;
  for (const std::string& name : file.names()) {
    const Tensor t = file.get(name);
    const bool projection = name.find(".layers.") != std::string::npos && t.dim() == 2 &&
                            name.find("norm") == std::string::npos && name.find("gate.weight") == std::string::npos;
    if (!projection) {
      tensors.emplace_back(name, t.clone());
      continue;
    }
    const int64_t rows = t.size(0), in = t.size(1);
    Tensor codes = Tensor::zeros({rows, in / 2}, DType::u8), scale = Tensor::zeros({rows, in / 16}, DType::e4m3);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < in / 2; ++i) codes.data<uint8_t>()[r * in / 2 + i] = static_cast<uint8_t>((r * 131 + i * 29 + 7) & 0xff);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < in / 16; ++b)
        static_cast<uint8_t*>(scale.raw())[r * (in / 16) + b] = static_cast<uint8_t>(0x30 + (r + 3 * b) % 9);
    tensors.emplace_back(name, codes);
    tensors.emplace_back(name + "_scale", scale);
    tensors.emplace_back(name + "_scale_2", scalar(0.01f));
  }
  save_safetensors((dir / "model.safetensors").string(), tensors);
  expect_rank_slices(dir, {2, 4});
  // And the values are those of the hand-checked dequantizer.
  const SafetensorsModel quantized = SafetensorsModel::open(dir.string());
  const ModelWeights whole = load_model_weights(quantized, load_model_config(dir.string()));
  const std::string o = "language_model.model.layers.0.self_attn.o_proj.weight";
  EXPECT_TRUE(testing::bitwise_equal(whole.layers[0].o_proj,
                                     model::dequantize_nvfp4(quantized.get(o), quantized.get(o + "_scale"),
                                                             quantized.get(o + "_scale_2"), o)));
}

// ---- corrupt inputs ----

// The made tiny NVFP4 checkpoint (one file) with its tensors passed through `edit`.
fs::path edited_nvfp4(const std::string& name, const std::function<void(NamedTensors&)>& edit) {
  static const fs::path source = made("fmt_source", "tiny", CheckpointFormat::nvfp4);
  return testing::edited_checkpoint(source, name, edit);
}

TEST(CheckpointFormats, CorruptInputsNameTheFileAndTensor) {
  const std::string w = "language_model.model.layers.2.block_sparse_moe.experts.1.w1.weight";
  const auto load_error = [](const fs::path& dir) { return error_of([&] { Model::load(dir.string()); }); };
  const auto replace = [&](const std::string& name, const std::function<Tensor(const Tensor&)>& change) {
    return [=](NamedTensors& tensors) {
      for (auto& entry : tensors)
        if (entry.first == name) entry.second = change(entry.second);
    };
  };
  std::string e = load_error(edited_nvfp4("bad_scale_shape", replace(w + "_scale", [](const Tensor& s) {
    return Tensor::zeros({s.size(0), s.size(1) + 1}, DType::e4m3);
  })));
  EXPECT_NE(e.find("'" + w + "_scale'"), std::string::npos) << e;
  EXPECT_NE(e.find("bad_scale_shape"), std::string::npos) << e;  // the checkpoint
  e = load_error(edited_nvfp4("bad_scale_nan", replace(w + "_scale", [](const Tensor& s) {
    Tensor t = s.clone();
    static_cast<uint8_t*>(t.raw())[5] = 0x7f;  // row 1, block 1 of 4
    return t;
  })));
  EXPECT_NE(e.find("'" + w + "_scale' at [1, 1]"), std::string::npos) << e;
  EXPECT_NE(e.find("NaN"), std::string::npos) << e;
  e = load_error(edited_nvfp4("bad_global", replace(w + "_scale_2", [](const Tensor&) { return scalar(NAN); })));
  EXPECT_NE(e.find("'" + w + "_scale_2'"), std::string::npos) << e;
  e = load_error(edited_nvfp4("no_global", [&](NamedTensors& tensors) {
    std::erase_if(tensors, [&](const auto& entry) { return entry.first == w + "_scale_2"; });
  }));
  EXPECT_NE(e.find("'" + w + "_scale_2' is missing"), std::string::npos) << e;
  e = load_error(edited_nvfp4("bad_width", replace(w, [](const Tensor& c) {
    return Tensor::zeros({c.size(0), c.size(1) - 8}, DType::u8);
  })));
  EXPECT_NE(e.find("'" + w + "': expected NVFP4 codes of shape [32, 32]"), std::string::npos) << e;
  e = load_error(edited_nvfp4("orphan_scale", [&](NamedTensors& tensors) {
    tensors.emplace_back("language_model.model.norm.weight_scale_2", scalar(1));
  }));
  EXPECT_NE(e.find("an NVFP4 scale whose weight"), std::string::npos) << e;

  // Sharded: a scale of the wrong shape names the shard file; a truncated shard and an index
  // naming a missing file are refused when the checkpoint is opened.
  const fs::path sharded = made("fmt_corrupt_shards", "tiny", CheckpointFormat::nvfp4, 24 << 10);
  const nlohmann::json index = nlohmann::json::parse(testing::read_bytes(sharded / "model.safetensors.index.json"));
  const std::string shard = index["weight_map"][w].get<std::string>();
  {
    const fs::path dir = fresh_dir("shard_bad_scale");
    for (const auto& entry : fs::directory_iterator(sharded)) fs::copy_file(entry.path(), dir / entry.path().filename());
    const SafetensorsFile file = SafetensorsFile::open((sharded / shard).string());
    NamedTensors tensors;
    for (const std::string& name : file.names())
      tensors.emplace_back(name, name == w + "_scale" ? Tensor::zeros({1, 1}, DType::e4m3) : file.get(name).clone());
    save_safetensors((dir / shard).string(), tensors);
    e = load_error(dir);
    EXPECT_NE(e.find("'" + w + "_scale'"), std::string::npos) << e;
    EXPECT_NE(e.find(shard), std::string::npos) << e;
  }
  {
    const fs::path dir = fresh_dir("shard_truncated");
    for (const auto& entry : fs::directory_iterator(sharded)) fs::copy_file(entry.path(), dir / entry.path().filename());
    fs::resize_file(dir / shard, fs::file_size(dir / shard) - 100);
    e = load_error(dir);
    EXPECT_NE(e.find(shard), std::string::npos) << e;
  }
  {
    const fs::path dir = fresh_dir("shard_missing");
    for (const auto& entry : fs::directory_iterator(sharded))
      if (entry.path().filename() != shard) fs::copy_file(entry.path(), dir / entry.path().filename());
    e = load_error(dir);
    EXPECT_NE(e.find(shard), std::string::npos) << e;
  }
}

// ---- quantization_config ----

TEST(CheckpointFormats, QuantizationConfigIsReadAndCheckedAndRoundTrips) {
  ModelConfig c = model_config_preset("tiny");
  for (const std::string q : {"nvfp4", "mxfp8", ""}) {
    c.quantization = q;
    EXPECT_EQ(parse_model_config(model_config_to_json(c), "made").quantization, q);
  }
  const auto with_block = [&](const std::string& block) {
    c.quantization = "";
    nlohmann::json root = nlohmann::json::parse(model_config_to_json(c));
    root["quantization_config"] = nlohmann::json::parse(block);
    return error_of([&] { parse_model_config(root.dump(), "cfg.json"); });
  };
  std::string e = with_block(R"({"quant_method": "modelopt", "quant_algo": "FP8"})");
  EXPECT_NE(e.find("'quantization_config.quant_algo'"), std::string::npos) << e;
  e = with_block(R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})");
  EXPECT_NE(e.find("'quantization_config.group_size'"), std::string::npos) << e;
  e = with_block(R"({"quant_method": "gptq", "bits": 4})");
  EXPECT_NE(e.find("'quantization_config.quant_method'"), std::string::npos) << e;
  EXPECT_EQ(with_block(R"({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})"), "(no error)");
}

// ---- the full-size preset ----

TEST(M3Full, PresetIsTheReleasedConfig) {
  const ModelConfig c = model_config_preset("m3-full");
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.num_layers, 60);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.index_heads, 4);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.experts_per_token, 4);
  EXPECT_EQ(c.moe_intermediate_size, 3072);
  EXPECT_EQ(c.shared_intermediate_size, 3072);
  EXPECT_EQ(c.dense_intermediate_size, 12288);
  EXPECT_EQ(c.vocab_size, 200064);
  EXPECT_EQ(c.block_size, 128);
  EXPECT_EQ(c.topk_blocks, 16);
  EXPECT_EQ(c.bos_token_id, 200034);
  ASSERT_TRUE(c.vision.has_value());
  EXPECT_EQ(c.vision->num_layers, 32);
  for (int64_t i = 0; i < 60; ++i) {
    EXPECT_EQ(c.sparse_layers[i], i >= 3) << i;
    EXPECT_EQ(c.moe_layers[i], i >= 3) << i;
  }
  // Its config.json reads back the same.
  const ModelConfig back = parse_model_config(model_config_to_json(c), "m3-full");
  EXPECT_EQ(back.sparse_layers, c.sparse_layers);
  EXPECT_EQ(back.num_experts, 128);
  // --layers N keeps the first N layers of the pattern.
  EXPECT_EQ(first_layers(c, 1).sparse_layers, std::vector<bool>{false});
  EXPECT_EQ(first_layers(c, 4).moe_layers, (std::vector<bool>{false, false, false, true}));
  EXPECT_NE(error_of([&] { first_layers(c, 0); }).find("'layers'"), std::string::npos);
  EXPECT_NE(error_of([&] { first_layers(c, 61); }).find("'layers'"), std::string::npos);
}

TEST(M3Full, SizesAndTheEightRankPlan) {
  const ModelConfig c = model_config_preset("m3-full");
  // Parameter-derived sizes (docs/model.md quotes these): the full bf16 model ~855 GB, the
  // MXFP8 layout ~444 GB (the release lists 413 GiB = 444 GB), NVFP4 experts ~260 GB.
  const auto gb = [&](const ModelConfig& config, CheckpointFormat format) {
    return static_cast<double>(random_checkpoint_bytes(config, {.dtype = DType::bf16, .format = format})) / 1e9;
  };
  EXPECT_NEAR(gb(c, CheckpointFormat::floats), 855, 10);
  EXPECT_NEAR(gb(c, CheckpointFormat::mxfp8), 444, 10);
  EXPECT_NEAR(gb(c, CheckpointFormat::nvfp4), 262, 15);
  const ModelConfig one = first_layers(c, 1), four = first_layers(c, 4);
  EXPECT_NEAR(gb(one, CheckpointFormat::nvfp4), 7.3, 0.5);  // embeddings, lm_head, vision, one dense layer
  EXPECT_NEAR(gb(four, CheckpointFormat::nvfp4), 13.1, 0.5);  // + one MoE layer (NVFP4 experts)
  // The plan of 8 ranks: KV groups replicated over rank pairs, 16 experts each.
  for (int r = 0; r < 8; ++r) {
    const ShardPlan p = make_shard_plan(c, r, 8);
    EXPECT_EQ(p.kv_heads, 1);
    EXPECT_EQ(p.kv_begin, r / 2);
    EXPECT_EQ(p.q_heads, 8);
    EXPECT_EQ(p.q_begin, 8 * r);
    EXPECT_EQ(p.experts, 16);
    EXPECT_EQ(p.expert_begin, 16 * r);
    EXPECT_EQ(p.dense_columns, 12288 / 8);
    EXPECT_EQ(p.shared_columns, 3072 / 8);
    // Column slices of o_proj / down are whole 16- and 32-column groups: no rank dequantizes
    // more than it owns.
    EXPECT_EQ(p.q_begin * c.head_dim % 32, 0);
    EXPECT_EQ(p.shared_begin % 32, 0);
  }
}

// ---- the command ----

TEST(CheckpointFormatsCli, MakeModelWritesEachFormatWithLayersAndShards) {
  const fs::path dir = fresh_dir("cli_fmt");
  testing::CliResult r = testing::run_cli("make-model --config tiny --dtype nvfp4 --layers 2 --shard-gb 0.00003 --out " +
                                          testing::shell_quote((dir / "m").string()));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("2 layers"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir / "m" / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir / "m" / "hf_quant_config.json"));
  const Model model = Model::load((dir / "m").string());
  EXPECT_EQ(model.config().num_layers, 2);
  EXPECT_EQ(model.config().quantization, "nvfp4");
  r = testing::run_cli("make-model --config tiny --dtype mxfp8 --out " + testing::shell_quote((dir / "x").string()));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(Model::load((dir / "x").string()).config().quantization, "mxfp8");
  r = testing::run_cli("make-model --config tiny --dtype int4 --out " + testing::shell_quote((dir / "y").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("mxfp8 or nvfp4"), std::string::npos) << r.out;
  r = testing::run_cli("make-model --config tiny --layers 4 --out " + testing::shell_quote((dir / "z").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--layers"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace msa
