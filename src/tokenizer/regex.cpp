#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <cstdint>
#include <pcre2.h>

#include "msa/error.h"
#include "tokenizer/unicode_bytes.h"

namespace msa::tok {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {
std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

struct MatchData {
  pcre2_match_data* data;
  explicit MatchData(const pcre2_code* code)
      : data(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(data); }
};
// `tokenizers` runs its patterns with Oniguruma, whose Unicode \s is the White_Space
// property and \w is [\p{L}\p{M}\p{N}\p{Pc}]; PCRE2's UCP classes differ (its \s adds
// U+180E, its \w lacks marks). Rewrites those escapes into explicit properties.
std::string to_oniguruma_classes(const std::string& pattern, const std::string& field) {
  static const std::string word = "\\p{L}\\p{M}\\p{N}\\p{Pc}";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') out += "\\p{White_Space}";
      else if (e == 'S') out += "\\P{White_Space}";
      else if (e == 'w') out += in_class ? word : "[" + word + "]";
      else if (e == 'W' && !in_class) out += "[^" + word + "]";
      else if (e == 'W') MSA_FAIL("tokenizer field '", field, "': \\W inside [...] is not supported");
      else out += {c, e};
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a member, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& field) : pattern_(pattern) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  auto code = std::make_shared<Code>();
  const std::string translated = to_oniguruma_classes(pattern, field);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                             PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code->code == nullptr)
    MSA_FAIL("tokenizer field '", field, "': invalid regex at offset ", error_offset, ": ",
             pcre2_message(error_code), " in pattern ", pattern);
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);  // best effort; falls back to the interpreter
  code_ = std::move(code);
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  MatchData match(code_->code);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // The text was checked once by the caller; skip PCRE2's per-call UTF check.
    const int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK,
                               match.data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) MSA_FAIL("regex ", pattern_, ": match failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {
      // Empty match: record nothing, step over one character.
      if (begin >= text.size()) break;
      start = begin + size_t(utf8_length(uint8_t(text[begin])));
    }
  }
  return matches;
}

}  // namespace msa::tok
