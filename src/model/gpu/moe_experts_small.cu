// The routed experts' GEMMs of a decode-sized MoE step (a few rows per expert) in one launch,
// reading each expert's row range from the dispatch's device offsets: no host round trip,
// so the step needs no synchronisation per MoE layer and can be captured in a graph.
//
// Why not cuBLASLt: a cuBLASLt call per expert needs the row counts on the host (one sync
// per layer, ~0.3 ms of a 0.4 ms MoE at batch 1 in `msa bench-model`), and at 1-16 rows per
// expert the work is a matrix-vector product bound by reading the expert's weights once.
//
// Plan. Grid (out / kRowsPerCta, entries). CTA (tile, n) works iff sorted row n is the first
// row of its expert e (n == offsets[e]); the others exit at once, so exactly the touched
// experts' weights are read, each once per tile. 8 warps x kRowsPerWarp output rows; a lane
// takes 16-byte chunks (8 bf16) of the input dimension, strided by 32 chunks: per chunk it
// loads the expert's chunk of x for up to kMaxRows rows (L1/L2-resident: the step's x_sorted
// is a few KB per row) and of each of its kRowsPerWarp weight rows, and accumulates in f32.
// An expert with more than kMaxRows rows loops over row groups (its weights then come from
// L2). Lane partial sums are reduced by shuffles; lane 0 stores. Each output is one f32 dot
// product in a fixed order: deterministic.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "kernels.h"

namespace msa::model::gpu {
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

__global__ void __launch_bounds__(kWarps * 32)
    moe_experts_small_kernel(MoeSmallGemm job) {
  const int n = blockIdx.y;
  // The expert of sorted row n: the last e with offsets[e] <= n (offsets non-decreasing).
  int lo = 0, hi = static_cast<int>(job.experts);
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (job.offsets[mid] <= n) lo = mid; else hi = mid - 1;
  }
  const int e = lo;
  if (job.offsets[e] != n) return;  // not the expert's first row: another CTA owns it
  const int end = min(job.offsets[e + 1], static_cast<int>(job.entries));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t{blockIdx.x} * kRowsPerCta + warp * kRowsPerWarp;
  const int64_t chunks = job.in / 8;
  const uint16_t* w = job.w + static_cast<int64_t>(e) * job.out * job.in;

  for (int first = n; first < end; first += kMaxRows) {
    const int rows = min(kMaxRows, end - first);
    float acc[kRowsPerWarp][kMaxRows];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) acc[j][r] = 0.0f;
    // Two chunks per iteration: 8 weight loads of 16 bytes in flight per lane (the kernel is
    // bound by how many bytes are in flight), kept packed until used.
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
      uint4 wv[kRowsPerWarp];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const int64_t out_row = row0 + j;
        wv[j] = out_row < job.out ? __ldg(reinterpret_cast<const uint4*>(w + out_row * job.in) + c)
                                  : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= rows) break;
        float xf[8];
        unpack8(reinterpret_cast<const uint4*>(job.x + static_cast<int64_t>(first + r) * job.in)[c], xf);
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
          float wf[8];
          unpack8(wv[j], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][r] = fmaf(wf[i], xf[i], acc[j][r]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        if (r >= rows) break;
        float v = acc[j][r];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
        const int64_t out_row = row0 + j;
        if (lane == 0 && out_row < job.out) job.y[static_cast<int64_t>(first + r) * job.out + out_row] = v;
      }
    }
  }
}

}  // namespace

bool moe_experts_small_fits(int64_t entries, int64_t in, int64_t out) {
  return entries > 0 && entries <= kMaxSmallMoeEntries && in % 8 == 0 && in > 0 && out > 0;
}

void moe_experts_small(const MoeSmallGemm& job, void* stream) {
  if (!moe_experts_small_fits(job.entries, job.in, job.out))
    MSA_FAIL("moe_experts_small: entries ", job.entries, " (1..", kMaxSmallMoeEntries, "), in ", job.in,
             " (a positive multiple of 8), out ", job.out, " (positive): use the per-expert GEMMs");
  const dim3 grid(static_cast<unsigned>((job.out + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(job.entries));
  moe_experts_small_kernel<<<grid, kWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(job);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
