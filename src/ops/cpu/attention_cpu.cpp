// Optimised CPU attention forward over block lists (sparse selection rows or dense causal).
//
// Work item = (tile of up to kTileQueries consecutive queries of one sequence, KV group,
// chunk of up to 16 of the group's heads). The item visits the union of its queries'
// blocks in ascending block order, so a K/V block is loaded once for every query of the
// tile that reads it (dense: all of them), and each query keeps an online-softmax state.
// Inside a block the kernel keeps heads in vector lanes ("rows in lanes"): scores are
// [keys][heads], so the row max is a vertical max and P.V broadcasts V elements.
// K/V blocks come through BlockReaders (f32 in place, bf16/f16 widened per block).
// Split-K (dense calls with fewer than kSplitMaxItems items: decode-sized batches): an item
// whose blocks span several multiples of kSegmentBlocks ("segments") runs one unit per
// segment, each with its own online softmax, and merges the units' states in ascending
// order, so a long context with few rows (one item per request and KV group) spreads over
// every core instead of running on one. Segments and the rule depend on the inputs only,
// never on the thread count. Sparse items visit at most rows x slots blocks: split, their
// units cost more in set-up than they save (a 128K sparse prefill ran 2x slower on 2 cores;
// bench/results/cpu.md).
//
// Bidirectional dense attention (MsaParams::causal = false) with fewer heads per KV group
// than lanes (the vision tower: 16 heads, one per group) puts queries in the lanes instead:
// every query of a tile sees the same keys (all of its sequence), so a tile of up to 16
// queries of one head shares each K/V block as a group's heads do above, and no lane idles
// (heads in lanes would fill 1 of 8 lanes there).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "block_reader.h"
#include "cpu.h"
#include "vector_math.h"

namespace msa::detail::cpu {

namespace {

constexpr int64_t kTileQueries = 16;
constexpr int64_t kMaxLanes = 16;  // heads per work item (two 8-lane vectors)
constexpr int64_t kSegmentBlocks = 32;              // blocks per split-K segment (fixed: see above)
constexpr size_t kSplitMaxItems = 256;              // split-K only below this many items
constexpr int64_t kWaveBytes = int64_t{256} << 20;  // segment states held at once

// One query's online-softmax state for `RV` row vectors (RV * 8 head lanes).
template <int RV>
struct QueryState {
  float* q_t;  // [D][lanes] scaled query, heads in lanes
  float* o_t;  // [D][lanes] unnormalised output
  f32x8 max[RV];
  f32x8 sum[RV];
};

// Scores of the first `n_valid` keys of a block: scores[t][lanes] = q_t^T k_t.
template <int RV>
void block_scores(const float* q_t, const float* keys, int64_t token_stride, int64_t n_valid,
                  int64_t D, float* scores) {
  constexpr int L = RV * kLanes;
  int64_t t = 0;
  for (; t + 8 <= n_valid; t += 8) {
    f32x8 acc[8][RV] = {};
    const float* key_rows = keys + t * token_stride;
    for (int64_t d = 0; d < D; ++d) {
      f32x8 qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = load8(q_t + d * L + v * kLanes);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const float key = key_rows[c * token_stride + d];
        for (int v = 0; v < RV; ++v) acc[c][v] += qv[v] * key;
      }
    }
    for (int c = 0; c < 8; ++c)
      for (int v = 0; v < RV; ++v) store8(scores + (t + c) * L + v * kLanes, acc[c][v]);
  }
  for (; t < n_valid; ++t) {
    f32x8 acc[RV] = {};
    const float* key = keys + t * token_stride;
    for (int64_t d = 0; d < D; ++d)
      for (int v = 0; v < RV; ++v) acc[v] += load8(q_t + d * L + v * kLanes) * key[d];
    for (int v = 0; v < RV; ++v) store8(scores + t * L + v * kLanes, acc[v]);
  }
}

// o_t[d0 .. d0+W) = o_t * alpha + sum_t p[t] v[t][d].
template <int RV, int W>
void accumulate_pv(float* o_t, const f32x8* alpha, const float* probs, const float* values,
                   int64_t token_stride, int64_t n_valid, int64_t d0) {
  constexpr int L = RV * kLanes;
  f32x8 acc[W][RV];
  for (int i = 0; i < W; ++i)
    for (int v = 0; v < RV; ++v) acc[i][v] = load8(o_t + (d0 + i) * L + v * kLanes) * alpha[v];
  for (int64_t t = 0; t < n_valid; ++t) {
    f32x8 p[RV];
    for (int v = 0; v < RV; ++v) p[v] = load8(probs + t * L + v * kLanes);
    const float* value = values + t * token_stride + d0;
#pragma GCC unroll 8
    for (int i = 0; i < W; ++i)
      for (int v = 0; v < RV; ++v) acc[i][v] += p[v] * value[i];
  }
  for (int i = 0; i < W; ++i)
    for (int v = 0; v < RV; ++v) store8(o_t + (d0 + i) * L + v * kLanes, acc[i][v]);
}

// Online-softmax update of one query's state with the first n_valid keys of a block.
template <int RV>
void attend_block(QueryState<RV>& state, BlockRows keys, BlockRows values, int64_t n_valid,
                  int64_t D, float* scores) {
  constexpr int L = RV * kLanes;
  block_scores<RV>(state.q_t, keys.data, keys.stride, n_valid, D, scores);
  f32x8 block_max[RV];
  for (int v = 0; v < RV; ++v) block_max[v] = splat(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n_valid; ++t)
    for (int v = 0; v < RV; ++v) block_max[v] = max8(block_max[v], load8(scores + t * L + v * kLanes));
  f32x8 alpha[RV], new_max[RV], block_sum[RV] = {};
  for (int v = 0; v < RV; ++v) {
    new_max[v] = max8(state.max[v], block_max[v]);
    alpha[v] = exp8(state.max[v] - new_max[v]);  // 0 on the first block (max = -inf)
  }
  for (int64_t t = 0; t < n_valid; ++t)
    for (int v = 0; v < RV; ++v) {
      const f32x8 p = exp8(load8(scores + t * L + v * kLanes) - new_max[v]);
      store8(scores + t * L + v * kLanes, p);
      block_sum[v] += p;
    }
  for (int v = 0; v < RV; ++v) {
    state.sum[v] = state.sum[v] * alpha[v] + block_sum[v];
    state.max[v] = new_max[v];
  }
  int64_t d0 = 0;
  for (; d0 + 8 <= D; d0 += 8)
    accumulate_pv<RV, 8>(state.o_t, alpha, scores, values.data, values.stride, n_valid, d0);
  for (; d0 < D; ++d0)
    accumulate_pv<RV, 1>(state.o_t, alpha, scores, values.data, values.stride, n_valid, d0);
}

// (block, query-in-tile) pairs with blocks in [j0, j1), in ascending block order.
struct Visit {
  int64_t block;
  int64_t query;
};

std::vector<Visit> tile_visits(const Batch& batch, BlockSource blocks, int64_t group, int64_t first_row,
                               int64_t rows, int64_t block_size, int64_t j0, int64_t j1) {
  std::vector<Visit> visits;
  if (blocks.topk) {
    for (int64_t i = 0; i < rows; ++i) {
      const int32_t* entries = blocks.topk + (group * batch.total_q() + first_row + i) * blocks.slots;
      for (int64_t slot = 0; slot < blocks.slots && entries[slot] >= 0; ++slot)
        if (entries[slot] >= j0 && entries[slot] < j1) visits.push_back({entries[slot], i});
    }
    std::sort(visits.begin(), visits.end(), [](const Visit& a, const Visit& b) {
      return a.block != b.block ? a.block < b.block : a.query < b.query;
    });
  } else {
    const int64_t last_block = batch.last_key(first_row + rows - 1) / block_size;
    for (int64_t j = j0; j <= std::min(last_block, j1 - 1); ++j)
      for (int64_t i = 0; i < rows; ++i)
        if (j <= batch.last_key(first_row + i) / block_size) visits.push_back({j, i});
  }
  return visits;
}

struct WorkItem {
  int64_t first_row, rows, group, first_head, heads;
};

// One unit: an item's visits to blocks [j0, j1). `partial` null: the unit is the item's
// only one and writes O and LSE; else it leaves each row's state there ([rows][D * L + 2 * L]:
// unnormalised O [D][L], then max [L] and sum [L]) for merge_segments.
template <int RV>
void run_unit(const WorkItem& item, int64_t j0, int64_t j1, const float* q, const StoredBlocks& k,
              const StoredBlocks& v, const AttentionDims& dims, const Batch& batch, BlockSource blocks,
              float scale, float* o, float* lse, float* partial) {
  constexpr int L = RV * kLanes;
  BlockReader keys(k), values(v);
  const int64_t D = dims.head_dim, B = keys.block_size();
  const int64_t seq = batch.seq_of_query[item.first_row];
  std::vector<float> buffers(static_cast<size_t>(item.rows * 2 * D * L + B * L), 0.0f);
  float* scores = buffers.data() + item.rows * 2 * D * L;
  std::vector<QueryState<RV>> states(item.rows);
  for (int64_t i = 0; i < item.rows; ++i) {
    QueryState<RV>& state = states[i];
    state.q_t = buffers.data() + i * 2 * D * L;
    state.o_t = state.q_t + D * L;
    const float* q_row = q + ((item.first_row + i) * dims.q_heads + item.first_head) * D;
    for (int64_t h = 0; h < item.heads; ++h)
      for (int64_t d = 0; d < D; ++d) state.q_t[d * L + h] = scale * q_row[h * D + d];
    for (int r = 0; r < RV; ++r) {
      state.max[r] = splat(-std::numeric_limits<float>::infinity());
      state.sum[r] = splat(0.0f);
    }
  }
  for (const Visit& visit : tile_visits(batch, blocks, item.group, item.first_row, item.rows, B, j0, j1)) {
    const int64_t last = batch.last_key(item.first_row + visit.query);
    const int64_t n_valid = std::min(B, last - visit.block * B + 1);
    attend_block<RV>(states[visit.query], keys.read(seq, visit.block, item.group, n_valid),
                     values.read(seq, visit.block, item.group, n_valid), n_valid, D, scores);
  }
  for (int64_t i = 0; i < item.rows; ++i) {
    const QueryState<RV>& state = states[i];
    if (partial) {
      float* out = partial + i * (D * L + 2 * L);
      std::copy(state.o_t, state.o_t + D * L, out);
      for (int r = 0; r < RV; ++r) {
        store8(out + D * L + r * kLanes, state.max[r]);
        store8(out + D * L + L + r * kLanes, state.sum[r]);
      }
      continue;
    }
    const int64_t row = item.first_row + i;
    for (int64_t h = 0; h < item.heads; ++h) {
      const float sum = state.sum[h / kLanes][h % kLanes];
      const float max = state.max[h / kLanes][h % kLanes];
      const float inv = sum > 0 ? 1.0f / sum : 0.0f;
      float* o_row = o + (row * dims.q_heads + item.first_head + h) * D;
      for (int64_t d = 0; d < D; ++d) o_row[d] = state.o_t[d * L + h] * inv;
      lse[row * dims.q_heads + item.first_head + h] =
          sum > 0 ? max + std::log(sum) : -std::numeric_limits<float>::infinity();
    }
  }
}

// O and LSE of an item from its `segments` partial states (run_unit's layout, lanes L, in
// ascending segment order): M = the segments' max, weights w_s = e^(max_s - M) (0 for a
// segment without a visible key of the row), O = sum w_s O_s / sum w_s sum_s, LSE = M +
// log(sum w_s sum_s). No visible key at all: O = 0, LSE = -inf.
void merge_segments(const WorkItem& item, const float* partial, int64_t segments, int64_t L,
                    const AttentionDims& dims, float* o, float* lse) {
  const int64_t D = dims.head_dim, row_floats = D * L + 2 * L, unit_floats = item.rows * row_floats;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> weight(static_cast<size_t>(segments * L)), acc(static_cast<size_t>(D * L));
  std::vector<float> max(static_cast<size_t>(L)), sum(static_cast<size_t>(L));
  for (int64_t i = 0; i < item.rows; ++i) {
    const auto state = [&](int64_t s) { return partial + s * unit_floats + i * row_floats; };
    std::fill(max.begin(), max.end(), kNegInf);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t s = 0; s < segments; ++s)
      for (int64_t h = 0; h < L; ++h) max[h] = std::max(max[h], state(s)[D * L + h]);
    for (int64_t s = 0; s < segments; ++s)
      for (int64_t h = 0; h < L; ++h) {
        const float segment_max = state(s)[D * L + h];
        const float w = segment_max == kNegInf ? 0.0f : std::exp(segment_max - max[h]);
        weight[s * L + h] = w;
        sum[h] += w * state(s)[D * L + L + h];
      }
    // O_s are [D][L] with heads in lanes: accumulate whole rows, segments in order.
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < segments; ++s) {
      const float* o_s = state(s);
      for (int64_t d = 0; d < D; ++d)
        for (int64_t h = 0; h < L; ++h) acc[d * L + h] += weight[s * L + h] * o_s[d * L + h];
    }
    const int64_t row = item.first_row + i;
    for (int64_t h = 0; h < item.heads; ++h) {
      const float inv = sum[h] > 0 ? 1.0f / sum[h] : 0.0f;
      float* o_row = o + (row * dims.q_heads + item.first_head + h) * D;
      for (int64_t d = 0; d < D; ++d) o_row[d] = acc[d * L + h] * inv;
      lse[row * dims.q_heads + item.first_head + h] = sum[h] > 0 ? max[h] + std::log(sum[h]) : kNegInf;
    }
  }
}

// Bidirectional, queries in lanes: `rows` (<= RV * 8) consecutive queries of one sequence
// and one query head against every key of the sequence, with one online-softmax state
// whose lanes are the queries (lanes beyond `rows` hold zero queries and are not written).
template <int RV>
void run_query_lanes(int64_t first_row, int64_t rows, int64_t head, const float* q,
                     const StoredBlocks& k, const StoredBlocks& v, const AttentionDims& dims,
                     const Batch& batch, float scale, float* o, float* lse) {
  constexpr int L = RV * kLanes;
  BlockReader keys(k), values(v);
  const int64_t D = dims.head_dim, B = keys.block_size(), group = head / dims.group_size();
  const int64_t seq = batch.seq_of_query[first_row], n_keys = batch.k_len[seq];
  std::vector<float> buffers(static_cast<size_t>(2 * D * L + B * L), 0.0f);
  QueryState<RV> state{.q_t = buffers.data(), .o_t = buffers.data() + D * L, .max = {}, .sum = {}};
  float* scores = buffers.data() + 2 * D * L;
  for (int64_t i = 0; i < rows; ++i) {
    const float* q_row = q + ((first_row + i) * dims.q_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) state.q_t[d * L + i] = scale * q_row[d];
  }
  for (int r = 0; r < RV; ++r) {
    state.max[r] = splat(-std::numeric_limits<float>::infinity());
    state.sum[r] = splat(0.0f);
  }
  for (int64_t block = 0; block * B < n_keys; ++block) {
    const int64_t n_valid = std::min(B, n_keys - block * B);
    attend_block<RV>(state, keys.read(seq, block, group, n_valid),
                     values.read(seq, block, group, n_valid), n_valid, D, scores);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float sum = state.sum[i / kLanes][i % kLanes];
    const float max = state.max[i / kLanes][i % kLanes];
    const float inv = sum > 0 ? 1.0f / sum : 0.0f;
    float* o_row = o + ((first_row + i) * dims.q_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) o_row[d] = state.o_t[d * L + i] * inv;
    lse[(first_row + i) * dims.q_heads + head] =
        sum > 0 ? max + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}

void forward_query_lanes(const float* q, const StoredBlocks& k, const StoredBlocks& v,
                         const AttentionDims& dims, const Batch& batch, float scale, float* o,
                         float* lse) {
  struct Tile {
    int64_t first_row, rows, head;
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch.size(); ++b)
    for (int64_t row = batch.q_start[b]; row < batch.q_start[b + 1]; row += kTileQueries)
      for (int64_t head = 0; head < dims.q_heads; ++head)
        tiles.push_back({row, std::min(kTileQueries, batch.q_start[b + 1] - row), head});
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t t = 0; t < tiles.size(); ++t) {
    const Tile& tile = tiles[t];
    if (tile.rows > kLanes)
      run_query_lanes<2>(tile.first_row, tile.rows, tile.head, q, k, v, dims, batch, scale, o, lse);
    else
      run_query_lanes<1>(tile.first_row, tile.rows, tile.head, q, k, v, dims, batch, scale, o, lse);
  }
}

}  // namespace

void attention_forward(const float* q, const StoredBlocks& k, const StoredBlocks& v,
                       const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                       float scale, float* o, float* lse) {
  const int64_t G = dims.group_size();
  if (!blocks.topk && !batch.causal && G < kLanes) {
    forward_query_lanes(q, k, v, dims, batch, scale, o, lse);
    return;
  }
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch.size(); ++b)
    for (int64_t row = batch.q_start[b]; row < batch.q_start[b + 1]; row += kTileQueries)
      for (int64_t group = 0; group < dims.kv_heads; ++group)
        for (int64_t h = 0; h < G; h += kMaxLanes)
          items.push_back({row, std::min(kTileQueries, batch.q_start[b + 1] - row), group,
                           group * G + h, std::min(kMaxLanes, G - h)});
  // Later queries see more keys: start the most expensive items first.
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return batch.last_key(a.first_row + a.rows - 1) > batch.last_key(b.first_row + b.rows - 1);
  });
  // Units, in waves that bound the segment states: a split item's segments, else the item
  // alone (also when its rows are empty: it writes O = 0, LSE = -inf).
  const int64_t B = BlockReader(k).block_size();
  const bool split = !blocks.topk && items.size() < kSplitMaxItems;
  struct Unit {
    size_t item;
    int64_t j0, j1;
    int64_t partial;  // float offset in the wave's buffer; -1: writes O and LSE itself
  };
  const auto lanes_of = [](const WorkItem& item) -> int64_t { return item.heads > kLanes ? 2 * kLanes : kLanes; };
  size_t wave_begin = 0;
  while (wave_begin < items.size()) {
    std::vector<Unit> units;
    struct Merge {
      size_t item, first_unit, units;
    };
    std::vector<Merge> merges;  // the split items
    int64_t floats = 0;
    size_t wave_end = wave_begin;
    for (; wave_end < items.size(); ++wave_end) {
      const WorkItem& item = items[wave_end];
      // Dense: blocks 0 .. the last row's own, segments 0 .. last / kSegmentBlocks.
      const int64_t last_segment = split ? batch.last_key(item.first_row + item.rows - 1) / B / kSegmentBlocks : 0;
      const int64_t unit_floats = item.rows * (dims.head_dim + 2) * lanes_of(item);
      const int64_t item_floats = last_segment > 0 ? (last_segment + 1) * unit_floats : 0;
      if (wave_end > wave_begin && (floats + item_floats) * 4 > kWaveBytes) break;
      if (last_segment == 0) {
        units.push_back({wave_end, 0, std::numeric_limits<int64_t>::max(), -1});
        continue;
      }
      merges.push_back({wave_end, units.size(), static_cast<size_t>(last_segment + 1)});
      for (int64_t s = 0; s <= last_segment; ++s, floats += unit_floats)
        units.push_back({wave_end, s * kSegmentBlocks, (s + 1) * kSegmentBlocks, floats});
    }
    std::vector<float> partial(static_cast<size_t>(floats));
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t u = 0; u < units.size(); ++u) {
      const Unit& unit = units[u];
      const WorkItem& item = items[unit.item];
      float* out = unit.partial < 0 ? nullptr : partial.data() + unit.partial;
      if (item.heads > kLanes)
        run_unit<2>(item, unit.j0, unit.j1, q, k, v, dims, batch, blocks, scale, o, lse, out);
      else
        run_unit<1>(item, unit.j0, unit.j1, q, k, v, dims, batch, blocks, scale, o, lse, out);
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t m = 0; m < merges.size(); ++m) {
      const WorkItem& item = items[merges[m].item];
      merge_segments(item, partial.data() + units[merges[m].first_unit].partial,
                     static_cast<int64_t>(merges[m].units), lanes_of(item), dims, o, lse);
    }
    wave_begin = wave_end;
  }
}

}  // namespace msa::detail::cpu
