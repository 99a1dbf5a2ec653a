// The decode path of the index branch (decode_launch.h): decode_scan_kernel writes each
// row's block maxima over a chunk of its index-key blocks (split-K over all SMs; bf16, fp8
// or fp4 keys: indexer_decode.cuh), then decode_select_kernel ranks one row per CTA with a
// threshold and an exact rank of the few candidates (indexer_decode_select.cuh). Both are
// PDL-launched, so each launch overlaps the kernel before it.
#include <algorithm>

#include "cuda/common/kernel_attributes.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/sm_count.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/decode/decode_scan_grid.h"
#include "cuda/decode/indexer_decode.cuh"
#include "cuda/decode/indexer_decode_select.cuh"

namespace msa::cuda {

namespace {

using namespace indexer_detail;

// Decode scan grid (decode_scan_grid.h): one wave of the 2 resident CTAs per SM
// (decode_scan_kernel's shared memory), each CTA a contiguous chunk of >= 1 block. Every CTA
// pays a start-up of dependent round trips (request geometry -> page table -> first keys)
// that longer chunks amortise, while few-block contexts want every block in flight at once
// (8K: 64 CTAs of 1 block rather than 16 of 4); the measurements behind this are in
// bench/results/history.md.
constexpr int kMinDecodeChunk = 1;   // blocks per decode CTA
constexpr int kDecodeCtasPerSm = 2;  // decode grid target (resident per SM: one wave)

template <int kDi, KeyFormat kFormat>
void launch_scan(const IndexerLaunch& p, const DecodeScanPlan& d, int64_t ctas, cudaStream_t stream) {
  using T = DecodeScanTraits<kDi, kFormat>;
  const auto kernel = decode_scan_kernel<kDi, kFormat>;
  require_dynamic_smem(kernel, T::kSmemBytes);
  launch_pdl(kernel, dim3(static_cast<unsigned>(ctas)), dim3(T::kThreads), T::kSmemBytes, stream, p, d);
}

template <int kDi>
void launch_scan(const IndexerLaunch& p, const DecodeScanPlan& d, int64_t ctas, cudaStream_t stream) {
  switch (p.ki_format) {
    case KeyFormat::bf16: launch_scan<kDi, KeyFormat::bf16>(p, d, ctas, stream); break;
    case KeyFormat::fp8: launch_scan<kDi, KeyFormat::fp8>(p, d, ctas, stream); break;
    case KeyFormat::fp4: launch_scan<kDi, KeyFormat::fp4>(p, d, ctas, stream); break;
  }
}

}  // namespace

bool plan_decode_index(const IndexerLaunch& p, int64_t max_blocks, DecodeIndexPlan& plan) {
  const int64_t total_rows = p.batch.total_q * p.heads;
  const int sms = sm_count();
  // Decode rows are read as float4 by decode_select_kernel: pad their stride to 4.
  plan.block_max_stride = ceil_div(max_blocks, 4) * 4;
  plan.block_max_bytes = size_t(total_rows) * size_t(plan.block_max_stride) * sizeof(float);
  if (plan.block_max_bytes > kMaxBlockMaxBytes) return false;
  plan.row_tiles = static_cast<int>(
      ceil_div(p.batch.max_q_len * p.heads, DecodeScanTraits<64, KeyFormat::bf16>::kRows));
  const DecodeScanGrid grid = decode_scan_grid(p.batch.batch * plan.row_tiles, max_blocks,
                                               int64_t{kDecodeCtasPerSm} * sms, kMinDecodeChunk);
  plan.chunk_blocks = static_cast<int>(grid.chunk_blocks);
  plan.chunks = static_cast<int>(grid.chunks);
  plan.ctas = p.batch.batch * plan.row_tiles * plan.chunks;
  // Few select CTAs are latency-bound: let them load their whole register share of the
  // row before its length is known (<= 32 KB per row, wasted past the row's end); many
  // CTAs hide that latency, and their rows may be far shorter than the capacity.
  plan.select_speculative_rounds =
      total_rows <= sms ? static_cast<int>(std::min<int64_t>(
                              kSelectRegRounds, ceil_div(plan.block_max_stride / 4, kSelectThreads)))
                        : 1;
  MSA_CHECK_ARG(plan.ctas < (int64_t{1} << 31), "batch", "fewer decode work items", plan.ctas);
  return true;
}

void launch_decode_index(const IndexerLaunch& p, const DecodeIndexPlan& plan, int ranked,
                         int list_pitch, float* block_max, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  DecodeScanPlan d;
  d.row_tiles = plan.row_tiles;
  d.chunks = plan.chunks;
  d.chunk_blocks = plan.chunk_blocks;
  d.block_max = block_max;
  d.block_max_stride = plan.block_max_stride;
  if (p.dim == 64)
    launch_scan<64>(p, d, plan.ctas, cuda_stream);
  else
    launch_scan<128>(p, d, plan.ctas, cuda_stream);
  if (p.decode_scan_only) return;  // benchmarks: the scan's share of the step
  DecodeSelectPlan s;
  s.block_max = block_max;
  s.block_max_stride = plan.block_max_stride;
  s.ranked = ranked;
  s.list_pitch = list_pitch;
  s.speculative_rounds = plan.select_speculative_rounds;
  const int64_t rows = p.batch.total_q * p.heads;
  MSA_CHECK_ARG(rows < (int64_t{1} << 31), "batch", "fewer decode rows", rows);
  launch_pdl(decode_select_kernel, dim3(static_cast<unsigned>(rows)), dim3(kSelectThreads), 0, cuda_stream, p, s);
}

}  // namespace msa::cuda
