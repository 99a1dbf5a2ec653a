// The added tokens of tokenizer.json ("added_tokens"): special tokens such as ]~!b[ and
// plain added tokens. They are cut out of the text before pre-tokenization: the leftmost
// match wins, the longest at that position, then the search resumes after it (the
// leftmost-longest Aho-Corasick scan of `tokenizers`).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/regex.h"

namespace msa::tok {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool single_word = false;  // only match where no word character touches either end
  bool lstrip = false;       // also take the whitespace on the left
  bool rstrip = false;       // also take the whitespace on the right
  bool normalized = true;    // matched in the normalized text (else in the raw text)
};

// A piece of text: either an added token (id set) or text still to tokenize.
struct Segment {
  size_t begin, end;
  std::optional<int32_t> id;
};

// One set of token strings matched together (raw or normalized ones).
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `patterns[i]` is the string searched for tokens[i].
  AddedTokenMatcher(std::vector<const AddedToken*> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  // Splits `text` into segments covering it in order.
  std::vector<Segment> split(std::string_view text) const;

 private:
  struct Node {
    std::unordered_map<unsigned char, int> next;
    int token = -1;  // index into tokens_ of the pattern ending here
  };
  // Length and token index of the longest pattern starting at `pos`.
  std::optional<std::pair<size_t, int>> longest_at(std::string_view text, size_t pos) const;

  std::vector<const AddedToken*> tokens_;
  std::vector<Node> trie_;
  std::shared_ptr<const Regex> word_char_, space_char_;
};

}  // namespace msa::tok
