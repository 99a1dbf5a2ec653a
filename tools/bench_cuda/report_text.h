// msa bench --device cuda: the text pieces every table and JSON writer shares (report.cpp,
// training_report.cpp): numbers and times as table cells, rates with their % of a ceiling,
// ratios, error cells, and one JSON line built key by key.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "bench_cuda/common.h"

namespace msa::cli::bench_cuda {

inline std::string num(double value, const char* format) {
  if (!std::isfinite(value)) return "-";
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

inline std::string time_cv(const Timing& t, double scale, const char* format) {
  if (!t.ok()) return "-";
  return num(t.ms * scale, format) + " (" + num(t.cv, "%.2f") + ")";
}

inline std::string rate(double work, const Timing& t, double unit, double peak) {  // "123 (45%)"
  if (!t.ok() || work <= 0) return "-";
  const double r = work / (t.ms * 1e-3) / unit;
  return num(r, "%.0f") + " (" + num(100.0 * r / peak, "%.0f") + "%)";
}

inline std::string ratio(const Timing& base, const Timing& t) {
  if (!base.ok() || !t.ok()) return "-";
  return num(base.ms / t.ms, "%.2f") + "x";
}

inline std::string error_text(double e) {
  if (e == -1) return "-";
  return std::isnan(e) ? "NaN" : num(e, "%.1e");
}

inline std::string json_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
    } else {
      out += ch;
    }
  }
  return out;
}

// GCC 12 at -O3 reports a bogus -Wrestrict inside std::operator+(const char*, std::string&&)
// once this class sits in its own translation unit (GCC bug 105651); the code is unchanged.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wrestrict"
#endif
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value) {
    return raw(key, std::isfinite(value) ? num(value, "%.6g") : "null");
  }
  JsonLine& add(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, int value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, const std::string& value) {
    return raw(key, "\"" + json_escape(value) + "\"");
  }
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, const Timing& t) {
    add(key + "_ms", t.ok() ? t.ms : NAN);
    add(key + "_cv", t.ok() ? t.cv : NAN);
    return add(key + "_runs", t.runs);
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  JsonLine& raw(const std::string& key, const std::string& value) {
    if (!body_.empty()) body_ += ",";
    body_ += "\"" + key + "\":" + value;
    return *this;
  }
  std::string body_;
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace msa::cli::bench_cuda
