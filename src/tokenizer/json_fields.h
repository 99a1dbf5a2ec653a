// Reading tokenizer.json objects strictly: every error names the field path
// ("pre_tokenizer.pretokenizers[0].behavior"), and keys this implementation does not know
// are errors rather than silently ignored behaviour.
#pragma once
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace msa::tok {

using Json = nlohmann::json;

// Fails unless `value` is an object whose keys are all in `known`.
void require_object(const Json& value, const std::string& field,
                    std::initializer_list<std::string_view> known);
// The object's "type" string.
std::string type_of(const Json& value, const std::string& field);
// `value[key]` as a bool / string; missing or null -> `fallback`.
bool bool_field(const Json& value, const std::string& field, const char* key, bool fallback);
std::string string_field(const Json& value, const std::string& field, const char* key);
// Fails unless `value[key]` is missing, null or equal to `allowed`.
void require_default(const Json& value, const std::string& field, const char* key,
                     const Json& allowed);

}  // namespace msa::tok
