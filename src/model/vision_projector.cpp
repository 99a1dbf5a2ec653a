// The multimodal projector: project every patch to the text width, then merge each window of
// m x m patches (m^2 consecutive rows, by the patch order) into one text token.
#include <vector>

#include "model/tensor_math.h"
#include "model/vision_internal.h"
#include "msa/model_vision.h"

namespace msa {

namespace model {

void project_rows(const VisionWeights& w, const VisionConfig& c, const float* features,
                  int64_t rows, float* out, const ForwardTap& tap) {
  const int64_t Hp = c.projector_hidden_size, H = w.linear_2.weight.size(0), m2 = c.merge_window();
  const int64_t windows = rows / m2;
  // Per patch: linear_2(gelu(linear_1(x))) -> [rows, H]; viewed as [windows, m2 * H], the
  // m2 patches of a window side by side (the order transformers' reshape gives).
  std::vector<float> inner(rows * Hp), patches(rows * H);
  linear_bias(features, rows, w.linear_1.weight, w.linear_1.bias, inner.data());
  gelu_erf(inner.data(), rows * Hp);
  linear_bias(inner.data(), rows, w.linear_2.weight, w.linear_2.bias, patches.data());
  if (tap) tap("projector.patches", Tensor::wrap(patches.data(), {rows, H}, DType::f32, nullptr));
  linear_bias(patches.data(), windows, w.merge_linear_1.weight, w.merge_linear_1.bias, inner.data());
  gelu_erf(inner.data(), windows * Hp);
  linear_bias(inner.data(), windows, w.merge_linear_2.weight, w.merge_linear_2.bias, out);
  if (tap) tap("projector", Tensor::wrap(out, {windows, H}, DType::f32, nullptr));
}

}  // namespace model

Tensor vision_projector_forward(const VisionWeights& weights, const VisionConfig& config,
                                const Tensor& features, const ForwardTap& tap) {
  const int64_t m2 = config.merge_window(), Hv = config.hidden_size;
  if (!features.defined() || features.dim() != 2 || features.size(1) != Hv ||
      features.size(0) % m2 != 0 || features.size(0) == 0)
    throw_arg_error("features",
                    "[N, " + std::to_string(Hv) + "] with N a positive multiple of " +
                        std::to_string(m2) + " (whole merge windows)",
                    features.defined() ? shape_string(features.shape()) : "none");
  if (features.device() != Device::cpu)
    throw_arg_error("features", "a CPU tensor", device_name(features.device()));
  const Tensor f32 = features.dtype() == DType::f32 && features.is_contiguous()
                         ? features
                         : features.to(DType::f32);
  const int64_t rows = features.size(0), H = weights.linear_2.weight.size(0);
  Tensor out = Tensor::zeros({rows / m2, H}, DType::f32);
  model::project_rows(weights, config, f32.data<float>(), rows, out.data<float>(), tap);
  return out;
}

}  // namespace msa
