// Host side of the selection inversion (selection_inversion.cuh), shared by the sparse
// forward (attention.cu), the sparse backward (src/cuda/training/attention_backward.cu) and
// the KL backward (src/cuda/training/indexer_kl.cu): the query chunking, the sizing and
// workspace regions of one chunk's inversion, and its launches.
//
// A chunk of chunk_q query rows of a selection topk [groups, total_q, slots] has
// E = groups * chunk_q * slots entries. Key = (group * nblk + block) << qbits | (chunk-local
// q * slots + slot), invalid_key = (groups * nblk) << qbits for a dead slot (sorts last).
// Regions, each 256-byte aligned: sorted keys 2 x E x 8 bytes (radix sort ping-pong), cub
// temp storage, item counter 4 bytes, work items item_bound x 8 bytes.
// invert_selection: build_selection_keys -> cub radix sort -> zero the item counter
// -> make_work_items, on the caller's stream (no allocation, no host synchronisation).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "cuda/launch.h"
#include "cuda/common/workspace_layout.h"

namespace msa::cuda {

namespace attn {
struct WorkItem;      // selection_inversion.cuh
struct SplitOutputs;  // selection_inversion.cuh
}

// Block count of the keys (>= 1); throws unless the key's group-block bits fit 30 bits.
int64_t selection_key_blocks(int64_t groups, int64_t max_k_len, int64_t block_size);

// Largest query chunk the inversion takes: fewer than 2^31 entries (cub's int count, int32
// item offsets; so q * slots < 2^31 too), at most total_q, at most `cap` when cap > 0, >= 1.
int64_t max_selection_chunk(int64_t total_q, int64_t groups, int64_t slots, int64_t cap);

// Largest chunk (<= max_chunk) whose plan_chunk(chunk).total fits `budget`, then equal
// chunks: per-query bytes dominate, so scale down to the budget, then shrink until it fits.
template <class PlanChunk>
auto fit_query_chunk(int64_t total_q, int64_t max_chunk, size_t budget, PlanChunk plan_chunk) {
  int64_t chunk = max_chunk;
  auto plan = plan_chunk(chunk);
  if (plan.total > budget && chunk > 1) {
    const long double per_query = static_cast<long double>(plan.total) / chunk;
    chunk = std::max<int64_t>(1, static_cast<int64_t>(budget / per_query));
    plan = plan_chunk(chunk);
    while (plan.total > budget && chunk > 1) {
      chunk = std::max<int64_t>(1, chunk - std::max<int64_t>(1, chunk / 64));
      plan = plan_chunk(chunk);
    }
  }
  const int64_t balanced = balanced_chunk(total_q, chunk);
  if (balanced < chunk) plan = plan_chunk(balanced);
  return plan;
}

// The inversion of chunks of chunk_q queries (the last chunk may be shorter) and its regions.
struct SelectionInversion {
  int64_t groups = 0, slots = 0, nblk = 0;
  int64_t chunk_q = 0, entries = 0;  // entries = groups * chunk_q * slots
  int qbits = 0, end_bit = 0;        // key low bits; bits the sort reads
  uint64_t invalid_key = 0;
  size_t cub_bytes = 0;
  int64_t item_bound = 0;  // work items of one chunk (the items region)
  size_t keys_in = 0, keys_out = 0, cub_temp = 0, item_count = 0, items = 0;  // offsets
};

// Sizes the inversion (key bits, cub temp bytes); its regions come from take_selection_regions.
SelectionInversion size_selection_inversion(int64_t groups, int64_t slots, int64_t nblk, int64_t chunk_q);

// Bound of the items of `entries` sorted entries cut into items of at most queries_per_item:
// each (group, sequence, block) segment ends at most one partial item.
inline int64_t packed_item_bound(const SelectionInversion& plan, int64_t entries, int64_t queries_per_item,
                                 int64_t batch) {
  const int64_t segments = std::min(entries, plan.groups * std::max<int64_t>(1, batch) * plan.nblk);
  return ceil_div(entries, queries_per_item) + segments;
}

// Takes the keys, cub temp, item counter and `item_bound` items regions, in that order.
void take_selection_regions(SelectionInversion& plan, int64_t item_bound, WorkspaceCursor& ws);

// One chunk's inverted selection in the workspace, as the kernels decode it.
struct SelectionChunk {
  int64_t q_begin = 0, chunk_q = 0, entries = 0;
  int64_t slots = 0, nblk = 0;
  int qbits = 0;
  const uint64_t* keys = nullptr;  // sorted keys of the chunk
  const attn::WorkItem* items = nullptr;
  const unsigned* item_count = nullptr;
};

// Inverts query rows [q_begin, q_begin + chunk_q) of topk into work items of at most
// queries_per_item entries (4 launches on `stream`). skip_rows ([groups, total_q] or null):
// rows flagged 1 contribute no entries (the query-major sparse forward's, attention.cu).
// split (or null): also records the segments cut into several items (attn::SplitOutputs; its
// counters are zeroed here, one more launch).
SelectionChunk invert_selection(const SelectionInversion& plan, const int32_t* topk, const BatchLayout& batch,
                                int64_t q_begin, int64_t chunk_q, int queries_per_item, char* workspace,
                                cudaStream_t stream, const uint8_t* skip_rows = nullptr,
                                const attn::SplitOutputs* split = nullptr);

// The selection fields of a kernel's arguments (attn::SparseArgs, kl::EntryArgs).
template <class Args>
void set_selection_chunk(Args& args, const SelectionChunk& chunk) {
  args.q_begin = chunk.q_begin;
  args.slots = chunk.slots;
  args.nblk = chunk.nblk;
  args.qbits = chunk.qbits;
  args.keys = chunk.keys;
  args.items = chunk.items;
  args.item_count = chunk.item_count;
}

}  // namespace msa::cuda
