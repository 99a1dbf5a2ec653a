#include "tokenizer/normalizer.h"

#include <cstdint>
#include <uninorm.h>

#include <cstdlib>
#include <memory>

#include "msa/error.h"

namespace msa::tok {

Normalizer Normalizer::from_json(const Json& value, const std::string& field) {
  Normalizer normalizer;
  if (value.is_null()) return normalizer;
  const std::string type = type_of(value, field);
  if (type == "NFC") {
    require_object(value, field, {"type"});
    normalizer.nfc_ = true;
  } else if (type == "Sequence") {
    require_object(value, field, {"type", "normalizers"});
    if (!value.contains("normalizers") || !value["normalizers"].is_array())
      MSA_FAIL("tokenizer field '", field, ".normalizers': expected an array");
    for (size_t i = 0; i < value["normalizers"].size(); ++i) {
      const auto sub = from_json(value["normalizers"][i], field + ".normalizers[" + std::to_string(i) + "]");
      normalizer.nfc_ = normalizer.nfc_ || sub.nfc_;
    }
  } else {
    MSA_FAIL("tokenizer field '", field, ".type': normalizer '", type,
             "' not supported (supported: null, NFC, Sequence of those)");
  }
  return normalizer;
}

std::string Normalizer::apply(std::string_view text) const {
  if (!nfc_ || text.empty()) return std::string(text);
  size_t length = 0;
  uint8_t* out = u8_normalize(UNINORM_NFC, reinterpret_cast<const uint8_t*>(text.data()),
                              text.size(), nullptr, &length);
  if (out == nullptr) MSA_FAIL("NFC normalization failed on ", text.size(), " bytes of text");
  std::unique_ptr<uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), length);
}

}  // namespace msa::tok
