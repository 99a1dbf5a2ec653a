#include "tokenizer/json_fields.h"

#include "core/json_parse.h"
#include "msa/error.h"

namespace msa::tok {

void require_object(const Json& value, const std::string& field,
                    std::initializer_list<std::string_view> known) {
  if (!value.is_object())
    MSA_FAIL("tokenizer field '", field, "': expected an object, got ", value.type_name());
  for (const auto& [key, _] : value.items()) {
    bool ok = false;
    for (auto k : known) ok = ok || k == key;
    if (!ok) MSA_FAIL("tokenizer field '", field, ".", key, "': not supported");
  }
}

std::string type_of(const Json& value, const std::string& field) {
  if (!value.is_object() || !value.contains("type") || !value["type"].is_string())
    MSA_FAIL("tokenizer field '", field, ".type': expected a string");
  return value["type"].get<std::string>();
}

bool bool_field(const Json& value, const std::string& field, const char* key, bool fallback) {
  if (!value.contains(key) || value[key].is_null()) return fallback;
  if (!value[key].is_boolean())
    MSA_FAIL("tokenizer field '", field, ".", key, "': expected a bool, got ", json_excerpt(value[key]));
  return value[key].get<bool>();
}

std::string string_field(const Json& value, const std::string& field, const char* key) {
  if (!value.contains(key) || !value[key].is_string())
    MSA_FAIL("tokenizer field '", field, ".", key, "': expected a string");
  return value[key].get<std::string>();
}

void require_default(const Json& value, const std::string& field, const char* key,
                     const Json& allowed) {
  if (!value.contains(key) || value[key].is_null() || value[key] == allowed) return;
  MSA_FAIL("tokenizer field '", field, ".", key, "': not supported: ", json_excerpt(value[key]),
           " (supported: null or ", json_excerpt(allowed), ")");
}

}  // namespace msa::tok
