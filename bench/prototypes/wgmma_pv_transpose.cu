// Prototype / layout check: one warpgroup computes S = Q K^T (both K-major, shared memory)
// and O = bf16(S / 16) V with the A operand in registers and V [keys x D] read transposed
// (MN-major, 128B swizzle), for each candidate (leading, stride) byte offset of V's
// descriptor. Prints the max relative error of each against a CPU loop: the pair the sparse
// attention kernel uses (kernels/attention_sparse_wgmma.cuh) must print ~1e-3.
// H200, 2026-11-29: leading 16384 / stride 1024 -> 4.0e-06 (the layout's 64-column slabs are
// 16 KB apart, its 8-row groups 1 KB); the three other pairs -> ~1 (wrong).
// Build from the repository root: nvcc -O3 -std=c++17 -I src
// -gencode=arch=compute_90a,code=sm_90a bench/prototypes/wgmma_pv_transpose.cu -o pv
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/common/common.cuh"
#include "cuda/common/wgmma.cuh"

using namespace msa::cuda;

__global__ void __launch_bounds__(128) pv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                                 uint32_t leading, uint32_t stride, float* out) {
  __shared__ __align__(1024) unsigned char smem[3 * 32768];
  unsigned char* qs = smem;            // 64 rows (16 KB used)
  unsigned char* ks = smem + 32768;    // 128 keys
  unsigned char* vs = smem + 65536;    // 128 keys x 128 D
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 16; i += 128) {
    const int row = i / 16, chunk = i % 16;
    cp_async_16(qs + swizzled_offset(row, chunk, 64), q + row * 128 + chunk * 8);
  }
  for (int i = tid; i < 128 * 16; i += 128) {
    const int row = i / 16, chunk = i % 16;
    cp_async_16(ks + swizzled_offset(row, chunk, 128), k + row * 128 + chunk * 8);
    cp_async_16(vs + swizzled_offset(row, chunk, 128), v + row * 128 + chunk * 8);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();
  float s[64];
  wgmma_fence();
  for (int kk = 0; kk < 8; ++kk) {
    const int slab = kk / 4, within = (kk % 4) * 32;
    wgmma_m64n128k16(s, wgmma_descriptor(smem_address(qs) + slab * 64 * 128 + within),
                     wgmma_descriptor(smem_address(ks) + slab * 128 * 128 + within), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(s);
  uint32_t p[8][4];
  for (int kk = 0; kk < 8; ++kk)
    for (int j = 0; j < 4; ++j) p[kk][j] = pack_bf16(s[8 * kk + 2 * j] / 16, s[8 * kk + 2 * j + 1] / 16);
  float o[64];
  wgmma_fence();
  for (int kk = 0; kk < 8; ++kk)
    wgmma_m64n128k16_rs_tb(o, p[kk], wgmma_descriptor(smem_address(vs) + kk * 2048, leading, stride),
                           kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(o);
  const int warp = tid / 32, lane = tid % 32;
  for (int i = 0; i < 64; ++i) {
    const int row = warp * 16 + lane / 4 + 8 * ((i % 4) / 2);
    const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
    out[row * 128 + col] = o[i];
  }
}

static uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
static float from_bf16(uint16_t h) {
  uint32_t u = uint32_t{h} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> q(64 * 128), k(128 * 128), v(128 * 128);
  for (auto& x : q) x = to_bf16(normal(rng));
  for (auto& x : k) x = to_bf16(normal(rng));
  for (auto& x : v) x = to_bf16(normal(rng));
  std::vector<double> ref(64 * 128, 0.0);
  for (int r = 0; r < 64; ++r) {
    std::vector<float> p(128);
    for (int t = 0; t < 128; ++t) {
      float acc = 0;
      for (int d = 0; d < 128; ++d) acc += from_bf16(q[r * 128 + d]) * from_bf16(k[t * 128 + d]);
      p[t] = from_bf16(to_bf16(acc / 16));
    }
    for (int d = 0; d < 128; ++d)
      for (int t = 0; t < 128; ++t) ref[r * 128 + d] += double(p[t]) * from_bf16(v[t * 128 + d]);
  }
  uint16_t *dq, *dk, *dv;
  float* dout;
  cudaMalloc(&dq, q.size() * 2);
  cudaMalloc(&dk, k.size() * 2);
  cudaMalloc(&dv, v.size() * 2);
  cudaMalloc(&dout, 64 * 128 * 4);
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  const uint32_t candidates[][2] = {{16384, 1024}, {1024, 16384}, {8192, 1024}, {1024, 8192}};
  for (const auto& c : candidates) {
    cudaMemset(dout, 0xff, 64 * 128 * 4);
    pv_kernel<<<1, 128>>>(dq, dk, dv, c[0], c[1], dout);
    const cudaError_t e = cudaDeviceSynchronize();
    std::vector<float> out(64 * 128);
    cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      num += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    std::printf("leading %u stride %u: %s rel L2 error %.3e\n", c[0], c[1], cudaGetErrorString(e),
                std::sqrt(num / den));
  }
  return 0;
}
