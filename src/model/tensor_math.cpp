// Linear layers (BLAS when available), norms, RoPE and the SwiGLU-OAI activation.
#include "tensor_math.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef MSA_MODEL_HAVE_CBLAS
#include <cblas.h>
#endif

namespace msa::model {
namespace {

// Below this many multiply-adds (or elements) a loop runs on one thread: waking the team
// costs more than it saves, and on a busy machine a descheduled thread stalls the barrier.
constexpr int64_t kParallelWork = int64_t{1} << 18;

// Converts rows [begin, end) of a bf16/f16 matrix to f32.
void rows_to_f32(const Tensor& w, int64_t begin, int64_t end, float* out) {
  const int64_t in = w.size(1);
  const int64_t count = (end - begin) * in;
  if (w.dtype() == DType::bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(w.raw()) + begin * in;
#pragma omp parallel for schedule(static) if (count > kParallelWork)
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(src[i]);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(w.raw()) + begin * in;
#pragma omp parallel for schedule(static) if (count > kParallelWork)
    for (int64_t i = 0; i < count; ++i) out[i] = f16_to_float(src[i]);
  }
}

// y[:, col_begin:col_begin+cols] (row stride ldy) = x * w_f32[cols, in]^T.
// With BLAS: tiles of kGemmTileRows x kGemmTileCols outputs, each one single-threaded sgemm call
// (OpenBLAS's OpenMP build runs single-threaded inside an active parallel region, and below
// its own threshold of 65536 x 4 multiply-adds, which the serial branch's tiles stay under).
// Why not one call over all threads: OpenBLAS then splits the output among its threads, and
// with its AVX-512 kernels (measured on an AMD EPYC with AVX-512) an element's sum depends on
// which micro-kernel (a full tile or an edge one) computes it, i.e. on the thread count. Fixed
// tiles make every result independent of the thread count; each tile is ~1.6 GFLOP against
// ~19 MB of packed operands at a 6144-wide input, still compute-bound.
constexpr int64_t kGemmTileRows = 256, kGemmTileCols = 512;
void gemm_nt(const float* x, int64_t rows, int64_t in, const float* w, int64_t cols, float* y,
             int64_t ldy) {
#ifdef MSA_MODEL_HAVE_CBLAS
  const int64_t row_tiles = (rows + kGemmTileRows - 1) / kGemmTileRows;
  const int64_t col_tiles = (cols + kGemmTileCols - 1) / kGemmTileCols;
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols * in >= kParallelWork / 4)
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      const int64_t r0 = rt * kGemmTileRows, c0 = ct * kGemmTileCols;
      const int64_t m = std::min(kGemmTileRows, rows - r0), n = std::min(kGemmTileCols, cols - c0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(in), 1.0f, x + r0 * in, static_cast<int>(in), w + c0 * in,
                  static_cast<int>(in), 0.0f, y + r0 * ldy + c0, static_cast<int>(ldy));
    }
#else
#pragma omp parallel for collapse(2) schedule(static) if (rows * cols * in > kParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float* a = x + r * in;
      const float* b = w + c * in;
      float sum = 0;
      for (int64_t i = 0; i < in; ++i) sum += a[i] * b[i];
      y[r * ldy + c] = sum;
    }
#endif
}

// Few rows (decode): read the 16-bit weights once, converting on the fly.
template <class Convert>
void gemv_16bit(const float* x, int64_t rows, const uint16_t* w, int64_t out, int64_t in, float* y,
                Convert convert) {
#pragma omp parallel for schedule(static) if (rows * out * in > kParallelWork)
  for (int64_t o = 0; o < out; ++o) {
    const uint16_t* row = w + o * in;
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = x + r * in;
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += a[i] * convert(row[i]);
      y[r * out + o] = sum;
    }
  }
}

}  // namespace

void linear(const float* x, int64_t rows, const Tensor& w, float* y) {
  const int64_t out = w.size(0), in = w.size(1);
  if (rows == 0) return;
  if (w.dtype() == DType::f32) {
    gemm_nt(x, rows, in, static_cast<const float*>(w.raw()), out, y, out);
    return;
  }
  if (w.dtype() != DType::bf16 && w.dtype() != DType::f16)
    throw_arg_error("weight", "dtype f32, bf16 or f16", dtype_name(w.dtype()));
  const uint16_t* data = static_cast<const uint16_t*>(w.raw());
  if (rows <= 4) {
    if (w.dtype() == DType::bf16)
      gemv_16bit(x, rows, data, out, in, y, [](uint16_t v) { return bf16_to_float(v); });
    else
      gemv_16bit(x, rows, data, out, in, y, [](uint16_t v) { return f16_to_float(v); });
    return;
  }
  // Many rows: convert ~4 MiB of weight rows at a time to f32 and run a GEMM on them, but
  // at least 256 of them: every chunk's GEMM reads all of x again, and a wide input (the
  // vision projector's merge, 24576) would otherwise leave chunks of 42 columns re-reading
  // x (56 MB for a 672 x 672 image) 146 times.
  const int64_t chunk =
      std::min(out, std::max<int64_t>((int64_t{1} << 20) / std::max<int64_t>(in, 1), 256));
  std::vector<float> buffer(static_cast<size_t>(chunk * in));
  for (int64_t begin = 0; begin < out; begin += chunk) {
    const int64_t end = std::min(out, begin + chunk);
    rows_to_f32(w, begin, end, buffer.data());
    gemm_nt(x, rows, in, buffer.data(), end - begin, y + begin, out);
  }
}

void gemma_rms_norm(const float* x, float* y, int64_t rows, int64_t dim, const Tensor& weight,
                    double eps) {
  const float* w = weight.data<float>();
#pragma omp parallel for schedule(static) if (rows * dim > kParallelWork / 8)
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float* out = y + r * dim;
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(in[i]) * in[i];
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
    for (int64_t i = 0; i < dim; ++i) out[i] = (in[i] * inv) * (1.0f + w[i]);
  }
}

void gemma_rms_norm(float* x, int64_t rows, int64_t dim, const Tensor& weight, double eps) {
  gemma_rms_norm(x, x, rows, dim, weight, eps);
}

std::vector<float> rope_inverse_frequencies(int64_t rotary_dim, double theta) {
  std::vector<float> inv(static_cast<size_t>(rotary_dim / 2));
  const float base = static_cast<float>(theta);
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
    inv[i] = 1.0f / std::pow(base, exponent);
  }
  return inv;
}

namespace {
// NeoX rotation of one token's heads: pair (i, i + half) of each head turned by angle i.
void rotate_heads(float* x, int64_t heads, int64_t dim, int64_t half, const float* cos_a, const float* sin_a) {
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos_a[i] - b * sin_a[i];
      v[i + half] = b * cos_a[i] + a * sin_a[i];
    }
  }
}
}  // namespace

void apply_rope(float* x, int64_t tokens, int64_t heads, int64_t dim,
                std::span<const int64_t> positions, std::span<const float> inv_freq) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  if (half == 0) return;
#pragma omp parallel for schedule(static) if (tokens * heads * dim > kParallelWork / 8)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> cos_a(half), sin_a(half);
    const float pos = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_a[i] = std::cos(angle);
      sin_a[i] = std::sin(angle);
    }
    rotate_heads(x + t * heads * dim, heads, dim, half, cos_a.data(), sin_a.data());
  }
}

void apply_rope_angles(float* x, int64_t tokens, int64_t heads, int64_t dim, const float* angles,
                       int64_t half) {
  if (half == 0) return;
#pragma omp parallel for schedule(static) if (tokens * heads * dim > kParallelWork / 8)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> cos_a(half), sin_a(half);
    for (int64_t i = 0; i < half; ++i) {
      cos_a[i] = std::cos(angles[t * half + i]);
      sin_a[i] = std::sin(angles[t * half + i]);
    }
    rotate_heads(x + t * heads * dim, heads, dim, half, cos_a.data(), sin_a.data());
  }
}

void linear_bias(const float* x, int64_t rows, const Tensor& w, const Tensor& bias, float* y) {
  linear(x, rows, w, y);
  const int64_t out = w.size(0);
  const float* b = bias.data<float>();
#pragma omp parallel for schedule(static) if (rows * out > kParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += b[o];
}

void layer_norm(const float* x, float* y, int64_t rows, int64_t dim, const Tensor& weight,
                const Tensor& bias, double eps) {
  const float* w = weight.data<float>();
  const float* b = bias.data<float>();
#pragma omp parallel for schedule(static) if (rows * dim > kParallelWork / 8)
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * dim;
    float* out = y + r * dim;
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += in[i];
    const double mean = sum / static_cast<double>(dim);
    double squares = 0;
    for (int64_t i = 0; i < dim; ++i) squares += (in[i] - mean) * (in[i] - mean);
    const float inv = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(dim) + eps));
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < dim; ++i) out[i] = (in[i] - m) * inv * w[i] + b[i];
  }
}

void gelu_erf(float* x, int64_t count) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
#pragma omp parallel for schedule(static) if (count > kParallelWork)
  for (int64_t i = 0; i < count; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

void swiglu_oai(float* gate, const float* up, int64_t count, float alpha, float limit) {
#pragma omp parallel for schedule(static) if (count > kParallelWork)
  for (int64_t i = 0; i < count; ++i) {
    const float g = std::min(gate[i], limit);
    const float u = std::clamp(up[i], -limit, limit);
    const float glu = g / (1.0f + std::exp(-alpha * g));  // g * sigmoid(alpha * g)
    gate[i] = (u + 1.0f) * glu;
  }
}

}  // namespace msa::model
