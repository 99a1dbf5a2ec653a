// KL backward of the indexer (docs/msa.md §5), the KV-block-major pass over selection entries.
//
// Where the time goes without the measures below (from the code and the timings; H200, M3
// at 128K: Hq 64, Hi 4, D = Di = B = 128, top-16: the KL backward then ran at 4% of peak,
// ~165 ms). E = 8.4M entries, I ~ 135K items of <= 64 entries, ~1030 items per SM: ~160 us
// (~300K clocks) per item.
//   1. The student LSE (indexer_selected_lse, row-major: one warp per row, f32 FMAs)
//      reads 16 x 32 KB of index keys per row = 268 GB from L2, plus 137 G FMAs and as
//      many bf16 -> f32 converts: ~64 ms (the training indexer's time with lse_out less
//      the prefill indexer's; 32K: ~16 of ~43 ms). Dominant.
//   2. Teacher phase, per item 1024 (entry, head) rows x 128 keys: 8192 mma (+ 2.6K for
//      student, dqi, dki hi/lo; ~10.8K mma ~ 17K clocks at mma.sync rate: 6% of the
//      item), 131K exp2 (~8K clocks of MUFU), and 3 shuffles per value (12.3K warp
//      shuffles) in a runtime-trip-count loop (Gp is a runtime value): not unrolled, so
//      each lane ran 32 serial exp -> 3 dependent shuffle chains per 64-key sub-tile
//      (~4-5K clocks), 16 sub-tiles per warp per item, 8 warps per SM (2 per scheduler)
//      to hide it: ~70-80K clocks per item. Second dominant.
//   3. Q gathered synchronously at the top of each m-tile (16 rows x 256 B, 4 KB per
//      entry = 34 GB at 128K, from HBM: each query row is read by its 16 slots at random
//      times) through per-load branches: ~1-2K clocks exposed per m-tile, 8 per warp.
//   4. Smaller: loads not overlapped with compute (4 barriers per item, K + KI 64 KB from
//      L2, qi 16 KB); student phase on 4 of 8 warps; 158.7 KB smem and ~230-250 registers:
//      one CTA (8 warps) per SM; dqi partials E x Di x 4 = 4.3 GB written and read back by
//      the row reduce (~2 ms); deterministic dki partials 64 KB per item = 8.9 GB written
//      and read (~4-6 ms incl. the reduce's tail of early blocks; fast mode: 2.2G f32
//      atomics instead); selection inversion (4 chunks of 2.1M keys) ~1-2 ms.
// Hence: (1) the student LSE runs on the tensor cores over the same items
// (indexer_kl_student_lse.cuh: a KI block loaded once per 64 entries); (2) the teacher's
// group sum is unrolled warp-uniform butterfly steps after all exps of a sub-tile (for
// Gp = 16 the two halves are folded first: 48 shuffles per lane per sub-tile, not 96);
// (3) the next m-tile's Q rows and LSE are prefetched into L1 (prefetch.global.L1, no
// registers; a register double buffer spilled) while the current tile computes, and the
// Q loads are branch-free. Next: overlap the next item's K / KI loads with the student and
// dki phases, reduce dqi on chip.
//
// Work items come from the selection inversion of the sparse forward
// (selection_inversion.cuh): an item is up to kItemEntries entries (query rows of one
// index head g, ordered by query) that selected the same key block of one sequence. A
// persistent CTA of 8 warps takes items strided over the grid; per item:
//   0. cp.async: K block of KV head g [B, D], index keys [B, Di], the entries' qi rows
//      [64, Di] (bf16, pitch +8 elements), entry metadata to shared memory.
//   1. teacher: rows = (entry, head) pairs, each entry padded to Gp = next power of two
//      >= G rows, 16-row m-tiles over the warps (Q rows of the next m-tile prefetched into
//      L1 while this one computes): S = Q K^T (mma.m16n8k16), p = exp2(scale log2e S - log2e
//      LSE_r) for visible keys, summed over the entry's G rows by butterfly shuffles ->
//      p_t [entry, key] (f32, shared). The student LSE comes from the earlier
//      kl_student_lse pass (indexer_kl_student_lse.cuh).
//   2. student: 16-entry m-tiles (warp w: entries 16w..16w+15): S_i = qi . ki (mma),
//      log p_s = logit_scale S_i - lse_s, ds = p_s - p_t, loss += p_t (log p_t - log p_s);
//      dqi partial = ds . KI (mma; ds split into bf16 hi + lo parts so the product keeps
//      ~16 bits of ds) -> global dqi_partial[entry], loss_partial[entry]; ds hi/lo staged
//      as bf16 [entry, key] in shared memory.
//   3. dki: [B, Di] = DS^T QI over the item's entries (mma, A by ldmatrix.trans of the
//      staged ds), warp w owns 16-key x Di/2 tiles w and w + 8. Deterministic mode writes
//      the item's partial (dki_partial[item]) and item_slot[first entry] = item; the
//      reduce kernel sums the partials of a key block in a fixed order. Fast mode adds
//      grad_scale * partial into dki with atomicAdd.
// Every phase ends in a CTA barrier (the next phase reads what the previous one wrote;
// the next item's loads overwrite the buffers).
// With the teacher given (EntryArgs::teacher, written by the attention backward from its own P:
// AttentionBackwardLaunch::kl_teacher), kl_given_teacher_kernel (at the end of this file) runs
// phases 2 and 3 only, on p_t rows loaded with the other operands a stage ahead.
//
// Shared memory (B = D = Di = 128): K 34,816 + KI 34,816 + qi 17,408 + ds hi/lo 2 x 17,408
// + p_t 34,816 + entries 2,048 = 158,720 bytes: one CTA per SM.
//
// Cost per entry (M3, G = 16, D = Di = B = 128): teacher 2 G D B = 524 KFLOP, student and
// dqi/dki (hi + lo) 2 B Di (1 + 2 + 2) = 164 KFLOP; HBM: qi row and dqi partial (0.8 KB),
// Q rows of the group gathered (4 KB, the dominant traffic), the item's K/KI blocks shared
// by up to 64 entries; deterministic mode adds the item's dki partial (64 KB per item).
#pragma once
#include <cuda_bf16.h>

#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/training/kl_launch.h"
#include "cuda/attention/selection_inversion.cuh"

namespace msa::cuda::kl {

using attn::kKeyTile;
using attn::kLog2e;
using attn::smem_pitch;
using attn::WorkItem;

constexpr int kKlWarps = 8;
constexpr int kKlThreads = kKlWarps * 32;
constexpr int kItemEntries = 64;  // entries per work item (queries_per_item of the inversion)

// An entry of the current item, decoded once into shared memory.
struct EntryInfo {
  int64_t q;        // global query row (-1: padding)
  int64_t pos;      // its position (-1: padding, sees no key)
  int64_t partial;  // index into dqi_partial / loss_partial ((ql * Hi + g) * slots + s)
  float student_lse;
  float pad;
};

struct EntryArgs {
  const uint16_t* q;  // [total_q, q_heads, D]
  KeyLayout k;        // [total_k, kv_heads, D]
  const float* main_lse;  // [total_q, q_heads]
  const uint16_t* qi;     // [total_q, Hi, Di]
  KeyLayout ki;           // [total_k, Di]
  int64_t q_heads, kv_heads, group, group_pad;  // group_pad: next power of two >= group
  int block_size;
  const int64_t* q_start;
  const int64_t* k_len;
  const int32_t* seq_of_query;
  int64_t total_q, q_begin, slots, nblk;  // q_begin: the chunk's first query row
  int qbits;
  const uint64_t* keys;  // sorted selection keys of the chunk
  const WorkItem* items;
  const unsigned* item_count;
  const float* student_lse;  // [Hi, total_q] (written per chunk by the student LSE pass)
  float2* student_partial;   // [chunk_q * Hi * slots, 2]: (max, sum) of each 64-key half
  float scale_log2;          // main scale * log2(e)
  float logit_scale;         // index_scale / temperature
  float* dqi_partial;        // [chunk_q * Hi * slots, Di]
  float* loss_partial;       // [chunk_q * Hi * slots]
  float* dki_partial;        // deterministic: [item_bound, B, Di]; null in fast mode
  int32_t* item_slot;        // deterministic: [entries] item index by its first sorted entry
  float* dki;                // fast mode: [total_k, Di] (atomicAdd target, pre-zeroed)
  float grad_scale;          // fast mode: logit_scale * loss_scale
  const float* teacher;      // [Hi, total_q, slots, B]: p_t given (kl_given_teacher_kernel), else null
};

// Row pitch (elements) of the [entry, key] buffers p_t (f32) and ds (bf16): +8 keeps
// ldmatrix rows 16-byte aligned and spreads consecutive rows over the banks.
__host__ __device__ constexpr int entry_key_pitch(int B) { return B + 8; }

// Shared-memory plan, in bytes (every offset a multiple of 16).
template <int D, int Di>
struct KlSmem {
  static constexpr int kKPitch = smem_pitch<D>();
  static constexpr int kIPitch = smem_pitch<Di>();
  __host__ __device__ static constexpr size_t k_offset() { return 0; }
  __host__ __device__ static constexpr size_t ki_offset(int B) {
    return k_offset() + size_t(B) * kKPitch * 2;
  }
  __host__ __device__ static constexpr size_t qi_offset(int B) {
    return ki_offset(B) + size_t(B) * kIPitch * 2;
  }
  __host__ __device__ static constexpr size_t ds_hi_offset(int B) {
    return qi_offset(B) + size_t(kItemEntries) * kIPitch * 2;
  }
  __host__ __device__ static constexpr size_t ds_lo_offset(int B) {
    return ds_hi_offset(B) + size_t(kItemEntries) * entry_key_pitch(B) * 2;
  }
  __host__ __device__ static constexpr size_t pt_offset(int B) {
    return ds_lo_offset(B) + size_t(kItemEntries) * entry_key_pitch(B) * 2;
  }
  __host__ __device__ static constexpr size_t entries_offset(int B) {
    return pt_offset(B) + size_t(kItemEntries) * entry_key_pitch(B) * 4;
  }
  __host__ __device__ static constexpr size_t bytes(int B) {
    return entries_offset(B) + size_t(kItemEntries) * sizeof(EntryInfo);
  }
};

// The hi + lo bf16 split of x: hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void split_bf16(float x, float& hi, float& lo) {
  hi = __bfloat162float(__float2bfloat16_rn(x));
  lo = x - hi;
}

// d0 / d1 (the two n-tiles of B) += (A_hi + A_lo) B: ds as its bf16 hi + lo split, the hi
// product first.
__device__ __forceinline__ void mma_split_x2(float (&d0)[4], float (&d1)[4], const uint32_t (&a_hi)[4],
                                             const uint32_t (&a_lo)[4], const uint32_t (&b)[4]) {
  mma_bf16_16816_x2(d0, d1, a_hi, b);
  mma_bf16_16816_x2(d0, d1, a_lo, b);
}

// Where an item sits: index head g, key block, sequence, the position offset of its
// queries (pos = q + pos_offset) and the block's keys inside the sequence.
struct ItemGeometry {
  int64_t g, block, seq, pos_offset;
  int valid_keys;
};

__device__ __forceinline__ ItemGeometry decode_item(const EntryArgs& a, const WorkItem& item) {
  const uint64_t mask = (uint64_t{1} << a.qbits) - 1;
  const uint64_t first_key = a.keys[item.first];
  const int64_t group_block = static_cast<int64_t>(first_key >> a.qbits);
  ItemGeometry geo;
  geo.g = group_block / a.nblk;
  geo.block = group_block % a.nblk;
  geo.seq = a.seq_of_query[a.q_begin + static_cast<uint32_t>(first_key & mask) / static_cast<uint32_t>(a.slots)];
  const int64_t seq_first = a.q_start[geo.seq];
  geo.pos_offset = a.k_len[geo.seq] - (a.q_start[geo.seq + 1] - seq_first) - seq_first;
  const int64_t keys_left = a.k_len[geo.seq] - geo.block * a.block_size;
  geo.valid_keys = static_cast<int>(keys_left < a.block_size ? keys_left : a.block_size);
  return geo;
}

// Entry e of an item, from its sorted selection key: its query row within the chunk and slot.
struct EntrySlot {
  uint32_t local_q, slot;
};

__device__ __forceinline__ EntrySlot entry_slot(const EntryArgs& a, const WorkItem& item, int e) {
  const uint64_t mask = (uint64_t{1} << a.qbits) - 1;
  const uint32_t slots = static_cast<uint32_t>(a.slots);
  const uint32_t rest = static_cast<uint32_t>(a.keys[item.first + e] & mask);
  const uint32_t local_q = rest / slots;
  return {local_q, rest - local_q * slots};
}

// cp.async of one row per entry of the item into kItemEntries rows of `pitch` bytes at dst:
// row e (row_bytes, a multiple of 16) from row_of(entry_slot(e)), zero rows past item.count
// (their copies name `base`, the rows' tensor: one base register for both cases). Called by
// all kThreads threads; the caller commits and waits.
template <int kThreads, class RowOf>
__device__ __forceinline__ void load_entry_rows_async(const EntryArgs& a, const WorkItem& item, int row_bytes,
                                                      int pitch, void* dst, const void* base, RowOf row_of) {
  const int chunks = row_bytes / 16;
#pragma unroll 1  // unrolled, the copies' addresses pushed the student LSE kernel into a spill
  for (int c = threadIdx.x; c < kItemEntries * chunks; c += kThreads) {
    const int e = c / chunks, offset = (c % chunks) * 16;
    const bool valid = e < item.count;
    const char* from = static_cast<const char*>(base);
    if (valid) from = reinterpret_cast<const char*>(row_of(entry_slot(a, item, e))) + offset;
    cp_async_16(static_cast<char*>(dst) + e * pitch + offset, from, valid);
  }
}

// Threads 0..kItemEntries-1 decode the item's entries into shared memory (padding past
// item.count); with_lse: also the rows' student LSE (absent while the LSE pass computes it).
__device__ __forceinline__ void load_item_entries(const EntryArgs& a, const WorkItem& item,
                                                  const ItemGeometry& geo, bool with_lse,
                                                  EntryInfo* entries) {
  if (threadIdx.x >= kItemEntries) return;
  EntryInfo info{-1, -1, -1, 0.0f, 0.0f};
  if (static_cast<int>(threadIdx.x) < item.count) {
    const EntrySlot at = entry_slot(a, item, threadIdx.x);
    info.q = a.q_begin + at.local_q;
    info.pos = info.q + geo.pos_offset;
    info.partial = (int64_t{at.local_q} * a.kv_heads + geo.g) * a.slots + at.slot;
    if (with_lse) info.student_lse = a.student_lse[geo.g * a.total_q + info.q];
  }
  entries[threadIdx.x] = info;
}

// cp.async of the item's index operands: the KI block [B, Di] (rows past the sequence end
// zero) and the entries' qi rows [kItemEntries, Di] (zero past item.count), pitch Di + 8.
// Called by all kThreads threads; the caller commits and waits.
template <int Di, int kThreads>
__device__ __forceinline__ void load_index_operands_async(const EntryArgs& a, const WorkItem& item,
                                                          const ItemGeometry& geo, uint16_t* ki_smem,
                                                          uint16_t* qi_smem) {
  attn::load_rows_async<Di, kThreads>(ki_smem, block_pointer(a.ki, geo.seq, geo.block, 0), a.ki.token_stride,
                                      a.block_size, geo.valid_keys);
  load_entry_rows_async<kThreads>(a, item, Di * 2, smem_pitch<Di>() * 2, qi_smem, a.qi, [&a, g = geo.g](EntrySlot at) {
    return a.qi + ((a.q_begin + at.local_q) * a.kv_heads + g) * Di;
  });
}

// cp.async of the item's given teacher rows [kItemEntries, B] f32 (zero past item.count) into
// p_t at pitch entry_key_pitch(B): entry (q, g, slot) at ((g total_q + q) slots + slot) B.
template <int kThreads>
__device__ __forceinline__ void load_teacher_rows_async(const EntryArgs& a, const WorkItem& item,
                                                        const ItemGeometry& geo, float* pt) {
  const int B = a.block_size;
  load_entry_rows_async<kThreads>(a, item, B * 4, entry_key_pitch(B) * 4, pt, a.teacher, [&a, g = geo.g, B](EntrySlot at) {
    return a.teacher + ((g * a.total_q + a.q_begin + at.local_q) * a.slots + at.slot) * B;
  });
}

// Row r (0: lane row lane/4, 1: lane/4 + 8) of teacher m-tile `tile` (rows = n * Gp
// entry-major (entry, head) pairs): its entry and, when it is a real (entry, head) pair,
// its global q-head row; padding rows (e >= n or head >= G) give row 0 (always present).
struct TeacherRow {
  int64_t q_head, pos;  // pos -1: padding, sees no key
  int entry;
  bool valid;
};

__device__ __forceinline__ TeacherRow teacher_row(const EntryArgs& a, int64_t g, int n, const EntryInfo* entries,
                                                  int tile, int r) {
  const int G = static_cast<int>(a.group), Gp = static_cast<int>(a.group_pad);
  const int m = tile + (threadIdx.x % 32) / 4 + 8 * r;
  const int e = m / Gp, head = m % Gp;
  const EntryInfo info = entries[e < n ? e : 0];
  TeacherRow row;
  row.valid = e < n && head < G;
  row.q_head = row.valid ? info.q * a.q_heads + g * G + head : 0;
  row.pos = row.valid ? info.pos : -1;
  row.entry = e;
  return row;
}

// Hints the Q rows and main LSE of m-tile `tile` into L1 (no registers held): issued one
// m-tile ahead, so the loads of load_teacher_tile hit L1 instead of waiting on HBM (each
// query row is read by its slots at random times: Q misses L2).
template <int D>
__device__ __forceinline__ void prefetch_teacher_tile(const EntryArgs& a, int64_t g, int n,
                                                      const EntryInfo* entries, int tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const TeacherRow row = teacher_row(a, g, n, entries, tile, r);
    if (!row.valid) continue;
    const char* q_bytes = reinterpret_cast<const char*>(a.q + row.q_head * D);
    asm volatile("prefetch.global.L1 [%0];" ::"l"(q_bytes + (lane % 4) * (D / 2)));  // 4 lanes x D/2 bytes
    if (lane % 4 == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(a.main_lse + row.q_head));
  }
}

// The rows of one teacher m-tile: Q fragments, log2-domain main LSE, position and entry.
template <int D>
struct TeacherTile {
  uint32_t qf[D / 16][4];
  float lse2[2];
  int64_t pos[2];
  int entry[2];
};

// Loads m-tile `tile`, branch-free: padding rows load row 0 of q and main_lse and mask it
// (attn::load_q_fragments branches per load on a null row instead).
template <int D>
__device__ __forceinline__ void load_teacher_tile(TeacherTile<D>& t, const EntryArgs& a, int64_t g, int n,
                                                  const EntryInfo* entries, int tile) {
  const int col = 2 * (threadIdx.x % 4);
  const uint16_t* q_row[2];
  uint32_t keep[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const TeacherRow row = teacher_row(a, g, n, entries, tile, r);
    q_row[r] = a.q + row.q_head * D;
    keep[r] = row.valid ? 0xffffffffu : 0u;
    const float lse = __ldg(a.main_lse + row.q_head);
    t.lse2[r] = row.valid ? lse * kLog2e : 0.0f;
    t.pos[r] = row.pos;
    t.entry[r] = row.entry;
  }
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    t.qf[k][0] = attn::load_bf16_pair(q_row[0] + k * 16 + col) & keep[0];
    t.qf[k][1] = attn::load_bf16_pair(q_row[1] + k * 16 + col) & keep[1];
    t.qf[k][2] = attn::load_bf16_pair(q_row[0] + k * 16 + 8 + col) & keep[0];
    t.qf[k][3] = attn::load_bf16_pair(q_row[1] + k * 16 + 8 + col) & keep[1];
  }
}

// Phase 1: the teacher p_t[entry][key] of the item's entries over the block's visible keys.
// The sum over an entry's Gp rows (lane bits 2.. of the C fragment, and for Gp = 16 also
// the two halves) runs after all exps of a 64-key sub-tile, as unrolled warp-uniform
// butterfly steps, so the shuffles of the 32 (16 for Gp = 16) values interleave.
template <int D>
__device__ __forceinline__ void teacher_phase(const EntryArgs& a, int64_t g, int64_t block, int n,
                                              const EntryInfo* entries, const uint16_t* k_smem,
                                              float* pt) {
  constexpr int kPitch = smem_pitch<D>();
  constexpr int kStride = kKlWarps * attn::kWarpRows;
  const int B = a.block_size, pt_pitch = entry_key_pitch(B);
  const int G = static_cast<int>(a.group), Gp = static_cast<int>(a.group_pad);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = 2 * (lane % 4);
  const int rows = n * Gp;
  const float inv_group = 1.0f / static_cast<float>(G);
  const int reduce_span = 4 * (Gp < 8 ? Gp : 8);  // xor offsets 4 .. reduce_span / 2
  const bool fold_halves = Gp == 16;              // one entry spans both halves of the tile
  // Writers: the first lane group of each entry (row % Gp == 0); for Gp = 16 only the
  // first half holds the total.
  const bool first_of_entry = ((lane / 4) % (Gp < 8 ? Gp : 8)) == 0;

  for (int tile = warp * attn::kWarpRows; tile < rows; tile += kStride) {
    if (tile + kStride < rows) prefetch_teacher_tile<D>(a, g, n, entries, tile + kStride);
    TeacherTile<D> cur;
    load_teacher_tile<D>(cur, a, g, n, entries, tile);
    // Entries are ordered by query: the tile's last entry has the largest position.
    const int last_entry = ((tile + attn::kWarpRows < rows ? tile + attn::kWarpRows : rows) - 1) / Gp;
    const int64_t max_pos = entries[last_entry].pos;

    for (int sub = 0; sub < B; sub += kKeyTile) {
      const int64_t first_key = block * B + sub;
      if (first_key > max_pos) break;  // no row sees these keys; p_t there is never read
      float s[kKeyTile / 8][4];
      attn::tile_scores<D>(s, cur.qf, k_smem + sub * kPitch, lane);
      const int limit[2] = {attn::tile_limit(cur.pos[0], first_key), attn::tile_limit(cur.pos[1], first_key)};
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = nt * 8 + col + (i & 1);
          const float p = exp2f(s[nt][i] * a.scale_log2 - cur.lse2[i / 2]);
          s[nt][i] = key <= limit[i / 2] ? p : 0.0f;
        }
      if (fold_halves) {
#pragma unroll
        for (int nt = 0; nt < kKeyTile / 8; ++nt) {
          s[nt][0] += s[nt][2];
          s[nt][1] += s[nt][3];
        }
      }
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) {
        if (offset >= reduce_span) break;  // warp-uniform
#pragma unroll
        for (int nt = 0; nt < kKeyTile / 8; ++nt) {
          s[nt][0] += __shfl_xor_sync(0xffffffffu, s[nt][0], offset);
          s[nt][1] += __shfl_xor_sync(0xffffffffu, s[nt][1], offset);
        }
        if (!fold_halves) {  // warp-uniform
#pragma unroll
          for (int nt = 0; nt < kKeyTile / 8; ++nt) {
            s[nt][2] += __shfl_xor_sync(0xffffffffu, s[nt][2], offset);
            s[nt][3] += __shfl_xor_sync(0xffffffffu, s[nt][3], offset);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!first_of_entry || cur.entry[r] >= n || (fold_halves && r == 1)) continue;
        float* out = pt + cur.entry[r] * pt_pitch + sub + col;
#pragma unroll
        for (int nt = 0; nt < kKeyTile / 8; ++nt)
          *reinterpret_cast<float2*>(out + nt * 8) =
              make_float2(s[nt][2 * r] * inv_group, s[nt][2 * r + 1] * inv_group);
      }
    }
  }
}

// Phase 2: student, ds, loss and dqi of one 16-entry tile (warp w: entries 16w..16w+15).
template <int Di>
__device__ __forceinline__ void student_phase(const EntryArgs& a, int64_t block, int n,
                                              const EntryInfo* entries, const uint16_t* ki_smem,
                                              const uint16_t* qi_smem, const float* pt,
                                              uint16_t* ds_hi, uint16_t* ds_lo) {
  constexpr int kPitch = smem_pitch<Di>();
  const int B = a.block_size;
  const int pt_pitch = entry_key_pitch(B), ds_pitch = entry_key_pitch(B);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = 2 * (lane % 4);
  const int tile = warp * attn::kWarpRows;
  if (tile >= n) return;  // warp-uniform

  uint32_t qf[Di / 16][4];
  {
    const uint16_t* q_row =
        qi_smem + (tile + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
#pragma unroll
    for (int k = 0; k < Di / 16; ++k) ldmatrix_x4(qf[k], q_row + k * 16);
  }
  const int row[2] = {tile + lane / 4, tile + lane / 4 + 8};  // < kItemEntries
  const EntryInfo info[2] = {entries[row[0]], entries[row[1]]};
  float dqi[Di / 8][4];
#pragma unroll
  for (int nt = 0; nt < Di / 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) dqi[nt][i] = 0.0f;
  float loss[2] = {0.0f, 0.0f};
  const uint16_t* value_row = ki_smem + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;

  for (int sub = 0; sub < B; sub += kKeyTile) {
    const int64_t first_key = block * B + sub;
    float s[kKeyTile / 8][4];
    attn::tile_scores<Di>(s, qf, ki_smem + sub * kPitch, lane);
    const int limit[2] = {attn::tile_limit(info[0].pos, first_key),
                          attn::tile_limit(info[1].pos, first_key)};
    float hi[kKeyTile / 8][4], lo[kKeyTile / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = nt * 8 + col;
        const float2 teacher = *reinterpret_cast<const float2*>(pt + row[r] * pt_pitch + sub + key);
        const float p_teacher[2] = {teacher.x, teacher.y};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float ds = 0.0f;
          if (key + j <= limit[r]) {
            const float log_p_student = s[nt][2 * r + j] * a.logit_scale - info[r].student_lse;
            ds = expf(log_p_student) - p_teacher[j];
            if (p_teacher[j] > 0.0f) loss[r] += p_teacher[j] * (logf(p_teacher[j]) - log_p_student);
          }
          split_bf16(ds, hi[nt][2 * r + j], lo[nt][2 * r + j]);
        }
      }
    }
    // Stage ds (hi, lo) for the dki phase: rows = entries, columns = keys of the block.
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int offset = row[r] * ds_pitch + sub + nt * 8 + col;
        *reinterpret_cast<uint32_t*>(ds_hi + offset) = pack_bf16(hi[nt][2 * r], hi[nt][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(ds_lo + offset) = pack_bf16(lo[nt][2 * r], lo[nt][2 * r + 1]);
      }
    // dqi += ds . KI: the ds accumulators of n-tiles 2kk, 2kk+1 are the A fragment of key
    // step kk (as P in the forward's P V); KI rows by ldmatrix.trans (as V).
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk) {
      uint32_t a_hi[4], a_lo[4];
      attn::accumulator_a_fragment(a_hi, hi, kk);
      attn::accumulator_a_fragment(a_lo, lo, kk);
#pragma unroll
      for (int dp = 0; dp < Di / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, value_row + (sub + kk * 16) * kPitch + dp * 16);
        mma_split_x2(dqi[2 * dp], dqi[2 * dp + 1], a_hi, a_lo, b);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float row_loss = attn::quad_sum(loss[r]);
    if (row[r] >= n) continue;
    if (lane % 4 == 0) a.loss_partial[info[r].partial] = row_loss;
    float* out = a.dqi_partial + info[r].partial * Di + col;
#pragma unroll
    for (int nt = 0; nt < Di / 8; ++nt)
      *reinterpret_cast<float2*>(out + nt * 8) = make_float2(dqi[nt][2 * r], dqi[nt][2 * r + 1]);
  }
}

// Phase 3: the item's dki contribution [B, Di] = DS^T QI; warp w owns the 16-key x Di/2
// tiles w and w + 8 of the B / 16 x 2 tiles.
template <int Di>
__device__ __forceinline__ void dki_phase(const EntryArgs& a, unsigned item, int64_t seq,
                                          int64_t block, int n, int valid_keys,
                                          const uint16_t* qi_smem, const uint16_t* ds_hi,
                                          const uint16_t* ds_lo) {
  constexpr int kPitch = smem_pitch<Di>();
  constexpr int kHalf = Di / 2;
  const int B = a.block_size, ds_pitch = entry_key_pitch(B);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = 2 * (lane % 4);
  const int k_steps = (n + 15) / 16;  // entries beyond n hold ds = 0 and qi = 0
  const int tiles = (B / 16) * 2;
  for (int t = warp; t < tiles; t += kKlWarps) {
    const int key0 = (t / 2) * 16, col0 = (t % 2) * kHalf;
    float acc[kHalf / 8][4];
#pragma unroll
    for (int nt = 0; nt < kHalf / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
    for (int ks = 0; ks < k_steps; ++ks) {
      // A = DS^T (rows keys, k = entries) from ds [entry][key] by ldmatrix.trans:
      // matrices (entries 0-7, keys 0-7), (entries 0-7, keys 8-15), (entries 8-15, keys 0-7),
      // (entries 8-15, keys 8-15) = a[0..3].
      const int j = lane / 8;
      const int a_offset = (ks * 16 + (lane % 8) + (j / 2) * 8) * ds_pitch + key0 + (j % 2) * 8;
      uint32_t a_hi[4], a_lo[4];
      ldmatrix_x4_trans(a_hi, ds_hi + a_offset);
      ldmatrix_x4_trans(a_lo, ds_lo + a_offset);
      // B = QI (k = entries, n = index dims) by ldmatrix.trans, as V in the forward.
      const uint16_t* b_row =
          qi_smem + (ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + col0 + (lane / 16) * 8;
#pragma unroll
      for (int dp = 0; dp < kHalf / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_row + dp * 16);
        mma_split_x2(acc[2 * dp], acc[2 * dp + 1], a_hi, a_lo, b);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + lane / 4 + 8 * r;
      if (a.dki_partial) {
        float* out = a.dki_partial + (int64_t{item} * B + key) * Di + col0 + col;
#pragma unroll
        for (int nt = 0; nt < kHalf / 8; ++nt)
          *reinterpret_cast<float2*>(out + nt * 8) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
      } else if (key < valid_keys) {
        float* out = a.dki + (a.ki.seq_token_start[seq] + block * B + key) * Di + col0 + col;
#pragma unroll
        for (int nt = 0; nt < kHalf / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float value = acc[nt][2 * r + c];
            if (value != 0.0f) atomicAdd(out + nt * 8 + c, a.grad_scale * value);
          }
      }
    }
  }
}

template <int D, int Di>
__global__ void __launch_bounds__(kKlThreads, 1)
    kl_entries_kernel(const __grid_constant__ EntryArgs a) {
  using Smem = KlSmem<D, Di>;
  extern __shared__ uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  const int B = a.block_size;
  uint16_t* k_smem = reinterpret_cast<uint16_t*>(smem + Smem::k_offset());
  uint16_t* ki_smem = reinterpret_cast<uint16_t*>(smem + Smem::ki_offset(B));
  uint16_t* qi_smem = reinterpret_cast<uint16_t*>(smem + Smem::qi_offset(B));
  uint16_t* ds_hi = reinterpret_cast<uint16_t*>(smem + Smem::ds_hi_offset(B));
  uint16_t* ds_lo = reinterpret_cast<uint16_t*>(smem + Smem::ds_lo_offset(B));
  float* pt = reinterpret_cast<float*>(smem + Smem::pt_offset(B));
  EntryInfo* entries = reinterpret_cast<EntryInfo*>(smem + Smem::entries_offset(B));

  const unsigned n_items = *a.item_count;
  for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WorkItem item = a.items[it];
    const int n = item.count;  // 1..kItemEntries
    const ItemGeometry geo = decode_item(a, item);
    const int64_t g = geo.g, block = geo.block, seq = geo.seq;

    // 0. Loads: entry metadata, K and KI blocks (rows past the sequence end zero), qi rows.
    load_item_entries(a, item, geo, true, entries);
    attn::load_rows_async<D, kKlThreads>(k_smem, block_pointer(a.k, seq, block, g),
                                         a.k.token_stride, B, geo.valid_keys);
    load_index_operands_async<Di, kKlThreads>(a, item, geo, ki_smem, qi_smem);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    teacher_phase<D>(a, g, block, n, entries, k_smem, pt);
    __syncthreads();  // p_t complete
    student_phase<Di>(a, block, n, entries, ki_smem, qi_smem, pt, ds_hi, ds_lo);
    __syncthreads();  // ds staged
    dki_phase<Di>(a, it, seq, block, n, geo.valid_keys, qi_smem, ds_hi, ds_lo);
    if (a.item_slot && threadIdx.x == 0) a.item_slot[item.first] = static_cast<int32_t>(it);
    __syncthreads();  // the next item's loads overwrite every buffer
  }
}

// Shared-memory plan of kl_given_teacher_kernel, in bytes: two stages of the item operands
// (KI block, qi rows, p_t rows, entries), then ds hi / lo. B = Di = 128: 2 x 89,088 + 34,816 =
// 212,992 bytes.
template <int Di>
struct KlGivenSmem {
  static constexpr int kIPitch = smem_pitch<Di>();
  __host__ __device__ static constexpr size_t ki_bytes(int B) { return size_t(B) * kIPitch * 2; }
  __host__ __device__ static constexpr size_t qi_bytes() { return size_t(kItemEntries) * kIPitch * 2; }
  __host__ __device__ static constexpr size_t pt_bytes(int B) { return size_t(kItemEntries) * entry_key_pitch(B) * 4; }
  __host__ __device__ static constexpr size_t stage_bytes(int B) {
    return ki_bytes(B) + qi_bytes() + pt_bytes(B) + size_t(kItemEntries) * sizeof(EntryInfo);
  }
  __host__ __device__ static constexpr size_t ki_offset(int B, int s) { return s * stage_bytes(B); }
  __host__ __device__ static constexpr size_t qi_offset(int B, int s) { return ki_offset(B, s) + ki_bytes(B); }
  __host__ __device__ static constexpr size_t pt_offset(int B, int s) { return qi_offset(B, s) + qi_bytes(); }
  __host__ __device__ static constexpr size_t entries_offset(int B, int s) { return pt_offset(B, s) + pt_bytes(B); }
  __host__ __device__ static constexpr size_t ds_hi_offset(int B) { return 2 * stage_bytes(B); }
  __host__ __device__ static constexpr size_t ds_lo_offset(int B) {
    return ds_hi_offset(B) + size_t(kItemEntries) * entry_key_pitch(B) * 2;
  }
  __host__ __device__ static constexpr size_t bytes(int B) {
    return ds_lo_offset(B) + size_t(kItemEntries) * entry_key_pitch(B) * 2;
  }
};

// The KL with its teacher given (EntryArgs::teacher, as the attention backward wrote it): no K
// block, no Q gather, no teacher phase; per item the student and dki phases of
// kl_entries_kernel on the item's p_t rows. With the teacher's MMAs gone the item's loads
// (KI from L2, qi and p_t from HBM) would stand between phases, so they run a stage ahead:
// item i + 1's copies are issued right after item i's first barrier and land while item i
// computes (two stages of operands; ds is single: item i's dki phase ends before item i + 1's
// first barrier).
template <int Di>
__global__ void __launch_bounds__(kKlThreads, 1)
    kl_given_teacher_kernel(const __grid_constant__ EntryArgs a) {
  using Smem = KlGivenSmem<Di>;
  extern __shared__ uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  const int B = a.block_size;
  uint16_t* ds_hi = reinterpret_cast<uint16_t*>(smem + Smem::ds_hi_offset(B));
  uint16_t* ds_lo = reinterpret_cast<uint16_t*>(smem + Smem::ds_lo_offset(B));
  const auto ki_smem = [&](int s) { return reinterpret_cast<uint16_t*>(smem + Smem::ki_offset(B, s)); };
  const auto qi_smem = [&](int s) { return reinterpret_cast<uint16_t*>(smem + Smem::qi_offset(B, s)); };
  const auto pt = [&](int s) { return reinterpret_cast<float*>(smem + Smem::pt_offset(B, s)); };
  const auto entries = [&](int s) { return reinterpret_cast<EntryInfo*>(smem + Smem::entries_offset(B, s)); };
  // Item operands into stage s: entry metadata (stored), KI, qi and p_t rows (cp.async, one group).
  const auto issue = [&](const WorkItem& item, const ItemGeometry& geo, int s) {
    load_item_entries(a, item, geo, true, entries(s));
    load_teacher_rows_async<kKlThreads>(a, item, geo, pt(s));
    load_index_operands_async<Di, kKlThreads>(a, item, geo, ki_smem(s), qi_smem(s));
    cp_async_commit();
  };

  const unsigned n_items = *a.item_count;
  unsigned it = blockIdx.x;
  if (it >= n_items) return;  // CTA-uniform
  WorkItem item = a.items[it];
  ItemGeometry geo = decode_item(a, item);
  issue(item, geo, 0);
  for (int s = 0; it < n_items; it += gridDim.x, s ^= 1) {
    cp_async_wait<0>();  // this thread's copies of stage s
    __syncthreads();     // everyone's, and the entries; item it - grid is done with stage s ^ 1 and ds
    const unsigned next = it + gridDim.x;
    WorkItem next_item{};
    ItemGeometry next_geo{};
    if (next < n_items) {
      next_item = a.items[next];
      next_geo = decode_item(a, next_item);
      issue(next_item, next_geo, s ^ 1);
    }
    student_phase<Di>(a, geo.block, item.count, entries(s), ki_smem(s), qi_smem(s), pt(s), ds_hi, ds_lo);
    __syncthreads();  // ds staged
    dki_phase<Di>(a, it, geo.seq, geo.block, item.count, geo.valid_keys, qi_smem(s), ds_hi, ds_lo);
    if (a.item_slot && threadIdx.x == 0) a.item_slot[item.first] = static_cast<int32_t>(it);
    item = next_item;
    geo = next_geo;
  }
}

}  // namespace msa::cuda::kl
