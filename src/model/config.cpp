// config.json -> ModelConfig (both the released and the transformers spellings), the
// make-model presets, and ModelConfig -> config.json.
#include <climits>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/json_parse.h"
#include "core/text_file.h"

#include "model/config_fields.h"
#include "model/layer_layout.h"
#include "msa/model_config.h"

namespace msa {
namespace {

using model::aliased_integer;
using model::field_error;
using model::Fields;
using model::json;
using model::kMaxCount;
using model::kMaxDim;
using model::range_text;

// A per-layer list: strings (`sparse_name` marks true) or 0/1 flags.
std::vector<bool> layer_flags(const json& list, const std::string& field,
                              const std::string& sparse_name, const std::string& dense_name,
                              const std::string& origin) {
  if (!list.is_array()) field_error(origin, field, "a list", json_excerpt(list));
  std::vector<bool> flags;
  for (const json& entry : list) {
    if (entry.is_string() && !sparse_name.empty()) {
      const std::string name = entry.get<std::string>();
      if (name != sparse_name && name != dense_name)
        field_error(origin, field, "entries \"" + sparse_name + "\" or \"" + dense_name + "\"",
                    json_excerpt(entry));
      flags.push_back(name == sparse_name);
    } else if (entry.is_boolean()) {
      flags.push_back(entry.get<bool>());
    } else if (const std::optional<int64_t> flag = json_integral(entry); flag && *flag >= 0 && *flag <= 1) {
      flags.push_back(*flag == 1);
    } else {
      field_error(origin, field,
                  sparse_name.empty() ? std::string("0/1 flags")
                                      : "\"" + sparse_name + "\" / \"" + dense_name + "\" entries",
                  json_excerpt(entry));
    }
  }
  return flags;
}

// bos_token_id / eos_token_id: one id or a list of ids, each inside the vocabulary.
std::vector<int32_t> token_ids(const Fields& f, const std::string& name, int64_t vocab_size) {
  const json* value = f.find(name);
  if (!value) return {};
  const std::string expected =
      "token ids in [0, vocab_size = " + std::to_string(vocab_size) + ")";
  std::vector<int32_t> ids;
  const auto add = [&](const json& id) {
    const std::optional<int64_t> got = json_integral(id);
    if (!got || *got < 0 || *got >= vocab_size)
      field_error(f.origin(), f.path(name), expected, json_excerpt(id));
    ids.push_back(static_cast<int32_t>(*got));
  };
  if (value->is_array()) {
    for (const json& id : *value) add(id);
  } else {
    add(*value);
  }
  return ids;
}

// The top-level `quantization_config`. ModelOpt exports (quant_method "modelopt") must be
// NVFP4 with 16-channel groups, the only ModelOpt format the loader reads; "fp8" is the
// fine-grained FP8 / MXFP8 block (its scales are checked per tensor at load). Other methods
// are errors naming the field, since their tensors would be misread as plain weights.
std::string parse_quantization(const Fields& outer, const std::string& origin) {
  const json* block = outer.object("quantization_config");
  if (!block) return "";
  const Fields q(*block, nullptr, origin, "quantization_config.");
  const std::string method = q.string("quant_method", "");
  if (method == "modelopt") {
    const std::string algo = q.string("quant_algo", "");
    if (algo != "NVFP4")
      field_error(origin, "quantization_config.quant_algo", "\"NVFP4\" (the ModelOpt format msa reads)",
                  "\"" + algo + "\"");
    if (const std::optional<int64_t> group = q.integer("group_size", 1, kMaxDim); group && *group != 16)
      field_error(origin, "quantization_config.group_size", "16 (NVFP4)", std::to_string(*group));
    return "nvfp4";
  }
  if (method == "fp8") return "mxfp8";
  field_error(origin, "quantization_config.quant_method",
              "\"modelopt\" (NVFP4) or \"fp8\" (MXFP8), or no quantization_config", "\"" + method + "\"");
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
  auto in_range = [](const char* field, int64_t value, int64_t min, int64_t max) {
    if (value < min || value > max) throw_arg_error(std::string("config.") + field, range_text(min, max), value);
  };
  auto positive = [&](const char* field, int64_t value) { in_range(field, value, 1, kMaxDim); };
  auto real = [](const char* field, double value, double min, double max, const char* why) {
    if (!(value > min && value <= max))  // false for NaN
      throw_arg_error(std::string("config.") + field, why, value);
  };
  in_range("vocab_size", vocab_size, 1, INT32_MAX);
  positive("hidden_size", hidden_size);
  in_range("num_hidden_layers", num_layers, 1, kMaxCount);
  in_range("num_attention_heads", num_heads, 1, kMaxCount);
  in_range("num_key_value_heads", num_kv_heads, 1, kMaxCount);
  positive("head_dim", head_dim);
  real("rope_theta", rope_theta, 1, 1e15, "a number in (1, 1e15]");
  real("rms_norm_eps", rms_norm_eps, 0, 0.1, "a number in (0, 0.1]");
  real("routed_scaling_factor", routed_scaling_factor, 0, 1e6, "a number in (0, 1e6]");
  real("swiglu_alpha", swiglu_alpha, 0, 1e6, "a number in (0, 1e6]");
  real("swiglu_limit", swiglu_limit, 0, 1e6, "a number in (0, 1e6]");
  in_range("shared_intermediate_size", shared_intermediate_size, 0, kMaxDim);
  if (bos_token_id < -1 || bos_token_id >= vocab_size)
    throw_arg_error("config.bos_token_id",
                    "-1 (none) or a token id in [0, vocab_size = " + std::to_string(vocab_size) + ")",
                    bos_token_id);
  for (size_t i = 0; i < eos_token_ids.size(); ++i)
    if (eos_token_ids[i] < 0 || eos_token_ids[i] >= vocab_size)
      throw_arg_error("config.eos_token_id[" + std::to_string(i) + "]",
                      "a token id in [0, vocab_size = " + std::to_string(vocab_size) + ")",
                      eos_token_ids[i]);
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
    in_range("num_local_experts", num_experts, 1, kMaxCount);
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
    in_range("index_block_size", block_size, 1, kMaxCount);
    if (rotary_dim > index_head_dim)
      throw_arg_error("config.index_head_dim",
                      "at least rotary_dim (" + std::to_string(rotary_dim) + ")", index_head_dim);
    validate_params(msa_params());
  } else {
    in_range("index_block_size", block_size, 1, kMaxCount);
  }
  if (vision) vision->validate();
}

ModelConfig parse_model_config(std::string_view json_text, const std::string& origin) {
  json root;
  try {
    root = parse_json_limited(json_text);
  } catch (const JsonParseError& error) {
    throw Error(origin + ": " + error.what());
  }
  if (!root.is_object()) throw Error(origin + ": expected a JSON object, got " + json_excerpt(root));
  const json empty = json::object();
  const Fields outer(root, nullptr, origin);
  const json* text_config = outer.object("text_config");
  const Fields f(text_config ? *text_config : empty, &root, origin);
  ModelConfig c;
  c.vocab_size = f.require_integer("vocab_size", 1, INT32_MAX);
  c.hidden_size = f.require_integer("hidden_size", 1, kMaxDim);
  c.num_layers = f.require_integer("num_hidden_layers", 1, kMaxCount);
  c.num_heads = f.require_integer("num_attention_heads", 1, kMaxCount);
  c.num_kv_heads = f.integer("num_key_value_heads", c.num_heads, 1, kMaxCount);
  if (const std::optional<int64_t> head_dim = f.integer("head_dim", 1, kMaxDim)) {
    c.head_dim = *head_dim;
  } else {
    if (c.hidden_size % c.num_heads != 0)
      field_error(origin, "head_dim",
                  "a value (hidden_size " + std::to_string(c.hidden_size) +
                      " is not a multiple of num_attention_heads " + std::to_string(c.num_heads) + ")",
                  "none");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  // Normalization epsilon: positive (0 divides by zero on a zero row) and small (a large one
  // flattens every activation).
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6, 0, 0.1, /*min_open=*/true);

  // RoPE: transformers reads rope_parameters (theta, partial_rotary_factor) and ignores
  // `rotary_dim`; the release also has rotary_dim. The factor wins when both are there
  // (docs/m3-notes.md: transformers' own configs carry a stale rotary_dim).
  const json* rope_parameters = f.object("rope_parameters");
  const json* rope_scaling = f.object("rope_scaling");
  if (rope_parameters && rope_scaling && *rope_parameters != *rope_scaling)
    throw Error(origin + ": fields 'rope_parameters' and 'rope_scaling' are one setting and "
                "disagree; give one");
  const json* rope = rope_parameters ? rope_parameters : rope_scaling;
  const std::string rope_name = rope_parameters ? "rope_parameters." : "rope_scaling.";
  const Fields r(rope ? *rope : empty, nullptr, origin, rope_name);
  for (const char* key : {"rope_type", "type"}) {
    if (const json* type = r.find(key); type && (!type->is_string() || type->get<std::string>() != "default"))
      field_error(origin, rope_name + key, "\"default\" (no RoPE scaling)", json_excerpt(*type));
  }
  const auto rope_number = [&](const std::string& name, double min, double max, bool min_open) {
    // Nested or flat (at the text or the outer level): one setting, so they must agree.
    const std::optional<double> nested = r.number(name, min, max, min_open);
    const std::optional<double> flat = f.number(name, min, max, min_open);
    if (nested && flat && *nested != *flat)
      throw Error(origin + ": fields '" + rope_name + name + "' and '" + name +
                  "' are one setting and disagree; give one, or the same value in both");
    return nested ? nested : flat;
  };
  // theta > 1: the frequencies theta^(-2i/d) must fall with i.
  c.rope_theta = rope_number("rope_theta", 1, 1e15, /*min_open=*/true).value_or(c.rope_theta);
  if (const std::optional<double> factor = rope_number("partial_rotary_factor", 0, 1, false)) {
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * *factor);
  } else if (const std::optional<int64_t> rotary = f.integer("rotary_dim", 0, kMaxDim)) {
    c.rotary_dim = *rotary;
  } else {
    c.rotary_dim = c.head_dim;
  }

  c.moe_intermediate_size = f.integer("intermediate_size", c.moe_intermediate_size, 1, kMaxDim);
  c.dense_intermediate_size =
      f.integer("dense_intermediate_size", c.dense_intermediate_size, 1, kMaxDim);
  c.shared_intermediate_size =
      f.integer("shared_intermediate_size", c.shared_intermediate_size, 0, kMaxDim);
  const int64_t shared_experts = f.integer("n_shared_experts", 1, 0, 1);
  if (shared_experts == 0) c.shared_intermediate_size = 0;
  c.num_experts = f.integer("num_local_experts", c.num_experts, 1, kMaxCount);
  c.experts_per_token = f.integer("num_experts_per_tok", c.experts_per_token, 1, kMaxCount);
  c.routed_scaling_factor =
      f.number("routed_scaling_factor", c.routed_scaling_factor, 0, 1e6, /*min_open=*/true);
  c.swiglu_alpha = f.number("swiglu_alpha", c.swiglu_alpha, 0, 1e6, /*min_open=*/true);
  // The clamp limit of gate and up: [-limit, limit] is empty or a point for limit <= 0.
  c.swiglu_limit = f.number("swiglu_limit", c.swiglu_limit, 0, 1e6, /*min_open=*/true);
  const std::string scoring = f.string("scoring_func", "sigmoid");
  if (scoring != "sigmoid") field_error(origin, "scoring_func", "\"sigmoid\"", "\"" + scoring + "\"");
  if (f.boolean("attention_output_gate", false))
    field_error(origin, "attention_output_gate", "false (no output gate in M3)", "true");
  if (!f.boolean("use_gemma_norm", true)) field_error(origin, "use_gemma_norm", "true", "false");
  const std::string qk_norm = f.string("qk_norm_type", "per_head");
  if (qk_norm != "per_head") field_error(origin, "qk_norm_type", "\"per_head\"", qk_norm);

  // Sparse attention: transformers' flat index_* fields and the release's
  // sparse_attention_config name the same settings; both may be present and must agree.
  const json* sparse = f.object("sparse_attention_config");
  const Fields s(sparse ? *sparse : empty, nullptr, origin, "sparse_attention_config.");
  c.index_heads = aliased_integer(f, "index_n_heads", s, "sparse_num_index_heads", c.num_kv_heads,
                                  1, kMaxCount);
  c.index_head_dim = aliased_integer(f, "index_head_dim", s, "sparse_index_dim", c.index_head_dim,
                                     1, kMaxDim);
  c.block_size = static_cast<int>(
      aliased_integer(f, "index_block_size", s, "sparse_block_size", c.block_size, 1, kMaxCount));
  c.topk_blocks = static_cast<int>(aliased_integer(f, "index_topk_blocks", s, "sparse_topk_blocks",
                                                   c.topk_blocks, 1, kMaxDim));
  c.local_blocks = static_cast<int>(aliased_integer(f, "index_local_blocks", s,
                                                    "sparse_local_block", c.local_blocks, 1, kMaxDim));
  c.init_blocks = static_cast<int>(s.integer("sparse_init_block", c.init_blocks, 0, kMaxDim));
  const std::string score_type = s.string("sparse_score_type", "max");
  if (score_type != "max")
    field_error(origin, "sparse_attention_config.sparse_score_type", "\"max\"", score_type);

  std::optional<std::vector<bool>> sparse_from_types, sparse_from_freq;
  if (const json* types = f.find("layer_types"))
    sparse_from_types = layer_flags(*types, "layer_types", "minimax_m3_sparse", "full_attention",
                                    origin);
  if (const json* freq = s.find("sparse_attention_freq")) {
    sparse_from_freq =
        layer_flags(*freq, "sparse_attention_config.sparse_attention_freq", "", "", origin);
    if (!s.boolean("use_sparse_attention", true)) sparse_from_freq->assign(sparse_from_freq->size(), false);
  }
  if (sparse_from_types && sparse_from_freq && *sparse_from_types != *sparse_from_freq)
    throw Error(origin + ": fields 'layer_types' and 'sparse_attention_config.sparse_attention_freq' "
                "(with use_sparse_attention) are one setting and disagree; give one, or the same "
                "layers in both");
  if (sparse_from_types) c.sparse_layers = *sparse_from_types;
  else if (sparse_from_freq) c.sparse_layers = *sparse_from_freq;
  else c.sparse_layers.assign(c.num_layers, false);

  std::optional<std::vector<bool>> moe_from_types, moe_from_freq;
  if (const json* types = f.find("mlp_layer_types"))
    moe_from_types = layer_flags(*types, "mlp_layer_types", "sparse", "dense", origin);
  if (const json* freq = f.find("moe_layer_freq"))
    moe_from_freq = layer_flags(*freq, "moe_layer_freq", "", "", origin);
  if (moe_from_types && moe_from_freq && *moe_from_types != *moe_from_freq)
    throw Error(origin + ": fields 'mlp_layer_types' and 'moe_layer_freq' are one setting and "
                "disagree; give one, or the same layers in both");
  if (moe_from_types) c.moe_layers = *moe_from_types;
  else if (moe_from_freq) c.moe_layers = *moe_from_freq;
  else c.moe_layers.assign(c.num_layers, true);  // transformers' default: every layer MoE

  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  const std::vector<int32_t> bos = token_ids(f, "bos_token_id", c.vocab_size);
  if (bos.size() > 1)
    field_error(origin, "bos_token_id", "one token id", std::to_string(bos.size()) + " ids");
  c.bos_token_id = bos.empty() ? -1 : bos.front();
  c.eos_token_ids = token_ids(f, "eos_token_id", c.vocab_size);
  c.dtype = f.string("dtype", f.string("torch_dtype", c.dtype));
  c.quantization = parse_quantization(outer, origin);
  c.vision = model::parse_vision_config(root, origin);
  c.validate();
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  const fs::path file =
      fs::is_directory(path, ignored) ? fs::path(path) / "config.json" : fs::path(path);
  return parse_model_config(
      read_text_file(file.string(), "model config '" + file.string() + "'", 16u << 20),
      file.string());
}

namespace {

// What a made NVFP4 checkpoint keeps unquantized (ModelOpt's exclude_modules patterns):
// everything but the routed experts, as NVIDIA's experts-only NVFP4 recipe does.
const std::vector<std::string> kNvfp4Excluded = {
    "language_model.lm_head", "language_model.model.embed_tokens", "*self_attn*",
    "*block_sparse_moe.gate", "*shared_experts*", "*.mlp.*", "vision_tower*",
    "multi_modal_projector*", "patch_merge_mlp*"};

// The partial_rotary_factor that gives back `rotary_dim` where it is read (transformers and
// parse_model_config both take int(head_dim * factor)): rotary_dim / head_dim itself can
// fall an ulp short (8 / 98 reads back as 7), so it is raised to the first double that does.
double partial_rotary_factor(int64_t rotary_dim, int64_t head_dim) {
  double factor = static_cast<double>(rotary_dim) / static_cast<double>(head_dim);
  while (static_cast<int64_t>(static_cast<double>(head_dim) * factor) < rotary_dim)
    factor = std::nextafter(factor, 2.0);
  return factor;
}

// ModelOpt's quantization block (also the body of its hf_quant_config.json).
json modelopt_nvfp4_block() {
  return {{"quant_method", "modelopt"},
          {"quant_algo", "NVFP4"},
          {"group_size", 16},
          {"kv_cache_quant_algo", nullptr},
          {"exclude_modules", kNvfp4Excluded}};
}

// Ours: transformers' fine-grained FP8 block with [1, 32] blocks and UE8M0 scales.
json mxfp8_block() {
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", {1, 32}},
          {"scale_fmt", "ue8m0"},
          {"modules_to_not_convert",
           {"language_model.lm_head", "language_model.model.embed_tokens", "block_sparse_moe.gate",
            "vision_tower", "multi_modal_projector", "patch_merge_mlp"}}};
}

}  // namespace

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
        {"partial_rotary_factor", partial_rotary_factor(c.rotary_dim, c.head_dim)}}},
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
  json root = {{"architectures", {"MiniMaxM3SparseForConditionalGeneration"}},
               {"model_type", "minimax_m3_vl"},
               {"tie_word_embeddings", c.tie_word_embeddings},
               {"dtype", c.dtype},
               {"text_config", text}};
  if (c.vision) model::write_vision_config(*c.vision, root);
  if (c.quantization == "nvfp4") root["quantization_config"] = modelopt_nvfp4_block();
  else if (c.quantization == "mxfp8") root["quantization_config"] = mxfp8_block();
  else if (!c.quantization.empty())
    throw_arg_error("quantization", "\"\", \"nvfp4\" or \"mxfp8\"", c.quantization);
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

ModelConfig first_layers(ModelConfig c, int64_t layers) {
  if (layers < 1 || layers > c.num_layers)
    throw_arg_error("layers", "1.." + std::to_string(c.num_layers) + " (the config's layers)", layers);
  c.num_layers = layers;
  c.sparse_layers.resize(static_cast<size_t>(layers));
  c.moe_layers.resize(static_cast<size_t>(layers));
  c.validate();
  return c;
}

std::vector<std::string> model_config_preset_names() {
  return {"tiny", "small", "m3-layer", "tiny-vl", "m3-vision", "tiny-tp", "tiny-tp-cuda", "m3-full"};
}

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
  } else if (name == "tiny-tp") {
    // tiny with M3's 4 KV / index heads (2 query heads per group) in 1 dense + 1 MSA/MoE
    // layer: splits over 1, 2, 4 and 8 ranks (docs/parallel.md; 8 replicates KV groups).
    c = model_config_preset("tiny");
    c.num_heads = 8;
    c.num_kv_heads = 4;
    c.index_heads = 4;
    c = with_layers(c, 2, 1);
  } else if (name == "tiny-tp-cuda") {
    // tiny-tp's heads and experts at the CUDA kernels' shapes (head dim and block 64), bf16:
    // the parallel CUDA model's test and check (1 dense + 2 MSA/MoE layers; selection past
    // 2 blocks of 64 tokens; splits over 1, 2, 4 and 8 ranks).
    c.vocab_size = 512;
    c.hidden_size = 256;
    c.num_heads = 8;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.rotary_dim = 32;
    c.dense_intermediate_size = 384;
    c.moe_intermediate_size = 128;
    c.shared_intermediate_size = 128;
    c.num_experts = 8;
    c.experts_per_token = 2;
    c.index_heads = 4;
    c.index_head_dim = 64;
    c.block_size = 64;
    c.topk_blocks = 2;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c.dtype = "bfloat16";
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
  } else if (name == "m3-layer" || name == "m3-vision") {
    // One dense and one MSA/MoE layer at M3's real width; 16 experts instead of 128 and a
    // 8192-token vocabulary keep it at ~1.5B parameters (3 GB bf16).
    c.vocab_size = 8192;
    c.num_experts = 16;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    c = with_layers(c, 2, 1);
    if (name == "m3-vision") {
      // M3's ViT and projector widths (1280, 16 heads of 80, MLP 5120, projector to 6144)
      // with 4 of its 32 layers (~0.3B parameters with the projector): the vision path's
      // per-layer cost at full width, for benchmarks. Placeholder ids inside the vocabulary.
      VisionConfig v;
      v.num_layers = 4;
      v.image_token_id = 8100;
      v.video_token_id = 8101;
      v.vision_start_token_id = 8102;
      v.vision_end_token_id = 8103;
      c.vision = v;
    }
  } else if (name == "tiny-vl") {
    // The tiny text model with a tiny vision tower of M3's structure: patch 14 (1176 values
    // per patch, as the media front end makes them), 2x2 merge, 4-frame video segments;
    // head dim 20 so that 3D RoPE rotates 18 channels and 2 pass through (78 + 2 on M3); a
    // projector width (48) different from both towers' widths so that a transposed weight
    // cannot pass. f32, a few seconds for a parity run.
    c = model_config_preset("tiny");
    VisionConfig v;
    v.hidden_size = 40;
    v.num_layers = 2;
    v.num_heads = 2;
    v.intermediate_size = 80;
    v.projector_hidden_size = 48;
    v.image_token_id = 500;
    v.video_token_id = 501;
    v.vision_start_token_id = 502;
    v.vision_end_token_id = 503;
    c.vision = v;
  } else if (name == "m3-full") {
    // MiniMax-M3 as released (docs/model.md "m3-full"): ModelConfig's defaults are the
    // release's config.json values (/work/shared/docs/m3-architecture.md §1: hidden 6144, 64 q
    // / 4 KV heads of 128, 4 index heads of 128, 128 experts of 3072 with top-4, a shared
    // expert of 3072, dense MLP 12288, vocab 200064, B = 128, k = 16), 60 layers of which
    // 0-2 are dense attention + dense MLP and 3-59 MSA + MoE (sparse_attention_freq and
    // moe_layer_freq [0,0,0,1 x 57]), and the vision tower (VisionConfig's defaults: 32
    // layers of 1280, projector 6144).
    c = with_layers(c, 60, 3);
    c.vision = VisionConfig{};
  } else {
    throw_arg_error("config", "one of tiny, small, m3-layer, tiny-vl, m3-vision, tiny-tp, tiny-tp-cuda, m3-full",
                    std::string(name));
  }
  c.validate();
  return c;
}

}  // namespace msa
