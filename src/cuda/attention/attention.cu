// Host launcher of the main-branch attention forward (src/cuda/launch.h).
//
// topk given -> sparse, in the order of sparse_order_of: query-major tiles
//   (attention_sparse_union.{h,cuh}: tile unions, then the wgmma dense kernel over them) and/or
//   KV-block-major (attention_sparse_kv_major.cuh for the mma.sync engine,
//   attention_sparse_producer.cuh for the wgmma one): build_selection_keys -> cub radix sort
//   -> make_work_items (selection_inversion.h) -> the tile kernel -> merge_partials_kernel
//   (attention_merge.cuh), leaving out the query-major rows.
// batch.max_q_len <= 16 (decode / multi-token prediction), sparse or dense -> the decode path
//   (src/cuda/decode/attention_decode.cu); with fp8 K/V it reads the e4m3 codes.
// fp8 K/V with longer queries -> widen_fp8_kv (fp8_kv_widen.h), then the bf16 paths below on
//   the copy.
// topk null, longer, or bidirectional (causal = false) of any length -> dense flash
//   attention: the warpgroup-MMA kernel (attention_dense_wgmma.{h,cu}) for head_dim 128, and
//   for the vision tower's 80 on large calls (use_dense_wgmma), else dense_tile_plan ->
//   dense_flash_kernel (attention_dense_flash.cuh). Bidirectional rows all sit at their
//   sequence's last key (dense_tile), so the kernels' causal mask becomes the k_len bound.
// Nothing here synchronises with the host or allocates: the workspace (sized by
// attention_workspace_bytes from host-known quantities only) holds every intermediate.
//
// Workspace (sparse): queries run in chunks of C queries (C = total_q when it fits
// kSparseWorkspaceBudget = 8 GiB, else the largest C that does; every offset is 64-bit),
// E = kv_heads * C * slots selection entries per chunk, each region 256-byte aligned:
//   sorted keys, 2 x E x 8 bytes (radix sort ping-pong)
//   cub temp storage (cub's own query)
//   item counter, 4 bytes
//   work items, (ceil(E / queries_per_item) + min(E, kv_heads * batch * nblk)) x 8 bytes
//   partial LSE, C * q_heads * slots x 4 bytes (f32, log2 domain)
//   partial O,   C * q_heads * slots * head_dim x 2 bytes (bf16, normalised by the block sum)
// i.e. ~ C * q_heads * slots * (2 head_dim + 4) + 16 E bytes: M3 ~267 KB per query, so
// chunks of ~32K queries (8 GiB); a 1M-token call runs ~33 chunks. Dense: (batch + 1) x 8.
// Each chunk: build keys -> sort -> items -> attention -> merge (5 launches, stream order).
// Per chunk the K/V blocks are re-read once (M3: ~2 KB per token and chunk, small).
#include <algorithm>
#include <cfloat>
#include <string>
#include <utility>

#include "cuda/common/kernel_attributes.h"
#include "cuda/attention/attention_dense_wgmma.h"
#include "cuda/attention/fp8_kv_widen.h"
#include "cuda/attention/attention_sparse_union.h"
#include "cuda/attention/query_major_rule.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/attention/attention_inputs.h"
#include "cuda/launch.h"
#include "cuda/attention/selection_inversion.h"
#include "cuda/common/sm_count.h"
#include "cuda/common/tensor_map.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/attention/attention_dense_flash.cuh"
#include "cuda/attention/attention_merge.cuh"
#include "cuda/attention/attention_sparse_kv_major.cuh"
#include "cuda/attention/attention_sparse_producer.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {

using attn::PartialO;

constexpr int64_t kItemRows = 1024;  // target rows (entries x group heads) per sparse work item
// Sparse workspace bound: larger query counts run in chunks (K/V re-read once per chunk).
constexpr size_t kSparseWorkspaceBudget = size_t{8} << 30;

void check_params(const AttentionLaunch& p) {
  MSA_CHECK_ARG(p.max_chunk_queries >= 0, "max_chunk_queries", ">= 0 (0: no cap)", p.max_chunk_queries);
  // Head dim 80 is the vision tower's: dense attention only, on the prefill kernels (either
  // engine, use_dense_wgmma), never the decode path (attention_decode_applies).
  if (p.head_dim == 80) {
    if (p.topk) throw_arg_error("head_dim", "64 or 128 with a selection (80 is dense attention only)", p.head_dim);
  } else if (p.head_dim != 64 && p.head_dim != 128) {
    throw_arg_error("head_dim", "64 or 128 (or 80 for dense attention)", p.head_dim);
  }
  if (!p.causal && p.topk)
    throw_arg_error("causal", "true with a selection (MSA is causal; bidirectional attention is dense, topk null)",
                    "false");
  if (p.k.block_size != 64 && p.k.block_size != 128)
    throw_arg_error("block_size", "64 or 128", p.k.block_size);
  if (p.v.block_size != p.k.block_size)
    throw_arg_error("v.block_size", p.k.block_size, p.v.block_size);
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads != 0)
    throw_arg_error("q_heads", "a multiple of kv_heads", p.q_heads);
  const int64_t group = p.q_heads / p.kv_heads;
  if (group < 1 || group > 16) throw_arg_error("q_heads / kv_heads", "a group size in 1..16", group);
  if (p.topk && p.slots < 1) throw_arg_error("slots", "at least 1 with a selection", p.slots);
  if (p.kv_format == KvFormat::fp8) {
    // fp8 K/V (docs/msa.md §6.6): the decode kernels read the e4m3 codes; prefill widens them
    // into a bf16 copy first (fp8_kv_widen.h). Never a kernel that would take the codes for bf16.
    MSA_CHECK_ARG(p.k.page_table != nullptr && p.v.page_table != nullptr, "k", 
                  "a paged layout for fp8 K/V (the codes live in a paged cache)", "a packed one");
    for (const auto& [layout, name] : {std::pair<const KeyLayout*, const char*>{&p.k, "k"}, {&p.v, "v"}})
      MSA_CHECK_ARG(layout->token_stride % 16 == 0 && layout->head_stride % 16 == 0 &&
                        layout->block_stride % 16 == 0,
                    name, "fp8 strides that are multiples of 16 bytes (16-byte copies of each token row)",
                    std::to_string(layout->token_stride) + ", " + std::to_string(layout->head_stride) +
                        ", " + std::to_string(layout->block_stride));
  }
}

// The device pointers of fp8 K/V (host-known: checked before anything is launched).
void check_fp8_pointers(const AttentionLaunch& p) {
  if (p.kv_format != KvFormat::fp8) return;
  for (const auto& [kv, name] : {std::pair<const Fp8Kv*, const char*>{&p.k_fp8, "k_fp8"}, {&p.v_fp8, "v_fp8"}}) {
    MSA_CHECK_ARG(kv->codes != nullptr && kv->scales.data != nullptr, name,
                  "device pointers to the e4m3 codes and their f32 scales", "null");
    MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(kv->codes) % 16 == 0, std::string(name) + ".codes",
                  "a 16-byte aligned pointer", "a misaligned pointer");
  }
}

// Workspace regions of the sparse path, sized for one chunk of selection.chunk_q queries.
struct SparsePlan {
  SelectionInversion selection;  // keys, cub temp, item counter, items
  int64_t queries_per_item = 0;
  size_t partial_lse = 0, partial_o = 0, total = 0;
};

SparsePlan plan_sparse_chunk(const AttentionLaunch& p, int64_t chunk_q) {
  SparsePlan plan;
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t nblk = selection_key_blocks(p.kv_heads, p.batch.max_k_len, p.k.block_size);
  plan.queries_per_item = std::max<int64_t>(1, kItemRows / group);
  plan.selection = size_selection_inversion(p.kv_heads, p.slots, nblk, chunk_q);
  WorkspaceCursor ws;
  take_selection_regions(plan.selection,
                         packed_item_bound(plan.selection, plan.selection.entries, plan.queries_per_item,
                                           p.batch.batch),
                         ws);
  const size_t partials = static_cast<size_t>(chunk_q) * p.q_heads * p.slots;
  plan.partial_lse = ws.take(partials * sizeof(float));
  plan.partial_o = ws.take(partials * p.head_dim * sizeof(PartialO));
  plan.total = ws.at;
  return plan;
}

// Largest chunk (<= total_q queries) whose workspace fits kSparseWorkspaceBudget, within the
// inversion's limits (max_selection_chunk); the launcher runs the chunks in order, so one call
// of any length (1M tokens) works with a bounded workspace. AttentionLaunch::max_chunk_queries
// caps the chunk (tests exercise the chunking with it; it must not change between
// attention_workspace_bytes and attention).
SparsePlan plan_sparse(const AttentionLaunch& p) {
  const int64_t total_q = p.batch.total_q;
  const int64_t chunk = max_selection_chunk(total_q, p.kv_heads, p.slots, p.max_chunk_queries);
  return fit_query_chunk(total_q, chunk, kSparseWorkspaceBudget,
                         [&p](int64_t chunk_q) { return plan_sparse_chunk(p, chunk_q); });
}

size_t dense_workspace_bytes(const AttentionLaunch& p) {
  return align_up(static_cast<size_t>(p.batch.batch + 1) * sizeof(int64_t));
}

// The sparse tile engine: the producer-warpgroup wgmma kernel (attention_sparse_producer.cuh,
// D = B = 128) by default, measured faster than the mma.sync one at every context
// (bench/results/history.md); AttentionLaunch::sparse_engine pins one. The wgmma kernel folds
// the scale into the exponent and takes each block's row max over the unscaled scores: the max
// of the scaled ones only for a positive scale. A negative scale (the spec allows any) runs the
// mma.sync kernel, which scales before the max; pinning wgmma then is an error.
bool use_sparse_wgmma(const AttentionLaunch& p) {
  const bool fits = p.head_dim == 128 && p.k.block_size == 128 && p.scale >= 0;
  if (p.sparse_engine == Engine::wgmma && !fits)
    throw_arg_error("sparse_engine", "automatic or mma_sync here (the wgmma sparse kernel needs "
                    "head_dim = block_size = 128 and a positive scale)",
                    "wgmma with head_dim " + std::to_string(p.head_dim) + ", block_size " +
                        std::to_string(p.k.block_size) + ", scale " + std::to_string(p.scale));
  return fits && p.sparse_engine != Engine::mma_sync;
}

// Q tiles of the wgmma sparse kernel by the bulk tensor copy engine (one thread per query
// issues two boxes of its G heads) instead of 64 threads' cp.async gathers with their
// address arithmetic, which bind the producer (measured faster, bitwise equal;
// bench/results/history.md): for G = 8 or 16 (a tile is whole queries, each box 1024-byte
// aligned in the swizzled slot) and fewer than 2^31 (query, head) rows (32-bit box coordinates).
// AttentionLaunch::sparse_q_load pins one; tma where it cannot run is an error.
bool use_sparse_tma_q(const AttentionLaunch& p) {
  const int64_t group = p.q_heads / p.kv_heads;
  const bool fits = (group == 8 || group == 16) && p.batch.total_q * p.q_heads < (int64_t{1} << 31) &&
                    reinterpret_cast<uintptr_t>(p.q) % 16 == 0;
  if (p.sparse_q_load == TileLoad::tma && !fits)
    throw_arg_error("sparse_q_load", "automatic or cp_async here (TMA Q tiles need G = q_heads / "
                    "kv_heads of 8 or 16, < 2^31 (query, head) rows and a 16-byte aligned q)",
                    "tma with G " + std::to_string(group));
  return fits && p.sparse_q_load != TileLoad::cp_async;
}

// The sparse prefill's work order (SparseOrder, include/msa/cuda/types.h). automatic runs
// both: the tile-union plan sends each 128-row tile to query-major where query_major_pays
// (query_major_rule.h, kQueryMajorPairRatio), the rest to kv_major. A pinned kv_major tile
// engine (sparse_engine) keeps every tile on kv_major.
SparseOrder sparse_order_of(const AttentionLaunch& p) {
  const bool fits = sparse_query_major_fits(p);
  if (p.sparse_order == SparseOrder::query_major && !fits)
    throw_arg_error("sparse_order", "automatic or kv_major here (query_major needs head_dim = block_size = 128 "
                    "and G = q_heads / kv_heads of 4, 8 or 16)",
                    "query_major with head_dim " + std::to_string(p.head_dim) + ", block_size " +
                        std::to_string(p.k.block_size) + ", G " + std::to_string(p.q_heads / p.kv_heads));
  if (p.sparse_order == SparseOrder::query_major) return SparseOrder::query_major;
  if (p.sparse_order == SparseOrder::kv_major || !fits || p.sparse_engine != Engine::automatic)
    return SparseOrder::kv_major;
  return SparseOrder::automatic;
}

size_t sparse_workspace_bytes(const AttentionLaunch& p) {
  const SparseOrder order = sparse_order_of(p);
  return (order != SparseOrder::kv_major ? plan_tile_unions(p).total : 0) +
         (order != SparseOrder::query_major ? plan_sparse(p).total : 0);
}

// skip: [kv_heads, total_q] rows the query-major kernel wrote (null: none).
template <int D>
void run_sparse(const AttentionLaunch& p, const SparsePlan& plan, char* ws, cudaStream_t stream,
                const uint8_t* skip) {
  const int64_t total_q = p.batch.total_q, group = p.q_heads / p.kv_heads;
  PartialO* partial_o = reinterpret_cast<PartialO*>(ws + plan.partial_o);
  float* partial_lse = reinterpret_cast<float*>(ws + plan.partial_lse);

  const bool wgmma = use_sparse_wgmma(p);
  const bool q_tma = wgmma && use_sparse_tma_q(p);
  const CUtensorMap q_map = q_tma ? bf16_rows_tensor_map(p.q, p.batch.total_q * p.q_heads, static_cast<int>(D),
                                                         static_cast<int>(group), 64)
                                  : CUtensorMap{};
  const size_t smem = wgmma ? attn::SparseProducerTraits::kSmemBytes : attn::sparse_smem_bytes<D>(p.k.block_size);
  const void* kernel = wgmma ? reinterpret_cast<const void*>(attn::sparse_producer_kernel)
                             : reinterpret_cast<const void*>(attn::sparse_kv_major_kernel<D>);
  const int threads = wgmma ? attn::SparseProducerTraits::kThreads : attn::kSparseThreads;
  const int64_t resident = int64_t{resident_ctas_per_sm(kernel, threads, smem)} * sm_count();
  const size_t merge_smem = static_cast<size_t>(p.slots) * group * sizeof(float);
  auto merge_kernel = attn::merge_partials_kernel<D>;
  if (merge_smem > 48 * 1024)
    require_dynamic_smem(merge_kernel, merge_smem);

  for (int64_t q_begin = 0; q_begin < total_q; q_begin += plan.selection.chunk_q) {
    const int64_t chunk_q = std::min(plan.selection.chunk_q, total_q - q_begin);
    const SelectionChunk selection = invert_selection(plan.selection, p.topk, p.batch, q_begin, chunk_q,
                                                      static_cast<int>(plan.queries_per_item), ws, stream, skip);

    attn::SparseArgs args{};
    set_attention_inputs(args, p);
    args.block_size = p.k.block_size;
    args.seq_of_query = p.batch.seq_of_query;
    set_selection_chunk(args, selection);
    args.scale_log2 = p.scale * attn::kLog2e;
    args.partial_o = partial_o;
    args.partial_lse = partial_lse;
    const int64_t chunk_items =
        packed_item_bound(plan.selection, selection.entries, plan.queries_per_item, p.batch.batch);
    const int64_t grid = std::max<int64_t>(1, std::min(chunk_items, resident));
    if (wgmma)
      attn::sparse_producer_kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(args, q_map, q_tma);
    else
      attn::sparse_kv_major_kernel<D><<<static_cast<unsigned>(grid), threads, smem, stream>>>(args);
    MSA_CUDA_CHECK_LAUNCH();

    const attn::MergeArgs merge{p.topk,    total_q,     q_begin, chunk_q, p.q_heads, p.kv_heads, group,
                                p.slots,   partial_o,   partial_lse, p.o, p.o_type == OutputType::bf16,
                                p.lse, skip};
    merge_kernel<<<static_cast<unsigned>(p.kv_heads * chunk_q), attn::kMergeThreads, merge_smem, stream>>>(
        merge);
    MSA_CUDA_CHECK_LAUNCH();
  }
}


// The dense prefill engine, AttentionLaunch::dense_engine pins one; automatic picks what was
// measured faster (bench/results/h200.md, history.md). Head dim 128: the wgmma kernel
// (attention_dense_wgmma.cuh). Head dim 80 (the vision tower): the wgmma kernel when the call
// has at least kWgmma80Waves of its one-CTA-per-SM tiles per SM, else the mma.sync kernel,
// whose 64-row CTAs (several per SM) leave a shorter tail on small calls: measured on the
// H200 at 16 heads, a 2304-patch image (2.2 tiles per SM) ran 6% slower on wgmma and a video
// of 4096-patch segments (31 per SM) 12% faster. The decode path (max_q_len <= 16) does not
// read it.
constexpr int64_t kWgmma80Waves = 8;
bool use_dense_wgmma(const AttentionLaunch& p) {
  const bool fits = p.head_dim == 128 || p.head_dim == 80;
  if (p.dense_engine == Engine::wgmma && !fits)
    throw_arg_error("dense_engine", "automatic or mma_sync for head_dim " + std::to_string(p.head_dim) +
                    " (the wgmma dense kernel needs 128 or 80)", "wgmma");
  if (!fits || p.dense_engine == Engine::mma_sync) return false;
  if (p.dense_engine == Engine::wgmma || p.head_dim == 128) return true;
  const int64_t tiles = p.batch.total_q * p.q_heads / 128;  // DenseWgmmaTraits::kRows rows per CTA
  return tiles >= kWgmma80Waves * sm_count();
}

template <int D>
void run_dense(const AttentionLaunch& p, char* ws, cudaStream_t stream) {
  const int64_t group = p.q_heads / p.kv_heads;
  int64_t* tile_start = reinterpret_cast<int64_t*>(ws);
  if (use_dense_wgmma(p)) {
    run_dense_wgmma(p, tile_start, stream);  // same workspace: tile_start only
    return;
  }
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group,
                                                             tile_start);
  MSA_CUDA_CHECK_LAUNCH();

  attn::DenseArgs args{};
  set_dense_args(args, p, tile_start, attn::kLog2e);
  const int64_t tiles = dense_grid_tiles(p, attn::kDenseRows);
  const size_t smem = attn::dense_smem_bytes<D>();
  auto kernel = attn::dense_flash_kernel<D>;
  require_dynamic_smem(kernel, smem);
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), attn::kDenseThreads,
           smem, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t attention_workspace_bytes(const AttentionLaunch& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  if (attention_widens_fp8(params))  // the bf16 copy, then the bf16 prefill's own workspace
    return align_up(fp8_widen_workspace_bytes(params)) +
           attention_workspace_bytes(fp8_widened_launch(params, nullptr));
  if (attention_decode_applies(params)) return attention_decode_workspace_bytes(params);  // sparse or dense
  return params.topk ? sparse_workspace_bytes(params) : dense_workspace_bytes(params);
}

bool attention_uses_decode_path(const AttentionLaunch& params) {
  check_params(params);
  return params.batch.total_q > 0 && attention_decode_applies(params);
}

void attention(const AttentionLaunch& params, void* workspace, void* stream) {
  check_params(params);
  if (params.batch.total_q == 0) return;  // nothing to write
  check_fp8_pointers(params);
  MSA_CHECK_ARG(!params.decode_skip_merge || attention_decode_applies(params), "decode_skip_merge",
                "the decode path (max_seqlen_q <= 16)", "another path");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  if (attention_widens_fp8(params)) {
    widen_fp8_kv(params, ws, s);
    attention(fp8_widened_launch(params, ws), ws + align_up(fp8_widen_workspace_bytes(params)), stream);
    return;
  }
  if (attention_decode_applies(params)) {
    launch_attention_decode(params, ws, s);
  } else if (params.topk) {
    const SparseOrder order = sparse_order_of(params);
    const uint8_t* skip = nullptr;
    if (order != SparseOrder::kv_major) {
      const TileUnionPlan unions = plan_tile_unions(params);
      run_sparse_query_major(params, unions, ws,
                             order == SparseOrder::query_major ? FLT_MAX : kQueryMajorPairRatio, s);
      skip = query_major_flags(unions, ws);
      ws += unions.total;
    }
    if (order != SparseOrder::query_major) {
      const SparsePlan plan = plan_sparse(params);
      if (params.head_dim == 64)
        run_sparse<64>(params, plan, ws, s, skip);
      else
        run_sparse<128>(params, plan, ws, s, skip);
    }
  } else {
    if (params.head_dim == 64)
      run_dense<64>(params, ws, s);
    else if (params.head_dim == 80)
      run_dense<80>(params, ws, s);
    else
      run_dense<128>(params, ws, s);
  }
}

}  // namespace msa::cuda
