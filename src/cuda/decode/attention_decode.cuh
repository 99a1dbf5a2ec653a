// Sparse and dense attention for decode / multi-token prediction (every request has Q <= 16
// queries): no sort, no work list. Dispatched by src/cuda/attention/attention.cu when
// batch.max_q_len <= 16, with a selection (sparse mode) or without (topk null: dense mode).
//
// Dense mode is the same kernel with an implicit union: U = every block [0, own block of
// the chunk's last query] of the request, and every row holds every unit, so step 1 below
// is skipped and the causal mask (keys t > pos) does the rest. The units are the 64-key
// tiles 0 .. last_pos / 64 (a tile past the last query's position holds no visible key);
// the host bounds them by ceil(max_k_len / 64) to choose S. A 1M-token context is 16384
// units: at S = 66 (batch 1, 4 KV heads, 132 SMs) ~250 units per CTA through the ring.
//
// Plan. Grid (splits S, kv_heads * row_chunks, batch), 4 warps = 128 threads per CTA.
// A CTA owns one request b, one KV group g, one chunk of QC = min(max_q_len, 64 / G) of the
// request's queries (rows = QC * G <= 64: one 16-row warp tile per warp, rows flattened
// query-major: row m = query m / G, head m % G) and split s of the chunk's work:
//   1. union: the CTA reads the chunk's QC selection rows (QC * slots <= 512 ids; a row ends
//      at its first -1; ids past a query's own block are dropped: they hold no visible key),
//      keeps the distinct ids (the union U, ascending) and a membership bitmap query x U.
//      Up to 32 entries (M3: Q <= 2) warp 0 does it in registers (warp_union: ballot, match,
//      one shuffle per distinct id, one barrier); up to 128 entries (M3: QC x 16 <= 64) each
//      thread ranks its entry against the others in shared memory (no sort); more entries
//      are bitonic-sorted in shared memory. Every CTA of (b, g, chunk) computes the same U.
//
// Where warp 0's instructions go (SASS path trace, decode_attention_kernel<128>, M3 Q = 1:
// G 16, top-16, S = 32, one fully visible 64-key unit per CTA, the split's partial store;
// warps 1-3 run only the copies and barriers). Union by shared-memory rank / by warp_union:
//   prologue (ids, row geometry, Q row pointers) + Q fragment loads   ~400 / ~370
//   union (topk read, row ends, rank, bitmap)                          864 / 286
//   load_unit: split + 2 x 8 cp.async (16-byte chunk addresses)        ~560 / ~560
//   ring control, membership, limits, votes                           ~130 / ~130
//   attend (64 HMMA QK^T + PV, 64 LDSM, softmax)                       ~650 / ~650
//   finish + partial store (2 rows x 32 STG.64 + lse)                  ~260 / ~260
//   total                                                             2894 / 2285
// (Nsight Compute's count per warp is the 4 warps' mean.) Same registers (172, no spills);
// outputs bitwise identical (same U, bitmap and order). With the key split below, warp_union
// makes the sparse decode faster at every context (bench/results/history.md).
//
// Key split (kSplitKeys, host-chosen when rows_per_cta = QC x G <= 16: M3 at Q = 1, G 4 at
// Q <= 4, G 3 at Q <= 5, G 1 at Q <= 16; sparse and dense mode): the CTA's rows are ONE warp
// tile, so without it warps 1-3 only copy. With it every warp holds the 16 rows and attends
// to keys [16 w, 16 w + 16) of each unit (attend<kMask, 16>: 16 HMMA + 8 LDSM each for QK^T
// and PV), with its own online softmax; the 4 (m, l, O) are merged in shared memory (m = max,
// l = sum l_w 2^(m_w - m), warps in order; -inf rows give weight 0, no NaN) through ring
// stage 0 (the 4 f32 O at pitch D + 8 are exactly one stage), and each warp stores a quarter
// of the columns (float4). K/V copies use load_tile_rows_async (stepped addresses, no
// per-chunk division) in this path. SASS path trace, decode_attention_kernel<128, true>, same
// M3 Q = 1 case: warp 0 1900 instead of 2285 (union 282, prologue + Q ~340, copies ~280,
// ring/limits ~115, attend ~330, merge + store ~400), warps 1-3 1521 (no union, no lse
// store); 168 registers (<64, true>: 95), no spills; static smem +512 B (m, l per warp and
// row). Results differ from the one-warp path only in summation order.
// What binds (Nsight Compute, 128K, batch 1): at Q = 1 latency, in this kernel and in the
// merge (6% occupancy; long-scoreboard, ring-barrier and instruction-fetch stalls); at Q = 8
// (<128, false>, 256 CTAs of 4 units each) the ring barrier, a third of the samples, at 31%
// of DRAM peak, when each unit's page ids were still loaded next to its copies. At batch 8,
// Q = 1 (<128, true>, 256 CTAs of 4 units) the instruction chain: 3,640 instructions per warp
// at 6.7 cycles each (bench/results/h200.md). Why 2 CTAs per SM (the grid target): 1, 4 or
// 8 were measured up to 1.66x, 1.5x and 2.4x slower (4 and 8: more merge). An L2 prefetch (cp.async.bulk.prefetch) of the
// units beyond the ring was slower too (bench/results/history.md).
//   2. units: U x (B / 64) sub-tiles of 64 keys; split s takes units
//      [s * per, (s + 1) * per), per = ceil(|U| * B / 64 / S). With Q = 1 (M3, 128K, batch 1)
//      |U| = 16 blocks = 32 units and S = 32: 128 CTAs, one 64-key unit (32 KB of K + V) each.
//   3. K/V of the CTA's units stream through a 3-stage cp.async ring (2 units in flight;
//      each unit's page ids are loaded a ring step before its copies are issued, so no copy
//      waits for a page-table round trip past the prologue's one); each warp runs the
//      shared warp tile (attention_block_tile.cuh) over the units its queries selected: a
//      unit no row of the warp holds is skipped (warp-uniform), rows whose query does not
//      hold it, and keys t > pos, are masked. One online softmax per row across all the
//      CTA's units.
//   4. S == 1: the CTA writes O and LSE itself. S > 1: it writes (O / l, lse2) partials for
//      each of its rows (lse2 = -inf and O = 0 when it saw no key of the row), and
//      decode_merge_kernel (PDL-launched, one CTA per output row, all partials loaded in
//      parallel) combines the S partials. Deterministic: no atomics, a fixed summation
//      order.
//
// Bytes (M3: G 16, D 128, B 128, top-16): per (request, group) 16 blocks x 2 x 32 KB = 1 MB;
// batch 1, Q = 1: 4 MB of K/V (~1 us at 4.4 TB/s) + 1 MB of f32 partials written and read
// (L2). 128 CTAs each with one 32 KB unit: latency-bound (topk read -> union -> one K/V
// round trip -> 16 MMAs -> partial store; ~2-3 us) plus the merge (~1 us: one round trip for
// the partials; launch hidden by PDL). Batch 64 (S = 1): 256 MB (58 us at the read
// ceiling): bandwidth-bound, 2 CTAs per SM x 2 units in flight = 128 KB per SM. The MMA
// work (mma.sync, 16 rows per warp) is ~4 * D * 64 * 16 flop per warp-unit: never the
// bottleneck.
//
// Shared memory (D = 128): 3 stages x (K + V) x 64 x 136 x 2 B = 104,448 B + the union
// scratch (3 x entries_pad ints + QC x entries_pad / 32 words, <= 7 KB; none in dense
// mode) + 560 B static (key split: the merge's m and l): 2 CTAs per SM.
//
// Graph safety: the grid depends only on host-known capacities (batch, kv_heads,
// max_q_len, max_k_len); the kernel reads q_start / k_len / topk from the device and CTAs
// beyond a request's actual queries exit (after pdl_wait, see pdl.cuh).
//
// fp8 K/V (kFp8, docs/msa.md §6.6): the same kernel with the unit loads of
// attention_decode_fp8.cuh (e4m3 codes and f32 scales through the ring, scales applied in f32:
// K on the scores, V on the probabilities). With the key split the warps build their MMA
// fragments from the codes in the ring stage (f16 Q K^T on row-scaled Q, bf16 P V; 5 stages,
// no tile, one barrier per unit); rows per warp widen each unit once per CTA into a bf16 tile
// (4 stages + the tile, a second barrier per unit), because there up to 4 warps read every
// code. Everything else (union, splits, masks, softmax, merges) is the bf16 kernel's code;
// kFp8 = false compiles to the bf16 kernel unchanged (same SASS).
#pragma once
#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/decode/attention_decode_fp8.cuh"
#include "cuda/launch.h"
#include "cuda/common/pdl.cuh"

#include <type_traits>

namespace msa::cuda::attn {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeMaxRows = kDecodeWarps * kWarpRows;  // 64 rows per CTA
constexpr int kDecodeStages = 3;
constexpr int kDecodeMaxEntries = 512;  // QC * slots <= 16 * 32
constexpr int kDecodeMaxQueries = 16;
constexpr int kDecodeNoBlock = 0x7fffffff;
constexpr int kDecodeMergeThreads = 128;
// Splits per (request, group, chunk) are at most its units: entries x (B / 64) <= 512 x 2.
constexpr int kDecodeMaxSplits = kDecodeMaxEntries * 2;

struct DecodeArgs {
  const uint16_t* q;  // [total_q, q_heads, D]
  KeyLayout k, v;
  int64_t q_heads, kv_heads;
  int group, block_size;
  const int64_t* q_start;  // [batch + 1]
  const int64_t* k_len;    // [batch]
  int64_t batch, total_q;
  const int32_t* topk;  // [kv_heads, total_q, slots]
  int slots;            // 0 in dense mode (topk null)
  int max_q_len;        // host capacity: queries per request beyond it are ignored
  int queries_per_cta;  // QC
  int row_chunks;       // ceil(max_q_len / QC)
  int rows_per_cta;     // QC * G: partial row pitch
  int splits;           // S
  int entries_pad;      // power of two >= max(32, QC * slots); 0 in dense mode (no union)
  float scale_log2;
  float* partial_o;    // [batch, kv_heads, row_chunks, S, rows_per_cta, D] (S > 1)
  float* partial_lse;  // [batch, kv_heads, row_chunks, S, rows_per_cta] log2 domain
  void* o;             // [total_q, q_heads, D], f32 or bf16 (o_bf16)
  bool o_bf16;
  float* lse;          // [total_q, q_heads]
  Fp8Kv k_fp8, v_fp8;  // kFp8: the codes (at k / v's paged layout, in bytes) and scales
};

template <int D>
constexpr size_t decode_stage_elems() {
  return size_t{2} * kKeyTile * smem_pitch<D>();  // K then V of one 64-key unit
}

// The K/V part of the shared memory: the bf16 ring, or (kFp8) the fp8 ring, with the key split
// read as MMA fragments (attention_decode_fp8.cuh, path 1), otherwise followed by the bf16
// tile that each unit is widened into (path 2).
template <int D, bool kFp8, bool kSplitKeys>
constexpr size_t decode_kv_smem_bytes() {
  if constexpr (!kFp8) return kDecodeStages * decode_stage_elems<D>() * sizeof(uint16_t);
  return fp8_stages<kSplitKeys>() * fp8_stage_bytes<D, kSplitKeys>() +
         (kSplitKeys ? 0 : decode_stage_elems<D>() * sizeof(uint16_t));
}

template <int D, bool kFp8 = false, bool kSplitKeys = false>
size_t decode_smem_bytes(int entries_pad, int queries_per_cta) {
  return decode_kv_smem_bytes<D, kFp8, kSplitKeys>() + size_t(3) * entries_pad * sizeof(int32_t) +
         size_t(queries_per_cta) * (entries_pad / 32) * sizeof(uint32_t);
}

// Exclusive prefix sum of one int per thread over the CTA (kDecodeThreads); returns the
// thread's offset, `total` gets the sum. Contains __syncthreads.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    if (w < warp) before += warp_sums[w];
    total += warp_sums[w];
  }
  return before + inclusive - value;
}

// The union of <= 32 selection entries (entries_pad == 32) by one warp: lane i holds entry
// i (query i / slots, slot i % slots). An entry is valid when no entry of its row up to it is
// -1 (a row ends at its first -1) and its block is at most its query's own block. Lane i's
// union index is the number of distinct valid ids below its id; union_size, unique[0, |U|)
// and member[q] (words = 1 per query; every q < queries_per_cta is written) are the results.
__device__ __forceinline__ void warp_union(const DecodeArgs& a, int g, int64_t first_query,
                                           int64_t first_query_pos, int entries, int32_t* unique,
                                           uint32_t* member, int& union_size) {
  const int lane = threadIdx.x % 32;
  const int query = lane / a.slots, slot = lane % a.slots;
  const int32_t block = lane < entries ? a.topk[(g * a.total_q + first_query + query) * a.slots + slot] : -1;
  const uint32_t ended = __ballot_sync(0xffffffffu, block < 0);  // -1s, and lanes >= entries
  const uint32_t row_so_far = ((2u << lane) - 1u) & ~((1u << (lane - slot)) - 1u);  // [row start, lane]
  const bool valid = !(ended & row_so_far) && block <= (first_query_pos + query) / a.block_size;
  const int32_t id = valid ? block : kDecodeNoBlock;
  const uint32_t same = __match_any_sync(0xffffffffu, id);
  const uint32_t firsts = __ballot_sync(0xffffffffu, valid && lane == __ffs(same) - 1);
  int index = 0;  // distinct valid ids below id (firsts: one lane per distinct id)
  for (uint32_t bits = firsts; bits != 0u; bits &= bits - 1u)
    index += __shfl_sync(0xffffffffu, id, __ffs(bits) - 1) < id;
  if ((firsts >> lane) & 1u) unique[index] = id;
  for (int q = 0; q < a.queries_per_cta; ++q) {
    const uint32_t word = __reduce_or_sync(0xffffffffu, valid && query == q ? 1u << index : 0u);
    if (lane == 0) member[q] = word;
  }
  if (lane == 0) union_size = __popc(firsts);
}

// kSplitKeys (host-chosen: rows_per_cta <= 16, one warp tile per CTA): every warp holds the
// CTA's 16 rows and takes keys [16 w, 16 w + 16) of each unit; the 4 online-softmax states are
// merged in shared memory (lse2-weighted, warps in order) and each warp stores a quarter of
// the columns. Otherwise warp w holds rows [16 w, 16 w + 16) and all 64 keys of each unit.
template <int D, bool kSplitKeys, bool kFp8 = false>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(const __grid_constant__ DecodeArgs a) {
  pdl_wait();  // before any global access: topk / q come from the previous kernels
  pdl_launch_dependents();

  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  constexpr int kWarpKeys = kSplitKeys ? kKeyTile / kDecodeWarps : kKeyTile;  // keys per warp per unit
  __shared__ int warp_sums[kDecodeWarps];
  __shared__ int union_size;
  __shared__ uint32_t first_mask[kDecodeWarps];
  // kSplitKeys: each warp's running max and sum of its 16 rows, for the merge.
  __shared__ float warp_m[kSplitKeys ? kDecodeWarps : 1][kWarpRows], warp_l[kSplitKeys ? kDecodeWarps : 1][kWarpRows];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = a.group, B = a.block_size;
  const int split = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y % a.kv_heads);
  const int chunk = static_cast<int>(blockIdx.y / a.kv_heads);
  const int64_t b = blockIdx.z;
  const int64_t q_begin = a.q_start[b];
  const int q_len = static_cast<int>(min(a.q_start[b + 1] - q_begin, int64_t{a.max_q_len}));
  const int q0 = chunk * a.queries_per_cta;  // first query (within the request) of the CTA
  const int nq = min(q_len - q0, a.queries_per_cta);
  if (nq <= 0) return;  // CTA-uniform, before any barrier
  const int64_t k_len = a.k_len[b];
  const int64_t first_pos = k_len - (a.q_start[b + 1] - q_begin);  // pos of query 0
  const int rows = nq * G;
  const int entries = nq * a.slots;
  const int n_pad = a.entries_pad;
  const int words = n_pad / 32;  // membership words per query

  // bf16: the ring of K/V stages. kFp8: the fp8 ring (`ring` then only names its start); with
  // the key split the warps read MMA fragments from its stages (kFragments), otherwise the
  // bf16 tile that each unit is widened into follows it (attention_decode_fp8.cuh, paths 1 and
  // 2). Both before the union scratch.
  constexpr bool kFragments = kFp8 && kSplitKeys;
  constexpr int kStages = kFp8 ? fp8_stages<kFragments>() : kDecodeStages;
  constexpr size_t kFp8StageBytes = fp8_stage_bytes<D, kFragments>();
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem_raw);
  uint8_t* fp8_ring = reinterpret_cast<uint8_t*>(smem_raw);
  uint16_t* fp8_tile = reinterpret_cast<uint16_t*>(fp8_ring + kStages * kFp8StageBytes);  // path 2
  int32_t* raw = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(smem_raw) +
                                            decode_kv_smem_bytes<D, kFp8, kSplitKeys>());
  int32_t* sorted = raw + n_pad;
  int32_t* unique = sorted + n_pad;
  uint32_t* member = reinterpret_cast<uint32_t*>(unique + n_pad);  // [QC][words]

  // This lane's two rows (lane / 4 and lane / 4 + 8 of the warp's 16). Their Q fragments
  // are loaded before the union so that the round trip overlaps the selection read.
  const int warp_row0 = kSplitKeys ? 0 : warp * kWarpRows;  // kSplitKeys: every warp, rows 0-15
  const bool warp_active = kSplitKeys || warp_row0 < rows;
  bool row_valid[2];
  int row_query[2], row_head[2];
  int64_t row_pos[2];
  const uint16_t* q_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = warp_row0 + lane / 4 + 8 * r;
    row_valid[r] = m < rows;
    const int query = m / G;  // one division: m % G as m / G and m % G cost two (SASS)
    row_query[r] = row_valid[r] ? query : 0;
    row_head[r] = row_valid[r] ? m - query * G : 0;
    row_pos[r] = first_pos + q0 + row_query[r];
    q_row[r] = row_valid[r]
                   ? a.q + ((q_begin + q0 + row_query[r]) * a.q_heads + int64_t{g} * G + row_head[r]) * D
                   : nullptr;
  }
  // kFragments: Q as f16 fragments in path 1's order, and each row's softmax factor.
  uint32_t qf[D / 16][4];
  float row_scale_log2[2];
  std::conditional_t<kFragments, Fp8WarpRowsState<D>, WarpRowsState<D>> state;
  state.init();
  if constexpr (kFragments)
    load_q_fragments_f16<D>(qf, q_row[0], q_row[1], a.scale_log2, row_scale_log2);  // warp_active
  else if (warp_active)
    load_q_fragments<D>(qf, q_row[0], q_row[1]);

  const bool dense = a.topk == nullptr;  // dense mode: every block up to last_pos (CTA-uniform)
  const int64_t last_pos = first_pos + q0 + nq - 1;

  // ---- 1. union of the chunk's selected blocks (sparse mode) ---------------------------
  if (!dense && n_pad == 32) {
    // At most 32 entries (M3: Q <= 2): warp 0 builds U and the bitmap in registers, one
    // entry per lane, with one barrier (the general path below: shared memory, 4 barriers,
    // ~3x the instructions of warp 0, which alone runs the tile at Q = 1). Same U (distinct,
    // ascending) and bitmap as the general path.
    if (warp == 0) warp_union(a, g, q_begin + q0, first_pos + q0, entries, unique, member, union_size);
    __syncthreads();
  } else if (!dense) {
    for (int i = threadIdx.x; i < n_pad; i += kDecodeThreads) {
      int32_t block = -1;
      if (i < entries) {
        const int ql = i / a.slots, s = i % a.slots;
        block = a.topk[(g * a.total_q + q_begin + q0 + ql) * a.slots + s];
      }
      raw[i] = block;
    }
    for (int i = threadIdx.x; i < a.queries_per_cta * words; i += kDecodeThreads) member[i] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < n_pad; i += kDecodeThreads) {
      bool valid = i < entries;
      if (valid) {
        const int ql = i / a.slots, s = i % a.slots;
        for (int t = 0; t <= s; ++t) valid = valid && raw[ql * a.slots + t] >= 0;  // -1 ends a row
        const int64_t own_block = (first_pos + q0 + ql) / B;
        valid = valid && raw[i] <= own_block;  // later blocks hold no visible key
      }
      sorted[i] = valid ? raw[i] : kDecodeNoBlock;
    }
    __syncthreads();
    if (n_pad <= kDecodeThreads) {
      // Few entries (M3: QC x slots <= 64): no sort. Thread i holds entry i; it is the first
      // of its id when no lower entry holds the same id, and its union index is the number
      // of first entries with a smaller id. Gives the same U (distinct, ascending) and the
      // same bitmap as the sort below, without its log^2 barriers.
      const int i = threadIdx.x;
      const int32_t x = i < n_pad ? sorted[i] : kDecodeNoBlock;
      bool first = x != kDecodeNoBlock;
      for (int j = 0; j < i && first; ++j) first = sorted[j] != x;
      const uint32_t first_bits = __ballot_sync(0xffffffffu, first);
      if (lane == 0) first_mask[warp] = first_bits;
      __syncthreads();
      if (x != kDecodeNoBlock) {
        int index = 0;
        for (int j = 0; j < n_pad; ++j)
          index += ((first_mask[j / 32] >> (j % 32)) & 1u) && sorted[j] < x;
        if (first) unique[index] = x;
        atomicOr(&member[(i / a.slots) * words + index / 32], 1u << (index % 32));
      }
      if (threadIdx.x == 0) {
        int total = 0;
  #pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) total += __popc(first_mask[w]);
        union_size = total;
      }
    } else {
      for (int i = threadIdx.x; i < n_pad; i += kDecodeThreads)
        if (sorted[i] == kDecodeNoBlock) raw[i] = -1;  // raw: the entry's block, or -1
      // Bitonic sort, ascending (n_pad is a power of two).
      for (int size = 2; size <= n_pad; size *= 2)
        for (int stride = size / 2; stride > 0; stride /= 2) {
          __syncthreads();
          for (int i = threadIdx.x; i < n_pad; i += kDecodeThreads) {
            const int j = i ^ stride;
            if (j > i) {
              const int32_t x = sorted[i], y = sorted[j];
              if ((x > y) == ((i & size) == 0)) {
                sorted[i] = y;
                sorted[j] = x;
              }
            }
          }
        }
      __syncthreads();
      {
        // Thread t owns sorted[t * per, (t + 1) * per): distinct-id starts, scanned.
        const int per = (n_pad + kDecodeThreads - 1) / kDecodeThreads;
        const int begin = threadIdx.x * per;
        int count = 0;
        for (int i = begin; i < min(begin + per, n_pad); ++i)
          count += sorted[i] != kDecodeNoBlock && (i == 0 || sorted[i] != sorted[i - 1]);
        int total = 0;
        int at = block_exclusive_scan(count, warp_sums, total);
        for (int i = begin; i < min(begin + per, n_pad); ++i)
          if (sorted[i] != kDecodeNoBlock && (i == 0 || sorted[i] != sorted[i - 1])) unique[at++] = sorted[i];
        if (threadIdx.x == 0) union_size = total;
      }
      __syncthreads();
      const int n_sorted = union_size;
      for (int i = threadIdx.x; i < entries; i += kDecodeThreads) {
        const int32_t block = raw[i];
        if (block < 0) continue;
        int lo = 0, hi = n_sorted - 1;  // block is in unique[0, n_sorted)
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (unique[mid] < block)
            lo = mid + 1;
          else
            hi = mid;
        }
        atomicOr(&member[(i / a.slots) * words + lo / 32], 1u << (lo % 32));
      }
    }
    __syncthreads();
  }

  // ---- 2. this split's units ---------------------------------------------------------
  // Dense: the 64-key tiles 0 .. last_pos / 64 (last_pos < 2^31: at most 2^25 units).
  // A block holds 1 << unit_shift units (B = 64 or 128, the launcher's check): shifts and
  // masks, not the integer divisions by B / 64 that every unit of the loop paid.
  const int unit_shift = B == 2 * kKeyTile ? 1 : 0;
  const int n_units = dense ? (last_pos < 0 ? 0 : static_cast<int>(last_pos / kKeyTile + 1))
                            : union_size << unit_shift;
  const int per = (n_units + a.splits - 1) / a.splits;
  const int unit_begin = min(n_units, split * per);
  const int my_units = min(n_units, unit_begin + per) - unit_begin;

  const auto unit_block = [&](int unit) -> int32_t {
    return dense ? unit >> unit_shift : unique[unit >> unit_shift];
  };
  const auto unit_sub = [&](int unit) { return (unit & ((1 << unit_shift) - 1)) * kKeyTile; };
  // The page ids (page_id_of) of unit i's block in the K and V caches, 0 past the split's
  // units. They are loaded ahead of the unit's copies: the prologue's units and the loop's
  // first all at once, then one ring step ahead. Loaded next to its copies, a unit's K id,
  // then its V id, each cost a page-table round trip that the copies and the attend of the
  // unit before them waited for (ncu, 128K batch 8: the loop's wait for the K id alone held
  // 7.6% of the kernel's warp samples).
  struct UnitPages {
    int32_t k = 0, v = 0;
  };
  const auto unit_pages = [&](int i) {
    UnitPages ids;
    if (i < my_units) {
      const int32_t block = unit_block(unit_begin + i);
      ids.k = page_id_of(a.k, b, block);
      ids.v = page_id_of(a.v, b, block);
    }
    return ids;
  };
  PageFaultNote page_note;  // reported after the loop (checked_page)
  const auto load_unit = [&](int i, const UnitPages& ids) {
    const int unit = unit_begin + i;
    const int32_t block = unit_block(unit);
    const int sub = unit_sub(unit);
    const int64_t left = last_pos + 1 - (int64_t{block} * B + sub);  // keys any row may see
    const int valid_rows = static_cast<int>(left < 0 ? 0 : (left > kKeyTile ? kKeyTile : left));
    if constexpr (kFp8) {
      load_fp8_unit_async<D, kFragments, kDecodeThreads>(fp8_ring + (i % kStages) * kFp8StageBytes, a.k, a.v,
                                                         a.k_fp8, a.v_fp8, block, ids.k, ids.v, sub, g,
                                                         valid_rows, page_note);
      return;
    }
    uint16_t* k_dst = ring + (i % kDecodeStages) * decode_stage_elems<D>();
    const uint16_t* k_src = checked_block_pointer(a.k, b, block, ids.k, g, page_note) + sub * a.k.token_stride;
    const uint16_t* v_src = checked_block_pointer(a.v, b, block, ids.v, g, page_note) + sub * a.v.token_stride;
    if constexpr (kSplitKeys) {  // the latency-bound path: stepped addresses
      load_tile_rows_async<D, kDecodeThreads, kKeyTile>(k_dst, k_src, a.k.token_stride, valid_rows);
      load_tile_rows_async<D, kDecodeThreads, kKeyTile>(k_dst + kKeyTile * kPitch, v_src, a.v.token_stride,
                                                        valid_rows);
    } else {  // (load_tile_rows_async here: decode_attention_kernel<64, false> spills at 128 registers)
      load_rows_async<D, kDecodeThreads>(k_dst, k_src, a.k.token_stride, kKeyTile, valid_rows);
      load_rows_async<D, kDecodeThreads>(k_dst + kKeyTile * kPitch, v_src, a.v.token_stride, kKeyTile,
                                         valid_rows);
    }
  };

  // ---- 3. attention over the units -----------------------------------------------------
  UnitPages ahead[kStages - 1];
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) ahead[i] = unit_pages(i);  // in flight together
  UnitPages next = unit_pages(kStages - 1);                         // the loop's first copies
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_units) load_unit(i, ahead[i]);
    cp_async_commit();
  }
  for (int i = 0; i < my_units; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // unit i landed everywhere; every warp is done with unit i - 1's stage
                      // (path 2: and with the tile, and the widening with unit i - 1's codes)
    if (i + kStages - 1 < my_units) load_unit(i + kStages - 1, next);
    cp_async_commit();
    next = unit_pages(i + kStages);  // used one iteration on: its round trip overlaps this attend
    const uint8_t* fp8_stage = fp8_ring + (i % kStages) * kFp8StageBytes;
    if constexpr (kFp8 && !kFragments) {  // every thread, active warp or not, before any `continue`
      widen_fp8_unit<D, kDecodeThreads>(fp8_tile, fp8_stage);
      __syncthreads();  // the tile holds unit i
    }
    if (!warp_active) continue;
    const int unit = unit_begin + i;
    const unsigned u = static_cast<unsigned>(unit) >> unit_shift;  // the unit's union index
    const int key0 = kSplitKeys ? warp * kWarpKeys : 0;  // the warp's keys of the unit
    const int64_t first_key = int64_t{unit_block(unit)} * B + unit_sub(unit) + key0;
    int limit[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool holds =
          row_valid[r] && (dense || ((member[row_query[r] * words + u / 32] >> (u % 32)) & 1u));
      limit[r] = holds ? tile_limit(row_pos[r], first_key) : -1;
    }
    if (!__any_sync(0xffffffffu, limit[0] >= 0 || limit[1] >= 0)) continue;  // warp-uniform
    // kFp8: the unit's K scales (then its V scales) in its ring stage, from the warp's first key.
    const float* key_scales = kFp8 ? fp8_stage_key_scales<D, kFragments>(fp8_stage) + key0 : nullptr;
    const float* value_scales = kFp8 ? key_scales + kKeyTile : nullptr;
    const bool all_visible = __all_sync(0xffffffffu, limit[0] >= kWarpKeys - 1 && limit[1] >= kWarpKeys - 1);
    if constexpr (kFragments) {
      constexpr int kCodePitch = fp8_code_pitch<D, true>();
      const uint8_t* key_codes = fp8_stage + key0 * kCodePitch;
      const uint8_t* value_codes = key_codes + kKeyTile * kCodePitch;
      if (all_visible)
        state.template attend_codes<false, kWarpKeys>(qf, key_codes, value_codes, row_scale_log2, kWarpKeys,
                                                      kWarpKeys, key_scales, value_scales);
      else
        state.template attend_codes<true, kWarpKeys>(qf, key_codes, value_codes, row_scale_log2, limit[0],
                                                     limit[1], key_scales, value_scales);
    } else {
      const uint16_t* keys =
          (kFp8 ? fp8_tile : ring + (i % kDecodeStages) * decode_stage_elems<D>()) + key0 * kPitch;
      const uint16_t* values = keys + kKeyTile * kPitch;
      if (all_visible)
        state.template attend<false, kWarpKeys, kFp8>(qf, keys, values, a.scale_log2, kWarpKeys, kWarpKeys,
                                                      key_scales, value_scales);
      else
        state.template attend<true, kWarpKeys, kFp8>(qf, keys, values, a.scale_log2, limit[0], limit[1],
                                                     key_scales, value_scales);
    }
  }
  cp_async_wait<0>();  // nothing left in flight at exit
  report_page_fault(a.k, b, page_note);
  if (!warp_active) return;

  // ---- 4. outputs ----------------------------------------------------------------------
  const int64_t pair = (b * a.kv_heads + g) * a.row_chunks + chunk;
  if constexpr (kSplitKeys) {
    // Merge the 4 warps' online-softmax states of the 16 rows: m = max_w m_w, l = sum_w l_w
    // 2^(m_w - m), O = sum_w 2^(m_w - m) O_w / l (warps in order). A warp that saw no key of
    // a row has m_w = -inf, l_w = 0, O_w = 0: weight 0; every warp (m = -inf): O = 0, lse
    // -inf (m_use = 0 keeps -inf - -inf out). The scaled O_w go to ring stage 0 (f32, pitch
    // D + 8: exactly one bf16 stage; kFp8: the start of the fp8 ring, 3 of its stages), free
    // once every warp passed the barrier below.
    constexpr int kOPitch = D + 8;
    static_assert(kDecodeWarps * kWarpRows * kOPitch * sizeof(float) <= decode_kv_smem_bytes<D, kFp8, true>(),
                  "decode: the warps' O fit in the ring");
    float l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = quad_sum(state.l[r]);
    if (lane % 4 == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        warp_m[warp][lane / 4 + 8 * r] = state.m[r];
        warp_l[warp][lane / 4 + 8 * r] = l[r];
      }
    }
    __syncthreads();  // every warp is done with the ring and has written its m and l
    float* merged_o = reinterpret_cast<float*>(ring);  // [warp][16 rows][pitch D + 8]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int m = lane / 4 + 8 * r;
      float max_m = kNegInf;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) max_m = fmaxf(max_m, warp_m[w][m]);
      const float m_use = max_m == kNegInf ? 0.0f : max_m;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) sum += warp_l[w][m] * exp2f(warp_m[w][m] - m_use);
      // sum >= 1 when max_m is finite (the maximum's own term), 0 otherwise.
      const float scale = sum > 0.0f ? __fdividef(exp2f(state.m[r] - m_use), sum) : 0.0f;
      state.store_row(merged_o + (warp * kWarpRows + m) * kOPitch, r, scale);
      if (warp == 0 && lane % 4 == 0 && row_valid[r]) {
        const float lse2 = lse2_total(max_m, sum);
        if (a.splits == 1) {
          const int64_t out_row = (q_begin + q0 + row_query[r]) * a.q_heads + int64_t{g} * G + row_head[r];
          a.lse[out_row] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
        } else {
          a.partial_lse[(pair * a.splits + split) * a.rows_per_cta + m] = lse2;
        }
      }
    }
    __syncthreads();
    // Warp w sums and stores columns [w D / 4, (w + 1) D / 4) of the 16 rows: float4 each.
    constexpr int kVecs = D / kDecodeWarps / 4;  // float4 per row and warp
    constexpr int kRowsPerPass = 32 / kVecs;
    const int col = warp * (D / kDecodeWarps) + (lane % kVecs) * 4;
#pragma unroll
    for (int pass = 0; pass < kWarpRows / kRowsPerPass; ++pass) {
      const int m = pass * kRowsPerPass + lane / kVecs;
      if (m >= rows) continue;
      float4 o = *reinterpret_cast<const float4*>(merged_o + m * kOPitch + col);
#pragma unroll
      for (int w = 1; w < kDecodeWarps; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(merged_o + (w * kWarpRows + m) * kOPitch + col);
        o.x += x.x;
        o.y += x.y;
        o.z += x.z;
        o.w += x.w;
      }
      if (a.splits == 1) {
        const int query = m / G;
        const int64_t out_row = (q_begin + q0 + query) * a.q_heads + int64_t{g} * G + (m - query * G);
        store_output2(a.o, a.o_bf16, out_row * D + col, o.x, o.y);
        store_output2(a.o, a.o_bf16, out_row * D + col + 2, o.z, o.w);
      } else {
        const int64_t partial = (pair * a.splits + split) * a.rows_per_cta + m;
        *reinterpret_cast<float4*>(a.partial_o + partial * D + col) = o;  // zeros when lse2 = -inf
      }
    }
  } else {
    float inv[2], lse2[2];
    state.finish(inv, lse2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!row_valid[r]) continue;
      if (a.splits == 1) {
        const int64_t out_row = (q_begin + q0 + row_query[r]) * a.q_heads + int64_t{g} * G + row_head[r];
        state.store_output_row(a.o, a.o_bf16, out_row * D, r, inv[r]);
        if (lane % 4 == 0) a.lse[out_row] = lse2[r] == kNegInf ? kNegInf : lse2[r] * kLn2;
      } else {
        const int m = warp_row0 + lane / 4 + 8 * r;
        const int64_t partial = (pair * a.splits + split) * a.rows_per_cta + m;
        state.store_row(a.partial_o + partial * D, r, inv[r]);  // zeros when lse2 = -inf
        if (lane % 4 == 0) a.partial_lse[partial] = lse2[r];
      }
    }
  }
}

// One CTA per output row (request b, query i < max_q_len, q-head), every partial read in
// parallel (the previous one-warp-per-row loop paid two dependent L2 round trips per split:
// ~64 serial loads, ~10+ us, at S = 32):
//   1. LSE2 over the S partial lse2 (threads over splits; block max, then block sum in warp
//      order); the weights w_s = 2^(lse2_s - LSE2) (0 for splits that saw no key of the row)
//      go to shared memory.
//   2. O = sum_s w_s O_s: thread (phase, c) owns 4 columns [4c, 4c + 4) and the splits
//      s = phase, phase + P, ... (P = 128 / (D / 4) phases) in increasing order, their loads
//      issued kMergeUnroll at a time (the first batch before step 1's barriers); the P
//      phase sums are added in phase order. Deterministic: a fixed summation order.
// The partial O rows of every split are written by decode_attention_kernel (zeros for a split
// that saw no key), so every load reads written data.
template <int D>
__global__ void __launch_bounds__(kDecodeMergeThreads)
    decode_merge_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int kVec = 4;
  constexpr int kColThreads = D / kVec;
  constexpr int kPhases = kDecodeMergeThreads / kColThreads;
  constexpr int kMergeUnroll = 8;
  constexpr int kStep = kPhases * kMergeUnroll;
  static_assert(kDecodeMergeThreads % kColThreads == 0, "merge: whole phases");
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ float reduce[kDecodeMergeThreads / 32];
  __shared__ float4 phase_sum[kPhases][kColThreads];
  pdl_wait();
  pdl_launch_dependents();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col = threadIdx.x % kColThreads, phase = threadIdx.x / kColThreads;
  const int64_t row_id = blockIdx.x;
  const int64_t per_request = int64_t{a.max_q_len} * a.q_heads;
  const int64_t b = row_id / per_request;
  if (b >= a.batch) return;  // CTA-uniform
  const int qi = static_cast<int>((row_id % per_request) / a.q_heads);
  const int head = static_cast<int>(row_id % a.q_heads);
  const int G = a.group;
  const int g = head / G;
  const int chunk = qi / a.queries_per_cta;
  const int m = (qi % a.queries_per_cta) * G + head % G;
  const int64_t first = (((b * a.kv_heads + g) * a.row_chunks + chunk) * a.splits) * a.rows_per_cta + m;
  const int64_t pitch = a.rows_per_cta;
  const int S = a.splits;
  // Partial rows exist for every (b, g, chunk < row_chunks, split, m < rows_per_cta): the
  // loads below stay in bounds even for a query beyond the request's (checked after them).
  const float* o_base = a.partial_o + first * D + col * kVec;
  float4 x[kMergeUnroll];
  const auto load_batch = [&](int base) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = base + u * kPhases + phase;
      x[u] = s < S ? *reinterpret_cast<const float4*>(o_base + int64_t{s} * pitch * D)
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  const int64_t q_begin = a.q_start[b];
  const int64_t q_end = a.q_start[b + 1];
  load_batch(0);
  float row_max = kNegInf;
  for (int s = threadIdx.x; s < S; s += kDecodeMergeThreads) {
    const float value = a.partial_lse[first + s * pitch];
    weight[s] = value;
    row_max = fmaxf(row_max, value);
  }
  if (qi >= min(q_end - q_begin, int64_t{a.max_q_len})) return;  // CTA-uniform, before any barrier

  // ---- 1. LSE2 and the weights
  row_max = warp_max(row_max);
  if (lane == 0) reduce[warp] = row_max;
  __syncthreads();
  row_max = reduce[0];
#pragma unroll
  for (int w = 1; w < kDecodeMergeThreads / 32; ++w) row_max = fmaxf(row_max, reduce[w]);
  __syncthreads();  // reduce[] is reused below
  float sum = 0.0f;
  if (row_max != kNegInf)
    for (int s = threadIdx.x; s < S; s += kDecodeMergeThreads) sum += exp2f(weight[s] - row_max);
  sum = warp_sum(sum);
  if (lane == 0) reduce[warp] = sum;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kDecodeMergeThreads / 32; ++w) total += reduce[w];
  const float lse2 = lse2_total(row_max, total);
  for (int s = threadIdx.x; s < S; s += kDecodeMergeThreads) weight[s] = lse2_weight(weight[s], lse2);
  __syncthreads();

  // ---- 2. O
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int base = 0; base < S; base += kStep) {
    if (base > 0) load_batch(base);
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = base + u * kPhases + phase;
      const float w = s < S ? weight[s] : 0.0f;
      if (w != 0.0f) {
        acc.x += w * x[u].x;
        acc.y += w * x[u].y;
        acc.z += w * x[u].z;
        acc.w += w * x[u].w;
      }
    }
  }
  phase_sum[phase][col] = acc;
  __syncthreads();
  const int64_t out_row = (q_begin + qi) * a.q_heads + head;
  if (phase == 0) {
    float4 o = phase_sum[0][col];
#pragma unroll
    for (int p = 1; p < kPhases; ++p) {
      const float4 v = phase_sum[p][col];
      o.x += v.x;
      o.y += v.y;
      o.z += v.z;
      o.w += v.w;
    }
    store_output2(a.o, a.o_bf16, out_row * D + col * kVec, o.x, o.y);
    store_output2(a.o, a.o_bf16, out_row * D + col * kVec + 2, o.z, o.w);
  }
  if (threadIdx.x == 0) a.lse[out_row] = lse2 == kNegInf ? kNegInf : lse2 * kLn2;
}

}  // namespace msa::cuda::attn
