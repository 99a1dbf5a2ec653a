// Host launcher of the main-branch attention forward (src/cuda/launch.h).
//
// topk given -> sparse, KV-block-major (kernels/attention_sparse_kv_major.cuh):
//   build_selection_keys -> cub radix sort -> make_work_items -> sparse_kv_major_kernel
//   -> merge_partials_kernel (kernels/attention_merge.cuh).
// topk null -> dense causal flash attention (kernels/attention_dense_flash.cuh):
//   dense_tile_plan -> dense_flash_kernel.
// Nothing here synchronises with the host or allocates: the workspace (sized by
// attention_workspace_bytes from host-known quantities only) holds every intermediate.
//
// Workspace (sparse), E = kv_heads * total_q * slots selection entries, each region
// 256-byte aligned:
//   sorted keys, 2 x E x 8 bytes (radix sort ping-pong)
//   cub temp storage (cub's own query)
//   item counter, 4 bytes
//   work items, (ceil(E / queries_per_item) + min(E, kv_heads * batch * nblk)) x 8 bytes
//   partial LSE, total_q * q_heads * slots x 4 bytes
//   partial O,   total_q * q_heads * slots * head_dim x sizeof(PartialO) bytes
// i.e. ~ total_q * q_heads * slots * (head_dim + 1) * 4 + 16 E bytes: the partial O
// dominates (M3, 32K queries: 32768 * 64 * 16 * 129 * 4 = 17.3 GB). Dense: (batch + 1) x 8.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/launch.h"
#include "kernels/attention_dense_flash.cuh"
#include "kernels/attention_merge.cuh"
#include "kernels/attention_sparse_kv_major.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

using attn::PartialO;
using attn::WorkItem;

constexpr size_t kAlign = 256;
constexpr int64_t kItemRows = 512;  // target rows (entries x group heads) per sparse work item

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int bit_width(uint64_t value) {
  int bits = 0;
  while (value) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

void check_params(const AttentionParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) throw_arg_error("head_dim", "64 or 128", p.head_dim);
  if (p.k.block_size != 64 && p.k.block_size != 128)
    throw_arg_error("block_size", "64 or 128", p.k.block_size);
  if (p.v.block_size != p.k.block_size)
    throw_arg_error("v.block_size", p.k.block_size, p.v.block_size);
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads != 0)
    throw_arg_error("q_heads", "a multiple of kv_heads", p.q_heads);
  const int64_t group = p.q_heads / p.kv_heads;
  if (group < 1 || group > 16) throw_arg_error("q_heads / kv_heads", "a group size in 1..16", group);
  if (p.topk && p.slots < 1) throw_arg_error("slots", "at least 1 with a selection", p.slots);
}

// Workspace regions of the sparse path.
struct SparsePlan {
  int64_t entries = 0, nblk = 0, queries_per_item = 0, item_bound = 0;
  uint64_t invalid_key = 0;
  int end_bit = 0;
  size_t cub_bytes = 0;
  size_t keys_in = 0, keys_out = 0, cub_temp = 0, item_count = 0, items = 0, partial_lse = 0,
         partial_o = 0, total = 0;
};

SparsePlan plan_sparse(const AttentionParams& p) {
  SparsePlan plan;
  const int64_t total_q = p.batch.total_q, group = p.q_heads / p.kv_heads;
  const int64_t block_size = p.k.block_size;
  plan.entries = p.kv_heads * total_q * p.slots;
  plan.nblk = std::max<int64_t>(1, (p.batch.max_k_len + block_size - 1) / block_size);
  plan.queries_per_item = std::max<int64_t>(1, kItemRows / group);
  if (plan.entries >= (int64_t{1} << 31))
    throw_arg_error("topk", "fewer than 2^31 selection entries per call (split the queries)",
                    plan.entries);
  const long double key_count = static_cast<long double>(p.kv_heads) * plan.nblk * total_q * p.slots;
  if (key_count >= 9.2e18L)
    throw_arg_error("topk", "kv_heads * blocks * total_q * slots < 2^63", "more");
  plan.invalid_key = static_cast<uint64_t>(p.kv_heads * plan.nblk * total_q * p.slots);
  plan.end_bit = std::max(1, bit_width(plan.invalid_key));
  const int64_t segments = std::min(plan.entries, p.kv_heads * std::max<int64_t>(1, p.batch.batch) * plan.nblk);
  plan.item_bound = (plan.entries + plan.queries_per_item - 1) / plan.queries_per_item + segments;

  if (plan.entries > 0) {
    uint64_t* null_keys = nullptr;
    MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, plan.cub_bytes, null_keys, null_keys,
                                                  static_cast<int>(plan.entries), 0, plan.end_bit));
  }
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += align_up(bytes);
    return offset;
  };
  const size_t partials = static_cast<size_t>(total_q) * p.q_heads * p.slots;
  plan.keys_in = take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.keys_out = take(static_cast<size_t>(plan.entries) * sizeof(uint64_t));
  plan.cub_temp = take(plan.cub_bytes);
  plan.item_count = take(sizeof(unsigned));
  plan.items = take(static_cast<size_t>(plan.item_bound) * sizeof(WorkItem));
  plan.partial_lse = take(partials * sizeof(float));
  plan.partial_o = take(partials * p.head_dim * sizeof(PartialO));
  plan.total = at;
  return plan;
}

size_t dense_workspace_bytes(const AttentionParams& p) {
  return align_up(static_cast<size_t>(p.batch.batch + 1) * sizeof(int64_t));
}

int sm_count() {
  int device = 0, count = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  MSA_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template <int D>
void run_sparse(const AttentionParams& p, const SparsePlan& plan, char* ws, cudaStream_t stream) {
  const int64_t total_q = p.batch.total_q, group = p.q_heads / p.kv_heads;
  uint64_t* keys_in = reinterpret_cast<uint64_t*>(ws + plan.keys_in);
  uint64_t* keys_out = reinterpret_cast<uint64_t*>(ws + plan.keys_out);
  unsigned* item_count = reinterpret_cast<unsigned*>(ws + plan.item_count);
  WorkItem* items = reinterpret_cast<WorkItem*>(ws + plan.items);
  PartialO* partial_o = reinterpret_cast<PartialO*>(ws + plan.partial_o);
  float* partial_lse = reinterpret_cast<float*>(ws + plan.partial_lse);

  const attn::SparsePlanArgs plan_args{p.topk, p.kv_heads, total_q, p.slots, plan.nblk,
                                       plan.invalid_key};
  constexpr int kThreads = 256;
  const int64_t rows = p.kv_heads * total_q;
  attn::build_selection_keys<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0,
                               stream>>>(plan_args, keys_in);
  MSA_CUDA_CHECK_LAUNCH();
  size_t cub_bytes = plan.cub_bytes;
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(ws + plan.cub_temp, cub_bytes, keys_in, keys_out,
                                                static_cast<int>(plan.entries), 0, plan.end_bit,
                                                stream));
  MSA_CUDA_CHECK(cudaMemsetAsync(item_count, 0, sizeof(unsigned), stream));
  attn::make_work_items<<<static_cast<unsigned>((plan.entries + kThreads - 1) / kThreads), kThreads,
                          0, stream>>>(plan_args, keys_out, plan.entries, p.batch.q_start,
                                       p.batch.seq_of_query, static_cast<int>(plan.queries_per_item),
                                       items, item_count);
  MSA_CUDA_CHECK_LAUNCH();

  attn::SparseArgs args{};
  args.q = p.q;
  args.k = p.k;
  args.v = p.v;
  args.q_heads = p.q_heads;
  args.kv_heads = p.kv_heads;
  args.group = group;
  args.block_size = p.k.block_size;
  args.q_start = p.batch.q_start;
  args.k_len = p.batch.k_len;
  args.seq_of_query = p.batch.seq_of_query;
  args.total_q = total_q;
  args.slots = p.slots;
  args.nblk = plan.nblk;
  args.keys = keys_out;
  args.items = items;
  args.item_count = item_count;
  args.scale_log2 = p.scale * attn::kLog2e;
  args.partial_o = partial_o;
  args.partial_lse = partial_lse;

  const size_t smem = attn::sparse_smem_bytes<D>(p.k.block_size);
  auto kernel = attn::sparse_kv_major_kernel<D>;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  int per_sm = 0;
  MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, attn::kSparseThreads, smem));
  const int64_t grid = std::min<int64_t>(plan.item_bound, static_cast<int64_t>(std::max(per_sm, 1)) * sm_count());
  kernel<<<static_cast<unsigned>(grid), attn::kSparseThreads, smem, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();

  const attn::MergeArgs merge{p.topk,   total_q,     p.q_heads, p.kv_heads, group, p.slots,
                              partial_o, partial_lse, p.o,       p.lse};
  const size_t merge_smem = static_cast<size_t>(p.slots) * group * sizeof(float);
  auto merge_kernel = attn::merge_partials_kernel<D>;
  if (merge_smem > 48 * 1024)
    MSA_CUDA_CHECK(cudaFuncSetAttribute(merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(merge_smem)));
  merge_kernel<<<static_cast<unsigned>(p.kv_heads * total_q), attn::kMergeThreads, merge_smem,
                 stream>>>(merge);
  MSA_CUDA_CHECK_LAUNCH();
}

template <int D>
void run_dense(const AttentionParams& p, char* ws, cudaStream_t stream) {
  const int64_t group = p.q_heads / p.kv_heads;
  int64_t* tile_start = reinterpret_cast<int64_t*>(ws);
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group,
                                                             tile_start);
  MSA_CUDA_CHECK_LAUNCH();

  attn::DenseArgs args{};
  args.q = p.q;
  args.k = p.k;
  args.v = p.v;
  args.q_heads = p.q_heads;
  args.kv_heads = p.kv_heads;
  args.group = group;
  args.q_start = p.batch.q_start;
  args.k_len = p.batch.k_len;
  args.batch = p.batch.batch;
  args.tile_start = tile_start;
  args.scale_log2 = p.scale * attn::kLog2e;
  args.o = p.o;
  args.lse = p.lse;

  // Upper bound of sum_b ceil(q_len_b * G / rows): extra CTAs exit at once.
  const int64_t tiles = (p.batch.total_q * group + attn::kDenseRows - 1) / attn::kDenseRows + p.batch.batch;
  if (tiles >= (int64_t{1} << 31)) throw_arg_error("total_q", "fewer than 2^31 dense tiles", tiles);
  const size_t smem = attn::dense_smem_bytes<D>();
  auto kernel = attn::dense_flash_kernel<D>;
  MSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), attn::kDenseThreads,
           smem, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t attention_workspace_bytes(const AttentionParams& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  return params.topk ? plan_sparse(params).total : dense_workspace_bytes(params);
}

void attention(const AttentionParams& params, void* workspace, void* stream) {
  check_params(params);
  if (params.batch.total_q == 0) return;  // nothing to write
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  if (params.topk) {
    const SparsePlan plan = plan_sparse(params);
    if (params.head_dim == 64)
      run_sparse<64>(params, plan, ws, s);
    else
      run_sparse<128>(params, plan, ws, s);
  } else {
    if (params.head_dim == 64)
      run_dense<64>(params, ws, s);
    else
      run_dense<128>(params, ws, s);
  }
}

}  // namespace msa::cuda
