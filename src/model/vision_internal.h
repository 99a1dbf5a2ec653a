// The vision path's pieces shared by its files (vision_tower.cpp, vision_projector.cpp,
// model.cpp's Model::encode_vision): not part of the public API.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "msa/model_vision.h"

namespace msa::model {

// Consecutive runs [begin, end) of segments of at most a bounded number of patches each
// (a single segment above the bound is its own run): the ViT's batches.
std::vector<std::pair<size_t, size_t>> vision_batches(std::span<const VisionSegment> segments);

// pixel_values checked against the config ([patches, C*T*P*P], a float CPU tensor) and
// returned as a contiguous f32 tensor (the input itself when it already is one).
Tensor checked_pixel_values(const Tensor& pixel_values, const VisionConfig& config, int64_t patches);

// The ViT over one batch of segments (consecutive rows of `pixels`, f32 [.., C*T*P*P]):
// writes the batch's last hidden state to `out` (f32 [batch patches, Hv]).
void vit_batch(const VisionWeights& weights, const VisionConfig& config, const float* pixels,
               std::span<const VisionSegment> segments, Impl impl, const ForwardTap& tap,
               float* out);

// The projector over `rows` ViT output rows (a multiple of m^2) into out f32 [rows / m^2, H].
void project_rows(const VisionWeights& weights, const VisionConfig& config, const float* features,
                  int64_t rows, float* out, const ForwardTap& tap);

}  // namespace msa::model
