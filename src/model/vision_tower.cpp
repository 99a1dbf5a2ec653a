// The ViT of MiniMax-M3 on the CPU: patch embedding, pre_layrnorm and the pre-norm CLIP
// blocks with 3D RoPE and bidirectional attention within each segment; no post-norm (the
// checkpoint has none: the projector reads the last block's raw output).
//
// Segments are independent everywhere (attention never crosses one, every other step is per
// row), so the tower runs over batches of whole segments of at most kBatchRows patches: a long
// video's activations (x, q, k, v, the MLP's hidden rows) stay bounded by one batch.
#include <algorithm>
#include <cmath>
#include <vector>

#include "model/tensor_math.h"
#include "model/vision_internal.h"
#include "msa/model_vision.h"

namespace msa {
namespace {

// ~100 MB of activations per batch at M3's widths (Hv 1280, MLP 5120); a 672 x 672 image is
// 2304 patches, a 4-frame segment of a 768-token-per-frame video 12288.
constexpr int64_t kBatchRows = 16384;

Tensor wrap(std::vector<float>& data, int64_t rows, int64_t cols) {
  return Tensor::wrap(data.data(), {rows, cols}, DType::f32, nullptr);
}

}  // namespace

namespace model {

std::vector<std::pair<size_t, size_t>> vision_batches(std::span<const VisionSegment> segments) {
  std::vector<std::pair<size_t, size_t>> batches;
  size_t begin = 0;
  int64_t rows = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    const int64_t n = segments[s].grid.patches();
    if (s > begin && rows + n > kBatchRows) {
      batches.emplace_back(begin, s);
      begin = s;
      rows = 0;
    }
    rows += n;
  }
  if (begin < segments.size()) batches.emplace_back(begin, segments.size());
  return batches;
}

Tensor checked_pixel_values(const Tensor& pixel_values, const VisionConfig& config,
                            int64_t patches) {
  if (!pixel_values.defined() || pixel_values.dim() != 2 || pixel_values.size(0) != patches ||
      pixel_values.size(1) != config.patch_values())
    throw_arg_error("pixel_values",
                    "a [" + std::to_string(patches) + ", " + std::to_string(config.patch_values()) +
                        "] tensor (the grids' patches x C*T*P*P)",
                    pixel_values.defined() ? shape_string(pixel_values.shape()) : "none");
  if (pixel_values.device() != Device::cpu)
    throw_arg_error("pixel_values", "a CPU tensor", device_name(pixel_values.device()));
  const DType dtype = pixel_values.dtype();
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16 && dtype != DType::f64)
    throw_arg_error("pixel_values", "a float tensor (f32, bf16, f16 or f64)", dtype_name(dtype));
  return dtype == DType::f32 && pixel_values.is_contiguous() ? pixel_values
                                                                : pixel_values.to(DType::f32);
}

void vit_batch(const VisionWeights& w, const VisionConfig& c, const float* pixels,
               std::span<const VisionSegment> segments, Impl impl, const ForwardTap& tap,
               float* out) {
  const int64_t Hv = c.hidden_size, heads = c.num_heads, D = c.head_dim(), I = c.intermediate_size;
  int64_t N = 0;
  std::vector<int32_t> cu{0};
  std::vector<PatchPosition> positions;
  for (const VisionSegment& segment : segments) {
    const std::vector<PatchPosition> p = vision_patch_positions(segment.grid, c.spatial_merge_size);
    positions.insert(positions.end(), p.begin(), p.end());
    N += segment.grid.patches();
    cu.push_back(static_cast<int32_t>(N));
  }
  const std::vector<float> inv_freq = vision_rope_inverse_frequencies(c);
  const std::vector<float> angles = vision_rope_angles(positions, inv_freq);
  const int64_t half = 3 * static_cast<int64_t>(inv_freq.size());
  const Tensor cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  MsaParams attention;
  attention.causal = false;
  attention.scale = 1.0 / std::sqrt(static_cast<double>(D));

  // The batch's rows are consecutive in pixel_values (segments are in row order).
  std::vector<float> x(N * Hv), xn(N * Hv), q(N * Hv), k(N * Hv), v(N * Hv), hidden(N * I);
  model::linear(pixels + segments.front().first_row * c.patch_values(), N, w.patch_embedding,
                x.data());
  if (tap) tap("vision.patch_embed", wrap(x, N, Hv));
  model::layer_norm(x.data(), x.data(), N, Hv, w.pre_norm.weight, w.pre_norm.bias, c.layer_norm_eps);
  if (tap) tap("vision.pre_norm", wrap(x, N, Hv));
  for (size_t layer = 0; layer < w.layers.size(); ++layer) {
    const VisionLayerWeights& l = w.layers[layer];
    model::layer_norm(x.data(), xn.data(), N, Hv, l.norm1.weight, l.norm1.bias, c.layer_norm_eps);
    model::linear_bias(xn.data(), N, l.q_proj.weight, l.q_proj.bias, q.data());
    model::linear_bias(xn.data(), N, l.k_proj.weight, l.k_proj.bias, k.data());
    model::linear_bias(xn.data(), N, l.v_proj.weight, l.v_proj.bias, v.data());
    model::apply_rope_angles(q.data(), N, heads, D, angles.data(), half);
    model::apply_rope_angles(k.data(), N, heads, D, angles.data(), half);
    const auto heads_view = [&](std::vector<float>& data) {
      return Tensor::wrap(data.data(), {N, heads, D}, DType::f32, nullptr);
    };
    const Tensor o = dense_attention(heads_view(q), heads_view(k), heads_view(v), cu_seqlens,
                                     cu_seqlens, attention, impl)
                         .o;
    model::linear_bias(o.data<float>(), N, l.out_proj.weight, l.out_proj.bias, xn.data());
    for (int64_t i = 0; i < N * Hv; ++i) x[i] += xn[i];
    model::layer_norm(x.data(), xn.data(), N, Hv, l.norm2.weight, l.norm2.bias, c.layer_norm_eps);
    model::linear_bias(xn.data(), N, l.fc1.weight, l.fc1.bias, hidden.data());
    model::gelu_erf(hidden.data(), N * I);
    model::linear_bias(hidden.data(), N, l.fc2.weight, l.fc2.bias, xn.data());
    for (int64_t i = 0; i < N * Hv; ++i) x[i] += xn[i];
    if (tap) tap("vision.layers." + std::to_string(layer), wrap(x, N, Hv));
  }
  std::copy(x.begin(), x.end(), out);
}

}  // namespace model

Tensor vision_tower_forward(const VisionWeights& weights, const VisionConfig& config,
                            const Tensor& pixel_values, std::span<const VisionGrid> grids,
                            Impl attention, const ForwardTap& tap) {
  if (grids.empty()) throw_arg_error("grids", "at least one image or video grid", 0);
  const std::vector<VisionSegment> segments = vision_segments(grids, config);
  int64_t patches = 0;
  for (const VisionGrid& grid : grids) patches += grid.patches();
  const Tensor pixels = model::checked_pixel_values(pixel_values, config, patches);
  Tensor out = Tensor::zeros({patches, config.hidden_size}, DType::f32);
  for (const auto& [begin, end] : model::vision_batches(segments)) {
    const std::span<const VisionSegment> batch(segments.data() + begin, end - begin);
    model::vit_batch(weights, config, pixels.data<float>(), batch, attention, tap,
                     out.data<float>() + batch.front().first_row * config.hidden_size);
  }
  return out;
}

}  // namespace msa
