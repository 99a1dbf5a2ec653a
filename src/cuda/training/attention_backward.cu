// Host launcher of the main-branch backward (backward_launch.h).
//
// Every call: cudaMemsetAsync(dk, dv) -> backward_rows_kernel (Delta, LSE2), then
//   sparse (topk given), per query chunk (attention_backward_kv_major.cuh):
//     build_selection_keys -> cub radix sort -> make_work_items (items of at most
//     item_entries entries of one (group, sequence, block) segment, selection_inversion.h)
//     -> backward_kv_kernel (or, for D = B = 128, backward_kv_wgmma_kernel:
//     use_backward_wgmma) -> add_split_grads_kernel (the dK / dV of segments cut into
//     several items) [-> merge_dq_partials_kernel when deterministic];
//   dense (topk null): backward_kv_kernel over every (sequence, group, block)
//     [-> dense_tile_plan -> dense_dq_kernel when deterministic].
//   Fast mode (deterministic = false) zeroes dq first and the KV kernel adds dQ atomically.
//   Sparse with kl_teacher: the KV kernel also writes the KL's teacher of every entry it
//   computes (write_kl_teacher; the wgmma kernel's backward_kv_wgmma_kernel<true>).
// Nothing here synchronises with the host or allocates.
//
// Workspace, each region 256-byte aligned:
//   Delta and LSE2, 2 x total_q * q_heads x 4 bytes;
//   sparse, sized for one chunk of C queries (E = kv_heads * C * slots entries):
//     sorted keys 2 x E x 8 bytes, cub temp storage, item counter, items x 8, item slots
//     items x 4, split segments, their 2 counters, split pieces' dK / dV 2 x B x D x 4 bytes
//     each (these sized for the largest chunk: at most kItemsPerLaunch segments and twice as
//     many pieces, 256 MB at M3's shape),
//     deterministic only: dQ partials C * q_heads * slots * head_dim x 4 bytes
//     (M3: 512 KB per query, so chunks of ~8K queries in kSparseWorkspaceBudget = 4 GiB; the
//     K/V blocks are re-read and dK/dV re-accumulated once per chunk);
//   dense: tile_start (batch + 1) x 8 (deterministic only).
#include <algorithm>
#include <string>

#include "cuda/common/kernel_attributes.h"
#include "cuda/attention/attention_inputs.h"
#include "cuda/training/backward_items.h"
#include "cuda/training/backward_launch.h"
#include "cuda/attention/selection_inversion.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/training/attention_backward_dq.cuh"
#include "cuda/training/attention_backward_kv_major.cuh"
#include "cuda/training/attention_backward_wgmma.cuh"
#include "msa/cuda/training.h"  // backward_writes_kl_teacher
#include "msa/error.h"

namespace msa::cuda {

namespace {

// Sparse workspace bound: larger query counts run in chunks.
constexpr size_t kSparseWorkspaceBudget = size_t{4} << 30;

// The shapes the warpgroup-MMA dK / dV kernel (attention_backward_wgmma.cuh) runs.
bool backward_wgmma_fits(const AttentionBackwardLaunch& p) { return p.head_dim == 128 && p.k.block_size == 128; }

void check_params(const AttentionBackwardLaunch& p) {
  MSA_CHECK_ARG(p.max_chunk_queries >= 0, "max_chunk_queries", ">= 0 (0: no cap)", p.max_chunk_queries);
  if (p.head_dim != 64 && p.head_dim != 128) throw_arg_error("head_dim", "64 or 128", p.head_dim);
  if (p.k.block_size != 64 && p.k.block_size != 128)
    throw_arg_error("block_size", "64 or 128", p.k.block_size);
  if (p.v.block_size != p.k.block_size) throw_arg_error("v.block_size", p.k.block_size, p.v.block_size);
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads != 0)
    throw_arg_error("q_heads", "a multiple of kv_heads", p.q_heads);
  const int64_t group = p.q_heads / p.kv_heads;
  if (group < 1 || group > 16) throw_arg_error("q_heads / kv_heads", "a group size in 1..16", group);
  if (p.topk && p.slots < 1) throw_arg_error("slots", "at least 1 with a selection", p.slots);
  if (p.k.page_table || p.v.page_table || !p.k.seq_token_start || !p.v.seq_token_start)
    throw_arg_error("k/v layout", "varlen keys (seq_token_start set, no page table)", "a paged layout");
  if (p.k.token_stride != p.kv_heads * p.head_dim || p.k.head_stride != p.head_dim ||
      p.v.token_stride != p.k.token_stride || p.v.head_stride != p.head_dim)
    throw_arg_error("k/v layout", "contiguous [total_k, kv_heads, head_dim]", "other strides");
  if (p.total_k < 0) throw_arg_error("total_k", "a non-negative row count", p.total_k);
  if (p.engine == Engine::wgmma && !backward_wgmma_fits(p))
    throw_arg_error("engine", "automatic or mma_sync here (the wgmma backward needs head_dim = block_size = 128)",
                    "wgmma with head_dim " + std::to_string(p.head_dim) + ", block_size " +
                        std::to_string(p.k.block_size));
  if (p.kl_teacher && !p.topk)
    throw_arg_error("kl_teacher", "null for the dense backward (the KL's teacher needs a selection)",
                    "a device pointer");
  if (p.kl_teacher && !backward_writes_kl_teacher(group))
    throw_arg_error("kl_teacher", "null, or a group size (q_heads / kv_heads) of 1, 2, 4, 8 or 16",
                    "a device pointer with group size " + std::to_string(group));
  const auto require = [](const void* pointer, const char* name) {
    if (!pointer) throw_arg_error(name, "a device pointer", "null");
  };
  require(p.dk, "dk");
  require(p.dv, "dv");
  if (p.batch.total_q > 0) {
    require(p.q, "q");
    require(p.o, "o");
    require(p.grad_o, "grad_o");
    require(p.lse, "lse");
    require(p.dq, "dq");
    require(p.k.data, "k");
    require(p.v.data, "v");
  }
}

int64_t blocks_bound(const AttentionBackwardLaunch& p) {  // sum_b ceil(k_len_b / B), bounded
  const int64_t nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
  return std::min(std::max<int64_t>(1, p.batch.batch) * nblk, p.total_k / p.k.block_size + p.batch.batch + 1);
}

// Sparse: (group, sequence, block) segments of a chunk's entries.
int64_t segment_item_bound(const AttentionBackwardLaunch& p, int64_t entries) {
  return std::max<int64_t>(1, std::min(entries, p.kv_heads * blocks_bound(p)));
}

// Work items of a chunk of `entries` entries (backward_items.h).
int64_t chunk_item_bound(const AttentionBackwardLaunch& p, int64_t entries) {
  return work_item_bound(entries, p.q_heads / p.kv_heads, segment_item_bound(p, entries));
}

struct Plan {
  size_t delta = 0, lse2 = 0;
  // sparse
  SelectionInversion selection;  // keys, cub temp, item counter, items
  size_t piece_slot = 0, split_segments = 0, split_counts = 0, grad_partial = 0;
  size_t partials = 0;
  // dense
  size_t tile_start = 0;
  size_t total = 0;
};

// split_q: the query count the split regions are sized for (the largest chunk considered,
// so that they stay out of the per-query scaling of make_plan).
Plan plan_chunk(const AttentionBackwardLaunch& p, int64_t chunk_q, int64_t split_q) {
  Plan plan;
  WorkspaceCursor ws;
  const size_t rows = static_cast<size_t>(p.batch.total_q) * p.q_heads;
  plan.delta = ws.take(rows * sizeof(float));
  plan.lse2 = ws.take(rows * sizeof(float));
  if (!p.topk) {
    if (p.deterministic) plan.tile_start = ws.take(static_cast<size_t>(p.batch.batch + 1) * sizeof(int64_t));
    plan.total = ws.at;
    return plan;
  }
  const int64_t nblk = selection_key_blocks(p.kv_heads, p.batch.max_k_len, p.k.block_size);
  plan.selection = size_selection_inversion(p.kv_heads, p.slots, nblk, chunk_q);
  const int64_t entries = plan.selection.entries, group = p.q_heads / p.kv_heads;
  const int64_t item_bound = chunk_item_bound(p, entries);
  take_selection_regions(plan.selection, item_bound, ws);
  // The split regions hold split_entries' (>= any chunk's entries; the bounds are monotone).
  const int64_t split_entries = p.kv_heads * std::max(split_q, chunk_q) * p.slots;
  plan.piece_slot = ws.take(static_cast<size_t>(item_bound) * sizeof(int32_t));
  plan.split_segments =
      ws.take(static_cast<size_t>(split_segment_bound(split_entries, group)) * sizeof(attn::SplitSegment));
  plan.split_counts = ws.take(2 * sizeof(unsigned));
  plan.grad_partial = ws.take(static_cast<size_t>(split_slot_bound(split_entries, group)) * 2 *
                              p.k.block_size * p.head_dim * sizeof(float));
  if (p.deterministic)
    plan.partials = ws.take(static_cast<size_t>(chunk_q) * p.q_heads * p.slots * p.head_dim * sizeof(float));
  plan.total = ws.at;
  return plan;
}

// The sparse path's query chunk: all queries when the workspace fits kSparseWorkspaceBudget
// (and the inversion's limits, max_selection_chunk), else the largest chunk that does, then
// equal chunks. Unlike the forward's fit_query_chunk, the budget leaves out the whole-call
// regions (`fixed`) and the chunk is scaled once. AttentionBackwardLaunch::max_chunk_queries caps
// the chunk (tests; it must not change between attention_backward_workspace_bytes and
// attention_backward).
Plan make_plan(const AttentionBackwardLaunch& p) {
  if (!p.topk) return plan_chunk(p, 0, 0);
  const int64_t total_q = p.batch.total_q;
  const int64_t max_chunk = max_selection_chunk(total_q, p.kv_heads, p.slots, p.max_chunk_queries);
  int64_t chunk = max_chunk;
  Plan plan = plan_chunk(p, chunk, max_chunk);
  const size_t fixed = plan_chunk(p, 1, max_chunk).total;
  if (plan.total > kSparseWorkspaceBudget + fixed && chunk > 1) {
    const long double per_query = static_cast<long double>(plan.total - fixed) / chunk;
    chunk = std::max<int64_t>(1, static_cast<int64_t>(kSparseWorkspaceBudget / per_query));
    plan = plan_chunk(p, chunk, max_chunk);
  }
  const int64_t balanced = balanced_chunk(total_q, chunk);
  if (balanced < chunk) plan = plan_chunk(p, balanced, max_chunk);
  return plan;
}

// The fields BackwardArgs and DenseDqArgs share: the attention inputs, dO, the row statistics.
template <class Args>
void set_backward_inputs(Args& args, const AttentionBackwardLaunch& p, const float* lse2, const float* delta) {
  set_attention_inputs(args, p);
  args.grad_o = p.grad_o;
  args.batch = p.batch.batch;
  args.lse2 = lse2;
  args.delta = delta;
  args.scale = p.scale;
  args.scale_log2 = p.scale * attn::kLog2e;
}

// The dK / dV kernel: the warpgroup-MMA one where it runs unless the launch pins mma.sync
// (check_params refused wgmma pinned elsewhere).
bool use_backward_wgmma(const AttentionBackwardLaunch& p) {
  return backward_wgmma_fits(p) && p.engine != Engine::mma_sync;
}

template <int D>
void launch_kv_kernel(const attn::BackwardArgs& args, bool wgmma, dim3 grid, cudaStream_t stream) {
  if (wgmma) {
    const size_t smem = attn::BackwardWgmmaTraits::kSmemBytes;
    auto kernel = args.kl_teacher ? attn::backward_kv_wgmma_kernel<true> : attn::backward_kv_wgmma_kernel<false>;
    require_dynamic_smem(kernel, smem);
    kernel<<<grid, attn::BackwardWgmmaTraits::kThreads, smem, stream>>>(args);
    MSA_CUDA_CHECK_LAUNCH();
    return;
  }
  const size_t smem = attn::backward_kv_smem_bytes<D>(args.block_size);
  auto kernel = attn::backward_kv_kernel<D>;
  require_dynamic_smem(kernel, smem);
  const unsigned threads = static_cast<unsigned>(args.block_size / 16 * 32);
  kernel<<<grid, threads, smem, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

template <int D>
void run(const AttentionBackwardLaunch& p, const Plan& plan, char* ws, cudaStream_t stream) {
  const int64_t total_q = p.batch.total_q, group = p.q_heads / p.kv_heads;
  float* delta = reinterpret_cast<float*>(ws + plan.delta);
  float* lse2 = reinterpret_cast<float*>(ws + plan.lse2);
  const int64_t rows = total_q * p.q_heads;
  attn::backward_rows_kernel<<<static_cast<unsigned>(ceil_div(rows, attn::kRowsWarps)), attn::kRowsWarps * 32, 0,
                               stream>>>(p.o, p.grad_o, p.lse, rows, D, delta, lse2);
  MSA_CUDA_CHECK_LAUNCH();
  if (!p.deterministic)
    MSA_CUDA_CHECK(cudaMemsetAsync(p.dq, 0, static_cast<size_t>(rows) * D * sizeof(float), stream));

  attn::BackwardArgs args{};
  set_backward_inputs(args, p, lse2, delta);
  args.block_size = p.k.block_size;
  args.sparse = p.topk != nullptr;
  args.dq = p.dq;
  args.dk = p.dk;
  args.dv = p.dv;
  args.kl_teacher = p.kl_teacher;
  args.total_q = total_q;

  if (!p.topk) {
    args.dq_mode = p.deterministic ? attn::kDqNone : attn::kDqAtomic;
    const int64_t nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
    if (nblk > 65535) throw_arg_error("max_k_len", "at most 65535 blocks", nblk);
    if (p.batch.batch * p.kv_heads >= (int64_t{1} << 31))
      throw_arg_error("batch", "fewer than 2^31 (batch x kv_heads)", p.batch.batch * p.kv_heads);
    launch_kv_kernel<D>(args, use_backward_wgmma(p),
                        dim3(static_cast<unsigned>(p.batch.batch * p.kv_heads), static_cast<unsigned>(nblk)), stream);
    if (!p.deterministic) return;
    int64_t* tile_start = reinterpret_cast<int64_t*>(ws + plan.tile_start);
    attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start);
    MSA_CUDA_CHECK_LAUNCH();
    attn::DenseDqArgs dq{};
    set_backward_inputs(dq, p, lse2, delta);
    dq.tile_start = tile_start;
    dq.dq = p.dq;
    // Upper bound of sum_b ceil(q_len_b * G / 64): extra CTAs exit at once.
    const int64_t tiles = ceil_div(total_q * group, attn::kDenseRows) + p.batch.batch;
    if (tiles >= (int64_t{1} << 31)) throw_arg_error("total_q", "fewer than 2^31 dense tiles", tiles);
    const size_t smem = attn::dense_dq_smem_bytes<D>();
    auto kernel = attn::dense_dq_kernel<D>;
    require_dynamic_smem(kernel, smem);
    kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), attn::kDenseThreads, smem,
             stream>>>(dq);
    MSA_CUDA_CHECK_LAUNCH();
    return;
  }

  args.dq_mode = p.deterministic ? attn::kDqPartial : attn::kDqAtomic;
  args.dq_partial = p.deterministic ? reinterpret_cast<float*>(ws + plan.partials) : nullptr;
  attn::SplitOutputs split;
  split.piece_slot = reinterpret_cast<int32_t*>(ws + plan.piece_slot);
  split.segments = reinterpret_cast<attn::SplitSegment*>(ws + plan.split_segments);
  split.counts = reinterpret_cast<unsigned*>(ws + plan.split_counts);
  args.piece_slot = split.piece_slot;
  args.grad_partial = reinterpret_cast<float*>(ws + plan.grad_partial);
  attn::SparseArgs& sel = args.sel;
  sel.q_heads = p.q_heads;
  sel.kv_heads = p.kv_heads;
  sel.group = group;
  sel.block_size = p.k.block_size;
  sel.q_start = p.batch.q_start;
  sel.k_len = p.batch.k_len;
  sel.seq_of_query = p.batch.seq_of_query;

  for (int64_t q_begin = 0; q_begin < total_q; q_begin += plan.selection.chunk_q) {
    const int64_t chunk_q = std::min(plan.selection.chunk_q, total_q - q_begin);
    // Items of at most m entries; a block's dK / dV have one writer per launch: its item, or
    // the split pieces' sum (add_split_grads_kernel).
    const int64_t entries = p.kv_heads * chunk_q * p.slots;
    const int64_t m = item_entries(entries, group);
    const SelectionChunk selection = invert_selection(plan.selection, p.topk, p.batch, q_begin, chunk_q,
                                                      static_cast<int>(m), ws, stream, nullptr, &split);
    set_selection_chunk(sel, selection);
    launch_kv_kernel<D>(args, use_backward_wgmma(p), dim3(static_cast<unsigned>(chunk_item_bound(p, entries))),
                        stream);
    attn::add_split_grads_kernel<D><<<dim3(static_cast<unsigned>(split_segment_bound(entries, group)), 2),
                                      attn::kSplitGradThreads, 0, stream>>>(args, split.segments, split.counts);
    MSA_CUDA_CHECK_LAUNCH();
    if (p.deterministic) {
      const attn::MergeDqArgs merge{p.topk,     total_q,     q_begin, chunk_q, p.q_heads, p.kv_heads,
                                    group,      D,           p.slots, args.dq_partial, p.dq};
      attn::merge_dq_partials_kernel<<<static_cast<unsigned>(chunk_q * p.kv_heads), attn::kMergeDqThreads, 0,
                                       stream>>>(merge);
      MSA_CUDA_CHECK_LAUNCH();
    }
  }
}

}  // namespace

size_t attention_backward_workspace_bytes(const AttentionBackwardLaunch& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  return make_plan(params).total;
}

void attention_backward(const AttentionBackwardLaunch& params, void* workspace, void* stream) {
  check_params(params);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Keys no query reads get zero gradients; the kernels add into dk / dv.
  const size_t key_bytes = static_cast<size_t>(params.total_k) * params.kv_heads * params.head_dim * sizeof(float);
  MSA_CUDA_CHECK(cudaMemsetAsync(params.dk, 0, key_bytes, s));
  MSA_CUDA_CHECK(cudaMemsetAsync(params.dv, 0, key_bytes, s));
  if (params.batch.total_q == 0) return;
  const Plan plan = make_plan(params);
  char* ws = static_cast<char*>(workspace);
  if (params.head_dim == 64)
    run<64>(params, plan, ws, s);
  else
    run<128>(params, plan, ws, s);
}

}  // namespace msa::cuda
