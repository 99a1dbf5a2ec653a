// KL backward of the indexer: the student LSE of every (query, index head) row of a chunk,
// log sum_t exp(logit_scale qi . ki(t)) over the row's selected visible tokens, on the
// tensor cores over the same KV-block-major work items as kl_entries_kernel.
//
// Why: the row-major selected_lse_kernel (indexer_rows.cuh; one warp per row, f32 FMAs) reads
// 16 x 32 KB of index keys per row: 268 GB from L2 at 128K (M3), ~64 ms, most of the training
// indexer's time when it ran that way. Here a KI block is loaded once per item of up to 64
// entries, and the scores are the same mma.sync tile_scores as the student phase of
// kl_entries_kernel (identical logits in both passes).
//
// - kl_student_lse_kernel: persistent, 8 warps; per item: entries, KI block and qi rows to
//   shared memory (indexer_kl_entries.cuh loaders); warp w takes entries 16 (w % 4) ..
//   + 15 and the 64-key half w / 4 of the block (B = 64: warps 4-7 idle), and writes each
//   entry's (max, sum exp(logit - max)) of the half to student_partial[entry][half]
//   (max = -inf, sum = 0 where the half has no visible key).
// - kl_student_lse_reduce_kernel: one thread per row of the chunk combines its partials in
//   slot order, then half order (deterministic), into student_lse [Hi, total_q].
#pragma once
#include "cuda/training/indexer_kl_reduce.cuh"

namespace msa::cuda::kl {

// Shared memory of kl_student_lse_kernel: KI block, qi rows, entries.
template <int Di>
struct StudentLseSmem {
  __host__ __device__ static constexpr size_t ki_offset() { return 0; }
  __host__ __device__ static constexpr size_t qi_offset(int B) {
    return ki_offset() + size_t(B) * smem_pitch<Di>() * 2;
  }
  __host__ __device__ static constexpr size_t entries_offset(int B) {
    return qi_offset(B) + size_t(kItemEntries) * smem_pitch<Di>() * 2;
  }
  __host__ __device__ static constexpr size_t bytes(int B) {
    return entries_offset(B) + size_t(kItemEntries) * sizeof(EntryInfo);
  }
};

template <int Di>
__global__ void __launch_bounds__(kKlThreads) kl_student_lse_kernel(const __grid_constant__ EntryArgs a) {
  using Smem = StudentLseSmem<Di>;
  constexpr int kPitch = smem_pitch<Di>();
  extern __shared__ uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  const int B = a.block_size;
  uint16_t* ki_smem = reinterpret_cast<uint16_t*>(smem + Smem::ki_offset());
  uint16_t* qi_smem = reinterpret_cast<uint16_t*>(smem + Smem::qi_offset(B));
  EntryInfo* entries = reinterpret_cast<EntryInfo*>(smem + Smem::entries_offset(B));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = 2 * (lane % 4);
  const int tile = (warp % 4) * attn::kWarpRows;  // kItemEntries = 4 m-tiles
  const int half = warp / 4, sub = half * kKeyTile;

  const unsigned n_items = *a.item_count;
  for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WorkItem item = a.items[it];
    const int n = item.count;
    const ItemGeometry geo = decode_item(a, item);
    load_item_entries(a, item, geo, false, entries);
    load_index_operands_async<Di, kKlThreads>(a, item, geo, ki_smem, qi_smem);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    if (tile < n && sub < B) {  // warp-uniform
      uint32_t qf[Di / 16][4];
      const uint16_t* q_row = qi_smem + (tile + (lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 8;
#pragma unroll
      for (int k = 0; k < Di / 16; ++k) ldmatrix_x4(qf[k], q_row + k * 16);
      float s[kKeyTile / 8][4];
      attn::tile_scores<Di>(s, qf, ki_smem + sub * kPitch, lane);
      const int64_t first_key = geo.block * B + sub;
      const int row[2] = {tile + lane / 4, tile + lane / 4 + 8};
      const EntryInfo info[2] = {entries[row[0]], entries[row[1]]};
      const int limit[2] = {attn::tile_limit(info[0].pos, first_key), attn::tile_limit(info[1].pos, first_key)};
      float row_max[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = nt * 8 + col + (i & 1);
          s[nt][i] = key <= limit[i / 2] ? s[nt][i] * a.logit_scale : kNegInf;
          row_max[i / 2] = fmaxf(row_max[i / 2], s[nt][i]);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_max[r] = attn::quad_max(row_max[r]);
        // No visible key: every term is exp(-inf) = 0 against a finite reference.
        const float reference = row_max[r] == kNegInf ? 0.0f : row_max[r];
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kKeyTile / 8; ++nt)
          sum += expf(s[nt][2 * r] - reference) + expf(s[nt][2 * r + 1] - reference);
        sum = attn::quad_sum(sum);
        if (lane % 4 == 0 && row[r] < n)
          a.student_partial[info[r].partial * 2 + half] = make_float2(row_max[r], sum);
      }
    }
    __syncthreads();  // the next item's loads overwrite every buffer
  }
}

struct StudentLseReduceArgs {
  const int32_t* topk;  // [Hi, total_q, slots]
  int64_t total_q, heads, slots, q_begin, chunk_q;
  int halves;                    // 64-key halves per block: B / 64
  const float2* student_partial;  // [chunk_q * Hi * slots, 2]
  float* student_lse;             // [Hi, total_q]
};

__global__ void __launch_bounds__(kReduceThreads) kl_student_lse_reduce_kernel(const StudentLseReduceArgs a) {
  const int64_t row = int64_t{blockIdx.x} * kReduceThreads + threadIdx.x;  // chunk-local q * Hi + h
  if (row >= a.chunk_q * a.heads) return;
  const int64_t local_q = row / a.heads, h = row % a.heads, q = a.q_begin + local_q;
  const int32_t* selected = a.topk + (h * a.total_q + q) * a.slots;
  float m = kNegInf, l = 0.0f;
  for (int64_t s = 0; s < a.slots && selected[s] >= 0; ++s)
    for (int half = 0; half < a.halves; ++half) {
      const float2 part = a.student_partial[(row * a.slots + s) * 2 + half];
      if (part.x == kNegInf) continue;  // no visible key in this half
      if (part.x > m) {
        l = l * expf(m - part.x) + part.y;
        m = part.x;
      } else {
        l += part.y * expf(part.x - m);
      }
    }
  a.student_lse[h * a.total_q + q] = l > 0.0f ? m + logf(l) : kNegInf;
}

}  // namespace msa::cuda::kl
