// Quantize-on-append of fp8 K/V caches (msa/cuda/quantize.h): the CPU rule of
// src/core/fp8_rows.cpp step for step (f32 amax; scale = amax / 448 as an IEEE f32 division;
// codes e4m3 round to nearest even, saturating: cuda/common/e4m3.cuh), so the device writes
// the bytes the host op msa::append_kv_cache writes.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda/common/cuda_check.h"
#include "cuda/common/e4m3.cuh"
#include "msa/cuda/quantize.h"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float input_value(const void* values, InputType input, int64_t i) {
  return input == InputType::bf16 ? bf16_value(static_cast<const uint16_t*>(values)[i])
                                  : static_cast<const float*>(values)[i];
}

// One warp per (token, KV head, K or V): warp item = ((t * heads) + h) * 2 + (0: K, 1: V). A
// skipped token's warps exit at once (warp-uniform).
__global__ void __launch_bounds__(kThreads) append_kv_fp8_kernel(const KvAppendParams p) {
  const int64_t item = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (item >= p.tokens * p.kv_heads * 2) return;
  const bool is_v = item % 2 == 1;
  const int64_t h = (item / 2) % p.kv_heads, t = item / 2 / p.kv_heads;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // padding
  const int64_t page = slot / p.block_size, row = slot % p.block_size;
  const int64_t D = p.head_dim;
  const void* values = is_v ? p.v : p.k;
  const int64_t in = (t * p.kv_heads + h) * D;
  const int64_t at = (page * p.kv_heads + h) * p.block_size + row;  // (page, head, row)
  uint8_t* codes = (is_v ? p.v_cache : p.k_cache) + at * D;
  float* scales = is_v ? p.v_scale : p.k_scale;
  const KvScaleLayout layout = is_v ? p.v_layout : p.k_layout;
  float scale;
  if (layout == KvScaleLayout::per_tensor) {
    scale = scales[0];
  } else {
    float amax = 0.0f;
    for (int64_t d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(input_value(values, p.input, in + d)));
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    scale = __fdiv_rn(amax, 448.0f);
    if (lane == 0) scales[at] = scale;
  }
  for (int64_t d = lane; d < D; d += 32)
    codes[d] = scale == 0.0f ? 0 : to_e4m3(__fdiv_rn(input_value(values, p.input, in + d), scale));
}

}  // namespace

void append_kv_fp8(const KvAppendParams& p, Stream stream) {
  MSA_CHECK_ARG(p.tokens >= 0 && p.tokens < (int64_t{1} << 31), "tokens", "0 .. 2^31 - 1", p.tokens);
  if (p.tokens == 0) return;
  MSA_CHECK_ARG(p.kv_heads >= 1 && p.head_dim >= 1 && p.block_size >= 1, "kv_heads, head_dim, block_size",
                "positive values", std::to_string(p.kv_heads) + ", " + std::to_string(p.head_dim) + ", " +
                                       std::to_string(p.block_size));
  MSA_CHECK_ARG(p.tokens * p.kv_heads * 2 * 32 < (int64_t{1} << 40), "tokens x kv_heads",
                "fewer (token, head) rows", p.tokens * p.kv_heads);
  MSA_CHECK_ARG(p.input == InputType::bf16 || p.input == InputType::f32, "input", "bf16 or f32",
                static_cast<int>(p.input));
  for (const auto& [pointer, name] :
       {std::pair<const void*, const char*>{p.k, "k"}, {p.v, "v"}, {p.slot_mapping, "slot_mapping"},
        {p.k_cache, "k_cache"}, {p.v_cache, "v_cache"}, {p.k_scale, "k_scale"}, {p.v_scale, "v_scale"}})
    MSA_CHECK_ARG(pointer != nullptr, name, "a device pointer", "null");
  const int64_t warps = p.tokens * p.kv_heads * 2;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  append_kv_fp8_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
