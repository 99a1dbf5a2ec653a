// MiniMax-M3's vision tower and projector on the CPU (docs/vision.md "Vision tower"): image
// and video patches -> ViT -> projector -> one row per 2x2 window of patches, the embeddings
// of the prompt's image / video placeholder tokens.
//
//   msa::Model model = msa::Model::load(dir);            // a config.json with vision_config
//   msa::VisionGrid grid{.t = 1, .h = 32, .w = 48};       // an image of 448 x 672 pixels
//   std::vector<msa::Tensor> rows = model.encode_vision(pixel_values, {&grid, 1});
//   // rows[0]: f32 [32 * 48 / 4, hidden] for the image's 384 placeholder tokens
//
// pixel_values come from the media front end: f32 [t*h*w, C*T*P*P] (1176 on M3), patches
// ordered t first, then the merge windows in raster order, then (mh, mw) inside a window
// (patch row = m*hb + mh, column = m*wb + mw); a patch's values ordered [C][T][P][P].
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/model_weights.h"
#include "msa/ops.h"

namespace msa {

// Named intermediates of a step (the same type as in msa/model.h).
using ForwardTap = std::function<void(const std::string& name, const Tensor& value)>;

// Embedding rows that replace those of consecutive tokens: the visual rows of an image or a
// video (Model::encode_vision) at its placeholder tokens. `rows` f32 [n, hidden] (contiguous,
// e.g. a slice0 of an image's rows) replace the embeddings of tokens [first_token,
// first_token + n); in a ForwardRequest first_token indexes its `tokens`, in a
// GenerationRequest (msa/model_engine.h) its `prompt`. Each replaced token must be the
// config's image or video placeholder id; the text model's RoPE positions stay the tokens'
// own (1-D sequential, as in M3).
struct VisualRows {
  int64_t first_token = 0;
  Tensor rows;
};

// The parts of prompt-indexed visual rows that fall into prompt tokens [begin, end), with
// first_token made relative to `begin` (rows are views of the given ones): what a prefill
// chunk of those tokens passes as ForwardRequest::visual.
std::vector<VisualRows> visual_rows_in_range(std::span<const VisualRows> prompt_rows,
                                             int64_t begin, int64_t end);

// One image or video in patches: t temporal patches (1 for an image, frames / 2 for a video)
// of h x w spatial patches (multiples of spatial_merge_size).
struct VisionGrid {
  int64_t t = 1;
  int64_t h = 0;
  int64_t w = 0;
  int64_t patches() const { return t * h * w; }
};

// One attention segment of the ViT: the patches of `grid` starting at row `first_row` of
// pixel_values; they attend to each other only, and their RoPE time axis starts at 0.
struct VisionSegment {
  int64_t first_row = 0;
  VisionGrid grid;
  int64_t source = 0;  // index of the VisionGrid it belongs to
};

// The ViT's segments: each grid in order; an image (or a video of at most
// segment_max_frames temporal patches) is one segment, a longer video is cut into
// consecutive chunks of segment_max_frames temporal patches (the last one shorter). Checks
// every grid (t, h, w >= 1, h and w multiples of spatial_merge_size, segments of at most
// kMaxSegmentPatches, at most 2^31 - 1 patches in all), naming `grids[i]`.
inline constexpr int64_t kMaxSegmentPatches = int64_t{1} << 16;
std::vector<VisionSegment> vision_segments(std::span<const VisionGrid> grids,
                                           const VisionConfig& config);

// The (t, h, w) position of every patch of one segment, in pixel_values order (t-major, then
// merge windows in raster order, then (mh, mw)): h and w are the patch's real row and
// column in the grid, t its temporal patch within the segment.
struct PatchPosition {
  int64_t t = 0, h = 0, w = 0;
};
std::vector<PatchPosition> vision_patch_positions(const VisionGrid& grid, int64_t merge);

// The 3D RoPE inverse frequencies: F = rope_frequencies_per_axis() values
// inv_k = theta^(-2k / 2F) in f32 (13 for head dim 80: theta^(-2k/26)).
std::vector<float> vision_rope_inverse_frequencies(const VisionConfig& config);
// Per patch the 3F angles [t * inv (F), h * inv (F), w * inv (F)] in f32: f32 [patches, 3F].
// Channel i < 3F of a head pairs with channel i + 3F and turns by angle i (NeoX rotate_half
// over the first 6F channels); channels 6F.. pass through (78 and 79 on M3).
std::vector<float> vision_rope_angles(std::span<const PatchPosition> positions,
                                      std::span<const float> inv_freq);

// The ViT: pixel_values [N, C*T*P*P] -> the last layer's hidden state f32 [N, Hv] (no
// post-norm). Patch embedding (one GEMM with the f32 Conv3d kernel), pre_layrnorm, then
// per layer x += out_proj(attention(RoPE(q), RoPE(k), v)) over LN1(x) (bidirectional within
// each segment, scale head_dim^-0.5; `attention` picks the dense_attention implementation)
// and x += fc2(gelu(fc1(LN2(x)))).
Tensor vision_tower_forward(const VisionWeights& weights, const VisionConfig& config,
                            const Tensor& pixel_values, std::span<const VisionGrid> grids,
                            Impl attention = Impl::cpu, const ForwardTap& tap = nullptr);

// The projector: features [N, Hv] (N a multiple of m^2, each merge window's m^2 patches in
// consecutive rows) -> f32 [N / m^2, hidden]: per patch linear_2(gelu(linear_1(x))), then
// the m^2 rows of a window side by side ([N / m^2, m^2 * hidden]) through
// merge_linear_2(gelu(merge_linear_1(.))).
Tensor vision_projector_forward(const VisionWeights& weights, const VisionConfig& config,
                                const Tensor& features, const ForwardTap& tap = nullptr);

// Visual rows at a prompt's placeholder tokens, in the order transformers scatters them:
// the image placeholders (image_token_id) in prompt order take the rows of `images` in
// order, the video placeholders (video_token_id) those of `videos`. One VisualRows per run
// of consecutive placeholder positions within one tensor (rows are views). Throws msa::Error
// when the counts differ ("the prompt has N image placeholder tokens, the images give M
// rows") or a tensor is not f32 [n, hidden].
std::vector<VisualRows> place_visual_rows(std::span<const int32_t> prompt,
                                          const VisionConfig& config, int64_t hidden,
                                          std::span<const Tensor> images,
                                          std::span<const Tensor> videos);

}  // namespace msa
