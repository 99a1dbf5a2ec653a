// The decoder of tokenizer.json: ByteLevel (token characters back to bytes; a token with a
// character outside the byte-level alphabet is taken as its own UTF-8 text), or none (the
// tokens joined by spaces, as `tokenizers` does without a decoder).
#pragma once
#include <string>
#include <vector>

#include "tokenizer/json_fields.h"

namespace msa::tok {

class Decoder {
 public:
  static Decoder from_json(const Json& value, const std::string& field);
  std::string decode(const std::vector<const std::string*>& tokens) const;

 private:
  bool byte_level_ = false;
};

}  // namespace msa::tok
