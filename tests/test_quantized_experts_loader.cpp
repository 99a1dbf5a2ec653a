// Routed experts kept quantized by the loader (WeightLoadOptions::routed_experts = quantized,
// what the CUDA model asks for): the codes and scales are the file's bytes, the rank plan
// takes whole experts, one format per layer, the refusals, and the default (dequantizing)
// path unchanged.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>

#include "cli_runner.h"
#include "made_checkpoints.h"
#include "model/nvfp4.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/safetensors.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;
using testing::NamedTensors;

constexpr WeightLoadOptions kKeep{.routed_experts = RoutedExperts::quantized};

fs::path made(const std::string& name, const std::string& preset, CheckpointFormat format) {
  return testing::made_checkpoint(name, preset, format, 0, 11);
}

std::string expert_name(int64_t layer, int64_t expert, const char* matrix) {
  return "language_model.model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." +
         std::to_string(expert) + "." + matrix + ".weight";
}

// The kept matrix holds the file's codes and scales byte for byte (and its global scale).
void expect_as_stored(const SafetensorsModel& file, const QuantizedMatrix& m, const std::string& name,
                      QuantizedFormat format) {
  ASSERT_EQ(m.format, format) << name;
  EXPECT_TRUE(testing::bitwise_equal(m.codes, file.get(name))) << name;
  const std::string scale = name + (format == QuantizedFormat::mxfp8 ? "_scale_inv" : "_scale");
  EXPECT_TRUE(testing::bitwise_equal(m.scales, file.get(scale))) << scale;
  if (format == QuantizedFormat::nvfp4) EXPECT_EQ(m.global_scale, file.get(name + "_scale_2").data<float>()[0]);
  else EXPECT_EQ(m.global_scale, 1.0f);
}

TEST(QuantizedExpertsLoader, KeepsTheFilesCodesAndScalesBitwise) {
  for (const auto [format, stored] : {std::pair{CheckpointFormat::nvfp4, QuantizedFormat::nvfp4},
                                      std::pair{CheckpointFormat::mxfp8, QuantizedFormat::mxfp8}}) {
    const fs::path dir = made(std::string("qe_keep_") + quantized_format_name(stored), "tiny", format);
    const ModelConfig c = load_model_config(dir.string());
    const SafetensorsModel file = SafetensorsModel::open(dir.string());
    const ModelWeights kept = load_model_weights(file, c, kKeep);
    const ModelWeights plain = load_model_weights(file, c);  // the default: dequantized
    int64_t moe_layers = 0;
    for (int64_t layer = 0; layer < c.num_layers; ++layer) {
      if (!c.moe_layers[layer]) continue;
      ++moe_layers;
      ASSERT_EQ(static_cast<int64_t>(kept.layers[layer].experts.size()), c.num_experts);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const ExpertWeights& x = kept.layers[layer].experts[e];
        EXPECT_TRUE(x.is_quantized());
        EXPECT_FALSE(x.gate.defined() || x.up.defined() || x.down.defined());
        expect_as_stored(file, x.quantized.gate, expert_name(layer, e, "w1"), stored);
        expect_as_stored(file, x.quantized.up, expert_name(layer, e, "w3"), stored);
        expect_as_stored(file, x.quantized.down, expert_name(layer, e, "w2"), stored);
        const ExpertWeights& d = plain.layers[layer].experts[e];
        EXPECT_FALSE(d.is_quantized());
        EXPECT_EQ(d.gate.dtype(), DType::bf16);
      }
      // Everything else loads as the default path loads it (MXFP8 attention / shared
      // expert dequantized).
      EXPECT_TRUE(testing::bitwise_equal(kept.layers[layer].q_proj, plain.layers[layer].q_proj));
      EXPECT_TRUE(testing::bitwise_equal(kept.layers[layer].shared_expert.down, plain.layers[layer].shared_expert.down));
      EXPECT_TRUE(testing::bitwise_equal(kept.layers[layer].router, plain.layers[layer].router));
    }
    EXPECT_GE(moe_layers, 1);
    EXPECT_TRUE(testing::bitwise_equal(kept.layers[0].mlp.gate, plain.layers[0].mlp.gate));
  }
}

TEST(QuantizedExpertsLoader, RankPlanTakesWholeExpertsAsStored) {
  for (const CheckpointFormat format : {CheckpointFormat::nvfp4, CheckpointFormat::mxfp8}) {
    const fs::path dir = made(format == CheckpointFormat::nvfp4 ? "qe_tp_nvfp4" : "qe_tp_mxfp8", "tiny-tp", format);
    const ModelConfig c = load_model_config(dir.string());
    const SafetensorsModel file = SafetensorsModel::open(dir.string());
    const ModelWeights whole = load_model_weights(file, c, kKeep);
    for (int world : {2, 4})
      for (int r = 0; r < world; ++r) {
        const ShardPlan p = make_shard_plan(c, r, world);
        const ModelWeights mine = load_model_weights(file, c, p, kKeep);
        for (int64_t layer = 0; layer < c.num_layers; ++layer) {
          if (!c.moe_layers[layer]) continue;
          ASSERT_EQ(static_cast<int64_t>(mine.layers[layer].experts.size()), p.experts);
          for (int64_t e = 0; e < p.experts; ++e) {
            const QuantizedExpert& a = mine.layers[layer].experts[e].quantized;
            const QuantizedExpert& b = whole.layers[layer].experts[p.expert_begin + e].quantized;
            for (auto [x, y] : {std::pair{&a.gate, &b.gate}, std::pair{&a.up, &b.up}, std::pair{&a.down, &b.down}}) {
              EXPECT_NE(x->format, QuantizedFormat::none);
              EXPECT_TRUE(testing::bitwise_equal(x->codes, y->codes)) << world << " " << r << " " << e;
              EXPECT_TRUE(testing::bitwise_equal(x->scales, y->scales)) << world << " " << r << " " << e;
              EXPECT_EQ(x->global_scale, y->global_scale);
            }
          }
        }
      }
  }
}

// The made tiny MXFP8 checkpoint `source` with layer `layer`'s experts in transformers' fused layout
// (mlp.experts.gate_up_proj [E, 2I, H] with w1 rows first, down_proj [E, H, I], and their
// `_scale_inv`), the rest as made.
fs::path fused_mxfp8(const std::string& name, const fs::path& source, int64_t layer) {
  const ModelConfig c = load_model_config(source.string());
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  const fs::path dir = fresh_dir(name);
  fs::copy_file(source / "config.json", dir / "config.json");
  const SafetensorsModel file = SafetensorsModel::open(source.string());
  NamedTensors tensors;
  const std::string experts = "language_model.model.layers." + std::to_string(layer) + ".block_sparse_moe.experts.";
  for (const std::string& t : file.names())
    if (!t.starts_with(experts)) tensors.emplace_back(t, file.get(t).clone());
  auto stack = [&](std::initializer_list<const char*> matrices, int64_t rows, int64_t in, const char* suffix,
                   DType dtype) {
    Tensor out = Tensor::zeros({E, rows, in}, dtype);
    char* dst = static_cast<char*>(out.raw());
    for (int64_t e = 0; e < E; ++e)
      for (const char* m : matrices) {
        const Tensor part = file.get(expert_name(layer, e, m) + suffix);
        std::memcpy(dst, part.raw(), part.nbytes());
        dst += part.nbytes();
      }
    return out;
  };
  const std::string fused = "language_model.model.layers." + std::to_string(layer) + ".mlp.experts.";
  tensors.emplace_back(fused + "gate_up_proj", stack({"w1", "w3"}, 2 * I, H, "", DType::e4m3));
  tensors.emplace_back(fused + "gate_up_proj_scale_inv", stack({"w1", "w3"}, 2 * I, H / 32, "_scale_inv", DType::u8));
  tensors.emplace_back(fused + "down_proj", stack({"w2"}, H, I, "", DType::e4m3));
  tensors.emplace_back(fused + "down_proj_scale_inv", stack({"w2"}, H, I / 32, "_scale_inv", DType::u8));
  save_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

TEST(QuantizedExpertsLoader, FusedLayoutKeepsTheSameBytesWholeAndPerRank) {
  const fs::path made_dir = made("qe_fused_source", "tiny", CheckpointFormat::mxfp8);
  const fs::path dir = fused_mxfp8("qe_fused", made_dir, 1);
  const ModelConfig c = load_model_config(dir.string());
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  const SafetensorsModel source = SafetensorsModel::open(made_dir.string());
  const ModelWeights kept = load_model_weights(file, c, kKeep);
  for (int64_t e = 0; e < c.num_experts; ++e) {
    expect_as_stored(source, kept.layers[1].experts[e].quantized.gate, expert_name(1, e, "w1"), QuantizedFormat::mxfp8);
    expect_as_stored(source, kept.layers[1].experts[e].quantized.up, expert_name(1, e, "w3"), QuantizedFormat::mxfp8);
    expect_as_stored(source, kept.layers[1].experts[e].quantized.down, expert_name(1, e, "w2"), QuantizedFormat::mxfp8);
  }
  const ShardPlan p = make_shard_plan(c, 1, 2);
  const ModelWeights mine = load_model_weights(file, c, p, kKeep);
  ASSERT_EQ(static_cast<int64_t>(mine.layers[1].experts.size()), p.experts);
  for (int64_t e = 0; e < p.experts; ++e)
    expect_as_stored(source, mine.layers[1].experts[e].quantized.down, expert_name(1, p.expert_begin + e, "w2"),
                     QuantizedFormat::mxfp8);
}

// The made tiny NVFP4 checkpoint with tensors passed through `edit`.
fs::path edited_nvfp4(const std::string& name, const std::function<void(NamedTensors&)>& edit) {
  return testing::edited_checkpoint(made(name + "_source", "tiny", CheckpointFormat::nvfp4), name, edit);
}

TEST(QuantizedExpertsLoader, OneFormatPerLayerElseTheTensorIsNamed) {
  // Expert 3's w2 of layer 2 stored as bf16 (its dequantized values) among NVFP4 experts.
  const std::string w2 = expert_name(2, 3, "w2");
  const fs::path dir = edited_nvfp4("qe_mixed", [&](NamedTensors& tensors) {
    Tensor codes, scale, global;
    for (const auto& [name, t] : tensors) {
      if (name == w2) codes = t;
      if (name == w2 + "_scale") scale = t;
      if (name == w2 + "_scale_2") global = t;
    }
    const Tensor values = model::dequantize_nvfp4(codes, scale, global, w2);
    const std::string module = w2.substr(0, w2.size() - 6);  // "...experts.3.w2.": weight, scales, input_scale
    std::erase_if(tensors, [&](const auto& entry) { return entry.first.starts_with(module); });
    tensors.emplace_back(w2, values);
  });
  const ModelConfig c = load_model_config(dir.string());
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  const std::string e = error_of([&] { load_model_weights(file, c, kKeep); });
  EXPECT_NE(e.find("'" + w2 + "' is stored as floats"), std::string::npos) << e;
  EXPECT_NE(e.find("nvfp4"), std::string::npos) << e;
  EXPECT_NE(e.find("one format"), std::string::npos) << e;
  // The dequantizing default takes the mixture.
  const ModelWeights plain = load_model_weights(file, c);
  EXPECT_EQ(plain.layers[2].experts[3].down.dtype(), DType::bf16);
}

TEST(QuantizedExpertsLoader, KeptCodesAreCheckedAsTheDequantizerChecksThem) {
  const std::string w1 = expert_name(1, 2, "w1");
  const fs::path dir = edited_nvfp4("qe_nan_scale", [&](NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name == w1 + "_scale") static_cast<uint8_t*>(t.raw())[5] = 0xff;  // row 1, block 1 of 4 (H / 16)
  });
  const SafetensorsModel file = SafetensorsModel::open(dir.string());
  const std::string e = error_of([&] { load_model_weights(file, load_model_config(dir.string()), kKeep); });
  EXPECT_NE(e.find("'" + w1 + "_scale' at [1, 1]"), std::string::npos) << e;
  EXPECT_NE(e.find("qe_nan_scale"), std::string::npos) << e;  // the checkpoint
}

TEST(QuantizedExpertsLoader, TheCpuModelRefusesQuantizedExperts) {
  const fs::path dir = made("qe_cpu", "tiny", CheckpointFormat::mxfp8);
  std::string e = error_of([&] { Model::load(dir.string(), Device::cpu, false, RoutedExperts::quantized); });
  EXPECT_NE(e.find("routed_experts"), std::string::npos) << e;
  // Constructed by hand, its forward names the reason instead of reading undefined tensors.
  const Model model(load_model_config(dir.string()), SafetensorsModel::open(dir.string()), kKeep);
  KvCache cache(model.config(), 8, DType::f32);
  SequenceCache sequence;
  const std::vector<int32_t> tokens{5, 6, 7};
  const ForwardRequest request{.sequence = &sequence, .tokens = tokens};
  e = error_of([&] { model.forward({&request, 1}, cache); });
  EXPECT_NE(e.find("kept mxfp8"), std::string::npos) << e;
  // The default CPU load dequantizes (unchanged).
  const Model plain = Model::load(dir.string());
  EXPECT_EQ(plain.weights().layers[1].experts[0].gate.dtype(), DType::bf16);
}

}  // namespace
}  // namespace msa
