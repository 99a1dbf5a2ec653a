#include "attn_map_report.h"

#include <cmath>
#include <nlohmann/json.hpp>

namespace msa::cli {

std::string attention_map_json(const AttentionMap& map, const AttentionMapSource& source) {
  using nlohmann::json;
  const AttentionMapSpec& spec = map.spec;
  json doc;
  doc["model"] = source.model_dir;
  doc["prompt"] = source.prompt;
  doc["tokens"] = source.tokens;
  if (!source.token_texts.empty()) doc["token_texts"] = source.token_texts;
  doc["num_tokens"] = map.tokens;
  doc["span"] = {{"begin", spec.span_begin}, {"end", spec.span_end}};
  doc["grid"] = {{"rows", spec.grid_rows}, {"cols", spec.grid_cols}};
  doc["queries"] = {{"begin", spec.query_begin}, {"end", spec.query_end}};
  doc["heads"] = spec.heads;
  doc["block_size"] = source.block_size;
  doc["topk_blocks"] = source.topk_blocks;
  doc["uniform_visual_share"] = map.uniform_visual_share;
  doc["image"] = source.image.empty()
                     ? json(nullptr)
                     : json{{"path", source.image}, {"width", source.image_width}, {"height", source.image_height}};
  json layers = json::array();
  for (size_t i = 0; i < map.layers.size(); ++i) {
    const LayerAttentionMap& layer = map.layers[i];
    json heatmap = json::array();
    for (int64_t r = 0; r < spec.grid_rows; ++r)
      heatmap.push_back(std::vector<double>(layer.heatmap.begin() + r * spec.grid_cols,
                                            layer.heatmap.begin() + (r + 1) * spec.grid_cols));
    const auto number = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
    layers.push_back({{"layer", layer.layer},
                      {"kind", layer.sparse ? "msa" : "dense"},
                      {"visual_mass_share", number(layer.visual_mass_share)},
                      {"selected_visual_block_share",
                       layer.sparse ? number(layer.selected_visual_block_share) : json(nullptr)},
                      {"heatmap", std::move(heatmap)},
                      {"png", i < source.pngs.size() && !source.pngs[i].empty() ? json(source.pngs[i])
                                                                                 : json(nullptr)}});
  }
  doc["layers"] = std::move(layers);
  return doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace msa::cli
