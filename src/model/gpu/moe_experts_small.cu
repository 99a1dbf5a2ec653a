// The routed experts' GEMMs of a decode-sized MoE step (a few rows per expert) in one launch,
// reading each expert's row range from the dispatch's device offsets: no host round trip,
// so the step needs no synchronisation per MoE layer and can be captured in a graph.
//
// Why not cuBLASLt: a cuBLASLt call per expert needs the row counts on the host (one sync
// per layer, ~0.3 ms of a 0.4 ms MoE at batch 1 in `msa bench-model`), and at 1-16 rows per
// expert the work is a matrix-vector product bound by reading the expert's weights once.
//
// Plan. Grid (tile CTAs, entries). CTA (c, n) works iff sorted row n is the first row of its
// expert e (n == offsets[e]); the others exit at once, so exactly the touched experts' weights
// are read, each once per tile. The CTA finds e with one parallel round of offset loads (a
// binary search over the offsets is 7-8 dependent L2 round trips, ~2 us at E = 128, during
// which the CTA has no weight load in flight), then loops over the output tiles c, c + C,
// ... (C tile CTAs: about one resident wave over the experts the step can touch, so that no
// CTA start-up is paid per tile). 8 warps x kRowsPerWarp output rows per tile; a lane
// takes 16-byte chunks (8 bf16) of the input dimension, strided by 32 chunks: per chunk it
// loads the expert's chunk of x for up to kMaxRows rows (L1/L2-resident: the step's x_sorted
// is a few KB per row) and of each of its kRowsPerWarp weight rows, and accumulates in f32.
// An expert with more than kMaxRows rows loops over row groups (its weights then come from
// L2). Lane partial sums are reduced by shuffles; lane 0 stores. Each output is one f32 dot
// product in a fixed order: deterministic.
//
// Quantized weights (ExpertWeights mxfp8 / nvfp4): a lane's chunk is 16 weights (16 bytes of
// e4m3 codes, or 8 bytes of e2m1 pairs: one scale block either way, since 16 divides both
// block sizes), widened to bf16 in registers right after the load (expert_weights.cuh), so the
// product loop is the bf16 one. The NVFP4 chunk is half as many bytes, so that format keeps 4
// chunks per lane in flight instead of 2 (the same 128 bytes per lane in flight over the
// warp's 4 rows). NVFP4's global scale multiplies the reduced f32 sum once per output. The
// widened chunks take the quantized instantiations past the registers of two CTAs per SM
// (bounding them to two makes ptxas spill), so an SM holds half the bf16 kernel's reads in
// flight: whether that still reaches the read bandwidth is for the H200 to say.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/sm_count.h"
#include "expert_weights.cuh"
#include "expert_weights.h"
#include "kernels.h"

namespace msa::model::gpu {

using msa::cuda::launch_pdl;
using msa::cuda::pdl_launch_dependents;
using msa::cuda::pdl_wait;
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kMaxRows = 8;  // x rows held per pass (registers: kRowsPerWarp * kMaxRows sums)

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// A lane's chunk of one weight row per format: the raw load (Codes), how many weights it
// holds, and how many chunks a lane keeps in flight per row.
template <ExpertWeights F>
struct SmallChunk {  // mxfp8, nvfp4: 16 weights, widened by expert_weights.cuh
  using Codes = typename ExpertFormat<F>::Codes16;
  static constexpr int kWeights = 16;
  static constexpr int kUnroll = F == ExpertWeights::nvfp4 ? 4 : 2;
};
template <>
struct SmallChunk<ExpertWeights::bf16> {
  using Codes = uint4;  // 8 bf16
  static constexpr int kWeights = 8;
  static constexpr int kUnroll = 2;
};

template <ExpertWeights F>
__global__ void __launch_bounds__(kWarps * 32)
    moe_experts_small_kernel(MoeSmallGemm job) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  using Chunk = SmallChunk<F>;
  constexpr int kWords = Chunk::kWeights / 8;  // uint4 of 8 bf16 per widened chunk
  __shared__ int owner;  // the expert whose first sorted row is n, or -1
  const int n = blockIdx.y;
  if (threadIdx.x == 0) owner = -1;
  __syncthreads();
  // Offsets are non-decreasing: n is expert e's first row iff offsets[e] == n < offsets[e + 1]
  // (at most one e: the empty experts before it have offsets[e + 1] == n).
  for (int64_t i = threadIdx.x; i < job.experts; i += blockDim.x)
    if (job.offsets[i] == n && n < job.offsets[i + 1]) owner = static_cast<int>(i);
  __syncthreads();
  const int e = owner;
  if (e < 0) return;  // not an expert's first row: another CTA owns it
  const int end = min(job.offsets[e + 1], static_cast<int>(job.entries));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = job.in / Chunk::kWeights;
  const int64_t expert_row0 = static_cast<int64_t>(e) * job.out;  // the expert's first weight row
  const int64_t row_bytes = expert_row_bytes(F, job.in);
  const uint8_t* codes = F == ExpertWeights::bf16 ? reinterpret_cast<const uint8_t*>(job.w) : job.quantized.codes;
  const int64_t tiles = (job.out + kRowsPerCta - 1) / kRowsPerCta;

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row0 = tile * kRowsPerCta + warp * kRowsPerWarp;
    for (int first = n; first < end; first += kMaxRows) {
      const int rows = min(kMaxRows, end - first);
      float acc[kRowsPerWarp][kMaxRows];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) acc[j][r] = 0.0f;
      // kUnroll chunks per iteration: 8 weight loads of 16 bytes (bf16, mxfp8) or 16 of 8 bytes
      // (nvfp4) in flight per lane (the kernel is bound by how many bytes are in flight), kept
      // packed until used.
#pragma unroll Chunk::kUnroll
      for (int64_t c = lane; c < chunks; c += 32) {
        typename Chunk::Codes raw[kRowsPerWarp];
        uint32_t scale[kRowsPerWarp];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
          const int64_t out_row = row0 + j;
          const bool valid = out_row < job.out;
          const int64_t row = expert_row0 + out_row;
          raw[j] = valid ? __ldg(reinterpret_cast<const typename Chunk::Codes*>(codes + row * row_bytes) + c)
                         : typename Chunk::Codes{};
          if constexpr (F != ExpertWeights::bf16) {
            constexpr int kBlock = ExpertFormat<F>::kBlock;
            // A row beyond `out` reads the first scale (finite; its codes are zeros).
            scale[j] = __ldg(valid ? job.quantized.scales + row * (job.in / kBlock) + c * Chunk::kWeights / kBlock
                                   : job.quantized.scales);
          }
        }
        uint4 wv[kRowsPerWarp][kWords];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
          if constexpr (F == ExpertWeights::bf16) wv[j][0] = raw[j];
          else ExpertFormat<F>::widen16(raw[j], scale[j], wv[j]);
        }
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r >= rows) break;
          const uint4* x_row = reinterpret_cast<const uint4*>(job.x + static_cast<int64_t>(first + r) * job.in);
#pragma unroll
          for (int h = 0; h < kWords; ++h) {
            float xf[8];
            unpack8(x_row[c * kWords + h], xf);
#pragma unroll
            for (int j = 0; j < kRowsPerWarp; ++j) {
              float wf[8];
              unpack8(wv[j][h], wf);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[j][r] = fmaf(wf[i], xf[i], acc[j][r]);
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int64_t out_row = row0 + j;
        float factor = 1.0f;  // NVFP4: 2^6 (the widening's 2^-6) x the row's global scale
        if constexpr (F == ExpertWeights::nvfp4)
          if (lane == 0 && out_row < job.out)
            factor = kNvfp4WidenedFactor * job.quantized.global_scale[expert_row0 + out_row];
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r >= rows) break;
          float v = acc[j][r];
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
          if constexpr (F == ExpertWeights::nvfp4) v *= factor;
          if (lane == 0 && out_row < job.out) job.y[static_cast<int64_t>(first + r) * job.out + out_row] = v;
        }
      }
    }
  }
}

// Tile CTAs per sorted row: enough for about one resident wave when every entry starts an
// expert (the most experts a step can touch: min(entries, experts)), at least one tile each.
template <ExpertWeights F>
unsigned tile_ctas(int64_t entries, int64_t experts, int64_t tiles) {
  static const int per_sm = [] {
    int blocks = 0;
    MSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, moe_experts_small_kernel<F>, kWarps * 32, 0));
    return blocks > 0 ? blocks : 1;
  }();
  const int64_t slots = int64_t{per_sm} * msa::cuda::sm_count();
  const int64_t touched = std::max<int64_t>(1, std::min(entries, experts));
  return static_cast<unsigned>(std::clamp<int64_t>((slots + touched - 1) / touched, 1, tiles));
}

}  // namespace

bool moe_experts_small_fits(int64_t entries, int64_t in, int64_t out, ExpertWeights format) {
  const int64_t multiple = expert_weights_in_multiple(format);
  return entries > 0 && entries <= kMaxSmallMoeEntries && multiple > 0 && in > 0 && in % multiple == 0 && out > 0;
}

void moe_experts_small(const MoeSmallGemm& job, void* stream) {
  const ExpertWeights format = job.quantized.format;
  MSA_CHECK_ARG(expert_weights_in_multiple(format) > 0, "quantized.format", "bf16, mxfp8 or nvfp4",
                static_cast<int>(format));
  if (!moe_experts_small_fits(job.entries, job.in, job.out, format))
    MSA_FAIL("moe_experts_small: entries ", job.entries, " (1..", kMaxSmallMoeEntries, "), in ", job.in,
             " (a positive multiple of ", expert_weights_in_multiple(format), " for ", expert_weights_name(format),
             " weights), out ", job.out, " (positive): use the per-expert GEMMs");
  MSA_CHECK_ARG(job.experts >= 1, "experts", "at least 1", job.experts);
  check_expert_weights(job.w, job.quantized, job.in);
  MSA_CHECK_ARG(job.x && job.offsets && job.y, "x, offsets, y", "device pointers", "null");
  MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(job.x) % 16 == 0, "x", "16-byte aligned", "a misaligned pointer");
  const int64_t tiles = (job.out + kRowsPerCta - 1) / kRowsPerCta;
  const unsigned ctas = format == ExpertWeights::mxfp8   ? tile_ctas<ExpertWeights::mxfp8>(job.entries, job.experts, tiles)
                        : format == ExpertWeights::nvfp4 ? tile_ctas<ExpertWeights::nvfp4>(job.entries, job.experts, tiles)
                                                         : tile_ctas<ExpertWeights::bf16>(job.entries, job.experts, tiles);
  const dim3 grid(ctas, static_cast<unsigned>(job.entries));
  const auto kernel = format == ExpertWeights::mxfp8   ? moe_experts_small_kernel<ExpertWeights::mxfp8>
                      : format == ExpertWeights::nvfp4 ? moe_experts_small_kernel<ExpertWeights::nvfp4>
                                                       : moe_experts_small_kernel<ExpertWeights::bf16>;
  launch_pdl(kernel, grid, dim3(kWarps * 32), 0, static_cast<cudaStream_t>(stream), job);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
