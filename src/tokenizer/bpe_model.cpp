#include "tokenizer/bpe_model.h"

#include <cstdint>
#include <queue>

#include "msa/error.h"
#include "tokenizer/unicode_bytes.h"

namespace msa::tok {
namespace {
uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}
}  // namespace

BpeModel::BpeModel(BpeConfig config)
    : fuse_unk_(config.fuse_unk), ignore_merges_(config.ignore_merges) {
  token_to_id_.reserve(config.vocab.size());
  for (auto& [token, id] : config.vocab) {
    if (id < 0) MSA_FAIL("tokenizer field 'model.vocab': token '", token, "' has negative id ", id);
    if (const auto [it, inserted] = id_to_token_.emplace(id, token); !inserted)
      MSA_FAIL("tokenizer field 'model.vocab': tokens '", it->second, "' and '", token,
               "' share id ", id, " (each id must name one token)");
    max_id_ = std::max(max_id_, id);
    token_to_id_.emplace(std::move(token), id);
  }
  if (config.unk_token) {
    auto it = token_to_id_.find(*config.unk_token);
    if (it == token_to_id_.end())
      MSA_FAIL("tokenizer field 'model.unk_token': '", *config.unk_token, "' is not in model.vocab");
    unk_id_ = it->second;
  }
  merges_.reserve(config.merges.size());
  for (size_t rank = 0; rank < config.merges.size(); ++rank) {
    const auto& [left, right] = config.merges[rank];
    auto l = token_to_id_.find(left), r = token_to_id_.find(right);
    auto m = token_to_id_.find(left + right);
    if (l == token_to_id_.end() || r == token_to_id_.end() || m == token_to_id_.end())
      MSA_FAIL("tokenizer field 'model.merges': merge ", rank, " ('", left, "' '", right,
               "') uses a token missing from model.vocab");
    // A repeated pair keeps its last rank, as in `tokenizers` (a map built in order).
    merges_.insert_or_assign(pair_key(l->second, r->second), Merge{int32_t(rank), m->second});
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = token_to_id_.find(token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  auto it = id_to_token_.find(id);
  return it == id_to_token_.end() ? nullptr : &it->second;
}

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  // Symbols: one per character; a character missing from the vocabulary becomes the unk
  // token (consecutive ones fused when fuse_unk) or is dropped when there is none.
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (size_t pos = 0; pos < word.size();) {
    const size_t begin = pos;
    pos += size_t(utf8_length(uint8_t(word[pos])));
    auto id = token_to_id(word.substr(begin, pos - begin));
    if (!id) {
      if (!unk_id_) continue;
      if (fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_) continue;
      id = unk_id_;
    }
    const int index = int(symbols.size());
    symbols.push_back({*id, index - 1, index + 1, true});
  }
  if (symbols.empty()) return {};
  symbols.back().next = -1;

  // Candidate merges ordered by (rank, position); stale entries are skipped on pop.
  struct Candidate {
    int32_t rank;
    int left;
    int32_t left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push_pair = [&](int left) {
    if (left < 0) return;
    const int right = symbols[size_t(left)].next;
    if (right < 0) return;
    const int32_t l = symbols[size_t(left)].id, r = symbols[size_t(right)].id;
    if (const Merge* m = find_merge(l, r)) queue.push({m->rank, left, l, r});
  };
  for (int i = 0; i + 1 < int(symbols.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[size_t(c.left)];
    if (!left.alive || left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[size_t(left.next)];
    if (right.id != c.right_id) continue;
    left.id = find_merge(c.left_id, c.right_id)->result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[size_t(right.next)].prev = c.left;
    push_pair(left.prev);
    push_pair(c.left);
  }
  std::vector<int32_t> ids;
  for (int i = 0; i >= 0; i = symbols[size_t(i)].next) ids.push_back(symbols[size_t(i)].id);
  return ids;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  {
    std::lock_guard lock(cache_mutex_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard lock(cache_mutex_);
  if (cache_.size() >= kCacheCapacity) cache_.clear();
  cache_.emplace(std::string(word), std::move(ids));
}

}  // namespace msa::tok
