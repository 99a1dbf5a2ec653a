// The vision inputs of `msa vision-encode` and `msa logits --pixels`: a safetensors file of
// pixel values and grids (transformers' names), encoded by the model's vision path.
//
//   pixel_values         float [N, C*T*P*P]   the images' patches, image after image
//   image_grid_thw       int   [images, 3]    (t, h, w) of each image (alias: grid_thw)
//   pixel_values_videos  float [M, C*T*P*P]   the videos' patches
//   video_grid_thw       int   [videos, 3]    (t, h, w) of each video (t may exceed the segment
//                                             length: the ViT cuts it into segments)
// Either pair may be absent, not both. `msa preprocess`'s output (pixel_values + grid_thw,
// and for a video also timestamps) is read as one image or, with timestamps, one video.
#pragma once
#include <string>
#include <vector>

#include "msa/model.h"

namespace msa::cli {

struct PixelInputs {
  Tensor image_pixels;
  std::vector<VisionGrid> image_grids;
  Tensor video_pixels;
  std::vector<VisionGrid> video_grids;
};

// Reads and checks the file named by --`flag` (tensor names, ranks, dtypes; the values'
// agreement with a model is checked when encoding).
PixelInputs load_pixel_inputs(const std::string& flag, const std::string& path);

// The visual rows of every image and video (Model::encode_vision), in order.
struct EncodedPixels {
  std::vector<Tensor> images, videos;
};
EncodedPixels encode_pixel_inputs(const Model& model, const PixelInputs& media);

}  // namespace msa::cli
