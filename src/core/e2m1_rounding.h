// The e2m1 (OCP FP4) rounding of the index-key quantizers, written once for the CPU
// quantizer (quantized_index_keys.cpp: float_to_e2m1) and the device one
// (src/cuda/indexer/quantize_index_keys.cu), so both give the same codes bit for bit. Compiles as
// plain C++ and, under nvcc, as a __host__ __device__ function.
#pragma once
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MSA_HOST_DEVICE inline
#endif

namespace msa::detail {

// The e2m1 code (sign in bit 3, magnitude code 0..7 for 0, 0.5, 1, 1.5, 2, 3, 4, 6) nearest
// to `value`: the midpoints between neighbouring magnitudes decide, a tie goes to the even
// code, larger values (and NaN) saturate to 6; -0 keeps its sign.
MSA_HOST_DEVICE uint32_t e2m1_round(float value) {
  const uint32_t sign = std::signbit(value) ? 0x8u : 0x0u;
  const float v = std::fabs(value);
  uint32_t code;
  if (v <= 0.25f) code = 0;
  else if (v < 0.75f) code = 1;
  else if (v <= 1.25f) code = 2;
  else if (v < 1.75f) code = 3;
  else if (v <= 2.5f) code = 4;
  else if (v < 3.5f) code = 5;
  else if (v <= 5.0f) code = 6;
  else code = 7;  // saturating (and NaN)
  return sign | code;
}

}  // namespace msa::detail

#undef MSA_HOST_DEVICE
