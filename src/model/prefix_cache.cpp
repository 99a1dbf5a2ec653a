// The block-chain table of prefix caching (prefix_cache.h says why it is exact).
#include "prefix_cache.h"

#include <algorithm>

#include "msa/error.h"

namespace msa {

PrefixCache::PrefixCache(int page_size) : page_size_(page_size) {
  MSA_CHECK_ARG(page_size >= 1, "page_size", "at least 1", page_size);
}

uint64_t PrefixCache::chain_key(uint64_t parent_key, std::span<const int32_t> block) {
  // splitmix64 steps over the parent's key and the block's tokens. Keys only find a
  // candidate: find() compares the tokens and the parent page, so a collision costs a miss.
  uint64_t h = parent_key ^ 0x9e3779b97f4a7c15ull;
  for (int32_t token : block) {
    h ^= static_cast<uint32_t>(token);
    h += 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

int32_t PrefixCache::find(uint64_t key, int32_t parent, std::span<const int32_t> block) const {
  const auto it = by_key_.find(key);
  if (it == by_key_.end()) return -1;
  const Node& node = nodes_.at(it->second);
  if (node.parent != parent || !std::equal(block.begin(), block.end(), node.tokens.begin(), node.tokens.end()))
    return -1;
  return it->second;
}

void PrefixCache::update_leaf(int32_t page, const Node& node) {
  const std::pair<uint64_t, int32_t> entry{node.last_use, page};
  if (node.refs == 0 && node.children == 0) free_leaves_.insert(entry);
  else free_leaves_.erase(entry);
}

void PrefixCache::add_ref(int32_t page, Node& node) {
  free_leaves_.erase({node.last_use, page});
  if (node.refs++ == 0) --unreferenced_;
  node.last_use = ++clock_;
  update_leaf(page, node);
}

void PrefixCache::drop_ref(int32_t page, Node& node) {
  if (node.refs <= 0) MSA_FAIL("prefix cache: page ", page, " released more often than taken");
  if (--node.refs == 0) ++unreferenced_;
  update_leaf(page, node);
}

std::vector<int32_t> PrefixCache::acquire(std::span<const int32_t> tokens, int64_t max_tokens) {
  std::vector<int32_t> pages;
  const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(tokens.size()), max_tokens) / page_size_;
  uint64_t key = 0;
  int32_t parent = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    const auto block = tokens.subspan(static_cast<size_t>(b * page_size_), static_cast<size_t>(page_size_));
    key = chain_key(key, block);
    const int32_t page = find(key, parent, block);
    if (page < 0) break;
    pages.push_back(page);
    parent = page;
  }
  for (int32_t page : pages) add_ref(page, nodes_.at(page));
  return pages;
}

void PrefixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages,
                         int64_t full_pages) {
  full_pages = std::min<int64_t>({full_pages, static_cast<int64_t>(pages.size()),
                                  static_cast<int64_t>(tokens.size()) / page_size_});
  uint64_t key = 0;
  int32_t parent = -1;
  for (int64_t b = 0; b < full_pages; ++b) {
    const auto block = tokens.subspan(static_cast<size_t>(b * page_size_), static_cast<size_t>(page_size_));
    const int32_t own = pages[static_cast<size_t>(b)];
    key = chain_key(key, block);
    const int32_t cached = find(key, parent, block);
    if (cached == own) {  // registered before (acquired, or an earlier insert)
      parent = own;
      continue;
    }
    // Another page holds this block (or its key is taken): this request's copy stays its
    // own, and so must everything after it (a held page's ancestors are held too).
    if (cached >= 0 || by_key_.count(key) || nodes_.count(own)) return;
    Node node;
    node.key = key;
    node.parent = parent;
    node.tokens.assign(block.begin(), block.end());
    node.refs = 1;  // the registering request's
    node.last_use = ++clock_;
    if (parent >= 0) {
      Node& up = nodes_.at(parent);
      ++up.children;
      update_leaf(parent, up);
    }
    by_key_.emplace(key, own);
    nodes_.emplace(own, std::move(node));
    parent = own;
  }
}

std::vector<int32_t> PrefixCache::release(std::span<const int32_t> pages) {
  std::vector<int32_t> unowned;
  for (int32_t page : pages) {
    const auto it = nodes_.find(page);
    if (it == nodes_.end()) unowned.push_back(page);
    else drop_ref(page, it->second);
  }
  return unowned;
}

std::vector<int32_t> PrefixCache::evict(int64_t count) {
  std::vector<int32_t> freed;
  while (static_cast<int64_t>(freed.size()) < count && !free_leaves_.empty()) {
    const int32_t page = free_leaves_.begin()->second;
    free_leaves_.erase(free_leaves_.begin());
    const auto it = nodes_.find(page);
    const int32_t parent = it->second.parent;
    by_key_.erase(it->second.key);
    nodes_.erase(it);
    --unreferenced_;
    freed.push_back(page);
    if (parent >= 0) {
      Node& up = nodes_.at(parent);
      --up.children;
      update_leaf(parent, up);
    }
  }
  return freed;
}

}  // namespace msa
