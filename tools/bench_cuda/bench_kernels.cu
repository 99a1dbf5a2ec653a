#include "bench_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/common/cuda_check.h"


namespace msa::cuda::bench {

namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Two normals per 64-bit hash (Box-Muller on two 24-bit uniforms in (0, 1]).
__global__ void fill_normal_bf16_kernel(uint16_t* data, size_t count, uint64_t seed, float stddev) {
  const size_t pairs = (count + 1) / 2;
  const uint64_t key = splitmix64(seed * 0x632be59bd9b4e019ull + 1);
  for (size_t p = blockIdx.x * size_t{blockDim.x} + threadIdx.x; p < pairs;
       p += size_t{gridDim.x} * blockDim.x) {
    const uint64_t h = splitmix64(key ^ p);
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    const float radius = stddev * sqrtf(-2.0f * logf(u1));
    float s, c;
    sincospif(2.0f * u2, &s, &c);
    const __nv_bfloat16 x0 = __float2bfloat16_rn(radius * c);
    const __nv_bfloat16 x1 = __float2bfloat16_rn(radius * s);
    data[2 * p] = *reinterpret_cast<const uint16_t*>(&x0);
    if (2 * p + 1 < count) data[2 * p + 1] = *reinterpret_cast<const uint16_t*>(&x1);
  }
}

__global__ void fill_uniform_bytes_kernel(uint8_t* data, size_t count, uint64_t seed, uint32_t lo, uint32_t span,
                                          bool random_top_bit) {
  const uint64_t key = splitmix64(seed * 0x632be59bd9b4e019ull + 1);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const uint64_t h = splitmix64(key ^ i);
    const uint32_t value = lo + static_cast<uint32_t>((h >> 8) % span);
    data[i] = static_cast<uint8_t>(value | (random_top_bit && (h & 1) ? 0x80u : 0u));
  }
}

// rows[t] = rows[t - t % block] + noise x rows[t] for tokens t not at a block start (those are
// only read, so the update is race-free).
__global__ void share_block_rows_kernel(uint16_t* rows, size_t tokens, size_t row_elems, size_t block, float noise) {
  const size_t count = tokens * row_elems;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count; i += size_t{gridDim.x} * blockDim.x) {
    const size_t t = i / row_elems;
    if (t % block == 0) continue;
    const size_t base = (t - t % block) * row_elems + i % row_elems;
    const float x = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(rows + base)) +
                    noise * __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(rows + i));
    const __nv_bfloat16 y = __float2bfloat16_rn(x);
    rows[i] = *reinterpret_cast<const uint16_t*>(&y);
  }
}

// Grid-stride 16-byte loads, four in flight per thread.
__global__ void stream_read_kernel(const uint4* data, size_t count, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    const uint4 a = __ldcs(data + i);
    const uint4 b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride);
    const uint4 d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
  for (; i < count; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u && threadIdx.x == 1023) *sink = acc;  // practically never
}

// Four elements per step (16-byte loads, 8-byte stores; cudaMalloc pointers are aligned),
// then the tail of count % 4 elements.
__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, size_t count) {
  const size_t stride = size_t{gridDim.x} * blockDim.x, quads = count / 4;
  const size_t first = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (size_t i = first; i < quads; i += stride) {
    const float4 x = reinterpret_cast<const float4*>(in)[i];
    const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    reinterpret_cast<uint2*>(out)[i] = packed;
  }
  for (size_t i = 4 * quads + first; i < count; i += stride) {
    const __nv_bfloat16 x = __float2bfloat16_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&x);
  }
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__global__ void squared_error_kernel(const float* a, const void* b, bool b_is_bf16, size_t count,
                                     double* sums) {
  double diff = 0, norm = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count;
       i += size_t{gridDim.x} * blockDim.x) {
    const float ref = b_is_bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(b)[i])
                                : static_cast<const float*>(b)[i];
    const double d = static_cast<double>(a[i]) - ref;
    diff += d * d;
    norm += static_cast<double>(ref) * ref;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    diff += __shfl_xor_sync(0xffffffffu, diff, offset);
    norm += __shfl_xor_sync(0xffffffffu, norm, offset);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], diff);
    atomicAdd(&sums[1], norm);
  }
}

int grid_for(size_t work, int threads) {
  int device = 0, sms = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  MSA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t blocks = (work + threads - 1) / threads;
  const size_t cap = static_cast<size_t>(sms) * 8;
  return static_cast<int>(blocks < cap ? (blocks ? blocks : 1) : cap);
}

}  // namespace

void fill_normal_bf16(uint16_t* data, size_t count, uint64_t seed, float stddev, void* stream) {
  if (!count) return;
  const int threads = 256;
  fill_normal_bf16_kernel<<<grid_for((count + 1) / 2, threads), threads, 0,
                            static_cast<cudaStream_t>(stream)>>>(data, count, seed, stddev);
  MSA_CUDA_CHECK(cudaGetLastError());
}

void share_block_rows(uint16_t* rows, size_t tokens, size_t row_elems, size_t block, float noise, void* stream) {
  if (!tokens || !row_elems) return;
  const int threads = 256;
  share_block_rows_kernel<<<grid_for(tokens * row_elems, threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, tokens, row_elems, block, noise);
  MSA_CUDA_CHECK(cudaGetLastError());
}

void fill_uniform_bytes(uint8_t* data, size_t count, uint64_t seed, uint8_t lo, uint8_t hi, bool random_top_bit,
                        void* stream) {
  if (!count) return;
  if (lo > hi) MSA_FAIL("fill_uniform_bytes: lo ", int{lo}, " above hi ", int{hi});
  const int threads = 256;
  fill_uniform_bytes_kernel<<<grid_for(count, threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      data, count, seed, lo, uint32_t{hi} - lo + 1, random_top_bit);
  MSA_CUDA_CHECK(cudaGetLastError());
}

void stream_read(const void* data, size_t bytes, uint32_t* sink, void* stream) {
  if (bytes % 16) MSA_FAIL("stream_read: ", bytes, " bytes is not a multiple of 16");
  const int threads = 1024;
  int device = 0, sms = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  MSA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  stream_read_kernel<<<sms * 2, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(data), bytes / 16, sink);
  MSA_CUDA_CHECK(cudaGetLastError());
}

void f32_to_bf16(const float* in, uint16_t* out, size_t count, void* stream) {
  if (!count) return;
  if (reinterpret_cast<uintptr_t>(in) % 16 || reinterpret_cast<uintptr_t>(out) % 8)
    MSA_FAIL("f32_to_bf16: expected 16-byte aligned input and 8-byte aligned output pointers");
  const int threads = 256;
  f32_to_bf16_kernel<<<grid_for((count + 3) / 4, threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, out, count);
  MSA_CUDA_CHECK(cudaGetLastError());
}

double relative_l2_error(const float* a, const void* b, bool b_is_bf16, size_t count,
                         void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  double* sums = nullptr;
  MSA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&sums), 2 * sizeof(double), s));
  MSA_CUDA_CHECK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), s));
  const int threads = 256;
  squared_error_kernel<<<grid_for(count, threads), threads, 0, s>>>(a, b, b_is_bf16, count, sums);
  MSA_CUDA_CHECK(cudaGetLastError());
  double host[2] = {0, 0};
  MSA_CUDA_CHECK(cudaMemcpyAsync(host, sums, sizeof host, cudaMemcpyDeviceToHost, s));
  MSA_CUDA_CHECK(cudaFreeAsync(sums, s));
  MSA_CUDA_CHECK(cudaStreamSynchronize(s));
  if (std::isnan(host[0]) || std::isnan(host[1])) return NAN;
  if (host[1] == 0) return host[0] == 0 ? 0.0 : INFINITY;
  return std::sqrt(host[0] / host[1]);
}

}  // namespace msa::cuda::bench
