// The post-processor of tokenizer.json, used when encoding with add_special_tokens:
// TemplateProcessing's "single" template (e.g. BOS + text), ByteLevel (no change to ids),
// or a Sequence of those.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/json_fields.h"

namespace msa::tok {

class PostProcessor {
 public:
  static PostProcessor from_json(const Json& value, const std::string& field);
  std::vector<int32_t> apply(std::vector<int32_t> ids) const;

 private:
  void add(const Json& value, const std::string& field);
  // One template: pieces that are either the input sequence or fixed special ids.
  struct Piece {
    bool is_sequence;
    std::vector<int32_t> ids;
  };
  std::vector<std::vector<Piece>> templates_;  // applied in order
};

}  // namespace msa::tok
