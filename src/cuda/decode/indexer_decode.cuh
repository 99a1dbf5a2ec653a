// Index scan for decode / multi-token prediction (1..16 queries per request): block maxima
// of a request's rows over a chunk of its index-key blocks, written to a workspace
// [total_q * Hi, max_blocks] f32 that decode_select_kernel ranks (split-K over blocks).
//
// Tile plan (per CTA, 4 warps = 128 threads): one request, up to kRows = 32 of its
// (query, head) rows, one chunk of blocks. The scan is bandwidth-bound (docs/msa.md §6.4), so
// the MMA is transposed to waste little on few rows: S^T = K Q^T, keys in the M dimension
// (m16 tiles), rows in N (n8 tiles; one n-tile already holds a single query's 4 heads).
// Q^T fragments (4 n-tiles x Di/16 k-steps x 2 regs = 64 registers) stay in registers.
// Warp w takes keys [w B/4, (w+1) B/4) of each block (1 or 2 m-tiles); its per-row max
// goes through shared memory to a cross-warp max, done after the NEXT block's barrier
// (partials double-buffered by block parity), so a block costs one __syncthreads.
// Expected bottleneck: HBM / L2 bandwidth of the index-key stream.
// Launched with PDL (pdl.cuh): every CTA waits for the previous kernel before reading qi,
// then releases decode_select_kernel's launch (it waits for this grid's completion).
//
// Key formats (one kernel body, `kFormat`; launch.h KeyFormat, msa/quantized_index_keys.h):
// - bf16: keys via ldmatrix, bf16 MMA. Ring: 3 stages x 128 x (Di + 8) bf16 = 102 KB: 2
//   CTAs per SM keep 4 blocks (128 KB) in flight, enough to cover HBM latency. The per-block
//   work (copy, MMAs, maxima): indexer_decode_bf16.cuh.
// - fp8 (e4m3 codes + one f32 scale per token) and fp4 (e2m1 pairs + one e4m3 scale per 16
//   channels): the codes and scales are copied to shared memory as stored (16 KB + 512 B /
//   8 KB + 1 KB per 128-key block at Di = 128) and dequantized in registers into f16 MMA
//   operands (key_dequant.cuh): fp8 codes convert exactly (cvt.rn.f16x2.e4m3x2) and the
//   token scale multiplies the f32 scores before the max; fp4 values times their group
//   scale are exact in f16. Q^T is then f16, scaled per row by a power of two that the
//   cross-warp max undoes. More stages (5 / 8) keep about the same bytes in flight.
//   Channel order: the dot product is a sum over channels, so any bijection of the k index
//   works if A and B use the same one. Quad q of a warp (lane % 4) takes the contiguous
//   chunks [q C, (q + 1) C) of 16 channels of each key row (C = Di / 64), and its k-step
//   ks reads channels 16 (q C + ks / 4) + 4 (ks % 4) + {0, 1} (A's a0/a1, B's b0) and
//   + {2, 3} (a2/a3, b1) (fp4: {0, 2} and {1, 3}, fp4_permute_q): 16- or 8-byte shared
//   loads, conflict-free with row pitches Di + 16 (fp8, Di = 128) or the plain row size
//   (otherwise). The per-block work: indexer_decode_quantized.cuh.
//
// Budget of the fp8 / fp4 scans (M3: Di 128, B 128; decode batch 1, Q 1: 4 rows, one
// active n-tile). HBM: 4.6 TB/s / 132 SMs / 1.98 GHz = 17.6 B per SM-clock, one 16-byte
// granule of index stream per 0.91 clock. An SM issues 4 warp-instructions per clock (so
// 3.6 per granule at full bandwidth), ALU-pipe ones (LOP3, SHF, PRMT, FMNMX: 16 lanes per
// SMSP) 2 per clock (1.8 per granule). With only 8 warps per SM, the latency of a block
// iteration matters as much: the MMAs run as 4 independent chains of 4 HMMAs per warp and
// no global load is waited on in the loop (page ids reach a shared ring by cp.async
// 2 kStages - 2 blocks ahead). Counted in the sm_90a SASS (nvcc 13.0, cuobjdump), per warp
// (32 keys = 2 m-tiles) and 128-key block: fp4 (9216 B per block) ~470 warp-instructions
// (3.2 per granule; ALU pipe 0.85, 1.35 if F2FP issues there), fp8 (16896 B) ~306 (1.2
// per granule). Where F2FP issues (ALU or a slower conversion pipe) is not documented: as
// the fp4 scan stays far from HBM, that is the next suspect (72 cvt per warp and block).
//
// Budget of the bf16 scan (M3, decode batch 1, Q 1; indexer_decode_bf16.cuh, the quantized
// scans' recipe). With 8 warps per SM each block's latency, not the issue rate, bounds it:
// Nsight Compute found issue slots 25% busy and a warp CPI of 5.7 for a scan whose block cost
// each warp ~670 instructions, 60% integer/address work (a runtime-count copy loop with a
// division and a 64-bit multiply per granule, block_pointer per block, all 4 n-tiles' MMAs
// predicated: 64 HMMA issued, 16 needed). Hence compile-time tile counts through
// with_tile_counts (shared with fp8 / fp4), a fully unrolled copy from one per-thread pointer
// with immediate offsets, and the request's part of the block address hoisted. Counted in
// the sm_90a SASS (nvcc 13.0, cuobjdump), one steady-state 128-key block per warp, Q = 1: 168
// warp-instructions (192 in warp 0, which also combines the previous block's 4 maxima) with
// contiguous keys (token stride Di: M3's paged caches), 191 (215) strided, against 659 (693)
// for that loop; 16 HMMA, 16 LDSM, 16 LDGSTS. 148 registers, no spills (shared memory, not
// registers, holds it at 2 CTAs per SM). Block maxima do not depend on the copy recipe: same
// MMA operands and accumulation order, same fmaxf expressions in the same order.
// What binds (Nsight Compute): at 128K two serial round trips through the ring (~4 blocks per
// CTA), not instructions; at 1M DRAM bandwidth, 79-81% of peak with bf16 keys, 61-64% with
// fp8; the fp4 scan, at 39-40%, is bound by its dequantisation (3 CTAs per SM, which its
// 75 KB of shared memory allows, were measured slower). An L2 prefetch
// (cp.async.bulk.prefetch) of the blocks 2-8 beyond the ring made every size slower: not the
// way to more bytes in flight (bench/results/history.md).
#pragma once
#include "cuda/decode/indexer_decode_bf16.cuh"
#include "cuda/decode/indexer_decode_quantized.cuh"
#include "cuda/decode/indexer_decode_tiles.cuh"
#include "cuda/decode/key_dequant.cuh"
#include "cuda/common/pdl.cuh"
#include "cuda/indexer/topk_list.cuh"

namespace msa::cuda::indexer_detail {

template <int kDi, KeyFormat kFormat>
struct DecodeScanTraits {
  static_assert(kDi % 16 == 0 && kDi <= 128, "index head dim: multiple of 16, at most 128");
  static constexpr bool kQuantized = kFormat != KeyFormat::bf16;
  static_assert(!kQuantized || kDi % 64 == 0, "fp8 / fp4 index keys: Di 64 or 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 32;  // rows per CTA = N extent: 4 n8 tiles
  static constexpr int kNTiles = kRows / 8;
  static constexpr int kMaxBlock = 128;
  static constexpr int kMaxMTiles = kMaxBlock / kWarps / 16;  // key m-tiles per warp
  static constexpr int kKSteps = kDi / 16;
  static constexpr int kKeyPitch = kDi + 8;  // bf16: elements per key row (+16 B: conflict-free ldmatrix)
  // Bytes of one key's codes (global memory) and of its row in shared memory.
  static constexpr int kCodeBytes =
      kFormat == KeyFormat::bf16 ? 2 * kDi : kFormat == KeyFormat::fp8 ? kDi : kDi / 2;
  static constexpr int kRowPitchBytes = kFormat == KeyFormat::bf16 ? 2 * kKeyPitch
                                        : kFormat == KeyFormat::fp8 && kDi == 128 ? kCodeBytes + 16
                                                                                  : kCodeBytes;
  static constexpr int kScaleBytes =  // per key
      kFormat == KeyFormat::fp8 ? 4 : kFormat == KeyFormat::fp4 ? kDi / 16 : 0;
  static constexpr int kChunks = kDi / 64;  // quantized: 16-channel chunks per quad and key
  static constexpr int kStages = kFormat == KeyFormat::bf16 ? 3 : kFormat == KeyFormat::fp8 ? 5 : 8;
  static constexpr int kStageBytes = kMaxBlock * (kRowPitchBytes + kScaleBytes);
  static_assert(kStageBytes % 16 == 0 && kCodeBytes % 16 == 0, "16-byte cp.async granules");
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageBytes;
  static constexpr size_t kPartialBytes = 2 * kWarps * kRows * sizeof(float);
  // fp8 / fp4: page ids of blocks i .. i + kPageAhead, copied kPageAhead blocks ahead
  // (cp.async with the block loads, so that no warp waits on a page-table load).
  static constexpr int kPageRing = 32;
  static constexpr int kPageAhead = 2 * kStages - 2;
  static_assert(kPageAhead + 1 < kPageRing, "page ring");
  static constexpr size_t kSmemBytes =
      kPipelineBytes + kPartialBytes + kRows * sizeof(float) + kPageRing * sizeof(int32_t);
};

struct DecodeScanPlan {
  int row_tiles = 1;     // CTAs per (request, chunk) along rows
  int chunks = 1;        // CTAs per request along blocks
  int chunk_blocks = 1;  // blocks per chunk
  float* block_max = nullptr;  // [total_q * Hi, block_max_stride]
  int64_t block_max_stride = 0;
};

__device__ __forceinline__ float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_high(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// grid = batch * chunks * row_tiles work items, row tile fastest (CTAs that read the same
// keys run together and share them through L2).
template <int kDi, KeyFormat kFormat>
__global__ void __launch_bounds__(DecodeScanTraits<kDi, kFormat>::kThreads)
    decode_scan_kernel(const IndexerLaunch p, const DecodeScanPlan plan) {
  using T = DecodeScanTraits<kDi, kFormat>;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* ring = smem;  // kStages x kStageBytes: key rows (pitched), then scales
  float* partial = reinterpret_cast<float*>(smem + T::kPipelineBytes);  // [2][kWarps][kRows]
  float* row_unscale = reinterpret_cast<float*>(smem + T::kPipelineBytes + T::kPartialBytes);
  int32_t* page_ring = reinterpret_cast<int32_t*>(row_unscale + T::kRows);  // fp8 / fp4
  pdl_wait();
  pdl_launch_dependents();

  int64_t item = blockIdx.x;
  const int row_tile = static_cast<int>(item % plan.row_tiles);
  item /= plan.row_tiles;
  const int chunk = static_cast<int>(item % plan.chunks);
  const int64_t seq = item / plan.chunks;
  const int64_t q_begin = p.batch.q_start[seq];
  const int64_t rows = (p.batch.q_start[seq + 1] - q_begin) * p.heads;
  const int row0 = row_tile * T::kRows;
  if (row0 >= rows) return;
  const int n_rows = static_cast<int>(min64(T::kRows, rows - row0));
  const int block_size = p.block_size;
  // The request's last query sits at pos k_len - 1: its candidates cover every row's.
  const int32_t last_own_block = static_cast<int32_t>((p.batch.k_len[seq] - 1) / block_size);
  const int32_t scan_begin = p.init_blocks + chunk * plan.chunk_blocks;
  const int32_t scan_end = min(last_own_block - p.local_blocks + 1, scan_begin + plan.chunk_blocks);
  if (scan_begin >= scan_end) return;  // uniform: before any barrier
  const int n_blocks = scan_end - scan_begin;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int n_tiles = (n_rows + 7) / 8;  // active n8 tiles, CTA-uniform
  const int keys_per_warp = block_size / T::kWarps;
  const int m_tiles = keys_per_warp / 16;

  // Q^T as the B operand (col-major K x N = Di x rows): b0 = row group at k = 2 * quad,
  // b1 = the same row at k + 8 (bf16: k-step ks = channels 16 ks .. 16 ks + 15; quantized
  // formats: the channel order of the header comment, f16 scaled per row).
  uint32_t qb[T::kNTiles][T::kKSteps][2];
  const uint16_t* tile_q = p.qi + (q_begin * p.heads + row0) * kDi;
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt) {
    const int row = nt * 8 + group;
    const uint32_t* q_row = reinterpret_cast<const uint32_t*>(tile_q + int64_t{row} * kDi);
    if constexpr (!T::kQuantized) {
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks) {
        qb[nt][ks][0] = row < n_rows ? q_row[ks * 8 + quad] : 0u;
        qb[nt][ks][1] = row < n_rows ? q_row[ks * 8 + 4 + quad] : 0u;
      }
    } else {
      const uint32_t* quad_q = q_row + 8 * quad * T::kChunks;  // the quad's chunks
      float amax = 0.0f;
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t pair = row < n_rows ? quad_q[8 * (ks / 4) + 2 * (ks % 4) + h] : 0u;
          qb[nt][ks][h] = pair;
          amax = fmaxf(amax, fmaxf(fabsf(bf16_low(pair)), fabsf(bf16_high(pair))));
        }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the row's 4 quads
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float factor = f16_row_scale(amax);
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          qb[nt][ks][h] = pack_f16(bf16_low(qb[nt][ks][h]) * factor,
                                   bf16_high(qb[nt][ks][h]) * factor);
      if (quad == 0) row_unscale[row] = 1.0f / factor;  // a power of two: exact
    }
  }
  if constexpr (kFormat == KeyFormat::fp4) fp4_permute_q(qb);

  // bf16: block i's first key comes from the page table (a global load), fetched one block
  // ahead of its cp.async issue so that the issue never waits on it.
  const Bf16BlockSource block_source(p.ki, seq, scan_begin, n_blocks);
  // bf16 keys: page ids checked as the layout asks (checked_page), reported after the loop.
  // fp8 / fp4 keys trust them: DecodePlan, the one caller that asks, takes bf16 index keys
  // only, and the check measured +1-2% on the fp4 scan at 1M batch 8 (bench/results/h200.md).
  PageFaultNote page_note;
  using Source = decltype(block_source(0, page_note));
  const bool full_block = block_size == T::kMaxBlock;
  const bool contiguous_keys = p.ki.token_stride == kDi;  // M3's caches: immediate offsets
  // Block i -> its ring stage. src: bf16, the block's first key; fp8 / fp4, its page (codes
  // and scales of page p sit at p * B * bytes per key).
  const auto load_block = [&](int i, auto src) {
    unsigned char* dst = ring + (i % T::kStages) * T::kStageBytes;
    if constexpr (T::kQuantized) {
      quantized_load_block<T>(dst, p.ki_quantized.codes, p.ki_quantized.scales, src, block_size);
    } else {
      if (contiguous_keys)
        bf16_load_block<T>(dst, src, std::integral_constant<int64_t, kDi>{}, full_block);
      else
        bf16_load_block<T>(dst, src, p.ki.token_stride, full_block);
    }
  };
  // Cross-warp max of block i's partials -> workspace (threads < n_rows, one row each).
  const auto combine = [&](int i) {
    if (threadIdx.x >= n_rows) return;
    const float* part = partial + (i & 1) * T::kWarps * T::kRows;
    float value = part[threadIdx.x];
#pragma unroll
    for (int w = 1; w < T::kWarps; ++w) value = fmaxf(value, part[w * T::kRows + threadIdx.x]);
    if constexpr (T::kQuantized) value *= row_unscale[threadIdx.x];
    plan.block_max[(q_begin * p.heads + row0 + threadIdx.x) * plan.block_max_stride + scan_begin +
                   i] = value;
  };

  // bf16: ldmatrix.x4 over a 16-key x 16-dim tile as the A operand (row-major keys x dims):
  // lane l addresses key l % 8 + ((l / 8) % 2) * 8, dims (l / 16) * 8 -> a0..a3.
  const int lane_offset = (lane % 8 + ((lane / 8) % 2) * 8) * T::kKeyPitch + (lane / 16) * 8;
  Source next_source{};  // bf16: block i + kStages - 1's
  // fp8 / fp4: block i's page id sits in page_ring[i % kPageRing]. The first kPageAhead
  // come by plain loads; block i + kPageAhead's is copied in iteration i, in the commit
  // group that cp_async_wait completes in iteration i + kStages - 1, the iteration that
  // loads it (kPageAhead = 2 kStages - 2); its slot was last read kPageRing - kStages
  // iterations before.
  const int32_t* pages =
      T::kQuantized ? p.ki.page_table + seq * p.ki.page_table_stride + scan_begin : nullptr;
  if constexpr (T::kQuantized) {
    if (threadIdx.x < min(n_blocks, T::kPageAhead)) page_ring[threadIdx.x] = pages[threadIdx.x];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < T::kStages - 1; ++i) {
      if (i < n_blocks) load_block(i, page_ring[i]);
      cp_async_commit();
    }
  } else {
    Source source[T::kStages];  // all page-table loads of the prologue at once
#pragma unroll
    for (int i = 0; i < T::kStages; ++i) source[i] = block_source(i, page_note);
#pragma unroll
    for (int i = 0; i < T::kStages - 1; ++i) {
      if (i < n_blocks) load_block(i, source[i]);
      cp_async_commit();
    }
    next_source = source[T::kStages - 1];
  }
  for (int i = 0; i < n_blocks; ++i) {
    cp_async_wait<T::kStages - 2>();
    // Block i landed; every warp finished block i - 1 (its stage is reloaded below) and
    // wrote its partials, which combine(i - 1) reads; partials of block i - 2 (same
    // parity as i, overwritten below) were combined before this barrier. (The first
    // barrier also publishes row_unscale.)
    __syncthreads();
    if (i > 0) combine(i - 1);
    if constexpr (T::kQuantized) {
      if (i + T::kStages - 1 < n_blocks)
        load_block(i + T::kStages - 1, page_ring[(i + T::kStages - 1) % T::kPageRing]);
      if (threadIdx.x == 0 && i + T::kPageAhead < n_blocks)
        cp_async_4(page_ring + (i + T::kPageAhead) % T::kPageRing, pages + i + T::kPageAhead);
      cp_async_commit();
    } else {
      if (i + T::kStages - 1 < n_blocks) load_block(i + T::kStages - 1, next_source);
      cp_async_commit();
      next_source = block_source(i + T::kStages, page_note);  // consumed next iteration
    }

    const unsigned char* stage = ring + (i % T::kStages) * T::kStageBytes;
    float* part = partial + (i & 1) * T::kWarps * T::kRows + warp * T::kRows;
    with_tile_counts<T>(m_tiles, n_tiles, [&](auto kMT, auto kNT) {
      constexpr int kMTiles = decltype(kMT)::value, kNTiles = decltype(kNT)::value;
      if constexpr (T::kQuantized)
        quantized_block_partials<T, kFormat, kMTiles, kNTiles>(stage, qb, warp * keys_per_warp,
                                                               group, quad, n_tiles, part);
      else
        bf16_block_partials<T, kMTiles, kNTiles>(
            reinterpret_cast<const uint16_t*>(stage) + warp * keys_per_warp * T::kKeyPitch +
                lane_offset,
            qb, n_tiles, group, quad, part);
    });
    // The next block's barrier (or the one after the loop) publishes the partials.
  }
  __syncthreads();  // the last block's partials
  combine(n_blocks - 1);
  report_page_fault(p.ki, seq, page_note);
}

}  // namespace msa::cuda::indexer_detail
