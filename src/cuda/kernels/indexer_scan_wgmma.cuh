// Index scan for prefill on Hopper warpgroup MMA (wgmma), for M3's shape: Di = 128, B = 128.
// Same contract, tile mapping and list update as tile_scan_kernel (indexer_scan.cuh); only
// the mainloop differs.
//
// Tile plan (256 threads = two warpgroups, 1 CTA per SM):
//   rows  = kRows = 128 x kTiles (query, index head) rows of one sequence; warpgroup g owns
//           the kTiles 64-row tiles [64 (g kTiles + t), +64), A read from shared memory.
//   keys  = 128-key blocks streamed through a kStages-deep cp.async ring in the
//           128B-swizzled K-major layout (32 KB a block); all 256 threads issue the copies.
//           Each block read from L2 serves all kRows rows.
//   unit  = one row tile of one block: 8 x m64n128k16 (Di = 128) into one of two
//           accumulator sets; unit u + 1's MMAs run while unit u is reduced (row max: 32
//           FMNMX + 4 SHFL per thread, then one compare against the row's list threshold).
//
// Why chains (ptxas C7514, nvcc 13.0): ptxas serialises EVERY wgmma of the function as soon
//   as an MMA group is still in flight across a loop's back edge and its accumulators are
//   read afterwards (a 40-line reproducer shows it; the previous pair loop of this kernel
//   did that). The same overlap written as straight-line code is fine. So the mainloop runs
//   chains of kChainBlocks blocks (kChainBlocks x kTiles units), each chain fully unrolled,
//   overlapped inside (wait_group 1) and ending in wait_group 0 before the back edge. Per
//   chain one reduce of this warpgroup is not overlapped by its own MMAs (the other
//   warpgroup's MMAs keep the tensor cores busy meanwhile). The ragged tail (fewer than
//   kChainBlocks blocks) runs chains of kTailBlocks = 2 / kTiles blocks (two units); with
//   one tile an odd tail re-reads the last block once and drops the result.
//
// Ring protocol: ring index i (block scan_begin + min(i, last)) lives in stage i % kStages;
//   cp.async group i holds index i (group 0 also holds Q). arrive(i) waits for group i,
//   publishes it (proxy fence + barrier), then issues index i + kPrefetch into stage
//   (i + kPrefetch) % kStages. That stage last held index i + kPrefetch - kStages; every
//   thread entered that barrier having retired (wait_group) all MMAs of indices <= i - 2:
//   inside a chain its last wait_group 1 came right after issuing a unit of index i - 1,
//   so every older unit (all of index i - 2 and before) had retired; a chain ends in
//   wait_group 0. So kPrefetch = kStages - 2 is safe. Indices past the last block copy
//   nothing (predicated), so a stage holding the last block is never overwritten by them,
//   and the tail's re-read of the last block always finds it in place.
//
// Shared memory: Q kRows x 256 B + kStages x 32 KB ring + lists kRows x pitch x 8 B + 1 KB
//   alignment. kTiles = 2, kStages = 4: 64 + 128 + 1 KB + 2 KB x pitch, i.e. <= 227 KB for
//   pitch <= 17 (M3: topk 16, pitch 15 -> 223 KB); the host uses this kernel only where it
//   fits (indexer.cu), the mma.sync kernel otherwise.
// Registers (ptxas, nvcc 13.0, sm_90a): 222, no spills, no C7514 (kChainBlocks 2: 196;
//   8: 228). The per-thread copy addresses are two bases plus immediates (load_block):
//   computing each copy's swizzled address from scratch cost ~30 registers and spilled.
//
// History (H200, 2026-11-29): the serialised pair-loop version (128 rows per CTA) ran the
//   128K prefill in 34.9 ms (252 TFLOP/s) vs the mma.sync kernel's 27.9 ms. Expected for
//   these chains: per unit the SS wgmma reads 6 KB of shared memory per 64 clocks of MMA
//   (96 B/clk) plus 16 B/clk of ring fills, under the 128 B/clk limit; so ~60-75% of the
//   bf16 peak. Measured (H200, 2026-11-30, bench/results/2026-11-30-h200-round6.md): 32K
//   1.72 ms, 128K 24.0 ms (366 TFLOP/s, 46%: short rows, causal tails), 512K 310 ms (57%),
//   1M 1130 ms (498 TFLOP/s, 63%) vs mma.sync 1.84 / 27.9 / 417 / 1599 ms: the default
//   since then where it fits and no lse_out is requested (indexer.cu, make_plan).
#pragma once
#include "cuda/kernels/indexer_scan.cuh"
#include "cuda/kernels/wgmma.cuh"

namespace msa::cuda::indexer_detail {

// The bf16 wgmma scan's cp.async key ring, "Ring protocol" above: ring indices
// 0 .. kPrefetch - 1 are issued up front, one commit group each; ring_arrive(i) waits for index
// i, publishes it to both warpgroups (this thread's copies -> the async proxy, then the
// barrier) and issues index i + kPrefetch into the stage index i + kPrefetch - kStages left.
template <int kPrefetch, class LoadBlock>
__device__ __forceinline__ void ring_prefetch(LoadBlock&& load_block) {
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    load_block(s);
    cp_async_commit();
  }
}
template <int kPrefetch, class LoadBlock>
__device__ __forceinline__ void ring_arrive(int i, LoadBlock&& load_block) {
  cp_async_wait<kPrefetch - 1>();  // groups 0..i are done (i + kPrefetch committed)
  fence_async_shared();
  __syncthreads();
  load_block(i + kPrefetch);
  cp_async_commit();
}

// The rows a thread owns in the wgmma accumulator layout (bf16 and fp8 scans): in tile t of
// its warpgroup, rows r and r + 8 with r = 16 warp + lane / 4; after the reduce quad lane 0
// owns row r, quad lane 1 row r + 8. owner: the thread writes that row; own_block: the row's
// query's own block; own_cand_end: one past its last rankable block (before the local ones).
template <int kTiles>
__device__ __forceinline__ void owned_row_geometry(const IndexerParams& p, const TileGeometry& tile,
                                                   int heads, int warpgroup, int warp, int lane,
                                                   int (&own_row)[kTiles], bool (&owner)[kTiles],
                                                   int32_t (&own_block)[kTiles],
                                                   int32_t (&own_cand_end)[kTiles]) {
  const int quad = lane % 4;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    own_row[t] = (warpgroup * kTiles + t) * 64 + warp * 16 + lane / 4 + 8 * (quad & 1);
    owner[t] = quad < 2 && own_row[t] < tile.n_rows;
    own_block[t] = static_cast<int32_t>((tile.first_pos + own_row[t] / heads) / p.block_size);
    own_cand_end[t] = own_block[t] - p.local_blocks + 1;
  }
}

// Fused mode, the wgmma scans' (bf16 and fp8) last step: each owner thread writes its row's
// selection (ranked blocks, then the forced ones); rows as in the kernels (own_row etc.).
// List: TopList, or a TopSet after sort_best_first().
template <int kTiles, class List>
__device__ __forceinline__ void write_owned_selections(const IndexerParams& p, const TileGeometry& tile,
                                                       int heads, const int (&own_row)[kTiles],
                                                       const bool (&owner)[kTiles],
                                                       const int32_t (&own_block)[kTiles],
                                                       const List (&list)[kTiles]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (!owner[t]) continue;
    const int64_t own_query = tile.first_query + own_row[t] / heads;
    const int own_head = own_row[t] % heads;
    int32_t* out = p.topk_out + (own_head * p.batch.total_q + own_query) * p.topk;
    for (int slot = 0; slot < p.topk; ++slot)
      out[slot] = selection_slot(slot, p, own_block[t], list[t].ids, list[t].count);
  }
}

struct WgmmaScanTraits {
  static constexpr int kDi = 128;
  static constexpr int kBlock = 128;
  static constexpr int kThreads = 256;
  static constexpr int kTiles = 2;                // 64-row tiles per warpgroup
  static constexpr int kRows = 128 * kTiles;      // rows per CTA
  static constexpr int kStages = 4;
  static constexpr int kPrefetch = kStages - 2;   // see "Ring protocol" above
  static constexpr int kChainBlocks = 4;          // blocks per straight-line chain
  static constexpr int kTailBlocks = 2 / kTiles;  // blocks per tail chain (two units)
  static constexpr int kTileBytes = kRows * kDi * 2;    // Q
  static constexpr int kBlockBytes = kBlock * kDi * 2;  // one key block: 32 KB
  static constexpr int kCopiesPerThread = kBlockBytes / 16 / kThreads;
  static constexpr size_t kPipelineBytes = size_t{kTileBytes} + size_t{kStages} * kBlockBytes;
  static_assert(kTiles == 1 || kTiles == 2, "one or two row tiles per warpgroup");
  static_assert(kPrefetch >= 1 && kCopiesPerThread * kThreads == kBlock * 16 && kThreads % 128 == 0,
                "ring shape: 16 chunks per key, whole 8-key swizzle phases per copy step");
  static_assert(kChainBlocks % kTailBlocks == 0, "chains of whole tail chains");
  static constexpr size_t kMaxSmemBytes = 227 * 1024;  // sm_90's opt-in limit per CTA
  static constexpr size_t smem_bytes(int list_pitch) {
    return 1024 + kPipelineBytes + size_t{kRows} * list_pitch * (sizeof(float) + sizeof(int32_t));
  }
  static constexpr bool fits(int list_pitch) { return smem_bytes(list_pitch) <= kMaxSmemBytes; }
};
static_assert(WgmmaScanTraits::fits(15), "M3 (topk 16, local 1: 15 ranked) must fit");

__global__ void __launch_bounds__(WgmmaScanTraits::kThreads, 1)
    wgmma_tile_scan_kernel(const IndexerParams p, const TileScanPlan plan) {
  using T = WgmmaScanTraits;
  constexpr int kTiles = T::kTiles;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzled tiles need 1024-byte alignment.
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const uint32_t q_smem = smem_address(smem);
  const uint32_t ring_smem = q_smem + T::kTileBytes;
  float* list_values = reinterpret_cast<float*>(smem + T::kPipelineBytes);
  int32_t* list_ids = reinterpret_cast<int32_t*>(list_values + T::kRows * plan.list_pitch);

  const TileGeometry tile = tile_geometry(p, plan);
  if (!tile.valid) return;  // uniform over the CTA
  const bool fused = plan.block_max == nullptr;
  const int heads = static_cast<int>(p.heads);
  const int n_blocks = max(0, tile.scan_end - tile.scan_begin);
  const int last = n_blocks - 1;

  // This thread's rows (owned_row_geometry).
  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid % 128) / 32;
  const int quad = lane % 4;
  int own_row[kTiles];
  bool owner[kTiles];
  int32_t own_block[kTiles], own_cand_end[kTiles];
  owned_row_geometry(p, tile, heads, warpgroup, warp, lane, own_row, owner, own_block, own_cand_end);
  TopList list[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    list[t].init(list_values + own_row[t] * plan.list_pitch,
                 list_ids + own_row[t] * plan.list_pitch, plan.ranked);
  }

  if (n_blocks > 0) {
    // Q tile (rows past the tile are zero-filled: their maxima are ignored); joins group 0.
    const uint16_t* tile_q = p.qi + tile.first_query * p.heads * T::kDi;
    for (int i = tid; i < T::kRows * 16; i += T::kThreads) {
      const int row = i / 16, chunk = i % 16;
      const bool valid = row < tile.n_rows;
      cp_async_16(smem + swizzled_offset(row, chunk, T::kRows),
                  tile_q + (valid ? int64_t{row} * T::kDi + chunk * 8 : 0), valid);
    }
    // Ring index `index` -> stage index % kStages; indices past the last block copy nothing
    // (a predicated copy, no branch: its source stays clamped in bounds).
    // Thread tid copies chunk tid % 16 of keys tid / 16 + 16 j, j < kCopiesPerThread: the
    // same swizzle phase (key % 8) for every j, so only two bases stay live.
    const int copy_key = tid / 16, copy_chunk = tid % 16;
    const uint32_t copy_dst = ring_smem + swizzled_offset(copy_key, copy_chunk, T::kBlock);
    const int64_t copy_src = int64_t{copy_key} * p.ki.token_stride + copy_chunk * 8;
    const int64_t copy_step = 16 * p.ki.token_stride;  // 16 keys
    const auto load_block = [&](int index) {
      const bool real = index <= last;
      const uint16_t* src =
          block_pointer(p.ki, tile.seq, tile.scan_begin + min(index, last), 0) + copy_src;
      const uint32_t dst = copy_dst + (index % T::kStages) * T::kBlockBytes;
#pragma unroll
      for (int j = 0; j < T::kCopiesPerThread; ++j)
        cp_async_16_if(dst + j * 16 * 128, src + j * copy_step, real);
    };
    ring_prefetch<T::kPrefetch>(load_block);
    const auto arrive = [&](int i) { ring_arrive<T::kPrefetch>(i, load_block); };
    const auto issue = [&](float(&acc)[64], int index, int t) {
      const uint32_t a = q_smem + (warpgroup * kTiles + t) * 64 * 128;
      const uint32_t b = ring_smem + (min(index, last) % T::kStages) * T::kBlockBytes;
      fence_operands(acc);
      wgmma_fence();
      wgmma_m64n128k128_ss(acc, a, T::kRows, b, T::kBlock);
      wgmma_commit();
    };
    const auto reduce = [&](float(&acc)[64], int index, int t) {
      fence_operands(acc);
      float top = kNegInf, bottom = kNegInf;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        top = fmaxf(top, fmaxf(acc[n * 4 + 0], acc[n * 4 + 1]));
        bottom = fmaxf(bottom, fmaxf(acc[n * 4 + 2], acc[n * 4 + 3]));
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      bottom = fmaxf(bottom, __shfl_xor_sync(0xffffffffu, bottom, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      bottom = fmaxf(bottom, __shfl_xor_sync(0xffffffffu, bottom, 2));
      const int32_t block = tile.scan_begin + index;
      if (index > last || !owner[t] || block >= own_cand_end[t]) return;
      const float value = (quad & 1) ? bottom : top;
      if (fused)
        list[t].offer(value, block);
      else
        plan.block_max[(tile.first_query * p.heads + own_row[t]) * plan.block_max_stride + block] =
            value;
    };

    // Units of a chain run block by block, tile by tile; accumulator set u % 2. Straight-line
    // code (see the header): no MMA is in flight across the loops' back edges below.
    float acc[2][64];
    run_overlapped_chains<T::kChainBlocks, T::kTailBlocks, kTiles>(acc, n_blocks, arrive, issue, reduce);
    cp_async_wait<0>();  // nothing is copied past the last block; kept for clarity
  }

  if (fused) write_owned_selections(p, tile, heads, own_row, owner, own_block, list);
}

}  // namespace msa::cuda::indexer_detail
