// Backward of the main branch, KV-block-major: dK and dV (and dQ in two of three modes).
//
// Work unit = one (KV group g, sequence, key block of B = 64 or 128 keys), one CTA of B / 16
// warps; warp w owns keys [16 w, 16 w + 16) of the block. The unit's queries come from a
// "block source" (one kernel serves both ops):
//   sparse: a run of the inverted selection (selection_inversion.cuh: keys -> cub sort ->
//           work items of one (group, sequence, block) segment each, queries in ascending
//           order; a heavy segment is cut into several items, its pieces);
//   dense:  every query of the sequence at a position >= the block's first key.
// Rows = the unit's (query, q-head) pairs flattened query-major (row m: entry m / G, head
// m % G), in tiles of 64 rows. Per tile, every warp, for its 16 keys and the tile's rows
// (in sub-tiles of 32 rows), with mma.sync m16n8k16 (bf16 in, f32 accumulate):
//   S^T  = K Q^T            P^T = exp2(S^T scale log2e - LSE2[row]), 0 where key > pos(row)
//   dP^T = V dO^T           dS^T = P^T (dP^T - Delta[row])
//   dV  += P^T dO           dK  += dS^T Q            (f32 accumulators in registers)
// and, when dQ is computed here, the CTA writes dS^T (bf16) to shared memory and computes the
// tile's dQ = scale dS K (64 rows x D, split over the warps), added with float atomics into
// dq (fast mode) or stored as per-(query, group, slot) partials (sparse deterministic mode).
// Sparse, with kl_teacher set: the KL's teacher of each entry, the group mean of the P^T just
// computed (write_kl_teacher), so that indexer_kl does not recompute Q K^T and P.
// At the end dK = scale * acc and dV = acc are added (read-modify-write, f32) to the block's
// rows of dk / dv: the block's only item in the launch, or, for a segment cut into pieces
// (backward_items.h), stored to the piece's slot and summed in entry
// order by add_split_grads_kernel. The launcher zeroes dk / dv first and runs query chunks in
// stream order, so dK / dV are deterministic in every mode.
//
// Pipeline: K and V (B x D each) stay in shared memory for the whole unit; the Q and dO rows
// of tile t + 1 (gathered by query index, 16-byte cp.async, zero rows past the unit's end) and
// the row info (offsets, key limit, LSE2, Delta) are loaded while tile t computes. Two
// __syncthreads per tile (three with dQ).
// Shared memory (bf16 rows at pitch D + 8, conflict-free ldmatrix): K, V 2 x B x (D + 8) x 2;
// Q, dO 2 stages x 2 x 64 x (D + 8) x 2; dS^T B x 72 x 2; row info 2 x 64 x 36 bytes:
// B = D = 128: 162,304 bytes (one CTA of 8 warps per SM).
// Registers per lane (D = 128): dK 64 + dV 64 + S^T 16 + dP^T 16 + fragments.
// FLOPs per (query head, key) pair: 4 GEMMs x 2 D (+ 2 D for dQ); M3 (G = 16): an entry
// (query, block) costs 2.1 (2.6) MFLOP against 8 KB of Q and dO (from L2/HBM) -> ~300 FLOP/B.
// Bottleneck: shared-memory bandwidth of the ldmatrix traffic (~200 ldmatrix.x4 per 320 MMAs
// per warp and 64-row tile), then the 8 warps per SM. Measured at 15-23% of the bf16 peak
// in useful 10 D work (`msa bench --device cuda --training`; bench/results/h200.md). For
// D = B = 128 the warpgroup-MMA kernel (attention_backward_wgmma.cuh) runs the same units
// 1.5-1.7x faster and is the default; this kernel serves D = 64 and B = 64, and
// AttentionBackwardLaunch::engine pins it. The first blocks of a sequence have many times the
// mean readers; the sparse launcher cuts their segments into pieces so that no CTA holds more
// than a fraction of an SM's share (not tried: largest-item-first order).
#pragma once
#include "cuda/attention/attention_sparse_kv_major.cuh"

namespace msa::cuda::attn {

constexpr int kBwdRowTile = 64;  // rows (query-head pairs) per tile
constexpr int kBwdSubRows = 32;  // rows per S^T / dP^T sub-tile (register budget)
constexpr int kBwdDsPitch = kBwdRowTile + 8;
constexpr int kBwdMaxThreads = 256;  // B = 128: 8 warps

// Where dQ goes (the launcher picks one per op and mode).
enum BackwardDq : int {
  kDqNone = 0,     // not computed here (dense deterministic: attention_backward_dq.cuh)
  kDqAtomic = 1,   // atomicAdd into dq (fast mode)
  kDqPartial = 2,  // stored per (query, group, slot) into dq_partial (sparse deterministic)
};

struct BackwardArgs {
  const uint16_t* q;       // [total_q, q_heads, D]
  const uint16_t* grad_o;  // [total_q, q_heads, D]
  KeyLayout k, v;          // varlen
  int64_t q_heads, kv_heads, group, block_size;
  const int64_t* q_start;  // [batch + 1]
  const int64_t* k_len;    // [batch]
  int64_t batch;
  const float* lse2;   // [total_q, q_heads] LSE * log2(e); +inf for an empty row (P = 0)
  const float* delta;  // [total_q, q_heads] rowsum(dO * O)
  float scale, scale_log2;
  // Sparse block source: sel's keys, items, item_count, qbits, slots, nblk, q_begin,
  // seq_of_query, q_start and k_len (the fields decode_item / decode_entry read).
  bool sparse;
  SparseArgs sel;
  int dq_mode;        // BackwardDq
  float* dq;          // kDqAtomic: [total_q, q_heads, D]
  float* dq_partial;  // kDqPartial: [chunk_q, kv_heads, slots, G, D]
  float* dk;          // [total_k, kv_heads, D] (k's element offsets)
  float* dv;
  // Sparse, optional (null: every item is its block's only writer): piece_slot[item] >= 0 when
  // the item is a piece of a split segment, whose dK / dV then go to that slot of
  // grad_partial, [slot][dK, dV][block_size][D] f32, and add_split_grads_kernel sums the
  // pieces into dk / dv in slot order.
  const int32_t* piece_slot;
  float* grad_partial;
  // Sparse, optional: the KL's teacher (write_kl_teacher), [kv_heads, total_q, slots, block_size].
  float* kl_teacher;
  int64_t total_q;
};

// Bytes of one tile stage's row info (BackwardRows).
constexpr int kBwdRowInfoBytes = kBwdRowTile * (3 * sizeof(int64_t) + sizeof(int) + 2 * sizeof(float));

template <int D>
__host__ __device__ constexpr size_t backward_kv_smem_bytes(int64_t block_size) {
  return (2 * static_cast<size_t>(block_size) + 2 * 2 * kBwdRowTile) * smem_pitch<D>() * sizeof(uint16_t) +
         static_cast<size_t>(block_size) * kBwdDsPitch * sizeof(uint16_t) + 2 * size_t{kBwdRowInfoBytes};
}

// Per-row info of one tile stage (shared memory).
struct BackwardRows {
  int64_t* q_off;       // element offset of the row's (query, head) in q / grad_o, -1 = padding
  int64_t* dq_off;      // element offset of its dQ row in dq or dq_partial, -1 = padding
  int64_t* teacher_off;  // element offset of its entry's row in kl_teacher, -1 = padding or none
  int* limit;           // last visible key of the block for the row (-1: none)
  float* lse2;
  float* delta;
};

// The unit this CTA owns: group, sequence, block and its queries (entries).
struct BackwardUnit {
  int64_t g, seq, block;
  int64_t first;       // sparse: first entry in the sorted keys; dense: first query row
  int64_t count;       // entries (queries)
  int64_t pos_offset;  // position of global query row q = q + pos_offset
  bool valid;
};

__device__ __forceinline__ BackwardUnit backward_unit(const BackwardArgs& a, int G) {
  BackwardUnit u{};
  if (a.sparse) {
    const unsigned it = blockIdx.x;
    u.valid = it < *a.sel.item_count;
    if (!u.valid) return u;
    const ItemInfo info = decode_item(a.sel, it, G);
    u.g = info.g;
    u.seq = info.seq;
    u.block = info.block;
    u.first = info.first;
    u.count = a.sel.items[it].count;
    u.pos_offset = info.pos_offset;
    return u;
  }
  // Dense: blockIdx.x = seq * kv_heads + g, blockIdx.y = block (low blocks, the longest
  // units, are dispatched first).
  u.seq = blockIdx.x / a.kv_heads;
  u.g = blockIdx.x % a.kv_heads;
  u.block = blockIdx.y;
  const int64_t k_len = a.k_len[u.seq];
  u.valid = u.block * a.block_size < k_len;
  if (!u.valid) return u;
  const int64_t first_q = a.q_start[u.seq], end_q = a.q_start[u.seq + 1];
  const int64_t pos0 = k_len - (end_q - first_q);  // position of the first query
  const int64_t skip = u.block * a.block_size - pos0;
  u.first = first_q + (skip > 0 ? skip : 0);
  u.count = end_q > u.first ? end_q - u.first : 0;
  u.pos_offset = pos0 - first_q;
  return u;
}

// The selection key of tile row m of the unit (sparse; 0 for a padding row, and in dense mode,
// where rows need no key).
__device__ __forceinline__ uint64_t backward_row_key(const BackwardArgs& a, const BackwardUnit& u, int64_t m,
                                                     int G) {
  return a.sparse && m < u.count * G ? a.sel.keys[u.first + m / G] : 0;
}

// Row info of tile row m but its LSE2 and Delta (`key`: backward_row_key's): where its Q / dO
// and dQ rows are and its last visible key of the block. Returns the row's (query, head)
// index, -1 for a padding row (offsets and limit -1).
__device__ __forceinline__ int64_t decode_backward_row_place(const BackwardArgs& a, const BackwardUnit& u,
                                                             int64_t m, int G, int D, uint64_t key,
                                                             const BackwardRows& rows, int slot_in_tile) {
  if (m >= u.count * G) {
    rows.q_off[slot_in_tile] = -1;
    rows.dq_off[slot_in_tile] = -1;
    rows.teacher_off[slot_in_tile] = -1;
    rows.limit[slot_in_tile] = -1;
    return -1;
  }
  const int64_t e = m / G;
  const int h = static_cast<int>(m - e * G);
  int64_t q, pos;
  int slot = 0;
  if (a.sparse) {
    const Entry entry = decode_entry(a.sel, key, u.pos_offset);
    q = entry.q;
    pos = entry.pos;
    slot = entry.slot;
  } else {
    q = u.first + e;
    pos = q + u.pos_offset;
  }
  const int64_t row = q * a.q_heads + u.g * G + h;
  rows.q_off[slot_in_tile] = row * D;
  rows.dq_off[slot_in_tile] =
      a.dq_mode == kDqPartial
          ? ((((q - a.sel.q_begin) * a.kv_heads + u.g) * a.sel.slots + slot) * G + h) * D
          : row * D;
  rows.teacher_off[slot_in_tile] =
      a.kl_teacher ? ((u.g * a.total_q + q) * a.sel.slots + slot) * a.block_size : -1;
  const int64_t rel = pos - u.block * a.block_size;
  rows.limit[slot_in_tile] = static_cast<int>(rel < -1 ? -1 : (rel >= a.block_size ? a.block_size - 1 : rel));
  return row;
}

// Row info of tile row m (thread m < 64 of the CTA calls this for its row); padding rows get
// LSE2 = Delta = 0 (their limit -1 masks every key).
__device__ __forceinline__ void decode_backward_row(const BackwardArgs& a, const BackwardUnit& u, int64_t m,
                                                    int G, int D, const BackwardRows& rows, int slot_in_tile) {
  const int64_t row = decode_backward_row_place(a, u, m, G, D, backward_row_key(a, u, m, G), rows, slot_in_tile);
  rows.lse2[slot_in_tile] = row >= 0 ? a.lse2[row] : 0.0f;
  rows.delta[slot_in_tile] = row >= 0 ? a.delta[row] : 0.0f;
}

// Gathers the Q and dO rows of a tile (offsets from `rows`) into one stage; every thread.
template <int D>
__device__ __forceinline__ void gather_backward_rows(const BackwardArgs& a, const BackwardRows& rows,
                                                     uint16_t* q_dst, uint16_t* do_dst) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < kBwdRowTile * kChunks; c += blockDim.x) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int64_t off = rows.q_off[r];
    const bool valid = off >= 0;
    cp_async_16(q_dst + r * smem_pitch<D>() + col, valid ? a.q + off + col : a.q, valid);
    cp_async_16(do_dst + r * smem_pitch<D>() + col, valid ? a.grad_o + off + col : a.grad_o, valid);
  }
}

// dQ = scale * acc of this lane's two tile rows (dQ offsets `off`, < 0: padding) at columns
// col0 + 8 n + 2 (lane % 4) + {0, 1}, n < 8: added with float atomics into dq (fast mode) or
// stored into dq_partial (sparse deterministic). acc(n, r) gives the pair of row r.
template <class Accumulators>
__device__ __forceinline__ void write_dq_rows(const BackwardArgs& a, const int64_t (&off)[2], int col0, int lane,
                                              Accumulators acc) {
  float* out = a.dq_mode == kDqAtomic ? a.dq : a.dq_partial;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (off[r] < 0) continue;
    float* row_out = out + off[r] + col0 + 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float2 pair = acc(n, r);
      const float2 value = make_float2(pair.x * a.scale, pair.y * a.scale);
      if (a.dq_mode == kDqAtomic)
        atomicAdd(reinterpret_cast<float2*>(row_out + n * 8), value);
      else
        *reinterpret_cast<float2*>(row_out + n * 8) = value;
    }
  }
}

// dQ of a 64-row tile: dQ = scale dS K with dS^T (bf16, [B][72]) and K in shared memory,
// split over the warps in (16-row m-tile, 64-column group) pieces; rows with dq_off < 0 are
// padding.
template <int D>
__device__ __forceinline__ void backward_tile_dq(const BackwardArgs& a, const BackwardRows& rows,
                                                 const uint16_t* ds_smem, const uint16_t* k_smem, int B) {
  constexpr int kPitch = smem_pitch<D>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int piece = warp; piece < 4 * (D / 64); piece += warps) {
    const int mt = piece % 4, cg = piece / 4;  // rows 16 mt.., columns 64 cg..
    float acc[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
    for (int ks = 0; ks < B / 16; ++ks) {
      // A = dS (rows x keys) from its transpose: ldmatrix.trans of dS^T rows (keys).
      uint32_t af[4];
      ldmatrix_x4_trans(af, ds_smem + (ks * 16 + (lane % 8) + (lane / 16) * 8) * kBwdDsPitch + mt * 16 +
                                ((lane / 8) % 2) * 8);
      const uint16_t* k_row = k_smem + (ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + cg * 64 +
                              (lane / 16) * 8;
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_row + np * 16);
        const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
        mma_bf16_16816(acc[2 * np], af, b_lo);
        mma_bf16_16816(acc[2 * np + 1], af, b_hi);
      }
    }
    const int64_t off[2] = {rows.dq_off[mt * 16 + lane / 4], rows.dq_off[mt * 16 + lane / 4 + 8]};
    write_dq_rows(a, off, cg * 64, lane, [&](int n, int r) { return make_float2(acc[n][2 * r], acc[n][2 * r + 1]); });
  }
}

// Row info of stage s in the info region (computed, not indexed from an array: a run-time
// index into a local array would put it on the stack).
__device__ __forceinline__ BackwardRows backward_stage_rows(char* info, int s) {
  BackwardRows rows;
  rows.q_off = reinterpret_cast<int64_t*>(info + s * kBwdRowInfoBytes);
  rows.dq_off = rows.q_off + kBwdRowTile;
  rows.teacher_off = rows.dq_off + kBwdRowTile;
  rows.limit = reinterpret_cast<int*>(rows.teacher_off + kBwdRowTile);
  rows.lse2 = reinterpret_cast<float*>(rows.limit + kBwdRowTile);
  rows.delta = rows.lse2 + kBwdRowTile;
  return rows;
}

// P^T and dS^T of one accumulator quad in place: keys key_lo (values 0, 1) and key_lo + 8
// (2, 3), tile rows row (0, 2) and row + 1 (1, 3). s <- P = exp2(s scale log2e - LSE2[row])
// where the key is visible to the row (key <= limit[row]), else 0; dp <- P (dp - Delta[row]).
// kApprox: the exponent by one ex2.approx with the scale folded into an FMA (the wgmma
// kernel), else exp2f of the product.
template <bool kApprox>
__device__ __forceinline__ void backward_p_ds(const BackwardArgs& a, const BackwardRows& rows, int row, int key_lo,
                                              float (&s)[4], float (&dp)[4]) {
  const int2 limit = *reinterpret_cast<const int2*>(rows.limit + row);
  const float2 lse2 = *reinterpret_cast<const float2*>(rows.lse2 + row);
  const float2 delta = *reinterpret_cast<const float2*>(rows.delta + row);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = key_lo + (i >= 2 ? 8 : 0);
    const bool odd = i & 1;
    const bool visible = key <= (odd ? limit.y : limit.x);
    const float row_lse2 = odd ? lse2.y : lse2.x;
    const float p = !visible ? 0.0f
                    : kApprox ? fast_exp2(fmaf(s[i], a.scale_log2, -row_lse2))
                              : exp2f(s[i] * a.scale_log2 - row_lse2);
    s[i] = p;
    dp[i] = p * (dp[i] - (odd ? delta.y : delta.x));
  }
}

// write_kl_teacher for one group size: the lane's values v[2 i + h] (h 0: key key_lo, 1: key_lo
// + 8) are its partial sums of kV / 2 "entry slots" i: the entries of quads 2 i, 2 i + 1 (G 16),
// or the lane's entry in quad i (G 8, 4, 2). A reduce-scatter over the lanes that share the
// slots (xor 2 then 1 for G 8 and 16, xor 1 for G 4) leaves each lane the full sums of its own
// kV >> rounds values, original indices [base, base + (kV >> rounds)): all lanes store, and
// each round sends half of the values, not all of them.
template <int kG, int kN>
__device__ __forceinline__ void write_kl_teacher_group(const BackwardArgs& a, const BackwardRows& rows, int row0,
                                                       int key_lo, int quad, const float* p) {
  constexpr int kV = kG == 16 ? kN : 2 * kN;  // G 16: two quads per entry
  constexpr int kRounds = kG >= 8 ? 2 : (kG == 4 ? 1 : 0);
  constexpr int kKept = kV >> kRounds;
  float v[kV];
#pragma unroll
  for (int i = 0; i < kV / 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      v[2 * i + h] = p[4 * (kG == 16 ? 2 * i : i) + 2 * h] + p[4 * (kG == 16 ? 2 * i : i) + 2 * h + 1];
      if (kG == 16) v[2 * i + h] += p[4 * (2 * i + 1) + 2 * h] + p[4 * (2 * i + 1) + 2 * h + 1];
    }
  int base = 0, len = kV;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const int offset = kRounds == 2 && r == 0 ? 2 : 1;
    const bool upper = (quad & offset) != 0;
    len /= 2;
    if (upper) base += len;
#pragma unroll
    for (int i = 0; i < kV / 2; ++i) {
      if (i >= len) break;
      const float keep = upper ? v[len + i] : v[i];
      const float send = upper ? v[i] : v[len + i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  const float inv_group = 1.0f / static_cast<float>(kG);
#pragma unroll
  for (int j = 0; j < kKept; ++j) {
    const int slot = (base + j) / 2, h = (base + j) % 2;  // v[j]'s entry slot and key
    const int row = row0 + (kG == 16 ? 16 * slot : 8 * slot + (kG == 4 ? 4 * (quad / 2) : kG == 2 ? 2 * quad : 0));
    const int64_t off = rows.teacher_off[row];
    if (off >= 0) a.kl_teacher[off + key_lo + 8 * h] = v[j] * inv_group;
  }
}

// The KL's teacher (docs/msa.md §5) from the backward's own P: for each entry (query, group,
// slot) of the tile, p_t[key] = (1 / G) sum over the entry's G rows of P, written to
// kl_teacher[teacher_off + key]. `p` holds kN accumulator quads as backward_p_ds leaves them:
// quad n has keys key_lo (values 0, 1) and key_lo + 8 (2, 3) of tile rows row0 + 8 n + 2 (lane %
// 4) + {0, 1}. Rows are entry-major and G divides 16 (backward_writes_kl_teacher), so an
// entry's rows are one pair (G 2), the pairs of lanes 2j, 2j + 1 (G 4), all four lanes of the
// quad (G 8) or of quads n, n + 1 (G 16, n even). The sums run in a fixed order
// (deterministic). Every lane of the warp calls this (shuffles), with a warp-uniform G.
template <int kN, int kG = 16>
__device__ __forceinline__ void write_kl_teacher(const BackwardArgs& a, const BackwardRows& rows, int row0,
                                                 int key_lo, int lane, const float* p) {
  const int quad = lane % 4;
  if constexpr (kG > 1) {  // G 16, 8, 4, 2 in turn
    if (a.group == kG)
      write_kl_teacher_group<kG, kN>(a, rows, row0, key_lo, quad, p);
    else
      write_kl_teacher<kN, kG / 2>(a, rows, row0, key_lo, lane, p);
  } else {  // G 1: each row is its own entry
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t off = rows.teacher_off[row0 + 8 * n + 2 * quad + h];
        if (off < 0) continue;
        a.kl_teacher[off + key_lo] = p[4 * n + h];
        a.kl_teacher[off + key_lo + 8] = p[4 * n + 2 + h];
      }
  }
}

// dK = scale * acc and dV = acc of this lane's keys key_lo and key_lo + 8 (those below
// valid_keys), added to the block's rows of dk / dv (read-modify-write: one CTA per block per
// launch), or stored to the item's slot of grad_partial ([dK, dV][block_size][D]) when it is a
// piece of a split segment. The lane holds columns 8 n + 2 (lane % 4) + {0, 1}, n < kPairs, of
// both rows; acc(n, r) gives (dK.x, dK.y, dV.x, dV.y) there for row key_lo + 8 r.
template <int kPairs, class Accumulators>
__device__ __forceinline__ void add_block_grads(const BackwardArgs& a, const uint16_t* k_block, int key_lo,
                                                int valid_keys, int lane, Accumulators acc) {
  constexpr int D = 8 * kPairs;
  const int32_t slot = a.sparse && a.piece_slot ? a.piece_slot[blockIdx.x] : -1;
  const bool to_piece = slot >= 0;
  const int64_t block_offset = k_block - a.k.data;  // dk / dv share k's element offsets
  float* const dk_block = to_piece ? a.grad_partial + static_cast<int64_t>(slot) * 2 * a.block_size * D
                                   : a.dk + block_offset;
  float* const dv_block = to_piece ? dk_block + a.block_size * D : a.dv + block_offset;
  const int64_t row_stride = to_piece ? D : a.k.token_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + 8 * r;
    if (key >= valid_keys) continue;
    float* dk_row = dk_block + key * row_stride + 2 * (lane % 4);
    float* dv_row = dv_block + key * row_stride + 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < kPairs; ++n) {
      float2* dk2 = reinterpret_cast<float2*>(dk_row + n * 8);
      float2* dv2 = reinterpret_cast<float2*>(dv_row + n * 8);
      const float4 g = acc(n, r);
      const float2 old_k = to_piece ? make_float2(0.0f, 0.0f) : *dk2;
      const float2 old_v = to_piece ? make_float2(0.0f, 0.0f) : *dv2;
      *dk2 = make_float2(old_k.x + a.scale * g.x, old_k.y + a.scale * g.y);
      *dv2 = make_float2(old_v.x + g.z, old_v.y + g.w);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kBwdMaxThreads, 1)
    backward_kv_kernel(const __grid_constant__ BackwardArgs a) {
  extern __shared__ uint4 smem_raw[];
  constexpr int kPitch = smem_pitch<D>();
  constexpr int kSubTiles = kBwdSubRows / 8;  // 8-row n-tiles of a sub-tile
  const int B = static_cast<int>(a.block_size);
  const int G = static_cast<int>(a.group);
  const BackwardUnit u = backward_unit(a, G);
  if (!u.valid) return;  // CTA-uniform

  // Shared memory plan (see the header comment).
  uint16_t* k_smem = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* v_smem = k_smem + B * kPitch;
  uint16_t* qd_smem = v_smem + B * kPitch;  // [stage][Q, dO][64][kPitch]
  uint16_t* ds_smem = qd_smem + 2 * 2 * kBwdRowTile * kPitch;  // [B][72]
  char* info = reinterpret_cast<char*>(ds_smem + B * kBwdDsPitch);  // [stage] row info
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key0 = warp * 16;        // the warp's first key in the block
  const int key_lo = key0 + lane / 4;  // this lane's keys: key_lo and key_lo + 8
  const int64_t rows_total = u.count * G;
  const int64_t tiles = (rows_total + kBwdRowTile - 1) / kBwdRowTile;
  const int64_t keys_left = a.k_len[u.seq] - u.block * B;
  const int valid_keys = static_cast<int>(keys_left < B ? keys_left : B);
  const uint16_t* k_block = block_pointer(a.k, u.seq, u.block, u.g);
  const uint16_t* v_block = block_pointer(a.v, u.seq, u.block, u.g);

  // Prologue: row info of tile 0, then K, V and tile 0's Q / dO.
  if (threadIdx.x < kBwdRowTile) decode_backward_row(a, u, threadIdx.x, G, D, backward_stage_rows(info, 0), threadIdx.x);
  __syncthreads();
  if (threadIdx.x < 128) {
    load_rows_async<D, 128>(k_smem, k_block, a.k.token_stride, B, valid_keys);
    load_rows_async<D, 128>(v_smem, v_block, a.v.token_stride, B, valid_keys);
  }
  if (tiles > 0) gather_backward_rows<D>(a, backward_stage_rows(info, 0), qd_smem, qd_smem + kBwdRowTile * kPitch);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;

  for (int64_t t = 0; t < tiles; ++t) {
    const int s = static_cast<int>(t & 1);
    const bool has_next = t + 1 < tiles;
    if (has_next && threadIdx.x < kBwdRowTile)
      decode_backward_row(a, u, (t + 1) * kBwdRowTile + threadIdx.x, G, D, backward_stage_rows(info, s ^ 1),
                          threadIdx.x);
    cp_async_wait<0>();  // this thread's copies of tile t (and K, V) landed
    __syncthreads();     // everyone's copies and the next tile's row info are visible
    if (has_next) {
      uint16_t* next = qd_smem + (s ^ 1) * 2 * kBwdRowTile * kPitch;
      gather_backward_rows<D>(a, backward_stage_rows(info, s ^ 1), next, next + kBwdRowTile * kPitch);
    }
    cp_async_commit();

    const BackwardRows rows = backward_stage_rows(info, s);
    const uint16_t* q_tile = qd_smem + s * 2 * kBwdRowTile * kPitch;
    const uint16_t* do_tile = q_tile + kBwdRowTile * kPitch;
    // The warp's keys as A fragments (non-transposed ldmatrix of K / V rows).
    const uint16_t* k_a = k_smem + (key0 + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
    const uint16_t* v_a = v_smem + (key0 + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;

#pragma unroll 1
    for (int sub = 0; sub < kBwdRowTile; sub += kBwdSubRows) {
      // S^T = K Q^T and dP^T = V dO^T; B operands: Q / dO rows (non-transposed ldmatrix).
      float st[kSubTiles][4], dpt[kSubTiles][4];
      const int b_off = (sub + (lane % 8) + (lane / 16) * 8) * kPitch + ((lane / 8) % 2) * 8;
      mma_abt_pair<D>(st, dpt, k_a, v_a, q_tile + b_off, do_tile + b_off);
      // P^T and dS^T. Lane columns (rows of the tile): sub + 8 n + 2 (lane % 4) + {0, 1}.
#pragma unroll
      for (int n = 0; n < kSubTiles; ++n)
        backward_p_ds<false>(a, rows, sub + n * 8 + 2 * (lane % 4), key_lo, st[n], dpt[n]);
      if (a.kl_teacher) write_kl_teacher<kSubTiles>(a, rows, sub, key_lo, lane, &st[0][0]);
      // dV += P^T dO and dK += dS^T Q: A from the accumulators (bf16), B = dO / Q rows
      // (transposed ldmatrix).
#pragma unroll
      for (int kk = 0; kk < kSubTiles / 2; ++kk) {
        uint32_t pa[4], da[4];
        accumulator_a_fragment(pa, st, kk);
        accumulator_a_fragment(da, dpt, kk);
        const int t_row = sub + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, t_col = (lane / 16) * 8;
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, do_tile + t_row * kPitch + dp * 16 + t_col);
          const uint32_t do_lo[2] = {b[0], b[1]}, do_hi[2] = {b[2], b[3]};
          mma_bf16_16816(dv[2 * dp], pa, do_lo);
          mma_bf16_16816(dv[2 * dp + 1], pa, do_hi);
          ldmatrix_x4_trans(b, q_tile + t_row * kPitch + dp * 16 + t_col);
          const uint32_t q_lo[2] = {b[0], b[1]}, q_hi[2] = {b[2], b[3]};
          mma_bf16_16816(dk[2 * dp], da, q_lo);
          mma_bf16_16816(dk[2 * dp + 1], da, q_hi);
        }
      }
      if (a.dq_mode != kDqNone) {  // dS^T (bf16) for the tile's dQ
#pragma unroll
        for (int n = 0; n < kSubTiles; ++n) {
          const int col = sub + n * 8 + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(ds_smem + key_lo * kBwdDsPitch + col) = pack_bf16(dpt[n][0], dpt[n][1]);
          *reinterpret_cast<uint32_t*>(ds_smem + (key_lo + 8) * kBwdDsPitch + col) =
              pack_bf16(dpt[n][2], dpt[n][3]);
        }
      }
    }
    if (a.dq_mode != kDqNone) {
      __syncthreads();  // dS^T complete
      backward_tile_dq<D>(a, rows, ds_smem, k_smem, B);
    }
    __syncthreads();  // stage s, its row info and dS^T are free for reuse
  }
  cp_async_wait<0>();

  add_block_grads<D / 8>(a, k_block, key_lo, valid_keys, lane, [&](int n, int r) {
    return make_float4(dk[n][2 * r], dk[n][2 * r + 1], dv[n][2 * r], dv[n][2 * r + 1]);
  });
}

constexpr int kSplitGradThreads = 256;
constexpr int kSplitGradPairs = 32;  // float2 per thread: 256 x 32 x 2 = B x D at 128 x 128
static_assert(kSplitGradThreads * kSplitGradPairs * 2 >= 128 * 128, "a thread's pairs cover the largest block");

// One CTA per (split segment, dK or dV) (grid: a bound x 2; CTAs past counts[0] exit): the
// pieces of the segment, summed in slot order (= entry order), added to the block's rows of
// dk (blockIdx.y = 0) or dv (1). Runs after the launch that wrote the pieces and before the
// next chunk's, so each block still has one writer at a time and a fixed summation order.
// Each thread holds its kSplitGradPairs outputs and walks the pieces once, its loads of a
// piece independent of each other: a loop over elements outside the pieces would keep one
// dependent load in flight per thread, and a heavy segment has up to 16 pieces.
template <int D>
__global__ void __launch_bounds__(kSplitGradThreads)
    add_split_grads_kernel(const __grid_constant__ BackwardArgs a, const SplitSegment* segments,
                           const unsigned* counts) {
  if (blockIdx.x >= counts[0]) return;
  const SplitSegment segment = segments[blockIdx.x];
  const uint64_t key = a.sel.keys[segment.first_entry];
  const int64_t group_block = static_cast<int64_t>(key >> a.sel.qbits);
  const int64_t g = group_block / a.sel.nblk, block = group_block % a.sel.nblk;
  const int64_t seq = item_seq(a.sel, key);
  const int64_t keys_left = a.k_len[seq] - block * a.block_size;
  const int valid_keys = static_cast<int>(keys_left < a.block_size ? keys_left : a.block_size);
  const int64_t block_offset = block_pointer(a.k, seq, block, g) - a.k.data;
  const int64_t piece_floats = 2 * a.block_size * D;
  const bool is_dv = blockIdx.y == 1;
  const float* first = a.grad_partial + static_cast<int64_t>(segment.first_slot) * piece_floats +
                       (is_dv ? a.block_size * D : 0);
  const int pairs = valid_keys * (D / 2);
  float2 sum[kSplitGradPairs];
#pragma unroll
  for (int v = 0; v < kSplitGradPairs; ++v) sum[v] = make_float2(0.0f, 0.0f);
  for (int c = 0; c < segment.pieces; ++c) {
    const float2* piece = reinterpret_cast<const float2*>(first + c * piece_floats);
#pragma unroll
    for (int v = 0; v < kSplitGradPairs; ++v) {
      const int at = threadIdx.x + v * kSplitGradThreads;
      if (at < pairs) {
        const float2 p = piece[at];  // row at / (D / 2), columns 2 (at % (D / 2)) + {0, 1}
        sum[v] = make_float2(sum[v].x + p.x, sum[v].y + p.y);
      }
    }
  }
  float* out = (is_dv ? a.dv : a.dk) + block_offset;
#pragma unroll
  for (int v = 0; v < kSplitGradPairs; ++v) {
    const int at = threadIdx.x + v * kSplitGradThreads;
    if (at >= pairs) continue;
    float2* to = reinterpret_cast<float2*>(out + (at / (D / 2)) * a.k.token_stride + 2 * (at % (D / 2)));
    const float2 old = *to;
    *to = make_float2(old.x + sum[v].x, old.y + sum[v].y);
  }
}

}  // namespace msa::cuda::attn
