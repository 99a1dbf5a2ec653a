// Element types and exact conversions between them.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace msa {

enum class DType : uint8_t { f32, f64, bf16, f16, e4m3, i32, i64, u8 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);           // "f32", "bf16", ...
bool dtype_is_float(DType dtype);
// safetensors spellings: "F32", "BF16", "F8_E4M3", ... ; throws msa::Error for unknown ones.
std::string_view dtype_safetensors_name(DType dtype);
DType dtype_from_safetensors_name(std::string_view name);

// bf16: round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}
inline float bf16_to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// IEEE half: round to nearest even, overflow to infinity, subnormals kept.
uint16_t float_to_f16(float value);
float f16_to_float(uint16_t value);

// OCP FP8 E4M3 (e4m3fn: bias 7, no infinities, max 448): round to nearest even,
// saturating: finite values and infinities beyond +-448 become +-448; NaN stays NaN.
uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t value);

// Reads element `index` of a buffer of `dtype` as double / writes a double into it
// (rounded as above). Used at the edges (files, CLI, tests), never in hot loops.
double load_as_double(const void* data, DType dtype, int64_t index);
void store_from_double(void* data, DType dtype, int64_t index, double value);

}  // namespace msa
