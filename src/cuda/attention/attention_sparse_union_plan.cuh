// The plan of the query-major sparse forward (attention_sparse_union.cuh): each 128-row
// tile's union of selected blocks. Launched by attention_sparse_union.cu only.
//
// tile_union_kernel builds the union of one (tile, group): grid (dense tiles, kv_heads), one
// CTA of kUnionThreads each. Its queries' selection rows (up to the first -1; ids outside
// [0, blocks the tile can see) are ignored: they select no visible key) set bits in a bitmap
// of the tile's visible blocks in shared memory; an exclusive popcount prefix over the bitmap
// words ranks each set block, so the union comes out sorted by block id (the kernel's key
// order: the sums are bitwise repeatable) and each selection entry finds its union slot in
// O(1) to set its query's bit. Duplicate ids in a row count once (a set, as the spec reads it).
#pragma once
#include <cstdint>

#include "cuda/attention/attention_dense_tiles.cuh"
#include "cuda/attention/attention_sparse_union.cuh"

namespace msa::cuda::attn {

constexpr int kUnionThreads = 128;

struct TileUnionArgs {
  const int32_t* topk;  // [kv_heads, total_q, slots]
  int64_t total_q, slots, kv_heads;
  const int64_t* tile_start;  // dense_tile_plan's, 128 rows per tile
  int64_t batch;
  const int64_t* q_start;
  const int64_t* k_len;
  int G;                // divides 128
  int bitmap_words;     // shared bitmap words: >= ceil(max visible blocks / 32)
  int64_t cap;          // union blocks kept per (tile, group): >= min(queries x slots, blocks)
  // Query-major iff query_major_pays (query_major_rule.h); else count -1 and the tile is
  // kv_major's.
  float max_pair_ratio;
  UnionBlock* blocks;
  int32_t* count;
  uint8_t* query_major;  // [kv_heads, total_q]: 1 where the query's tile runs query-major
};

// Shared memory of tile_union_kernel: bitmap and its prefix (2 x bitmap_words) and the union's
// query masks (cap).
inline size_t tile_union_smem_bytes(int bitmap_words, int64_t cap) {
  return (2 * static_cast<size_t>(bitmap_words) + static_cast<size_t>(cap)) * sizeof(uint32_t);
}

// Calls visit(query index in tile, block id) for every valid entry of the tile's queries'
// selection rows (entries before the row's first -1, ids in [0, blocks)); warp w takes
// queries w, w + 4, ..., 32 slots at a time.
template <class Visit>
__device__ __forceinline__ void for_each_tile_entry(const TileUnionArgs& a, const DenseTile& t, int64_t g,
                                                    int queries, int64_t blocks, Visit&& visit) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t first_query = t.first_q + t.first_row / a.G;
  for (int qi = warp; qi < queries; qi += kUnionThreads / 32) {
    const int32_t* row = a.topk + (g * a.total_q + first_query + qi) * a.slots;
    for (int64_t base = 0; base < a.slots; base += 32) {
      const int32_t id = base + lane < a.slots ? row[base + lane] : -1;
      const unsigned ended = __ballot_sync(0xffffffffu, id < 0);
      const bool before_end = ended == 0 || lane < __ffs(ended) - 1;
      if (before_end && id < blocks) visit(qi, id);
      if (ended != 0) break;
    }
  }
}

__global__ void __launch_bounds__(kUnionThreads) tile_union_kernel(const __grid_constant__ TileUnionArgs a) {
  extern __shared__ uint32_t union_smem[];
  uint32_t* bitmap = union_smem;             // [bitmap_words]
  uint32_t* prefix = bitmap + a.bitmap_words;  // [bitmap_words]: set bits in the words before
  uint32_t* masks = prefix + a.bitmap_words;   // [cap]
  const DenseTile t = dense_tile(a.tile_start, a.batch, a.q_start, a.k_len, a.G, kUnionTileRows, true);
  if (!t.valid) return;  // CTA-uniform
  const int64_t g = blockIdx.y;
  const int64_t at = static_cast<int64_t>(blockIdx.x) * a.kv_heads + g;
  const int64_t blocks = t.last_pos / kUnionKeys + 1;  // blocks any row of the tile can see
  const int words = static_cast<int>((blocks + 31) / 32);
  const int queries = static_cast<int>(t.last_row / a.G - t.first_row / a.G + 1);
  __shared__ uint32_t entries;  // valid selection entries of the tile's queries
  for (int i = threadIdx.x; i < words; i += kUnionThreads) bitmap[i] = 0;
  for (int64_t i = threadIdx.x; i < a.cap; i += kUnionThreads) masks[i] = 0;
  if (threadIdx.x == 0) entries = 0;
  __syncthreads();
  for_each_tile_entry(a, t, g, queries, blocks, [&](int, int32_t id) {
    atomicOr(&bitmap[id / 32], 1u << (id % 32));
    atomicAdd(&entries, 1u);
  });
  __syncthreads();
  // Exclusive prefix of the words' popcounts by warp 0, 32 words a round.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    uint32_t carry = 0;
    for (int base = 0; base < words; base += 32) {
      const uint32_t n = base + lane < words ? __popc(bitmap[base + lane]) : 0;
      uint32_t inclusive = n;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const uint32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      if (base + lane < words) prefix[base + lane] = carry + inclusive - n;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
  __syncthreads();
  const int32_t total = words > 0 ? static_cast<int32_t>(prefix[words - 1] + __popc(bitmap[words - 1])) : 0;
  const bool query_major = query_major_pays(total, entries, a.G, a.max_pair_ratio);
  const int64_t first_query = t.first_q + t.first_row / a.G;
  for (int qi = threadIdx.x; qi < queries; qi += kUnionThreads)
    a.query_major[g * a.total_q + first_query + qi] = query_major ? 1 : 0;
  if (!query_major) {  // kv_major's tile, CTA-uniform
    if (threadIdx.x == 0) a.count[at] = -1;
    return;
  }
  const auto rank = [&](int32_t id) {
    return prefix[id / 32] + __popc(bitmap[id / 32] & ((1u << (id % 32)) - 1u));
  };
  for_each_tile_entry(a, t, g, queries, blocks,
                      [&](int qi, int32_t id) { atomicOr(&masks[rank(id)], 1u << qi); });
  __syncthreads();
  UnionBlock* out = a.blocks + at * a.cap;
  for (int i = threadIdx.x; i < words; i += kUnionThreads) {
    uint32_t bits = bitmap[i];
    uint32_t r = prefix[i];
    while (bits != 0) {
      const int bit = __ffs(bits) - 1;
      bits &= bits - 1;
      out[r] = UnionBlock{32 * i + bit, masks[r]};
      ++r;
    }
  }
  if (threadIdx.x == 0) a.count[at] = total;
}

}  // namespace msa::cuda::attn
