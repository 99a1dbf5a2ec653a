// Hopper warpgroup MMA (wgmma, sm_90a) vocabulary: shared-memory matrix descriptors for the
// 128-byte-swizzled K-major layout, the m64n128k16 bf16 MMA, and its fences.
//
// Layout: a [rows x 128] bf16 tile is two 64-column slabs; in a slab each row is 128 B and
// 16-byte chunk c of row r sits at chunk c ^ (r % 8) (the 128-byte swizzle). Tiles must be
// 1024-byte aligned. A k step of 16 elements advances the descriptor by 32 B inside a slab.
#pragma once
#include <cstdint>

namespace msa::cuda {

// Byte offset of 16-byte chunk `chunk` (0..15, 8 bf16 each) of row `row` in such a tile.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk, int rows) {
  const int slab = chunk / 8, c = chunk % 8;
  return slab * rows * 128 + row * 128 + ((c ^ (row & 7)) * 16);
}

// Descriptor of a 128B-swizzled operand starting at shared address `address`. K-major
// (the default): the leading byte offset is unused, the stride byte offset is 8 rows x 128 B.
// MN-major (a B operand read transposed, e.g. V [keys x D] for P V): `leading` is the
// distance between 64-column slabs of the N dimension and `stride` between 8-row groups of K.
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t address, uint32_t leading = 16,
                                                     uint32_t stride = 1024) {
  uint64_t desc = (address & 0x3ffff) >> 4;
  desc |= uint64_t((leading >> 4) & 0x3fff) << 16;
  desc |= uint64_t((stride >> 4) & 0x3fff) << 32;
  desc |= uint64_t(1) << 62;  // 128-byte swizzle
  return desc;
}

// The 64 f32 accumulators of an m64n128 wgmma: their register list in the instruction text
// (operands %0..%63) and the matching read-write operand constraints.
#define MSA_WGMMA_ACCUMULATORS                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                 \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "        \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "        \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define MSA_WGMMA_ACCUMULATOR_OPERANDS(d)                                                  \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),       \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),            \
      "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),         \
      "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),         \
      "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),         \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),         \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),         \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),         \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),         \
      "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[64] = A(64x16) * B(16x128) + (accumulate ? d : 0), both operands in shared memory.
// Accumulator layout per warp w of the warpgroup: d[4n + {0,1}] row 16w + lane/4, columns
// 8n + 2(lane%4) + {0,1}; d[4n + {2,3}] the same columns of row + 8.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b,
                                                 int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MSA_WGMMA_ACCUMULATORS 
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : MSA_WGMMA_ACCUMULATOR_OPERANDS(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d = A(64 x kDepth) * B(128 x kDepth)^T: kDepth / 16 k-steps of 16 across the 64-column
// slabs of 128B-swizzled K-major tiles at shared addresses `a` (a_rows rows) and `b` (b_rows
// rows); the first step overwrites d. kDepth 128 reads both slabs whole; 80 (the vision
// tower's head dim) reads slab 0 and the first 16 columns of slab 1 (the rest is never read).
// The caller fences before and commits after.
template <int kDepth = 128>
__device__ __forceinline__ void wgmma_m64n128_ss(float (&d)[64], uint32_t a, int a_rows, uint32_t b, int b_rows) {
  static_assert(kDepth % 16 == 0 && kDepth <= 128, "k-steps of 16 within two 64-column slabs");
#pragma unroll
  for (int k = 0; k < kDepth / 16; ++k) {
    const int slab = k / 4, within = (k % 4) * 32;
    wgmma_m64n128k16(d, wgmma_descriptor(a + slab * a_rows * 128 + within),
                     wgmma_descriptor(b + slab * b_rows * 128 + within), k > 0);
  }
}
__device__ __forceinline__ void wgmma_m64n128k128_ss(float (&d)[64], uint32_t a, int a_rows, uint32_t b,
                                                     int b_rows) {
  wgmma_m64n128_ss<128>(d, a, a_rows, b, b_rows);
}

// d[64] = A(64x16, registers) * B(16x128, shared memory, MN-major: read transposed) +
// (accumulate ? d : 0). A fragment per warp w (rows 16w..16w+15): a[0] row lane/4, columns
// 2(lane%4) + {0,1}; a[1] row + 8; a[2], a[3] the same rows at columns + 8 — which is the
// accumulator layout of columns 16k..16k+15 (d[8k .. 8k+7]) packed to bf16 pairs, so a
// softmax'ed score tile feeds the next MMA without a trip through shared memory.
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const uint32_t (&a)[4],
                                                       uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      MSA_WGMMA_ACCUMULATORS 
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : MSA_WGMMA_ACCUMULATOR_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// wgmma_m64n128k16_rs_tb with N = 80 (the vision tower's head dim: O = P V over 80 value
// columns, 40 accumulators in the same layout, d[4n + ...] for columns 8n + ..., n < 10). The
// MN-major B spans slab 0 and the first 16 columns of slab 1 (the descriptor's leading offset).
__device__ __forceinline__ void wgmma_m64n80k16_rs_tb(float (&d)[40], const uint32_t (&a)[4], uint64_t b,
                                                      int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %45, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "
      "{%40, %41, %42, %43}, %44, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d[32] = A(64x16) * B(16x64) + (accumulate ? d : 0), both operands in shared memory (the
// accumulator layout of the m64n128 form, n < 8). kTransA / kTransB: that operand is MN-major
// (read transposed: M, resp. N, contiguous in 128-byte rows; the descriptor's leading offset
// is the distance between 64-element slabs of M / N, its stride the distance between 8-row
// groups of K), else K-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, %36;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written by cp.async (generic proxy) becomes visible to wgmma (async proxy).
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an asynchronous MMA.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace msa::cuda
