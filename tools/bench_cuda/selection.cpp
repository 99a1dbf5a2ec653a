// msa bench --device cuda: checks the top-k selection rows and counts what they select.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench_cuda/common.h"
#include "cuda/attention/query_major_rule.h"

namespace msa::cli::bench_cuda {

// topk [heads, batch * q_len, k]: checks every row's structure (valid count min(k, L+1),
// own block L last, ids in [0, L] and distinct, -1 suffix) and counts what it selects.
SelectionCount count_selection(const std::vector<int32_t>& topk, int64_t heads, int64_t batch,
                               int64_t q_len, int64_t k_len, int64_t k, int64_t block,
                               int64_t head_dim) {
  SelectionCount out;
  const int64_t total_q = batch * q_len;
  const int64_t pages = (k_len + block - 1) / block;
  std::vector<uint32_t> seen(pages, 0), in_row(pages, 0);
  uint32_t stamp = 0, row_stamp = 0;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t r = 0; r < batch; ++r) {
      ++stamp;
      for (int64_t i = 0; i < q_len; ++i) {
        ++row_stamp;
        const int64_t pos = k_len - q_len + i, local = pos / block;
        const int32_t* row = topk.data() + (g * total_q + r * q_len + i) * k;
        int64_t valid = 0;
        while (valid < k && row[valid] >= 0) ++valid;
        bool bad = valid != std::min<int64_t>(k, local + 1);
        for (int64_t s = valid; s < k; ++s) bad |= row[s] != -1;
        if (valid > 0) bad |= row[valid - 1] != local;
        for (int64_t s = 0; s < valid; ++s) {
          const int64_t id = row[s];
          if (id > local) {
            bad = true;
            continue;
          }
          if (in_row[id] == row_stamp) bad = true;
          in_row[id] = row_stamp;
          out.keys += static_cast<double>(std::min(block, pos - id * block + 1));
          if (seen[id] != stamp) {
            seen[id] = stamp;
            out.kv_bytes += 4.0 * head_dim * std::min(block, k_len - id * block);
          }
        }
        out.malformed += bad;
      }
    }
  }
  return out;
}

double changed_row_fraction(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t k) {
  const int64_t rows = static_cast<int64_t>(std::min(a.size(), b.size())) / k;
  int64_t changed = 0;
  std::vector<int32_t> x, y;
  for (int64_t r = 0; r < rows; ++r) {
    x.clear();
    y.clear();
    for (int64_t s = 0; s < k; ++s) {
      if (a[r * k + s] >= 0) x.push_back(a[r * k + s]);
      if (b[r * k + s] >= 0) y.push_back(b[r * k + s]);
    }
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    changed += x != y;
  }
  return rows > 0 ? static_cast<double>(changed) / static_cast<double>(rows) : 0.0;
}

TileUnionCount count_tile_unions(const std::vector<int32_t>& topk, int64_t heads, int64_t n, int64_t k,
                                 int64_t group) {
  TileUnionCount out;
  const int64_t per_tile = cuda::kUnionTileRows / group;
  double unions = 0, entries = 0, tiles = 0, queries = 0, query_major = 0;
  std::vector<int32_t> blocks;
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t first = 0; first < n; first += per_tile) {
      blocks.clear();
      int64_t tile_entries = 0;
      for (int64_t q = first; q < std::min(n, first + per_tile); ++q, queries += 1) {
        const int32_t* row = topk.data() + (g * n + q) * k;
        for (int64_t s = 0; s < k && row[s] >= 0; ++s, ++tile_entries) blocks.push_back(row[s]);
      }
      std::sort(blocks.begin(), blocks.end());
      const int64_t distinct = std::unique(blocks.begin(), blocks.end()) - blocks.begin();
      unions += static_cast<double>(distinct);
      entries += static_cast<double>(tile_entries);
      tiles += 1;
      query_major += cuda::query_major_pays(distinct, tile_entries, static_cast<int>(group), cuda::kQueryMajorPairRatio);
    }
  // Per query: entries / queries valid blocks on average; per tile: unions / tiles.
  out.union_factor = entries > 0 ? (unions / tiles) / (entries / queries) : 0;
  out.query_major_tiles = tiles > 0 ? query_major / tiles : 0;
  return out;
}

}  // namespace msa::cli::bench_cuda
