// The routed experts' GEMMs of an MoE step as one grouped tensor-core GEMM per projection:
// y[n, :] = w[e(n)] x[n, :] for every sorted row n, with each expert's row range read from
// the dispatch's device offsets. No host round trip (the per-expert cuBLASLt path needs the
// row counts on the host: one sync per MoE layer), so any step size can be captured in a graph.
//
// Work decomposition without the host. A work item is (expert e, row tile j): rows
// [offsets[e] + j kTileM, min(offsets[e] + (j + 1) kTileM, offsets[e + 1])). Expert e has
// ceil(rows_e / kTileM) items, so the total is at most sum_e (rows_e / kTileM + 1) over the
// touched experts <= ceil(N / kTileM) + min(E, N): a capacity that does not depend on the
// routing. Grid (capacity, output tiles); each CTA numbers the items by a block-wide prefix
// over the per-expert tile counts (E + 1 offsets, L2-resident after the first CTAs: ~1 us,
// against a main loop of in / kTileK k-steps) and finds its own, or exits when the routing
// made fewer items than the capacity. The item index is blockIdx.x (the fastest-launched
// dimension), so the CTAs resident at once are mostly an expert's row tiles over one weight
// tile: the weight tile is read from HBM once and from L2 by the expert's other row tiles.
//
// CTA tile kTileM rows x kTileN outputs, k-steps of kTileK. 4 warps, each all kTileM rows x
// kTileN / 4 outputs with mma.sync m16n8k16 (bf16 in, f32 accumulate); operands ldmatrix'd
// from a kStages-deep cp.async ring of (x tile, weight tile) pairs. Rows beyond the expert's
// range, outputs beyond `out` and k beyond `in` are zero-filled loads (in % 8 == 0: a 16-byte
// chunk is wholly in or out), and those rows/outputs are never stored.
//
// kTileM = 32: decode and mid-size steps put 1 to a few hundred rows on an expert. At 1-16
// rows the kernel is bound by reading the expert's weights once (the MMA's idle rows cost
// nothing there); at a few hundred rows a taller tile would re-read each weight tile fewer
// times, but those re-reads are L2 hits (see the ordering above) and 32 keeps the ring small
// enough for two CTAs per SM. kTileN = 128 gives 48 output tiles at M3's 6144 outputs.
//
// Deterministic: each output is one CTA's f32 sum over k in a fixed order (no atomics, no
// split-k), independent of the routing of other rows.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common/common.cuh"
#include "cuda/common/cuda_check.h"
#include "cuda/common/kernel_attributes.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

struct GroupedGemmTraits {
  static constexpr int kTileM = 32, kTileN = 128, kTileK = 64;
  static constexpr int kStages = 4;
  static constexpr int kWarps = 4, kThreads = kWarps * 32;
  static constexpr int kWarpN = kTileN / kWarps;  // outputs per warp
  static constexpr int kMTiles = kTileM / 16, kNTiles = kWarpN / 8;
  // +8 bf16 per row: a row pitch of 144 B puts the 8 rows of one ldmatrix in distinct banks.
  static constexpr int kPitch = kTileK + 8;
  static constexpr int kChunksPerRow = kTileK / 8;  // 16-byte cp.async chunks
  static constexpr int kXStageElems = kTileM * kPitch, kWStageElems = kTileN * kPitch;
  static constexpr size_t kSmemBytes = size_t{kStages} * (kXStageElems + kWStageElems) * sizeof(uint16_t);
  static_assert(kTileM % 16 == 0 && kWarpN % 16 == 0 && kTileK % 16 == 0);
  static_assert(kTileM * kChunksPerRow % kThreads == 0 && kTileN * kChunksPerRow % kThreads == 0);
  static_assert(kStages >= 2);
};

// The work item `item` of the current routing: expert and row range, or expert -1 when there
// are fewer items than blockIdx.x. Every thread gets the answer (shared memory).
struct WorkItem {
  int expert, begin, end;
};

template <class T>
__device__ WorkItem find_work_item(const MoeGroupedGemm& job, int64_t item) {
  __shared__ int warp_totals[T::kWarps];
  __shared__ WorkItem found;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int entries = static_cast<int>(job.entries);
  if (tid == 0) found = {-1, 0, 0};
  int64_t base = 0;  // items of the experts before this chunk
  for (int64_t first = 0; first < job.experts; first += T::kThreads) {
    const int64_t e = first + tid;
    int begin = 0, end = 0;
    if (e < job.experts) {  // clamped, so a bad offsets array gives no out-of-range rows
      begin = min(max(job.offsets[e], 0), entries);
      end = min(max(job.offsets[e + 1], begin), entries);
    }
    const int count = (end - begin + T::kTileM - 1) / T::kTileM;
    int inclusive = count;  // warp-inclusive prefix
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += v;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    int64_t before = base + inclusive - count;
    int64_t chunk_total = 0;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      chunk_total += warp_totals[w];
    }
    if (item >= before && item < before + count) {
      const int tile = static_cast<int>(item - before);
      found = {static_cast<int>(e), begin + tile * T::kTileM, min(begin + (tile + 1) * T::kTileM, end)};
    }
    base += chunk_total;
    __syncthreads();  // warp_totals is rewritten by the next chunk; `found` is visible
  }
  return found;
}

template <class T>
__global__ void __launch_bounds__(T::kThreads) moe_experts_grouped_kernel(MoeGroupedGemm job) {
  using namespace msa::cuda;
  const WorkItem work = find_work_item<T>(job, blockIdx.x);
  if (work.expert < 0) return;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* x_ring = smem;                                // [kStages][kTileM][kPitch]
  uint16_t* w_ring = smem + T::kStages * T::kXStageElems;  // [kStages][kTileN][kPitch]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t out0 = int64_t{blockIdx.y} * T::kTileN;
  const int rows = work.end - work.begin;
  const uint16_t* x = job.x + int64_t{work.begin} * job.in;
  const uint16_t* w = job.w + int64_t{work.expert} * job.out * job.in + out0 * job.in;
  const int64_t k_tiles = (job.in + T::kTileK - 1) / T::kTileK;

  // One stage: the x tile (kTileM rows) and the weight tile (kTileN rows) of k-step kt.
  // Invalid chunks copy zeros from a valid address (the row's start), reading nothing.
  auto load_stage = [&](int64_t kt, int stage) {
    const int64_t k0 = kt * T::kTileK;
    uint16_t* xs = x_ring + stage * T::kXStageElems;
    uint16_t* ws = w_ring + stage * T::kWStageElems;
#pragma unroll
    for (int i = 0; i < T::kTileM * T::kChunksPerRow / T::kThreads; ++i) {
      const int chunk = tid + i * T::kThreads;
      const int r = chunk / T::kChunksPerRow, c = chunk % T::kChunksPerRow;
      const int64_t k = k0 + c * 8;
      const bool valid = r < rows && k < job.in;
      cp_async_16(xs + r * T::kPitch + c * 8, valid ? x + r * job.in + k : job.x, valid);
    }
#pragma unroll
    for (int i = 0; i < T::kTileN * T::kChunksPerRow / T::kThreads; ++i) {
      const int chunk = tid + i * T::kThreads;
      const int r = chunk / T::kChunksPerRow, c = chunk % T::kChunksPerRow;
      const int64_t k = k0 + c * 8;
      const bool valid = out0 + r < job.out && k < job.in;
      cp_async_16(ws + r * T::kPitch + c * 8, valid ? w + r * job.in + k : job.w, valid);
    }
  };

  float acc[T::kMTiles][T::kNTiles][4] = {};
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();  // always commit: the wait below counts groups
  }
  // ldmatrix lane addresses. x (A, 16x16): rows lane % 16, k half lane / 16. Weights (B,
  // two n8 tiles x k16): output (lane / 16) * 8 + lane % 8, k half (lane / 8) % 2, which
  // gives {b0, b1} of n-tile 0 in regs 0-1 and of n-tile 1 in regs 2-3.
  const int a_row = lane % 16, a_k = (lane / 16) * 8;
  const int b_row = warp * T::kWarpN + (lane / 16) * 8 + lane % 8, b_k = ((lane / 8) % 2) * 8;
#pragma unroll 1
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free to refill
    const int64_t next = kt + T::kStages - 1;
    if (next < k_tiles) load_stage(next, static_cast<int>(next % T::kStages));
    cp_async_commit();
    const int stage = static_cast<int>(kt % T::kStages);
    const uint16_t* xs = x_ring + stage * T::kXStageElems;
    const uint16_t* ws = w_ring + stage * T::kWStageElems;
#pragma unroll
    for (int ks = 0; ks < T::kTileK / 16; ++ks) {
      uint32_t a[T::kMTiles][4];
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m) ldmatrix_x4(a[m], xs + (m * 16 + a_row) * T::kPitch + ks * 16 + a_k);
#pragma unroll
      for (int np = 0; np < T::kNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, ws + (b_row + np * 16) * T::kPitch + ks * 16 + b_k);
#pragma unroll
        for (int m = 0; m < T::kMTiles; ++m) mma_bf16_16816_x2(acc[m][2 * np], acc[m][2 * np + 1], a[m], b);
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the CTA (the trailing groups are empty)

  // Accumulator (m, n, i): row m * 16 + lane / 4 + 8 (i / 2), output n * 8 + 2 (lane % 4) + i % 2.
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < T::kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = m * 16 + lane / 4 + 8 * (i / 2);
        const int64_t o = out0 + warp * T::kWarpN + n * 8 + 2 * (lane % 4) + i % 2;
        if (r < rows && o < job.out) job.y[(int64_t{work.begin} + r) * job.out + o] = acc[m][n][i];
      }
}

}  // namespace

bool moe_experts_grouped_fits(int64_t in, int64_t out) {
  return in > 0 && in % 8 == 0 && out > 0 && out <= int64_t{65535} * GroupedGemmTraits::kTileN;
}

int64_t moe_grouped_work_items(int64_t entries, int64_t experts) {
  using T = GroupedGemmTraits;
  return (entries + T::kTileM - 1) / T::kTileM + std::min(experts, entries);
}

void moe_experts_grouped(const MoeGroupedGemm& job, void* stream) {
  using T = GroupedGemmTraits;
  MSA_CHECK_ARG(job.entries >= 0 && job.entries < (int64_t{1} << 31), "entries", "0..2^31 - 1 rows", job.entries);
  MSA_CHECK_ARG(job.experts >= 1, "experts", "at least 1", job.experts);
  MSA_CHECK_ARG(job.in > 0 && job.in % 8 == 0, "in", "a positive multiple of 8 (16-byte row chunks)", job.in);
  MSA_CHECK_ARG(job.out > 0, "out", "positive", job.out);
  MSA_CHECK_ARG(job.out <= int64_t{65535} * T::kTileN, "out", "at most " + std::to_string(65535 * T::kTileN),
                job.out);
  MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(job.x) % 16 == 0 && reinterpret_cast<uintptr_t>(job.w) % 16 == 0, "x, w",
                "16-byte aligned", "a misaligned pointer");
  if (job.entries == 0) return;
  MSA_CHECK_ARG(job.x && job.w && job.offsets && job.y, "x, w, offsets, y", "device pointers", "null");
  const auto kernel = moe_experts_grouped_kernel<T>;
  msa::cuda::require_dynamic_smem(kernel, T::kSmemBytes);
  const dim3 grid(static_cast<unsigned>(moe_grouped_work_items(job.entries, job.experts)),
                  static_cast<unsigned>((job.out + T::kTileN - 1) / T::kTileN));
  kernel<<<grid, T::kThreads, T::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(job);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
