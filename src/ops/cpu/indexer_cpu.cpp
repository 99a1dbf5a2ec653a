// Optimised CPU index branch: block maxima of qi . ki without a token-score matrix, then
// the selection rule of docs/msa.md §3 per (query, index head), then the selected LSE.
//
// Rows are (query, index head) pairs; a tile holds the rows of up to kTileRows / Hi
// consecutive queries of one sequence. Phase 1 scans the index keys block by block with
// 8 or 16 rows in vector lanes (the block max is then a vertical max; no exp, no stores of
// token scores); it is split over (tile, run of blocks) so that one decode query also
// uses every core. Phase 2 selects per row and, for training, recomputes only the
// selected tokens' scores for the LSE (k*B keys instead of a second full pass).
// Index-key blocks come through BlockReaders (f32 in place, bf16/f16 widened per block):
// each block is read once per tile and scanned by all of the tile's chunks.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../selection.h"
#include "block_reader.h"
#include "cpu.h"
#include "vector_math.h"

namespace msa::detail::cpu {

namespace {

constexpr int64_t kTileRows = 128;             // rows per tile
constexpr int64_t kBlocksPerSegment = 32;      // blocks per phase-1 work item
constexpr int64_t kWaveBytes = int64_t{64} << 20;  // block-max buffer per wave

struct Tile {
  int64_t first_row, queries, seq;
  int64_t scanned_blocks;  // blocks [0, scanned_blocks) are scanned: all j < own block
};

// block_max[lane] = max over the block's B keys of q_t^T k, with RV * 8 rows in lanes
// (RV = 1 when a tile has at most 8 rows, as in decode).
template <int RV>
void scan_block(const float* q_t, BlockRows keys, int64_t B, int64_t Di, float* block_max) {
  constexpr int L = RV * kLanes;
  constexpr int kKeys = 16 / RV;  // keys per step: 16 accumulators
  f32x8 best[RV];
  for (int v = 0; v < RV; ++v) best[v] = splat(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kKeys <= B; t += kKeys) {
    f32x8 acc[kKeys][RV] = {};
    const float* key_rows = keys.row(t);
    for (int64_t d = 0; d < Di; ++d) {
      f32x8 qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = load8(q_t + d * L + v * kLanes);
#pragma GCC unroll 16
      for (int c = 0; c < kKeys; ++c) {
        const float key = key_rows[c * keys.stride + d];
        for (int v = 0; v < RV; ++v) acc[c][v] += qv[v] * key;
      }
    }
    for (int c = 0; c < kKeys; ++c)
      for (int v = 0; v < RV; ++v) best[v] = max8(best[v], acc[c][v]);
  }
  for (; t < B; ++t) {  // block sizes that are not a multiple of kKeys
    f32x8 acc[RV] = {};
    const float* key = keys.row(t);
    for (int64_t d = 0; d < Di; ++d)
      for (int v = 0; v < RV; ++v) acc[v] += load8(q_t + d * L + v * kLanes) * key[d];
    for (int v = 0; v < RV; ++v) best[v] = max8(best[v], acc[v]);
  }
  for (int v = 0; v < RV; ++v) store8(block_max + v * kLanes, best[v]);
}

// Tiles of at most kKeysInLanesRows rows (decode: one query's index heads, 4 for M3):
// block_max[r] = max over the block's B keys of q_r^T k for rows r < rows, q row-major
// [rows][Di]. Keys stream row by row, two at a time, each key row read once and in order,
// with Di in the vector lanes. The rows-in-lanes kernel (scan_block) would leave half of its
// lanes idle on 4 rows and walk 16 key rows column by column. q holds kKeysInLanesRows rows
// (zeros past `rows`, which are not stored).
constexpr int kKeysInLanesRows = 4;
void scan_block_keys_in_lanes(const float* q, int64_t rows, BlockRows keys, int64_t B, int64_t Di,
                              float* block_max) {
  constexpr int R = kKeysInLanesRows;
  static_assert(R == 4, "the four rows' sums are one reduce_sum8x4");
  const int64_t vector_end = Di - Di % kLanes;
  f32x4 best = f32x4{} - std::numeric_limits<float>::infinity();
  // The rows' q . key: the lanes' partial sums plus the scalar tail of Di.
  const auto finish = [&](const f32x8 (&acc)[R], const float* key) {
    f32x4 sum = reduce_sum8x4(acc[0], acc[1], acc[2], acc[3]);
    for (int64_t d = vector_end; d < Di; ++d)
      for (int r = 0; r < R; ++r) sum[r] += q[r * Di + d] * key[d];
    best = max4(best, sum);
  };
  int64_t t = 0;
  for (; t + 2 <= B; t += 2) {
    const float* k0 = keys.row(t);
    const float* k1 = keys.row(t + 1);
    f32x8 acc0[R] = {}, acc1[R] = {};
    for (int64_t d = 0; d < vector_end; d += kLanes) {
      const f32x8 a = load8(k0 + d), b = load8(k1 + d);
      for (int r = 0; r < R; ++r) {
        const f32x8 qv = load8(q + r * Di + d);
        acc0[r] += qv * a;
        acc1[r] += qv * b;
      }
    }
    finish(acc0, k0);
    finish(acc1, k1);
  }
  for (; t < B; ++t) {  // odd block sizes
    const float* k0 = keys.row(t);
    f32x8 acc0[R] = {};
    for (int64_t d = 0; d < vector_end; d += kLanes) {
      const f32x8 a = load8(k0 + d);
      for (int r = 0; r < R; ++r) acc0[r] += load8(q + r * Di + d) * a;
    }
    finish(acc0, k0);
  }
  for (int64_t r = 0; r < rows; ++r) block_max[r] = best[r];
}

float dot(const float* a, const float* b, int64_t n) {
  f32x8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float sum = reduce_sum8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// log sum exp(logit_scale * qi.ki(t)) over the visible tokens of the row's selected blocks.
float selected_lse(const float* q_row, const int32_t* row, int64_t slots, BlockReader& ki,
                   int64_t seq, int64_t pos, int64_t Di, float logit_scale) {
  const int64_t B = ki.block_size();
  float max = -std::numeric_limits<float>::infinity(), sum = 0;
  for (int64_t slot = 0; slot < slots && row[slot] >= 0; ++slot) {
    const int64_t n_valid = std::min(B, pos - row[slot] * B + 1);
    const BlockRows keys = ki.read(seq, row[slot], 0, n_valid);
    for (int64_t t = 0; t < n_valid; ++t) {
      const float logit = logit_scale * dot(q_row, keys.row(t), Di);
      if (logit > max) {
        sum = sum * std::exp(max - logit) + 1.0f;
        max = logit;
      } else {
        sum += std::exp(logit - max);
      }
    }
  }
  return sum > 0 ? max + std::log(sum) : -std::numeric_limits<float>::infinity();
}

}  // namespace

void indexer(const float* qi, int64_t index_heads, int64_t index_dim, const StoredBlocks& ki,
             const Batch& batch, const MsaParams& params, float index_scale, int32_t* topk,
             float* lse, const IndexRanking* ranking) {
  const int64_t Hi = index_heads, Di = index_dim, B = params.block_size;
  const float* rank_qi = ranking ? ranking->qi : qi;  // phase 1 (block maxima) reads these
  const StoredBlocks& rank_ki = ranking ? *ranking->ki : ki;
  const int64_t queries_per_tile = std::max<int64_t>(1, kTileRows / Hi);
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch.size(); ++b)
    for (int64_t row = batch.q_start[b]; row < batch.q_start[b + 1]; row += queries_per_tile) {
      const int64_t queries = std::min(queries_per_tile, batch.q_start[b + 1] - row);
      tiles.push_back({row, queries, b, batch.pos(row + queries - 1) / B});
    }
  // Rows per microkernel call: 8 (one vector) when every tile has few rows (decode), else 16.
  int64_t max_tile_rows = 0;
  for (const Tile& tile : tiles) max_tile_rows = std::max(max_tile_rows, tile.queries * Hi);
  const int64_t lanes = max_tile_rows <= kLanes ? kLanes : 2 * kLanes;
  const float logit_scale = index_scale / static_cast<float>(params.temperature);

  // Waves of tiles bound the block-max buffer: [tile][chunk][block][lanes].
  size_t wave_begin = 0;
  while (wave_begin < tiles.size()) {
    std::vector<int64_t> offset{0};  // float offset of each tile's block maxima
    size_t wave_end = wave_begin;
    while (wave_end < tiles.size()) {
      const Tile& tile = tiles[wave_end];
      const int64_t chunks = (tile.queries * Hi + lanes - 1) / lanes;
      const int64_t floats = chunks * tile.scanned_blocks * lanes;
      if (wave_end > wave_begin && (offset.back() + floats) * 4 > kWaveBytes) break;
      offset.push_back(offset.back() + floats);
      ++wave_end;
    }
    std::vector<float> block_max(static_cast<size_t>(offset.back()));

    // Phase 1: (tile, segment of blocks) items. Every chunk of the tile scans a block
    // right after the previous one, while the block is still in the core's cache, so
    // the keys stream from memory once per tile rather than once per chunk.
    struct ScanItem {
      int64_t tile, j0, j1;
    };
    std::vector<ScanItem> items;
    for (size_t t = wave_begin; t < wave_end; ++t)
      for (int64_t j = 0; j < tiles[t].scanned_blocks; j += kBlocksPerSegment)
        items.push_back({static_cast<int64_t>(t), j,
                         std::min(tiles[t].scanned_blocks, j + kBlocksPerSegment)});
#pragma omp parallel
    {
      std::vector<float> q_t;  // [chunk][Di][lanes] rows of the tile, heads in lanes (decode: [rows][Di])
      BlockReader keys(rank_ki);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < items.size(); ++i) {
        const ScanItem& item = items[i];
        const Tile& tile = tiles[item.tile];
        const int64_t rows = tile.queries * Hi;
        const int64_t chunks = (rows + lanes - 1) / lanes;
        float* tile_max = block_max.data() + offset[item.tile - wave_begin];
        if (rows <= kKeysInLanesRows) {  // decode (M3: one query's 4 heads): chunk 0 only
          q_t.assign(static_cast<size_t>(kKeysInLanesRows * Di), 0.0f);
          std::copy_n(rank_qi + tile.first_row * Hi * Di, rows * Di, q_t.begin());
          for (int64_t j = item.j0; j < item.j1; ++j)
            scan_block_keys_in_lanes(q_t.data(), rows, keys.read(tile.seq, j, 0, B), B, Di, tile_max + j * lanes);
          continue;
        }
        q_t.assign(static_cast<size_t>(chunks * Di * lanes), 0.0f);
        for (int64_t r = 0; r < rows; ++r) {
          const float* q_row = rank_qi + (tile.first_row * Hi + r) * Di;
          float* column = q_t.data() + (r / lanes) * Di * lanes + r % lanes;
          for (int64_t d = 0; d < Di; ++d) column[d * lanes] = q_row[d];
        }
        for (int64_t j = item.j0; j < item.j1; ++j) {
          const BlockRows block = keys.read(tile.seq, j, 0, B);  // j < own block: all B rows
          for (int64_t c = 0; c < chunks; ++c) {
            float* out = tile_max + (c * tile.scanned_blocks + j) * lanes;
            if (lanes == kLanes)
              scan_block<1>(q_t.data() + c * Di * lanes, block, B, Di, out);
            else
              scan_block<2>(q_t.data() + c * Di * lanes, block, B, Di, out);
          }
        }
      }
    }

    // Phase 2: one row at a time.
    int64_t rows_in_wave = 0;
    std::vector<std::pair<int64_t, int64_t>> row_items;  // (tile, row in tile)
    for (size_t t = wave_begin; t < wave_end; ++t)
      for (int64_t r = 0; r < tiles[t].queries * Hi; ++r) row_items.push_back({t, r});
    rows_in_wave = static_cast<int64_t>(row_items.size());
#pragma omp parallel
    {
      std::vector<float> row_max;
      std::vector<int64_t> scratch;
      BlockReader keys(ki);
#pragma omp for schedule(dynamic, 16)
      for (int64_t i = 0; i < rows_in_wave; ++i) {
        const auto [t, r] = row_items[i];
        const Tile& tile = tiles[t];
        const int64_t query = tile.first_row + r / Hi, head = r % Hi;
        const int64_t pos = batch.pos(query), own_block = pos / B;
        const float* maxima = block_max.data() + offset[t - wave_begin] +
                              (r / lanes) * tile.scanned_blocks * lanes;
        row_max.resize(static_cast<size_t>(own_block));
        for (int64_t j = 0; j < own_block; ++j) row_max[j] = maxima[j * lanes + r % lanes];
        int32_t* out_row = topk + (head * batch.total_q() + query) * params.topk;
        write_selection_row(row_max.data(), own_block, params, out_row, scratch);
        if (lse)
          lse[head * batch.total_q() + query] =
              selected_lse(qi + (query * Hi + head) * Di, out_row, params.topk, keys, tile.seq,
                           pos, Di, logit_scale);
      }
    }
    wave_begin = wave_end;
  }
}

}  // namespace msa::detail::cpu
