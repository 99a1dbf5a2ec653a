// Prototype: the indexer's block-max scan on Hopper warpgroup MMA (wgmma), measured alone.
//
// rows = (query, index head) pairs, 128 per CTA (two consumer warpgroups of 64 rows); the
// CTA streams 128-key blocks of the index keys (Di = 128, bf16) through a 3-stage cp.async
// ring in the 128-byte-swizzled K-major layout wgmma reads, runs 8 m64n128k16 MMAs per
// block per warpgroup and reduces each row to its block max in registers. The output here
// is the [rows, blocks] block-max matrix (checked against a CPU loop); the production
// kernel (src/cuda/kernels/indexer_scan_wgmma.cuh) keeps a running top list instead.
// Build from the repository root: nvcc -O3 -std=c++17 -I src
// -gencode=arch=compute_90a,code=sm_90a bench/prototypes/wgmma_block_max.cu -o wgmma_block_max
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/common/wgmma.cuh"

using namespace msa::cuda;

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t e = (call);                                                            \
    if (e != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

constexpr int kDim = 128;          // Di
constexpr int kKeys = 128;         // keys per block (B)
constexpr int kRows = 128;         // rows per CTA
constexpr int kStages = 5;  // prefetch distance kStages - 3: a stage is reloaded only after
                             // both warpgroups waited for the MMAs that read it
constexpr int kThreads = 256;      // two warpgroups
constexpr int kSlabBytes = kKeys * 128;               // one 64-wide K slab of a key block
constexpr int kBlockBytes = 2 * kSlabBytes;           // 32 KB
constexpr int kQBytes = kRows * kDim * 2;             // 32 KB
constexpr int kSmemBytes = kQBytes + kStages * kBlockBytes + 1024;  // + alignment slack

__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(global));
}

// Each CTA: rows [tile * 128, +128) of q [rows_total, 128]; blocks [0, blocks) of keys
// [blocks * 128, 128]; writes block_max[row][block].
__global__ void __launch_bounds__(kThreads, 1)
    block_max_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ keys,
                     int blocks, float* __restrict__ block_max) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t q_smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t k_smem = q_smem + kQBytes;
  const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid % 32, warp_in_group = (tid % 128) / 32;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;

  // Q tile: 128 rows x 16 chunks of 16 B.
  for (int i = tid; i < kRows * 16; i += kThreads) {
    const int row = i / 16, chunk = i % 16;
    cp_async_16(q_smem + swizzled_offset(row, chunk, kRows), q + (row0 + row) * kDim + chunk * 8);
  }
  auto load_block = [&](int block, int stage) {
    const __nv_bfloat16* src = keys + int64_t(block) * kKeys * kDim;
    const uint32_t dst = k_smem + stage * kBlockBytes;
    for (int i = tid; i < kKeys * 16; i += kThreads) {
      const int row = i / 16, chunk = i % 16;
      cp_async_16(dst + swizzled_offset(row, chunk, kKeys), src + row * kDim + chunk * 8);
    }
  };
  for (int s = 0; s < kStages - 3; ++s) {
    if (s < blocks) load_block(s, s);
    asm volatile("cp.async.commit_group;\n");
  }

  const uint32_t a_base = q_smem + warpgroup * 64 * 128;  // this warpgroup's 64 rows, slab 0
  const int64_t top_row = row0 + warpgroup * 64 + warp_in_group * 16 + lane / 4;

  // Issues the 8 MMAs of one block into `acc`; the first overwrites it (no zeroing moves,
  // which would make ptxas serialise the two accumulator sets).
  auto issue = [&](float (&acc)[64], int block) {
    const uint32_t b_base = k_smem + (block % kStages) * kBlockBytes;
    fence_operands(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < kDim / 16; ++k) {
      const int slab = k / 4, within = (k % 4) * 32;  // 16 bf16 = 32 B per k step
      wgmma_m64n128k16(acc, wgmma_descriptor(a_base + slab * kRows * 128 + within),
                       wgmma_descriptor(b_base + slab * kKeys * 128 + within), k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  };
  // Row max of a finished block: rows lane/4 and lane/4 + 8 of this warp's 16.
  auto reduce_and_store = [&](float (&acc)[64], int block, bool keep) {
    fence_operands(acc);
    float top = -INFINITY, bottom = -INFINITY;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      top = fmaxf(top, fmaxf(acc[n * 4 + 0], acc[n * 4 + 1]));
      bottom = fmaxf(bottom, fmaxf(acc[n * 4 + 2], acc[n * 4 + 3]));
    }
    for (int offset = 1; offset < 4; offset *= 2) {
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
      bottom = fmaxf(bottom, __shfl_xor_sync(0xffffffffu, bottom, offset));
    }
    if (keep && lane % 4 == 0) {
      block_max[top_row * blocks + block] = top;
      block_max[(top_row + 8) * blocks + block] = bottom;
    }
  };
  // Waits for block `block`'s keys (and issues the load kStages - 1 blocks ahead).
  int loaded = kStages - 3;  // blocks [0, loaded) have loads issued
  auto arrive = [&](int block) {
    if (loaded < blocks && loaded <= block + kStages - 3) {
      load_block(loaded, loaded % kStages);
      ++loaded;
    }
    asm volatile("cp.async.commit_group;\n");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 3));
    // This thread's cp.async writes are done; make them visible to the async proxy (wgmma)
    // before the barrier that publishes the stage to every warpgroup.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  };

  // Two accumulator sets: block j+1's MMAs run while block j is reduced. The loop body is
  // branch-free (ptxas serialises wgmma when accumulators are live across divergent paths):
  // the block count is rounded up to even and the one extra MMA re-reads the last block
  // and is discarded.
  float acc_even[64], acc_odd[64];  // written by the first MMA of each block
  const int last = blocks - 1;
  arrive(0);
  issue(acc_even, 0);
  for (int block = 0; block < blocks; block += 2) {
    arrive(min(block + 1, last));
    issue(acc_odd, min(block + 1, last));
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    reduce_and_store(acc_even, block, true);
    arrive(min(block + 2, last));
    issue(acc_even, min(block + 2, last));
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    reduce_and_store(acc_odd, block + 1, block + 1 <= last);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 1024;  // keys = 128 * blocks
  const int tiles = argc > 2 ? std::atoi(argv[2]) : 264;    // rows = 128 * tiles
  const int64_t rows = int64_t(tiles) * kRows, keys = int64_t(blocks) * kKeys;
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> hq(rows * kDim), hk(keys * kDim);
  for (auto& x : hq) x = __float2bfloat16(normal(gen));
  for (auto& x : hk) x = __float2bfloat16(normal(gen));
  __nv_bfloat16 *dq, *dk;
  float* dmax;
  CHECK(cudaMalloc(&dq, hq.size() * 2));
  CHECK(cudaMalloc(&dk, hk.size() * 2));
  CHECK(cudaMalloc(&dmax, rows * blocks * 4));
  CHECK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dmax, 0xff, rows * blocks * 4));
  CHECK(cudaFuncSetAttribute(block_max_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  block_max_kernel<<<tiles, kThreads, kSmemBytes>>>(dq, dk, blocks, dmax);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> got(rows * blocks);
  CHECK(cudaMemcpy(got.data(), dmax, got.size() * 4, cudaMemcpyDeviceToHost));
  // Check a sample of rows against the CPU.
  double worst = 0;
  int checked = 0;
  for (int64_t row = 0; row < rows; row += std::max<int64_t>(1, rows / 97)) {
    for (int b = 0; b < blocks; b += std::max(1, blocks / 31)) {
      float best = -INFINITY;
      for (int t = 0; t < kKeys; ++t) {
        float s = 0;
        for (int d = 0; d < kDim; ++d)
          s += __bfloat162float(hq[row * kDim + d]) * __bfloat162float(hk[(int64_t(b) * kKeys + t) * kDim + d]);
        best = std::max(best, s);
      }
      worst = std::max(worst, double(std::fabs(best - got[row * blocks + b])));
      ++checked;
    }
  }
  std::printf("check: %d (row, block) maxima, worst |diff| %.3g %s\n", checked, worst,
              worst < 1e-2 ? "OK" : "FAILED");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int r = 0; r < 20; ++r) {
    cudaEventRecord(start);
    block_max_kernel<<<tiles, kThreads, kSmemBytes>>>(dq, dk, blocks, dmax);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double flops = 2.0 * rows * keys * kDim;
  std::printf("rows %lld x keys %lld x Di %d: median %.3f ms, %.1f TFLOP/s (min %.3f ms)\n",
              (long long)rows, (long long)keys, kDim, ms[10], flops / (ms[10] * 1e-3) / 1e12, ms[0]);
  return worst < 1e-2 ? 0 : 1;
}
