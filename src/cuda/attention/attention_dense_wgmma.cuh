// Dense GQA attention (topk == null), prefill forward on Hopper warpgroup MMA (wgmma),
// D = 128 only; causal, or bidirectional (every row at its sequence's last key, DenseTile). The default for D = 128 (attention.cu, use_dense_wgmma;
// AttentionLaunch::dense_engine = mma_sync selects the mma.sync kernel, attention_dense_flash.cuh).
//
// Rows: as the mma.sync kernel, a CTA owns rows = (query, head) pairs of one KV group
// (blockIdx.y) of one sequence, flattened query-major (row m -> query m / G, head m % G), but
// 128 of them (dense_tile_plan / dense_tile with rows_per_tile = 128): 8 queries x 16 heads
// for M3, 128 queries for G = 1. Why flattened rows rather than one head per CTA: every row
// of a 64-row tile is real work for any G in 1..16 (no padding heads), each K/V tile is
// shared by 128 rows whatever G is, and the causal diagonal of a CTA spans 128 / G query
// positions, so for M3 only the last key tile needs a mask. Two warpgroups, 64 rows each;
// warp w (0..7) owns rows 16 w .. 16 w + 15 (dense_warp_rows / dense_row with the CTA-wide
// warp index).
// Per 128-key tile, each warpgroup runs (as attention_sparse_wgmma.cuh, whose operand
// layouts and wgmma.cuh helpers this reuses):
//   S = Q K^T   8 x m64n128k16, Q and K from shared memory (128B-swizzled K-major tiles);
//   softmax     online, in registers: scale, causal mask (a branch taken only by tiles past
//               the warpgroup's first position), row max over the tile, rescale O and l by
//               2^(m_old - m_new), P = 2^(S - m) rounded to bf16 (the row sums use the f32
//               values);
//   O += P V    8 x m64n128k16, P from registers, V [keys x D] read MN-major.
// Software pipeline inside a warpgroup: P V of tile t - 1 runs on the tensor cores during the
// softmax of tile t (step t of the key loop in the kernel). The sparse kernel's arrangement, S(t + 1) issued
// before the softmax of tile t, needs a second 64-register S set: ptxas went to 255
// registers and spilled or serialised every wgmma (C7511). Here P(t) stays in the S
// registers as f32 and is packed only after P V(t - 1) has released the fragments.
// Warp specialisation (FlashAttention-3's structure): warpgroups 0 and 1 consume (Q, the
// MMAs, the softmax, the store), warpgroup 2 produces: K(u) and V(u) into stage u % 3 of
// three (cp.async, zero-filled past k_len: P x 0 stays finite where an unwritten page tail
// holds NaN), announced on the stage's `full` mbarrier by each producer thread's copy-arrive
// and refilled once both consumer warpgroups arrived on its `empty` mbarrier after their MMAs
// on it retired. No CTA barrier per step: each consumer waits only for its own stage. A
// 128-key tile is one block (B = 128) or two (B = 64): each 64-key half is addressed through
// block_pointer once, so varlen and paged layouts work as in the mma.sync kernel.
// Ping-pong: the two consumer warpgroups take turns issuing their step's MMAs (named barriers
// 3 and 4), so that one warpgroup's softmax runs while the other's S and P V occupy the
// tensor cores, instead of both softmaxes falling in the same window with the tensor pipe
// idle (a CTA barrier per step, which ties the two warpgroups' phases together, measured
// ~5000 clocks per tile step against 2048 of MMA).
// Registers: O 64 + S 64 + P 32 + row state; setmaxnreg: consumers 232, producer 40 (2 x 128
// x 232 + 128 x 40 = 64,512 of 65,536); ptxas (nvcc 13.0, sm_90a): no spills.
// Shared memory: 1 KB alignment + 3 stages x (K + V) x 32 KB + 2 warpgroups x 16 KB Q + 128
// output rows x 8 B + 6 mbarriers = 231,472 B: one CTA (12 warps) per SM.
//
// Cycle budget per 128-key tile and warpgroup (SASS of nvcc 13.0 for sm_90a, counted along
// the executed path of a varlen tile without the causal mask; a warpgroup is one warp on each
// of the SM's four sub-partitions, which issue one instruction per clock each):
//   MMA   16 x m64n128k16 = 4.19 MFLOP; at the SM's 4096 dense bf16 FLOP per clock (989
//         TFLOP/s at 1.83 GHz over 132 SMs; the measured 793 TFLOP/s matmul ceiling is that
//         rate at the clock under load) 1024 clocks: S 512 + P V 512. Both warpgroups: 2048
//         tensor clocks per tile step and SM.
//   ALU   the K/V copies (~376 instructions per warp and tile) run on the producer warpgroup;
//         MUFU.EX2 (16 per clock per SM): 66 x 8 = 528 clocks per warp.
// Measured (H200, bench/results/h200.md): 420-428 TFLOP/s, 54-55% of the bf16 peak at
// 8K-128K, cuDNN 543-644 in the same run (69-82%). Nsight Compute of
// the union variant (32K, coherent selections): tensor pipe 40% of the elapsed cycles, issue
// slots 47% busy, 6.2 cycles between a warp's instructions: latency, not issue, binds. What
// FlashAttention-3 has beyond this: K/V by the bulk tensor copy engine (the producer's 32
// cp.async per thread and operand cost issue slots on every sub-partition), O stored by TMA,
// and S(t + 1) issued before the softmax of tile t (a second S register set, which at 232
// registers does not fit beside P: ptxas C7511).
// Longest tiles first: dense_tile gives the last (longest) tiles of a sequence the lowest
// CTA ids.
#pragma once
#include <type_traits>

#include "cuda/attention/attention_dense_flash.cuh"
#include "cuda/attention/attention_sparse_union.cuh"
#include "cuda/common/mbarrier.cuh"
#include "cuda/common/wgmma.cuh"

namespace msa::cuda::attn {

// D = 128 (the text model) or 80 (the vision tower). Shared-memory tiles keep the 128-column
// layout (two 64-column slabs of 128B-swizzled rows) for both: at D = 80 a row fills slab 0 and
// the first 16 columns of slab 1; the copies skip the rest and no MMA reads it (S takes
// D / 16 k-steps, O = P V is m64nD).
template <int D>
struct DenseWgmmaTraits {
  static_assert(D == 128 || D == 80, "the wgmma dense kernel's head dims");
  static constexpr int kD = D;
  static constexpr int kChunks = D / 8;           // 16-byte chunks of a row that hold data
  static constexpr int kKeys = 128;               // keys per tile
  static constexpr int kConsumerThreads = 256;    // warpgroups 0, 1: the rows' MMAs and softmax
  static constexpr int kProducerThreads = 128;    // warpgroup 2: the K/V copies
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kConsumerRegisters = 232, kProducerRegisters = 40;  // 2 x 128 x 232 + 128 x 40 = 64,512
  static constexpr int kWarpgroupRows = 64;       // rows of one warpgroup's m-tile
  static constexpr int kRows = 2 * kWarpgroupRows;  // rows per CTA
  static constexpr int kStages = 3;
  static constexpr int kPaddedD = 128;                           // columns of a shared-memory row
  static constexpr int kKvBytes = kKeys * kPaddedD * 2;          // one K (or V) tile: 32 KB
  static constexpr int kQBytes = kWarpgroupRows * kPaddedD * 2;  // one warpgroup's Q: 16 KB
  // 1 KB alignment, K/V stages, Q of both warpgroups, and the output row of each CTA row
  // (int64, -1: padding), kept here rather than in registers across the key loop.
  static constexpr int kBarriers = 2 * kStages;  // full[stage], empty[stage]
  static constexpr size_t kSmemBytes =
      1024 + kStages * 2 * size_t{kKvBytes} + 2 * size_t{kQBytes} + kRows * sizeof(int64_t) + kBarriers * 8;
};
static_assert(DenseWgmmaTraits<128>::kSmemBytes <= 227 * 1024, "one CTA per SM");
static_assert(DenseWgmmaTraits<128>::kRows == (DenseWgmmaTraits<128>::kConsumerThreads / 32) * kWarpRows,
              "dense_warp_rows with the CTA-wide warp index");

// One operand (`keys`: K or V) of key tile `tile` into dst in the swizzled layout; keys at
// or past k_len are zero-filled and not read. The producer's 128 threads (p = its thread
// index); the caller arrives on the stage's barrier. A thread's 16 rows are row0 + 8 j, so a
// copy's source is one of two half-tile bases plus a multiple of 8 rows and its shared offset
// an immediate (the 128B swizzle repeats every 8 rows: + 1024 j).
template <int D>
__device__ __forceinline__ void load_dense_operand_swizzled(const KeyLayout& keys, int64_t seq, int64_t g,
                                                            int64_t k_len, int64_t tile, unsigned char* dst, int p) {
  using T = DenseWgmmaTraits<D>;
  const int64_t first_key = tile * T::kKeys;  // < k_len for every tile the kernel visits
  const int row0 = p / 16, chunk = p % 16;
  if (chunk >= T::kChunks) return;  // padding columns (D = 80): never read
  const int64_t left = k_len - first_key - row0;  // row0 + 8 j is a key iff 8 j < left
  const int rows_left = static_cast<int>(left < T::kKeys ? left : T::kKeys);
  const uint16_t* half[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // A half past the end needs only a valid address (nothing is read): the first half's,
    // and its page-table entry may not exist.
    const int64_t key = first_key + 64 * h < k_len ? first_key + 64 * h : first_key;
    const int64_t block = key / keys.block_size, in_block = key % keys.block_size;
    half[h] = block_pointer(keys, seq, block, g) + (in_block + row0) * keys.token_stride + chunk * 8;
  }
  const int64_t rows8 = 8 * keys.token_stride;
  unsigned char* at = dst + swizzled_offset(row0, chunk, T::kKeys);  // row0 + 8 j: + 1024 j
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const bool valid = 8 * j < rows_left;
    cp_async_16(at + 1024 * j, valid ? half[j / 8] + (j % 8) * rows8 : half[0], valid);
  }
}

// Q of the warpgroup's 64 rows (CTA rows 64 wg ..) into `dst` in the swizzled layout; rows
// past the tile are zero-filled. The warpgroup's threads; the caller commits.
template <int D>
__device__ __forceinline__ void load_dense_q_swizzled(const DenseArgs& a, const DenseTile& t, int G, int64_t g,
                                                      int wg, unsigned char* dst) {
  using T = DenseWgmmaTraits<D>;
  const int wtid = threadIdx.x % 128, chunk = wtid % 16;
  if (chunk >= T::kChunks) return;  // padding columns (D = 80): never read
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = wtid / 16 + 8 * j;  // 0..63
    const int64_t m = t.first_row + wg * T::kWarpgroupRows + row;
    const bool valid = m <= t.last_row;
    const uint16_t* src = valid ? a.q + dense_row_index(t, m, G, a.q_heads, g) * T::kD + chunk * 8 : a.q;
    cp_async_16(dst + swizzled_offset(row, chunk, T::kWarpgroupRows), src, valid);
  }
}

// Key column of accumulator i of the lane (the wgmma accumulator layout below).
__device__ __forceinline__ int dense_wgmma_column(int i, int lane) { return 8 * (i / 4) + 2 * (lane % 4) + (i % 2); }

// Online-softmax state of one thread's two rows (lane / 4 and lane / 4 + 8 of its warp's 16)
// in the wgmma accumulator layout: o[4n + 2r + {0, 1}] is row r, columns 8n + 2 (lane % 4)
// + {0, 1}. m: running max of the scaled (log2-domain) logits; l: the lane's share of the
// running sum (quad-reduced at the end).
template <int D>
struct DenseWgmmaRows {
  static constexpr int kO = D / 2;  // accumulators of an m64nD tile per thread
  float o[kO];
  float m[2];
  float l[2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] = 0.0f;
    m[0] = m[1] = kNegInf;
    l[0] = l[1] = 0.0f;
  }

  // S = Q K^T of one key tile into s (q_addr: the warpgroup's Q, k_addr: the tile's K): one
  // wgmma commit group, not waited for.
  static __device__ __forceinline__ void issue_scores(float (&s)[64], uint32_t q_addr, uint32_t k_addr) {
    using T = DenseWgmmaTraits<D>;
    wgmma_fence();
    wgmma_m64n128_ss<D>(s, q_addr, T::kWarpgroupRows, k_addr, T::kKeys);
    wgmma_commit();
  }

  // The online softmax of a finished score tile s: m updated, l rescaled and summed, the
  // factor alpha that O takes before the tile's P V (rescale), and P = 2^(S - m) as f32 in s
  // (pack_probabilities rounds it to bf16 fragments later). With `masked`, key column c is
  // visible to row r iff c <= limit[r]; the mask is a branch of its own, so that tiles without
  // one skip its 64 compares and selects (folded into the scaling loop, the compiler
  // predicates it on every tile).
  __device__ __forceinline__ void softmax(float (&s)[64], float scale_log2, bool masked, const int (&limit)[2],
                                          float (&alpha)[2]) {
    const int lane = threadIdx.x % 32;
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] *= scale_log2;
    if (masked) {
#pragma unroll
      for (int i = 0; i < 64; ++i)
        if (dense_wgmma_column(i, lane) > limit[(i % 4) / 2]) s[i] = kNegInf;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) tile_max[(i % 4) / 2] = fmaxf(tile_max[(i % 4) / 2], s[i]);
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(tile_max[r]));
      m_use[r] = m_new == kNegInf ? 0.0f : m_new;  // nothing visible yet: p = 0, no NaN
      alpha[r] = fast_exp2(m[r] - m_use[r]);       // 0 while m is -inf
      m[r] = m_new;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = j % 2;
        const float p0 = fast_exp2(s[8 * k + 2 * j] - m_use[r]);
        const float p1 = fast_exp2(s[8 * k + 2 * j + 1] - m_use[r]);
        l[r] += p0 + p1;
        s[8 * k + 2 * j] = p0;
        s[8 * k + 2 * j + 1] = p1;
      }
  }

  // P (f32 in s, from softmax) as bf16 A fragments.
  static __device__ __forceinline__ void pack_probabilities(const float (&s)[64], uint32_t (&p)[8][4]) {
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) p[k][j] = pack_bf16(s[8 * k + 2 * j], s[8 * k + 2 * j + 1]);
  }

  __device__ __forceinline__ void rescale(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < kO; ++i) o[i] *= alpha[(i % 4) / 2];
  }

  // O += P V (v_addr: the tile's V [keys x D], read MN-major): one wgmma commit group, not
  // waited for (o and p stay in use until then).
  __device__ __forceinline__ void issue_values(const uint32_t (&p)[8][4], uint32_t v_addr) {
    using T = DenseWgmmaTraits<D>;
    fence_operands(o);  // the rescale stays before the MMAs that accumulate into o
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < T::kKeys / 16; ++k) {
      const uint64_t v = wgmma_descriptor(v_addr + k * 16 * 128, T::kKvBytes / 2, 1024);
      if constexpr (D == 128)
        wgmma_m64n128k16_rs_tb(o, p[k], v, 1);
      else
        wgmma_m64n80k16_rs_tb(o, p[k], v, 1);
    }
    wgmma_commit();
  }

  // O / l (f32 or bf16, store_output2) and the natural-log LSE of row r, only where the row
  // is part of the tile.
  __device__ __forceinline__ void store(const DenseArgs& a, const DenseRow (&row)[2]) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(l[r]);  // every lane: shuffles
      if (!row[r].valid) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int64_t first = row[r].index * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        store_output2(a.o, a.o_bf16, first + 8 * n + 2 * (lane % 4), o[4 * n + 2 * r] * inv,
                      o[4 * n + 2 * r + 1] * inv);
      if (lane % 4 == 0) a.lse[row[r].index] = sum > 0.0f ? (m[r] + log2f(sum)) * kLn2 : kNegInf;
    }
  }
};

// One CTA per 128-row tile (blockIdx.x, dense_tile) and KV group (blockIdx.y); the key loop
// is the software pipeline of the header. kUnion: the query-major sparse forward
// (attention_sparse_union.cuh): the CTA's key tiles are its union's blocks (u.count of them,
// ascending) instead of 0 .. the last row's; a row sees a block's keys only if its query's bit
// is set, so the mask is per tile and row (limit -1: none of the block); D = B = 128, G
// divides 128. Both warpgroups take every step of the union (the stages and the ping-pong
// turns are shared), but a warpgroup issues MMAs only on the blocks one of its 64 / G queries
// selected.
template <int D, bool kUnion = false>
__global__ void __launch_bounds__(DenseWgmmaTraits<D>::kThreads, 1)
    dense_wgmma_kernel(const __grid_constant__ DenseArgs a, const __grid_constant__ TileUnions u) {
  static_assert(!kUnion || D == 128, "union blocks are 128 keys of D = 128");
  using T = DenseWgmmaTraits<D>;
  extern __shared__ uint4 smem_raw[];  // same declaration as the other kernels of this namespace
  // Aligned by an offset from smem_raw, so that the pointers stay in the shared window.
  const uint32_t align_pad = (1024u - (smem_address(smem_raw) & 1023u)) & 1023u;
  // [stage][K, V], Q[2], output rows, barriers
  unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw) + align_pad;

  const int G = static_cast<int>(a.group);
  const DenseTile tile = dense_tile(a.tile_start, a.batch, a.q_start, a.k_len, G, T::kRows, a.causal);
  if (!tile.valid) return;  // CTA-uniform, before any barrier
  const int64_t g = blockIdx.y;
  const UnionBlock* union_blocks = nullptr;
  int union_count = 0;
  if constexpr (kUnion) {
    const int64_t at = static_cast<int64_t>(blockIdx.x) * a.kv_heads + g;
    union_count = u.count[at];
    if (union_count < 0) return;  // kv_major's tile (CTA-uniform, before any barrier)
    union_blocks = u.blocks + at * u.cap;
  }
  const int tiles = kUnion ? union_count : static_cast<int>(tile.last_pos / T::kKeys + 1);
  // Key tile of step u: u, or the union's u-th block.
  const auto key_tile = [&](int u) -> int64_t {
    if constexpr (kUnion)
      return union_blocks[u].block;
    else
      return u;
  };
  const auto slot = [&](int u) { return smem + (u % T::kStages) * 2 * T::kKvBytes; };
  int64_t* out_row = reinterpret_cast<int64_t*>(smem + T::kStages * 2 * T::kKvBytes + 2 * T::kQBytes);
  // full[s] (count 128): every producer thread's copy-arrive for the tile in stage s;
  // empty[s] (count 256): every consumer thread once its warpgroup's MMAs on the stage retired.
  const uint32_t bars = smem_address(out_row + T::kRows);
  const auto full = [&](int s) { return bars + 8 * s; };
  const auto empty = [&](int s) { return bars + 8 * (T::kStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(full(s), T::kProducerThreads);
      mbar_init(empty(s), T::kConsumerThreads);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers' initialisation is visible to every thread

  // One if/else over whole warpgroups: what setmaxnreg needs to take effect.
  if (threadIdx.x >= T::kConsumerThreads) {
    // Producer: K(u) and V(u) into stage u % 3 once the stage's previous tile (u - 3) is
    // released by both consumer warpgroups.
    setmaxnreg_dec<T::kProducerRegisters>();
    const int p = threadIdx.x - T::kConsumerThreads;
    for (int u = 0; u < tiles; ++u) {
      const int s = u % T::kStages;
      if (u >= T::kStages) mbar_wait(empty(s), (u / T::kStages - 1) & 1);
      const int64_t key = key_tile(u);
      load_dense_operand_swizzled<D>(a.k, tile.seq, g, tile.k_len, key, slot(u), p);
      load_dense_operand_swizzled<D>(a.v, tile.seq, g, tile.k_len, key, slot(u) + T::kKvBytes, p);
      mbar_arrive_on_copies(full(s));
    }
    return;
  }
  setmaxnreg_inc<T::kConsumerRegisters>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;

  // The warpgroup's rows: which key tiles it visits, which need the causal mask.
  const int64_t wg_first = tile.first_row + wg * T::kWarpgroupRows;
  const bool wg_active = wg_first <= tile.last_row;
  const int64_t wg_last = wg_first + T::kWarpgroupRows - 1 < tile.last_row ? wg_first + T::kWarpgroupRows - 1
                                                                          : tile.last_row;
  const int64_t wg_min_pos = tile.row_pos(wg_active ? wg_first : tile.last_row, G);
  const int64_t wg_max_pos = tile.row_pos(wg_active ? wg_last : tile.last_row, G);

  const DenseWarpRows w = dense_warp_rows(tile, warp, G);
  DenseRow row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) row[r] = dense_row(tile, w, lane, r, G, a.q_heads, g);

  unsigned char* q_smem = smem + T::kStages * 2 * T::kKvBytes + wg * T::kQBytes;
  DenseWgmmaRows<D> state;
  load_dense_q_swizzled<D>(a, tile, G, g, wg, q_smem);
  cp_async_commit();
  state.init();
  const uint32_t q_addr = smem_address(q_smem);
  // Key tiles 0 .. it reads (all of the union's).
  const int wg_tiles = !wg_active ? 0 : kUnion ? tiles : static_cast<int>(wg_max_pos / T::kKeys) + 1;
  // Tile t needs the causal mask iff wg_min_pos - 128 t < 127; then that difference is in
  // [-63, 126] (the warpgroup reads tile t only if 128 t <= wg_max_pos <= wg_min_pos + 63).
  const int row_rel[2] = {static_cast<int>(row[0].pos - wg_min_pos), static_cast<int>(row[1].pos - wg_min_pos)};
  // kUnion: the rows' query bits (the query's index in the tile; G divides 64), and the bits of
  // the warpgroup's 64 / G queries.
  const int query_bit[2] = {row_rel[0] + wg * (T::kWarpgroupRows / G), row_rel[1] + wg * (T::kWarpgroupRows / G)};
  const int wg_queries = T::kWarpgroupRows / G;
  const uint32_t wg_query_bits = (wg_queries >= 32 ? ~0u : (1u << wg_queries) - 1u) << (wg * wg_queries);
  // The output rows wait in shared memory until the store.
  if (lane % 4 == 0)
    for (int r = 0; r < 2; ++r) out_row[warp * kWarpRows + lane / 4 + 8 * r] = row[r].valid ? row[r].index : -1;
  cp_async_wait<0>();
  fence_async_shared();
  named_barrier_sync(1 + wg, 128);  // the warpgroup's Q landed (every thread's copies)

  // Ping-pong (FlashAttention-3): the warpgroups take turns issuing their MMAs of a step, so
  // that one's softmax runs while the other's MMAs occupy the tensor cores. Named barrier
  // 3 + w: warpgroup w waits there before issuing (bar.sync, 128 threads) for the other's
  // arrival (bar.arrive, 128) after its issue. Warpgroup 1 arrives once ahead so that
  // warpgroup 0 goes first, and skips its last arrival: both barriers see steps 0 .. tiles
  // pairs, whatever work each warpgroup has (every step is taken, with or without MMAs).
  const int my_turn = 3 + wg, other_turn = 3 + (1 - wg);
  if (wg == 1) named_barrier_arrive(other_turn, 256);
  const auto pass_turn = [&](int t) {
    if (wg == 0 || t < tiles) named_barrier_arrive(other_turn, 256);
  };

  float s[64];         // S(t), then P(t) as f32 until the next step packs it
  uint32_t p[8][4];    // P(t - 1) as bf16 A fragments, read by P V(t - 1)
  float alpha[2];      // O's factor before P V(t - 1)
  // Step t of a tile the warpgroup reads (kValues: P V(t - 1) runs during the softmax):
  // pack P(t - 1) into the fragments (released by the wait that ended step t - 1), issue
  // S(t) over it, rescale O (retired by that wait too), issue P V(t - 1), pass the turn, wait
  // for S(t), the softmax of tile t, wait for P V(t - 1). Each path from an MMA issue to its
  // wait is straight-line code of its own (ptxas serialises every wgmma when an MMA is in
  // flight across a loop's back edge, C7514, or a join of branches, C7518); the branches
  // between the paths are warpgroup-uniform.
  const auto attend = [&](int t, auto values) {
    constexpr bool kValues = decltype(values)::value;
    if constexpr (kValues) DenseWgmmaRows<D>::pack_probabilities(s, p);
    DenseWgmmaRows<D>::issue_scores(s, q_addr, smem_address(slot(t)));
    if constexpr (kValues) {
      state.rescale(alpha);
      state.issue_values(p, smem_address(slot(t - 1)) + T::kKvBytes);
      pass_turn(t);
      wgmma_wait<1>();  // S(t) is done; P V(t - 1) may run on
    } else {
      pass_turn(t);
      wgmma_wait<0>();
    }
    fence_operands(s);
    if constexpr (kUnion) {
      // A union block may lie past some rows' positions (another query's) or be unselected by
      // their query: diagonal spans more than [-63, 126], clamped so that the int sums hold.
      const UnionBlock block = union_blocks[t];
      const int64_t diagonal = wg_min_pos - int64_t{T::kKeys} * block.block;
      const int d = static_cast<int>(diagonal < T::kKeys ? (diagonal > -2 * T::kKeys ? diagonal : -2 * T::kKeys)
                                                         : T::kKeys);
      int limit[2];
#pragma unroll
      for (int r = 0; r < 2; ++r)
        limit[r] = (block.queries >> query_bit[r]) & 1u ? min(d + row_rel[r], T::kKeys - 1) : -1;
      state.softmax(s, a.scale_log2, limit[0] < T::kKeys - 1 || limit[1] < T::kKeys - 1, limit, alpha);
    } else {
      const int64_t diagonal = wg_min_pos - int64_t{T::kKeys} * t;  // in [-63, 126] where masked
      const int d = static_cast<int>(diagonal < T::kKeys ? diagonal : T::kKeys);
      const int limit[2] = {min(d + row_rel[0], T::kKeys - 1), min(d + row_rel[1], T::kKeys - 1)};
      state.softmax(s, a.scale_log2, diagonal < T::kKeys - 1, limit, alpha);
    }
    if constexpr (kValues) {
      wgmma_wait<0>();
      fence_operands(state.o);
    }
  };
  // Whether the warpgroup reads tile t (warpgroup-uniform). kUnion: a block none of the
  // warpgroup's queries selected is skipped: its scores would all be masked, which leaves m, l
  // and O exactly as they are (alpha 1, p 0), so the skip changes no bit of the output.
  const auto reads = [&](int t) {
    if constexpr (kUnion)
      return t < wg_tiles && (union_blocks[t].queries & wg_query_bits) != 0u;
    else
      return t < wg_tiles;
  };
  bool pending = false;  // P V of the previous tile is still to be issued
  for (int t = 0; t <= tiles; ++t) {
    // Every consumer thread waits for the stage of step t (even without MMAs on it), so that
    // its release below never runs a phase ahead of the producer.
    if (t < tiles) {
      mbar_wait(full(t % T::kStages), (t / T::kStages) & 1);
      fence_async_shared();  // the producer's cp.async writes -> this thread's wgmma reads
    }
    named_barrier_sync(my_turn, 256);
    const bool read = reads(t);
    if (read) {
      if (pending)
        attend(t, std::true_type{});
      else
        attend(t, std::false_type{});
    } else if (pending) {  // the last P V before a skipped tile or the end: tile t - 1's stage
      DenseWgmmaRows<D>::pack_probabilities(s, p);  // is released below, so it cannot wait
      state.rescale(alpha);
      state.issue_values(p, smem_address(slot(t - 1)) + T::kKvBytes);
      pass_turn(t);
      wgmma_wait<0>();
      fence_operands(state.o);
    } else {
      pass_turn(t);
    }
    pending = read;
    // The warpgroup's MMAs on tile t - 1 retired (each path above ends with none in flight).
    if (t > 0) mbar_arrive(empty((t - 1) % T::kStages));
  }
  // Written before the loop's barriers, by the quad leader of the same warp.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row[r].index = out_row[warp * kWarpRows + lane / 4 + 8 * r];
    row[r].valid = row[r].index >= 0;
  }
  state.store(a, row);
}

}  // namespace msa::cuda::attn
