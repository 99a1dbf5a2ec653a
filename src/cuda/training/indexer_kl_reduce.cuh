// KL backward of the indexer: fixed-order reductions of the per-entry / per-item partials
// written by kl_entries_kernel (indexer_kl_entries.cuh). Nothing here uses atomics, so the
// outputs are bitwise reproducible.
// - kl_row_reduce_kernel: one warp per (query, index head) row of the chunk: dqi = g x the
//   row's dqi partials summed in slot order; the row's loss = its loss partials in slot
//   order (double).
// - kl_dki_reduce_kernel (deterministic mode): one CTA per (sequence, key block): the item
//   partials of the block, head by head and in ascending query order, times g; the first
//   chunk writes dki (zero where no query selected the block), later chunks add. Holds the
//   whole B x Di block in registers (kDkiVectors float4 per thread).
// - kl_loss_reduce_kernel: one CTA sums the row losses (strided per thread, then a fixed
//   tree) and scales by c / (Hi * total_q).
#pragma once
#include "cuda/common/common.cuh"
#include "cuda/training/indexer_kl_entries.cuh"

namespace msa::cuda::kl {

constexpr int kRowWarps = 8;
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kMaxIndexHeads = 16;
constexpr int kReduceThreads = 256;

struct RowReduceArgs {
  const int32_t* topk;  // [Hi, total_q, slots]
  int64_t total_q, heads, slots, q_begin, chunk_q, index_dim;
  const float* dqi_partial;   // [chunk_q * Hi * slots, Di]
  const float* loss_partial;  // [chunk_q * Hi * slots]
  float grad_scale;
  float* dqi;        // [total_q, Hi, Di]
  double* row_loss;  // [total_q * Hi]
};

__global__ void __launch_bounds__(kRowThreads) kl_row_reduce_kernel(const RowReduceArgs a) {
  constexpr int kMaxColumns = 128 / 32;  // Di <= 128
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * kRowWarps + warp;  // chunk-local q * Hi + h
  if (row >= a.chunk_q * a.heads) return;
  const int64_t local_q = row / a.heads, h = row % a.heads, q = a.q_begin + local_q;
  const int32_t* selected = a.topk + (h * a.total_q + q) * a.slots;
  const int columns = static_cast<int>(a.index_dim / 32);
  float acc[kMaxColumns] = {0.0f, 0.0f, 0.0f, 0.0f};
  double loss = 0.0;
  for (int64_t s = 0; s < a.slots && selected[s] >= 0; ++s) {
    const int64_t partial = row * a.slots + s;
    const float* from = a.dqi_partial + partial * a.index_dim + lane;
#pragma unroll
    for (int c = 0; c < kMaxColumns; ++c)
      if (c < columns) acc[c] += from[32 * c];
    loss += a.loss_partial[partial];
  }
  float* out = a.dqi + (q * a.heads + h) * a.index_dim + lane;
#pragma unroll
  for (int c = 0; c < kMaxColumns; ++c)
    if (c < columns) out[32 * c] = a.grad_scale * acc[c];
  if (lane == 0) a.row_loss[q * a.heads + h] = loss;
}

struct DkiReduceArgs {
  const uint64_t* keys;  // sorted selection keys of the chunk
  int64_t entries;
  const int32_t* item_slot;   // item index by its first sorted entry
  const float* dki_partial;   // [items, B, Di]
  int64_t heads, nblk, slots, q_begin, chunk_q, index_dim, batch;
  int qbits, block_size;
  const int64_t* q_start;
  const int64_t* k_len;
  const int64_t* k_start;  // first packed token of each sequence
  float grad_scale;
  bool accumulate;  // false: the first chunk writes, true: later chunks add
  float* dki;       // [total_k, Di]
};

// First position in keys[0, n) whose key is >= value.
__device__ __forceinline__ int64_t lower_bound_key(const uint64_t* keys, int64_t n, uint64_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < value)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Each thread owns kDkiVectors float4 of the block's B x Di outputs (all of them at B = Di =
// 128) and walks the block's items once, in the fixed order, with all its loads of an item
// independent: 64 KB in flight per CTA. One element per thread and item at a time would keep
// a single dependent load in flight per thread, and the first blocks of each sequence have
// hundreds of items. The item slots are staged in
// shared memory a batch at a time. Per element the sum runs head by head, in ascending
// entries, as the partials were written: deterministic.
constexpr int kDkiVectors = 16;
constexpr int kDkiSlotBatch = kReduceThreads;

__global__ void __launch_bounds__(kReduceThreads) kl_dki_reduce_kernel(const DkiReduceArgs a) {
  __shared__ int64_t run_begin[kMaxIndexHeads], items_before[kMaxIndexHeads + 1];
  __shared__ int32_t slot_batch[kDkiSlotBatch];
  const int64_t seq = blockIdx.x / a.nblk, block = blockIdx.x % a.nblk;
  if (seq >= a.batch) return;
  const int B = a.block_size;
  const int64_t keys_left = a.k_len[seq] - block * B;
  if (keys_left <= 0) return;  // CTA-uniform, before any barrier
  const int64_t rows = keys_left < B ? keys_left : B;

  // The chunk-local queries of this sequence, and per head the sorted entries of
  // (head, block) among them: one segment of the inversion, cut into items of
  // kItemEntries entries starting at run_begin (make_work_items).
  if (threadIdx.x < a.heads) {
    const int64_t g = threadIdx.x;
    const int64_t first = a.q_start[seq] > a.q_begin ? a.q_start[seq] - a.q_begin : 0;
    const int64_t chunk_end = a.q_begin + a.chunk_q;
    const int64_t end = (a.q_start[seq + 1] < chunk_end ? a.q_start[seq + 1] : chunk_end) - a.q_begin;
    int64_t begin_at = 0, end_at = 0;
    if (first < end) {
      const uint64_t group_block = static_cast<uint64_t>(g * a.nblk + block) << a.qbits;
      begin_at = lower_bound_key(a.keys, a.entries, group_block | static_cast<uint64_t>(first * a.slots));
      end_at = lower_bound_key(a.keys, a.entries, group_block | static_cast<uint64_t>(end * a.slots));
    }
    run_begin[g] = begin_at;
    items_before[g + 1] = (end_at - begin_at + kItemEntries - 1) / kItemEntries;  // the head's items
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    items_before[0] = 0;
    for (int64_t g = 0; g < a.heads; ++g) items_before[g + 1] += items_before[g];
  }
  __syncthreads();
  const int64_t items = items_before[a.heads];

  const int64_t vectors = rows * a.index_dim / 4;  // Di is a multiple of 4
  const int64_t item_floats = int64_t{B} * a.index_dim;
  float4 acc[kDkiVectors];
#pragma unroll
  for (int v = 0; v < kDkiVectors; ++v) acc[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int64_t batch = 0; batch < items; batch += kDkiSlotBatch) {
    const int64_t mine = batch + threadIdx.x;  // item `mine` in order: head g, its (mine - items_before[g])-th
    if (mine < items) {
      int64_t g = 0;
      while (items_before[g + 1] <= mine) ++g;
      slot_batch[threadIdx.x] = a.item_slot[run_begin[g] + (mine - items_before[g]) * kItemEntries];
    }
    __syncthreads();
    const int64_t in_batch = items - batch < kDkiSlotBatch ? items - batch : kDkiSlotBatch;
    for (int64_t j = 0; j < in_batch; ++j) {
      const float4* item = reinterpret_cast<const float4*>(a.dki_partial + slot_batch[j] * item_floats);
#pragma unroll
      for (int v = 0; v < kDkiVectors; ++v) {
        const int64_t at = threadIdx.x + v * kReduceThreads;
        if (at < vectors) {
          const float4 p = item[at];
          acc[v].x += p.x;
          acc[v].y += p.y;
          acc[v].z += p.z;
          acc[v].w += p.w;
        }
      }
    }
    __syncthreads();  // slot_batch is rewritten by the next batch
  }

  float4* out = reinterpret_cast<float4*>(a.dki + (a.k_start[seq] + block * B) * a.index_dim);
  const float g = a.grad_scale;
#pragma unroll
  for (int v = 0; v < kDkiVectors; ++v) {
    const int64_t at = threadIdx.x + v * kReduceThreads;
    if (at >= vectors) continue;
    float4 value = make_float4(g * acc[v].x, g * acc[v].y, g * acc[v].z, g * acc[v].w);
    if (a.accumulate) {
      const float4 old = out[at];
      value = make_float4(old.x + value.x, old.y + value.y, old.z + value.z, old.w + value.w);
    }
    out[at] = value;
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    kl_loss_reduce_kernel(const double* row_loss, int64_t rows, double loss_scale, float* loss) {
  __shared__ double partial[kReduceThreads];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += kReduceThreads) sum += row_loss[i];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kReduceThreads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss[0] = static_cast<float>(loss_scale * partial[0]);
}

}  // namespace msa::cuda::kl
