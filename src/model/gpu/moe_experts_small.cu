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
// takes 16-byte chunks (8 bf16) of the input dimension, strided by 32 chunks, and per chunk
// accumulates in f32 its kRowsPerWarp weight rows against the expert's chunk of x for up to
// kMaxRows rows (x read from L1/L2: the step's x_sorted is a few KB per row). An expert with
// more than kMaxRows rows loops over row groups (its weights then come from L2). Lane partial
// sums are reduced by shuffles; lane 0 stores. Each output is one f32 dot product in a fixed
// order: deterministic.
//
// bf16 weights: each lane loads two chunks of its 4 rows per iteration into registers (8 loads
// of 16 bytes in flight) at two CTAs per SM; M3's expert projections read at 3.6-3.8 TB/s
// (bench/results/h200.md, "The decode step's small kernels and quantized experts on the
// device").
//
// Quantized weights (ExpertWeights mxfp8 / nvfp4): a lane's chunk is 16 weights (16 bytes of
// e4m3 codes, or 8 bytes of e2m1 pairs: one scale block either way, since 16 divides both
// block sizes).
//   - Each lane streams its chunks through a cp.async ring in shared memory (its own slots:
//     no barrier, the lane reads back only what it copied), 64 bytes per row and 256 per lane
//     in flight, two CTAs per SM at 128 registers (loads into registers took 156-162 of them:
//     one CTA per SM). The chunk's block-scale byte travels with its codes (the aligned 4-byte
//     word that holds it), where a load in the loop put an L2 round trip on every chunk. A
//     slot is refilled only after the chunk in it was computed (program order; a warp issues
//     in order, so the refill's cp.async issues after the FMAs that consumed its values).
//   - The product takes the chunk's 16 values in f32 by cvt conversions (expert_weights.cuh,
//     chunk_f32: half a conversion per weight, exact), sums the chunk's 16 products, and
//     applies the block scale once per chunk and row. NVFP4's global scale multiplies the
//     reduced f32 sum once per output.
//   - Addresses: a lane's code and scale pointers are set once per tile and stepped per chunk.
// What bound the integer decode before it (Nsight Compute, M3's gate_up at batch 1, MXFP8,
// 68.8 us): the ALU pipe 67% busy with the per-weight shifts and masks and the per-chunk
// 64-bit scale addressing, 2.6 instructions issued per cycle, DRAM at 48%: ~8.5 weights per
// SM per cycle for both formats whatever their bytes. Measured with the cvt decode (same
// shapes, bench/results/h200.md "The index ranking's pass grid and fp8 default; the small
// expert kernel by cvt"): MXFP8 55.9 / 32.9 us (gate_up / down), NVFP4 51.9 / 30.1 us, DRAM at
// 59% / 35% of peak, the ALU pipe still the busiest (48% / 59%). The next step is the tensor
// cores: the cvt's f16 pairs are mma.sync A fragments as they come, with each k-step inside
// one scale block and x fed as f16 scaled per row by a power of two.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/common.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/kernel_attributes.h"
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

// A lane's chunk of one weight row per format: the codes (Codes), the weights they hold,
// and (quantized formats) the ring's depth in chunks: 64 bytes per lane and row in flight,
// so NVFP4's 8-byte chunks take twice the stages.
template <ExpertWeights F>
struct SmallChunk {  // mxfp8, nvfp4: 16 weights, one block scale
  using Codes = typename ExpertFormat<F>::Codes16;
  static constexpr int kWeights = 16;
  static constexpr int kStages = 64 / sizeof(Codes);
};
template <>
struct SmallChunk<ExpertWeights::bf16> {
  using Codes = uint4;  // 8 bf16
  static constexpr int kWeights = 8;
  static constexpr int kStages = 0;  // no ring
};

// Ring slots per warp (stage x row x lane) and the dynamic shared memory of a CTA: the codes,
// then the scale words (MXFP8 80 KB, NVFP4 96 KB: two CTAs per SM); none for bf16.
template <ExpertWeights F>
constexpr int slots_per_warp() {
  return SmallChunk<F>::kStages * kRowsPerWarp * 32;
}
template <ExpertWeights F>
constexpr size_t small_smem_bytes() {
  if constexpr (F == ExpertWeights::bf16) return 0;  // loads into registers (below)
  return size_t{kWarps} * slots_per_warp<F>() * (sizeof(typename SmallChunk<F>::Codes) + sizeof(uint32_t));
}

template <class Codes>
__device__ __forceinline__ void copy_codes(Codes* slot, const uint8_t* global) {
  if constexpr (sizeof(Codes) == 16) msa::cuda::cp_async_16(slot, global);
  else msa::cuda::cp_async_8(slot, global);
}

// acc[j][r] += w[j] . x[first + r] over chunk c (8 bf16) of the input.
__device__ __forceinline__ void accumulate_bf16(const uint4 (&w)[kRowsPerWarp], const uint16_t* x, int64_t in,
                                                int64_t c, int first, int rows,
                                                float (&acc)[kRowsPerWarp][kMaxRows]) {
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= rows) break;
    float xf[8];
    unpack8(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(first + r) * in)[c], xf);
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      float wf[8];
      unpack8(w[j], wf);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[j][r] = fmaf(wf[k], xf[k], acc[j][r]);
    }
  }
}

// acc[j][r] += scale[j] * (codes[j] . x[first + r]) over chunk c (16 weights, one scale block):
// the codes' values (expert_weights.cuh, chunk_f32; scale[j] carries its chunk_factor) times x
// summed in f32, then the block scale once per chunk and row.
template <ExpertWeights F>
__device__ __forceinline__ void accumulate_quantized(const typename SmallChunk<F>::Codes (&codes)[kRowsPerWarp],
                                                     const float (&scale)[kRowsPerWarp], const uint16_t* x,
                                                     int64_t in, int64_t c, int first, int rows,
                                                     float (&acc)[kRowsPerWarp][kMaxRows]) {
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= rows) break;
    const uint4* x_row = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(first + r) * in);
    float xf[16];
    unpack8(x_row[2 * c], *reinterpret_cast<float(*)[8]>(&xf[0]));
    unpack8(x_row[2 * c + 1], *reinterpret_cast<float(*)[8]>(&xf[8]));
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      float w[16];
      ExpertFormat<F>::chunk_f32(codes[j], w);
      float partial = 0.0f;
#pragma unroll
      for (int k = 0; k < 16; ++k) partial = fmaf(w[k], xf[k], partial);
      acc[j][r] = fmaf(partial, scale[j], acc[j][r]);
    }
  }
}

// Scale bytes between a lane's successive chunks (lane + 32 i): a multiple of 4.
template <ExpertWeights F>
constexpr int kScaleStep = 32 * SmallChunk<F>::kWeights / ExpertFormat<F>::kBlock;

template <ExpertWeights F>
// Two CTAs per SM (128 registers: the quantized instantiations fit without spilling).
__global__ void __launch_bounds__(kWarps * 32, 2)
    moe_experts_small_kernel(MoeSmallGemm job) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  using Chunk = SmallChunk<F>;
  using Codes = typename Chunk::Codes;
  constexpr int kStages = Chunk::kStages;
  constexpr int kSlotsPerWarp = slots_per_warp<F>();
  constexpr bool kQuantized = F != ExpertWeights::bf16;
  extern __shared__ __align__(16) unsigned char ring_memory[];
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
      if constexpr (!kQuantized) {
        // Two chunks per iteration: 8 weight loads of 16 bytes in flight per lane (measured
        // faster than the ring for bf16: 78.9 / 42.0 us against 87.3 / 45.7 us for M3's
        // gate_up / down at batch 1, bench/results/h200.md), kept packed until used.
#pragma unroll 2
        for (int64_t c = lane; c < chunks; c += 32) {
          uint4 w[kRowsPerWarp];
#pragma unroll
          for (int j = 0; j < kRowsPerWarp; ++j) {
            const int64_t out_row = row0 + j;
            w[j] = out_row < job.out ? __ldg(reinterpret_cast<const uint4*>(codes + (expert_row0 + out_row) * row_bytes) + c)
                                     : uint4{};
          }
          accumulate_bf16(w, job.x, job.in, c, first, rows, acc);
        }
      } else {
        Codes* code_ring = reinterpret_cast<Codes*>(ring_memory) + warp * kSlotsPerWarp;
        uint32_t* scale_ring = reinterpret_cast<uint32_t*>(ring_memory + size_t{kWarps} * kSlotsPerWarp * sizeof(Codes)) +
                               warp * kSlotsPerWarp;
        const int64_t mine = chunks > lane ? (chunks - lane + 31) / 32 : 0;  // this lane's chunks lane + 32 i
        // Row j's chunk i (input chunk lane + 32 i): codes at lane_codes + j * row_bytes +
        // i * 32 chunks, its scale byte at lane_scales + j * scale_bytes + i * kScaleStep. The
        // copy takes the aligned word around that byte, whose place in the word (shift[j]) is
        // the same for every i.
        static_assert(kScaleStep<F> % 4 == 0);
        const int64_t scale_bytes = job.in / ExpertFormat<F>::kBlock;
        const uint8_t* lane_codes = codes + (expert_row0 + row0) * row_bytes + lane * sizeof(Codes);
        const uint8_t* lane_scales = job.quantized.scales + (expert_row0 + row0) * scale_bytes +
                                     lane * Chunk::kWeights / ExpertFormat<F>::kBlock;
        int shift[kRowsPerWarp];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j)
          shift[j] = static_cast<int>((reinterpret_cast<uintptr_t>(lane_scales) + j * scale_bytes) & 3u) * 8;
        // Chunk i of row j goes to slot (i % kStages, j). Rows beyond `out` copy nothing:
        // their sums are never stored.
        auto issue = [&](int64_t i) {
          if (i < mine) {
            const int stage = static_cast<int>(i % kStages);
#pragma unroll
            for (int j = 0; j < kRowsPerWarp; ++j) {
              if (row0 + j >= job.out) continue;
              const int slot = (stage * kRowsPerWarp + j) * 32 + lane;
              copy_codes(code_ring + slot, lane_codes + j * row_bytes + i * 32 * int64_t{sizeof(Codes)});
              const uintptr_t scale_at =
                  reinterpret_cast<uintptr_t>(lane_scales + j * scale_bytes + i * kScaleStep<F>);
              msa::cuda::cp_async_4(scale_ring + slot, reinterpret_cast<const void*>(scale_at & ~uintptr_t{3}));
            }
          }
          msa::cuda::cp_async_commit();  // every lane commits every group: the wait counts agree
        };
#pragma unroll
        for (int i = 0; i < kStages; ++i) issue(i);
        for (int64_t i = 0; i < mine; ++i) {
          msa::cuda::cp_async_wait<kStages - 1>();  // chunk i's group has landed
          const int64_t c = lane + 32 * i;
          const int stage = static_cast<int>(i % kStages);
          Codes chunk[kRowsPerWarp];
          float scale[kRowsPerWarp];
#pragma unroll
          for (int j = 0; j < kRowsPerWarp; ++j) {
            const int slot = (stage * kRowsPerWarp + j) * 32 + lane;
            chunk[j] = code_ring[slot];
            scale[j] = ExpertFormat<F>::scale_f32((scale_ring[slot] >> shift[j]) & 0xffu) *
                       ExpertFormat<F>::kChunkFactor;
          }
          accumulate_quantized<F>(chunk, scale, job.x, job.in, c, first, rows, acc);
          issue(i + kStages);  // refills the slot just computed
        }
        msa::cuda::cp_async_wait<0>();  // nothing of this pass stays in flight into the next
      }
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int64_t out_row = row0 + j;
        float factor = 1.0f;  // NVFP4: the row's global scale
        if constexpr (F == ExpertWeights::nvfp4)
          if (lane == 0 && out_row < job.out) factor = job.quantized.global_scale[expert_row0 + out_row];
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

// Launches the format's kernel. Tile CTAs per sorted row: enough for about one resident wave
// when every entry starts an expert (the most experts a step can touch: min(entries,
// experts)), at least one tile each. The shared memory limit is raised before the occupancy
// query, which counts the ring.
template <ExpertWeights F>
void launch_small(const MoeSmallGemm& job, cudaStream_t stream) {
  constexpr size_t smem = small_smem_bytes<F>();
  const int per_sm = msa::cuda::resident_ctas_per_sm(moe_experts_small_kernel<F>, kWarps * 32, smem);
  const int64_t tiles = (job.out + kRowsPerCta - 1) / kRowsPerCta;
  const int64_t slots = int64_t{per_sm} * msa::cuda::sm_count();
  const int64_t touched = std::max<int64_t>(1, std::min(job.entries, job.experts));
  const auto ctas = static_cast<unsigned>(std::clamp<int64_t>((slots + touched - 1) / touched, 1, tiles));
  launch_pdl(moe_experts_small_kernel<F>, dim3(ctas, static_cast<unsigned>(job.entries)), dim3(kWarps * 32), smem,
             stream, job);
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
  const auto s = static_cast<cudaStream_t>(stream);
  if (format == ExpertWeights::mxfp8) launch_small<ExpertWeights::mxfp8>(job, s);
  else if (format == ExpertWeights::nvfp4) launch_small<ExpertWeights::nvfp4>(job, s);
  else launch_small<ExpertWeights::bf16>(job, s);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
