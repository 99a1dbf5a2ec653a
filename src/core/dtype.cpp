#include "msa/dtype.h"

#include <cmath>
#include <limits>

#include "msa/error.h"

namespace msa {

namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
  std::string_view safetensors_name;
  bool is_float;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::f32, 4, "f32", "F32", true},   {DType::f64, 8, "f64", "F64", true},
    {DType::bf16, 2, "bf16", "BF16", true}, {DType::f16, 2, "f16", "F16", true},
    {DType::e4m3, 1, "e4m3", "F8_E4M3", true}, {DType::i32, 4, "i32", "I32", false},
    {DType::i64, 8, "i64", "I64", false},  {DType::u8, 1, "u8", "U8", false},
};

const DTypeInfo& info(DType dtype) {
  for (const auto& entry : kDTypes)
    if (entry.dtype == dtype) return entry;
  MSA_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

// A binary float format with `kMantissaBits` stored mantissa bits and exponent bias `bias`.
// Encodes |value| (finite, non-negative) with round-to-nearest-even into its exponent and
// mantissa fields; returns the magnitude code (sign not included). Values that round past
// `max_code` are left to the caller (they may overflow into the next binade).
uint32_t encode_magnitude(double magnitude, int mantissa_bits, int bias) {
  const int min_normal_exponent = 1 - bias;
  const double subnormal_unit = std::ldexp(1.0, min_normal_exponent - mantissa_bits);
  if (magnitude < std::ldexp(1.0, min_normal_exponent)) {
    // nearbyint rounds half to even in the default rounding mode; a result equal to
    // 2^mantissa_bits is exactly the smallest normal, whose code is the same number.
    return static_cast<uint32_t>(std::nearbyint(magnitude / subnormal_unit));
  }
  int exponent;
  const double fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent
  exponent -= 1;                                             // now magnitude = f * 2^exponent, f in [1,2)
  const double scaled = (fraction * 2.0 - 1.0) * std::ldexp(1.0, mantissa_bits);
  uint32_t mantissa = static_cast<uint32_t>(std::nearbyint(scaled));
  if (mantissa == (1u << mantissa_bits)) {
    mantissa = 0;
    exponent += 1;
  }
  return (static_cast<uint32_t>(exponent + bias) << mantissa_bits) | mantissa;
}

double decode_magnitude(uint32_t code, int mantissa_bits, int bias) {
  const uint32_t exponent_field = code >> mantissa_bits;
  const uint32_t mantissa = code & ((1u << mantissa_bits) - 1);
  if (exponent_field == 0) return std::ldexp(static_cast<double>(mantissa), 1 - bias - mantissa_bits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(mantissa), -mantissa_bits),
                    static_cast<int>(exponent_field) - bias);
}

}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }
bool dtype_is_float(DType dtype) { return info(dtype).is_float; }
std::string_view dtype_safetensors_name(DType dtype) { return info(dtype).safetensors_name; }

DType dtype_from_safetensors_name(std::string_view name) {
  for (const auto& entry : kDTypes)
    if (entry.safetensors_name == name) return entry.dtype;
  throw_arg_error("dtype", "one of F32, F64, BF16, F16, F8_E4M3, I32, I64, U8",
                  std::string("\"") + std::string(name) + "\"");
}

uint16_t float_to_f16(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return sign | 0x7e00;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (std::isinf(value)) return sign | 0x7c00;
  const uint32_t code = encode_magnitude(magnitude, 10, 15);
  if (code >= 0x7c00) return sign | 0x7c00;  // rounded past 65504: infinity
  return static_cast<uint16_t>(sign | code);
}

float f16_to_float(uint16_t value) {
  const bool negative = value & 0x8000;
  const uint32_t code = value & 0x7fff;
  float magnitude;
  if ((code >> 10) == 0x1f)
    magnitude = (code & 0x3ff) ? std::numeric_limits<float>::quiet_NaN()
                               : std::numeric_limits<float>::infinity();
  else
    magnitude = static_cast<float>(decode_magnitude(code, 10, 15));
  return negative ? -magnitude : magnitude;
}

uint8_t float_to_e4m3(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  if (std::isnan(value)) return sign | 0x7f;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude >= 448.0) return sign | 0x7e;  // saturate (448 = 0x7e; 0x7f is NaN)
  const uint32_t code = encode_magnitude(magnitude, 3, 7);
  return static_cast<uint8_t>(sign | (code > 0x7e ? 0x7e : code));
}

float e4m3_to_float(uint8_t value) {
  const bool negative = value & 0x80;
  const uint32_t code = value & 0x7f;
  const float magnitude = code == 0x7f ? std::numeric_limits<float>::quiet_NaN()
                                       : static_cast<float>(decode_magnitude(code, 3, 7));
  return negative ? -magnitude : magnitude;
}

double load_as_double(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::f64: return static_cast<const double*>(data)[index];
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::e4m3: return e4m3_to_float(static_cast<const uint8_t*>(data)[index]);
    case DType::i32: return static_cast<const int32_t*>(data)[index];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(data)[index]);
    case DType::u8: return static_cast<const uint8_t*>(data)[index];
  }
  MSA_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

void store_from_double(void* data, DType dtype, int64_t index, double value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = static_cast<float>(value); return;
    case DType::f64: static_cast<double*>(data)[index] = value; return;
    case DType::bf16:
      static_cast<uint16_t*>(data)[index] = float_to_bf16(static_cast<float>(value));
      return;
    case DType::f16:
      static_cast<uint16_t*>(data)[index] = float_to_f16(static_cast<float>(value));
      return;
    case DType::e4m3:
      static_cast<uint8_t*>(data)[index] = float_to_e4m3(static_cast<float>(value));
      return;
    case DType::i32: static_cast<int32_t*>(data)[index] = static_cast<int32_t>(value); return;
    case DType::i64: static_cast<int64_t*>(data)[index] = static_cast<int64_t>(value); return;
    case DType::u8: static_cast<uint8_t*>(data)[index] = static_cast<uint8_t>(value); return;
  }
  MSA_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

}  // namespace msa
