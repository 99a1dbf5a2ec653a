// Host launcher of the main-branch backward (src/cuda/launch_backward.h).
//
// Every call: cudaMemsetAsync(dk, dv) -> backward_rows_kernel (Delta, LSE2), then
//   sparse (topk given), per query chunk (kernels/attention_backward_kv_major.cuh):
//     build_selection_keys -> cub radix sort -> make_work_items (one item per (group,
//     sequence, block) segment, selection_inversion.cuh) -> backward_kv_kernel
//     [-> merge_dq_partials_kernel when deterministic];
//   dense (topk null): backward_kv_kernel over every (sequence, group, block)
//     [-> dense_tile_plan -> dense_dq_kernel when deterministic].
//   Fast mode (deterministic = false) zeroes dq first and the KV kernel adds dQ atomically.
// Nothing here synchronises with the host or allocates.
//
// Workspace, each region 256-byte aligned:
//   Delta and LSE2, 2 x total_q * q_heads x 4 bytes;
//   sparse, sized for one chunk of C queries (E = kv_heads * C * slots entries):
//     sorted keys 2 x E x 8 bytes, cub temp storage, item counter, items (<= segments) x 8,
//     deterministic only: dQ partials C * q_heads * slots * head_dim x 4 bytes
//     (M3: 512 KB per query, so chunks of ~8K queries in kSparseWorkspaceBudget = 4 GiB; the
//     K/V blocks are re-read and dK/dV re-accumulated once per chunk);
//   dense: tile_start (batch + 1) x 8 (deterministic only).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/launch_backward.h"
#include "kernels/attention_backward_dq.cuh"
#include "kernels/attention_backward_kv_major.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr size_t kAlign = 256;
// Sparse workspace bound: larger query counts run in chunks.
constexpr size_t kSparseWorkspaceBudget = size_t{4} << 30;
constexpr int kPlanThreads = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int bit_width(uint64_t value) {
  int bits = 0;
  while (value) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_params(const AttentionBackwardParams& p) {
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

int64_t blocks_bound(const AttentionBackwardParams& p) {  // sum_b ceil(k_len_b / B), bounded
  const int64_t nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
  return std::min(std::max<int64_t>(1, p.batch.batch) * nblk, p.total_k / p.k.block_size + p.batch.batch + 1);
}

struct Plan {
  size_t delta = 0, lse2 = 0;
  // sparse
  int64_t chunk_q = 0, entries = 0, nblk = 0, item_bound = 0;
  int qbits = 0, end_bit = 0;
  uint64_t invalid_key = 0;
  size_t cub_bytes = 0, keys_in = 0, keys_out = 0, cub_temp = 0, item_count = 0, items = 0, partials = 0;
  // dense
  size_t tile_start = 0;
  size_t total = 0;
};

struct Allocator {
  size_t at = 0;
  size_t take(size_t bytes) {
    const size_t offset = at;
    at += align_up(bytes);
    return offset;
  }
};

Plan plan_chunk(const AttentionBackwardParams& p, int64_t chunk_q) {
  Plan plan;
  Allocator ws;
  const size_t rows = static_cast<size_t>(p.batch.total_q) * p.q_heads;
  plan.delta = ws.take(rows * sizeof(float));
  plan.lse2 = ws.take(rows * sizeof(float));
  if (!p.topk) {
    if (p.deterministic) plan.tile_start = ws.take(static_cast<size_t>(p.batch.batch + 1) * sizeof(int64_t));
    plan.total = ws.at;
    return plan;
  }
  plan.chunk_q = chunk_q;
  plan.entries = p.kv_heads * chunk_q * p.slots;
  plan.nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
  plan.qbits = std::max(1, bit_width(static_cast<uint64_t>(chunk_q * p.slots)));
  plan.end_bit = plan.qbits + bit_width(static_cast<uint64_t>(p.kv_heads * plan.nblk));
  plan.invalid_key = static_cast<uint64_t>(p.kv_heads * plan.nblk) << plan.qbits;
  plan.item_bound = std::max<int64_t>(1, std::min(plan.entries, p.kv_heads * blocks_bound(p)));
  if (plan.entries > 0) {
    uint64_t* null_keys = nullptr;
    MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, plan.cub_bytes, null_keys, null_keys,
                                                  static_cast<int>(plan.entries), 0, plan.end_bit));
  }
  plan.keys_in = ws.take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.keys_out = ws.take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.cub_temp = ws.take(plan.cub_bytes);
  plan.item_count = ws.take(sizeof(unsigned));
  plan.items = ws.take(static_cast<size_t>(plan.item_bound) * sizeof(attn::WorkItem));
  if (p.deterministic)
    plan.partials = ws.take(static_cast<size_t>(chunk_q) * p.q_heads * p.slots * p.head_dim * sizeof(float));
  plan.total = ws.at;
  return plan;
}

// Query-chunk cap (development knob for tests and benchmarks; must not change between
// attention_backward_workspace_bytes and attention_backward): MSA_BACKWARD_CHUNK_QUERIES=N.
int64_t chunk_override() {
  const char* text = std::getenv("MSA_BACKWARD_CHUNK_QUERIES");
  if (!text || !*text) return 0;
  const long long value = std::atoll(text);
  return value > 0 ? static_cast<int64_t>(value) : 0;
}

// The sparse path's query chunk: all queries when the workspace fits kSparseWorkspaceBudget
// (and the sort's limits: < 2^31 entries, key low bits q * slots < 2^32), else the largest
// chunk that does, then equal chunks.
Plan make_plan(const AttentionBackwardParams& p) {
  if (!p.topk) return plan_chunk(p, 0);
  const int64_t total_q = p.batch.total_q;
  const int64_t nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
  if (bit_width(static_cast<uint64_t>(p.kv_heads * nblk)) > 30)
    throw_arg_error("max_k_len", "fewer than 2^30 (kv_heads x blocks)", p.kv_heads * nblk);
  int64_t chunk = std::min<int64_t>(total_q, ((int64_t{1} << 31) - 1) / (p.kv_heads * p.slots));
  chunk = std::max<int64_t>(1, std::min<int64_t>(chunk, ((int64_t{1} << 31) - 1) / p.slots));
  if (const int64_t forced = chunk_override()) chunk = std::min(chunk, forced);
  Plan plan = plan_chunk(p, chunk);
  const size_t fixed = plan_chunk(p, 1).total;
  if (plan.total > kSparseWorkspaceBudget + fixed && chunk > 1) {
    const long double per_query = static_cast<long double>(plan.total - fixed) / chunk;
    chunk = std::max<int64_t>(1, static_cast<int64_t>(kSparseWorkspaceBudget / per_query));
    plan = plan_chunk(p, chunk);
  }
  const int64_t chunks = ceil_div(total_q, chunk);
  const int64_t balanced = ceil_div(total_q, chunks);
  if (balanced < chunk) plan = plan_chunk(p, balanced);
  return plan;
}

template <int D>
void launch_kv_kernel(const attn::BackwardArgs& args, dim3 grid, cudaStream_t stream) {
  const size_t smem = attn::backward_kv_smem_bytes<D>(args.block_size);
  auto kernel = attn::backward_kv_kernel<D>;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const unsigned threads = static_cast<unsigned>(args.block_size / 16 * 32);
  kernel<<<grid, threads, smem, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

template <int D>
void run(const AttentionBackwardParams& p, const Plan& plan, char* ws, cudaStream_t stream) {
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
  args.q = p.q;
  args.grad_o = p.grad_o;
  args.k = p.k;
  args.v = p.v;
  args.q_heads = p.q_heads;
  args.kv_heads = p.kv_heads;
  args.group = group;
  args.block_size = p.k.block_size;
  args.q_start = p.batch.q_start;
  args.k_len = p.batch.k_len;
  args.batch = p.batch.batch;
  args.lse2 = lse2;
  args.delta = delta;
  args.scale = p.scale;
  args.scale_log2 = p.scale * attn::kLog2e;
  args.sparse = p.topk != nullptr;
  args.dq = p.dq;
  args.dk = p.dk;
  args.dv = p.dv;

  if (!p.topk) {
    args.dq_mode = p.deterministic ? attn::kDqNone : attn::kDqAtomic;
    const int64_t nblk = std::max<int64_t>(1, ceil_div(p.batch.max_k_len, p.k.block_size));
    if (nblk > 65535) throw_arg_error("max_k_len", "at most 65535 blocks", nblk);
    if (p.batch.batch * p.kv_heads >= (int64_t{1} << 31))
      throw_arg_error("batch", "fewer than 2^31 (batch x kv_heads)", p.batch.batch * p.kv_heads);
    launch_kv_kernel<D>(args, dim3(static_cast<unsigned>(p.batch.batch * p.kv_heads), static_cast<unsigned>(nblk)),
                        stream);
    if (!p.deterministic) return;
    int64_t* tile_start = reinterpret_cast<int64_t*>(ws + plan.tile_start);
    attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start);
    MSA_CUDA_CHECK_LAUNCH();
    attn::DenseDqArgs dq{};
    dq.q = p.q;
    dq.grad_o = p.grad_o;
    dq.k = p.k;
    dq.v = p.v;
    dq.q_heads = p.q_heads;
    dq.kv_heads = p.kv_heads;
    dq.group = group;
    dq.q_start = p.batch.q_start;
    dq.k_len = p.batch.k_len;
    dq.batch = p.batch.batch;
    dq.tile_start = tile_start;
    dq.lse2 = lse2;
    dq.delta = delta;
    dq.scale = p.scale;
    dq.scale_log2 = args.scale_log2;
    dq.dq = p.dq;
    // Upper bound of sum_b ceil(q_len_b * G / 64): extra CTAs exit at once.
    const int64_t tiles = ceil_div(total_q * group, attn::kDenseRows) + p.batch.batch;
    if (tiles >= (int64_t{1} << 31)) throw_arg_error("total_q", "fewer than 2^31 dense tiles", tiles);
    const size_t smem = attn::dense_dq_smem_bytes<D>();
    auto kernel = attn::dense_dq_kernel<D>;
    MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), attn::kDenseThreads, smem,
             stream>>>(dq);
    MSA_CUDA_CHECK_LAUNCH();
    return;
  }

  args.dq_mode = p.deterministic ? attn::kDqPartial : attn::kDqAtomic;
  args.dq_partial = p.deterministic ? reinterpret_cast<float*>(ws + plan.partials) : nullptr;
  uint64_t* keys_in = reinterpret_cast<uint64_t*>(ws + plan.keys_in);
  uint64_t* keys_out = reinterpret_cast<uint64_t*>(ws + plan.keys_out);
  unsigned* item_count = reinterpret_cast<unsigned*>(ws + plan.item_count);
  attn::WorkItem* items = reinterpret_cast<attn::WorkItem*>(ws + plan.items);
  attn::SparseArgs& sel = args.sel;
  sel.q_heads = p.q_heads;
  sel.kv_heads = p.kv_heads;
  sel.group = group;
  sel.block_size = p.k.block_size;
  sel.q_start = p.batch.q_start;
  sel.k_len = p.batch.k_len;
  sel.seq_of_query = p.batch.seq_of_query;
  sel.slots = p.slots;
  sel.nblk = plan.nblk;
  sel.qbits = plan.qbits;
  sel.keys = keys_out;
  sel.items = items;
  sel.item_count = item_count;

  for (int64_t q_begin = 0; q_begin < total_q; q_begin += plan.chunk_q) {
    const int64_t chunk_q = std::min(plan.chunk_q, total_q - q_begin);
    const int64_t entries = p.kv_heads * chunk_q * p.slots;
    const attn::SparsePlanArgs plan_args{p.topk, p.kv_heads, total_q,    p.slots,         plan.nblk,
                                         q_begin, chunk_q,   plan.qbits, plan.invalid_key};
    attn::build_selection_keys<<<static_cast<unsigned>(ceil_div(p.kv_heads * chunk_q, kPlanThreads)), kPlanThreads,
                                 0, stream>>>(plan_args, keys_in);
    MSA_CUDA_CHECK_LAUNCH();
    size_t cub_bytes = plan.cub_bytes;
    MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(ws + plan.cub_temp, cub_bytes, keys_in, keys_out,
                                                  static_cast<int>(entries), 0, plan.end_bit, stream));
    MSA_CUDA_CHECK(cudaMemsetAsync(item_count, 0, sizeof(unsigned), stream));
    // One item per (group, sequence, block) segment (a segment holds at most chunk_q * slots
    // entries), so each block has one writer of its dK / dV per launch.
    attn::make_work_items<<<static_cast<unsigned>(ceil_div(entries, kPlanThreads)), kPlanThreads, 0, stream>>>(
        plan_args, keys_out, entries, p.batch.q_start, p.batch.seq_of_query, static_cast<int>(chunk_q * p.slots),
        items, item_count);
    MSA_CUDA_CHECK_LAUNCH();
    sel.q_begin = q_begin;
    const int64_t item_bound = std::max<int64_t>(1, std::min(entries, p.kv_heads * blocks_bound(p)));
    launch_kv_kernel<D>(args, dim3(static_cast<unsigned>(item_bound)), stream);
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

size_t attention_backward_workspace_bytes(const AttentionBackwardParams& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  return make_plan(params).total;
}

void attention_backward(const AttentionBackwardParams& params, void* workspace, void* stream) {
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
