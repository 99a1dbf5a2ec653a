#include "pixel_inputs.h"

#include "cli_args.h"
#include "msa/safetensors.h"

namespace msa::cli {
namespace {

// Grids [G, 3] of int32 or int64 (t, h, w), G in [1, 65536].
std::vector<VisionGrid> read_grids(const SafetensorsFile& file, const std::string& name) {
  const Tensor grid = file.get(name);
  const std::string where = file.path() + ": tensor '" + name + "'";
  if (grid.dim() != 2 || grid.size(1) != 3 || grid.size(0) < 1 || grid.size(0) > 65536)
    throw Error(where + ": expected shape [grids in 1..65536, 3] of (t, h, w), got " +
                shape_string(grid.shape()));
  if (grid.dtype() != DType::i32 && grid.dtype() != DType::i64)
    throw Error(where + ": expected an int32 or int64 tensor, got " + std::string(dtype_name(grid.dtype())));
  std::vector<VisionGrid> grids;
  for (int64_t i = 0; i < grid.size(0); ++i)
    grids.push_back({.t = static_cast<int64_t>(grid.get(3 * i)),
                     .h = static_cast<int64_t>(grid.get(3 * i + 1)),
                     .w = static_cast<int64_t>(grid.get(3 * i + 2))});
  return grids;
}

}  // namespace

PixelInputs load_pixel_inputs(const std::string& flag, const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  PixelInputs media;
  const auto pair = [&](const char* pixels, std::initializer_list<const char*> grids, Tensor& values,
                        std::vector<VisionGrid>& out) {
    const char* grid_name = nullptr;
    for (const char* name : grids)
      if (file.contains(name)) {
        grid_name = name;
        break;
      }
    if (file.contains(pixels) != (grid_name != nullptr))
      throw Error(path + ": expected both '" + std::string(pixels) + "' and '" + *grids.begin() +
                  "' or neither, got only one of them");
    if (!grid_name) return;
    values = file.get(pixels);
    // One NaN pixel makes every row of its segment NaN, and then every logit after it.
    if (const int64_t at = first_non_finite(values); at >= 0)
      throw Error(path + ": tensor '" + std::string(pixels) + "': expected finite values, got " +
                  std::to_string(values.get(at)) + " at index " + index_string(values.shape(), at));
    out = read_grids(file, grid_name);
  };
  // `msa preprocess --video` writes one video as pixel_values + grid_thw (with timestamps);
  // `msa preprocess --image` one image as pixel_values + grid_thw.
  const bool preprocessed_video = file.contains("timestamps") && file.contains("grid_thw") &&
                                  !file.contains("image_grid_thw");
  if (preprocessed_video) {
    pair("pixel_values", {"grid_thw"}, media.video_pixels, media.video_grids);
  } else {
    pair("pixel_values", {"image_grid_thw", "grid_thw"}, media.image_pixels, media.image_grids);
    pair("pixel_values_videos", {"video_grid_thw"}, media.video_pixels, media.video_grids);
  }
  if (media.image_grids.empty() && media.video_grids.empty())
    throw UsageError("--" + flag + ": expected a safetensors file with 'pixel_values' + "
                     "'image_grid_thw' and/or 'pixel_values_videos' + 'video_grid_thw', got " + path);
  return media;
}

EncodedPixels encode_pixel_inputs(const Model& model, const PixelInputs& media) {
  EncodedPixels encoded;
  if (!media.image_grids.empty())
    encoded.images = model.encode_vision(media.image_pixels, media.image_grids);
  if (!media.video_grids.empty())
    encoded.videos = model.encode_vision(media.video_pixels, media.video_grids);
  return encoded;
}

}  // namespace msa::cli
