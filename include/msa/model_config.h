// The MiniMax-M3 text model's configuration, read from a Hugging Face config.json.
//
// Both spellings are accepted: the released checkpoint's (`sparse_attention_config` with
// `sparse_*` fields, `moe_layer_freq`, top-level `rope_theta`/`partial_rotary_factor`) and
// transformers' (`layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`), at the
// top level or under `text_config`. See docs/model.md for the field table and
// docs/m3-notes.md for where transformers and the release differ.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "msa/ops.h"

namespace msa {

struct ModelConfig {
  int64_t vocab_size = 200064;
  int64_t hidden_size = 6144;
  int64_t num_layers = 60;
  int64_t num_heads = 64;
  int64_t num_kv_heads = 4;
  int64_t head_dim = 128;
  int64_t rotary_dim = 64;  // NeoX RoPE on channels [0, rotary_dim) of every head
  double rope_theta = 5e6;
  double rms_norm_eps = 1e-6;

  int64_t dense_intermediate_size = 12288;  // dense MLP layers
  int64_t moe_intermediate_size = 3072;     // each routed expert
  int64_t shared_intermediate_size = 3072;  // the shared expert (0: none)
  int64_t num_experts = 128;
  int64_t experts_per_token = 4;
  double routed_scaling_factor = 2.0;
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;

  std::vector<bool> sparse_layers;  // true: MSA (indexer + sparse attention); false: dense
  std::vector<bool> moe_layers;     // true: MoE; false: dense MLP

  int64_t index_heads = 4;  // one per KV group
  int64_t index_head_dim = 128;
  int block_size = 128;  // MSA block = KV page
  int topk_blocks = 16;
  int local_blocks = 1;
  int init_blocks = 0;

  bool tie_word_embeddings = false;
  int32_t bos_token_id = -1;  // -1: none
  std::vector<int32_t> eos_token_ids;

  // The weights' dtype the config declares ("bfloat16", "float32"; informative only).
  std::string dtype = "bfloat16";

  // MSA parameters of the sparse layers (scale 1/sqrt(head_dim)).
  MsaParams msa_params() const;
  bool any_sparse_layer() const;
  // Throws msa::Error naming the first inconsistent field.
  void validate() const;
};

// Reads `model_dir`/config.json (or the file itself when given a .json path).
ModelConfig load_model_config(const std::string& path);
// Parses a config.json text; `origin` names it in errors.
ModelConfig parse_model_config(std::string_view json_text, const std::string& origin);
// Writes the config as transformers' `minimax_m3_vl` config.json (text_config holds both
// the transformers fields and the released checkpoint's sparse_attention_config).
std::string model_config_to_json(const ModelConfig& config);

// Built-in M3-shaped configs for `msa make-model`: "tiny", "small", "m3-layer".
ModelConfig model_config_preset(std::string_view name);
std::vector<std::string> model_config_preset_names();

}  // namespace msa
