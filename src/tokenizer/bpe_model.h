// The BPE model of tokenizer.json: a vocabulary (token string -> id) and ranked merges.
// tokenize() splits a word (byte-level text) into its characters and applies merges
// lowest rank first (leftmost among equal ranks), as `tokenizers` does. Results are cached
// per word.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace msa::tok {

struct BpeConfig {
  std::vector<std::pair<std::string, int32_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool ignore_merges = false;  // a word that is itself in the vocabulary is one token
};

class BpeModel {
 public:
  // Merge parts or results missing from the vocabulary -> msa::Error.
  explicit BpeModel(BpeConfig config);

  // Appends the ids of `word` (non-empty byte-level text) to `out`.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr if unknown
  size_t size() const { return id_to_token_.size(); }
  int32_t max_id() const { return max_id_; }

  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  std::vector<int32_t> merge_word(std::string_view word) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  std::unordered_map<int32_t, std::string> id_to_token_;
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  int32_t max_id_ = -1;

  static constexpr size_t kCacheCapacity = 1 << 16;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>
      cache_;
};

}  // namespace msa::tok
