// Index scan for prefill on Hopper warpgroup MMA, M3's shape Di = B = 128:
// producer_tile_scan_kernel<kFp8>. The tile mapping, causal key ranges, fused and split modes
// and output rows are those of tile_scan_kernel (indexer_scan.cuh); the row helpers and the
// C7514 note: indexer_scan_wgmma.cuh.
//   kFp8 = false: bf16 qi rows and keys as given (the default scan without lse_out): 8 x
//     m64n128k16 bf16 per unit, 64 KB of Q, a 4-stage ring of 32 KB blocks, chains of 2
//     blocks, no scales. Faster at every context than a bf16 wgmma scan with all 256
//     threads copying, a CTA barrier per block and sorted lists, with bitwise equal
//     selection rows (bench/results/history.md).
//   kFp8 = true (MsaParams::index_compute fp8): what follows.
//
// Scores (msa/ops.h IndexCompute): qi rows and keys are e4m3 codes with one f32 scale each
// (quantized by the indexer's launcher into its workspace, or an fp8 cache as stored);
// block max = q_scale * max over the block's keys t of (k_scale[t] * sum_d qcode[d] kcode[t][d]).
// k_scale differs per key, so it is applied before the max; q_scale >= 0 is one factor of
// the whole row, applied after (max(c x) = c max(x) for c >= 0; with c = 0 the row's codes are
// all 0 and every value is 0).
//
// Warpgroups (384 threads, 1 CTA per SM):
//   0, 1 consume: kRows = 256 (query, index head) rows of one sequence; warpgroup g owns the
//        two 64-row tiles [64 (2g + t), +64), A (Q codes) read from shared memory. A unit =
//        one row tile against one 128-key block: 4 x m64n128k32 e4m3 into one of two
//        accumulator sets; unit u + 1's MMAs run while unit u is reduced (16 x (2 FMUL by the
//        key scales, FMNMX), a max tree, 2 quad shuffles, x q_scale, one list compare).
//   2    produces: every key copy (cp.async: 16 B codes into the 128B-swizzled K-major ring,
//        128 e4m3 = one swizzle row per key; 4 B scales, as a varlen sequence's first token
//        may sit at any 4-byte offset), the page-table read one block ahead, and each stage's
//        full barrier. setmaxnreg moves registers from it (40) to the consumers (232).
//   So the consumers issue no copies, no page-table loads and no CTA barrier, the two
//   consumer warpgroups are not in lockstep (one reduces while the other's MMAs run), and a
//   warp stalled in a list insert holds up its own warpgroup only.
//
// Ring protocol (block j = 0.. of the tile's scan in stage j % kStages; mbarrier.cuh):
//   full[s]  (count 128): each producer thread's noinc arrive fires when its copies landed;
//            consumers wait for parity (j / kStages) & 1.
//   empty[s] (count 8): lane 0 of each consumer warp arrives after the warp's last reduce of
//            block j (its wgmma reads retired at wait_group, its scale loads done). The
//            producer waits for parity (j / kStages - 1) & 1 before copying block j >= kStages.
//   __syncwarp before that arrive: the shuffles of the reduce are no memory ordering, so
//            without it the other lanes' scale loads were not ordered before lane 0's
//            release (racecheck: the producer's next scale copy against those loads).
//   Deadlock-free: consumers wait for blocks [4c, 4c + 4) at chain c's start having released
//   every block < 4c; the producer needs only releases of blocks <= 4c + 3 - kStages < 4c.
//
// Consumer chains (ptxas C7514, nvcc 13.0: an MMA in flight across a loop's back edge
//   serialises every wgmma; see indexer_scan_wgmma.cuh): chains of kChainBlocks = 4 blocks
//   as straight-line code, overlapped inside (wait_group 1), ending in wait_group 0; a tail
//   of fewer blocks runs 1-block chains. A chain waits for all its blocks' full barriers at
//   its start (no MMA in flight there: the spin loops are back edges) and makes the copies
//   visible to the tensor cores with one proxy fence (reader side, after the acquire).
//
// Key scales of a stage are stored permuted and XOR-swizzled (scale_slot): a reduce loads
//   them with 8 conflict-free LDS.128. Lists are TopSets (topk_list.cuh: unsorted, worst
//   entry tracked, an insert rescans in batches of 8 independent loads), each sorted once at
//   the end: the rows are exactly those of a sorted TopList.
//
// Shared memory: Q 256 x 128 B (32 KB) + kStages x (16 KB + 512 B) ring + lists 256 x pitch
//   x 8 B + 1 KB alignment reserve, which holds the 16 mbarriers (128 B): before the aligned
//   region when its pad is >= 128 B, else after the lists (the reserve's other end then has
//   >= 897 B free). kStages 8: 165 KB + 2 KB x pitch <= 227 KB for every pitch <= 31, i.e.
//   every topk <= 32 (M3: pitch 15 -> 195 KB).
//
// Budget per 128-key block (SASS, nvcc 13.0): the tensor cores need 16 x m64n128k32 = 1024
//   clocks per SM at the fp8 rate; a consumer warp issues ~365 instructions on the common
//   path (262 FMUL/FMNMX, 16 LDS.128, 8 SHFL, 8 QGMMA, ~80 other), ~730 per SM
//   sub-partition (+ ~30 of its producer warp). An fp8 scan with all 256 threads copying, a
//   CTA barrier per block and sorted-list inserts issues ~1030, and its epilogue binds (1M:
//   ~1.9 us per block per SM). This kernel is faster at every context, with rows bitwise equal
//   to that scan's (bench/results/history.md).
//
// Checked: rows within tolerance of the fp8 CPU reference (tests/test_cuda_indexer_fp8.cpp);
//   compute-sanitizer memcheck, synccheck and racecheck clean on varlen split tiles and paged
//   bf16 / fp8 caches (racecheck found the hazard that the __syncwarp above fixes).
#pragma once
#include <type_traits>

#include "cuda/indexer/indexer_scan.cuh"
#include "cuda/indexer/indexer_scan_wgmma.cuh"  // write_owned_selections
#include "cuda/common/mbarrier.cuh"
#include "cuda/common/wgmma.cuh"

namespace msa::cuda::indexer_detail {

// The fp8 operands of the scan (device pointers; launcher workspace or an fp8 cache).
// Key token index of block j of sequence b: paged page_table[b, j] * B + slot, varlen
// seq_token_start[b] + j * B + slot (the addressing of IndexerLaunch::ki, in tokens).
struct Fp8ScanOperands {
  const uint8_t* q_codes = nullptr;  // e4m3 [total_q * heads, 128]
  const float* q_scales = nullptr;   // f32 [total_q * heads]
  const uint8_t* k_codes = nullptr;  // e4m3 [key tokens, 128]
  const float* k_scales = nullptr;   // f32 [key tokens]
};

// kFp8: e4m3 keys and Q with f32 scales (index_compute fp8); otherwise bf16 keys and Q as
// given.
template <bool kFp8>
struct ProducerScanTraits {
  static constexpr int kDi = 128;
  static constexpr int kBlock = 128;
  static constexpr int kConsumerThreads = 256;                 // warpgroups 0 and 1
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kProducerThreads = 128;                 // warpgroup 2
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  // setmaxnreg: 384 threads start at 168 registers (3 warps per sub-partition share its 64 KB);
  // the producer gives its share to the consumers: 2 x 232 + 40 = 504 <= 512 per lane.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kTiles = 2;                             // 64-row tiles per warpgroup
  static constexpr int kRows = 128 * kTiles;
  // bf16: Q 64 KB + 4 x 32 KB leaves room for the lists of pitch <= 17 (M3: 15).
  static constexpr int kStages = kFp8 ? 8 : 4;
  static constexpr int kChainBlocks = kFp8 ? 4 : 2;
  static constexpr int kKeyBytes = kFp8 ? kDi : 2 * kDi;       // one key (or Q row)
  static constexpr int kQBytes = kRows * kKeyBytes;
  static constexpr int kBlockBytes = kBlock * kKeyBytes;       // 16 KB e4m3 / 32 KB bf16
  static constexpr int kScaleBytes = kFp8 ? kBlock * 4 : 0;    // 512 B of f32 scales
  static constexpr int kQCopiesPerThread = kQBytes / 16 / kConsumerThreads;       // 8
  static constexpr int kCodeCopiesPerThread = kBlockBytes / 16 / kProducerThreads;  // 8
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr size_t kPipelineBytes =
      size_t{kQBytes} + size_t{kStages} * (kBlockBytes + kScaleBytes);
  static_assert(kTiles == 2, "units alternate between the two row tiles of a block");
  static_assert(kStages % kChainBlocks == 0 && kStages >= 2 * kChainBlocks,
                "whole chains never wrap the ring; two chains in flight");
  static_assert((kStages & (kStages - 1)) == 0, "stage and parity by shifts");
  static_assert(kProducerThreads == kBlock, "one key scale per producer thread");
  static_assert(kCodeCopiesPerThread * kProducerThreads * 16 == kBlockBytes &&
                    kProducerThreads % 128 == 0,
                "whole 16-byte chunks; keys tid / 8 + 16 i (bf16: tid / 16 + 8 i) keep one swizzle phase");
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 512, "one sub-partition's file");
  static_assert(kBarrierBytes <= 512, "the barriers fit either end of the 1 KB reserve");
  static constexpr size_t kMaxSmemBytes = 227 * 1024;  // sm_90's opt-in limit per CTA
  static constexpr size_t smem_bytes(int list_pitch) {
    return 1024 + kPipelineBytes + size_t{kRows} * list_pitch * (sizeof(float) + sizeof(int32_t));
  }
  static constexpr bool fits(int list_pitch) { return smem_bytes(list_pitch) <= kMaxSmemBytes; }
};
using Fp8ScanTraits = ProducerScanTraits<true>;
static_assert(Fp8ScanTraits::fits(kMaxTopk - 1), "every list pitch (topk <= 32) must fit");
static_assert(ProducerScanTraits<false>::fits(15), "M3 (topk 16, local 1: 15 ranked) must fit");

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

// ---- key-scale layout of one stage ----
// The reduce's thread quad q needs the scales of columns 8n + 2q + e (n < 16, e < 2): as 8
// float4 chunks m = {cols (2m, q, 0), (2m, q, 1), (2m + 1, q, 0), (2m + 1, q, 1)}. Chunk m of
// quad q sits at float 32 q + 4 (m ^ q): the 4 quads of a quarter warp hit 4 bank groups.
__device__ __forceinline__ int scale_chunk_offset(int quad, int chunk) {  // floats
  return 32 * quad + 4 * (chunk ^ quad);
}
__device__ __forceinline__ int scale_slot(int key) {  // floats, 0..127
  const int n = key / 8, quad = (key % 8) / 2, e = key % 2;
  return scale_chunk_offset(quad, n / 2) + 2 * (n % 2) + e;
}

// The kernel's shared-memory plan (addresses; see "Shared memory" above).
template <bool kFp8>
struct ProducerScanSmem {
  uint32_t q = 0;       // [kRows][128 B] e4m3, swizzled
  uint32_t ring = 0;    // kStages x [128 keys][128 B] e4m3, swizzled
  uint32_t scales = 0;  // kStages x [128] f32, permuted (scale_slot)
  uint32_t bars = 0;    // full[kStages], empty[kStages]
  const float* scale_ring = nullptr;  // = scales, as a pointer (LDS)
  float* list_values = nullptr;       // [kRows][list_pitch]
  int32_t* list_ids = nullptr;        // [kRows][list_pitch]
  __device__ __forceinline__ uint32_t full(int stage) const { return bars + 8 * stage; }
  __device__ __forceinline__ uint32_t empty(int stage) const {
    return bars + 8 * (ProducerScanTraits<kFp8>::kStages + stage);
  }
};

template <bool kFp8>
__device__ __forceinline__ ProducerScanSmem<kFp8> producer_scan_smem(unsigned char* smem_raw,
                                                     const TileScanPlan& plan) {
  using T = ProducerScanTraits<kFp8>;
  ProducerScanSmem<kFp8> m;
  const uint32_t raw = smem_address(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  unsigned char* smem = smem_raw + pad;  // 1024-byte aligned
  m.q = raw + pad;
  m.ring = m.q + T::kQBytes;
  m.scale_ring = reinterpret_cast<const float*>(smem + T::kQBytes + T::kStages * T::kBlockBytes);
  m.scales = smem_address(m.scale_ring);
  m.list_values = reinterpret_cast<float*>(smem + T::kPipelineBytes);
  m.list_ids = reinterpret_cast<int32_t*>(m.list_values + T::kRows * plan.list_pitch);
  // Split mode allocates no lists (the launcher's smem_bytes(0)).
  const int allocated_pitch = plan.block_max == nullptr ? plan.list_pitch : 0;
  const uint32_t lists_end = m.q + static_cast<uint32_t>(T::kPipelineBytes) +
                             static_cast<uint32_t>(T::kRows * allocated_pitch * 8);
  m.bars = pad >= T::kBarrierBytes ? raw : lists_end;
  return m;
}

// bf16 keys: thread ptid copies chunk ptid % 16 of keys ptid / 16 + 8 i (i < 16)
// of each block (key % 8 fixed: one swizzle phase), from the page table's block one ahead.
__device__ __forceinline__ void bf16_scan_produce(const IndexerLaunch& p, const TileGeometry& tile,
                                                  const ProducerScanSmem<false>& m, int n_blocks) {
  using T = ProducerScanTraits<false>;
  const int ptid = threadIdx.x - T::kConsumerThreads;  // 0..127
  const int key0 = ptid / 16, chunk = ptid % 16;
  const uint32_t dst0 = swizzled_offset(key0, chunk, T::kBlock);
  const int64_t src0 = int64_t{key0} * p.ki.token_stride + chunk * 8;
  const int64_t step = 8 * p.ki.token_stride;  // 8 keys
  const uint16_t* block = n_blocks > 0 ? block_pointer(p.ki, tile.seq, tile.scan_begin, 0) : nullptr;
  for (int j = 0; j < n_blocks; ++j) {
    const uint16_t* next = j + 1 < n_blocks ? block_pointer(p.ki, tile.seq, tile.scan_begin + j + 1, 0) : nullptr;
    const int stage = j % T::kStages;
    if (j >= T::kStages) mbar_wait(m.empty(stage), ((j / T::kStages) - 1) & 1);
    const uint16_t* src = block + src0;
    const uint32_t dst = m.ring + stage * T::kBlockBytes + dst0;
#pragma unroll
    for (int i = 0; i < T::kCodeCopiesPerThread; ++i) cp_async_16_if(dst + i * 8 * 128, src + i * step, true);
    mbar_arrive_on_copies(m.full(stage));
    block = next;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the warp
}

// The producer warpgroup: copies blocks 0..n_blocks-1 of the tile's scan into the ring, each
// stage's codes (swizzled) and scales (permuted), and arms its full barrier.
__device__ __forceinline__ void fp8_scan_produce(const IndexerLaunch& p, const TileGeometry& tile,
                                                 const Fp8ScanOperands& ops, const ProducerScanSmem<true>& m,
                                                 int n_blocks) {
  using T = Fp8ScanTraits;
  const int ptid = threadIdx.x - T::kConsumerThreads;  // 0..127
  // Thread ptid copies chunk ptid % 8 of keys ptid / 8 + 16 i (i < 8): a warp's instruction
  // is a coalesced 512-byte run of 4 keys; key % 8 = (ptid / 8) % 8 for every i (one phase).
  const int key0 = ptid / 8, chunk = ptid % 8;
  const uint32_t dst0 = key0 * 128 + ((chunk ^ (key0 % 8)) * 16);
  const int src0 = key0 * T::kDi + chunk * 16;
  const uint32_t scale_dst = 4 * scale_slot(ptid);  // key ptid's scale

  const bool paged = p.ki.page_table != nullptr;
  const int64_t seq_start = paged ? 0 : p.ki.seq_token_start[tile.seq];
  const auto block_token = [&](int j) -> int64_t {
    const int64_t block = tile.scan_begin + j;
    if (paged)
      return static_cast<int64_t>(p.ki.page_table[tile.seq * p.ki.page_table_stride + block]) *
             p.ki.block_size;
    return seq_start + block * p.ki.block_size;
  };
  int64_t token = n_blocks > 0 ? block_token(0) : 0;
  for (int j = 0; j < n_blocks; ++j) {
    // The next block's first token, loaded one block ahead (paged: a page-table read).
    const int64_t next_token = j + 1 < n_blocks ? block_token(j + 1) : 0;
    const int stage = j % T::kStages;
    if (j >= T::kStages) mbar_wait(m.empty(stage), ((j / T::kStages) - 1) & 1);
    const uint8_t* src = ops.k_codes + token * T::kDi + src0;
    const uint32_t dst = m.ring + stage * T::kBlockBytes + dst0;
#pragma unroll
    for (int i = 0; i < T::kCodeCopiesPerThread; ++i)
      cp_async_16_if(dst + i * 16 * 128, src + i * 16 * T::kDi, true);
    // 4 bytes: a varlen sequence's first token (hence its scales) may sit anywhere.
    cp_async_4_if(m.scales + stage * T::kScaleBytes + scale_dst, ops.k_scales + token + ptid, true);
    mbar_arrive_on_copies(m.full(stage));
    token = next_token;
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives the warp
}

// The two consumer warpgroups: MMAs and reduces of their row tiles, fed by the ring.
template <bool kFp8>
__device__ __forceinline__ void producer_scan_consume(const IndexerLaunch& p, const TileScanPlan& plan,
                                                 const Fp8ScanOperands& ops,
                                                 const TileGeometry& tile, const ProducerScanSmem<kFp8>& m,
                                                 int n_blocks) {
  using T = ProducerScanTraits<kFp8>;
  constexpr int kTiles = T::kTiles;
  const bool fused = plan.block_max == nullptr;
  const int heads = static_cast<int>(p.heads);
  const int64_t tile_row0 = tile.first_query * p.heads;  // global row of the tile's row 0
  // This thread's rows (owned_row_geometry). The warpgroup index through a shuffle: provably
  // warp-uniform, so the A descriptors live in uniform registers (no per-MMA register moves).
  const int tid = threadIdx.x, lane = tid % 32, warp = (tid % 128) / 32;
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int quad = lane % 4;
  int own_row[kTiles];
  bool owner[kTiles];
  int32_t own_block[kTiles], own_cand_end[kTiles];
  owned_row_geometry(p, tile, heads, warpgroup, warp, lane, own_row, owner, own_block, own_cand_end);
  float own_q_scale[kTiles];
  TopSet list[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    // Rows past the tile read no scale (their values are never used).
    if constexpr (kFp8)
      own_q_scale[t] = own_row[t] < tile.n_rows ? ops.q_scales[tile_row0 + own_row[t]] : 0.0f;
    list[t].init(m.list_values + own_row[t] * plan.list_pitch,
                 m.list_ids + own_row[t] * plan.list_pitch, plan.ranked);
  }

  if (n_blocks > 0) {
    // Q codes (rows past the tile zero-filled: their maxima are ignored), visible to both
    // warpgroups' MMAs.
    constexpr int kChunks = T::kKeyBytes / 16;  // 16-byte chunks per row
    const unsigned char* tile_q = kFp8 ? reinterpret_cast<const unsigned char*>(ops.q_codes)
                                       : reinterpret_cast<const unsigned char*>(p.qi);
    tile_q += tile_row0 * T::kKeyBytes;
#pragma unroll
    for (int j = 0; j < T::kQCopiesPerThread; ++j) {
      const int c = tid + j * T::kConsumerThreads, row = c / kChunks, chunk = c % kChunks;
      const bool valid = row < tile.n_rows;
      cp_async_16(m.q + swizzled_offset(row, chunk, T::kRows),
                  tile_q + (valid ? int64_t{row} * T::kKeyBytes + chunk * 16 : 0), valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_shared();
    named_barrier_sync(1, T::kConsumerThreads);

    uint64_t a_desc[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
      a_desc[t] = wgmma_descriptor(m.q + (warpgroup * kTiles + t) * 64 * T::kDi);
    const uint64_t b_desc = wgmma_descriptor(m.ring);
    // This quad's scale chunks c < 4 of stage 0 (chunk c + 4: +16 floats; stage s: +128 s).
    const float* scale_chunk[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) scale_chunk[c] = m.scale_ring + scale_chunk_offset(quad, c);

    // One unit: 4 x m64n128k32 e4m3 of row tile t against the block in `stage`. Descriptors
    // count 16-byte units: a stage is kBlockBytes / 16 of them, a k step of 32 B is 2.
    const auto issue = [&](float(&acc)[64], int stage, int t) {
      fence_operands(acc);
      wgmma_fence();
      if constexpr (kFp8) {
#pragma unroll
        for (int k = 0; k < T::kDi / 32; ++k)
          wgmma_m64n128k32_e4m3(acc, a_desc[t] + 2 * k,
                                b_desc + static_cast<uint64_t>(stage * (T::kBlockBytes / 16) + 2 * k),
                                k > 0);
      } else {  // 8 x m64n128k16 bf16 over the two 64-column slabs (wgmma.cuh)
        wgmma_m64n128k128_ss(acc, m.q + (warpgroup * kTiles + t) * 64 * 128, T::kRows,
                             m.ring + stage * T::kBlockBytes, T::kBlock);
      }
      wgmma_commit();
    };
    // The block max of a retired unit. Columns 8n + 2 quad + {0, 1} of accumulator group n:
    // two adjacent key scales, chunk c holding those of groups 2c and 2c + 1.
    const auto reduce = [&](float(&acc)[64], int index, int stage, int t) {
      fence_operands(acc);
      float top[16], bottom[16];
      if constexpr (kFp8) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const float4 s = *reinterpret_cast<const float4*>(scale_chunk[c % 4] +
                                                            stage * T::kBlock + 16 * (c / 4));
          const int n0 = 2 * c, n1 = 2 * c + 1;
          top[n0] = fmaxf(acc[4 * n0] * s.x, acc[4 * n0 + 1] * s.y);
          bottom[n0] = fmaxf(acc[4 * n0 + 2] * s.x, acc[4 * n0 + 3] * s.y);
          top[n1] = fmaxf(acc[4 * n1] * s.z, acc[4 * n1 + 1] * s.w);
          bottom[n1] = fmaxf(acc[4 * n1 + 2] * s.z, acc[4 * n1 + 3] * s.w);
        }
      } else {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          top[n] = fmaxf(acc[4 * n], acc[4 * n + 1]);
          bottom[n] = fmaxf(acc[4 * n + 2], acc[4 * n + 3]);
        }
      }
      float tv = max_tree16(top), bv = max_tree16(bottom);
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 1));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 1));
      tv = fmaxf(tv, __shfl_xor_sync(0xffffffffu, tv, 2));
      bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, 2));
      const int32_t block = tile.scan_begin + index;
      if (!owner[t] || block >= own_cand_end[t]) return;
      float value = (quad & 1) ? bv : tv;
      if constexpr (kFp8) value *= own_q_scale[t];
      if (fused)
        list[t].offer(value, block);
      else
        plan.block_max[(tile.maxima_row0 + own_row[t]) * plan.block_max_stride + block] = value;
    };
    // After this warp's last reduce of a block: its MMAs retired (wait_group), and the
    // __syncwarp orders every lane's scale loads before lane 0's release (header).
    const auto release = [&](int stage) {
      __syncwarp();
      if (lane == 0) mbar_arrive(m.empty(stage));
    };

    // A chain of kBlocks blocks from block `first` (stages first % kStages + b: a whole chain
    // starts at a multiple of kChainBlocks, so it never wraps): units block by block, tile
    // by tile, in accumulator set u % 2; straight-line code, no MMA in flight at its ends.
    // All of a chain's full barriers are waited for at its start: a wait mid-chain, with an
    // MMA in flight, would put a spin loop's back edge there (C7514).
    float acc[2][64];
    const auto run_chain = [&](int first, auto chain_blocks) {
      constexpr int kBlocks = decltype(chain_blocks)::value;
      constexpr int kUnits = kBlocks * kTiles;
      const int stage0 = first % T::kStages;
      const uint32_t parity = (first / T::kStages) & 1;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) mbar_wait(m.full(stage0 + b), parity);
      fence_async_shared();  // the producer's cp.async writes -> this thread's wgmma reads
      issue(acc[0], stage0, 0);
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        const int next = u + 1;
        if (next < kUnits) {  // resolved at compile time (the loop is unrolled)
          issue(acc[next % 2], stage0 + next / kTiles, next % kTiles);
          wgmma_wait<1>();  // retires unit u
        } else {
          wgmma_wait<0>();
        }
        reduce(acc[u % 2], first + u / kTiles, stage0 + u / kTiles, u % kTiles);
        if (u % kTiles == kTiles - 1) release(stage0 + u / kTiles);
      }
    };
    int i = 0;
    for (; i + T::kChainBlocks <= n_blocks; i += T::kChainBlocks)
      run_chain(i, std::integral_constant<int, T::kChainBlocks>{});
    for (; i < n_blocks; ++i) run_chain(i, std::integral_constant<int, 1>{});
  }

  if (!fused) return;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
    if (owner[t]) list[t].sort_best_first();
  write_owned_selections(p, tile, heads, own_row, owner, own_block, list);
}

// grid = (tile bound, chunks) as tile_scan_kernel: blockIdx.x -> tile, blockIdx.y -> chunk.
// 384 threads: warpgroups 0 and 1 consume (MMA + reduce), warpgroup 2 produces (copies).
template <bool kFp8>
__global__ void __launch_bounds__(ProducerScanTraits<kFp8>::kThreads, 1)
    producer_tile_scan_kernel(const IndexerLaunch p, const TileScanPlan plan,
                              const Fp8ScanOperands ops) {
  using T = ProducerScanTraits<kFp8>;
  extern __shared__ unsigned char smem_raw[];
  const ProducerScanSmem<kFp8> m = producer_scan_smem<kFp8>(smem_raw, plan);
  const TileGeometry tile = tile_geometry(p, plan);
  if (!tile.valid) return;  // uniform over the CTA: before any barrier
  const int n_blocks = max(0, tile.scan_end - tile.scan_begin);
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(m.full(s), T::kProducerThreads);
      mbar_init(m.empty(s), T::kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers' initialisation is visible to every thread
  // One if/else over whole warpgroups: what setmaxnreg needs to take effect.
  if (threadIdx.x >= T::kConsumerThreads) {
    setmaxnreg_dec<T::kProducerRegisters>();
    if constexpr (kFp8)
      fp8_scan_produce(p, tile, ops, m, n_blocks);
    else
      bf16_scan_produce(p, tile, m, n_blocks);
  } else {
    setmaxnreg_inc<T::kConsumerRegisters>();
    producer_scan_consume<kFp8>(p, plan, ops, tile, m, n_blocks);
  }
}

}  // namespace msa::cuda::indexer_detail
