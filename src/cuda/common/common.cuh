// Device vocabulary shared by the kernels: checks, bf16 packing, warp-level tensor-core
// MMA (m16n8k16, bf16 in, f32 accumulate), ldmatrix, cp.async and warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/sequence_geometry.h"



namespace msa::cuda {

constexpr float kNegInf = -__builtin_huge_valf();

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Attention outputs in f32 or bf16 (msa::cuda::OutputType; the flag is uniform across a
// launch, so the branch costs nothing next to the store). `index` counts elements of the
// whole output; bf16 rounds to nearest even, as the host's f32 -> bf16 conversion.
__device__ __forceinline__ void store_output2(void* out, bool bf16, int64_t index, float a, float b) {
  if (bf16)
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + index) = pack_bf16(a, b);
  else
    *reinterpret_cast<float2*>(static_cast<float*>(out) + index) = make_float2(a, b);
}
__device__ __forceinline__ void store_output8(void* out, bool bf16, int64_t index, const float (&v)[8]) {
  if (bf16) {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + index) =
        make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
  } else {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(out) + index);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// Unpacks 8 bf16 (one 16-byte load) to f32: the low half of each word first.
__device__ __forceinline__ void unpack_bf16x8(const uint4& packed, float (&out)[8]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// D = A (16x16, row) * B (16x8, col) + C, bf16 inputs, f32 accumulators. Fragment layout
// (PTX ISA, mma.m16n8k16): a[0..3], b[0..1] hold packed bf16 pairs, c/d[0..3] floats for
// rows lane/4 and lane/4 + 8, columns 2*(lane%4) + {0, 1}.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The two n-tiles of a 16 x 16 B operand loaded by one ldmatrix.x4 (b[0..1]: columns 0-7,
// b[2..3]: columns 8-15): d0 = A B[:, 0:8] + d0, then d1 = A B[:, 8:16] + d1.
__device__ __forceinline__ void mma_bf16_16816_x2(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[4]) {
  const uint32_t b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
  mma_bf16_16816(d0, a, b_lo);
  mma_bf16_16816(d1, a, b_hi);
}

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row_address)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(row_address)));
}

// 16-byte asynchronous global -> shared copy; `valid` false writes zeros instead.
__device__ __forceinline__ void cp_async_16(uint32_t shared, const void* global,
                                            bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid = true) {
  cp_async_16(smem_address(shared), global, valid);
}
// 16-byte cp.async issued only where `pred` holds: a predicated instruction, not a branch
// (no divergent path while MMAs are in flight).
__device__ __forceinline__ void cp_async_16_if(uint32_t shared, const void* global, bool pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "@p cp.async.cg.shared.global [%0], [%1], 16;\n"
      "}\n" ::"r"(shared),
      "l"(global), "r"(int(pred)));
}
// 8- and 4-byte asynchronous copies (L1-allocating: sizes below 16 have no .cg form).
__device__ __forceinline__ void cp_async_8(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_address(shared)), "l"(global));
}
__device__ __forceinline__ void cp_async_4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(shared)), "l"(global));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// 2^x by one ex2.approx (flush-to-zero; 2^-inf = 0): the wgmma softmaxes' exponential.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Page ids of a paged KeyLayout, checked where the layout asks (KeyLayout::page_fault; the
// decode kernels): checked_page() turns an id outside [0, pages) into page 0 and notes the
// first one in the thread's PageFaultNote, report_page_fault() records the note once the
// thread's reads are issued. Reporting at once would put an atomic between two page-table
// loads, which the compiler then keeps in order: a prologue's loads, otherwise in flight
// together, turn into a chain of round trips (measured: +0.5 us per decode step at batch 1).
struct PageFaultNote {
  int32_t block = -1;  // the first bad block read, -1: none
  int32_t id = 0;
};

template <class Layout>
__device__ __forceinline__ int64_t checked_page(const Layout& keys, int64_t block, int32_t id,
                                                PageFaultNote& note) {
  const bool bad = keys.page_fault != nullptr && !(id >= 0 && id < keys.pages);
  if (bad && note.block < 0) {
    note.block = static_cast<int32_t>(block);
    note.id = id;
  }
  return bad ? 0 : id;
}

// The raw page id of block `block` of sequence `seq` in a paged KeyLayout (0 when not paged).
// A kernel that issues copies from several pages loads their ids ahead (all of a prologue's
// together) and checks each where its copies are issued (checked_page): loaded next to its
// use, every id is a page-table round trip that the copies, and the work behind them, wait for.
template <class Layout>
__device__ __forceinline__ int32_t page_id_of(const Layout& keys, int64_t seq, int64_t block) {
  return keys.page_table ? keys.page_table[seq * keys.page_table_stride + block] : 0;
}

// The note of request `seq` into the step's status (the first report of the step wins, so a
// step with one bad entry names it exactly).
template <class Layout>
__device__ __forceinline__ void report_page_fault(const Layout& keys, int64_t seq, const PageFaultNote& note) {
  if (note.block < 0) return;
  GeometryStatus* status = keys.page_fault;
  if (atomicCAS(reinterpret_cast<int*>(&status->request), -1, static_cast<int>(seq)) == -1) {
    status->error = GeometryError::page_out_of_range;
    status->value = page_fault_value(note.block, note.id);
  }
}

// Address of token t (of one head) in a KeyLayout-described tensor.
template <class Layout>
__device__ __forceinline__ const uint16_t* block_pointer(const Layout& keys, int64_t seq,
                                                         int64_t block, int64_t head) {
  if (keys.page_table)
    return keys.data + static_cast<int64_t>(page_id_of(keys, seq, block)) * keys.block_stride +
           head * keys.head_stride;
  return keys.data + keys.seq_token_start[seq] * keys.token_stride + block * keys.block_stride +
         head * keys.head_stride;
}

// block_pointer of a paged layout from the block's page id as loaded (page_id_of), checked
// (checked_page): the decode kernels' reads.
template <class Layout>
__device__ __forceinline__ const uint16_t* checked_block_pointer(const Layout& keys, int64_t seq, int64_t block,
                                                                 int32_t id, int64_t head, PageFaultNote& note) {
  if (!keys.page_table) return block_pointer(keys, seq, block, head);
  return keys.data + checked_page(keys, block, id, note) * keys.block_stride + head * keys.head_stride;
}

}  // namespace msa::cuda
