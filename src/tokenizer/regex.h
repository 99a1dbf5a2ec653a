// A compiled PCRE2 regex (UTF + Unicode properties) for the pre-tokenizer patterns of
// `tokenizers` (\p{L}, \p{N}, (?i:...), lookahead such as \s+(?!\S)).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace msa::tok {

class Regex {
 public:
  // Invalid pattern -> msa::Error naming `field` and PCRE2's message.
  Regex(const std::string& pattern, const std::string& field);
  // Byte ranges [begin, end) of the successive non-overlapping matches in valid UTF-8
  // `text` (an empty match advances by one character, as find_iter does).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::string pattern_;
  std::shared_ptr<const Code> code_;
};

}  // namespace msa::tok
