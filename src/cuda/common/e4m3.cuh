// The e4m3 rounding of the device quantizers (the fp8 index keys, src/cuda/indexer/
// quantize_index_keys.cu; the fp8 K/V append, src/cuda/decode/append_kv_fp8.cu), written once:
// the hardware conversion rounds to nearest even and saturates finite values at +-448, as the
// CPU's float_to_e4m3 (msa/dtype.h) does, so both write the same codes.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace msa::cuda {

__device__ __forceinline__ float bf16_value(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

__device__ __forceinline__ uint8_t to_e4m3(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_value(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace msa::cuda
