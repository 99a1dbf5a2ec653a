// Sparse attention, KV-block-major (the MSA authors' "KV-outer"), forward.
//
// Plan (all on the device, graph-capturable, no host sync), per chunk of queries
// [q_begin, q_begin + chunk_q) (the launcher bounds the workspace by chunking, see attention.cu):
//   1. build_selection_keys: every (group g, chunk-local query q, slot s) entry of the selection
//      rows becomes a 64-bit key (g * nblk + block) << qbits | (q * slots + s), qbits =
//      bit_width(chunk_q * slots); entries at or after a row's first -1 get the key `invalid`
//      (= groups * nblk << qbits), which sorts last. Decoding is a shift, a mask and one 32-bit
//      division (no 64-bit division in the kernels).
//   2. cub::DeviceRadixSort::SortKeys over [0, end_bit) bits. Within one (group, block) run the
//      keys are ordered by query row, and queries of one sequence are contiguous rows, so each
//      (group, sequence, block) is one contiguous segment ordered by query row: a
//      deterministic CSR without a separate count/scan/fill.
//   3. make_work_items: the first entry of each segment finds the segment end by binary search
//      and appends ceil(len / queries_per_item) items {first entry, entry count} (atomic
//      append: the item *order* varies run to run, their content does not, and every item
//      writes only its own partials, so the outputs are bitwise deterministic).
//
// Attention kernel: persistent, one CTA of 8 warps (256 threads) per SM, items strided over
// CTAs. Tile plan:
//   - K and V of an item's block (B x D bf16 each, pitch D + 8) sit in shared memory, double
//     buffered: the next item's K/V are loaded with cp.async while the current item computes.
//   - the item's rows are its (entry, head) pairs flattened entry-major: row m = entry m / G,
//     head m % G; warp w takes the 16-row m-tiles w, w + 8, ... (one query's 16 heads for M3;
//     several queries per tile when G < 16, no padding waste).
//   - Q rows of a warp's m-tile are gathered from global memory with cp.async into a per-warp
//     double buffer (2 x 16 x (D + 8) bf16), one m-tile ahead (also across items), so the Q
//     latency is hidden behind the previous tile's MMAs; fragments come from ldmatrix.
//   - per m-tile: 64-key sub-tiles with the online softmax (attention_block_tile.cuh),
//     mma.sync m16n8k16; sub-tiles past the tile's last visible key are skipped, masks only
//     where a sub-tile crosses a row's position (the query's own block);
//   - each row writes a partial: O / l as bf16 (D values, staged through the warp's Q buffer
//     and written with coalesced 16-byte stores: one entry's G x D partial is contiguous) and
//     lse2 = m + log2 l (f32) at partial index ((q * kv_heads + g) * slots + s) * G + head.
//     attention_merge.cuh combines them in f32.
// Shared memory: 2 x 2 x B x (D + 8) x 2 + 8 x 2 x 16 x (D + 8) x 2 bytes = 208,896
// (B = D = 128), 110,592 (B = 128, D = 64), 139,264 (B = 64, D = 128): one CTA per SM.
//
// Bytes and FLOPs per (query, group, selected block) entry, M3 (G = 16, D = B = 128):
//   Q gather 4 KB (random queries: from HBM), partial O write 4 KB (bf16) + 64 B lse,
//   merge read 4 KB + 64 B; K/V 64 KB per item of up to 64 queries (mostly L2 hits:
//   an item's neighbours in the item list share its block) -> ~1 KB per entry.
//   FLOPs 4 x D x G x B = 1.05 MFLOP (causal: the local block half).
// At 128K (8.4M entries, 8.5 TFLOP): ~100 GB of HBM traffic -> ~24 ms floor at 4.2 TB/s
// (attention kernel ~68 GB overlapped with the MMAs, merge ~38 GB); MMAs at ~350-400 TFLOP/s
// (mma.sync, 8 warps/SM) -> ~22-24 ms. Budget: attention ~24-26 ms + merge ~9 ms + sort and
// plan ~1-2 ms = ~35 ms. 1M (chunks of ~32K queries, 67M entries, 70 TFLOP): ~0.3 s.
// Bottleneck: HBM bytes per entry (Q gather + bf16 partials) on random selections, then the
// mma.sync rate; hence the wgmma engine for D = B = 128 (m64 = 4 queries x 16 heads,
// attention_sparse_wgmma.cuh, whose header also weighs the ways to shrink the bytes).
#pragma once
#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/launch.h"
#include "cuda/attention/selection_inversion.cuh"

namespace msa::cuda::attn {

using PartialO = __nv_bfloat16;  // partial O element type (normalised O_s / l_s)

struct SparseArgs {
  const uint16_t* q;  // [total_q, q_heads, D]
  KeyLayout k, v;
  int64_t q_heads, kv_heads, group;  // group = q_heads / kv_heads <= 16
  int64_t block_size;
  const int64_t* q_start;
  const int64_t* k_len;
  const int32_t* seq_of_query;
  int64_t q_begin, slots, nblk;  // chunk's first query row
  int qbits;
  const uint64_t* keys;  // sorted selection keys of the chunk
  const WorkItem* items;
  const unsigned* item_count;
  float scale_log2;
  PartialO* partial_o;  // [chunk_q, kv_heads, slots, group, D]
  float* partial_lse;   // [chunk_q, kv_heads, slots, group] (log2 domain)
};

constexpr int kSparseWarps = 8;
constexpr int kSparseThreads = kSparseWarps * 32;

template <int D>
__host__ __device__ constexpr size_t sparse_smem_bytes(int64_t block_size) {
  return (2 * 2 * static_cast<size_t>(block_size) + kSparseWarps * 2 * kWarpRows) * smem_pitch<D>() *
         sizeof(uint16_t);
}

// One entry of an item, decoded (q is the global query row).
struct Entry {
  int64_t q, pos;
  int slot;
};

// The item's (group, block, sequence), decoded from its first key.
struct ItemInfo {
  int64_t g, block, seq;
  int64_t pos_offset;  // position of global query row q = q + pos_offset
  int first, rows;
};

// decode_item's dependent loads, in order: the item, its first selection key, the sequence
// of that key's query (item_seq), then the sequence's geometry (item_info).
__device__ __forceinline__ int64_t item_seq(const SparseArgs& a, uint64_t first_key) {
  const uint32_t rest = static_cast<uint32_t>(first_key & ((uint64_t{1} << a.qbits) - 1));
  return a.seq_of_query[a.q_begin + rest / static_cast<uint32_t>(a.slots)];
}
__device__ __forceinline__ ItemInfo item_info(const SparseArgs& a, const WorkItem& item, uint64_t first_key,
                                              int64_t seq, int G) {
  const int64_t group_block = static_cast<int64_t>(first_key >> a.qbits);
  ItemInfo info;
  info.g = group_block / a.nblk;
  info.block = group_block % a.nblk;
  info.seq = seq;
  const int64_t seq_first = a.q_start[info.seq];
  info.pos_offset = a.k_len[info.seq] - (a.q_start[info.seq + 1] - seq_first) - seq_first;
  info.first = item.first;
  info.rows = item.count * G;
  return info;
}
__device__ __forceinline__ ItemInfo decode_item(const SparseArgs& a, unsigned it, int G) {
  const WorkItem item = a.items[it];
  const uint64_t first_key = a.keys[item.first];
  return item_info(a, item, first_key, item_seq(a, first_key), G);
}

__device__ __forceinline__ Entry decode_entry(const SparseArgs& a, uint64_t key, int64_t pos_offset) {
  const uint32_t rest = static_cast<uint32_t>(key & ((uint64_t{1} << a.qbits) - 1));
  const uint32_t slots = static_cast<uint32_t>(a.slots);
  const uint32_t ql = rest / slots;
  Entry entry;
  entry.q = a.q_begin + ql;
  entry.slot = static_cast<int>(rest - ql * slots);
  entry.pos = entry.q + pos_offset;
  return entry;
}

// K and V of the item's block into one K/V buffer (rows past the sequence end zero-filled).
template <int D>
__device__ __forceinline__ void load_item_kv(const SparseArgs& a, const ItemInfo& info, uint16_t* k_smem,
                                             uint16_t* v_smem, int B) {
  const int64_t keys_left = a.k_len[info.seq] - info.block * B;
  const int valid_rows = static_cast<int>(keys_left < B ? keys_left : B);
  load_rows_async<D, kSparseThreads>(k_smem, block_pointer(a.k, info.seq, info.block, info.g),
                                     a.k.token_stride, B, valid_rows);
  load_rows_async<D, kSparseThreads>(v_smem, block_pointer(a.v, info.seq, info.block, info.g),
                                     a.v.token_stride, B, valid_rows);
}

// One warp gathers the Q rows of m-tile rows [tile_row, tile_row + 16) of an item into `dst`
// (16 rows at pitch D + 8) with cp.async; rows past the item's rows are zero-filled. Lanes
// 0..15 decode one row each, the row's global Q address is shuffled to the copying lanes.
template <int D>
__device__ __forceinline__ void prefetch_q_tile(const SparseArgs& a, const ItemInfo& info, int tile_row,
                                                int G, uint16_t* dst) {
  const int lane = threadIdx.x % 32;
  const int m = tile_row + (lane % 16);
  const bool valid = m < info.rows;
  int64_t offset = 0;  // element offset of the row in q
  if (valid) {
    const uint64_t key = a.keys[info.first + m / G];
    const uint32_t rest = static_cast<uint32_t>(key & ((uint64_t{1} << a.qbits) - 1));
    const int64_t q = a.q_begin + rest / static_cast<uint32_t>(a.slots);
    offset = (q * a.q_heads + info.g * G + m % G) * D;
  }
  constexpr int kChunks = D / 8;              // 16-byte chunks per row
  constexpr int kRowsPerPass = 32 / kChunks;  // rows covered by one pass of the warp
#pragma unroll
  for (int pass = 0; pass < kWarpRows / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + lane / kChunks;
    const int col = (lane % kChunks) * 8;
    const int64_t row_offset = __shfl_sync(0xffffffffu, offset, row);
    const bool row_valid = tile_row + row < info.rows;
    cp_async_16(dst + row * smem_pitch<D>() + col, row_valid ? a.q + row_offset + col : a.q, row_valid);
  }
}

template <int D>
__global__ void __launch_bounds__(kSparseThreads, 1)
    sparse_kv_major_kernel(const __grid_constant__ SparseArgs a) {
  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  const int B = static_cast<int>(a.block_size);
  uint16_t* kv_smem = reinterpret_cast<uint16_t*>(smem_raw);  // [2 buffers][K, V][B][kPitch]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint16_t* q_smem = kv_smem + 4 * B * kPitch + warp * 2 * kWarpRows * kPitch;  // [2][16][kPitch]
  const int G = static_cast<int>(a.group);
  constexpr int kStride = kSparseWarps * kWarpRows;  // rows between a warp's m-tiles

  const unsigned n_items = *a.item_count;
  unsigned it = blockIdx.x;
  if (it >= n_items) return;

  // cp.async group order per thread (the waits below count on it):
  //   KV(item 0), Q(first tile of item 0) | per item j: KV(j + 1), [Q(first tile of j + 1)
  //   if the warp has no tile in j], then per tile i: Q(tile i + 1, or first tile of j + 1).
  ItemInfo cur = decode_item(a, it, G);
  load_item_kv<D>(a, cur, kv_smem, kv_smem + B * kPitch, B);
  cp_async_commit();
  if (warp * kWarpRows < cur.rows) prefetch_q_tile<D>(a, cur, warp * kWarpRows, G, q_smem);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  int buf = 0, q_slot = 0;
  for (;;) {
    const unsigned next_it = it + gridDim.x;
    const bool has_next = next_it < n_items;
    ItemInfo nxt{};
    if (has_next) {
      nxt = decode_item(a, next_it, G);
      uint16_t* k_next = kv_smem + (1 - buf) * 2 * B * kPitch;
      load_item_kv<D>(a, nxt, k_next, k_next + B * kPitch, B);
    }
    cp_async_commit();
    const bool next_q = has_next && warp * kWarpRows < nxt.rows;
    if (warp * kWarpRows >= cur.rows) {  // no tile here: prefetch the next item's first tile now
      if (next_q) prefetch_q_tile<D>(a, nxt, warp * kWarpRows, G, q_smem + q_slot * kWarpRows * kPitch);
      cp_async_commit();
    }

    const uint16_t* k_smem = kv_smem + buf * 2 * B * kPitch;
    const uint16_t* v_smem = k_smem + B * kPitch;
    const int64_t block_first_key = cur.block * B;
    bool first_tile = true;
    for (int tile_row = warp * kWarpRows; tile_row < cur.rows; tile_row += kStride) {
      // Prefetch the warp's next Q tile into the other slot.
      uint16_t* q_next = q_smem + (1 - q_slot) * kWarpRows * kPitch;
      if (tile_row + kStride < cur.rows)
        prefetch_q_tile<D>(a, cur, tile_row + kStride, G, q_next);
      else if (next_q)
        prefetch_q_tile<D>(a, nxt, warp * kWarpRows, G, q_next);
      cp_async_commit();

      // This lane's two rows (lane / 4 and lane / 4 + 8 of the m-tile).
      bool valid[2];
      Entry entry[2];
      int head[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int m = tile_row + lane / 4 + 8 * r;
        valid[r] = m < cur.rows;
        const int mm = valid[r] ? m : cur.rows - 1;  // padding rows mirror the last row
        entry[r] = decode_entry(a, a.keys[cur.first + mm / G], cur.pos_offset);
        head[r] = mm % G;
      }
      // Rows are ordered by query, so the tile's positions grow with the row index.
      const int last_row = (tile_row + kWarpRows < cur.rows ? tile_row + kWarpRows : cur.rows) - 1;
      const int64_t min_pos = decode_entry(a, a.keys[cur.first + tile_row / G], cur.pos_offset).pos;
      const int64_t max_pos = decode_entry(a, a.keys[cur.first + last_row / G], cur.pos_offset).pos;

      if (first_tile)
        cp_async_wait<2>();  // pending: KV(next item), Q(next tile)
      else
        cp_async_wait<1>();  // pending: Q(next tile)
      first_tile = false;
      __syncwarp();

      uint16_t* q_tile = q_smem + q_slot * kWarpRows * kPitch;
      uint32_t qf[D / 16][4];
      {
        const uint16_t* q_row = q_tile + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
#pragma unroll
        for (int k = 0; k < D / 16; ++k) ldmatrix_x4(qf[k], q_row + k * 16);
      }
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

      // Stage O / l as bf16 in the (consumed) Q tile, then coalesced 16-byte stores: the
      // tile's rows of one entry are consecutive partial rows.
      __syncwarp();  // every lane's ldmatrix of q_tile is done
      state.store_row_bf16_smem(q_tile + (lane / 4) * kPitch, 0, inv[0]);
      state.store_row_bf16_smem(q_tile + (lane / 4 + 8) * kPitch, 1, inv[1]);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (valid[r] && lane % 4 == 0)
          a.partial_lse[((entry[r].q - a.q_begin) * a.kv_heads + cur.g) * a.slots * G +
                        entry[r].slot * G + head[r]] = lse2[r];
      __syncwarp();
      {
        constexpr int kChunks = D / 8;
        constexpr int kRowsPerPass = 32 / kChunks;
        // Partial row index of m-tile row `row`: lanes 0..15 hold rows 0..15's indices.
        int64_t partial = -1;
        {
          const int m = tile_row + (lane % 16);
          if (m < cur.rows) {
            const Entry e = decode_entry(a, a.keys[cur.first + m / G], cur.pos_offset);
            partial = ((e.q - a.q_begin) * a.kv_heads + cur.g) * a.slots * G + e.slot * G + m % G;
          }
        }
#pragma unroll
        for (int pass = 0; pass < kWarpRows / kRowsPerPass; ++pass) {
          const int row = pass * kRowsPerPass + lane / kChunks;
          const int col = (lane % kChunks) * 8;
          const int64_t row_partial = __shfl_sync(0xffffffffu, partial, row);
          if (row_partial >= 0)
            *reinterpret_cast<uint4*>(a.partial_o + row_partial * D + col) =
                *reinterpret_cast<const uint4*>(q_tile + row * kPitch + col);
        }
      }
      __syncwarp();  // the staged tile is read before a later prefetch overwrites the slot
      q_slot ^= 1;
    }
    if (!has_next) break;
    cp_async_wait<1>();  // KV(next item) landed (only the warp's next Q tile may be pending)
    __syncthreads();     // every warp is done with `buf` and sees the next K/V
    it = next_it;
    cur = nxt;
    buf ^= 1;
  }
  cp_async_wait<0>();
}

}  // namespace msa::cuda::attn
