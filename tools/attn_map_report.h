// The JSON document of `msa attn-map` (docs/attention-maps.md): the prompt and grid metadata
// and, per layer, its kind, shares and heatmap grid.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "msa/attention_map.h"

namespace msa::cli {

// What the report says about where the numbers came from, besides the map itself.
struct AttentionMapSource {
  std::string model_dir;
  std::string prompt;                    // the --prompt text ("" for --tokens)
  std::vector<int32_t> tokens = {};      // the prompt's token ids
  std::vector<std::string> token_texts = {};  // each id decoded alone (empty without a tokenizer)
  std::string image = {};                // the overlay image's path ("" without one)
  int64_t image_width = 0, image_height = 0;
  int64_t block_size = 0, topk_blocks = 0;  // the model's MSA parameters
  std::vector<std::string> pngs = {};    // per map layer: its PNG's file name, "" when none
};

// The document as JSON text (2-space indent; invalid UTF-8 in token texts replaced).
std::string attention_map_json(const AttentionMap& map, const AttentionMapSource& source);

}  // namespace msa::cli
