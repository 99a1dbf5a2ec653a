// Prototype: the indexer's block-max scan on Hopper fp8 (e4m3) warpgroup MMA, measured alone.
//
// What it measures: rows (query, index head) of qi [R, 128] against keys [N, 128], both
// quantized per row / token to e4m3 with one f32 scale (the project's fp8 index-key recipe,
// include/msa/quantized_index_keys.h: scale = amax / 448, code = e4m3_rne_saturating(x / scale));
// output block_max[r][b] = q_scale[r] * max over the 128 keys t of block b of
// (k_scale[t] * sum_d qcode[r][d] * kcode[t][d]), the scan the prefill indexer does before
// its top-16 (msa-spec §3). The key scale differs per key, so it is applied before the max;
// the row scale is one positive factor, applied after.
//
// Kernel (one CTA per SM, 256 threads = two consumer warpgroups, no producer warp):
//   rows   128 * kTiles per CTA; warpgroup g owns kTiles row tiles of 64 (A from shared memory).
//   keys   128-key blocks (16 KB of codes + 512 B of scales) through an 8-stage cp.async ring
//          in the 128B-swizzled K-major layout: Di = 128 e4m3 = one 128-byte swizzle row per
//          token, so a block is a single slab and a k step of 32 is +32 B in the descriptor.
//   MMA    per block and row tile 4 x wgmma m64n128k32 e4m3 x e4m3 -> f32.
//   overlap two accumulator sets alternating over units (unit = one row tile of one block):
//          unit u + 1's MMAs run while unit u is reduced (wgmma.wait_group 1). kTiles = 1
//          alternates between blocks (as the bf16 prototype); kTiles = 2 (256 rows per CTA)
//          between the two row tiles of a block, and reads each key block from L2 half as
//          often per flop. Both are timed.
//   reduce per thread 16 x (LDS.64 of two key scales, 4 FMUL, 2 FMNMX), a max tree, 2 quad
//          shuffles, x q_scale; owner lanes store.
// Why cp.async and not TMA: the bf16 prototype and the production kernel load this exact
//   layout with cp.async and pass their GPU tests; a block costs each thread 4-5 copies
//   against ~300 epilogue instructions, so a TMA producer warp would save little here and add
//   a tensor map and mbarrier phases that cannot be debugged without a device. A stage is
//   refilled right after the barrier of block i with block i + kStages - 2: every MMA that read
//   the stage's previous block (i - 2) was waited for (wgmma.wait_group) before that barrier.
// No ptxas C7514 (wgmma serialisation). Found with nvcc 13.0 (a 40-line kernel reproduces
//   it): ptxas serialises every wgmma of a function as soon as an MMA group is still in flight
//   across a loop's back edge and its accumulators are read later (the bf16 prototype and
//   indexer_scan_wgmma.cuh both do that, hence their C7514); the same overlap in straight-line
//   code is fine. So the mainloop runs chains of kChainUnits units as straight-line code,
//   overlapped inside the chain, each chain ending with wait_group 0 (as FlashAttention-3's
//   intra-warpgroup overlap ends its iterations): 1 reduce in kChainUnits is not overlapped by
//   this warpgroup's own MMAs. (A lane-divergent `if` around the store, with MMAs in flight,
//   does not trigger it; the copies past the end are predicated off all the same.)
// Budget (ptxas, nvcc 13.0): 198 / 212 registers (256 / 128 rows per CTA), no spills, no
//   C7514; per unit ~210 SASS instructions per warp (the reduce's 16 LDS + 64 FMUL + 62 FMNMX
//   are ~150 of them), so per 128-key block the SM issues ~950 cycles of ALU work against
//   1024 cycles of fp8 MMA at peak: the epilogue, not the tensor cores, is the likely limit.
//   A per-block key scale (instead of per token) would drop the 64 FMUL.
// Two numbers for the default timing case (R = 67584, N = 131072): 2.27 PFLOP = 1.15 ms at
//   the 1979 TFLOP/s fp8 spec; every CTA reads all 16.8 MB of keys from L2: 4.4 GB at 256
//   rows per CTA, 8.9 GB at 128 (~0.6 / 1.3 ms at ~7 TB/s of L2), which is why 256 rows.
//
// Build and run from the repository root (H100/H200):
//   nvcc -O3 -std=c++17 -I src -I include -gencode=arch=compute_90a,code=sm_90a
//     bench/prototypes/wgmma_fp8_block_max.cu -o /tmp/fp8proto -Xptxas -v && /tmp/fp8proto
//   (one line)
// With a cuBLASLt fp8 GEMM (8192^3, e4m3 in, bf16 out) as the measured fp8 ceiling, add
//   -DMSA_PROTO_CUBLASLT -lcublasLt
// Arguments (optional): timing key blocks (default 1024 = 131072 keys), timing rows
// (default 67584 = 132 SMs x 2 waves x 256). Exit code 1 when a check fails.
//
// What the production kernel needs beyond this: a running top-16 list per row instead of the
// block-max matrix (indexer_scan.cuh's TopList: one compare per row and block in the common
// case), each tile's causal key range (scan_begin/end, the local blocks excluded, a mask on the
// diagonal block), varlen sequences and paged keys (per-block source pointers, a tile never
// straddling sequences, rows past the tile end zero-filled), the (query, index head) row
// mapping, and an fp8 quantizer for qi (per row, fused into the indexer's q projection).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <type_traits>
#include <vector>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/wgmma.cuh"

#ifdef MSA_PROTO_CUBLASLT
#include <cublasLt.h>
#endif

using namespace msa::cuda;

#define CHECK(call)                                                                        \
  do {                                                                                     \
    cudaError_t e = (call);                                                                \
    if (e != cudaSuccess) {                                                                \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e), __FILE__, __LINE__, \
                  #call);                                                                  \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kDim = 128;                     // Di: 128 e4m3 codes = 128 B per token
constexpr int kKeys = 128;                    // keys per block (B)
constexpr int kThreads = 256;                 // two warpgroups
constexpr int kStages = 8;                    // ring depth (a power of two: index % kStages)
constexpr int kPrefetch = kStages - 2;        // blocks loaded ahead (see the header)
constexpr int kBlockBytes = kKeys * kDim;     // 16 KB of codes
constexpr int kChunksPerThread = kBlockBytes / 16 / kThreads;  // 4 copies of 16 B
constexpr int kChainUnits = 8;                // (block, row tile) units per straight-line chain
static_assert(kBlockBytes % (16 * kThreads) == 0, "a block splits evenly over the threads");
static_assert((kStages & (kStages - 1)) == 0 && kPrefetch >= 1, "ring shape");

__host__ __device__ constexpr int rows_per_cta(int tiles) { return 128 * tiles; }
__host__ __device__ constexpr int smem_bytes(int tiles) {
  return 1024 /* alignment slack */ + rows_per_cta(tiles) * kDim + kStages * kBlockBytes +
         kStages * kKeys * 4;
}

// d[64] = A(64 x 32 e4m3) * B(32 x 128 e4m3)^T + (accumulate ? d : 0); both operands K-major
// in shared memory (fp8 wgmma has no transposed form). Accumulator layout as in wgmma.cuh.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t a, uint64_t b,
                                                      int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      MSA_WGMMA_ACCUMULATORS
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : MSA_WGMMA_ACCUMULATOR_OPERANDS(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// Max of 16 values as a tree (depth 4, not a 16-deep dependency chain); constant indices only.
__device__ __forceinline__ float max_tree16(float (&v)[16]) {
#pragma unroll
  for (int n = 0; n < 8; ++n) v[n] = fmaxf(v[n], v[n + 8]);
#pragma unroll
  for (int n = 0; n < 4; ++n) v[n] = fmaxf(v[n], v[n + 4]);
#pragma unroll
  for (int n = 0; n < 2; ++n) v[n] = fmaxf(v[n], v[n + 2]);
  return fmaxf(v[0], v[1]);
}

// q [rows, 128] e4m3 codes, q_scale [rows] f32, keys [blocks * 128, 128] e4m3, k_scale
// [blocks * 128] f32 -> block_max [rows, blocks] f32 (written when `store` != 0; the timing
// runs once with and once without the stores). rows = gridDim.x * rows_per_cta(kTiles).
template <int kTiles>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_block_max_kernel(const uint8_t* __restrict__ q, const float* __restrict__ q_scale,
                         const uint8_t* __restrict__ keys, const float* __restrict__ k_scale,
                         int blocks, float* __restrict__ block_max, int store) {
  constexpr int kRows = rows_per_cta(kTiles);
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment for the swizzled tiles, as an offset from smem_raw so that the
  // compiler still knows the pointers below are shared (LDS, not generic LD, for the scales).
  uint8_t* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const uint32_t q_smem = smem_address(smem);           // [kRows][128 B], swizzled
  const uint32_t ring_smem = q_smem + kRows * kDim;      // kStages x [128 keys][128 B]
  const float* scale_ring = reinterpret_cast<const float*>(smem + kRows * kDim + kStages * kBlockBytes);
  const uint32_t scale_smem = smem_address(scale_ring);  // kStages x [128] f32
  const int tid = threadIdx.x, warpgroup = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int last = blocks - 1;

  // Q tile: kRows x 8 chunks of 16 B; it joins the first block's copy group.
#pragma unroll
  for (int j = 0; j < kRows * 8 / kThreads; ++j) {
    const int c = tid + j * kThreads, row = c / 8, chunk = c % 8;
    cp_async_16(smem + swizzled_offset(row, chunk, kRows), q + (row0 + row) * kDim + chunk * 16);
  }
  // Ring slot `index % kStages` receives block `index`; indices past the end copy nothing
  // (predicated copies: no branch; the source pointer stays clamped in bounds).
  const auto load_block = [&](int index) {
    const bool real = index <= last;
    const int64_t block = min(index, last);
    const uint8_t* src = keys + block * kBlockBytes;
    const uint32_t dst = ring_smem + (index % kStages) * kBlockBytes;
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int c = tid + j * kThreads, key = c / 8, chunk = c % 8;
      cp_async_16_if(dst + swizzled_offset(key, chunk, kKeys), src + key * kDim + chunk * 16, real);
    }
    // 128 scales = 32 copies of 16 B, by warp 0.
    cp_async_16_if(scale_smem + ((index % kStages) * kKeys + (tid % 32) * 4) * 4,
                   k_scale + block * kKeys + (tid % 32) * 4, real && tid < 32);
  };
  // One copy group per ring index: group i holds block i (group 0 also Q).
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    load_block(s);
    cp_async_commit();
  }
  // Publishes ring index i to both warpgroups, then refills the slot of index i - 2 (free:
  // each thread passed the wait_group that retired the MMAs reading it before this barrier).
  const auto arrive = [&](int i) {
    cp_async_wait<kPrefetch - 1>();  // groups 0..i are done (i + kPrefetch were committed)
    fence_async_shared();            // this thread's copies -> the async proxy (wgmma) ...
    __syncthreads();                 // ... then to every thread
    load_block(i + kPrefetch);
    cp_async_commit();
  };

  // This thread's rows in the accumulator layout: r and r + 8, r = 16 * warp + lane / 4 of
  // its 64-row tile. Quad lane 0 stores row r, quad lane 1 row r + 8.
  const int quad = lane % 4;
  const bool owner = quad < 2;
  const int own_row_in_tile = 16 * warp + lane / 4 + 8 * (quad & 1);
  float own_q_scale[kTiles];
  int64_t own_row[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    own_row[t] = row0 + (warpgroup * kTiles + t) * 64 + own_row_in_tile;
    own_q_scale[t] = q_scale[own_row[t]];
  }

  const auto issue = [&](float(&acc)[64], int index, int tile) {
    const uint32_t a = q_smem + (warpgroup * kTiles + tile) * 64 * kDim;
    const uint32_t b = ring_smem + (index % kStages) * kBlockBytes;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kDim / 32; ++k)  // 32 e4m3 = 32 B per k step
      wgmma_m64n128k32_e4m3(acc, wgmma_descriptor(a + 32 * k), wgmma_descriptor(b + 32 * k), k > 0);
    wgmma_commit();
  };
  // Max over the block's keys of acc * k_scale for rows r and r + 8, stored by the owners.
  const auto reduce = [&](float(&acc)[64], int index, int tile) {
    fence_operands(acc);
    // Columns 8n + 2 quad + {0, 1} of accumulator group n: two adjacent key scales.
    const float* scales = scale_ring + (index % kStages) * kKeys + 2 * quad;
    float top[16], bottom[16];
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float2 s = *reinterpret_cast<const float2*>(scales + 8 * n);
      top[n] = fmaxf(acc[4 * n] * s.x, acc[4 * n + 1] * s.y);
      bottom[n] = fmaxf(acc[4 * n + 2] * s.x, acc[4 * n + 3] * s.y);
    }
    float t = max_tree16(top), bt = max_tree16(bottom);
    t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 1));
    bt = fmaxf(bt, __shfl_xor_sync(0xffffffffu, bt, 1));
    t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 2));
    bt = fmaxf(bt, __shfl_xor_sync(0xffffffffu, bt, 2));
    const float value = ((quad & 1) ? bt : t) * own_q_scale[tile];
    if (store && owner) block_max[own_row[tile] * blocks + index] = value;
  };

  // Two accumulator sets, alternating between consecutive units (unit = one row tile of one
  // block; units run block by block, tile by tile). A chain of units is straight-line code:
  // unit u + 1's MMAs are issued before unit u is reduced (wait_group 1), and the chain ends
  // with wait_group 0, so no MMA is in flight across the loop's back edge: ptxas cannot track
  // wgmma groups around a loop and serialises every wgmma if one is (C7514, measured with
  // nvcc 13.0; FlashAttention-3's intra-warpgroup overlap ends its iterations the same way).
  // The exposed reduce at a chain's end is 1 in kChainUnits. The first MMA of each unit
  // overwrites its set (no zeroing moves).
  float acc[2][64];
  const auto run_chain = [&](int first, auto chain_blocks) {
    run_overlapped_chain<decltype(chain_blocks)::value * kTiles, kTiles>(acc, first, arrive, issue, reduce);
  };
  constexpr int kChainBlocks = kChainUnits / kTiles;
  int i = 0;
  for (; i + kChainBlocks <= blocks; i += kChainBlocks)
    run_chain(i, std::integral_constant<int, kChainBlocks>{});
  for (; i < blocks; ++i) run_chain(i, std::integral_constant<int, 1>{});
  cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
}

// ---------------------------------------------------------------------------------------
// Host side.

// e4m3 encode / decode on the host: cuda_fp8.h's conversions are __host__ __device__, and
// __NV_SATFINITE is round-to-nearest-even, saturating at +-448 — the same function the
// project's CUDA quantizer uses (src/cuda/quantize_index_keys.cu), whose bytes equal the CPU
// quantizer's (msa::float_to_e4m3, src/core/dtype.cpp; not linked here to keep one file).
uint8_t encode_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
float decode_e4m3(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(code);
  return static_cast<float>(v);
}

struct Quantized {
  std::vector<uint8_t> codes;  // [rows, kDim]
  std::vector<float> scale;    // [rows]
};

// Per row: scale = amax / 448 (f32), code = e4m3(x / scale); an all-zero row gets scale 0.
Quantized quantize_rows(const std::vector<float>& x, int64_t rows) {
  Quantized out{std::vector<uint8_t>(rows * kDim, 0), std::vector<float>(rows, 0.0f)};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * kDim;
    float amax = 0;
    for (int d = 0; d < kDim; ++d) amax = std::max(amax, std::fabs(row[d]));
    const float scale = amax / 448.0f;
    out.scale[r] = scale;
    if (scale == 0) continue;
    for (int d = 0; d < kDim; ++d) out.codes[r * kDim + d] = encode_e4m3(row[d] / scale);
  }
  return out;
}

std::vector<float> random_normal(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(gen);
  return x;
}

struct DeviceCase {
  uint8_t *q = nullptr, *keys = nullptr;
  float *q_scale = nullptr, *k_scale = nullptr, *out = nullptr;
  int64_t rows = 0;
  int blocks = 0;
};

DeviceCase upload(const Quantized& q, const Quantized& k, int64_t rows, int blocks) {
  DeviceCase d;
  d.rows = rows;
  d.blocks = blocks;
  const int64_t keys = int64_t(blocks) * kKeys;
  CHECK(cudaMalloc(&d.q, rows * kDim));
  CHECK(cudaMalloc(&d.keys, keys * kDim));
  CHECK(cudaMalloc(&d.q_scale, rows * 4));
  CHECK(cudaMalloc(&d.k_scale, keys * 4));
  CHECK(cudaMalloc(&d.out, rows * blocks * 4));
  CHECK(cudaMemcpy(d.q, q.codes.data(), rows * kDim, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.keys, k.codes.data(), keys * kDim, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.q_scale, q.scale.data(), rows * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.k_scale, k.scale.data(), keys * 4, cudaMemcpyHostToDevice));
  return d;
}
void release(DeviceCase& d) {
  CHECK(cudaFree(d.q));
  CHECK(cudaFree(d.keys));
  CHECK(cudaFree(d.q_scale));
  CHECK(cudaFree(d.k_scale));
  CHECK(cudaFree(d.out));
}

template <int kTiles>
void launch(const DeviceCase& d, int store) {
  if (d.rows % rows_per_cta(kTiles) != 0 || d.blocks < 1) {
    std::printf("launch: rows %lld must be a multiple of %d and blocks %d >= 1\n",
                (long long)d.rows, rows_per_cta(kTiles), d.blocks);
    std::exit(1);
  }
  const int ctas = static_cast<int>(d.rows / rows_per_cta(kTiles));
  fp8_block_max_kernel<kTiles><<<ctas, kThreads, smem_bytes(kTiles)>>>(
      d.q, d.q_scale, d.keys, d.k_scale, d.blocks, d.out, store);
  CHECK(cudaGetLastError());
}

// Block maxima of q . k over each block's keys, in f64 (f: the row / key vectors as floats).
// With `argmax` set, also the key index of each maximum.
std::vector<double> cpu_block_max(const std::vector<float>& q, const std::vector<float>& k,
                                  const float* q_scale, const float* k_scale, int64_t rows,
                                  int blocks, std::vector<int>* argmax) {
  std::vector<double> out(rows * blocks);
  if (argmax) argmax->assign(rows * blocks, -1);
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < blocks; ++b) {
      double best = -INFINITY;
      int best_key = -1;
      for (int t = 0; t < kKeys; ++t) {
        const int64_t key = int64_t(b) * kKeys + t;
        double dot = 0;
        for (int d = 0; d < kDim; ++d) dot += double(q[r * kDim + d]) * double(k[key * kDim + d]);
        if (k_scale) dot *= k_scale[key];
        if (dot > best) best = dot, best_key = t;
      }
      out[r * blocks + b] = q_scale ? best * q_scale[r] : best;
      if (argmax) (*argmax)[r * blocks + b] = best_key;
    }
  return out;
}

std::vector<float> decode_all(const std::vector<uint8_t>& codes) {
  std::vector<float> out(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) out[i] = decode_e4m3(codes[i]);
  return out;
}

// Compares a kernel's block maxima with the f64 reference over the same quantized values:
// prints the worst relative error (where, got, ref), the norm-wise one, and the first bad
// entry; returns the number of entries off by more than 1e-3 relative (NaN, i.e. unwritten
// poison, counts as bad).
int64_t compare_block_max(const std::vector<float>& got, const std::vector<double>& ref, int64_t rows,
                          int blocks, const char* label) {
  double worst_rel = 0, err2 = 0, ref2 = 0;
  int64_t worst_at = 0, bad = 0, not_finite = 0, first_bad = -1;
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const bool finite = std::isfinite(got[i]);
    const double diff = finite ? double(got[i]) - ref[i] : 0.0;
    const double rel = std::fabs(diff) / std::max(std::fabs(ref[i]), 1e-30);
    err2 += diff * diff;
    ref2 += ref[i] * ref[i];
    not_finite += !finite;
    if (!finite || rel > 1e-3) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
    if (rel > worst_rel) worst_rel = rel, worst_at = i;
  }
  std::printf("check %s rows %lld blocks %d: max rel err %.3g at (row %lld, block %lld: got %.7g ref %.7g), "
              "norm rel err %.3g (finite entries), %lld NaN/inf, %lld bad:%s\n",
              label, (long long)rows, blocks, worst_rel, (long long)(worst_at / blocks),
              (long long)(worst_at % blocks), got[worst_at], ref[worst_at], std::sqrt(err2 / std::max(ref2, 1e-300)),
              (long long)not_finite, (long long)bad, bad ? " FAILED" : " OK");
  if (bad)
    std::printf("  first bad (row %lld, block %lld): got %.7g ref %.7g\n", (long long)(first_bad / blocks),
                (long long)(first_bad % blocks), got[first_bad], ref[first_bad]);
  return bad;
}

// Quantization effect (informative): per (row, block), whether the argmax key differs between
// the dequantized fp8 data and the f32 data; per row, how the top-16 block set of the kernel's
// fp8 output differs from the f32 data's.
void quantization_report(const std::vector<float>& got, const std::vector<double>& ref_f32,
                         const std::vector<int>& argmax_fp8, const std::vector<int>& argmax_f32, int64_t rows,
                         int blocks) {
  int64_t argmax_diff = 0, rows_set_diff = 0, blocks_swapped = 0;
  for (int64_t i = 0; i < rows * blocks; ++i) argmax_diff += argmax_fp8[i] != argmax_f32[i];
  const int top = std::min(16, blocks);
  std::vector<int> a(blocks), b(blocks), common;
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < blocks; ++j) a[j] = b[j] = j;
    const float* g = got.data() + r * blocks;
    const double* f = ref_f32.data() + r * blocks;
    std::partial_sort(a.begin(), a.begin() + top, a.end(), [&](int x, int y) { return g[x] > g[y]; });
    std::partial_sort(b.begin(), b.begin() + top, b.end(), [&](int x, int y) { return f[x] > f[y]; });
    std::sort(a.begin(), a.begin() + top);
    std::sort(b.begin(), b.begin() + top);
    common.clear();
    std::set_intersection(a.begin(), a.begin() + top, b.begin(), b.begin() + top, std::back_inserter(common));
    blocks_swapped += top - static_cast<int64_t>(common.size());
    rows_set_diff += common.size() != size_t(top);
  }
  std::printf("quantization (fp8 vs f32 data, informative): argmax key differs in %lld of %lld (row, block); "
              "top-%d of %d blocks differs in %lld of %lld rows (%lld blocks swapped in all)\n",
              (long long)argmax_diff, (long long)(rows * blocks), top, blocks, (long long)rows_set_diff,
              (long long)rows, (long long)blocks_swapped);
}

// One correctness case for both kernels, on fresh random data; returns false on failure.
bool check_case(int64_t rows, int blocks, uint32_t seed) {
  const int64_t keys = int64_t(blocks) * kKeys;
  const std::vector<float> qf = random_normal(rows * kDim, seed);
  const std::vector<float> kf = random_normal(keys * kDim, seed + 1);
  const Quantized q = quantize_rows(qf, rows), k = quantize_rows(kf, keys);
  std::vector<int> argmax_fp8, argmax_f32;
  const std::vector<double> ref = cpu_block_max(decode_all(q.codes), decode_all(k.codes),
                                                q.scale.data(), k.scale.data(), rows, blocks, &argmax_fp8);
  const std::vector<double> ref_f32 = cpu_block_max(qf, kf, nullptr, nullptr, rows, blocks, &argmax_f32);
  DeviceCase d = upload(q, k, rows, blocks);
  bool ok = true;
  for (int tiles = 1; tiles <= 2; ++tiles) {
    CHECK(cudaMemset(d.out, 0xff, rows * blocks * 4));  // poison: NaN
    tiles == 1 ? launch<1>(d, 1) : launch<2>(d, 1);
    CHECK(cudaDeviceSynchronize());
    std::vector<float> got(rows * blocks);
    CHECK(cudaMemcpy(got.data(), d.out, got.size() * 4, cudaMemcpyDeviceToHost));
    ok = compare_block_max(got, ref, rows, blocks, tiles == 1 ? "128 rows/CTA" : "256 rows/CTA") == 0 && ok;
    if (tiles == 2) quantization_report(got, ref_f32, argmax_fp8, argmax_f32, rows, blocks);
  }
  release(d);
  return ok;
}

template <int kTiles>
float time_kernel(const DeviceCase& d, int store) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int w = 0; w < 3; ++w) launch<kTiles>(d, store);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < 10; ++r) {
    CHECK(cudaEventRecord(start));
    launch<kTiles>(d, store);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float t;
    CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return (ms[4] + ms[5]) / 2;  // median of 10
}

#ifdef MSA_PROTO_CUBLASLT
__global__ void fill_e4m3(uint8_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = static_cast<uint8_t>((h & 0x80) | ((h >> 8) % 0x50));  // |value| <= 2^(9-7) .. no NaN codes
  }
}

// D (bf16, m x n) = A^T (e4m3, k x m stored) * B (e4m3, k x n): the "TN" layout cuBLASLt fp8 needs.
void time_cublaslt_fp8(int size) {
  const int64_t m = size, n = size, k = size;
  uint8_t *a, *b;
  void *dmat, *workspace;
  const size_t workspace_bytes = 64 << 20;
  CHECK(cudaMalloc(&a, m * k));
  CHECK(cudaMalloc(&b, k * n));
  CHECK(cudaMalloc(&dmat, m * n * 2));
  CHECK(cudaMalloc(&workspace, workspace_bytes));
  fill_e4m3<<<1024, 256>>>(a, m * k, 1);
  fill_e4m3<<<1024, 256>>>(b, k * n, 2);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t s = cublasLtCreate(&lt);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans));
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans));
  // Fast accumulation (no periodic promotion): the scan's 128-deep sums need none either.
  const int8_t fast_accum = 1;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum));
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceCreate(&pref);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                             sizeof(workspace_bytes));
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heuristic, &found);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
    std::printf("cuBLASLt fp8 ceiling: unavailable (status %d, %d algorithms)\n", int(s), found);
  } else {
    const auto run = [&] {
      return cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, dmat, ld, dmat, ld, &heuristic.algo, workspace,
                            workspace_bytes, 0);
    };
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    for (int w = 0; w < 3 && s == CUBLAS_STATUS_SUCCESS; ++w) s = run();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> ms;
    for (int r = 0; r < 10 && s == CUBLAS_STATUS_SUCCESS; ++r) {
      CHECK(cudaEventRecord(start));
      s = run();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t);
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
      std::printf("cuBLASLt fp8 ceiling: matmul failed (status %d)\n", int(s));
    } else {
      std::sort(ms.begin(), ms.end());
      const float median = (ms[4] + ms[5]) / 2;
      std::printf("cuBLASLt fp8 ceiling: %lld^3 e4m3 -> bf16 GEMM median %.3f ms = %.1f TFLOP/s\n", (long long)m,
                  median, 2.0 * m * n * k / (median * 1e-3) / 1e12);
    }
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (ld) cublasLtMatrixLayoutDestroy(ld);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(dmat));
  CHECK(cudaFree(workspace));
}
#endif

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 1024;                 // timing: keys = 128 * blocks
  const int64_t rows = argc > 2 ? std::atoll(argv[2]) : int64_t(132) * 2 * 256;  // timing rows
  if (blocks < 1 || rows < 256 || rows % 256 != 0) {
    std::printf("usage: %s [key blocks >= 1] [rows, a multiple of 256]\n", argv[0]);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  CHECK(cudaFuncSetAttribute(fp8_block_max_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(1)));
  CHECK(cudaFuncSetAttribute(fp8_block_max_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(2)));

  // Checks: an even and an odd block count (the 128-row kernel pads odd counts), fresh data.
  bool ok = check_case(256, 32, 11);
  ok = check_case(512, 33, 23) && ok;
  ok = check_case(256, 1, 37) && ok;

  // Timing: every CTA scans all `blocks` key blocks (the keys stay in L2, as a sequence's do
  // for its query tiles in the indexer); rows large enough for >= 2 waves of the 256-row kernel.
  const int64_t keys = int64_t(blocks) * kKeys;
  const Quantized q = quantize_rows(random_normal(rows * kDim, 101), rows);
  const Quantized k = quantize_rows(random_normal(keys * kDim, 202), keys);
  DeviceCase d = upload(q, k, rows, blocks);
  CHECK(cudaMemset(d.out, 0xff, rows * blocks * 4));
  const double flops = 2.0 * kDim * double(rows) * double(keys);
  for (int tiles = 1; tiles <= 2; ++tiles)
    for (int store = 1; store >= 0; --store) {
      const float ms = tiles == 1 ? time_kernel<1>(d, store) : time_kernel<2>(d, store);
      std::printf("time %s rows/CTA (%lld CTAs), %s: rows %lld x keys %lld x Di %d: median %.3f ms, %.1f TFLOP/s\n",
                  tiles == 1 ? "128" : "256", (long long)(rows / rows_per_cta(tiles)),
                  store ? "block max stored " : "no stores (scan)", (long long)rows, (long long)keys, kDim, ms,
                  flops / (ms * 1e-3) / 1e12);
    }
  release(d);
#ifdef MSA_PROTO_CUBLASLT
  time_cublaslt_fp8(8192);
#else
  std::printf("fp8 ceiling: not measured (build with -DMSA_PROTO_CUBLASLT -lcublasLt); H200 dense fp8 spec "
              "~1979 TFLOP/s; measured bf16 ceiling 789 TFLOP/s, bf16 wgmma scan prototype 465\n");
#endif
  std::printf("%s\n", ok ? "ALL CHECKS OK" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
