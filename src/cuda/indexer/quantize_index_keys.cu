// Device quantizer of index keys (msa/cuda/quantize.h): the CPU rules of
// src/core/quantized_index_keys.cpp, step for step (f32 divisions round to nearest even,
// e4m3 conversion RNE saturating, e2m1 by the same routine: core/e2m1_rounding.h).
#include "msa/cuda/quantize.h"

#include <cuda_runtime.h>

#include <string>

#include "core/e2m1_rounding.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/e4m3.cuh"

namespace msa::cuda {

namespace {

constexpr int kThreads = 256;

// One warp per token: amax, scale = amax / 448, codes = e4m3(x / scale).
__global__ void __launch_bounds__(kThreads)
    quantize_fp8_kernel(const uint16_t* keys, int64_t tokens, int dim, uint8_t* codes,
                        float* scales) {
  const int64_t token = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= tokens) return;  // warp-uniform
  const uint16_t* row = keys + token * dim;
  float amax = 0.0f;
  for (int d = lane; d < dim; d += 32) amax = fmaxf(amax, fabsf(bf16_value(row[d])));
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = __fdiv_rn(amax, 448.0f);
  if (lane == 0) scales[token] = scale;
  for (int d = lane; d < dim; d += 32)
    codes[token * dim + d] = scale == 0.0f ? 0 : to_e4m3(__fdiv_rn(bf16_value(row[d]), scale));
}

// One thread per (token, 16-channel group): scale = smallest e4m3 >= amax / 6, 8 code bytes.
__global__ void __launch_bounds__(kThreads)
    quantize_fp4_kernel(const uint16_t* keys, int64_t groups, uint8_t* codes, uint8_t* scales) {
  const int64_t group = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (group >= groups) return;
  float x[16];
  const uint4* source = reinterpret_cast<const uint4*>(keys + group * 16);
  float amax = 0.0f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint4 v = source[half];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      x[8 * half + 2 * w] = __uint_as_float(words[w] << 16);
      x[8 * half + 2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const float wanted = __fdiv_rn(amax, 6.0f);
  uint8_t scale_code = 0;
  uint32_t packed[2] = {0u, 0u};
  if (wanted != 0.0f) {
    scale_code = to_e4m3(wanted);
    if (e4m3_value(scale_code) < wanted && scale_code < 0x7e) ++scale_code;
    const float scale = e4m3_value(scale_code);
#pragma unroll
    for (int i = 0; i < 16; ++i)
      packed[i / 8] |= msa::detail::e2m1_round(__fdiv_rn(x[i], scale)) << (4 * (i % 8));
  }
  scales[group] = scale_code;
  reinterpret_cast<uint2*>(codes)[group] = make_uint2(packed[0], packed[1]);
}

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace

void quantize_index_keys(const uint16_t* keys, int64_t tokens, int64_t dim, KeyFormat format,
                         uint8_t* codes, uint8_t* scales, Stream stream) {
  MSA_CHECK_ARG(dim >= 16 && dim % 16 == 0 && dim <= 1024, "dim",
                "a multiple of 16 in [16, 1024]", dim);
  MSA_CHECK_ARG(format != KeyFormat::bf16, "format", "fp8 or fp4", "bf16");
  MSA_CHECK_ARG(tokens >= 0 && tokens * dim < (int64_t{1} << 40), "tokens",
                "a non-negative count", tokens);
  if (tokens == 0) return;
  MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(keys) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(codes) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(scales) % 4 == 0,
                "keys/codes/scales", "aligned device pointers", "a misaligned pointer");
  const auto s = static_cast<cudaStream_t>(stream);
  if (format == KeyFormat::fp8) {
    quantize_fp8_kernel<<<blocks_for(tokens * 32), kThreads, 0, s>>>(
        keys, tokens, static_cast<int>(dim), codes, reinterpret_cast<float*>(scales));
  } else {
    const int64_t groups = tokens * (dim / 16);
    quantize_fp4_kernel<<<blocks_for(groups), kThreads, 0, s>>>(keys, groups, codes, scales);
  }
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
