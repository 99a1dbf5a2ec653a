// Inversion of the selection rows into per-(group, block, sequence) runs of queries: the
// plan steps 1-3 of attention_sparse_kv_major.cuh (keys -> cub radix sort -> work items),
// shared by the sparse forward, the sparse backward and the KL backward. Launched only by
// selection_inversion.cu (host side: selection_inversion.h); the kernels are `static` so that
// the kernel headers that read WorkItem can include this header in several .cu files.
#pragma once
#include <cstdint>

namespace msa::cuda::attn {

struct SparsePlanArgs {
  const int32_t* topk;  // [groups, topk_rows, slots]
  int64_t groups, topk_rows, slots, nblk;
  int64_t q_begin, chunk_q;  // the chunk's first query row and its query count
  int qbits;                 // key low bits: chunk-local q * slots + s
  uint64_t invalid_key;
  const uint8_t* skip = nullptr;  // [groups, topk_rows] or null: rows (1) whose entries get invalid_key
};

static __global__ void build_selection_keys(SparsePlanArgs a, uint64_t* keys) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= a.groups * a.chunk_q) return;
  const int64_t g = idx / a.chunk_q, q = idx % a.chunk_q;
  const int32_t* row = a.topk + (g * a.topk_rows + a.q_begin + q) * a.slots;
  uint64_t* out = keys + idx * a.slots;
  bool live = a.skip == nullptr || a.skip[g * a.topk_rows + a.q_begin + q] == 0;
  for (int64_t s = 0; s < a.slots; ++s) {
    const int32_t block = row[s];
    live = live && block >= 0;
    out[s] = live ? (static_cast<uint64_t>(g * a.nblk + block) << a.qbits) |
                        static_cast<uint64_t>(q * a.slots + s)
                  : a.invalid_key;
  }
}

struct WorkItem {
  int32_t first;  // index of the item's first entry in the sorted keys
  int32_t count;  // entries (queries) in the item
};

// A segment cut into more than one item (its pieces), for consumers that sum the pieces in a
// fixed order (the sparse backward's dK / dV): they own slots [first_slot, first_slot +
// pieces), in entry order.
struct SplitSegment {
  int32_t first_entry;  // the segment's first entry in the sorted keys
  int32_t first_slot;
  int32_t pieces;
};

// Optional outputs of make_work_items (piece_slot null: none). piece_slot[item] = the item's
// slot when its segment is split, else -1; counts[0] = split segments, counts[1] = slots (both
// zeroed before). Slots and split segments are numbered in atomic order, but a segment's
// pieces are consecutive in entry order, so a sum over its slots has a fixed order.
struct SplitOutputs {
  int32_t* piece_slot = nullptr;
  SplitSegment* segments = nullptr;
  unsigned* counts = nullptr;
};

static __global__ void make_work_items(SparsePlanArgs a, const uint64_t* keys, int64_t entries,
                                const int64_t* q_start, const int32_t* seq_of_query,
                                int queries_per_item, WorkItem* items, unsigned* item_count,
                                SplitOutputs split) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  const uint64_t key = keys[e];
  if (key >= a.invalid_key) return;
  const uint64_t mask = (uint64_t{1} << a.qbits) - 1;
  const uint64_t group_block = key >> a.qbits;
  const int64_t q = static_cast<int64_t>(key & mask) / a.slots;  // chunk-local
  const int32_t seq = seq_of_query[a.q_begin + q];
  if (e > 0) {
    const uint64_t prev = keys[e - 1];
    if ((prev >> a.qbits) == group_block &&
        seq_of_query[a.q_begin + static_cast<int64_t>(prev & mask) / a.slots] == seq)
      return;  // not the first entry of its segment
  }
  // Segment end: first key >= (group_block, first query of the next sequence or chunk end).
  const int64_t seq_end = q_start[seq + 1] - a.q_begin;
  const int64_t local_end = seq_end < a.chunk_q ? seq_end : a.chunk_q;
  const uint64_t end_key = (group_block << a.qbits) | static_cast<uint64_t>(local_end * a.slots);
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
  if (split.piece_slot == nullptr) return;
  if (n == 1) {
    split.piece_slot[base] = -1;
    return;
  }
  const unsigned slot = atomicAdd(split.counts + 1, static_cast<unsigned>(n));
  split.segments[atomicAdd(split.counts, 1u)] = {static_cast<int32_t>(e), static_cast<int32_t>(slot),
                                                 static_cast<int32_t>(n)};
  for (int64_t c = 0; c < n; ++c) split.piece_slot[base + c] = static_cast<int32_t>(slot + c);
}

}  // namespace msa::cuda::attn
