// The vision part of config.json: vision_config (the release's CLIP-style fields or
// transformers' MiniMaxM3VLVisionConfig), the top-level VL fields, their validation, and
// writing them back.
#include <climits>
#include <cmath>

#include "model/config_fields.h"

namespace msa {

namespace {

// A string field that, when present, must hold the one value M3 defines (a different one
// describes a different model, which this runtime would silently run wrong).
void require_string(const model::Fields& f, const std::string& name, const std::string& value) {
  const std::string got = f.string(name, value);
  if (got != value) model::field_error(f.origin(), f.path(name), "\"" + value + "\"", "\"" + got + "\"");
}

// One number with two spellings (flat `rope_theta` and `rope_parameters.rope_theta`): they
// must agree when both are given.
std::optional<double> aliased_number(const model::Fields& a, const std::string& a_name,
                                     const model::Fields& b, const std::string& b_name,
                                     double min, double max) {
  const std::optional<double> x = a.number(a_name, min, max, /*min_open=*/true);
  const std::optional<double> y = b.number(b_name, min, max, /*min_open=*/true);
  if (x && y && *x != *y)
    throw Error(a.origin() + ": fields '" + a.path(a_name) + "' and '" + b.path(b_name) +
                "' are one setting and disagree; give one, or the same value in both");
  return x ? x : y;
}

}  // namespace

void VisionConfig::validate() const {
  using model::kMaxCount;
  using model::kMaxDim;
  const auto in_range = [](const char* field, int64_t value, int64_t min, int64_t max) {
    if (value < min || value > max)
      throw_arg_error(std::string("config.vision_config.") + field, model::range_text(min, max), value);
  };
  in_range("hidden_size", hidden_size, 1, kMaxDim);
  in_range("num_hidden_layers", num_layers, 1, kMaxCount);
  in_range("num_attention_heads", num_heads, 1, kMaxCount);
  in_range("intermediate_size", intermediate_size, 1, kMaxDim);
  in_range("num_channels", num_channels, 1, 64);
  in_range("patch_size", patch_size, 1, 1024);
  in_range("temporal_patch_size", temporal_patch_size, 1, 64);
  in_range("spatial_merge_size", spatial_merge_size, 1, 64);
  in_range("vision_segment_max_frames", segment_max_frames, 1, kMaxCount);
  in_range("projector_hidden_size", projector_hidden_size, 1, kMaxDim);
  if (hidden_size % num_heads != 0)
    throw_arg_error("config.vision_config.hidden_size",
                    "a multiple of num_attention_heads (" + std::to_string(num_heads) + ")",
                    hidden_size);
  if (patch_values() > kMaxDim)
    throw_arg_error("config.vision_config", "num_channels * temporal_patch_size * patch_size^2 <= " +
                                                std::to_string(kMaxDim),
                    patch_values());
  if (!(rope_theta > 1 && rope_theta <= 1e15))
    throw_arg_error("config.vision_config.rope_theta", "a number in (1, 1e15]", rope_theta);
  if (!(layer_norm_eps > 0 && layer_norm_eps <= 0.1))
    throw_arg_error("config.vision_config.layer_norm_eps", "a number in (0, 0.1]", layer_norm_eps);
  // Ids outside the vocabulary are legal (transformers' default 200025 with a small test
  // vocabulary): no prompt can then hold that placeholder, and placing rows says so.
  const std::pair<const char*, int32_t> ids[] = {{"image_token_index", image_token_id},
                                                 {"video_token_index", video_token_id},
                                                 {"vision_start_token_id", vision_start_token_id},
                                                 {"vision_end_token_id", vision_end_token_id}};
  for (const auto& [name, id] : ids)
    if (id < 0) throw_arg_error(std::string("config.") + name, "a token id >= 0", id);
  for (size_t i = 0; i < 4; ++i)
    for (size_t j = i + 1; j < 4; ++j)
      if (ids[i].second == ids[j].second)
        throw_arg_error(std::string("config.") + ids[j].first,
                        std::string("a token id other than ") + ids[i].first + "'s",
                        ids[j].second);
}

namespace model {

std::optional<VisionConfig> parse_vision_config(const json& root, const std::string& origin) {
  const Fields top(root, nullptr, origin);
  const json* vision_object = top.object("vision_config");
  if (!vision_object) return std::nullopt;
  const json empty = json::object();
  const Fields v(*vision_object, nullptr, origin, "vision_config.");
  VisionConfig c;
  c.hidden_size = v.integer("hidden_size", c.hidden_size, 1, kMaxDim);
  c.num_layers = v.integer("num_hidden_layers", c.num_layers, 1, kMaxCount);
  c.num_heads = v.integer("num_attention_heads", c.num_heads, 1, kMaxCount);
  c.intermediate_size = v.integer("intermediate_size", c.intermediate_size, 1, kMaxDim);
  c.num_channels = v.integer("num_channels", c.num_channels, 1, 64);
  c.patch_size = v.integer("patch_size", c.patch_size, 1, 1024);
  c.layer_norm_eps = v.number("layer_norm_eps", c.layer_norm_eps, 0, 0.1, /*min_open=*/true);
  // Exact-erf GELU in the ViT MLP; the projector's MLPs use the same.
  require_string(v, "hidden_act", "gelu");
  require_string(top, "projector_hidden_act", "gelu");
  // RoPE over (t, h, w): transformers' rope_parameters (type "axial") or the release's flat
  // rope_theta with position_embedding_type "rope" and rope_mode "3d".
  require_string(v, "position_embedding_type", "rope");
  require_string(v, "rope_mode", "3d");
  const json* rope = v.object("rope_parameters");
  const Fields r(rope ? *rope : empty, nullptr, origin, "vision_config.rope_parameters.");
  for (const char* key : {"rope_type", "type"})
    if (const json* type = r.find(key); type && (!type->is_string() || type->get<std::string>() != "axial"))
      field_error(origin, r.path(key), "\"axial\" (3D RoPE over t, h, w)", json_excerpt(*type));
  c.rope_theta = aliased_number(v, "rope_theta", r, "rope_theta", 1, 1e15).value_or(c.rope_theta);
  // Merge and temporal patch sizes: flat (transformers) or img_token_compression_config (the
  // release; it sits in vision_config and at the top level).
  const json* compression = v.object("img_token_compression_config");
  if (!compression) compression = top.object("img_token_compression_config");
  const Fields m(compression ? *compression : empty, nullptr, origin,
                 "img_token_compression_config.");
  require_string(m, "image_token_compression_method", "patch_merge");
  c.spatial_merge_size = aliased_integer(v, "spatial_merge_size", m, "spatial_merge_size",
                                         c.spatial_merge_size, 1, 64);
  c.temporal_patch_size = aliased_integer(v, "temporal_patch_size", m, "temporal_patch_size",
                                          c.temporal_patch_size, 1, 64);
  c.segment_max_frames = aliased_integer(v, "vision_segment_max_frames", top,
                                         "vision_segment_max_frames", c.segment_max_frames, 1,
                                         kMaxCount);

  // Projector and the features it reads: the last layer's full hidden state, with biases.
  c.projector_hidden_size = top.integer("projector_hidden_size", c.projector_hidden_size, 1, kMaxDim);
  if (!top.boolean("multimodal_projector_bias", true))
    field_error(origin, "multimodal_projector_bias", "true (M3's projector has biases)", "false");
  if (const std::optional<int64_t> layer = top.integer("vision_feature_layer", INT32_MIN, INT32_MAX);
      layer && *layer != -1)
    field_error(origin, "vision_feature_layer", "-1 (the last ViT layer's output)",
                std::to_string(*layer));
  require_string(top, "vision_feature_select_strategy", "full");

  // Token ids: the release's *_index, transformers' *_id attribute names.
  c.image_token_id = static_cast<int32_t>(aliased_integer(top, "image_token_index", top, "image_token_id",
                                                         c.image_token_id, 0, INT32_MAX));
  c.video_token_id = static_cast<int32_t>(aliased_integer(top, "video_token_index", top, "video_token_id",
                                                         c.video_token_id, 0, INT32_MAX));
  c.vision_start_token_id = static_cast<int32_t>(
      top.integer("vision_start_token_id", c.vision_start_token_id, 0, INT32_MAX));
  c.vision_end_token_id =
      static_cast<int32_t>(top.integer("vision_end_token_id", c.vision_end_token_id, 0, INT32_MAX));
  return c;
}

void write_vision_config(const VisionConfig& c, json& root) {
  const json compression = {{"image_token_compression_method", "patch_merge"},
                            {"spatial_merge_size", c.spatial_merge_size},
                            {"temporal_patch_size", c.temporal_patch_size}};
  root["vision_config"] = {
      {"model_type", "minimax_m3_vl_vision"},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"intermediate_size", c.intermediate_size},
      {"num_channels", c.num_channels},
      {"patch_size", c.patch_size},
      {"temporal_patch_size", c.temporal_patch_size},
      {"spatial_merge_size", c.spatial_merge_size},
      {"img_token_compression_config", compression},
      {"hidden_act", "gelu"},
      {"layer_norm_eps", c.layer_norm_eps},
      {"position_embedding_type", "rope"},
      {"rope_mode", "3d"},
      {"rope_theta", c.rope_theta},
      {"rope_parameters", {{"rope_type", "axial"}, {"rope_theta", c.rope_theta}}},
      {"vision_segment_max_frames", c.segment_max_frames},
  };
  root["img_token_compression_config"] = compression;
  root["projector_hidden_size"] = c.projector_hidden_size;
  root["projector_hidden_act"] = "gelu";
  root["multimodal_projector_bias"] = true;
  root["vision_feature_layer"] = -1;
  root["vision_feature_select_strategy"] = "full";
  root["image_token_index"] = c.image_token_id;
  root["video_token_index"] = c.video_token_id;
  root["vision_start_token_id"] = c.vision_start_token_id;
  root["vision_end_token_id"] = c.vision_end_token_id;
}

}  // namespace model
}  // namespace msa
