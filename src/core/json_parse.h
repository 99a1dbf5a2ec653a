// The one way msa reads JSON (safetensors headers, model.safetensors.index.json,
// config.json, tokenizer.json, tokenizer_config.json, chat-template contexts): a parse that
// refuses containers nested deeper than a limit, and checked readers of numbers.
//
// Why a depth limit: nlohmann::json parses iteratively, but copying, comparing, dumping and
// walking a value recurse once per level, so a file nested 100,000 deep overflows the stack
// of whichever code touches it next (an error message that dumps it, a copy). Refusing
// such input at parse time bounds every later recursion. Real files nest a handful of
// levels (tokenizer.json: 6); chat messages with tool calls a few more.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "msa/error.h"

namespace msa {

inline constexpr int kMaxJsonDepth = 128;

// What parse_json_limited throws: not JSON, or nested too deep. what() says which, without
// naming the file (callers add that).
class JsonParseError : public Error {
 public:
  using Error::Error;
};

// Parses `text` (the whole of it) as JSON with at most `max_depth` levels of nested arrays
// and objects; throws JsonParseError otherwise.
nlohmann::json parse_json_limited(std::string_view text, int max_depth = kMaxJsonDepth);
nlohmann::ordered_json parse_ordered_json_limited(std::string_view text,
                                                  int max_depth = kMaxJsonDepth);

// "string \"abc\"", "array [1,2,...]": the type and the start of the text of `value`, for
// error messages (at most `max_chars` characters of text).
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 60);

// The integer `value` holds: a JSON integer, or a number with an integral value (64.0);
// nullopt for anything else (64.5, "64", true, an integer beyond int64).
std::optional<int64_t> json_integral(const nlohmann::json& value);
// The number `value` holds (integer or float; never a bool or a string), else nullopt.
std::optional<double> json_number(const nlohmann::json& value);

}  // namespace msa
