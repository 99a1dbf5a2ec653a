// The selection rule of docs/msa.md §3 on the device: a row's geometry (own block, candidate
// range), a bounded best-first list of (block max, block id) candidates and an unsorted
// one sorted at the end, a warp merge of such lists, and the layout of a selection row.
// Matches src/ops/selection.cpp exactly: rank by block max descending, equal maxima to the
// lower block id.
#pragma once
#include "cuda/common/common.cuh"
#include "cuda/launch.h"

namespace msa::cuda::indexer_detail {

constexpr int kMaxTopk = 32;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
constexpr int32_t kNoBlock = 0x7fffffff;  // "no entry": loses every comparison

// (value, id) ordering of the ranking: higher value first, equal values lower id first.
// An entry with id kNoBlock is worse than every real entry.
__device__ __forceinline__ bool ranks_before(float value, int32_t id, float other_value,
                                             int32_t other_id) {
  if (id == kNoBlock) return false;
  if (other_id == kNoBlock) return true;
  return value > other_value || (value == other_value && id < other_id);
}

__device__ __forceinline__ float sanitize_score(float value) {
  return value != value ? kNegInf : value;  // NaN ranks last (a total order)
}

// Entry keys (the decode select and select_rows_kernel): one u64 compare instead of
// ranks_before. High word: the value's order bits
// (NaN read as -inf, -0 as +0 so that equal values tie); low word: ~id (equal values: the
// lower id is the larger key). Every real entry's key is >= 2^32 (-inf: 0x007fffff'...);
// an entry outside the row has order bits 0.
__device__ __forceinline__ uint32_t order_bits(float value) {
  const uint32_t bits = __float_as_uint(sanitize_score(value) + 0.0f);  // + 0: -0 -> +0
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}
__device__ __forceinline__ uint64_t entry_key(uint32_t order, int32_t id) {
  return (static_cast<uint64_t>(order) << 32) | static_cast<uint32_t>(~id);
}
__device__ __forceinline__ int32_t key_id(uint64_t key) {
  return static_cast<int32_t>(~static_cast<uint32_t>(key));
}
constexpr uint64_t kEveryEntry = uint64_t{1} << 32;  // threshold admitting every real entry

// Where one query row stands: sequence, position, own block L and its ranked candidates
// [cand_begin, cand_end) = blocks j < L that are neither init (j < init) nor local
// (j >= L - local + 1). Empty when cand_end <= cand_begin.
struct RowGeometry {
  int64_t seq = 0, pos = 0;
  int32_t own_block = 0, cand_begin = 0, cand_end = 0;
};

// `seq` = p.batch.seq_of_query[query], passed in by callers that load it early.
__device__ __forceinline__ RowGeometry row_geometry(const IndexerLaunch& p, int64_t query,
                                                    int64_t seq) {
  RowGeometry row;
  row.seq = seq;
  const int64_t q_begin = p.batch.q_start[row.seq];
  const int64_t q_len = p.batch.q_start[row.seq + 1] - q_begin;
  row.pos = p.batch.k_len[row.seq] - q_len + (query - q_begin);
  row.own_block = static_cast<int32_t>(row.pos / p.block_size);
  row.cand_begin = p.init_blocks;
  row.cand_end = row.own_block - p.local_blocks + 1;
  return row;
}

__device__ __forceinline__ RowGeometry row_geometry(const IndexerLaunch& p, int64_t query) {
  return row_geometry(p, query, p.batch.seq_of_query[query]);
}

// Slot `slot` of a selection row (selection.cpp write_row): init blocks ascending, the
// `n_ranked` ranked ids, the other local blocks ascending, the own block, then -1.
__device__ __forceinline__ int32_t selection_slot(int slot, const IndexerLaunch& p,
                                                  int32_t own_block, const int32_t* ranked,
                                                  int n_ranked) {
  const int32_t init_end = min(p.init_blocks, own_block + 1);
  const int32_t local_begin = max(0, own_block - p.local_blocks + 1);
  const int n_init = min(init_end, local_begin);
  if (slot < n_init) return slot;
  slot -= n_init;
  if (slot < n_ranked) return ranked[slot];
  slot -= n_ranked;
  if (slot <= own_block - local_begin) return local_begin + slot;
  return -1;
}

// A best-first list of at most `capacity` candidates in shared memory, owned by ONE thread
// (no synchronisation). Ids must be offered in ascending order: then "insert only when
// strictly greater than the current minimum" and "evict the last entry" keep exactly the
// best `capacity` of everything offered under ranks_before (an equal value offered later
// has a higher id, so it ranks after every entry it ties with). Entries are sorted best
// first; equal values keep ascending ids. Optionally each entry carries a float payload
// (insert<true> / offer<true>; the training scan keeps the block's sum-exp there) that
// moves with its entry; the default <false> calls never touch `payload`.
struct TopList {
  float* values;
  int32_t* ids;
  float* payload;  // null unless the <true> calls are used
  int capacity;
  int count;
  float threshold;  // values[capacity - 1] once full; +inf for an empty capacity

  __device__ __forceinline__ void init(float* v, int32_t* i, int cap, float* extra = nullptr) {
    values = v;
    ids = i;
    payload = extra;
    capacity = cap;
    count = 0;
    threshold = cap > 0 ? kNegInf : -kNegInf;
  }
  // The common case (full list, value below the threshold) costs one compare.
  __device__ __forceinline__ bool wants(float value) const {
    return count < capacity || value > threshold;
  }
  // Precondition: wants(value). kPayload: `extra` is stored in payload[] with the entry.
  template <bool kPayload = false>
  __device__ void insert(float value, int32_t id, float extra = 0.0f) {
    int slot = count < capacity ? count++ : capacity - 1;  // append, or evict the last
    while (slot > 0 && values[slot - 1] < value) {
      values[slot] = values[slot - 1];
      ids[slot] = ids[slot - 1];
      if constexpr (kPayload) payload[slot] = payload[slot - 1];
      --slot;
    }
    values[slot] = value;
    ids[slot] = id;
    if constexpr (kPayload) payload[slot] = extra;
    if (count == capacity) threshold = values[capacity - 1];
  }
  template <bool kPayload = false>
  __device__ __forceinline__ void offer(float value, int32_t id, float extra = 0.0f) {
    if (wants(value)) insert<kPayload>(value, id, extra);
  }
};

// The best `capacity` candidates of one row, unsorted, with the worst entry tracked (the
// smallest value; among equal values the highest id, which ranks last). Owned by one thread.
// Offered ids ascend, so an entry enters only when strictly better than the worst (an equal
// value offered later ranks after it): exactly the set TopList keeps. sort_best_first()
// orders it as TopList does (value descending, equal values by ascending id). Why (the fp8
// scan, indexer_scan_producer.cuh): an insert is a batched rescan, not TopList's dependent
// shift of ~40-50 clocks per entry, which stalled the scan's epilogue.
struct TopSet {
  float* values;
  int32_t* ids;
  int capacity;
  int count;
  int worst;        // slot of the worst entry once full
  float threshold;  // its value once full; -inf before; +inf for an empty capacity

  __device__ __forceinline__ void init(float* v, int32_t* i, int cap) {
    values = v;
    ids = i;
    capacity = cap;
    count = 0;
    worst = 0;
    threshold = cap > 0 ? kNegInf : -kNegInf;
  }
  __device__ __forceinline__ bool wants(float value) const {
    return count < capacity || value > threshold;
  }
  // Batches of 8 independent (predicated, branch-free) loads: the rescan of a 15-entry list
  // costs ~2 shared-memory round trips, not one per entry.
  __device__ __forceinline__ void find_worst() {
    constexpr int kBatch = 8;
    float worst_value = -kNegInf;
    int32_t worst_id = -1;
    int slot = 0;
    for (int base = 0; base < capacity; base += kBatch) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int k = base + u;
        const bool valid = k < capacity;
        const float v = values[valid ? k : 0];
        const int32_t id = ids[valid ? k : 0];
        if (valid && (v < worst_value || (v == worst_value && id > worst_id))) {
          worst_value = v;
          worst_id = id;
          slot = k;
        }
      }
    }
    worst = slot;
    threshold = worst_value;
  }
  // Precondition: wants(value).
  __device__ __forceinline__ void insert(float value, int32_t id) {
    const int slot = count < capacity ? count++ : worst;
    values[slot] = value;
    ids[slot] = id;
    if (count == capacity) find_worst();
  }
  __device__ __forceinline__ void offer(float value, int32_t id) {
    if (wants(value)) insert(value, id);
  }
  __device__ void sort_best_first() {  // once per row, at the end (insertion sort)
    for (int i = 1; i < count; ++i) {
      const float v = values[i];
      const int32_t id = ids[i];
      int j = i;
      while (j > 0 && ranks_before(v, id, values[j - 1], ids[j - 1])) {
        values[j] = values[j - 1];
        ids[j] = ids[j - 1];
        --j;
      }
      values[j] = v;
      ids[j] = id;
    }
  }
};

// Merges the 32 sorted lists of a warp (one per lane) into the best `capacity` entries,
// written best first to `merged` (shared or global, written by lane 0); returns how many.
// Each round is a warp argmax over the lists' heads; ids are unique, so exactly one lane
// pops its head.
static __device__ int warp_merge_lists(const TopList& list, int capacity, int32_t* merged) {
  const int lane = threadIdx.x % 32;
  int head = 0, n = 0;
  for (; n < capacity; ++n) {
    float best_value = head < list.count ? list.values[head] : kNegInf;
    int32_t best_id = head < list.count ? list.ids[head] : kNoBlock;
    const int32_t my_id = best_id;
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_value = __shfl_xor_sync(0xffffffffu, best_value, offset);
      const int32_t other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (ranks_before(other_value, other_id, best_value, best_id)) {
        best_value = other_value;
        best_id = other_id;
      }
    }
    // Lane 0's answer for everyone: a NaN value (no total order) must not split the warp.
    best_id = __shfl_sync(0xffffffffu, best_id, 0);
    if (best_id == kNoBlock) break;  // every list is exhausted
    if (my_id == best_id) ++head;
    if (lane == 0) merged[n] = best_id;
  }
  return n;
}

}  // namespace msa::cuda::indexer_detail
