// Small SIMD vocabulary for the CPU kernels: 8-lane f32 vectors (GCC/Clang vector
// extensions; AVX2/AVX-512 with -march=native, plain SSE or scalar code elsewhere).
#pragma once
#include <cstdint>
#include <cstring>

namespace msa::detail::cpu {

constexpr int kLanes = 8;
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 splat(float value) { return f32x8{} + value; }
inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
inline f32x8 max8(f32x8 a, f32x8 b) { return a > b ? a : b; }

// e^x for each lane, relative error ~2 ulp; e^x = 0 below -87.3 (so e^-inf = 0) and
// +inf above 88.3. Cephes' expf: x = n ln2 + r with |r| <= ln2/2, polynomial in r.
inline f32x8 exp8(f32x8 x) {
  const f32x8 hi = splat(88.3f), lo = splat(-87.3365f);
  const f32x8 clamped = x > hi ? hi : (x < lo ? lo : x);
  const f32x8 t = clamped * 1.44269504f + 0.5f;
  const f32x8 truncated = __builtin_convertvector(__builtin_convertvector(t, i32x8), f32x8);
  const f32x8 n = truncated > t ? truncated - 1.0f : truncated;  // floor(x log2e + 1/2)
  // ln2 split in two so that n * 0.693359375 is exact.
  const f32x8 r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  f32x8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x8 exponent = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 two_to_n;
  std::memcpy(&two_to_n, &exponent, sizeof two_to_n);
  const f32x8 result = p * two_to_n;
  return x < lo ? splat(0.0f) : (x > hi ? splat(__builtin_inff()) : result);
}

inline float reduce_max8(f32x8 v) {
  float out = v[0];
  for (int i = 1; i < kLanes; ++i) out = v[i] > out ? v[i] : out;
  return out;
}
inline float reduce_sum8(f32x8 v) {
  float out = 0;
  for (int i = 0; i < kLanes; ++i) out += v[i];
  return out;
}

typedef float f32x4 __attribute__((vector_size(16)));
inline f32x4 max4(f32x4 a, f32x4 b) { return a > b ? a : b; }
// The lane sums of four vectors as one: {sum(a), sum(b), sum(c), sum(d)}, in shuffles and
// adds (halves, then pairs) rather than four scalar chains of 8.
inline f32x4 reduce_sum8x4(f32x8 a, f32x8 b, f32x8 c, f32x8 d) {
  const auto halves = [](f32x8 v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  };
  const f32x4 ha = halves(a), hb = halves(b), hc = halves(c), hd = halves(d);
  // {a0 + a2, b0 + b2, a1 + a3, b1 + b3} and the same of c, d.
  const f32x4 ab = __builtin_shufflevector(ha, hb, 0, 4, 1, 5) + __builtin_shufflevector(ha, hb, 2, 6, 3, 7);
  const f32x4 cd = __builtin_shufflevector(hc, hd, 0, 4, 1, 5) + __builtin_shufflevector(hc, hd, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

}  // namespace msa::detail::cpu
