// config.json -> ModelConfig (both the released and the transformers spellings), the
// make-model presets, and ModelConfig -> config.json.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/layer_layout.h"
#include "msa/model_config.h"

namespace msa {
namespace {

using json = nlohmann::json;

// Reads fields from the text config, falling back to the outer config (a text-only
// config.json has no text_config).
class Fields {
 public:
  Fields(const json& text, const json& outer, std::string origin)
      : text_(text), outer_(outer), origin_(std::move(origin)) {}

  const json* find(const std::string& name) const {
    if (text_.is_object() && text_.contains(name) && !text_[name].is_null()) return &text_[name];
    if (outer_.is_object() && outer_.contains(name) && !outer_[name].is_null())
      return &outer_[name];
    return nullptr;
  }
  template <class T>
  T get(const std::string& name, T fallback) const {
    const json* value = find(name);
    if (!value) return fallback;
    try {
      return value->get<T>();
    } catch (const json::exception&) {
      throw Error(origin_ + ": field '" + name + "': expected a " + type_name<T>() + ", got " +
                  value->dump());
    }
  }
  template <class T>
  T require(const std::string& name) const {
    if (!find(name)) throw Error(origin_ + ": missing required field '" + name + "'");
    return get<T>(name, T{});
  }
  const std::string& origin() const { return origin_; }

 private:
  template <class T>
  static const char* type_name() {
    if constexpr (std::is_same_v<T, bool>) return "boolean";
    else if constexpr (std::is_integral_v<T>) return "integer";
    else if constexpr (std::is_floating_point_v<T>) return "number";
    else if constexpr (std::is_same_v<T, std::string>) return "string";
    else return "list";
  }
  const json& text_;
  const json& outer_;
  std::string origin_;
};

[[noreturn]] void field_error(const std::string& origin, const std::string& field,
                              const std::string& expected, const std::string& got) {
  throw Error(origin + ": field '" + field + "': expected " + expected + ", got " + got);
}

// A per-layer list: strings (`sparse_name` marks true) or 0/1 flags.
std::vector<bool> layer_flags(const json& list, const std::string& field,
                              const std::string& sparse_name, const std::string& dense_name,
                              const std::string& origin) {
  if (!list.is_array()) field_error(origin, field, "a list", list.dump());
  std::vector<bool> flags;
  for (const json& entry : list) {
    if (entry.is_string()) {
      const std::string name = entry.get<std::string>();
      if (name != sparse_name && name != dense_name)
        field_error(origin, field, "entries \"" + sparse_name + "\" or \"" + dense_name + "\"",
                    entry.dump());
      flags.push_back(name == sparse_name);
    } else if (entry.is_number_integer() || entry.is_boolean()) {
      flags.push_back(entry.is_boolean() ? entry.get<bool>() : entry.get<int64_t>() != 0);
    } else {
      field_error(origin, field, "strings or 0/1 flags", entry.dump());
    }
  }
  return flags;
}

std::vector<int32_t> token_ids(const json* value) {
  if (!value) return {};
  if (value->is_number_integer()) return {value->get<int32_t>()};
  std::vector<int32_t> ids;
  if (value->is_array())
    for (const json& id : *value)
      if (id.is_number_integer()) ids.push_back(id.get<int32_t>());
  return ids;
}

}  // namespace

MsaParams ModelConfig::msa_params() const {
  MsaParams params;
  params.block_size = block_size;
  params.topk = topk_blocks;
  params.local_blocks = local_blocks;
  params.init_blocks = init_blocks;
  params.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  return params;
}

bool ModelConfig::any_sparse_layer() const {
  for (bool sparse : sparse_layers)
    if (sparse) return true;
  return false;
}

void ModelConfig::validate() const {
  auto positive = [](const char* field, int64_t value) {
    if (value < 1) throw_arg_error(std::string("config.") + field, "a positive value", value);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_hidden_layers", num_layers);
  positive("num_attention_heads", num_heads);
  positive("num_key_value_heads", num_kv_heads);
  positive("head_dim", head_dim);
  if (num_heads % num_kv_heads != 0)
    throw_arg_error("config.num_attention_heads",
                    "a multiple of num_key_value_heads (" + std::to_string(num_kv_heads) + ")",
                    num_heads);
  if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    throw_arg_error("config.rotary_dim", "an even count in [0, head_dim=" +
                                             std::to_string(head_dim) + "]",
                    rotary_dim);
  if (static_cast<int64_t>(sparse_layers.size()) != num_layers)
    throw_arg_error("config.layer_types", std::to_string(num_layers) + " entries",
                    sparse_layers.size());
  if (static_cast<int64_t>(moe_layers.size()) != num_layers)
    throw_arg_error("config.mlp_layer_types", std::to_string(num_layers) + " entries",
                    moe_layers.size());
  bool any_moe = false, any_dense_mlp = false;
  for (int64_t i = 0; i < num_layers; ++i) (moe_layers[i] ? any_moe : any_dense_mlp) = true;
  if (any_dense_mlp) positive("dense_intermediate_size", dense_intermediate_size);
  if (any_moe) {
    positive("intermediate_size", moe_intermediate_size);
    positive("num_local_experts", num_experts);
    if (experts_per_token < 1 || experts_per_token > num_experts)
      throw_arg_error("config.num_experts_per_tok",
                      "a count in [1, num_local_experts=" + std::to_string(num_experts) + "]",
                      experts_per_token);
  }
  if (any_sparse_layer()) {
    if (index_heads != num_kv_heads)
      throw_arg_error("config.index_n_heads",
                      "num_key_value_heads (" + std::to_string(num_kv_heads) +
                          "): MSA selects per GQA group",
                      index_heads);
    positive("index_head_dim", index_head_dim);
    if (rotary_dim > index_head_dim)
      throw_arg_error("config.index_head_dim",
                      "at least rotary_dim (" + std::to_string(rotary_dim) + ")", index_head_dim);
    validate_params(msa_params());
  } else if (block_size < 1) {
    throw_arg_error("config.index_block_size", "a positive KV page size", block_size);
  }
}

ModelConfig parse_model_config(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {
    throw Error(origin + ": not valid JSON: " + error.what());
  }
  if (!root.is_object()) throw Error(origin + ": expected a JSON object");
  const json empty = json::object();
  const json& text = root.contains("text_config") && root["text_config"].is_object()
                         ? root["text_config"]
                         : empty;
  const Fields f(text, root, origin);
  ModelConfig c;
  c.vocab_size = f.require<int64_t>("vocab_size");
  c.hidden_size = f.require<int64_t>("hidden_size");
  c.num_layers = f.require<int64_t>("num_hidden_layers");
  c.num_heads = f.require<int64_t>("num_attention_heads");
  c.num_kv_heads = f.get<int64_t>("num_key_value_heads", c.num_heads);
  c.head_dim = f.get<int64_t>("head_dim", c.hidden_size / c.num_heads);
  c.rms_norm_eps = f.get<double>("rms_norm_eps", 1e-6);

  // RoPE: transformers reads rope_parameters (theta, partial_rotary_factor) and ignores
  // `rotary_dim`; the release also has rotary_dim. The factor wins when both are there.
  const json* rope = f.find("rope_parameters");
  if (!rope) rope = f.find("rope_scaling");
  auto rope_field = [&](const std::string& name) -> const json* {
    if (rope && rope->is_object() && rope->contains(name) && !(*rope)[name].is_null())
      return &(*rope)[name];
    return f.find(name);
  };
  if (rope && rope->is_object() && rope->contains("rope_type")) {
    const json& type = (*rope)["rope_type"];
    if (!type.is_string() || type.get<std::string>() != "default")
      field_error(origin, "rope_parameters.rope_type", "\"default\" (no RoPE scaling)",
                  type.dump());
  }
  if (const json* theta = rope_field("rope_theta")) c.rope_theta = theta->get<double>();
  if (const json* factor = rope_field("partial_rotary_factor")) {
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * factor->get<double>());
  } else if (const json* rotary = f.find("rotary_dim")) {
    c.rotary_dim = rotary->get<int64_t>();
  } else {
    c.rotary_dim = c.head_dim;
  }

  c.moe_intermediate_size = f.get<int64_t>("intermediate_size", c.moe_intermediate_size);
  c.dense_intermediate_size = f.get<int64_t>("dense_intermediate_size", c.dense_intermediate_size);
  c.shared_intermediate_size =
      f.get<int64_t>("shared_intermediate_size", c.shared_intermediate_size);
  const int64_t shared_experts = f.get<int64_t>("n_shared_experts", 1);
  if (shared_experts != 0 && shared_experts != 1)
    field_error(origin, "n_shared_experts", "0 or 1", std::to_string(shared_experts));
  if (shared_experts == 0) c.shared_intermediate_size = 0;
  c.num_experts = f.get<int64_t>("num_local_experts", c.num_experts);
  c.experts_per_token = f.get<int64_t>("num_experts_per_tok", c.experts_per_token);
  c.routed_scaling_factor = f.get<double>("routed_scaling_factor", c.routed_scaling_factor);
  c.swiglu_alpha = f.get<double>("swiglu_alpha", c.swiglu_alpha);
  c.swiglu_limit = f.get<double>("swiglu_limit", c.swiglu_limit);
  const std::string scoring = f.get<std::string>("scoring_func", "sigmoid");
  if (scoring != "sigmoid") field_error(origin, "scoring_func", "\"sigmoid\"", "\"" + scoring + "\"");
  if (f.get<bool>("attention_output_gate", false))
    field_error(origin, "attention_output_gate", "false (no output gate in M3)", "true");
  if (f.get<bool>("use_gemma_norm", true) == false)
    field_error(origin, "use_gemma_norm", "true", "false");
  const std::string qk_norm = f.get<std::string>("qk_norm_type", "per_head");
  if (qk_norm != "per_head") field_error(origin, "qk_norm_type", "\"per_head\"", qk_norm);

  // Sparse attention: transformers' flat index_* fields, overridden by the release's
  // sparse_attention_config (as transformers does).
  c.index_heads = f.get<int64_t>("index_n_heads", c.num_kv_heads);
  c.index_head_dim = f.get<int64_t>("index_head_dim", c.index_head_dim);
  c.block_size = f.get<int>("index_block_size", c.block_size);
  c.topk_blocks = f.get<int>("index_topk_blocks", c.topk_blocks);
  c.local_blocks = f.get<int>("index_local_blocks", c.local_blocks);
  const json* sparse = f.find("sparse_attention_config");
  const json sparse_cfg = sparse && sparse->is_object() ? *sparse : json::object();
  const Fields s(sparse_cfg, empty, origin + " sparse_attention_config");
  c.index_heads = s.get<int64_t>("sparse_num_index_heads", c.index_heads);
  c.index_head_dim = s.get<int64_t>("sparse_index_dim", c.index_head_dim);
  c.block_size = s.get<int>("sparse_block_size", c.block_size);
  c.topk_blocks = s.get<int>("sparse_topk_blocks", c.topk_blocks);
  c.local_blocks = s.get<int>("sparse_local_block", c.local_blocks);
  c.init_blocks = s.get<int>("sparse_init_block", c.init_blocks);
  const std::string score_type = s.get<std::string>("sparse_score_type", "max");
  if (score_type != "max")
    field_error(origin, "sparse_attention_config.sparse_score_type", "\"max\"", score_type);

  if (const json* types = f.find("layer_types")) {
    c.sparse_layers = layer_flags(*types, "layer_types", "minimax_m3_sparse", "full_attention",
                                  origin);
  } else if (sparse_cfg.contains("sparse_attention_freq") &&
             s.get<bool>("use_sparse_attention", true)) {
    c.sparse_layers = layer_flags(sparse_cfg["sparse_attention_freq"],
                                  "sparse_attention_config.sparse_attention_freq", "", "", origin);
  } else {
    c.sparse_layers.assign(c.num_layers, false);
  }
  if (const json* types = f.find("mlp_layer_types")) {
    c.moe_layers = layer_flags(*types, "mlp_layer_types", "sparse", "dense", origin);
  } else if (const json* freq = f.find("moe_layer_freq")) {
    c.moe_layers = layer_flags(*freq, "moe_layer_freq", "", "", origin);
  } else {
    c.moe_layers.assign(c.num_layers, true);  // transformers' default: every layer MoE
  }

  c.tie_word_embeddings = f.get<bool>("tie_word_embeddings", false);
  const std::vector<int32_t> bos = token_ids(f.find("bos_token_id"));
  c.bos_token_id = bos.empty() ? -1 : bos.front();
  c.eos_token_ids = token_ids(f.find("eos_token_id"));
  if (const json* dtype = f.find("dtype")) c.dtype = dtype->get<std::string>();
  else if (const json* dtype = f.find("torch_dtype")) c.dtype = dtype->get<std::string>();
  c.validate();
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file = fs::is_directory(path) ? fs::path(path) / "config.json" : fs::path(path);
  std::ifstream in(file);
  if (!in) throw Error("model config: cannot open " + file.string());
  std::stringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), file.string());
}

std::string model_config_to_json(const ModelConfig& c) {
  json layer_types = json::array(), mlp_types = json::array(), sparse_freq = json::array(),
       moe_freq = json::array();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    layer_types.push_back(c.sparse_layers[i] ? "minimax_m3_sparse" : "full_attention");
    mlp_types.push_back(c.moe_layers[i] ? "sparse" : "dense");
    sparse_freq.push_back(c.sparse_layers[i] ? 1 : 0);
    moe_freq.push_back(c.moe_layers[i] ? 1 : 0);
  }
  json text = {
      {"model_type", "minimax_m3_vl_text"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"rotary_dim", c.rotary_dim},
      {"rope_parameters",
       {{"rope_type", "default"},
        {"rope_theta", c.rope_theta},
        {"partial_rotary_factor",
         static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim)}}},
      {"rms_norm_eps", c.rms_norm_eps},
      {"intermediate_size", c.moe_intermediate_size},
      {"dense_intermediate_size", c.dense_intermediate_size},
      {"shared_intermediate_size", c.shared_intermediate_size},
      {"n_shared_experts", c.shared_intermediate_size > 0 ? 1 : 0},
      {"num_local_experts", c.num_experts},
      {"num_experts_per_tok", c.experts_per_token},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"scoring_func", "sigmoid"},
      {"use_routing_bias", true},
      {"hidden_act", "swigluoai"},
      {"swiglu_alpha", c.swiglu_alpha},
      {"swiglu_limit", c.swiglu_limit},
      {"use_gemma_norm", true},
      {"qk_norm_type", "per_head"},
      {"layer_types", layer_types},
      {"mlp_layer_types", mlp_types},
      {"moe_layer_freq", moe_freq},
      {"index_n_heads", c.index_heads},
      {"index_head_dim", c.index_head_dim},
      {"index_block_size", c.block_size},
      {"index_topk_blocks", c.topk_blocks},
      {"index_local_blocks", c.local_blocks},
      {"sparse_attention_config",
       {{"use_sparse_attention", true},
        {"sparse_attention_freq", sparse_freq},
        {"sparse_num_index_heads", c.index_heads},
        {"sparse_index_dim", c.index_head_dim},
        {"sparse_block_size", c.block_size},
        {"sparse_topk_blocks", c.topk_blocks},
        {"sparse_local_block", c.local_blocks},
        {"sparse_init_block", c.init_blocks},
        {"sparse_score_type", "max"}}},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"dtype", c.dtype},
  };
  if (c.bos_token_id >= 0) text["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) text["eos_token_id"] = c.eos_token_ids.front();
  else if (!c.eos_token_ids.empty()) text["eos_token_id"] = c.eos_token_ids;
  const json root = {{"architectures", {"MiniMaxM3SparseForConditionalGeneration"}},
                     {"model_type", "minimax_m3_vl"},
                     {"tie_word_embeddings", c.tie_word_embeddings},
                     {"dtype", c.dtype},
                     {"text_config", text}};
  return root.dump(2) + "\n";
}

ModelConfig with_layers(ModelConfig c, int64_t layers, int64_t dense_layers) {
  c.num_layers = layers;
  c.sparse_layers.assign(layers, true);
  c.moe_layers.assign(layers, true);
  for (int64_t i = 0; i < dense_layers && i < layers; ++i)
    c.sparse_layers[i] = c.moe_layers[i] = false;
  return c;
}

std::vector<std::string> model_config_preset_names() { return {"tiny", "small", "m3-layer"}; }

ModelConfig model_config_preset(std::string_view name) {
  ModelConfig c;  // the real M3 text values
  c.bos_token_id = 200034;
  c.eos_token_ids = {200020};
  if (name == "tiny") {  // seconds to build and run; selection exercised past 64 tokens
    c.vocab_size = 512;
    c.hidden_size = 64;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 16;
    c.rotary_dim = 8;
    c.dense_intermediate_size = 96;
    c.moe_intermediate_size = 32;
    c.shared_intermediate_size = 32;
    c.num_experts = 8;
    c.experts_per_token = 2;
    c.index_heads = 2;
    c.index_head_dim = 16;
    c.block_size = 16;
    c.topk_blocks = 4;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c.dtype = "float32";
    c = with_layers(c, 3, 1);
  } else if (name == "small") {  // ~30M parameters, bf16; selection past 512 tokens
    c.vocab_size = 4096;
    c.hidden_size = 512;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.rotary_dim = 32;
    c.dense_intermediate_size = 1536;
    c.moe_intermediate_size = 256;
    c.shared_intermediate_size = 256;
    c.num_experts = 16;
    c.experts_per_token = 4;
    c.index_heads = 2;
    c.index_head_dim = 64;
    c.block_size = 64;
    c.topk_blocks = 8;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c = with_layers(c, 4, 1);
  } else if (name == "m3-layer") {
    // One dense and one MSA/MoE layer at M3's real width; 16 experts instead of 128 and a
    // 8192-token vocabulary keep it at ~1.5B parameters (3 GB bf16).
    c.vocab_size = 8192;
    c.num_experts = 16;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c = with_layers(c, 2, 1);
  } else {
    throw_arg_error("config", "one of tiny, small, m3-layer", std::string(name));
  }
  c.validate();
  return c;
}

}  // namespace msa
