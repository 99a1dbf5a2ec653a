// How the sparse backward cuts its segments into work items (src/cuda/training/backward_items.h):
// plain C++, checked on the CPU. Every cut of a chunk's entries into segments fits the bounds
// the workspace regions and grids are sized by; the bounds are monotone in the entry count (a
// shorter last chunk fits the regions of the largest); M3's chunks split the blocks that every
// query reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/training/backward_items.h"

namespace msa::testing {
namespace {

using namespace msa::cuda;

struct Cut {
  int64_t items = 0, split_segments = 0, slots = 0, largest_item = 0;
};

// What make_work_items makes of these segment lengths with items of at most m entries.
Cut cut(const std::vector<int64_t>& segments, int64_t m) {
  Cut c;
  for (const int64_t len : segments) {
    const int64_t pieces = (len + m - 1) / m;
    c.items += pieces;
    c.largest_item = std::max(c.largest_item, std::min(len, m));
    if (pieces > 1) {
      ++c.split_segments;
      c.slots += pieces;
    }
  }
  return c;
}

// Segment lengths summing to `entries`: each of `length` (the last shorter), then the rest.
std::vector<int64_t> equal_segments(int64_t entries, int64_t length) {
  std::vector<int64_t> out;
  for (int64_t left = entries; left > 0; left -= length) out.push_back(std::min(left, length));
  return out;
}

std::vector<int64_t> random_segments(int64_t entries, std::mt19937_64& rng) {
  std::vector<int64_t> out;
  for (int64_t left = entries; left > 0;) {
    // Heavy-tailed: mostly short segments, a few of up to a third of the chunk.
    const int64_t cap = std::max<int64_t>(1, rng() % 4 == 0 ? entries / 3 : 200);
    const int64_t len = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng() % cap));
    out.push_back(len);
    left -= len;
  }
  return out;
}

TEST(BackwardItems, EveryCutFitsTheBounds) {
  std::mt19937_64 rng(20261204);
  for (const int64_t group : {1, 2, 3, 4, 8, 16})
    for (const int64_t entries : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{1000}, int64_t{65535},
                                  int64_t{65536}, int64_t{65600}, int64_t{524288}, int64_t{8388608}}) {
      const int64_t m = item_entries(entries, group);
      std::vector<std::vector<int64_t>> cuts = {{entries}, equal_segments(entries, 1), equal_segments(entries, m),
                                               equal_segments(entries, m + 1), equal_segments(entries, 2 * m + 1)};
      for (int r = 0; r < 4; ++r) cuts.push_back(random_segments(entries, rng));
      for (const std::vector<int64_t>& segments : cuts) {
        const Cut c = cut(segments, m);
        const int64_t n_segments = static_cast<int64_t>(segments.size());
        const std::string what = "G " + std::to_string(group) + ", " + std::to_string(entries) + " entries in " +
                                 std::to_string(n_segments) + " segments, m " + std::to_string(m);
        EXPECT_LE(c.items, work_item_bound(entries, group, n_segments)) << what;
        EXPECT_LE(c.split_segments, split_segment_bound(entries, group)) << what;
        EXPECT_LE(c.slots, split_slot_bound(entries, group)) << what;
        EXPECT_LE(c.largest_item, m) << what;
      }
      EXPECT_GE(m * group, std::min(kItemMinRows, entries * group)) << "pieces below the minimum rows";
      EXPECT_LE(m, std::max(item_min_entries(group), (entries + kItemsPerLaunch - 1) / kItemsPerLaunch));
    }
}

// A region sized for the largest chunk must hold a shorter chunk's items: e.g. at G 16 a chunk
// of 65,600 entries has m = 65 (at most ~1009 pieces beyond its segments) while one of 65,536
// has m = 64 (up to 1024). The bounds themselves must not fall as the entry count grows.
TEST(BackwardItems, BoundsAreMonotoneInTheEntryCount) {
  for (const int64_t group : {1, 3, 16}) {
    const int64_t knee = kItemsPerLaunch * item_min_entries(group);  // where m starts to grow
    std::vector<int64_t> counts;
    for (int64_t e = 1; e < 300; ++e) counts.push_back(e);
    for (int64_t e = knee - 300; e < knee + 3000; ++e) counts.push_back(e);
    for (int64_t e = 3 * knee - 50; e < 3 * knee + 50; ++e) counts.push_back(e);
    for (size_t i = 1; i < counts.size(); ++i) {
      const int64_t a = counts[i - 1], b = counts[i];
      const std::string what = "G " + std::to_string(group) + ": " + std::to_string(a) + " -> " + std::to_string(b);
      EXPECT_LE(work_item_bound(a, group, a), work_item_bound(b, group, b)) << what;
      EXPECT_LE(split_segment_bound(a, group), split_segment_bound(b, group)) << what;
      EXPECT_LE(split_slot_bound(a, group), split_slot_bound(b, group)) << what;
      // The worst cut of the shorter chunk (segments of m + 1, two pieces each, or of m) fits
      // the longer chunk's regions.
      const int64_t m = item_entries(a, group);
      for (const int64_t length : {m, m + 1}) {
        const Cut c = cut(equal_segments(a, length), m);
        EXPECT_LE(c.items, work_item_bound(b, group, b)) << what;
        EXPECT_LE(c.slots, split_slot_bound(b, group)) << what;
      }
    }
  }
}

// M3's deterministic chunks at 8 x 16K: 8K queries x 4 groups x 16 slots. Items of 512
// entries (8K rows at G 16); block 0, read by all 8K queries of a sequence's first chunk, runs
// as 16 pieces; a segment of 512 entries stays whole.
TEST(BackwardItems, M3ChunksSplitTheBlocksEveryQueryReads) {
  const int64_t group = 16, entries = int64_t{8192} * 4 * 16;
  const int64_t m = item_entries(entries, group);
  EXPECT_EQ(m, 512);
  EXPECT_EQ(cut({8192}, m).items, 16);
  EXPECT_EQ(cut({512}, m).split_segments, 0);
  EXPECT_EQ(item_min_entries(group), 64);
  EXPECT_EQ(split_slot_bound(entries, group), 2 * kItemsPerLaunch);  // 256 MB of B x D x 2 f32 slots
}

}  // namespace
}  // namespace msa::testing
