// Prefix caching over the paged KV cache: a page that holds a whole block of B prompt tokens
// (B = the page size = the MSA block size, 128 on M3) is kept after its request ends, keyed
// by its tokens and every token before it, and a later request whose prompt starts with the
// same chain of blocks uses those pages instead of computing them again (the next turn of a
// chat, a shared system prompt).
//
// Why whole pages, and why that is exact: a token's K/V (and index key) depends only on the
// tokens up to it, so a page is a pure function of its block chain; sharing whole pages never
// lets two requests write to one page, since a request only appends behind its cached prefix.
//
// Reference counts: every request that holds a cached page counts once. A request that holds
// a cached page also holds all of that page's ancestors (acquire() takes whole chains from the
// first block; insert() only extends a chain the request holds), so a page nobody holds has
// no held descendants and can be evicted, leaves first, least recently used first.
//
// Not thread-safe: the Engine owns it and calls it from its step loop.
#pragma once
#include <cstdint>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace msa {

class PrefixCache {
 public:
  explicit PrefixCache(int page_size);

  // The longest chain of cached pages that holds `tokens` from the first one on, at most
  // `max_tokens` tokens (whole pages only); takes a reference on each. Page ids in order.
  std::vector<int32_t> acquire(std::span<const int32_t> tokens, int64_t max_tokens);

  // Registers the first `full_pages` pages of a request that holds `pages` (pages[i] holds
  // tokens [i*B, (i+1)*B)); the request then holds a reference on each page registered. A
  // block already cached in another page ends the registration there (the request keeps
  // its own copy, which release() then frees).
  void insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, int64_t full_pages);

  // Drops the request's reference on each cached page of `pages`; returns the pages that
  // the cache does not hold, which the caller gives back to the KV cache's free list.
  std::vector<int32_t> release(std::span<const int32_t> pages);

  // Forgets up to `count` cached pages that no request holds (leaves first, least recently
  // used first) and returns them for the free list.
  std::vector<int32_t> evict(int64_t count);

  int64_t cached_pages() const { return static_cast<int64_t>(nodes_.size()); }
  // Cached pages no request holds: what evict() can free.
  int64_t evictable_pages() const { return unreferenced_; }
  bool holds(int32_t page) const { return nodes_.count(page) != 0; }

 private:
  struct Node {
    uint64_t key = 0;
    int32_t parent = -1;  // page of the previous block; -1 for a prompt's first block
    std::vector<int32_t> tokens;
    int64_t refs = 0;
    int64_t children = 0;
    uint64_t last_use = 0;
  };
  static uint64_t chain_key(uint64_t parent_key, std::span<const int32_t> block);
  // The cached page of `block` after `parent` (-1: first block), or -1.
  int32_t find(uint64_t key, int32_t parent, std::span<const int32_t> block) const;
  void add_ref(int32_t page, Node& node);
  void drop_ref(int32_t page, Node& node);
  void update_leaf(int32_t page, const Node& node);

  int page_size_;
  uint64_t clock_ = 0;
  int64_t unreferenced_ = 0;
  std::unordered_map<int32_t, Node> nodes_;             // by page
  std::unordered_map<uint64_t, int32_t> by_key_;        // chain key -> page
  std::set<std::pair<uint64_t, int32_t>> free_leaves_;  // (last_use, page) of evictable leaves
};

}  // namespace msa
