// The dense math of the model on the CPU: linear layers over f32/bf16/f16 weights, Gemma
// RMSNorm and LayerNorm, NeoX RoPE (1-D positions or given angles), the clamped SwiGLU-OAI
// and the exact GELU activations. All activations
// are f32 and contiguous, row-major.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "msa/tensor.h"

namespace msa::model {

// y[rows, out] = x[rows, in] * w[out, in]^T, f32 accumulation; w is f32, bf16 or f16.
void linear(const float* x, int64_t rows, const Tensor& w, float* y);

// Gemma RMSNorm in place over `rows` vectors of `dim`: x * rsqrt(mean(x^2) + eps) * (1 + w).
void gemma_rms_norm(float* x, int64_t rows, int64_t dim, const Tensor& weight_f32, double eps);
// The same, reading x and writing y.
void gemma_rms_norm(const float* x, float* y, int64_t rows, int64_t dim, const Tensor& weight_f32,
                    double eps);

// Inverse frequencies of the default RoPE over `rotary_dim` channels, computed in f32 exactly
// as transformers does: 1 / theta^(arange(0, rot, 2) / rot).
std::vector<float> rope_inverse_frequencies(int64_t rotary_dim, double theta);
// NeoX (rotate_half) RoPE in place on channels [0, rotary_dim) of x [tokens, heads, dim]:
// channel i pairs with i + rotary_dim/2; angle = position * inv_freq[i] (f32).
void apply_rope(float* x, int64_t tokens, int64_t heads, int64_t dim,
                std::span<const int64_t> positions, std::span<const float> inv_freq);

// NeoX (rotate_half) RoPE in place on channels [0, 2 * half) of x [tokens, heads, dim] with
// per-token angles [tokens, half] (f32): channel i pairs with i + half and turns by
// angles[t][i]. (The vision tower's 3D RoPE: angles from (t, h, w), not one position.)
void apply_rope_angles(float* x, int64_t tokens, int64_t heads, int64_t dim, const float* angles,
                       int64_t half);

// y = x * w^T + bias over `rows` rows (model::linear, then the f32 bias [out] added).
void linear_bias(const float* x, int64_t rows, const Tensor& w, const Tensor& bias_f32, float* y);

// LayerNorm over `rows` vectors of `dim`: (x - mean) / sqrt(var + eps) * w + b (biased
// variance; statistics accumulated in f64, the rest f32), reading x and writing y.
void layer_norm(const float* x, float* y, int64_t rows, int64_t dim, const Tensor& weight_f32,
                const Tensor& bias_f32, double eps);

// Exact GELU in place: x * (1 + erf(x / sqrt(2))) / 2 (transformers' "gelu").
void gelu_erf(float* x, int64_t count);

// act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit);
// written over `gate`.
void swiglu_oai(float* gate, const float* up, int64_t count, float alpha, float limit);

}  // namespace msa::model
