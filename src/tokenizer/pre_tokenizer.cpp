#include "tokenizer/pre_tokenizer.h"

#include <cstdint>
#include <cctype>

#include "core/json_parse.h"
#include "msa/error.h"

namespace msa::tok {
namespace {

// The GPT-2 split that ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A literal string as a PCRE2 pattern.
std::string escape_literal(const std::string& text) {
  std::string out;
  for (char c : text) {
    const auto u = uint8_t(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const Json& value, const std::string& field) {
  PreTokenizer pre;
  if (!value.is_null()) pre.add_steps(value, field);
  return pre;
}

void PreTokenizer::add_steps(const Json& value, const std::string& field) {
  const std::string type = type_of(value, field);
  if (type == "Sequence") {
    require_object(value, field, {"type", "pretokenizers"});
    if (!value.contains("pretokenizers") || !value["pretokenizers"].is_array())
      MSA_FAIL("tokenizer field '", field, ".pretokenizers': expected an array");
    for (size_t i = 0; i < value["pretokenizers"].size(); ++i)
      add_steps(value["pretokenizers"][i], field + ".pretokenizers[" + std::to_string(i) + "]");
  } else if (type == "Split") {
    require_object(value, field, {"type", "pattern", "behavior", "invert"});
    const Json& pattern = value.contains("pattern") ? value["pattern"] : Json();
    std::string regex;
    if (pattern.is_object() && pattern.size() == 1 && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      regex = pattern["Regex"].get<std::string>();
    } else if (pattern.is_object() && pattern.size() == 1 && pattern.contains("String") && pattern["String"].is_string()) {
      regex = escape_literal(pattern["String"].get<std::string>());
    } else {
      MSA_FAIL("tokenizer field '", field, ".pattern': expected {\"Regex\": str} or {\"String\": str}, got ",
               json_excerpt(pattern));
    }
    const std::string behavior = string_field(value, field, "behavior");
    Step step;
    if (behavior == "Isolated") {
      step.kind = Step::Kind::split_isolated;
    } else if (behavior == "Removed") {
      step.kind = Step::Kind::split_removed;
    } else {
      MSA_FAIL("tokenizer field '", field, ".behavior': '", behavior,
               "' not supported (supported: Isolated, Removed)");
    }
    step.invert = bool_field(value, field, "invert", false);
    step.regex = std::make_shared<Regex>(regex, field + ".pattern");
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    require_object(value, field, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
    Step step;
    step.kind = Step::Kind::byte_level;
    step.add_prefix_space = bool_field(value, field, "add_prefix_space", true);
    if (bool_field(value, field, "use_regex", true))
      step.regex = std::make_shared<Regex>(kGpt2Pattern, field + " (GPT-2 regex)");
    steps_.push_back(std::move(step));
    byte_level_ = true;
  } else {
    MSA_FAIL("tokenizer field '", field, ".type': pre-tokenizer '", type,
             "' not supported (supported: Split, ByteLevel, Sequence)");
  }
}

void PreTokenizer::apply(const Step& step, std::string_view word, std::vector<std::string>& out) {
  std::string prefixed;
  if (step.kind == Step::Kind::byte_level && step.add_prefix_space && !word.starts_with(' ')) {
    prefixed.reserve(word.size() + 1);
    prefixed += ' ';
    prefixed.append(word);
    word = prefixed;
  }
  if (!step.regex) {
    out.emplace_back(word);
    return;
  }
  // Pieces alternate between non-matches and matches; `invert` swaps their roles.
  const bool keep_matches = step.kind != Step::Kind::split_removed || step.invert;
  const bool keep_gaps = step.kind != Step::Kind::split_removed || !step.invert;
  size_t prev = 0;
  auto emit = [&](size_t begin, size_t end, bool keep) {
    if (keep && end > begin) out.emplace_back(word.substr(begin, end - begin));
  };
  for (const auto& [begin, end] : step.regex->find_all(word)) {
    emit(prev, begin, keep_gaps);
    emit(begin, end, keep_matches);
    prev = end;
  }
  emit(prev, word.size(), keep_gaps);
}

std::vector<std::string> PreTokenizer::split(std::string_view text) const {
  std::vector<std::string> words{std::string(text)};
  for (const Step& step : steps_) {
    std::vector<std::string> next;
    for (const std::string& word : words) apply(step, word, next);
    words = std::move(next);
  }
  return words;
}

}  // namespace msa::tok
