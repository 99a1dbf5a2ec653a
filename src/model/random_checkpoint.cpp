// `msa make-model`: random weights under the released checkpoint's names, single file or
// sharded with an index, plus config.json.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "msa/model_random.h"
#include "msa/safetensors.h"

namespace msa {
namespace {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// splitmix64: fast, seedable, and the same on every platform.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
};

class Builder {
 public:
  Builder(uint64_t seed, DType dtype) : random_{seed}, dtype_(dtype) {}

  // Uniform with the given standard deviation (mean `mean`).
  void add(const std::string& name, const Shape& shape, double std, double mean = 0,
           bool keep_f32 = false) {
    const DType dtype = keep_f32 ? DType::f32 : dtype_;
    Tensor tensor = Tensor::zeros(shape, dtype);
    const float half_width = static_cast<float>(std * std::sqrt(3.0));
    const int64_t n = tensor.numel();
    if (dtype == DType::f32) {
      float* data = tensor.data<float>();
      for (int64_t i = 0; i < n; ++i)
        data[i] = static_cast<float>(mean) + half_width * (2 * random_.uniform() - 1);
    } else {
      uint16_t* data = static_cast<uint16_t*>(tensor.raw());
      for (int64_t i = 0; i < n; ++i) {
        const float value = static_cast<float>(mean) + half_width * (2 * random_.uniform() - 1);
        data[i] = dtype == DType::bf16 ? float_to_bf16(value) : float_to_f16(value);
      }
    }
    parameters_ += n;
    tensors_.emplace_back(name, std::move(tensor));
  }
  void linear(const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, 1.0 / std::sqrt(static_cast<double>(in)));
  }
  void norm(const std::string& name, int64_t dim) { add(name, {dim}, 0.1); }

  NamedTensors& tensors() { return tensors_; }
  int64_t parameters() const { return parameters_; }

 private:
  Random random_;
  DType dtype_;
  NamedTensors tensors_;
  int64_t parameters_ = 0;
};

void add_mlp(Builder& b, const std::string& prefix, int64_t hidden, int64_t inter) {
  b.linear(prefix + "gate_proj.weight", inter, hidden);
  b.linear(prefix + "up_proj.weight", inter, hidden);
  b.linear(prefix + "down_proj.weight", hidden, inter);
}

void save_sharded(const std::filesystem::path& dir, NamedTensors& tensors, int64_t shard_bytes) {
  std::vector<NamedTensors> shards(1);
  int64_t size = 0;
  for (auto& entry : tensors) {
    const int64_t bytes = static_cast<int64_t>(entry.second.nbytes());
    if (!shards.back().empty() && size + bytes > shard_bytes) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().push_back(entry);
    size += bytes;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  char name[64];
  for (size_t i = 0; i < shards.size(); ++i) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    for (const auto& entry : shards[i]) {
      weight_map[entry.first] = name;
      total += static_cast<int64_t>(entry.second.nbytes());
    }
    save_safetensors((dir / name).string(), shards[i], {{"format", "pt"}});
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream((dir / "model.safetensors.index.json").string()) << index.dump(2) << "\n";
}

}  // namespace

int64_t write_random_checkpoint(const ModelConfig& c, const std::string& dir_name,
                                const RandomCheckpointOptions& options) {
  namespace fs = std::filesystem;
  c.validate();
  ModelConfig config = c;
  config.dtype = options.dtype == DType::f32 ? "float32" : options.dtype == DType::bf16 ? "bfloat16" : "float16";
  const fs::path dir(dir_name);
  fs::create_directories(dir);
  // A stale single file or index would shadow what is written now.
  fs::remove(dir / "model.safetensors");
  fs::remove(dir / "model.safetensors.index.json");
  Builder b(options.seed, options.dtype);
  const int64_t H = c.hidden_size, D = c.head_dim;
  const std::string p = "language_model.model.";
  b.add(p + "embed_tokens.weight", {c.vocab_size, H}, 1.0);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string layer = p + "layers." + std::to_string(i) + ".";
    b.norm(layer + "input_layernorm.weight", H);
    b.norm(layer + "post_attention_layernorm.weight", H);
    const std::string attn = layer + "self_attn.";
    b.linear(attn + "q_proj.weight", c.num_heads * D, H);
    b.linear(attn + "k_proj.weight", c.num_kv_heads * D, H);
    b.linear(attn + "v_proj.weight", c.num_kv_heads * D, H);
    b.linear(attn + "o_proj.weight", H, c.num_heads * D);
    b.norm(attn + "q_norm.weight", D);
    b.norm(attn + "k_norm.weight", D);
    if (c.sparse_layers[i]) {
      b.linear(attn + "index_q_proj.weight", c.index_heads * c.index_head_dim, H);
      b.linear(attn + "index_k_proj.weight", c.index_head_dim, H);
      b.norm(attn + "index_q_norm.weight", c.index_head_dim);
      b.norm(attn + "index_k_norm.weight", c.index_head_dim);
    }
    if (c.moe_layers[i]) {
      const std::string moe = layer + "block_sparse_moe.";
      b.add(moe + "gate.weight", {c.num_experts, H}, 1.0 / std::sqrt(static_cast<double>(H)), 0,
            /*keep_f32=*/true);
      b.add(moe + "e_score_correction_bias", {c.num_experts}, 0.05, 0, /*keep_f32=*/true);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        b.linear(expert + "w1.weight", c.moe_intermediate_size, H);
        b.linear(expert + "w3.weight", c.moe_intermediate_size, H);
        b.linear(expert + "w2.weight", H, c.moe_intermediate_size);
      }
      if (c.shared_intermediate_size > 0)
        add_mlp(b, moe + "shared_experts.", H, c.shared_intermediate_size);
    } else {
      add_mlp(b, layer + "mlp.", H, c.dense_intermediate_size);
    }
  }
  b.norm(p + "norm.weight", H);
  b.linear("language_model.lm_head.weight", c.vocab_size, H);

  std::ofstream((dir / "config.json").string()) << model_config_to_json(config);
  if (options.shard_bytes > 0) save_sharded(dir, b.tensors(), options.shard_bytes);
  else save_safetensors((dir / "model.safetensors").string(), b.tensors(), {{"format", "pt"}});
  return b.parameters();
}

}  // namespace msa
