// Strict reading of config.json fields, shared by the text (config.cpp) and the vision
// (vision_config.cpp) parts: every value's type and range is checked, and an error names the
// file and the field.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>

#include "core/json_parse.h"
#include "msa/error.h"
#include "msa/model_config.h"

namespace msa::model {

using json = nlohmann::json;

[[noreturn]] inline void field_error(const std::string& origin, const std::string& field,
                                     const std::string& expected, const std::string& got) {
  throw Error(origin + ": field '" + field + "': expected " + expected + ", got " + got);
}

inline std::string range_text(int64_t min, int64_t max) {
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

// Fields of one JSON object read strictly: the type and the range of every value are
// checked (64.5 is not an integer, true is not a number, a string is not a list), and an
// error names the field as `prefix` + name. `outer` is where a field missing from `object`
// is looked up next (a text-only config.json has no text_config).
class Fields {
 public:
  Fields(const json& object, const json* outer, std::string origin, std::string prefix = "")
      : object_(object), outer_(outer), origin_(std::move(origin)), prefix_(std::move(prefix)) {}

  const json* find(const std::string& name) const {
    if (object_.is_object() && object_.contains(name) && !object_[name].is_null())
      return &object_[name];
    if (outer_ && outer_->is_object() && outer_->contains(name) && !(*outer_)[name].is_null())
      return &(*outer_)[name];
    return nullptr;
  }
  std::string path(const std::string& name) const { return prefix_ + name; }

  std::optional<int64_t> integer(const std::string& name, int64_t min, int64_t max) const {
    const json* value = find(name);
    if (!value) return std::nullopt;
    const std::optional<int64_t> got = json_integral(*value);
    if (!got || *got < min || *got > max)
      field_error(origin_, path(name), range_text(min, max), json_excerpt(*value));
    return got;
  }
  int64_t integer(const std::string& name, int64_t fallback, int64_t min, int64_t max) const {
    return integer(name, min, max).value_or(fallback);
  }
  int64_t require_integer(const std::string& name, int64_t min, int64_t max) const {
    if (!find(name)) throw Error(origin_ + ": missing required field '" + path(name) + "'");
    return *integer(name, min, max);
  }
  // A finite number in [min, max] (or (min, max] when min_open).
  std::optional<double> number(const std::string& name, double min, double max,
                               bool min_open) const {
    const json* value = find(name);
    if (!value) return std::nullopt;
    const std::optional<double> got = json_number(*value);
    if (!got || !std::isfinite(*got) || (min_open ? *got <= min : *got < min) || *got > max) {
      std::ostringstream expected;
      expected << "a number in " << (min_open ? "(" : "[") << min << ", " << max << "]";
      field_error(origin_, path(name), expected.str(), json_excerpt(*value));
    }
    return got;
  }
  double number(const std::string& name, double fallback, double min, double max,
                bool min_open) const {
    return number(name, min, max, min_open).value_or(fallback);
  }
  bool boolean(const std::string& name, bool fallback) const {
    const json* value = find(name);
    if (!value) return fallback;
    if (!value->is_boolean()) field_error(origin_, path(name), "true or false", json_excerpt(*value));
    return value->get<bool>();
  }
  std::string string(const std::string& name, const std::string& fallback) const {
    const json* value = find(name);
    if (!value) return fallback;
    if (!value->is_string()) field_error(origin_, path(name), "a string", json_excerpt(*value));
    return value->get<std::string>();
  }
  // A nested object (or nullptr when absent or null).
  const json* object(const std::string& name) const {
    const json* value = find(name);
    if (value && !value->is_object())
      field_error(origin_, path(name), "an object", json_excerpt(*value));
    return value;
  }
  const std::string& origin() const { return origin_; }

 private:
  const json& object_;
  const json* outer_;
  std::string origin_;
  std::string prefix_;
};

// One setting with two spellings (transformers' flat field and the release's nested one):
// either may be given; both must then agree, since silently preferring one would run a
// different model than the other describes.
inline int64_t aliased_integer(const Fields& a, const std::string& a_name, const Fields& b,
                               const std::string& b_name, int64_t fallback, int64_t min, int64_t max) {
  const std::optional<int64_t> x = a.integer(a_name, min, max);
  const std::optional<int64_t> y = b.integer(b_name, min, max);
  if (x && y && *x != *y)
    throw Error(a.origin() + ": fields '" + a.path(a_name) + "' (" + std::to_string(*x) +
                ") and '" + b.path(b_name) + "' (" + std::to_string(*y) +
                ") are one setting and disagree; give one, or the same value in both");
  return x ? *x : y ? *y : fallback;
}

// Dimensions are bounded so that products of a few of them (weight shapes, cache sizes)
// stay far from int64 overflow; the bounds are orders of magnitude above real models.
constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxCount = int64_t{1} << 16;  // layers, heads, experts

// The vision part of a config.json (vision_config.cpp): nullopt when `root` has no
// vision_config (a text-only model); the fields' spellings are listed in msa/model_config.h.
std::optional<VisionConfig> parse_vision_config(const json& root, const std::string& origin);
// Adds vision_config and the top-level VL fields to a config.json object, in both the
// release's and transformers' spellings.
void write_vision_config(const VisionConfig& vision, json& root);

}  // namespace msa::model
