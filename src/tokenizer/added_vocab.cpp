#include "tokenizer/added_vocab.h"

#include "tokenizer/unicode_bytes.h"
#include <cstdint>

namespace msa::tok {
namespace {

bool is_match_of_all(const Regex& re, std::string_view ch) {
  auto matches = re.find_all(ch);
  return !matches.empty() && matches[0].first == 0 && matches[0].second == ch.size();
}

std::string_view last_char(std::string_view text) {
  size_t pos = text.size();
  while (pos > 0 && (uint8_t(text[pos - 1]) & 0xC0) == 0x80) --pos;
  return text.substr(pos == 0 ? 0 : pos - 1);
}

std::string_view first_char(std::string_view text) {
  return text.substr(0, size_t(utf8_length(uint8_t(text[0]))));
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<const AddedToken*> tokens,
                                     std::vector<std::string> patterns)
    : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (patterns[i].empty()) continue;
    int node = 0;
    for (unsigned char c : patterns[i]) {
      auto it = trie_[size_t(node)].next.find(c);
      if (it == trie_[size_t(node)].next.end()) {
        trie_[size_t(node)].next[c] = int(trie_.size());
        node = int(trie_.size());
        trie_.emplace_back();
      } else {
        node = it->second;
      }
    }
    // Of equal patterns the first one wins, as in the Aho-Corasick automaton.
    if (trie_[size_t(node)].token < 0) trie_[size_t(node)].token = int(i);
  }
  word_char_ = std::make_shared<Regex>("\\w", "added_tokens (single_word)");
  space_char_ = std::make_shared<Regex>("\\s", "added_tokens (lstrip/rstrip)");
}

std::optional<std::pair<size_t, int>> AddedTokenMatcher::longest_at(std::string_view text,
                                                                    size_t pos) const {
  std::optional<std::pair<size_t, int>> best;
  int node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    auto it = trie_[size_t(node)].next.find(uint8_t(text[i]));
    if (it == trie_[size_t(node)].next.end()) break;
    node = it->second;
    if (trie_[size_t(node)].token >= 0) best = {{i + 1 - pos, trie_[size_t(node)].token}};
  }
  return best;
}

std::vector<Segment> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<Segment> segments;
  size_t done = 0;  // end of the last segment emitted
  size_t pos = 0;   // where the search resumes
  while (pos < text.size()) {
    auto match = empty() ? std::nullopt : longest_at(text, pos);
    if (!match) {
      pos += size_t(utf8_length(uint8_t(text[pos])));
      continue;
    }
    const AddedToken& token = *tokens_[size_t(match->second)];
    size_t begin = pos, end = pos + match->first;
    pos = end;
    if (token.single_word) {
      const bool word_before = begin > 0 && is_match_of_all(*word_char_, last_char(text.substr(0, begin)));
      const bool word_after = end < text.size() && is_match_of_all(*word_char_, first_char(text.substr(end)));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (begin > done) {
        std::string_view ch = last_char(text.substr(0, begin));
        if (!is_match_of_all(*space_char_, ch)) break;
        begin -= ch.size();
      }
    }
    if (token.rstrip) {
      while (end < text.size()) {
        std::string_view ch = first_char(text.substr(end));
        if (!is_match_of_all(*space_char_, ch)) break;
        end += ch.size();
      }
      pos = end;
    }
    if (begin > done) segments.push_back({done, begin, std::nullopt});
    segments.push_back({begin, end, token.id});
    done = end;
  }
  if (done < text.size()) segments.push_back({done, text.size(), std::nullopt});
  return segments;
}

}  // namespace msa::tok
