// Sparse attention, KV-block-major (the MSA authors' "KV-outer"), forward.
//
// Plan (all on the device, graph-capturable, no host sync):
//   1. build_selection_keys: every (group g, query q, slot s) entry of the selection rows
//      becomes a 64-bit key ((g * nblk + block) * total_q + q) * slots + s; entries at or
//      after a row's first -1 get the key `invalid` (= groups * nblk * total_q * slots), which
//      sorts last.
//   2. cub::DeviceRadixSort::SortKeys over [0, bit_width(invalid)) bits. Within one
//      (group, block id) run the keys are ordered by query row, and queries of one sequence
//      are contiguous rows, so each (group, sequence, block) is one contiguous segment
//      ordered by query row: a deterministic CSR without a separate count/scan/fill.
//   3. make_work_items: the first entry of each segment finds the segment end by binary
//      search and appends ceil(len / queries_per_item) items {first entry, entry count}
//      (atomic append: the item *order* varies run to run, their content does not, and every
//      item writes only its own partials, so the outputs are bitwise deterministic).
//
// Attention kernel (persistent grid, items strided over CTAs, 4 warps = 128 threads):
//   - the CTA loads the item's K and V block (B x D bf16 each) into shared memory once with
//     cp.async (rows past the sequence end zero-filled);
//   - the item's rows are its (entry, head) pairs flattened entry-major: row m = entry
//     m / G, head m % G. Each warp takes 16-row m-tiles (one query's 16 heads for M3;
//     several queries per tile when G < 16: no padding waste) and runs the block in 64-key
//     sub-tiles with the shared online softmax (attention_block_tile.cuh); sub-tiles past
//     the warp's last visible key are skipped, masks only where a sub-tile crosses a row's
//     position (the query's own block);
//   - each row writes a partial: O / l (f32, D values) and lse2 = m + log2 l at partial
//     index ((q * kv_heads + g) * slots + s) * G + head. merge.cuh combines them.
// Shared memory: 2 * B * (D + 8) * 2 bytes = 69,632 (B = D = 128), 34,816 (B = 128, D = 64
// or B = 64, D = 128). Registers: the warp tile (~140 live values) + addressing; see the
// -Xptxas -v report in the launcher's comment.
// Expected bottleneck: the partial-O stores (G * D * 4 bytes per (query, block) against one
// B x D x 2 x 2 K/V load per item); the MMA work is ~4 * D * B * 16 flop per pair.
// PartialO is the one place to switch to bf16 partials later.
#pragma once
#include "attention_block_tile.cuh"
#include "cuda/launch.h"

namespace msa::cuda::attn {

using PartialO = float;  // partial O element type (normalised O_s / l_s)

struct SparsePlanArgs {
  const int32_t* topk;  // [groups, total_q, slots]
  int64_t groups, total_q, slots, nblk;
  uint64_t invalid_key;
};

__global__ void build_selection_keys(SparsePlanArgs a, uint64_t* keys) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.groups * a.total_q) return;
  const int64_t g = idx / a.total_q, q = idx % a.total_q;
  const int32_t* row = a.topk + idx * a.slots;
  uint64_t* out = keys + idx * a.slots;
  bool live = true;
  for (int64_t s = 0; s < a.slots; ++s) {
    const int32_t block = row[s];
    live = live && block >= 0;
    out[s] = live ? static_cast<uint64_t>(((g * a.nblk + block) * a.total_q + q) * a.slots + s)
                  : a.invalid_key;
  }
}

struct WorkItem {
  int32_t first;  // index of the item's first entry in the sorted keys
  int32_t count;  // entries (queries) in the item
};

__global__ void make_work_items(SparsePlanArgs a, const uint64_t* keys, int64_t entries,
                                const int64_t* q_start, const int32_t* seq_of_query,
                                int queries_per_item, WorkItem* items, unsigned* item_count) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  const uint64_t key = keys[e];
  if (key >= a.invalid_key) return;
  const uint64_t per_block = static_cast<uint64_t>(a.total_q * a.slots);
  const uint64_t group_block = key / per_block;
  const int64_t q = static_cast<int64_t>((key % per_block) / a.slots);
  const int32_t seq = seq_of_query[q];
  if (e > 0) {
    const uint64_t prev = keys[e - 1];
    if (prev / per_block == group_block &&
        seq_of_query[static_cast<int64_t>((prev % per_block) / a.slots)] == seq)
      return;  // not the first entry of its segment
  }
  // Segment end: first key >= (group_block, first query of the next sequence, slot 0).
  const uint64_t end_key = (group_block * a.total_q + q_start[seq + 1]) * a.slots;
  int64_t lo = e + 1, hi = entries;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < end_key)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int64_t len = lo - e;
  const int64_t n = (len + queries_per_item - 1) / queries_per_item;
  const unsigned base = atomicAdd(item_count, static_cast<unsigned>(n));
  for (int64_t c = 0; c < n; ++c)
    items[base + c] = {static_cast<int32_t>(e + c * queries_per_item),
                       static_cast<int32_t>(len - c * queries_per_item < queries_per_item
                                                ? len - c * queries_per_item
                                                : queries_per_item)};
}

struct SparseArgs {
  const uint16_t* q;  // [total_q, q_heads, D]
  KeyLayout k, v;
  int64_t q_heads, kv_heads, group;  // group = q_heads / kv_heads <= 16
  int64_t block_size;
  const int64_t* q_start;
  const int64_t* k_len;
  const int32_t* seq_of_query;
  int64_t total_q, slots, nblk;
  const uint64_t* keys;  // sorted selection keys
  const WorkItem* items;
  const unsigned* item_count;
  float scale_log2;
  PartialO* partial_o;  // [total_q, kv_heads, slots, group, D]
  float* partial_lse;   // [total_q, kv_heads, slots, group] (log2 domain)
};

constexpr int kSparseWarps = 4;
constexpr int kSparseThreads = kSparseWarps * 32;

template <int D>
__host__ __device__ constexpr size_t sparse_smem_bytes(int64_t block_size) {
  return 2 * static_cast<size_t>(block_size) * smem_pitch<D>() * sizeof(uint16_t);
}

// One entry of an item, decoded.
struct Entry {
  int64_t q, slot, pos;
};

__device__ __forceinline__ Entry decode_entry(const SparseArgs& a, uint64_t key, int64_t seq) {
  const uint64_t per_block = static_cast<uint64_t>(a.total_q * a.slots);
  const int64_t rest = static_cast<int64_t>(key % per_block);
  Entry entry;
  entry.q = rest / a.slots;
  entry.slot = rest % a.slots;
  const int64_t first = a.q_start[seq];
  const int64_t q_len = a.q_start[seq + 1] - first;
  entry.pos = a.k_len[seq] - q_len + (entry.q - first);
  return entry;
}

template <int D>
__global__ void __launch_bounds__(kSparseThreads)
    sparse_kv_major_kernel(const __grid_constant__ SparseArgs a) {
  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  const int B = static_cast<int>(a.block_size);
  uint16_t* k_smem = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* v_smem = k_smem + B * kPitch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = static_cast<int>(a.group);
  const uint64_t per_block = static_cast<uint64_t>(a.total_q * a.slots);

  const unsigned n_items = *a.item_count;
  for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WorkItem item = a.items[it];
    const uint64_t first_key = a.keys[item.first];
    const int64_t group_block = static_cast<int64_t>(first_key / per_block);
    const int64_t g = group_block / a.nblk, block = group_block % a.nblk;
    const int64_t q0 = static_cast<int64_t>((first_key % per_block) / a.slots);
    const int64_t seq = a.seq_of_query[q0];
    const int64_t block_first_key = block * B;

    // K and V of the block, once for every query of the item.
    const int64_t keys_left = a.k_len[seq] - block_first_key;
    const int valid_rows = static_cast<int>(keys_left < B ? keys_left : B);
    load_rows_async<D, kSparseThreads>(k_smem, block_pointer(a.k, seq, block, g), a.k.token_stride,
                                       B, valid_rows);
    load_rows_async<D, kSparseThreads>(v_smem, block_pointer(a.v, seq, block, g), a.v.token_stride,
                                       B, valid_rows);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    const int rows = item.count * G;
    for (int tile_row = warp * kWarpRows; tile_row < rows; tile_row += kSparseWarps * kWarpRows) {
      // This lane's two rows (lane / 4 and lane / 4 + 8 of the m-tile).
      bool valid[2];
      Entry entry[2];
      int head[2];
      const uint16_t* q_row[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int m = tile_row + lane / 4 + 8 * r;
        valid[r] = m < rows;
        const int mm = valid[r] ? m : rows - 1;  // padding rows mirror the last row
        entry[r] = decode_entry(a, a.keys[item.first + mm / G], seq);
        head[r] = mm % G;
        q_row[r] = valid[r] ? a.q + (entry[r].q * a.q_heads + g * G + head[r]) * D : nullptr;
      }
      // Rows are ordered by query, so the tile's positions grow with the row index.
      const int last_row = (tile_row + kWarpRows < rows ? tile_row + kWarpRows : rows) - 1;
      const int64_t min_pos = decode_entry(a, a.keys[item.first + tile_row / G], seq).pos;
      const int64_t max_pos = decode_entry(a, a.keys[item.first + last_row / G], seq).pos;

      uint32_t qf[D / 16][4];
      load_q_fragments<D>(qf, q_row[0], q_row[1]);
      WarpRowsState<D> state;
      state.init();
      for (int sub = 0; sub < B; sub += kKeyTile) {
        const int64_t tile_first_key = block_first_key + sub;
        if (tile_first_key > max_pos) break;  // no row sees this sub-tile (warp-uniform)
        const uint16_t* k_tile = k_smem + sub * kPitch;
        const uint16_t* v_tile = v_smem + sub * kPitch;
        if (tile_first_key + kKeyTile - 1 > min_pos)
          state.template attend<true>(qf, k_tile, v_tile, a.scale_log2,
                                      tile_limit(entry[0].pos, tile_first_key),
                                      tile_limit(entry[1].pos, tile_first_key));
        else
          state.template attend<false>(qf, k_tile, v_tile, a.scale_log2, kKeyTile, kKeyTile);
      }
      float inv[2], lse2[2];
      state.finish(inv, lse2);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!valid[r]) continue;
        const int64_t partial =
            ((entry[r].q * a.kv_heads + g) * a.slots + entry[r].slot) * G + head[r];
        state.store_row(a.partial_o + partial * D, r, inv[r]);
        if (lane % 4 == 0) a.partial_lse[partial] = lse2[r];
      }
    }
    __syncthreads();  // every warp is done with this block before the next item's loads
  }
}

}  // namespace msa::cuda::attn
