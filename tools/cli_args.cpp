#include "cli_args.h"

#include <cstdint>
#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <new>

namespace msa::cli {

namespace {
[[noreturn]] void bad_value(const std::string& flag, const std::string& expected,
                            const std::string& got) {
  throw UsageError("--" + flag + ": expected " + expected + ", got \"" + got + "\"");
}

// Whether all of `text` (not empty) parses as a T into `out`.
template <class T>
bool parse_whole(const std::string& text, T& out) {
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, out);
  return error == std::errc() && stop == end && !text.empty();
}
}  // namespace

Args::Args(int argc, char** argv, std::set<std::string> switches, std::set<std::string> repeatable)
    : switches_(std::move(switches)) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      positional_.push_back(arg);
      continue;
    }
    std::string flag = arg.substr(2), value;
    const size_t equals = flag.find('=');
    if (equals != std::string::npos) {
      value = flag.substr(equals + 1);
      flag.resize(equals);
      if (switches_.count(flag)) throw UsageError("--" + flag + " takes no value");
    } else if (switches_.count(flag)) {
      value = "1";
    } else {
      if (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0)
        throw UsageError("--" + flag + ": expected a value after it, got none");
      value = argv[++i];
    }
    if (flag.empty()) throw UsageError("expected a flag name after \"--\", got \"" + arg + "\"");
    if (repeatable.count(flag)) repeated_[flag].push_back(value);
    if (!values_.emplace(flag, value).second && !repeatable.count(flag))
      throw UsageError("--" + flag + " given twice");
  }
}

bool Args::has(const std::string& flag) const { return values_.count(flag) != 0; }

const std::string* Args::value_of(const std::string& flag) {
  used_.insert(flag);
  const auto found = values_.find(flag);
  return found == values_.end() ? nullptr : &found->second;
}

std::vector<std::string> Args::get_strings(const std::string& flag) {
  used_.insert(flag);
  const auto found = repeated_.find(flag);
  return found == repeated_.end() ? std::vector<std::string>{} : found->second;
}

bool Args::get_switch(const std::string& flag) { return value_of(flag) != nullptr; }

std::string Args::get_string(const std::string& flag) {
  const std::string* value = value_of(flag);
  if (!value) throw UsageError("--" + flag + " is required");
  return *value;
}

std::string Args::get_string(const std::string& flag, const std::string& fallback) {
  const std::string* value = value_of(flag);
  return value ? *value : fallback;
}

namespace {
template <class T>
T parse_in_range(const std::string& flag, const std::string& text, T min, T max) {
  T out{};
  if (!parse_whole(text, out) || out < min || out > max)
    bad_value(flag, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]",
              text);
  return out;
}
}  // namespace

int Args::get_int(const std::string& flag, int fallback, int min, int max) {
  const std::string* value = value_of(flag);
  return value ? parse_in_range<int>(flag, *value, min, max) : fallback;
}

int64_t Args::get_int64(const std::string& flag, int64_t fallback, int64_t min, int64_t max) {
  const std::string* value = value_of(flag);
  return value ? parse_in_range<int64_t>(flag, *value, min, max) : fallback;
}

uint64_t Args::get_seed(const std::string& flag, uint64_t fallback) {
  const std::string* value = value_of(flag);
  return value ? parse_in_range<uint64_t>(flag, *value, 0, UINT64_MAX) : fallback;
}

double Args::get_double(const std::string& flag, double fallback, double min, double max,
                        bool min_open) {
  const std::string* value = value_of(flag);
  if (!value) return fallback;
  double out = 0;
  if (!parse_whole(*value, out) || !std::isfinite(out) || (min_open ? out <= min : out < min) ||
      out > max) {
    char range[96];
    std::snprintf(range, sizeof range, "a number in %c%g, %g]", min_open ? '(' : '[', min, max);
    bad_value(flag, range, *value);
  }
  return out;
}

int Args::get_threads(const std::string& flag) {
  const int cores = std::max(1, omp_get_num_procs());
  const std::string* value = value_of(flag);
  if (!value) return 0;
  int out = 0;
  if (!parse_whole(*value, out) || out < 0 || out > cores)
    bad_value(flag,
              "an integer in [0, " + std::to_string(cores) + "] (0: all " + std::to_string(cores) +
                  " cores of this machine; more threads than cores only slow the kernels down)",
              *value);
  return out;
}

void Args::finish() const {
  std::string unknown;
  for (const auto& entry : values_)
    if (!used_.count(entry.first)) unknown += (unknown.empty() ? "--" : ", --") + entry.first;
  if (!unknown.empty()) throw UsageError("unknown flag(s): " + unknown);
}

std::vector<int64_t> Args::get_positive_list(const std::string& flag, const std::string& fallback,
                                             int64_t max, bool allow_none) {
  const std::string text = get_string(flag, fallback);
  std::vector<int64_t> out;
  if (allow_none && (text == "none" || text.empty())) return out;
  const std::string expected = "comma-separated integers in [1, " + std::to_string(max) + "]" +
                               (allow_none ? " or none" : "");
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    int64_t value = 0;
    if (!parse_whole(item, value) || value < 1 || value > max) bad_value(flag, expected, text);
    out.push_back(value);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::optional<bool> parse_on_off(Args& args, const std::string& flag) {
  if (!args.has(flag)) return std::nullopt;
  const std::string text = args.get_string(flag);
  if (text == "on") return true;
  if (text == "off") return false;
  throw UsageError("--" + flag + ": expected on or off, got \"" + text + "\"");
}

std::vector<int32_t> parse_token_ids(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    try {
      size_t used = 0;
      const long value = std::stol(item, &used);
      if (used != item.size() || value < 0 || value > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(value));
    } catch (const std::exception&) {
      throw UsageError("--" + flag + ": expected comma-separated token ids, got \"" + item + "\"");
    }
    start = comma + 1;
  }
  return ids;
}

int run_reporting_errors(const char* name, const char* usage, const std::function<int()>& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "msa %s: %s\n%s", name, e.what(), usage);
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "msa %s: error: out of memory\n", name);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "msa %s: error: %s\n", name, e.what());
    return 2;
  }
}

}  // namespace msa::cli
