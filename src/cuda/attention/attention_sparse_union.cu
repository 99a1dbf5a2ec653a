// Host launcher of the query-major sparse forward (see attention_sparse_union.h).
#include "cuda/attention/attention_sparse_union.h"

#include <algorithm>

#include "cuda/attention/attention_dense_wgmma.cuh"
#include "cuda/attention/attention_inputs.h"
#include "cuda/attention/attention_sparse_union_plan.cuh"
#include "cuda/common/kernel_attributes.h"
#include "cuda/common/workspace_layout.h"
#include "msa/error.h"

namespace msa::cuda {

namespace {
// The plan's shared memory: bitmap + prefix + masks within a CTA's default 48 KB (a 1M-token
// sequence needs 2 KB of bitmap).
constexpr size_t kUnionSmemLimit = 48 * 1024;

int64_t union_cap(const AttentionLaunch& p, int64_t blocks) {
  const int64_t group = p.q_heads / p.kv_heads;
  return std::max<int64_t>(1, std::min(attn::kUnionTileRows / group * p.slots, blocks));
}
}  // namespace

bool sparse_query_major_fits(const AttentionLaunch& p) {
  const int64_t group = p.kv_heads > 0 ? p.q_heads / p.kv_heads : 0;
  if (p.head_dim != 128 || p.k.block_size != attn::kUnionKeys || !(group == 4 || group == 8 || group == 16))
    return false;
  const int64_t blocks = ceil_div(p.batch.max_k_len, attn::kUnionKeys);
  return attn::tile_union_smem_bytes(static_cast<int>(ceil_div(blocks, 32)), union_cap(p, blocks)) <=
         kUnionSmemLimit;
}

TileUnionPlan plan_tile_unions(const AttentionLaunch& p) {
  TileUnionPlan plan;
  const int64_t blocks = ceil_div(p.batch.max_k_len, attn::kUnionKeys);
  plan.tiles = dense_grid_tiles(p, attn::kUnionTileRows);
  plan.cap = union_cap(p, blocks);
  plan.bitmap_words = static_cast<int>(ceil_div(blocks, 32));
  WorkspaceCursor ws;
  plan.tile_start = ws.take_elements<int64_t>(p.batch.batch + 1);
  plan.count = ws.take_elements<int32_t>(plan.tiles * p.kv_heads);
  plan.blocks = ws.take_elements<attn::UnionBlock>(plan.tiles * p.kv_heads * plan.cap);
  plan.query_major = ws.take_elements<uint8_t>(p.kv_heads * p.batch.total_q);
  plan.total = ws.total();
  return plan;
}

void run_sparse_query_major(const AttentionLaunch& p, const TileUnionPlan& plan, char* ws, float max_pair_ratio,
                            void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t group = p.q_heads / p.kv_heads;
  int64_t* tile_start = reinterpret_cast<int64_t*>(ws + plan.tile_start);
  auto* blocks = reinterpret_cast<attn::UnionBlock*>(ws + plan.blocks);
  auto* count = reinterpret_cast<int32_t*>(ws + plan.count);
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start,
                                                             attn::kUnionTileRows);
  MSA_CUDA_CHECK_LAUNCH();

  attn::TileUnionArgs u{};
  u.topk = p.topk;
  u.total_q = p.batch.total_q;
  u.slots = p.slots;
  u.kv_heads = p.kv_heads;
  u.tile_start = tile_start;
  u.batch = p.batch.batch;
  u.q_start = p.batch.q_start;
  u.k_len = p.batch.k_len;
  u.G = static_cast<int>(group);
  u.bitmap_words = plan.bitmap_words;
  u.cap = plan.cap;
  u.max_pair_ratio = max_pair_ratio;
  u.blocks = blocks;
  u.count = count;
  u.query_major = reinterpret_cast<uint8_t*>(ws + plan.query_major);
  const dim3 grid(static_cast<unsigned>(plan.tiles), static_cast<unsigned>(p.kv_heads));
  attn::tile_union_kernel<<<grid, attn::kUnionThreads, attn::tile_union_smem_bytes(plan.bitmap_words, plan.cap),
                            stream>>>(u);
  MSA_CUDA_CHECK_LAUNCH();

  using T = attn::DenseWgmmaTraits<128>;
  attn::DenseArgs args{};
  set_dense_args(args, p, tile_start, attn::kLog2e);
  auto kernel = attn::dense_wgmma_kernel<128, true>;
  require_dynamic_smem(kernel, T::kSmemBytes);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(args, attn::TileUnions{blocks, count, plan.cap});
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
