// The vision input's geometry: grids checked and cut into attention segments, each patch's
// (t, h, w) position in pixel_values order, and the 3D RoPE angles of those positions.
#include <algorithm>
#include <climits>
#include <string>

#include "model/config_fields.h"
#include "msa/model_vision.h"

namespace msa {

std::vector<VisionSegment> vision_segments(std::span<const VisionGrid> grids,
                                           const VisionConfig& config) {
  const int64_t merge = config.spatial_merge_size, max_frames = config.segment_max_frames;
  std::vector<VisionSegment> segments;
  int64_t row = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const VisionGrid& g = grids[i];
    const std::string name = "grids[" + std::to_string(i) + "]";
    // Bounded first, so that t * h * w cannot overflow.
    if (g.t < 1 || g.t > model::kMaxDim) throw_arg_error(name + ".t", model::range_text(1, model::kMaxDim), g.t);
    for (const auto& [axis, value] : {std::pair{".h", g.h}, std::pair{".w", g.w}})
      if (value < 1 || value > model::kMaxDim || value % merge != 0)
        throw_arg_error(name + axis,
                        "a multiple of spatial_merge_size (" + std::to_string(merge) + ") in [1, " +
                            std::to_string(model::kMaxDim) + "]",
                        value);
    if (g.patches() > INT32_MAX - row)
      throw_arg_error(name, "at most " + std::to_string(INT32_MAX) + " patches in all grids",
                      std::to_string(row) + " + " + std::to_string(g.patches()));
    // A segment attends to itself whole: beyond this its attention (quadratic) and the
    // activations of one batch (about 30 KB per patch at M3's widths) are no longer sane.
    if (std::min(g.t, max_frames) * g.h * g.w > kMaxSegmentPatches)
      throw_arg_error(name, "segments of at most " + std::to_string(kMaxSegmentPatches) +
                                " patches (M3's processors make at most 2304 per image and 12288 "
                                "per 4-frame video segment)",
                      std::to_string(std::min(g.t, max_frames) * g.h * g.w) + " patches in a segment");
    for (int64_t t0 = 0; t0 < g.t; t0 += max_frames)
      segments.push_back({.first_row = row + t0 * g.h * g.w,
                          .grid = {.t = std::min(max_frames, g.t - t0), .h = g.h, .w = g.w},
                          .source = static_cast<int64_t>(i)});
    row += g.patches();
  }
  return segments;
}

std::vector<PatchPosition> vision_patch_positions(const VisionGrid& grid, int64_t merge) {
  std::vector<PatchPosition> positions;
  positions.reserve(static_cast<size_t>(grid.patches()));
  for (int64_t t = 0; t < grid.t; ++t)
    for (int64_t hb = 0; hb < grid.h / merge; ++hb)
      for (int64_t wb = 0; wb < grid.w / merge; ++wb)
        for (int64_t mh = 0; mh < merge; ++mh)
          for (int64_t mw = 0; mw < merge; ++mw)
            positions.push_back({.t = t, .h = merge * hb + mh, .w = merge * wb + mw});
  return positions;
}

std::vector<float> vision_rope_inverse_frequencies(const VisionConfig& config) {
  // As transformers computes it in f32: 1 / theta^(arange(0, 2F, 2) / 2F).
  const int64_t frequencies = config.rope_frequencies_per_axis(), axis_dim = 2 * frequencies;
  std::vector<float> inv(static_cast<size_t>(frequencies));
  const float base = static_cast<float>(config.rope_theta);
  for (int64_t k = 0; k < frequencies; ++k)
    inv[k] = 1.0f / std::pow(base, static_cast<float>(2 * k) / static_cast<float>(axis_dim));
  return inv;
}

std::vector<float> vision_rope_angles(std::span<const PatchPosition> positions,
                                      std::span<const float> inv_freq) {
  const size_t F = inv_freq.size();
  std::vector<float> angles(positions.size() * 3 * F);
  for (size_t p = 0; p < positions.size(); ++p) {
    float* row = angles.data() + p * 3 * F;
    const float axes[3] = {static_cast<float>(positions[p].t), static_cast<float>(positions[p].h),
                           static_cast<float>(positions[p].w)};
    for (size_t axis = 0; axis < 3; ++axis)
      for (size_t k = 0; k < F; ++k) row[axis * F + k] = axes[axis] * inv_freq[k];
  }
  return angles;
}

}  // namespace msa
