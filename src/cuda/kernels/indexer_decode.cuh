// Index scan for decode / multi-token prediction (1..16 queries per request): block maxima
// of a request's rows over a chunk of its index-key blocks, written to a workspace
// [total_q * Hi, max_blocks] f32 that select_rows_kernel ranks (split-K over blocks).
//
// Tile plan (per CTA, 4 warps = 128 threads): one request, up to kRows = 32 of its
// (query, head) rows, one chunk of blocks. The scan is bandwidth-bound (msa-spec §6), so
// the MMA is transposed to waste little on few rows: S^T = K Q^T, keys in the M dimension
// (m16 tiles), rows in N (n8 tiles; one n-tile already holds a single query's 4 heads).
// Q^T fragments (4 n-tiles x Di/16 k-steps x 2 regs = 64 registers) stay in registers.
// Warp w takes keys [w B/4, (w+1) B/4) of each block (1 or 2 m-tiles); its per-row max
// goes through shared memory to a cross-warp max, done after the NEXT block's barrier
// (partials double-buffered by block parity), so a block costs one __syncthreads.
// Shared memory: kStages x 128 x (Di + 8) bf16 = 102 KB of K ring + 1 KB of partials:
// 2 CTAs per SM keep 4 blocks (128 KB) in flight, enough to cover HBM latency.
// Expected bottleneck: HBM / L2 bandwidth of the index-key stream.
// Launched with PDL (pdl.cuh): every CTA waits for the previous kernel before reading qi,
// then releases decode_select_kernel's launch (it waits for this grid's completion).
#pragma once
#include "cuda/kernels/pdl.cuh"
#include "cuda/kernels/topk_list.cuh"

namespace msa::cuda::indexer_detail {

template <int kDi>
struct DecodeScanTraits {
  static_assert(kDi % 16 == 0 && kDi <= 128, "index head dim: multiple of 16, at most 128");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 32;  // rows per CTA = N extent: 4 n8 tiles
  static constexpr int kNTiles = kRows / 8;
  static constexpr int kMaxBlock = 128;
  static constexpr int kMaxMTiles = kMaxBlock / kWarps / 16;  // key m-tiles per warp
  static constexpr int kKSteps = kDi / 16;
  static constexpr int kKeyPitch = kDi + 8;  // +16 B: conflict-free ldmatrix
  static constexpr int kStages = 3;
  static constexpr int kStageElems = kMaxBlock * kKeyPitch;
  static constexpr size_t kPipelineBytes = size_t{kStages} * kStageElems * sizeof(uint16_t);
  static constexpr size_t kSmemBytes = kPipelineBytes + 2 * kWarps * kRows * sizeof(float);
};

struct DecodeScanPlan {
  int row_tiles = 1;     // CTAs per (request, chunk) along rows
  int chunks = 1;        // CTAs per request along blocks
  int chunk_blocks = 1;  // blocks per chunk
  float* block_max = nullptr;  // [total_q * Hi, block_max_stride]
  int64_t block_max_stride = 0;
};

// grid = batch * chunks * row_tiles work items, row tile fastest (CTAs that read the same
// keys run together and share them through L2).
template <int kDi>
__global__ void __launch_bounds__(DecodeScanTraits<kDi>::kThreads)
    decode_scan_kernel(const IndexerParams p, const DecodeScanPlan plan) {
  using T = DecodeScanTraits<kDi>;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* partial = reinterpret_cast<float*>(smem + T::kPipelineBytes);  // [2][kWarps][kRows]
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
  // b1 = the same row at k + 8.
  uint32_t qb[T::kNTiles][T::kKSteps][2];
  const uint16_t* tile_q = p.qi + (q_begin * p.heads + row0) * kDi;
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt) {
    const int row = nt * 8 + group;
    const uint32_t* q_row = reinterpret_cast<const uint32_t*>(tile_q + int64_t{row} * kDi);
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      qb[nt][ks][0] = row < n_rows ? q_row[ks * 8 + quad] : 0u;
      qb[nt][ks][1] = row < n_rows ? q_row[ks * 8 + 4 + quad] : 0u;
    }
  }

  // Block i's source comes from the page table (a global load): it is fetched one block
  // ahead of its cp.async issue, so that the issue never waits on it.
  const auto block_source = [&](int i) {
    return i < n_blocks ? block_pointer(p.ki, seq, scan_begin + i, 0) : nullptr;
  };
  const auto load_block = [&](int i, const uint16_t* src) {
    uint16_t* dst = ring + (i % T::kStages) * T::kStageElems;
    constexpr int kChunksPerKey = kDi / 8;
    for (int c = threadIdx.x; c < block_size * kChunksPerKey; c += T::kThreads) {
      const int key = c / kChunksPerKey, part = c % kChunksPerKey;
      cp_async_16(dst + key * T::kKeyPitch + part * 8, src + key * p.ki.token_stride + part * 8);
    }
  };
  // Cross-warp max of block i's partials -> workspace (threads < n_rows, one row each).
  const auto combine = [&](int i) {
    if (threadIdx.x >= n_rows) return;
    const float* part = partial + (i & 1) * T::kWarps * T::kRows;
    float value = part[threadIdx.x];
#pragma unroll
    for (int w = 1; w < T::kWarps; ++w) value = fmaxf(value, part[w * T::kRows + threadIdx.x]);
    plan.block_max[(q_begin * p.heads + row0 + threadIdx.x) * plan.block_max_stride + scan_begin +
                   i] = value;
  };

  // ldmatrix.x4 over a 16-key x 16-dim tile as the A operand (row-major keys x dims):
  // lane l addresses key l % 8 + ((l / 8) % 2) * 8, dims (l / 16) * 8 -> a0..a3.
  const int lane_offset = (lane % 8 + ((lane / 8) % 2) * 8) * T::kKeyPitch + (lane / 16) * 8;
  const uint16_t* source[T::kStages];  // all page-table loads of the prologue at once
#pragma unroll
  for (int i = 0; i < T::kStages; ++i) source[i] = block_source(i);
#pragma unroll
  for (int i = 0; i < T::kStages - 1; ++i) {
    if (i < n_blocks) load_block(i, source[i]);
    cp_async_commit();
  }
  const uint16_t* next_source = source[T::kStages - 1];  // block i + kStages - 1's
  for (int i = 0; i < n_blocks; ++i) {
    cp_async_wait<T::kStages - 2>();
    // Block i landed; every warp finished block i - 1 (its stage is reloaded below) and
    // wrote its partials, which combine(i - 1) reads; partials of block i - 2 (same
    // parity as i, overwritten below) were combined before this barrier.
    __syncthreads();
    if (i > 0) combine(i - 1);
    if (i + T::kStages - 1 < n_blocks) load_block(i + T::kStages - 1, next_source);
    cp_async_commit();
    next_source = block_source(i + T::kStages);  // consumed next iteration

    const uint16_t* keys = ring + (i % T::kStages) * T::kStageElems + warp * keys_per_warp * T::kKeyPitch;
    float acc[T::kMaxMTiles][T::kNTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks)
#pragma unroll
      for (int mt = 0; mt < T::kMaxMTiles; ++mt) {
        if (mt >= m_tiles) continue;
        uint32_t a[4];
        ldmatrix_x4(a, keys + mt * 16 * T::kKeyPitch + lane_offset + ks * 16);
#pragma unroll
        for (int nt = 0; nt < T::kNTiles; ++nt)
          if (nt < n_tiles) mma_bf16_16816(acc[mt][nt], a, qb[nt][ks]);
      }
    // Accumulator (mt, nt): c0/c1 = key group, rows 2 quad / +1; c2/c3 = key group + 8.
    float* part = partial + (i & 1) * T::kWarps * T::kRows + warp * T::kRows;
#pragma unroll
    for (int nt = 0; nt < T::kNTiles; ++nt) {
      if (nt >= n_tiles) continue;
      float even = fmaxf(acc[0][nt][0], acc[0][nt][2]), odd = fmaxf(acc[0][nt][1], acc[0][nt][3]);
#pragma unroll
      for (int mt = 1; mt < T::kMaxMTiles; ++mt)
        if (mt < m_tiles) {
          even = fmaxf(even, fmaxf(acc[mt][nt][0], acc[mt][nt][2]));
          odd = fmaxf(odd, fmaxf(acc[mt][nt][1], acc[mt][nt][3]));
        }
      for (int offset = 4; offset < 32; offset *= 2) {  // over the 8 key groups
        even = fmaxf(even, __shfl_xor_sync(0xffffffffu, even, offset));
        odd = fmaxf(odd, __shfl_xor_sync(0xffffffffu, odd, offset));
      }
      if (group == 0) {
        part[nt * 8 + 2 * quad] = even;
        part[nt * 8 + 2 * quad + 1] = odd;
      }
    }
  }
  __syncthreads();  // the last block's partials
  combine(n_blocks - 1);
}

}  // namespace msa::cuda::indexer_detail
