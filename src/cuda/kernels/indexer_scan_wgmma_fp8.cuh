// Index scan for prefill on Hopper fp8 (e4m3) warpgroup MMA: MsaParams::index_compute fp8,
// M3's shape Di = B = 128. The tile mapping, causal key ranges, list update, fused and split
// modes and output rows are those of wgmma_tile_scan_kernel (indexer_scan_wgmma.cuh); the
// mainloop is that of the fp8 block-max prototype measured in round 6 (825 TFLOP/s storing the
// maxima, bench/results/2026-11-30-h200-round6.md; removed since: this kernel replaces it).
//
// Scores (msa/ops.h IndexCompute): qi rows and keys are e4m3 codes with one f32 scale each
// (quantized by the indexer's launcher into its workspace, or an fp8 cache as stored);
// block max = q_scale * max over the block's keys t of (k_scale[t] * sum_d qcode[d] kcode[t][d]).
// k_scale differs per key, so it is applied before the max; q_scale >= 0 is one factor of
// the whole row, applied after (max(c x) = c max(x) for c >= 0; with c = 0 the row's codes are
// all 0 and every value is 0).
//
// Tile plan (256 threads = two warpgroups, 1 CTA per SM):
//   rows  = kRows = 256 (query, index head) rows of one sequence; warpgroup g owns the two
//           64-row tiles [64 (2g + t), +64), A (codes) read from shared memory.
//   keys  = 128-key blocks (16 KB of codes + 512 B of scales) through a kStages-deep cp.async
//           ring in the 128B-swizzled K-major layout: 128 e4m3 = one 128-byte swizzle row per
//           token, so a block is one slab and a k step of 32 is +32 B in the descriptor.
//   unit  = one row tile of one block: 4 x m64n128k32 e4m3 into one of two accumulator
//           sets; unit u + 1's MMAs run while unit u is reduced (16 x (2 FMUL by the key
//           scales, FMNMX), a max tree, 2 quad shuffles, x q_scale, one list compare).
//
// Chains (ptxas C7514, nvcc 13.0; see indexer_scan_wgmma.cuh): the mainloop runs chains of
//   kChainBlocks blocks as straight-line code, overlapped inside (wait_group 1), each ending
//   in wait_group 0 before the loop's back edge; a tail of fewer blocks runs 1-block chains.
//
// Ring protocol (as indexer_scan_wgmma.cuh, deeper): ring index i (block scan_begin + min(i,
//   last)) lives in stage i % kStages; cp.async group i holds index i (group 0 also Q).
//   arrive(i) waits for group i, publishes it (proxy fence + barrier), then issues index
//   i + kPrefetch into stage (i + kPrefetch) % kStages, which last held index i - 2: when a
//   thread reaches arrive(i), at most the MMAs of index i - 1 are in flight (inside a chain
//   the last wait_group 1 came right after issuing a unit of index i - 1, retiring every
//   older unit; a chain ends in wait_group 0), so after the barrier nobody reads index i - 2.
//   Indices past the last block copy nothing (predicated), so a stage holding a real block
//   is never overwritten by them.
//
// Budget per 128-key block (SASS, nvcc 13.0; 2026-12, not measured): the tensor cores need
//   16 x m64n128k32 = 1024 clocks per SM at the fp8 rate; each of the 8 warps issues ~516
//   instructions on the common path (2 reduces of 156: 64 FMUL, 66 FMNMX, 16 LDS.64, 4 SHFL;
//   2 list compares of ~12; 2 MMA issues of ~35; one ring step of ~90 with the CTA barrier,
//   proxy fence, a page-table load and 5 copies), i.e. ~1030 per SM sub-partition (2 warps):
//   as much as the MMAs, so the epilogue binds and its latencies (barrier, page-table load
//   before the next MMA, list inserts shifting ~40 clocks per entry) are exposed. Measured
//   (1M): 1.92 us per block per SM, ~3.3x the MMA time. MSA_INDEXER_FP8_NEXT=1 runs
//   fp8_tile_scan_next_kernel (indexer_scan_wgmma_fp8_next.cuh), which cuts this to ~360.
//
// Shared memory: Q 256 x 128 B (32 KB) + kStages x (16 KB + 512 B) ring + lists 256 x pitch
//   x 8 B + 1 KB alignment: kStages 8: 165 KB + 2 KB x pitch <= 227 KB for every pitch <= 31,
//   i.e. every topk <= 32 (M3: pitch 15 -> 195 KB).
#pragma once
#include "cuda/kernels/indexer_scan.cuh"
#include "cuda/kernels/indexer_scan_wgmma.cuh"  // cp_async_16_if
#include "cuda/kernels/wgmma.cuh"

namespace msa::cuda::indexer_detail {

// The fp8 operands of the scan (device pointers; launcher workspace or an fp8 cache).
// Key token index of block j of sequence b: paged page_table[b, j] * B + slot, varlen
// seq_token_start[b] + j * B + slot (the addressing of IndexerParams::ki, in tokens).
struct Fp8ScanOperands {
  const uint8_t* q_codes = nullptr;  // e4m3 [total_q * heads, 128]
  const float* q_scales = nullptr;   // f32 [total_q * heads]
  const uint8_t* k_codes = nullptr;  // e4m3 [key tokens, 128]
  const float* k_scales = nullptr;   // f32 [key tokens]
};

struct Fp8ScanTraits {
  static constexpr int kDi = 128;
  static constexpr int kBlock = 128;
  static constexpr int kThreads = 256;
  static constexpr int kTiles = 2;                // 64-row tiles per warpgroup
  static constexpr int kRows = 128 * kTiles;      // rows per CTA
  static constexpr int kStages = 8;
  static constexpr int kPrefetch = kStages - 2;   // see "Ring protocol" above
  static constexpr int kChainBlocks = 4;          // blocks per straight-line chain (8 units)
  static constexpr int kQBytes = kRows * kDi;     // Q codes
  static constexpr int kBlockBytes = kBlock * kDi;  // one key block's codes: 16 KB
  static constexpr int kScaleBytes = kBlock * 4;    // one key block's scales: 512 B
  static constexpr int kCopiesPerThread = kBlockBytes / 16 / kThreads;  // 4
  static constexpr int kQCopiesPerThread = kQBytes / 16 / kThreads;     // 8
  static constexpr size_t kPipelineBytes =
      size_t{kQBytes} + size_t{kStages} * (kBlockBytes + kScaleBytes);
  static_assert(kTiles == 2, "the unit order below assumes two row tiles per warpgroup");
  static_assert((kStages & (kStages - 1)) == 0 && kPrefetch >= 1, "ring shape");
  static_assert(kCopiesPerThread * kThreads * 16 == kBlockBytes && kThreads % 8 == 0,
                "whole 16-byte chunks per thread, one swizzle phase per thread");
  static_assert(kBlock <= kThreads, "one thread per key scale");
  static constexpr size_t kMaxSmemBytes = 227 * 1024;  // sm_90's opt-in limit per CTA
  static constexpr size_t smem_bytes(int list_pitch) {
    return 1024 + kPipelineBytes + size_t{kRows} * list_pitch * (sizeof(float) + sizeof(int32_t));
  }
};
static_assert(Fp8ScanTraits::smem_bytes(kMaxTopk - 1) <= Fp8ScanTraits::kMaxSmemBytes,
              "every list pitch (topk <= 32) must fit");

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

// 4-byte cp.async issued only where `pred` holds (a predicated instruction, not a branch).
__device__ __forceinline__ void cp_async_4_if(uint32_t shared, const void* global, bool pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p cp.async.ca.shared.global [%0], [%1], 4;\n"
      "}\n" ::"r"(shared),
      "l"(global), "r"(int(pred)));
}

// Max of 16 values as a tree (depth 4); constant indices only.
__device__ __forceinline__ float max_tree16(float (&v)[16]) {
#pragma unroll
  for (int n = 0; n < 8; ++n) v[n] = fmaxf(v[n], v[n + 8]);
#pragma unroll
  for (int n = 0; n < 4; ++n) v[n] = fmaxf(v[n], v[n + 4]);
#pragma unroll
  for (int n = 0; n < 2; ++n) v[n] = fmaxf(v[n], v[n + 2]);
  return fmaxf(v[0], v[1]);
}

// First key token (in Fp8ScanOperands' token numbering) of block `block` of sequence `seq`.
__device__ __forceinline__ int64_t fp8_block_token(const KeyLayout& ki, int64_t seq,
                                                   int64_t block) {
  if (ki.page_table)
    return static_cast<int64_t>(ki.page_table[seq * ki.page_table_stride + block]) * ki.block_size;
  return ki.seq_token_start[seq] + block * ki.block_size;
}

// grid = (tile bound, chunks) as tile_scan_kernel: blockIdx.x -> tile, blockIdx.y -> chunk.
__global__ void __launch_bounds__(Fp8ScanTraits::kThreads, 1)
    fp8_tile_scan_kernel(const IndexerParams p, const TileScanPlan plan,
                         const Fp8ScanOperands ops) {
  using T = Fp8ScanTraits;
  constexpr int kTiles = T::kTiles;
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte alignment for the swizzled tiles, as an offset from smem_raw (the compiler
  // keeps knowing the pointers are shared: LDS for the scales).
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const uint32_t q_smem = smem_address(smem);                 // [kRows][128 B], swizzled
  const uint32_t ring_smem = q_smem + T::kQBytes;              // kStages x [128 keys][128 B]
  const float* scale_ring =
      reinterpret_cast<const float*>(smem + T::kQBytes + T::kStages * T::kBlockBytes);
  const uint32_t scale_smem = smem_address(scale_ring);       // kStages x [128] f32
  float* list_values = reinterpret_cast<float*>(smem + T::kPipelineBytes);
  int32_t* list_ids = reinterpret_cast<int32_t*>(list_values + T::kRows * plan.list_pitch);

  const TileGeometry tile = tile_geometry(p, plan);
  if (!tile.valid) return;  // uniform over the CTA: before any barrier
  const bool fused = plan.block_max == nullptr;
  const int heads = static_cast<int>(p.heads);
  const int n_blocks = max(0, tile.scan_end - tile.scan_begin);
  const int last = n_blocks - 1;
  const int64_t tile_row0 = tile.first_query * p.heads;  // global row of the tile's row 0

  // This thread's rows in the accumulator layout of tile t: r and r + 8 with
  // r = 16 warp + lane / 4; after the reduce quad lane 0 owns row r, quad lane 1 row r + 8.
  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid % 128) / 32;
  const int quad = lane % 4;
  int own_row[kTiles];
  bool owner[kTiles];
  int32_t own_block[kTiles], own_cand_end[kTiles];
  float own_q_scale[kTiles];
  TopList list[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    own_row[t] = (warpgroup * kTiles + t) * 64 + warp * 16 + lane / 4 + 8 * (quad & 1);
    owner[t] = quad < 2 && own_row[t] < tile.n_rows;
    own_block[t] = static_cast<int32_t>((tile.first_pos + own_row[t] / heads) / p.block_size);
    own_cand_end[t] = own_block[t] - p.local_blocks + 1;
    // Rows past the tile read no scale (their values are never used).
    own_q_scale[t] = own_row[t] < tile.n_rows ? ops.q_scales[tile_row0 + own_row[t]] : 0.0f;
    list[t].init(list_values + own_row[t] * plan.list_pitch,
                 list_ids + own_row[t] * plan.list_pitch, plan.ranked);
  }

  if (n_blocks > 0) {
    // Q codes (rows past the tile are zero-filled: their maxima are ignored); join group 0.
    const uint8_t* tile_q = ops.q_codes + tile_row0 * T::kDi;
#pragma unroll
    for (int j = 0; j < T::kQCopiesPerThread; ++j) {
      const int c = tid + j * T::kThreads, row = c / 8, chunk = c % 8;
      const bool valid = row < tile.n_rows;
      cp_async_16(smem + swizzled_offset(row, chunk, T::kRows),
                  tile_q + (valid ? int64_t{row} * T::kDi + chunk * 16 : 0), valid);
    }
    // Ring index `index` -> stage index % kStages; indices past the last block copy nothing
    // (predicated copies, no branch: the source stays clamped to the last block).
    // Thread tid copies chunk tid % 8 of keys tid / 8 + 32 j, j < kCopiesPerThread: the same
    // swizzle phase (key % 8) for every j, so the addresses are two bases plus immediates.
    const int copy_key = tid / 8, copy_chunk = tid % 8;
    const uint32_t copy_dst = ring_smem + swizzled_offset(copy_key, copy_chunk, T::kBlock);
    const int copy_src = copy_key * T::kDi + copy_chunk * 16;
    const auto load_block = [&](int index) {
      const bool real = index <= last;
      const int64_t token = fp8_block_token(p.ki, tile.seq, tile.scan_begin + min(index, last));
      const uint8_t* src = ops.k_codes + token * T::kDi + copy_src;
      const int stage = index % T::kStages;
      const uint32_t dst = copy_dst + stage * T::kBlockBytes;
#pragma unroll
      for (int j = 0; j < T::kCopiesPerThread; ++j)
        cp_async_16_if(dst + j * 32 * 128, src + j * 32 * T::kDi, real);
      // 128 scales, 4 B each by warpgroup 0 (a varlen sequence's first token, hence its
      // scales, may sit at any 4-byte offset: no 16-byte copies).
      cp_async_4_if(scale_smem + (stage * T::kBlock + tid % 128) * 4,
                    ops.k_scales + token + tid % 128, real && tid < 128);
    };
    ring_prefetch<T::kPrefetch>(load_block);
    const auto arrive = [&](int i) { ring_arrive<T::kPrefetch>(i, load_block); };
    const auto issue = [&](float(&acc)[64], int index, int t) {
      const uint32_t a = q_smem + (warpgroup * kTiles + t) * 64 * T::kDi;
      const uint32_t b = ring_smem + (index % T::kStages) * T::kBlockBytes;
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < T::kDi / 32; ++k)  // 32 e4m3 = 32 B per k step
        wgmma_m64n128k32_e4m3(acc, wgmma_descriptor(a + 32 * k), wgmma_descriptor(b + 32 * k),
                              k > 0);
      wgmma_commit();
    };
    const auto reduce = [&](float(&acc)[64], int index, int t) {
      fence_operands(acc);
      // Columns 8n + 2 quad + {0, 1} of accumulator group n: two adjacent key scales.
      const float* scales = scale_ring + (index % T::kStages) * T::kBlock + 2 * quad;
      float top[16], bottom[16];
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const float2 s = *reinterpret_cast<const float2*>(scales + 8 * n);
        top[n] = fmaxf(acc[4 * n] * s.x, acc[4 * n + 1] * s.y);
        bottom[n] = fmaxf(acc[4 * n + 2] * s.x, acc[4 * n + 3] * s.y);
      }
      float tv = max_tree16(top), bv = max_tree16(bottom);
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 1));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 1));
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 2));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 2));
      const int32_t block = tile.scan_begin + index;
      if (index > last || !owner[t] || block >= own_cand_end[t]) return;
      const float value = ((quad & 1) ? bv : tv) * own_q_scale[t];
      if (fused)
        list[t].offer(value, block);
      else
        plan.block_max[(tile_row0 + own_row[t]) * plan.block_max_stride + block] = value;
    };

    // Units of a chain run block by block, tile by tile; accumulator set u % 2. Straight-line
    // code: no MMA is in flight across the loops' back edges below.
    float acc[2][64];
    run_overlapped_chains<T::kChainBlocks, 1, kTiles>(acc, n_blocks, arrive, issue, reduce);
    cp_async_wait<0>();  // nothing is copied past the last block; kept for clarity
  }

  if (fused) write_owned_selections(p, tile, heads, own_row, owner, own_block, list);
}

}  // namespace msa::cuda::indexer_detail
