// Host launcher of the index branch (docs/msa.md §3): picks a path from the host-known batch
// maxima, sizes the workspace, and launches the kernels of this folder on the caller's
// stream. Allocation-free and never synchronises (graph-capturable).
//
// Paths:
// - fused tiles (prefill): tile_prefix_kernel, then a tile scan ranks in its epilogue and
//   writes the rows. Used when there are enough tiles to fill the GPU, except where the split
//   ranking is the default or pinned (plan_tile_ranking, ranking_passes.h). For M3's shape
//   (Di = B = 128) without lse_out, the warpgroup-MMA scan (producer_tile_scan_kernel<false>,
//   indexer_scan_producer.cuh: a producer warpgroup feeds two consumer warpgroups, 256-row
//   tiles) runs where its lists fit (make_plan); else the mma.sync tile_scan_kernel
//   (indexer_scan.cuh).
// - split tiles: the tile scan (grid.y chunks of blocks) writes block maxima to the workspace,
//   select_rows_kernel (indexer_rows.cuh) ranks them, in passes over the queries whose maxima
//   fit the cap; each pass's scan launches only the tiles that hold its queries. Short
//   prefills (chunks balance a few long tiles), every prefill of the bf16 or fp8 wgmma scans,
//   and any prefill when pinned.
// - decode (max_q_len <= 16): src/cuda/decode/indexer_decode.cu (split-K scan over all SMs,
//   then a select kernel). fp8/fp4 index-key caches run this path only.
// - fp8 compute (IndexerLaunch::fp8_compute; Di = B = 128): quantize_index_keys (the CPU
//   recipe's bytes) writes e4m3 codes + f32 scales of the qi rows and, for bf16 keys, of every
//   stored key token into the workspace (an fp8 cache is read as stored), then
//   producer_tile_scan_kernel<true> ranks by fp8 scores on the tile paths' grid, fused or
//   split. Every q_len takes this path (correct for decode-sized batches, not tuned for them).
// Then, when lse_out is requested (training): on the fused mma.sync path with logit_scale
// > 0, tile_scan_kernel<kDi, true> writes the ranked blocks' LSE from per-block (max,
// sum-exp) computed with the scores, and selected_lse_kernel (forced-only) merges in the
// init and local blocks. Everywhere else (split tiles, the wgmma scan, decode, fp8 compute,
// logit_scale <= 0) selected_lse_kernel recomputes all selected scores per row: correct, and
// cheap at the short contexts those paths serve (with lse_out the wgmma scan runs only when
// pinned). lse_out stays exact under fp8 compute (bf16 qi and keys). msa::training_step on
// CUDA does not ask for lse_out: the KL's tensor-core pass computes the same LSE
// (IndexerKlLaunch::student_lse_out), and this launcher's ranking alone is 3.2x faster at 128K.
#include <algorithm>
#include <string>

#include "cuda/common/kernel_attributes.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/indexer/indexer_rows.cuh"
#include "cuda/indexer/indexer_scan.cuh"
#include "cuda/indexer/indexer_scan_wgmma.cuh"
#include "cuda/indexer/indexer_scan_producer.cuh"
#include "cuda/indexer/ranking_passes.h"
#include "cuda/launch.h"
#include "msa/cuda/quantize.h"
#include "cuda/common/sm_count.h"
#include "cuda/common/workspace_layout.h"

namespace msa::cuda {

namespace {

using namespace indexer_detail;

enum class Path { fused_tiles, split_tiles, decode };

struct Plan {
  Path path = Path::fused_tiles;
  bool wgmma = false;  // tile paths: the warpgroup-MMA kernel (Di = 128, B = 128)
  bool fp8 = false;    // tile paths: the fp8 scan (fp8_compute) and its quantized operands
  bool fused_lse = false;  // lse_out from the fused scan (+ the forced-only row pass)
  int ranked = 0, list_pitch = 1;
  int64_t max_blocks = 0;  // block-max row stride
  // tile paths
  int queries_per_tile = 0;
  int64_t tile_bound = 0;  // grid.x: an upper bound of the number of tiles
  int64_t pass_queries = 0;  // split tiles: queries per pass (scan + select_rows), equal passes
  int64_t passes = 0;
  TileRanking ranking;  // split tiles: a pass's scan grid.x (pass_tile_bound) and chunks (pass_chunks)
  DecodeIndexPlan decode;  // decode path
  // workspace
  size_t prefix_offset = 0, pass_tiles_offset = 0, block_max_offset = 0, bytes = 0;
  // fp8: e4m3 codes + f32 scales of the qi rows, and of the keys when they are bf16
  size_t q_codes_offset = 0, q_scales_offset = 0, k_codes_offset = 0, k_scales_offset = 0;
};

void check_params(const IndexerLaunch& p) {
  MSA_CHECK_ARG(p.dim == 64 || p.dim == 128, "qi", "index head dim 64 or 128 (CUDA indexer)",
                p.dim);
  MSA_CHECK_ARG(p.heads >= 1 && p.heads <= 16, "qi", "1..16 index heads (CUDA indexer)", p.heads);
  MSA_CHECK_ARG(p.max_chunk_queries >= 0, "max_chunk_queries", ">= 0 (0: no cap)", p.max_chunk_queries);
  MSA_CHECK_ARG(p.block_size == 64 || p.block_size == 128, "block_size",
                "64 or 128 (CUDA indexer)", p.block_size);
  MSA_CHECK_ARG(p.topk >= 1 && p.topk <= kMaxTopk, "topk", "1..32 (CUDA indexer)", p.topk);
  MSA_CHECK_ARG(p.local_blocks >= 1, "local_blocks", "at least 1", p.local_blocks);
  MSA_CHECK_ARG(p.init_blocks >= 0, "init_blocks", "a non-negative count", p.init_blocks);
  MSA_CHECK_ARG(p.init_blocks + p.local_blocks <= p.topk, "local_blocks + init_blocks",
                "at most topk = " + std::to_string(p.topk), p.init_blocks + p.local_blocks);
  MSA_CHECK_ARG(p.ki.block_size == p.block_size, "ki", "a layout with block size " +
                std::to_string(p.block_size), p.ki.block_size);
  if (p.ki_format == KeyFormat::bf16) {
    MSA_CHECK_ARG(p.ki.token_stride % 8 == 0, "ki", "a token stride that is a multiple of 8",
                  p.ki.token_stride);
    MSA_CHECK_ARG(p.ki.head_stride % 8 == 0 && p.ki.block_stride % 8 == 0, "ki",
                  "head and block strides that are multiples of 8",
                  std::to_string(p.ki.head_stride) + ", " + std::to_string(p.ki.block_stride));
    MSA_CHECK_ARG(is_aligned(p.ki.data, 16), "ki", "16-byte aligned data", "a misaligned pointer");
  } else {  // fp8 / fp4 codes + scales of a paged cache (decode path, make_plan)
    MSA_CHECK_ARG(p.ki.page_table != nullptr, "ki", "a paged layout (page table) for fp8/fp4 "
                  "index keys", "a varlen layout");
    MSA_CHECK_ARG(is_aligned(p.ki_quantized.codes, 16) && is_aligned(p.ki_quantized.scales, 16) &&
                      p.ki_quantized.codes != nullptr && p.ki_quantized.scales != nullptr,
                  "ki_quantized", "16-byte aligned codes and scales", "a null or misaligned pointer");
    MSA_CHECK_ARG(p.lse_out == nullptr, "lse_out",
                  "null with fp8/fp4 index keys (the CUDA indexer computes no selected LSE from "
                  "quantized keys; Impl::cpu does)",
                  "a device pointer");
  }
  MSA_CHECK_ARG(is_aligned(p.qi, 16), "qi", "16-byte aligned data", "a misaligned pointer");
  if (p.fp8_compute) {
    MSA_CHECK_ARG(p.dim == Fp8ScanTraits::kDi && p.block_size == Fp8ScanTraits::kBlock,
                  "index_compute", "exact for Di = " + std::to_string(p.dim) + ", B = " +
                  std::to_string(p.block_size) + " (the CUDA fp8 index scan needs Di = B = 128)",
                  "fp8");
    MSA_CHECK_ARG(p.ki_format != KeyFormat::fp4, "index_compute",
                  "exact with fp4 index keys (fp8 compute reads bf16 or fp8 keys)", "fp8");
    if (p.ki_format == KeyFormat::bf16) {
      MSA_CHECK_ARG(p.ki.token_stride == p.dim && p.ki.block_stride == p.block_size * p.dim, "ki",
                    "contiguous token rows (token stride Di, block stride B * Di) with "
                    "index_compute fp8",
                    std::to_string(p.ki.token_stride) + ", " + std::to_string(p.ki.block_stride));
      MSA_CHECK_ARG(p.batch.total_q == 0 || p.ki_tokens >= 1, "ki_tokens",
                    "the number of key tokens stored at ki.data (index_compute fp8)", p.ki_tokens);
    }
  }
  MSA_CHECK_ARG(p.batch.total_q == 0 || p.topk_out != nullptr, "topk_out", "a device pointer",
                "null");
  MSA_CHECK_ARG(p.batch.max_q_len <= p.batch.total_q && p.batch.max_k_len >= 0, "batch",
                "consistent maxima", "max_q_len " + std::to_string(p.batch.max_q_len));
}

// CTAs of the producer scan per SM in split mode (no lists in shared memory): one, at its
// pipeline's shared memory, on the H200.
template <bool kFp8>
int split_scan_ctas_per_sm() {
  using T = ProducerScanTraits<kFp8>;
  return resident_ctas_per_sm(producer_tile_scan_kernel<kFp8>, T::kThreads, T::smem_bytes(0));
}

Plan make_plan(const IndexerLaunch& p) {
  Plan plan;
  plan.ranked = p.topk - p.init_blocks - p.local_blocks;
  plan.list_pitch = plan.ranked | 1;  // odd: 32 lanes' lists start in 32 distinct banks
  plan.max_blocks = ceil_div(p.batch.max_k_len, p.block_size);
  const int64_t total_rows = p.batch.total_q * p.heads;
  const int sms = sm_count();

  // Decode-sized calls (<= 16 queries per sequence) take the split-K decode scan
  // (src/cuda/decode/), whose block maxima fit the workspace cap.
  DecodeIndexPlan decode;
  if (!p.fp8_compute && plan.ranked > 0 && p.batch.max_q_len <= kDecodeMaxQueries &&
      plan_decode_index(p, plan.max_blocks, decode)) {
    plan.path = Path::decode;
    plan.decode = decode;
    plan.block_max_offset = 0;
    plan.bytes = align_up(decode.block_max_bytes);
    return plan;
  }
  // Quantized keys are read by the decode scan only. Without ranked candidates (topk ==
  // local + init) the tile path writes the rows without reading any key: allowed.
  if (p.ki_format != KeyFormat::bf16 && plan.ranked > 0 && !p.fp8_compute)
    throw Error("ki: quantized index keys (fp8/fp4) are supported for decode (q_len <= " +
                std::to_string(kDecodeMaxQueries) + ") only; got max_q_len " +
                std::to_string(p.batch.max_q_len) +
                (p.batch.max_q_len <= kDecodeMaxQueries
                     ? " with " + std::to_string(decode.block_max_bytes >> 20) +
                           " MiB of decode block maxima (over the " +
                           std::to_string(kMaxBlockMaxBytes >> 20) + " MiB workspace cap)"
                     : std::string()));

  // Engine of the tile paths: the wgmma scan for Di = B = 128 where 256 rows' lists fit shared
  // memory next to the ring (list pitch <= 17, i.e. topk - local - init <= 17; M3: 15), by
  // measurement faster than the mma.sync scan (bench/results/history.md); but with lse_out the
  // mma.sync scan, whose fused per-block sum-exp beats the wgmma scan plus the selected-LSE
  // recomputation. IndexerLaunch::scan_engine pins one (tests, benchmarks).
  using Bf16Scan = ProducerScanTraits<false>;
  const bool wgmma_fits =
      p.dim == Bf16Scan::kDi && p.block_size == Bf16Scan::kBlock && Bf16Scan::fits(plan.list_pitch);
  MSA_CHECK_ARG(!(p.scan_engine == Engine::wgmma && !wgmma_fits && !p.fp8_compute), "scan_engine",
                "automatic or mma_sync for this shape (the wgmma scan needs Di = B = 128 and "
                "topk - local_blocks - init_blocks <= 17)", "wgmma");
  MSA_CHECK_ARG(!(p.scan_engine == Engine::mma_sync && p.fp8_compute), "scan_engine",
                "automatic or wgmma with fp8 index compute (its scan is the fp8 wgmma kernel)",
                "mma_sync");
  plan.fp8 = p.fp8_compute;
  plan.wgmma = !plan.fp8 && wgmma_fits &&
               (p.scan_engine == Engine::automatic ? p.lse_out == nullptr
                                                   : p.scan_engine == Engine::wgmma);
  const int tile_rows = plan.fp8     ? Fp8ScanTraits::kRows
                        : plan.wgmma ? Bf16Scan::kRows
                                     : TileScanTraits<64>::kRows;
  plan.queries_per_tile = static_cast<int>(tile_rows / p.heads);
  plan.tile_bound = std::min(p.batch.total_q,
                             ceil_div(p.batch.total_q, plan.queries_per_tile) + p.batch.batch);
  plan.prefix_offset = 0;
  plan.bytes = align_up(size_t(p.batch.batch + 1) * sizeof(int64_t));
  // The ranking (ranking_passes.h, plan_tile_ranking): in the scan, or separately in passes
  // of at most pass_queries queries whose maxima fit the cap (kMaxBlockMaxBytes, or fewer
  // queries: IndexerLaunch::max_chunk_queries), one scan and one select_rows launch each.
  // A query's maxima take Hi x blocks x 4 bytes; at M3's shape (Hi = 4, B = 128) one pass
  // holds a whole 64K prefill, and 32K queries of a 128K one (4 passes). Each pass writes and
  // reads back up to 512 MiB, ~0.25 ms of traffic against the ~5 ms its scan computes at
  // 128K. A tile across a pass boundary is scanned in both passes. IndexerLaunch::ranking
  // pins either (tests, benchmarks).
  const size_t query_max_bytes = size_t(p.heads) * size_t(plan.max_blocks) * sizeof(float);
  TileRankingInputs in;
  in.ranking = p.ranking;
  in.producer_scan = plan.wgmma || plan.fp8;
  in.ranked = plan.ranked;
  in.total_q = p.batch.total_q;
  in.batch = p.batch.batch;
  in.tile_bound = plan.tile_bound;
  in.queries_per_tile = plan.queries_per_tile;
  in.max_blocks = plan.max_blocks;
  in.passes = ranking_passes(p.batch.total_q, query_max_bytes, kMaxBlockMaxBytes, p.max_chunk_queries);
  in.sms = sms;
  if (in.producer_scan && p.batch.batch == 1) {  // pass_chunks: wave-fitted chunks
    in.resident_ctas = int64_t{sms} * (plan.fp8 ? split_scan_ctas_per_sm<true>()
                                                : split_scan_ctas_per_sm<false>());
    in.max_k_len = p.batch.max_k_len;
    in.block_size = p.block_size;
    in.skipped_blocks = p.init_blocks + p.local_blocks;
  }
  MSA_CHECK_ARG(p.ranking != IndexRanking::separate || in.passes.passes > 0 || plan.ranked <= 0, "ranking",
                "automatic or in_scan for this call (separate ranking needs one query's block "
                "maxima within the " + std::to_string(kMaxBlockMaxBytes >> 20) + " MiB workspace cap)",
                "separate, for " + std::to_string(query_max_bytes >> 20) + " MiB per query");
  const TileRanking ranking = plan_tile_ranking(in);
  if (ranking.separate) {
    plan.path = Path::split_tiles;
    plan.pass_queries = in.passes.pass_queries;
    plan.passes = in.passes.passes;
    plan.ranking = ranking;
    plan.pass_tiles_offset = plan.bytes;
    plan.bytes += align_up(size_t(2 * plan.passes) * sizeof(int64_t));
    plan.block_max_offset = plan.bytes;
    plan.bytes += align_up(in.passes.maxima_bytes);
  }
  // The fused scan's sum-exp is relative to the block max of the raw score, which is the
  // block max of the logit only for a positive scale.
  plan.fused_lse = p.lse_out != nullptr && plan.path == Path::fused_tiles && !plan.wgmma &&
                   !plan.fp8 && p.logit_scale > 0.0f;
  if (plan.fp8) {  // the quantized operands (host-known sizes: rows, ki_tokens)
    const size_t dim = static_cast<size_t>(p.dim);
    plan.q_codes_offset = plan.bytes;
    plan.bytes += align_up(size_t(total_rows) * dim);
    plan.q_scales_offset = plan.bytes;
    plan.bytes += align_up(size_t(total_rows) * sizeof(float));
    if (p.ki_format == KeyFormat::bf16) {
      plan.k_codes_offset = plan.bytes;
      plan.bytes += align_up(size_t(p.ki_tokens) * dim);
      plan.k_scales_offset = plan.bytes;
      plan.bytes += align_up(size_t(p.ki_tokens) * sizeof(float));
    }
  }
  return plan;
}

template <int kDi>
void launch(const IndexerLaunch& p, const Plan& plan, char* workspace, cudaStream_t stream) {
  float* block_max = reinterpret_cast<float*>(workspace + plan.block_max_offset);
  MSA_CHECK_ARG(!p.decode_scan_only || plan.path == Path::decode, "decode_scan_only",
                "the decode path (max_seqlen_q <= 16, ranked candidates)", "another path");
  if (plan.path == Path::decode) {
    launch_decode_index(p, plan.decode, plan.ranked, plan.list_pitch, block_max, stream);
  } else {
    using T = TileScanTraits<kDi>;
    const bool split = plan.path == Path::split_tiles;
    int64_t* tile_prefix = reinterpret_cast<int64_t*>(workspace + plan.prefix_offset);
    int64_t* pass_tiles =
        split ? reinterpret_cast<int64_t*>(workspace + plan.pass_tiles_offset) : nullptr;
    tile_prefix_kernel<<<1, kPrefixThreads, 0, stream>>>(p.batch, plan.queries_per_tile,
                                                         tile_prefix, plan.pass_queries, pass_tiles);
    MSA_CUDA_CHECK_LAUNCH();
    TileScanPlan t;
    t.tile_prefix = tile_prefix;
    t.pass_tiles = pass_tiles;
    t.queries_per_tile = plan.queries_per_tile;
    t.ranked = plan.ranked;
    t.list_pitch = plan.list_pitch;
    t.block_max = split ? block_max : nullptr;
    t.block_max_stride = plan.max_blocks;
    t.logit_scale_log2 = p.logit_scale * 1.4426950408889634f;  // log2(e)
    // Fused: every tile, one CTA each; split: a pass's tiles (tile_geometry) x its chunks
    // (pass_chunks, set per pass below).
    dim3 grid(static_cast<unsigned>(split ? plan.ranking.pass_tile_bound : plan.tile_bound), 1);
    Fp8ScanOperands ops;
    if (plan.fp8) {
      ops.q_codes = reinterpret_cast<const uint8_t*>(workspace + plan.q_codes_offset);
      ops.q_scales = reinterpret_cast<const float*>(workspace + plan.q_scales_offset);
      quantize_index_keys(p.qi, p.batch.total_q * p.heads, p.dim, KeyFormat::fp8,
                          reinterpret_cast<uint8_t*>(workspace + plan.q_codes_offset),
                          reinterpret_cast<uint8_t*>(workspace + plan.q_scales_offset), stream);
      if (p.ki_format == KeyFormat::bf16) {
        ops.k_codes = reinterpret_cast<const uint8_t*>(workspace + plan.k_codes_offset);
        ops.k_scales = reinterpret_cast<const float*>(workspace + plan.k_scales_offset);
        quantize_index_keys(p.ki.data, p.ki_tokens, p.dim, KeyFormat::fp8,
                            reinterpret_cast<uint8_t*>(workspace + plan.k_codes_offset),
                            reinterpret_cast<uint8_t*>(workspace + plan.k_scales_offset), stream);
      } else {  // an fp8 cache, as stored
        ops.k_codes = p.ki_quantized.codes;
        ops.k_scales = reinterpret_cast<const float*>(p.ki_quantized.scales);
      }
    }
    const auto scan = [&] {
      if (plan.fp8) {
        using F = Fp8ScanTraits;
        const size_t smem = F::smem_bytes(split ? 0 : plan.list_pitch);
        require_dynamic_smem(producer_tile_scan_kernel<true>, smem);
        producer_tile_scan_kernel<true><<<grid, F::kThreads, smem, stream>>>(p, t, ops);
      } else if (plan.wgmma) {
        using P = ProducerScanTraits<false>;
        const size_t smem = P::smem_bytes(split ? 0 : plan.list_pitch);
        require_dynamic_smem(producer_tile_scan_kernel<false>, smem);
        producer_tile_scan_kernel<false><<<grid, P::kThreads, smem, stream>>>(p, t, Fp8ScanOperands{});
      } else {
        const size_t smem = T::smem_bytes(split ? 0 : plan.list_pitch, plan.fused_lse);
        const auto kernel = plan.fused_lse ? tile_scan_kernel<kDi, true> : tile_scan_kernel<kDi, false>;
        require_dynamic_smem(kernel, smem);
        kernel<<<grid, T::kThreads, smem, stream>>>(p, t);
      }
      MSA_CUDA_CHECK_LAUNCH();
    };
    if (!split) {
      scan();
    } else {  // passes over the queries, each ranked before the next reuses the maxima
      for (int64_t pass = 0; pass < plan.passes; ++pass) {
        const int64_t q0 = pass * plan.pass_queries;
        t.pass = pass;
        t.query_begin = q0;
        t.query_end = std::min(p.batch.total_q, q0 + plan.pass_queries);
        const PassChunks chunks = pass_chunks(plan.ranking, pass);
        t.chunk_blocks = chunks.chunk_blocks;
        grid.y = static_cast<unsigned>(chunks.chunks);
        scan();
        SelectPlan s;
        s.block_max = block_max;
        s.block_max_stride = plan.max_blocks;
        s.row_begin = t.query_begin * p.heads;
        s.row_end = t.query_end * p.heads;
        s.ranked = plan.ranked;
        s.list_pitch = plan.list_pitch;
        const unsigned ctas = static_cast<unsigned>(ceil_div(s.row_end - s.row_begin, kRowWarps));
        select_rows_kernel<<<ctas, kRowThreads, select_smem_bytes(plan.list_pitch), stream>>>(p, s);
        MSA_CUDA_CHECK_LAUNCH();
      }
    }
  }

  const unsigned row_ctas = static_cast<unsigned>(ceil_div(p.batch.total_q * p.heads, kRowWarps));
  if (p.lse_out) {  // all selected blocks, or (fused_lse) the forced ones into the scan's LSE
    selected_lse_kernel<kDi><<<row_ctas, kRowThreads, 0, stream>>>(p, plan.fused_lse);
    MSA_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

size_t indexer_workspace_bytes(const IndexerLaunch& params) {
  check_params(params);
  if (params.batch.total_q == 0) return 0;
  return make_plan(params).bytes;
}

bool indexer_uses_decode_path(const IndexerLaunch& params) {
  check_params(params);
  return params.batch.total_q > 0 && make_plan(params).path == Path::decode;
}

void indexer_selected_lse(const IndexerLaunch& params, void* stream) {
  check_params(params);
  MSA_CHECK_ARG(params.lse_out != nullptr, "lse_out", "a device pointer", "null");
  if (params.batch.total_q == 0) return;
  const unsigned row_ctas =
      static_cast<unsigned>(ceil_div(params.batch.total_q * params.heads, kRowWarps));
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.dim == 64)
    selected_lse_kernel<64><<<row_ctas, kRowThreads, 0, cuda_stream>>>(params, false);
  else
    selected_lse_kernel<128><<<row_ctas, kRowThreads, 0, cuda_stream>>>(params, false);
  MSA_CUDA_CHECK_LAUNCH();
}

void indexer(const IndexerLaunch& params, void* workspace, void* stream) {
  check_params(params);
  if (params.batch.total_q == 0) return;  // no rows, nothing to write
  const Plan plan = make_plan(params);
  MSA_CHECK_ARG(plan.bytes == 0 || workspace != nullptr, "workspace",
                std::to_string(plan.bytes) + " bytes (indexer_workspace_bytes)", "null");
  char* bytes = static_cast<char*>(workspace);
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.dim == 64)
    launch<64>(params, plan, bytes, cuda_stream);
  else
    launch<128>(params, plan, bytes, cuda_stream);
}

}  // namespace msa::cuda
