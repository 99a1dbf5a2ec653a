#include "tokenizer/decoder.h"

#include "msa/error.h"
#include "tokenizer/unicode_bytes.h"

namespace msa::tok {
namespace {

// The bytes a byte-level token stands for, or the token's own text when one of its
// characters is not in the byte-level alphabet.
void append_token_bytes(const std::string& token, std::string& out) {
  const size_t start = out.size();
  size_t pos = 0;
  while (pos < token.size()) {
    auto byte = char_to_byte(next_code_point(token, pos));
    if (!byte) {
      out.resize(start);
      out += token;
      return;
    }
    out += char(*byte);
  }
}

}  // namespace

Decoder Decoder::from_json(const Json& value, const std::string& field) {
  Decoder decoder;
  if (value.is_null()) return decoder;
  const std::string type = type_of(value, field);
  if (type != "ByteLevel")
    MSA_FAIL("tokenizer field '", field, ".type': decoder '", type,
             "' not supported (supported: null, ByteLevel)");
  require_object(value, field, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
  decoder.byte_level_ = true;
  return decoder;
}

std::string Decoder::decode(const std::vector<const std::string*>& tokens) const {
  std::string out;
  if (!byte_level_) {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + *tokens[i];
    return out;
  }
  for (const std::string* token : tokens) append_token_bytes(*token, out);
  return utf8_lossy(out);
}

}  // namespace msa::tok
