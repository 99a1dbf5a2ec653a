// The MiniMax-M3 text model's configuration, read from a Hugging Face config.json.
//
// Both spellings are accepted: the released checkpoint's (`sparse_attention_config` with
// `sparse_*` fields, `moe_layer_freq`, top-level `rope_theta`/`partial_rotary_factor`) and
// transformers' (`layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`), at the
// top level or under `text_config`. See docs/model.md for the field table and
// docs/m3-notes.md for where transformers and the release differ.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "msa/ops.h"

namespace msa {

// The vision tower, its projector and the multimodal token ids (docs/vision.md "Vision
// tower"): the released config.json's `vision_config` (CLIP-style fields,
// `img_token_compression_config`, `vision_segment_max_frames`) and top-level VL fields
// (`image_token_index`, `projector_hidden_size`, ...), or transformers' `minimax_m3_vl`
// spellings (`vision_config.rope_parameters`, `spatial_merge_size`, `image_token_id`, ...).
// Defaults are MiniMax-M3's values.
struct VisionConfig {
  int64_t hidden_size = 1280;
  int64_t num_layers = 32;
  int64_t num_heads = 16;  // head_dim = hidden_size / num_heads (80)
  int64_t intermediate_size = 5120;
  int64_t num_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;  // one text token per merge x merge window of patches
  double rope_theta = 1e4;         // 3D RoPE base
  double layer_norm_eps = 1e-5;
  // A video grid of more temporal patches is split into consecutive attention segments of at
  // most this many (each with its own 3D RoPE time axis from 0); an image is one segment.
  int64_t segment_max_frames = 4;
  int64_t projector_hidden_size = 6144;  // the projector MLPs' inner width

  // Placeholder tokens whose embeddings the visual rows replace, and the image brackets.
  int32_t image_token_id = 200025;        // ]<]image[>[
  int32_t video_token_id = 200026;        // ]<]video[>[
  int32_t vision_start_token_id = 200029; // ]<]start of image[>[
  int32_t vision_end_token_id = 200030;   // ]<]end of image[>[

  int64_t head_dim() const { return hidden_size / num_heads; }
  // Values of one patch in pixel_values: [C][T][P][P] (1176 on M3).
  int64_t patch_values() const {
    return num_channels * temporal_patch_size * patch_size * patch_size;
  }
  int64_t merge_window() const { return spatial_merge_size * spatial_merge_size; }
  // 3D RoPE frequencies per axis (t, h, w): (head_dim / 3) / 2 (13 for head dim 80); channels
  // [0, 6 * that) rotate, the rest pass through.
  int64_t rope_frequencies_per_axis() const { return head_dim() / 3 / 2; }
  // Throws msa::Error naming the first inconsistent field. The four token ids must be
  // distinct; one outside the vocabulary (transformers writes 200025 / 200026 whatever the
  // vocabulary) only means that no prompt can hold it.
  void validate() const;
};

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
  // The config.json's `quantization_config`: "" (none), "nvfp4" (ModelOpt: quant_method
  // "modelopt", quant_algo "NVFP4", group_size 16) or "mxfp8" (quant_method "fp8" with
  // UE8M0 scales per 32 input channels). Informative for the loader, which reads each
  // matrix's format from its tensors; make-model writes the block from it.
  std::string quantization;

  // The vision tower and projector; absent for a text-only config.json (no vision_config).
  std::optional<VisionConfig> vision;

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

// Built-in M3-shaped configs for `msa make-model`: "tiny", "small", "m3-layer" (text only),
// "tiny-vl" (tiny text + a tiny vision tower), "m3-vision" (M3's real ViT and projector
// widths with a few ViT layers, and the m3-layer text part), "tiny-tp" and "m3-full"
// (MiniMax-M3 as released: every width and count, its 60-layer dense/MSA/MoE pattern and
// its vision tower; cut it with first_layers).
ModelConfig model_config_preset(std::string_view name);
std::vector<std::string> model_config_preset_names();

// The config with only its first `layers` decoder layers (1 <= layers <= num_layers; the
// dense/MSA and dense/MoE pattern of those layers kept). An msa::Error naming `layers`
// otherwise.
ModelConfig first_layers(ModelConfig config, int64_t layers);

}  // namespace msa
