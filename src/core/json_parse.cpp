#include "core/json_parse.h"

#include <cmath>

namespace msa {
namespace {

// The parser callback sees each container as it opens, with the number of containers
// already open around it; throwing there stops the parse before anything deeper is built.
template <class Json>
Json parse_limited(std::string_view text, int max_depth) {
  const auto limit = [max_depth](int depth, typename Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start ||
         event == Json::parse_event_t::array_start) &&
        depth >= max_depth)
      throw JsonParseError("JSON nested deeper than " + std::to_string(max_depth) +
                           " levels of arrays and objects");
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), limit);
  } catch (const typename Json::exception& e) {
    throw JsonParseError(std::string("invalid JSON: ") + e.what());
  }
}

}  // namespace

nlohmann::json parse_json_limited(std::string_view text, int max_depth) {
  return parse_limited<nlohmann::json>(text, max_depth);
}

nlohmann::ordered_json parse_ordered_json_limited(std::string_view text, int max_depth) {
  return parse_limited<nlohmann::ordered_json>(text, max_depth);
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  // Invalid UTF-8 in a string is replaced rather than thrown about: this builds a message.
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > max_chars) text = text.substr(0, max_chars > 3 ? max_chars - 3 : 0) + "...";
  return std::string(value.type_name()) + " " + text;
}

std::optional<int64_t> json_integral(const nlohmann::json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double v = value.get<double>();
    // [-2^63, 2^63): the doubles that convert to int64 exactly when integral.
    if (!std::isfinite(v) || v != std::floor(v) || v < -9223372036854775808.0 ||
        v >= 9223372036854775808.0)
      return std::nullopt;
    return static_cast<int64_t>(v);
  }
  return std::nullopt;
}

std::optional<double> json_number(const nlohmann::json& value) {
  if (!value.is_number()) return std::nullopt;
  return value.get<double>();
}

}  // namespace msa
