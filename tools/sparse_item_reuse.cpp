// How often the sparse forward's work items could share data on chip or in L2, measured on
// real selection rows: the CPU indexer on random inputs (one sequence of N tokens, M3 shape:
// 4 KV groups, k = 16, B = 128, Di = 128). Answers the questions of the wgmma kernel's
// "Traffic and floors" note (src/cuda/attention/attention_sparse_wgmma.cuh):
//   - local: entries that are the query's own block (always selected);
//   - previous item: entries whose (query, group) also has an entry in the item the same CTA
//     ran just before (the partials an on-chip merge across a CTA's consecutive items saves);
//   - same CTA: entries whose (query, group) the same CTA saw in any earlier item (the bound
//     of "write a query's partial once per CTA");
//   - Q / K-V in the wave: entries whose (query, group) Q rows, or items whose block, were read
//     by one of the `grid` items before it in the item order (these are in flight together or
//     just before: L2 hits rather than HBM reads);
//   - union: blocks selected by any query of a 128-query tile (one query block) of one group,
//     against k: what a query-major kernel over a query block's selected blocks would load.
// coherence c > 0 makes the index queries of one 128-token block near copies of one another
// (qi = block base + c-scaled per-token noise, i.e. smaller c = more coherent; 0: independent
// random queries), a stand-in for real-model selections, where neighbouring queries pick
// mostly the same blocks.
// The items are built as make_work_items does (sorted keys, (group, block) segments cut into
// items of 1024 / G queries) in sorted order (the atomic append follows it roughly) and go to
// CTAs as the persistent kernel strides them: CTA c runs items c, c + grid, ...
// Usage: msa_sparse_item_reuse [N=16384] [grid=132] [chunk_q=N] [coherence=0] [impl=cpu]
// (impl cuda: the CUDA indexer, for N >= 64K on a machine with a GPU).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "msa/ops.h"
#include "random_inputs.h"

namespace {

struct Item {
  int64_t g, block;
  std::vector<int64_t> queries;  // chunk-local query rows, ascending
};

uint64_t pair_key(int64_t g, int64_t q) { return (static_cast<uint64_t>(g) << 40) | static_cast<uint64_t>(q); }

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t grid = argc > 2 ? std::atoll(argv[2]) : 132;
  const int64_t chunk_q = argc > 3 ? std::atoll(argv[3]) : n;
  const double coherence = argc > 4 ? std::atof(argv[4]) : 0.0;
  const msa::Impl impl = argc > 5 ? msa::impl_from_name(argv[5]) : msa::Impl::cpu;
  constexpr int64_t kGroups = 4, kDi = 128, kGroup = 16, kQueriesPerItem = 1024 / kGroup;
  msa::MsaParams params;  // k = 16, B = 128, one local block
  const int64_t slots = params.topk;

  msa::Tensor qi = msa::cli::random_normal_tensor({n, kGroups, kDi}, 1);
  if (coherence > 0) {  // one base per 128-token block plus coherence x the token's own noise
    float* x = qi.data<float>();
    const int64_t row = kGroups * kDi;
    for (int64_t t = 0; t < n; ++t)
      if (t % 128 != 0)
        for (int64_t i = 0; i < row; ++i)
          x[t * row + i] = x[(t - t % 128) * row + i] + static_cast<float>(coherence) * x[t * row + i];
  }
  const msa::Tensor ki = msa::cli::random_normal_tensor({n, kDi}, 2);
  const msa::Tensor cu = msa::Tensor::from_vector(std::vector<int32_t>{0, static_cast<int32_t>(n)}, {2});
  std::fprintf(stderr, "%s indexer, N = %lld ...\n", std::string(msa::impl_name(impl)).c_str(),
               static_cast<long long>(n));
  const msa::IndexerOutput index = msa::indexer(qi, ki, cu, cu, params, impl);
  const int32_t* topk = index.topk.data<int32_t>();  // [groups, n, slots]

  // Union of the selected blocks per (group, tile of `queries` consecutive queries), against
  // the mean valid count: the FLOP factor of a query-major kernel over such tiles.
  const auto mean_union = [&](int64_t queries) {
    double union_sum = 0, valid_sum = 0;
    for (int64_t g = 0; g < kGroups; ++g)
      for (int64_t t0 = 0; t0 < n; t0 += queries) {
        std::unordered_set<int32_t> blocks;
        const int64_t t1 = std::min(n, t0 + queries);
        for (int64_t q = t0; q < t1; ++q)
          for (int64_t s = 0; s < slots; ++s)
            if (topk[(g * n + q) * slots + s] >= 0) {
              blocks.insert(topk[(g * n + q) * slots + s]);
              valid_sum += 1.0 / static_cast<double>(t1 - t0);
            }
        union_sum += static_cast<double>(blocks.size());
      }
    return std::pair{union_sum / valid_sum, union_sum / (kGroups * ((n + queries - 1) / queries))};
  };

  int64_t entries = 0, local = 0, prev_item = 0, same_cta = 0, q_in_wave = 0, items_total = 0,
          kv_in_wave = 0;
  for (int64_t q0 = 0; q0 < n; q0 += chunk_q) {
    const int64_t q1 = std::min(n, q0 + chunk_q);
    // Segments: (group, block) -> queries in ascending order (the sorted keys' order).
    std::vector<Item> items;
    for (int64_t g = 0; g < kGroups; ++g) {
      std::vector<std::vector<int64_t>> by_block;
      for (int64_t q = q0; q < q1; ++q) {
        const int32_t* row = topk + (g * n + q) * slots;
        int valid = 0;
        while (valid < slots && row[valid] >= 0) ++valid;
        for (int s = 0; s < valid; ++s) {
          if (static_cast<size_t>(row[s]) >= by_block.size()) by_block.resize(row[s] + 1);
          by_block[row[s]].push_back(q);
          ++entries;
          if (s == valid - 1) ++local;  // the query's own block is the last valid slot
        }
      }
      for (int64_t b = 0; b < static_cast<int64_t>(by_block.size()); ++b)
        for (size_t c = 0; c < by_block[b].size(); c += kQueriesPerItem)
          items.push_back({g, b,
                           std::vector<int64_t>(by_block[b].begin() + c,
                                                by_block[b].begin() + std::min(by_block[b].size(), c + kQueriesPerItem))});
    }
    items_total += static_cast<int64_t>(items.size());
    // Per CTA: the previous item's pairs and every pair seen.
    for (int64_t cta = 0; cta < grid; ++cta) {
      std::unordered_set<uint64_t> seen, previous;
      for (size_t it = cta; it < items.size(); it += grid) {
        std::unordered_set<uint64_t> current;
        for (int64_t q : items[it].queries) {
          const uint64_t key = pair_key(items[it].g, q);
          prev_item += previous.count(key);
          same_cta += seen.count(key);
          current.insert(key);
        }
        seen.insert(current.begin(), current.end());
        previous.swap(current);
      }
    }
    // The wave: the `grid` items before each item in the item order (pair -> last item index).
    std::unordered_map<uint64_t, int64_t> last_q;
    std::unordered_map<uint64_t, int64_t> last_block;
    for (int64_t it = 0; it < static_cast<int64_t>(items.size()); ++it) {
      const uint64_t block_key = pair_key(items[it].g, items[it].block);
      auto b = last_block.find(block_key);
      if (b != last_block.end() && it - b->second <= grid) ++kv_in_wave;
      last_block[block_key] = it;
      for (int64_t q : items[it].queries) {
        const uint64_t key = pair_key(items[it].g, q);
        auto f = last_q.find(key);
        if (f != last_q.end() && it - f->second <= grid) ++q_in_wave;
        last_q[key] = it;
      }
    }
  }
  const double e = static_cast<double>(entries);
  std::printf("N %lld, grid %lld, chunk_q %lld: %lld entries (query, group, block), %lld items\n",
              static_cast<long long>(n), static_cast<long long>(grid), static_cast<long long>(chunk_q),
              static_cast<long long>(entries), static_cast<long long>(items_total));
  for (const int64_t queries : {4, 128}) {
    const auto [factor, mean] = mean_union(queries);
    std::printf("  coherence %.3g: union of a %lld-query tile's blocks %.1f, %.2fx its queries' mean valid count\n",
                coherence, static_cast<long long>(queries), mean, factor);
  }
  std::printf("  local block entries          %6.2f%%\n", 100.0 * local / e);
  std::printf("  pair in the CTA's last item  %6.3f%%\n", 100.0 * prev_item / e);
  std::printf("  pair earlier in the same CTA %6.3f%%\n", 100.0 * same_cta / e);
  std::printf("  Q pair read in the last wave %6.2f%%\n", 100.0 * q_in_wave / e);
  std::printf("  K/V block read in last wave  %6.2f%% of items\n", 100.0 * kv_in_wave / items_total);
  return 0;
}
