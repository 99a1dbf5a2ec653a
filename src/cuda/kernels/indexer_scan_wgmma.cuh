// Index scan for prefill on Hopper warpgroup MMA (wgmma), for M3's shape: Di = 128, B = 128.
// Same contract, tile mapping and list update as tile_scan_kernel (indexer_scan.cuh); only
// the mainloop differs.
//
// Tile plan (256 threads = two warpgroups, 1 CTA per SM):
//   rows  = 128 (query, index head) rows of one sequence (M3: 32 queries x 4 heads);
//           warpgroup g owns rows [64g, 64g + 64), its A operand read from shared memory.
//   keys  = 128-key blocks streamed through a kStages-deep cp.async ring in the
//           128B-swizzled K-major layout (32 KB a block); all 256 threads issue the copies.
//   MMA   = per block and warpgroup, 8 x m64n128k16 (Di = 128); two accumulator sets, so
//           block j+1's MMAs run while block j is reduced (row max: 32 FMNMX + 2 SHFL per
//           thread, then one compare against the row's list threshold).
// Shared memory: Q 32 KB + kStages x 32 KB ring + lists 128 rows x pitch x 8 B (<= 31 KB)
//   + 1 KB alignment: <= 224 KB at kStages = 5. A stage is refilled kStages - 3 blocks
//   ahead, so a load never overwrites a block whose MMAs either warpgroup may still run.
// Measured on the H200 (2026-11-29): as a stand-alone scan (bench/prototypes/
//   wgmma_block_max.cu, every CTA reading the same keys) 465 TFLOP/s, 58% of peak; inside the
//   indexer (GPU tests pass) 128K prefill 34.9 ms = 252 TFLOP/s, SLOWER than the mma.sync
//   kernel's 27.9 ms (its 256-row tiles read each key block half as often). Opt-in with
//   MSA_INDEXER_WGMMA=1 until it wins: next steps are 256 rows per CTA (two m64 per
//   warpgroup), TMA loads from a producer warp, and removing ptxas's C7514 serialisation.
#pragma once
#include "cuda/kernels/indexer_scan.cuh"
#include "cuda/kernels/wgmma.cuh"

namespace msa::cuda::indexer_detail {

struct WgmmaScanTraits {
  static constexpr int kDi = 128;
  static constexpr int kBlock = 128;
  static constexpr int kThreads = 256;
  static constexpr int kRows = 128;
  static constexpr int kStages = 5;
  // Loads run kPrefetch blocks ahead: stage (i + 2) % 5 last held block i - 3, whose MMAs
  // both warpgroups waited for before the barrier of block i - 1.
  static constexpr int kPrefetch = kStages - 3;
  static constexpr int kTileBytes = kRows * kDi * 2;     // Q: 32 KB
  static constexpr int kBlockBytes = kBlock * kDi * 2;   // one key block: 32 KB
  static constexpr size_t kPipelineBytes = size_t{kTileBytes} + size_t{kStages} * kBlockBytes;
  static size_t smem_bytes(int list_pitch) {
    return 1024 + kPipelineBytes + size_t{kRows} * list_pitch * (sizeof(float) + sizeof(int32_t));
  }
};

__global__ void __launch_bounds__(WgmmaScanTraits::kThreads, 1)
    wgmma_tile_scan_kernel(const IndexerParams p, const TileScanPlan plan) {
  using T = WgmmaScanTraits;
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

  // This thread's rows in the accumulator layout, and the one row it owns after the reduce:
  // quad lane 0 owns the warp's row lane/4, quad lane 1 the row + 8.
  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128, warp = (tid % 128) / 32;
  const int top_row = warpgroup * 64 + warp * 16 + lane / 4;
  const int quad = lane % 4;
  const int own_row = top_row + 8 * (quad & 1);
  const bool owner = quad < 2 && own_row < tile.n_rows;
  const int64_t own_query = tile.first_query + own_row / heads;
  const int own_head = own_row % heads;
  const int32_t own_block = static_cast<int32_t>((tile.first_pos + own_row / heads) / p.block_size);
  const int32_t own_cand_end = own_block - p.local_blocks + 1;
  TopList list;
  list.init(list_values + own_row * plan.list_pitch, list_ids + own_row * plan.list_pitch,
            plan.ranked);

  // Q tile (rows past the tile are zero-filled: their maxima are ignored).
  const uint16_t* tile_q = p.qi + tile.first_query * p.heads * T::kDi;
  for (int i = tid; i < T::kRows * 16; i += T::kThreads) {
    const int row = i / 16, chunk = i % 16;
    const bool valid = row < tile.n_rows;
    cp_async_16(smem + swizzled_offset(row, chunk, T::kRows),
                tile_q + (valid ? int64_t{row} * T::kDi + chunk * 8 : 0), valid);
  }
  const auto load_block = [&](int i) {
    const uint16_t* src = block_pointer(p.ki, tile.seq, tile.scan_begin + i, 0);
    unsigned char* dst = smem + T::kTileBytes + (i % T::kStages) * T::kBlockBytes;
    for (int c = tid; c < T::kBlock * 16; c += T::kThreads) {
      const int key = c / 16, chunk = c % 16;
      cp_async_16(dst + swizzled_offset(key, chunk, T::kBlock),
                  src + key * p.ki.token_stride + chunk * 8);
    }
  };
  // One cp.async group per block (the first also holds Q), so wait_group counts blocks.
  int loaded = 0;  // blocks [0, loaded) have their copies issued
  for (int s = 0; s < T::kPrefetch; ++s) {
    if (loaded < n_blocks) load_block(loaded++);
    cp_async_commit();
  }
  // Makes block i's keys visible to both warpgroups (and issues the load kPrefetch ahead).
  const auto arrive = [&](int i) {
    if (loaded < n_blocks && loaded <= i + T::kPrefetch) load_block(loaded++);
    cp_async_commit();
    cp_async_wait<T::kPrefetch>();
    fence_async_shared();  // this thread's copies -> the async proxy, then the barrier
    __syncthreads();
  };
  const uint32_t a_base = q_smem + warpgroup * 64 * 128;
  const auto issue = [&](float(&acc)[64], int i) {
    const uint32_t b_base = ring_smem + (i % T::kStages) * T::kBlockBytes;
    fence_operands(acc);
    wgmma_fence();
    wgmma_m64n128k128_ss(acc, a_base, T::kRows, b_base, T::kBlock);
    wgmma_commit();
  };
  const auto reduce = [&](float(&acc)[64], int i, bool real) {
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
    const int32_t block = tile.scan_begin + i;
    if (!real || !owner || block >= own_cand_end) return;
    const float value = (quad & 1) ? bottom : top;
    if (fused)
      list.offer(value, block);
    else
      plan.block_max[(tile.first_query * p.heads + own_row) * plan.block_max_stride + block] = value;
  };

  if (n_blocks > 0) {
    // Branch-free pairs (ptxas serialises wgmma when accumulators are live across
    // divergent paths): an odd count re-reads the last block once and drops the result.
    float acc_even[64], acc_odd[64];
    const int last = n_blocks - 1;
    arrive(0);
    issue(acc_even, 0);
    for (int i = 0; i < n_blocks; i += 2) {
      arrive(min(i + 1, last));
      issue(acc_odd, min(i + 1, last));
      wgmma_wait<1>();
      reduce(acc_even, i, true);
      arrive(min(i + 2, last));
      issue(acc_even, min(i + 2, last));
      wgmma_wait<1>();
      reduce(acc_odd, i + 1, i + 1 <= last);
    }
    wgmma_wait<0>();
  }

  if (!fused || !owner) return;
  int32_t* out = p.topk_out + (own_head * p.batch.total_q + own_query) * p.topk;
  for (int slot = 0; slot < p.topk; ++slot)
    out[slot] = selection_slot(slot, p, own_block, list.ids, list.count);
}

}  // namespace msa::cuda::indexer_detail
