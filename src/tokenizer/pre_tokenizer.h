// The pre-tokenizer of tokenizer.json: a Split on a regex (behaviour Isolated or Removed),
// ByteLevel (optional GPT-2 regex split and prefix space), or a Sequence of those. It cuts
// a text segment into words; the BPE model then sees each word on its own.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/json_fields.h"
#include "tokenizer/regex.h"

namespace msa::tok {

class PreTokenizer {
 public:
  static PreTokenizer from_json(const Json& value, const std::string& field);

  // Words of `text`, as raw bytes (before the byte-level mapping).
  std::vector<std::string> split(std::string_view text) const;
  // Whether words are mapped to byte-level characters before BPE (a ByteLevel step).
  bool byte_level() const { return byte_level_; }

 private:
  struct Step {
    enum class Kind { split_isolated, split_removed, byte_level } kind;
    std::shared_ptr<const Regex> regex;  // null for ByteLevel without use_regex
    bool invert = false;
    bool add_prefix_space = false;
  };
  void add_steps(const Json& value, const std::string& field);
  static void apply(const Step& step, std::string_view word, std::vector<std::string>& out);

  std::vector<Step> steps_;
  bool byte_level_ = false;
};

}  // namespace msa::tok
