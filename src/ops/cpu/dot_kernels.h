// Dot-product kernels shared by the CPU backward passes (attention_backward_cpu.cpp,
// kl_cpu.cpp), f32. Private to src/ops/cpu.
//
// Internal linkage (an unnamed namespace, not `inline`) on purpose: with -ffp-contract=fast
// what gets fused into an FMA depends on where these are inlined, and the `inline` keyword
// changes GCC's inlining decisions. As static functions of each including file they are
// compiled exactly as the per-file copies they replace, so results stay bitwise identical.
#pragma once
#include <cstdint>

namespace msa::detail::cpu {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += a x
void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[j] = shared . x[j] for four vectors: four independent FMA chains, `shared` loaded once.
void dot4(const float* shared, const float* const x[4], int64_t n, float* out, int64_t out_stride) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += shared[i] * x0[i];
    s1 += shared[i] * x1[i];
    s2 += shared[i] * x2[i];
    s3 += shared[i] * x3[i];
  }
  out[0] = s0;
  out[out_stride] = s1;
  out[2 * out_stride] = s2;
  out[3 * out_stride] = s3;
}

// scores[r * ld + t] = rows[r] . keys[t] for `m` contiguous rows of length d and `n` keys
// `key_stride` apart. Four dot products share one operand (the key when m >= 4, else the row).
void score_block(const float* rows, int64_t m, int64_t d, const float* keys, int64_t key_stride,
                 int64_t n, float* scores, int64_t ld) {
  if (m >= 4) {
    for (int64_t t = 0; t < n; ++t) {
      const float* key = keys + t * key_stride;
      int64_t r = 0;
      for (; r + 4 <= m; r += 4) {
        const float* x[4] = {rows + r * d, rows + (r + 1) * d, rows + (r + 2) * d,
                             rows + (r + 3) * d};
        dot4(key, x, d, scores + r * ld + t, ld);
      }
      for (; r < m; ++r) scores[r * ld + t] = dot(rows + r * d, key, d);
    }
    return;
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* row = rows + r * d;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      const float* x[4] = {keys + t * key_stride, keys + (t + 1) * key_stride,
                           keys + (t + 2) * key_stride, keys + (t + 3) * key_stride};
      dot4(row, x, d, scores + r * ld + t, 1);
    }
    for (; t < n; ++t) scores[r * ld + t] = dot(row, keys + t * key_stride, d);
  }
}

// y += sum_j a[j * a_stride] x[j] over `count` vectors x[j] = x0 + j * x_stride, four at a
// time so y is loaded and stored once per four updates.
[[maybe_unused]] void accumulate(const float* a, int64_t a_stride, const float* x0,
                                 int64_t x_stride, int64_t count, float* y, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float a0 = a[j * a_stride], a1 = a[(j + 1) * a_stride], a2 = a[(j + 2) * a_stride],
                a3 = a[(j + 3) * a_stride];
    const float *x_0 = x0 + j * x_stride, *x_1 = x_0 + x_stride, *x_2 = x_1 + x_stride,
                *x_3 = x_2 + x_stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += a0 * x_0[i] + a1 * x_1[i] + a2 * x_2[i] + a3 * x_3[i];
  }
  for (; j < count; ++j) {
    const float aj = a[j * a_stride];
    const float* xj = x0 + j * x_stride;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += aj * xj[i];
  }
}

}  // namespace
}  // namespace msa::detail::cpu
