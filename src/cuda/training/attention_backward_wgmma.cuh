// Backward of the main branch, KV-block-major, on Hopper warpgroup MMA (wgmma) for
// D = B = 128: the same work units, block sources, row info, dQ modes and outputs as
// backward_kv_kernel (attention_backward_kv_major.cuh); only the tile engine differs. That
// kernel runs 8 warps of mma.sync fed by ldmatrix and is bound by the shared-memory traffic of
// its fragments (16-23% of the bf16 peak); here the operands stay in 128B-swizzled tiles that
// the tensor cores read themselves.
//
// CTA = 2 warpgroups (256 threads); warpgroup w owns keys [64 w, 64 w + 64) of the block. Per
// tile of 64 rows (the unit's (query, q-head) pairs, query-major), each warpgroup computes
//   S^T  = K_w Q^T     8 x m64n64k16, K_w and Q (both K-major over D) from shared memory
//   dP^T = V_w dO^T    likewise
//   P^T = exp2(S^T scale log2e - LSE2[row]) (0 where key > pos(row)),
//   dS^T = P^T (dP^T - Delta[row])                            in registers
//   dV_w += P^T dO     4 x m64n128k16, P^T from registers (the S^T accumulator layout is the A
//                      fragment layout), dO [rows x D] read transposed (MN-major)
//   dK_w += dS^T Q     likewise
// and, when dQ is computed here, both warpgroups write dS^T (bf16) into one swizzled
// [128 keys x 64 rows] tile and warpgroup w computes columns [64 w, 64 w + 64) of
//   dQ = scale dS K    8 x m64n64k16 over the 128 keys, dS (the tile read transposed) and
//                      K (columns of slab w, read transposed) from shared memory,
// added with float atomics (fast mode) or stored as per-(query, group, slot) partials
// (sparse deterministic), exactly as the mma.sync kernel does. dK = scale * acc and dV = acc
// are added to the block's rows of dk / dv at the end (or stored to the item's piece slot),
// as the mma.sync kernel does.
//
// With a.kl_teacher (the <true> instantiation) each tile also writes the KL's teacher of its
// entries from P^T (write_kl_teacher, before P^T is packed): +0.6-1.2% at M3's shape.
// Pipeline: K and V stay in shared memory for the unit; while tile t computes, the Q and dO
// rows of tile t + 1 are gathered (16-byte cp.async into the swizzled layout, zero rows past
// the unit's end) with their LSE2 and Delta (4-byte cp.async), and the 64 decoding threads place
// the rows of tile t + 2 from selection keys they loaded one tile before. Decoded just ahead
// of its gather, a tile's rows cost two dependent global round trips (key, then LSE2 / Delta)
// that every warp waited for at the tile's first barrier (Nsight Compute, 32K: 19% of the warp
// samples). Row info in three stages (placed, gathered, computed). Two CTA barriers per tile
// (three with dQ).
// Registers per thread: dV 64 + dK 64 f32 accumulators, S^T / dP^T 32 + 32 (dead once packed
// into the 16 + 16 bf16 A fragments), dQ 32.
// Measured (H200, M3's shape, bench/results/h200.md): 25-29% of the bf16 peak deterministic,
// 33-36% with atomic dQ, 1.54-1.67x the mma.sync kernel. What binds: one CTA of 8 warps per
// SM, and each tile's phases run in order (S^T / dP^T MMAs, wait, exponentials and packing
// while the tensor cores idle, dV / dK / dQ MMAs, wait); Nsight Compute finds a third of the
// issue slots busy and the largest stall at the dS^T exchange barrier. Decoding the rows in
// both warpgroups from keys fetched into shared memory was measured slower (history.md).
// Shared memory: 1 KB alignment + K, V 2 x 32 KB + Q, dO 2 stages x 2 x 16 KB + dS^T 16 KB +
// row info 3 x 64 x 36 B = 155,392 bytes: one CTA per SM.
#pragma once
#include "cuda/attention/attention_sparse_wgmma.cuh"  // copy_block_chunk: the swizzled K / V block copy
#include "cuda/common/wgmma.cuh"
#include "cuda/training/attention_backward_kv_major.cuh"

namespace msa::cuda::attn {

struct BackwardWgmmaTraits {
  static constexpr int kD = 128, kB = 128;
  static constexpr int kThreads = 256;
  static constexpr int kKeyBytes = kB * kD * 2;                      // K or V: 32 KB
  static constexpr int kTileBytes = kBwdRowTile * kD * 2;            // a Q or dO tile: 16 KB
  static constexpr int kDsBytes = kB * kBwdRowTile * 2;              // dS^T: 16 KB
  static constexpr int kInfoBytes = kBwdRowInfoBytes;  // BackwardRows of one stage
  static constexpr int kInfoStages = 3;
  static constexpr size_t kSmemBytes =
      1024 + 2 * size_t{kKeyBytes} + 2 * 2 * size_t{kTileBytes} + kDsBytes + kInfoStages * size_t{kInfoBytes};
};
static_assert(BackwardWgmmaTraits::kSmemBytes <= 227 * 1024, "one CTA per SM");

// The tile's 64 Q and dO rows (offsets from `rows`, zero rows for padding) into swizzled
// K-major tiles; every thread of the CTA.
__device__ __forceinline__ void gather_backward_tile(const BackwardArgs& a, const BackwardRows& rows,
                                                     unsigned char* q_dst, unsigned char* do_dst) {
  using T = BackwardWgmmaTraits;
  constexpr int kChunks = T::kD / 8;
#pragma unroll
  for (int j = 0; j < kBwdRowTile * kChunks / T::kThreads; ++j) {
    const int c = threadIdx.x + j * T::kThreads;
    const int r = c / kChunks, chunk = c % kChunks;
    const int64_t off = rows.q_off[r];
    const bool valid = off >= 0;
    const uint32_t at = swizzled_offset(r, chunk, kBwdRowTile);
    cp_async_16(q_dst + at, valid ? a.q + off + chunk * 8 : a.q, valid);
    cp_async_16(do_dst + at, valid ? a.grad_o + off + chunk * 8 : a.grad_o, valid);
  }
}

// kKlTeacher: a.kl_teacher is set (a separate instantiation: the teacher's sums would push the
// plain kernel past its 255 registers).
template <bool kKlTeacher>
__global__ void __launch_bounds__(BackwardWgmmaTraits::kThreads, 1)
    backward_kv_wgmma_kernel(const __grid_constant__ BackwardArgs a) {
  using T = BackwardWgmmaTraits;
  extern __shared__ uint4 smem_raw[];
  const int G = static_cast<int>(a.group);
  const BackwardUnit u = backward_unit(a, G);
  if (!u.valid) return;  // CTA-uniform

  // Shared memory: 1 KB-aligned swizzled tiles (pointer arithmetic on smem_raw keeps them
  // shared addresses), then the row info of the three stages.
  unsigned char* base = reinterpret_cast<unsigned char*>(smem_raw);
  base += (1024 - (smem_address(base) & 1023)) & 1023;
  unsigned char* k_s = base;
  unsigned char* v_s = k_s + T::kKeyBytes;
  unsigned char* tiles_s = v_s + T::kKeyBytes;  // [stage][Q, dO]
  unsigned char* ds_s = tiles_s + 4 * T::kTileBytes;
  char* info = reinterpret_cast<char*>(ds_s + T::kDsBytes);
  const auto q_tile = [&](int s) { return tiles_s + 2 * s * T::kTileBytes; };
  const auto do_tile = [&](int s) { return tiles_s + (2 * s + 1) * T::kTileBytes; };

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int key_lo = wg * 64 + warp * 16 + lane / 4;  // this thread's keys: key_lo, key_lo + 8
  const int64_t rows_total = u.count * G;
  const int64_t tiles = (rows_total + kBwdRowTile - 1) / kBwdRowTile;
  const int64_t keys_left = a.k_len[u.seq] - u.block * T::kB;
  const int valid_keys = static_cast<int>(keys_left < T::kB ? keys_left : T::kB);
  const uint16_t* k_block = block_pointer(a.k, u.seq, u.block, u.g);
  const uint16_t* v_block = block_pointer(a.v, u.seq, u.block, u.g);
  const bool with_dq = a.dq_mode != kDqNone;

  // Thread r < 64 decodes row r of every tile. LSE2 and Delta of a placed row follow its Q / dO
  // gather (cp.async); a padding row gets 0 for both (its limit -1 masks every key).
  const bool decoder = threadIdx.x < kBwdRowTile;
  const auto gather_row_stats = [&](const BackwardRows& rows) {
    const int64_t off = rows.q_off[threadIdx.x];  // this thread's own store
    if (off >= 0) {
      cp_async_4(rows.lse2 + threadIdx.x, a.lse2 + off / T::kD);
      cp_async_4(rows.delta + threadIdx.x, a.delta + off / T::kD);
    } else {
      rows.lse2[threadIdx.x] = 0.0f;
      rows.delta[threadIdx.x] = 0.0f;
    }
  };
  // Prologue: rows of tiles 0 and 1, the key of tile 2's row, then K, V and tile 0's Q / dO.
  uint64_t next_key = 0;
  if (decoder) {
    for (int tile = 0; tile < 2; ++tile) {
      const int64_t m = tile * kBwdRowTile + threadIdx.x;
      decode_backward_row_place(a, u, m, G, T::kD, backward_row_key(a, u, m, G), backward_stage_rows(info, tile),
                                threadIdx.x);
    }
    gather_row_stats(backward_stage_rows(info, 0));
    next_key = backward_row_key(a, u, 2 * kBwdRowTile + threadIdx.x, G);
  }
  __syncthreads();
#pragma unroll 4
  for (int i = threadIdx.x; i < T::kB * 16; i += T::kThreads) {
    copy_block_chunk(k_s, k_block, a.k.token_stride, valid_keys, i);
    copy_block_chunk(v_s, v_block, a.v.token_stride, valid_keys, i);
  }
  if (tiles > 0) gather_backward_tile(a, backward_stage_rows(info, 0), q_tile(0), do_tile(0));
  cp_async_commit();

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.0f;

  const uint32_t k_addr = smem_address(k_s), v_addr = smem_address(v_s), ds_addr = smem_address(ds_s);
  const auto following = [](int info_stage) { return info_stage + 1 == T::kInfoStages ? 0 : info_stage + 1; };
  int stage = 0;  // t % kInfoStages, counted
  for (int64_t t = 0; t < tiles; ++t, stage = following(stage)) {
    const int s = static_cast<int>(t & 1);
    const int stage_next = following(stage), stage_after = following(stage_next);
    const bool has_next = t + 1 < tiles;
    cp_async_wait<0>();    // this thread's copies of tile t (and K, V) landed
    fence_async_shared();  // ... and are visible to the tensor cores
    __syncthreads();       // everyone's copies, and the rows of tile t + 1 placed
    if (has_next) {
      const BackwardRows next_rows = backward_stage_rows(info, stage_next);
      gather_backward_tile(a, next_rows, q_tile(s ^ 1), do_tile(s ^ 1));
      if (decoder) gather_row_stats(next_rows);
    }
    cp_async_commit();
    if (decoder && t + 2 < tiles) {  // tile t + 2's rows from the key loaded a tile ago
      decode_backward_row_place(a, u, (t + 2) * kBwdRowTile + threadIdx.x, G, T::kD, next_key,
                                backward_stage_rows(info, stage_after), threadIdx.x);
      next_key = backward_row_key(a, u, (t + 3) * kBwdRowTile + threadIdx.x, G);  // used one tile on
    }

    const BackwardRows rows = backward_stage_rows(info, stage);
    const uint32_t q_addr = smem_address(q_tile(s)), do_addr = smem_address(do_tile(s));

    // S^T = K_w Q^T and dP^T = V_w dO^T (K-major over D: two 64-column slabs).
    float st[32], dpt[32];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < T::kD / 16; ++k) {
      const int slab = k / 4, within = (k % 4) * 32;
      const uint32_t key_off = slab * T::kB * 128 + wg * 64 * 128 + within;
      const uint32_t row_off = slab * kBwdRowTile * 128 + within;
      wgmma_m64n64k16_ss<0, 0>(st, wgmma_descriptor(k_addr + key_off), wgmma_descriptor(q_addr + row_off), k > 0);
      wgmma_m64n64k16_ss<0, 0>(dpt, wgmma_descriptor(v_addr + key_off), wgmma_descriptor(do_addr + row_off),
                               k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(st);
    fence_operands(dpt);

    // P^T and dS^T. Accumulator 4 n + i: key key_lo + 8 (i / 2), tile row 8 n + 2 (lane % 4) + i % 2.
#pragma unroll
    for (int n = 0; n < 8; ++n)
      backward_p_ds<true>(a, rows, 8 * n + 2 * (lane % 4), key_lo, *reinterpret_cast<float(*)[4]>(st + 4 * n),
                          *reinterpret_cast<float(*)[4]>(dpt + 4 * n));
    if constexpr (kKlTeacher) write_kl_teacher<8>(a, rows, 0, key_lo, lane, st);
    uint32_t pa[4][4], da[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pa[kk][j] = pack_bf16(st[8 * kk + 2 * j], st[8 * kk + 2 * j + 1]);
        da[kk][j] = pack_bf16(dpt[8 * kk + 2 * j], dpt[8 * kk + 2 * j + 1]);
      }
    if (with_dq) {
      // dS^T into the swizzled [128 keys x 64 rows] tile: the thread's pair (rows 8 n + 2 (lane
      // % 4) + {0, 1}) is 4 bytes of 16-byte chunk n of key row key_lo (+ 8).
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = key_lo + 8 * h;
          *reinterpret_cast<uint32_t*>(ds_s + key * 128 + ((n ^ (key & 7)) * 16) + 4 * (lane % 4)) =
              da[n / 2][2 * (n % 2) + h];
        }
    }

    // dV += P^T dO, dK += dS^T Q: B = dO / Q [rows x D] read transposed (N = D over two
    // 64-column slabs 8 KB apart, k steps of 16 rows = 2 KB).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_m64n128k16_rs_tb(dv, pa[kk], wgmma_descriptor(do_addr + kk * 16 * 128, T::kTileBytes / 2, 1024), 1);
      wgmma_m64n128k16_rs_tb(dk, da[kk], wgmma_descriptor(q_addr + kk * 16 * 128, T::kTileBytes / 2, 1024), 1);
    }
    wgmma_commit();

    if (with_dq) {
      fence_async_shared();  // dS^T written by the threads, read by the tensor cores
      __syncthreads();       // both warpgroups' halves of dS^T
      // dQ[:, 64 w, 64 w + 64) = dS K over the 128 keys: A = dS^T read transposed (M = the
      // 64 rows in one slab), B = K's slab w read transposed; k steps of 16 keys = 2 KB.
      const int64_t dq_off[2] = {rows.dq_off[warp * 16 + lane / 4], rows.dq_off[warp * 16 + lane / 4 + 8]};
      float dqa[32];
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < T::kB / 16; ++k)
        wgmma_m64n64k16_ss<1, 1>(dqa, wgmma_descriptor(ds_addr + k * 16 * 128, T::kDsBytes, 1024),
                                 wgmma_descriptor(k_addr + wg * T::kB * 128 + k * 16 * 128, T::kKeyBytes / 2, 1024),
                                 k > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(dqa);
      write_dq_rows(a, dq_off, wg * 64, lane,
                    [&](int n, int r) { return make_float2(dqa[4 * n + 2 * r], dqa[4 * n + 2 * r + 1]); });
    }
    // No barrier here: the next tile's first barrier is passed only once every warpgroup has
    // waited for its MMAs, which frees stage s, dS^T and this tile's row info for reuse.
    wgmma_wait<0>();
    fence_operands(dv);
    fence_operands(dk);
  }
  cp_async_wait<0>();

  // Accumulator 4 n + 2 r + {0, 1}: key key_lo + 8 r, columns 8 n + 2 (lane % 4) + {0, 1}.
  add_block_grads<16>(a, k_block, key_lo, valid_keys, lane, [&](int n, int r) {
    return make_float4(dk[4 * n + 2 * r], dk[4 * n + 2 * r + 1], dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1]);
  });
}

}  // namespace msa::cuda::attn
