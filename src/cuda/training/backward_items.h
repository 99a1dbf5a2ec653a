// How the sparse backward cuts a query chunk's inverted selection into work items
// (attention_backward.cu), and the bounds its workspace regions and grids are sized by. Plain
// C++ (no CUDA) so that CPU tests check the bounds.
//
// A (group, sequence, block) segment holds the entries (query, selected block) that read one
// block. The first blocks of a sequence are read by nearly every query, so whole segments as
// items leave one CTA with several times an SM's share (8 x 16K in query chunks of 8K: block
// 0 of a sequence's first chunk is 131K rows against 64K per SM). Segments are cut into
// pieces of at most item_entries entries: at most 1 / kItemsPerLaunch of the launch's entries
// (about 1 / 8 of an SM's share on 132 SMs), and at least kItemMinRows rows (entries x G), so
// that a piece's K / V load and epilogue stay small against its row tiles. A split segment's
// pieces write their dK / dV to slots that add_split_grads_kernel sums in entry order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda/common/workspace_layout.h"  // ceil_div

namespace msa::cuda {

constexpr int64_t kItemsPerLaunch = 1024;
constexpr int64_t kItemMinRows = 1024;

inline int64_t item_min_entries(int64_t group) { return ceil_div(kItemMinRows, group); }

// The most entries of one item in a launch of `entries` entries (queries_per_item).
inline int64_t item_entries(int64_t entries, int64_t group) {
  return std::max(item_min_entries(group), ceil_div(std::max<int64_t>(entries, 1), kItemsPerLaunch));
}

// The bounds below hold for any cut of `entries` entries into segments, and are monotone in
// the entry count, so regions sized for the largest chunk hold a shorter last chunk's.
// With m = item_entries(entries): entries / m <= min(entries / item_min_entries, kItemsPerLaunch).
// - Split segments have more than m entries: fewer than entries / m of them.
inline int64_t split_segment_bound(int64_t entries, int64_t group) {
  return std::max<int64_t>(1, std::min(kItemsPerLaunch, entries / item_min_entries(group)));
}
// - A split segment of len entries has ceil(len / m) <= 2 len / m pieces.
inline int64_t split_slot_bound(int64_t entries, int64_t group) { return 2 * split_segment_bound(entries, group); }
// - Items: the sum over segments of ceil(len / m) <= entries / m + segments, where
//   `segments` bounds the chunk's segments (itself monotone in the entry count).
inline int64_t work_item_bound(int64_t entries, int64_t group, int64_t segments) {
  return std::min(ceil_div(entries, item_min_entries(group)), kItemsPerLaunch) + segments;
}

}  // namespace msa::cuda
