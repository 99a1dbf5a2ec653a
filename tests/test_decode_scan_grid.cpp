// The decode index scan's grid (src/cuda/decode/decode_scan_grid.h): plain C++, checked on the
// CPU. Every block of the longest request is in exactly one chunk, and the CTAs fill at most
// one wave of the resident slots whenever the work items alone fit in one.
#include <gtest/gtest.h>

#include "cuda/decode/decode_scan_grid.h"

namespace msa::testing {
namespace {

using cuda::decode_scan_grid;
using cuda::DecodeScanGrid;

constexpr int64_t kResident = 2 * 132;  // H200: 2 CTAs per SM

TEST(DecodeScanGrid, ChunksCoverEveryBlockOnce) {
  for (int64_t items : {1, 3, 5, 8, 33, 64, 200, 264, 265, 1000})
    for (int64_t blocks : {1, 2, 63, 64, 65, 1023, 1024, 1025, 8192}) {
      const DecodeScanGrid g = decode_scan_grid(items, blocks, kResident, 1);
      EXPECT_GE(g.chunks * g.chunk_blocks, blocks) << items << " items, " << blocks << " blocks";
      EXPECT_LT((g.chunks - 1) * g.chunk_blocks, blocks) << "an empty last chunk: " << items << ", " << blocks;
      EXPECT_GE(g.chunk_blocks, 1);
    }
}

TEST(DecodeScanGrid, OneWaveWheneverTheWorkItemsFit) {
  for (int64_t items = 1; items <= kResident; ++items)
    for (int64_t blocks : {64, 1024, 8192}) {
      const DecodeScanGrid g = decode_scan_grid(items, blocks, kResident, 1);
      EXPECT_LE(items * g.chunks, kResident) << items << " items, " << blocks << " blocks: a second wave";
    }
  // Batch 64, Q 1 (one row tile each), 128K: 4 chunks of 256 blocks, 256 CTAs (was 5 x 205 = 320).
  const DecodeScanGrid batch64 = decode_scan_grid(64, 1024, kResident, 1);
  EXPECT_EQ(batch64.chunks, 4);
  EXPECT_EQ(batch64.chunk_blocks, 256);
  // Batch 1 at 1M: the shortest chunks that one wave covers (8192 / 264 -> 32 blocks, 256
  // CTAs), and few-block contexts put every block in flight.
  EXPECT_EQ(decode_scan_grid(1, 8192, kResident, 1).chunk_blocks, 32);
  EXPECT_EQ(decode_scan_grid(1, 64, kResident, 1).chunks, 64);
  // More work items than slots: one chunk each.
  EXPECT_EQ(decode_scan_grid(1000, 1024, kResident, 1).chunks, 1);
}

TEST(DecodeScanGrid, MinimumChunkLength) {
  const DecodeScanGrid g = decode_scan_grid(1, 100, kResident, 8);
  EXPECT_GE(g.chunk_blocks, 8);
  EXPECT_EQ(g.chunks, 13);
}

}  // namespace
}  // namespace msa::testing
