// Host side of the selection inversion: see selection_inversion.h.
#include "cuda/attention/selection_inversion.h"

#include <cub/device/device_radix_sort.cuh>

#include "cuda/common/cuda_check.h"
#include "cuda/attention/selection_inversion.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr int kThreads = 256;  // build_selection_keys, make_work_items

int bit_width(uint64_t value) {
  int bits = 0;
  while (value) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

}  // namespace

int64_t selection_key_blocks(int64_t groups, int64_t max_k_len, int64_t block_size) {
  const int64_t nblk = std::max<int64_t>(1, ceil_div(max_k_len, block_size));
  if (bit_width(static_cast<uint64_t>(groups * nblk)) > 30)
    throw_arg_error("max_k_len", "fewer than 2^30 (kv_heads x blocks)", groups * nblk);
  return nblk;
}

int64_t max_selection_chunk(int64_t total_q, int64_t groups, int64_t slots, int64_t cap) {
  int64_t chunk = std::min<int64_t>(total_q, ((int64_t{1} << 31) - 1) / (groups * slots));
  if (cap > 0) chunk = std::min(chunk, cap);
  return std::max<int64_t>(chunk, 1);
}

SelectionInversion size_selection_inversion(int64_t groups, int64_t slots, int64_t nblk, int64_t chunk_q) {
  SelectionInversion plan;
  plan.groups = groups;
  plan.slots = slots;
  plan.nblk = nblk;
  plan.chunk_q = chunk_q;
  plan.entries = groups * chunk_q * slots;
  plan.qbits = std::max(1, bit_width(static_cast<uint64_t>(chunk_q * slots)));
  plan.end_bit = plan.qbits + bit_width(static_cast<uint64_t>(groups * nblk));
  plan.invalid_key = static_cast<uint64_t>(groups * nblk) << plan.qbits;
  if (plan.entries > 0 && plan.entries < (int64_t{1} << 31)) {
    uint64_t* null_keys = nullptr;
    MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, plan.cub_bytes, null_keys, null_keys,
                                                  static_cast<int>(plan.entries), 0, plan.end_bit));
  }
  return plan;
}

void take_selection_regions(SelectionInversion& plan, int64_t item_bound, WorkspaceCursor& ws) {
  plan.item_bound = item_bound;
  plan.keys_in = ws.take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.keys_out = ws.take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.cub_temp = ws.take(plan.cub_bytes);
  plan.item_count = ws.take(sizeof(unsigned));
  plan.items = ws.take(static_cast<size_t>(item_bound) * sizeof(attn::WorkItem));
}

SelectionChunk invert_selection(const SelectionInversion& plan, const int32_t* topk, const BatchLayout& batch,
                                int64_t q_begin, int64_t chunk_q, int queries_per_item, char* workspace,
                                cudaStream_t stream, const uint8_t* skip_rows,
                                const attn::SplitOutputs* split) {
  uint64_t* keys_in = reinterpret_cast<uint64_t*>(workspace + plan.keys_in);
  uint64_t* keys_out = reinterpret_cast<uint64_t*>(workspace + plan.keys_out);
  unsigned* item_count = reinterpret_cast<unsigned*>(workspace + plan.item_count);
  attn::WorkItem* items = reinterpret_cast<attn::WorkItem*>(workspace + plan.items);
  const int64_t rows = plan.groups * chunk_q, entries = rows * plan.slots;
  const attn::SparsePlanArgs args{topk,    plan.groups, batch.total_q, plan.slots,      plan.nblk,
                                  q_begin, chunk_q,     plan.qbits,    plan.invalid_key,
                                  skip_rows};
  attn::build_selection_keys<<<static_cast<unsigned>(ceil_div(rows, kThreads)), kThreads, 0, stream>>>(args,
                                                                                                       keys_in);
  MSA_CUDA_CHECK_LAUNCH();
  size_t cub_bytes = plan.cub_bytes;
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(workspace + plan.cub_temp, cub_bytes, keys_in, keys_out,
                                                static_cast<int>(entries), 0, plan.end_bit, stream));
  MSA_CUDA_CHECK(cudaMemsetAsync(item_count, 0, sizeof(unsigned), stream));
  if (split) MSA_CUDA_CHECK(cudaMemsetAsync(split->counts, 0, 2 * sizeof(unsigned), stream));
  attn::make_work_items<<<static_cast<unsigned>(ceil_div(entries, kThreads)), kThreads, 0, stream>>>(
      args, keys_out, entries, batch.q_start, batch.seq_of_query, queries_per_item, items, item_count,
      split ? *split : attn::SplitOutputs{});
  MSA_CUDA_CHECK_LAUNCH();

  return {q_begin, chunk_q, entries, plan.slots, plan.nblk, plan.qbits, keys_out, items, item_count};
}

}  // namespace msa::cuda
