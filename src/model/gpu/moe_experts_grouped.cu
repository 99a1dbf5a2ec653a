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
// Quantized weights (ExpertWeights mxfp8 / nvfp4). The ring holds the codes as stored (64 e4m3
// bytes or 32 packed e2m1 bytes per weight row and k-step, a half or a quarter of the bf16
// tile's bytes); after a stage lands, thread t widens weight row t of it (64 weights, with
// that row's 2 UE8M0 or 4 e4m3 block scales) into one bf16 tile in shared memory, and the
// warps build their B fragments from that tile with the bf16 path's ldmatrix. Why a shared
// tile and not the fragments directly: a B fragment needs a thread's k pairs 2(lane % 4) and
// 2(lane % 4) + 8 of each k16, scattered over the codes, so building fragments in registers
// means either 2-byte shared loads or a k permutation shared with the A operand (replacing
// its ldmatrix); each weight is widened once per CTA either way, and the tile costs one more
// barrier per k-step (its cost on the H200 is still to be measured). The block scales are 2
// (MXFP8) or 4 (NVFP4) bytes per row and k-step at offsets with no 4-byte alignment in
// general (rows of in / 32 or in / 16 bytes), which cp.async (4, 8 or 16 aligned bytes)
// cannot copy: each thread loads its row's scales with plain byte loads two k-steps ahead
// (two register sets alternating, so no copy waits on a load in flight). NVFP4's global
// scale (per output row) multiplies the f32 accumulator in the epilogue, with the widening's
// 2^6. Shared memory: bf16 90 KB, MXFP8 76 KB, NVFP4 56 KB (two CTAs per SM each).
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
#include "expert_weights.cuh"
#include "expert_weights.h"
#include "kernels.h"

namespace msa::model::gpu {
namespace {

template <ExpertWeights F>
struct GroupedGemmTraits {
  static constexpr int kTileM = 32, kTileN = 128, kTileK = 64;
  static constexpr int kStages = 4;
  static constexpr int kWarps = 4, kThreads = kWarps * 32;
  static constexpr int kWarpN = kTileN / kWarps;  // outputs per warp
  static constexpr int kMTiles = kTileM / 16, kNTiles = kWarpN / 8;
  // +8 bf16 per row: a row pitch of 144 B puts the 8 rows of one ldmatrix in distinct banks.
  static constexpr int kPitch = kTileK + 8;
  static constexpr int kChunksPerRow = kTileK / 8;  // 16-byte cp.async chunks of bf16
  static constexpr int kXStageElems = kTileM * kPitch, kWStageElems = kTileN * kPitch;
  // Quantized: bytes of codes per weight row and k-step, copied as 4 chunks of 16 weights
  // (16 bytes of e4m3, 8 of e2m1); the row pitch keeps the widening thread's reads (row t of
  // 8 rows per 16-byte phase, 16 rows per 8-byte phase) in distinct banks: 80 B = 20 words,
  // 40 B = 10 words.
  static constexpr bool kQuantized = F != ExpertWeights::bf16;
  static constexpr int kCodeBytes = F == ExpertWeights::mxfp8 ? kTileK : kTileK / 2;
  static constexpr int kCodeChunkBytes = kCodeBytes / 4;
  static constexpr int kCodePitch = kCodeBytes + kCodeChunkBytes;
  static constexpr int kCodeStageBytes = kTileN * kCodePitch;
  static constexpr size_t kXRingBytes = size_t{kStages} * kXStageElems * sizeof(uint16_t);
  // bf16: the weight ring; quantized: the code ring, then the widened bf16 tile.
  static constexpr size_t kSmemBytes =
      kXRingBytes + (kQuantized ? size_t{kStages} * kCodeStageBytes + kWStageElems * sizeof(uint16_t)
                                : size_t{kStages} * kWStageElems * sizeof(uint16_t));
  static_assert(kTileM % 16 == 0 && kWarpN % 16 == 0 && kTileK % 16 == 0);
  static_assert(kTileM * kChunksPerRow % kThreads == 0 && kTileN * kChunksPerRow % kThreads == 0);
  static_assert(kStages >= 2);
  static_assert(!kQuantized || kThreads == kTileN, "one widening thread per weight row");
  static_assert(!kQuantized || kTileK == 64, "a row's k-step is 4 pieces of 16 weights");
  static_assert(kXRingBytes % 16 == 0 && kCodeStageBytes % 16 == 0);
};
using Bf16Traits = GroupedGemmTraits<ExpertWeights::bf16>;

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

// 8-byte asynchronous copy (through L1: .cg copies only 16 bytes); `valid` false writes zeros.
__device__ __forceinline__ void cp_async_8(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(msa::cuda::smem_address(shared)),
               "l"(global), "r"(valid ? 8 : 0));
}

template <ExpertWeights F>
__global__ void __launch_bounds__(GroupedGemmTraits<F>::kThreads) moe_experts_grouped_kernel(MoeGroupedGemm job) {
  using namespace msa::cuda;
  using T = GroupedGemmTraits<F>;
  const WorkItem work = find_work_item<T>(job, blockIdx.x);
  if (work.expert < 0) return;
  extern __shared__ __align__(16) uint8_t smem_bytes[];
  uint16_t* x_ring = reinterpret_cast<uint16_t*>(smem_bytes);  // [kStages][kTileM][kPitch]
  // bf16: [kStages][kTileN][kPitch] bf16; quantized: codes [kStages][kTileN][kCodePitch] bytes,
  // then the widened tile [kTileN][kPitch] bf16.
  uint16_t* w_ring = reinterpret_cast<uint16_t*>(smem_bytes + T::kXRingBytes);
  uint8_t* code_ring = smem_bytes + T::kXRingBytes;
  uint16_t* widened = reinterpret_cast<uint16_t*>(code_ring + T::kStages * T::kCodeStageBytes);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t out0 = int64_t{blockIdx.y} * T::kTileN;
  const int rows = work.end - work.begin;
  const uint16_t* x = job.x + int64_t{work.begin} * job.in;
  const int64_t expert_row0 = int64_t{work.expert} * job.out;  // the expert's first weight row
  const int64_t row_bytes = expert_row_bytes(F, job.in);
  const uint8_t* codes = (F == ExpertWeights::bf16 ? reinterpret_cast<const uint8_t*>(job.w) : job.quantized.codes) +
                         (expert_row0 + out0) * row_bytes;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(codes);
  const int64_t k_tiles = (job.in + T::kTileK - 1) / T::kTileK;

  // One stage: the x tile (kTileM rows) and the weight tile (kTileN rows) of k-step kt.
  // Invalid chunks copy zeros from a valid address (the row's start), reading nothing.
  auto load_stage = [&](int64_t kt, int stage) {
    const int64_t k0 = kt * T::kTileK;
    uint16_t* xs = x_ring + stage * T::kXStageElems;
#pragma unroll
    for (int i = 0; i < T::kTileM * T::kChunksPerRow / T::kThreads; ++i) {
      const int chunk = tid + i * T::kThreads;
      const int r = chunk / T::kChunksPerRow, c = chunk % T::kChunksPerRow;
      const int64_t k = k0 + c * 8;
      const bool valid = r < rows && k < job.in;
      cp_async_16(xs + r * T::kPitch + c * 8, valid ? x + r * job.in + k : job.x, valid);
    }
    if constexpr (F == ExpertWeights::bf16) {
      uint16_t* ws = w_ring + stage * T::kWStageElems;
#pragma unroll
      for (int i = 0; i < T::kTileN * T::kChunksPerRow / T::kThreads; ++i) {
        const int chunk = tid + i * T::kThreads;
        const int r = chunk / T::kChunksPerRow, c = chunk % T::kChunksPerRow;
        const int64_t k = k0 + c * 8;
        const bool valid = out0 + r < job.out && k < job.in;
        cp_async_16(ws + r * T::kPitch + c * 8, valid ? w + r * job.in + k : job.w, valid);
      }
    } else {
      // Chunks of 16 weights: wholly inside or outside `in` (a multiple of 16 and 32).
      uint8_t* cs = code_ring + stage * T::kCodeStageBytes;
#pragma unroll
      for (int i = 0; i < T::kTileN * 4 / T::kThreads; ++i) {
        const int chunk = tid + i * T::kThreads;
        const int r = chunk / 4, c = chunk % 4;
        const int64_t k = k0 + c * 16;
        const bool valid = out0 + r < job.out && k < job.in;
        const uint8_t* src = valid ? codes + r * row_bytes + c * T::kCodeChunkBytes + kt * T::kCodeBytes
                                   : job.quantized.codes;
        if constexpr (F == ExpertWeights::mxfp8) cp_async_16(cs + r * T::kCodePitch + c * 16, src, valid);
        else cp_async_8(cs + r * T::kCodePitch + c * 8, src, valid);
      }
    }
  };

  // Quantized: the block scales of weight row `tid` in k-step kt, one register per block, each
  // the destination of its load: nothing computes with them before the widening two k-steps
  // later, so no instruction waits on a load in flight. Blocks beyond `in` and rows beyond
  // `out` read the first scale instead (a valid, finite one: their codes are zeros).
  constexpr int kBlock = F == ExpertWeights::mxfp8 ? 32 : 16;
  constexpr int kBlocksPerStep = T::kTileK / kBlock;
  using StepScales = uint32_t[kBlocksPerStep];
  auto load_scales = [&](int64_t kt, StepScales& scales) {
    if constexpr (T::kQuantized) {
      const int64_t blocks = job.in / kBlock;
      const bool row_valid = out0 + tid < job.out;
      const uint8_t* scale_row = job.quantized.scales + (expert_row0 + out0 + tid) * blocks;
#pragma unroll
      for (int j = 0; j < kBlocksPerStep; ++j) {
        const int64_t block = kt * kBlocksPerStep + j;
        scales[j] = __ldg(row_valid && block < blocks ? scale_row + block : job.quantized.scales);
      }
    }
  };
  // Quantized: weight row `tid` of a landed stage, widened into the bf16 tile.
  auto widen_row = [&](int stage, const StepScales& scales) {
    if constexpr (T::kQuantized) {
      const uint8_t* cs = code_ring + stage * T::kCodeStageBytes + tid * T::kCodePitch;
      uint16_t* dst = widened + tid * T::kPitch;
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // weights 16q .. 16q + 15: block 16q / kBlock
        using Codes = typename ExpertFormat<F>::Codes16;
        const Codes piece = *reinterpret_cast<const Codes*>(cs + q * T::kCodeChunkBytes);
        uint4 wide[2];
        ExpertFormat<F>::widen16(piece, scales[16 * q / kBlock], wide);
        reinterpret_cast<uint4*>(dst + 16 * q)[0] = wide[0];
        reinterpret_cast<uint4*>(dst + 16 * q)[1] = wide[1];
      }
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
  auto mma_k_step = [&](const uint16_t* xs, const uint16_t* ws) {
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
  };
  // One k-step: wait for its stage, refill the ring, (quantized) widen, multiply.
  auto k_step = [&](int64_t kt, StepScales& scales) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 (and the widened tile) is free
    const int64_t next = kt + T::kStages - 1;
    if (next < k_tiles) load_stage(next, static_cast<int>(next % T::kStages));
    cp_async_commit();
    const int stage = static_cast<int>(kt % T::kStages);
    const uint16_t* xs = x_ring + stage * T::kXStageElems;
    if constexpr (T::kQuantized) {
      widen_row(stage, scales);
      load_scales(kt + 2, scales);  // used two k-steps from now
      __syncthreads();               // the widened tile is complete
      mma_k_step(xs, widened);
    } else {
      mma_k_step(xs, w_ring + stage * T::kWStageElems);
    }
  };
  StepScales scales_even = {}, scales_odd = {};  // unused for bf16
  if constexpr (T::kQuantized) {
    // Two k-steps per iteration, so the scales of step kt + 2 load into the registers step kt
    // just used (no register copy, which would wait on the load).
    load_scales(0, scales_even);
    load_scales(1, scales_odd);
#pragma unroll 1
    for (int64_t kt = 0; kt < k_tiles; kt += 2) {
      k_step(kt, scales_even);
      if (kt + 1 < k_tiles) k_step(kt + 1, scales_odd);
    }
  } else {
#pragma unroll 1
    for (int64_t kt = 0; kt < k_tiles; ++kt) k_step(kt, scales_even);
  }
  cp_async_wait<0>();  // no copy outlives the CTA (the trailing groups are empty)

  // Accumulator (m, n, i): row m * 16 + lane / 4 + 8 (i / 2), output n * 8 + 2 (lane % 4) + i % 2.
#pragma unroll
  for (int n = 0; n < T::kNTiles; ++n)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t o = out0 + warp * T::kWarpN + n * 8 + 2 * (lane % 4) + i;
      if (o >= job.out) continue;
      float factor = 1.0f;  // NVFP4: 2^6 (the widening's 2^-6) x the output row's global scale
      if constexpr (F == ExpertWeights::nvfp4) factor = kNvfp4WidenedFactor * job.quantized.global_scale[expert_row0 + o];
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m * 16 + lane / 4 + 8 * half;
          float v = acc[m][n][2 * half + i];
          if constexpr (F == ExpertWeights::nvfp4) v *= factor;
          if (r < rows) job.y[(int64_t{work.begin} + r) * job.out + o] = v;
        }
    }
}

template <ExpertWeights F>
void launch_grouped(const MoeGroupedGemm& job, cudaStream_t stream) {
  using T = GroupedGemmTraits<F>;
  const auto kernel = moe_experts_grouped_kernel<F>;
  msa::cuda::require_dynamic_smem(kernel, T::kSmemBytes);
  const dim3 grid(static_cast<unsigned>(moe_grouped_work_items(job.entries, job.experts)),
                  static_cast<unsigned>((job.out + T::kTileN - 1) / T::kTileN));
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(job);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool moe_experts_grouped_fits(int64_t in, int64_t out, ExpertWeights format) {
  const int64_t multiple = expert_weights_in_multiple(format);
  return multiple > 0 && in > 0 && in % multiple == 0 && out > 0 && out <= int64_t{65535} * Bf16Traits::kTileN;
}

int64_t moe_grouped_work_items(int64_t entries, int64_t experts) {
  using T = Bf16Traits;  // kTileM is the same for every format
  return (entries + T::kTileM - 1) / T::kTileM + std::min(experts, entries);
}

void moe_experts_grouped(const MoeGroupedGemm& job, void* stream) {
  using T = Bf16Traits;
  const ExpertWeights format = job.quantized.format;
  MSA_CHECK_ARG(job.entries >= 0 && job.entries < (int64_t{1} << 31), "entries", "0..2^31 - 1 rows", job.entries);
  MSA_CHECK_ARG(job.experts >= 1, "experts", "at least 1", job.experts);
  const int64_t multiple = expert_weights_in_multiple(format);
  MSA_CHECK_ARG(multiple > 0, "quantized.format", "bf16, mxfp8 or nvfp4", static_cast<int>(format));
  MSA_CHECK_ARG(job.in > 0 && job.in % multiple == 0, "in",
                "a positive multiple of " + std::to_string(multiple) + " for " + expert_weights_name(format) +
                    " weights (16-byte row chunks, whole scale blocks)",
                job.in);
  MSA_CHECK_ARG(job.out > 0, "out", "positive", job.out);
  MSA_CHECK_ARG(job.out <= int64_t{65535} * T::kTileN, "out", "at most " + std::to_string(65535 * T::kTileN),
                job.out);
  MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(job.x) % 16 == 0, "x", "16-byte aligned", "a misaligned pointer");
  if (job.entries == 0) return;
  check_expert_weights(job.w, job.quantized, job.in);
  MSA_CHECK_ARG(job.x && job.offsets && job.y, "x, offsets, y", "device pointers", "null");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (format) {
    case ExpertWeights::bf16: launch_grouped<ExpertWeights::bf16>(job, s); break;
    case ExpertWeights::mxfp8: launch_grouped<ExpertWeights::mxfp8>(job, s); break;
    case ExpertWeights::nvfp4: launch_grouped<ExpertWeights::nvfp4>(job, s); break;
  }
}

}  // namespace msa::model::gpu
