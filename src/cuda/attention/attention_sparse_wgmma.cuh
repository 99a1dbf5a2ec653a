// Sparse attention, KV-block-major, forward on Hopper warpgroup MMA (wgmma) for D = B = 128.
//
// Same plan, work items and partial outputs as sparse_kv_major_kernel
// (attention_sparse_kv_major.cuh: sorted selection keys -> items of one (group, block,
// sequence) and up to 1024 rows; attention_merge.cuh combines the partials); only the tile
// engine differs. The mma.sync kernel gives each warp 16 rows (one query's 16 heads), runs 8
// warps per SM and is latency bound (Nsight Compute, 32K prefill: issue slots 42% busy,
// tensor pipe 28%). Here an m-tile is 64 rows (4 queries x 16 heads for M3) and one
// warpgroup runs it as two wgmma chains:
//   S = Q K^T   8 x m64n128k16, Q and K from shared memory (128B-swizzled K-major tiles);
//   softmax     in registers: mask keys after the row's position, row max / sum over the
//               block's 128 keys (one block per entry: no online rescaling), P = 2^(S - m);
//   O = P V     8 x m64n128k16, P from registers (the S accumulator layout is the A fragment
//               layout), V [keys x D] from shared memory read transposed (MN-major).
// The kernel (sparse_producer_kernel, attention_sparse_producer.cuh): two consumer
// warpgroups run the tiles, a third produces their operands (K/V, row tables, Q gathers)
// through mbarriers; one CTA per SM, persistent over items. This file holds what the tile
// math needs: the traits and shared-memory budget, the swizzled K/V and Q copies, the row
// decode into a shared-memory row table, and softmax_pv_store.
//
// Software pipeline inside a consumer warpgroup (FlashAttention-3's intra-warpgroup overlap):
// while the ALUs run the softmax of tile t, the tensor pipe computes S of tile t + 1 into a
// second set of 64 accumulators. Per tile t of an item (S(t) issued or done on entry):
//   wait Q(t + 1); issue S(t + 1) [async]; wait S(t); release Q(t)'s slot;
//   softmax(t) || S(t + 1); issue P V(t); wait all (S(t + 1), P V(t)); store partials(t).
// Every tile ends with nothing in flight, and the two accumulator sets alternate by name in a
// loop unrolled by two (an MMA group in flight across a back edge serialises all wgmma: ptxas
// C7514). An item's last tile has no S(t + 1) (the next item's K is another buffer).
// Registers: S(t) / O(t) (O accumulates into the dead S registers, the first k step
// overwrites), S(t + 1) and P: 64 + 64 + 32.
// Shared memory: 1 KB alignment + 2 x 64 KB K/V + 2 warpgroups x 2 x 16 KB Q + 8 warps x 2,176 B
// store staging + 2 warpgroups x 4 x 1,280 B row tables (+ the producer's 12 mbarriers).
// Each tile's rows are decoded once into a shared-memory row table (Q row, partial row,
// visible key limit); O / l is staged per warp, 8 rows at a time, for 16-byte stores of whole
// rows; the softmax uses ex2.approx with the scale folded into one FMA. Shared-memory
// pointers derive from smem_raw by pointer arithmetic, so they stay 32-bit shared addresses.
// Why this engine: on the M3 shape it runs the sparse stage faster than the mma.sync kernel
// at every context, and the pipeline above, the producer warpgroup and the TMA Q tiles each
// added to that (bench/results/history.md). The mma.sync kernel
// (AttentionLaunch::sparse_engine) stays for other shapes and negative scales; both are
// tested (GpuSparseWgmma).
//
// Traffic and floors (M3: G = 16, D = B = 128, k = 16; a row is one (query, q-head, selected
// block); bytes from the code, reuse measured by tools/sparse_item_reuse.cpp on CPU-indexer
// selections of random inputs, 132 CTAs):
//   attention kernel: Q gather 256 B (bf16; each item gathers its rows, so a query's Q rows
//     are read once per selected block, k times in all; 77% / 55% / 34% of the (query, group)
//     gathers at 8K / 16K / 32K tokens were also gathered by one of the 132 items before,
//     i.e. in flight at the same time: L2 hits, falling with N); K/V 64 KB per item of <= 1024
//     rows (>= 64 B per row; 97% of the items find their block read by the 132 items before:
//     L2); partial O 256 B (bf16 O / l) + partial LSE 4 B written.
//   merge (attention_merge.cuh): partial O + LSE read, 260 B; O written in f32, 512 B per
//     (query, head) = 32 B per row; LSE 4 B per (query, head).
//   plan (keys, 64-bit radix sort, items): ~100 B per entry of G rows, ~6 B per row.
//   Sum: ~814 B per row with Q from HBM (776 B without the merge's O write and the plan),
//   ~560 B with Q from L2; 65.5 KFLOP per row (4 D B: the local block's masked half is
//   computed too): 80 FLOP/B, half the H200's ridge (793 TFLOP/s / 4.8 TB/s = 165 FLOP/B).
//   128K, one sequence (133M rows: 64 heads x min(k, L + 1) slots per query): 8.7 TFLOP =
//   11.0 ms at peak; the attention kernel moves ~69 GB = 14.5 ms at 4.8 TB/s (its floor: bytes,
//   not FLOPs), the merge ~39 GB = 8.1 ms, the plan ~1 ms: ~24 ms is this design's floor.
//   Measured, the stage sits well above this floor (bench/results/h200.md): the merge takes
//   about a quarter of it at ~85% of DRAM bandwidth, the plan ~2%, and the attention kernel
//   saturates neither bytes nor FLOPs.
//   Why a producer warpgroup: with the two consumer warpgroups also gathering Q and decoding
//   rows, a 32K profile (Nsight Compute) had about a third of the issue slots busy and under
//   half an eligible warp per scheduler; its stalls were fixed-latency dependencies (softmax
//   and address arithmetic), row-table loads before the partial stores, the CTA barrier at an
//   item change and selection-key loads, and over a third of the instructions were integer
//   work (row decode, cp.async addresses). With the producer and cp.async Q gathers the
//   largest stall was the consumers' wait for Q (q_full; two Q slots per warpgroup give a
//   gather about 0.7 of a tile, ~1 us, to land), hence the TMA Q tiles
//   (attention_sparse_producer.cuh).
//   Overlapping the merge of chunk c with the attention of chunk c + 1 does not fit as is:
//   this kernel's CTA holds nearly the whole register file (216 x 256 + 72 x 128) and 225 KB of
//   shared memory; one 128-thread, 40-register merge CTA would need a smaller cap, and it
//   keeps too few bytes in flight (~8 KB per SM) to move the merge's traffic in time.
//   Why two Q slots: loads in flight per SM must cover bandwidth x latency, ~4.8 TB/s x
//   ~1.5 us / 132 SMs = ~55 KB; two slots keep at most one 16 KB Q tile per warpgroup in
//   flight (32 KB per SM), issued about one tile ahead. Yet deeper Q rings (3 Q slots per
//   consumer warpgroup, paid for by a 3-unit K/V ring in which V of the next item waits for
//   the last S of this one; also with one gatherer for both warpgroups) were measured slower:
//   the Q lead does not bind, the gather's issue latency does (bench/results/history.md).
// Shrinking the bytes (16K / 32K tokens, random inputs):
//   - a query's partials merged on chip across a CTA's consecutive items: 0.5% / 0.24% of the
//     entries have their (query, group) in the CTA's previous item (items are ordered by block
//     and a CTA takes every 132nd: consecutive items are other blocks, whose queries barely
//     overlap); in any earlier item of the CTA, 5.3% (chance: k items per query over 132
//     CTAs). Coherent selections (below) give the same 0.4-0.7%: the item order decides, not
//     the selection. Not worth it; neither is "once per CTA".
//   - the local block query-major, fused with the merge: 6.4% of the entries; saves their
//     partial write and read (520 of ~814 B): ~4% of the bytes (~1 ms at 128K) for an MMA
//     stage in the merge kernel. Not worth it alone.
//   - the real lever is the order: a query-major kernel over the union of a query tile's
//     blocks writes no partials and reads Q once (~110 B per row instead of ~814: compute
//     bound), but computes every (tile, union block) pair: the union of a 4-query (64-row)
//     tile's blocks is 2.5x / 2.9x the mean valid count on random selections (16K / 32K;
//     ~3.8x at 128K), 1.08x / 1.03x on coherent ones (index queries of one 128-token block =
//     a shared base plus 3% / 1% noise; 128-query tiles: 1.22x / 1.08x). Built as the
//     query-major order (attention_sparse_union.cuh), chosen per tile by its union.
#pragma once
#include "cuda/attention/attention_sparse_kv_major.cuh"
#include "cuda/common/mbarrier.cuh"
#include "cuda/common/wgmma.cuh"

namespace msa::cuda::attn {

struct SparseWgmmaTraits {
  static constexpr int kD = 128, kB = 128;
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kTileRows = 64;  // rows of one warpgroup m-tile
  static constexpr int kKeyBytes = kB * kD * 2;         // one K (or V) block: 32 KB
  static constexpr int kQBytes = kTileRows * kD * 2;    // one Q tile: 16 KB
  static constexpr int kStagePitch = kD * 2 + 16;       // bytes per staged row (padded)
  static constexpr int kStageBytes = 8 * kStagePitch;   // one warp's store staging: 8 rows
  static constexpr int kRowTables = 4;                  // per warpgroup (see the kernel)
  static constexpr size_t kRowTableBytes = kTileRows * (8 + 8 + 4);
  // 1 KB alignment, K/V double buffer, 2 Q slots per warpgroup, staging, row tables.
  static constexpr size_t kSmemBytes = 1024 + 2 * 2 * size_t{kKeyBytes} + 2 * 2 * size_t{kQBytes} +
                                       (kThreads / 32) * size_t{kStageBytes} + 2 * kRowTables * kRowTableBytes;
};
static_assert(SparseWgmmaTraits::kSmemBytes <= 227 * 1024, "one CTA per SM");

// Chunk i (row i / 16, 16-byte chunk i % 16) of one K or V block (rows token_stride apart
// from src) into the swizzled layout; rows past valid_rows are zero-filled (their scores are
// masked anyway, and P x 0 stays finite where an unwritten page tail holds NaN).
__device__ __forceinline__ void copy_block_chunk(unsigned char* dst, const uint16_t* src, int64_t token_stride,
                                                 int valid_rows, int i) {
  using T = SparseWgmmaTraits;
  const int row = i / 16, chunk = i % 16;
  const bool valid = row < valid_rows;
  cp_async_16(dst + swizzled_offset(row, chunk, T::kB), valid ? src + row * token_stride + chunk * 8 : src,
              valid);
}

// Keys of the item's block that exist (the sequence may end inside it).
__device__ __forceinline__ int item_valid_rows(const SparseArgs& a, const ItemInfo& info) {
  const int64_t keys_left = a.k_len[info.seq] - info.block * SparseWgmmaTraits::kB;
  return static_cast<int>(keys_left < SparseWgmmaTraits::kB ? keys_left : SparseWgmmaTraits::kB);
}

// What a tile needs to know about each of its 64 rows, decoded once (row m of the item is
// entry m / G, head m % G): where its Q row is, where its partial goes (-1: padding row),
// and the last key column of the block it may see.
struct TileRows {
  int64_t q_offset[SparseWgmmaTraits::kTileRows];
  int64_t partial[SparseWgmmaTraits::kTileRows];
  int32_t limit[SparseWgmmaTraits::kTileRows];
};
static_assert(sizeof(TileRows) == SparseWgmmaTraits::kRowTableBytes);

// Selection key of row tile_row + r of the item (r < 64: one row per thread; padding rows
// mirror the last row), loaded ahead of its decode to keep the latency off the path.
__device__ __forceinline__ uint64_t load_row_key(const SparseArgs& a, const ItemInfo& info, int tile_row, int G,
                                                 int r) {
  if (r >= SparseWgmmaTraits::kTileRows) return 0;
  const int m = tile_row + r;
  const int mm = m < info.rows ? m : info.rows - 1;
  return a.keys[info.first + mm / G];
}

// Row tile_row + r of the item (r < 64; `key`: load_row_key's) into rows.*[r]: where its Q
// row is, where its partial goes (-1: a padding row past the item) and its last visible key.
// Returns the Q row (in rows of D) of head 0 of the row's query; a padding row gives the
// item's last query's (the TMA gather loads whole queries).
__device__ __forceinline__ int64_t decode_tile_row(const SparseArgs& a, const ItemInfo& info, int tile_row,
                                                   int G, uint64_t key, TileRows& rows, int r) {
  using T = SparseWgmmaTraits;
  const int m = tile_row + r;
  const bool valid = m < info.rows;
  const int mm = valid ? m : info.rows - 1;  // padding rows mirror the last row
  const Entry e = decode_entry(a, key, info.pos_offset);
  const int64_t limit = e.pos - info.block * T::kB;
  rows.limit[r] = static_cast<int32_t>(limit < T::kB ? limit : T::kB - 1);
  rows.q_offset[r] = valid ? (e.q * a.q_heads + info.g * G + mm % G) * T::kD : -1;
  rows.partial[r] = valid ? ((e.q - a.q_begin) * a.kv_heads + info.g) * a.slots * G + e.slot * G + mm % G : -1;
  return e.q * a.q_heads + info.g * G;
}

// The tile's 64 Q rows (rows.q_offset, zero rows for padding) into `dst` by the 64 threads of
// a producer half; thread tid copies chunk tid % 16 of rows tid / 16 + 4 j.
__device__ __forceinline__ void gather_q_tile(const SparseArgs& a, const TileRows& rows, unsigned char* dst,
                                              int tid) {
  using T = SparseWgmmaTraits;
  constexpr int kThreads = 64;
  const int chunk = tid % 16;
  // Unrolled by 2 only: fully unrolled, the hoisted shared addresses of the 16 rows outnumber
  // the producer's registers.
#pragma unroll 2
  for (int j = 0; j < T::kTileRows * 16 / kThreads; ++j) {
    const int row = tid / 16 + (kThreads / 16) * j;
    const int64_t offset = rows.q_offset[row];
    cp_async_16(dst + swizzled_offset(row, chunk, T::kTileRows), offset >= 0 ? a.q + offset + chunk * 8 : a.q,
                offset >= 0);
  }
}

// The part of a tile after S(t) has landed in s: softmax over the block's keys in the log2
// domain (masks from `rows`), O = P V into s's registers, and the partials (lse2 and O / l as
// bf16, staged per warp in `stage`) written to global memory. kNext: S(t + 1) is in flight
// into s_next (its registers are fenced when everything retires). Ends with no MMA in flight.
template <bool kNext>
__device__ __forceinline__ void softmax_pv_store(const SparseArgs& a, float (&s)[64], float (&s_next)[64],
                                                 const TileRows& rows, int warp, int lane,
                                                 unsigned char* stage, uint32_t v_addr) {
  using T = SparseWgmmaTraits;
  // This thread's rows (warp w owns rows 16w..16w+15 of the accumulator).
  const int row0 = warp * 16 + lane / 4;
  const int limit[2] = {rows.limit[row0], rows.limit[row0 + 8]};
  // Rows are ordered by query: the tile needs masks only where its first row does.
  const bool masked = rows.limit[0] < T::kB - 1;

  // Softmax over the block's keys in the log2 domain; P packed as bf16 A fragments.
  float m[2] = {kNegInf, kNegInf};
  if (masked) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
      if (col > limit[(i % 4) / 2]) s[i] = kNegInf;
    }
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) m[(i % 4) / 2] = fmaxf(m[(i % 4) / 2], s[i]);
  float l[2], m_scaled[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
    m_scaled[r] = m[r] == kNegInf ? 0.0f : m[r] * a.scale_log2;  // no visible key: p = 0
    l[r] = 0.0f;
  }
  uint32_t p[8][4];
#pragma unroll
  for (int k = 0; k < 8; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = j % 2;
      const float p0 = fast_exp2(fmaf(s[8 * k + 2 * j], a.scale_log2, -m_scaled[r]));
      const float p1 = fast_exp2(fmaf(s[8 * k + 2 * j + 1], a.scale_log2, -m_scaled[r]));
      l[r] += p0 + p1;
      p[k][j] = pack_bf16(p0, p1);
    }

  // O = P V, into the registers of S(t) (dead once P is packed: the first k step
  // overwrites), so that two accumulator sets cover S(t) / O(t) and S(t + 1).
  float (&o)[64] = s;
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < T::kB / 16; ++k)
    wgmma_m64n128k16_rs_tb(o, p[k], wgmma_descriptor(v_addr + k * 16 * 128, T::kKeyBytes / 2, 1024), k > 0);
  wgmma_commit();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  wgmma_wait<0>();
  fence_operands(o);
  if constexpr (kNext) fence_operands(s_next);

  // Partials: lse2 = m + log2 l, and O / l as bf16, staged per warp 8 rows at a time
  // (rows 16w + 8r + 0..7; the 16-byte row padding spreads the 8 rows over all banks and
  // keeps the addresses a base plus constants) and written as 16-byte chunks of whole rows.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int64_t partial = rows.partial[row0 + 8 * r];
    if (lane % 4 == 0 && partial >= 0) a.partial_lse[partial] = l[r] > 0.0f ? m_scaled[r] + log2f(l[r]) : kNegInf;
#pragma unroll
    for (int n = 0; n < 16; ++n)
      *reinterpret_cast<uint32_t*>(stage + (lane / 4) * T::kStagePitch + 16 * n + 4 * (lane % 4)) =
          pack_bf16(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int staged = 2 * j + lane / 16, chunk = lane % 16;
      const int64_t row_partial = rows.partial[warp * 16 + 8 * r + staged];
      if (row_partial >= 0)
        *reinterpret_cast<uint4*>(a.partial_o + row_partial * T::kD + chunk * 8) =
            *reinterpret_cast<const uint4*>(stage + staged * T::kStagePitch + 16 * chunk);
    }
    __syncwarp();  // the staging is read before it is written again
  }
}

}  // namespace msa::cuda::attn
