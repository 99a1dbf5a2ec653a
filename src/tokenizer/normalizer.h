// The normalizer of tokenizer.json: none, or Unicode NFC (alone or in a Sequence).
#pragma once
#include <string>
#include <string_view>

#include "tokenizer/json_fields.h"

namespace msa::tok {

class Normalizer {
 public:
  static Normalizer from_json(const Json& value, const std::string& field);
  bool is_identity() const { return !nfc_; }
  std::string apply(std::string_view text) const;

 private:
  bool nfc_ = false;
};

}  // namespace msa::tok
