// The image decoder (include/msa/vision_media.h): PNG through libpng, JPEG through
// libjpeg-turbo, anything else refused, all from bytes. Every input is decoded or refused
// with msa::Error (a libpng / libjpeg error must come back through setjmp, never abort or
// exit); a decoded image is non-empty, within the limits and holds width * height * 3
// bytes. Small decoded images also go through preprocess_image (the resize and patch paths
// at odd sizes: 1 x N, extreme aspect ratios).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "msa/vision_media.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace msa;
  // Limits far below the library's defaults keep every run within libFuzzer's memory limit
  // (a 2^22-pixel image decodes into 16 MB at most) and fast.
  vision::DecodeLimits limits;
  limits.max_pixels = int64_t{1} << 22;
  limits.max_side = int64_t{1} << 14;
  vision::Rgb8Image image;
  try {
    image = vision::decode_image_bytes(data, size, "fuzz input", limits);
  } catch (const Error&) {
    return 0;
  }
  if (image.width < 1 || image.height < 1 || image.width > limits.max_side || image.height > limits.max_side ||
      image.width * image.height > limits.max_pixels)
    fuzz::invariant_failed("a decoded image outside the limits: " + std::to_string(image.width) + "x" +
                           std::to_string(image.height));
  if (image.rgb.size() != static_cast<size_t>(image.width * image.height * 3))
    fuzz::invariant_failed("a decoded image of " + std::to_string(image.rgb.size()) + " bytes for " +
                           std::to_string(image.width) + "x" + std::to_string(image.height));
  if (image.width * image.height > (int64_t{1} << 16)) return 0;
  try {
    const vision::PixelPatches patches = vision::preprocess_image(image, {});
    if (patches.pixel_values.size(0) != patches.grid_t * patches.grid_h * patches.grid_w ||
        patches.grid_h % 2 != 0 || patches.grid_w % 2 != 0)
      fuzz::invariant_failed("patches that do not match their grid");
  } catch (const Error&) {
    // An aspect ratio beyond 200 is refused by smart_resize; nothing else may be.
    if (std::max(image.width, image.height) <= 200 * std::min(image.width, image.height))
      fuzz::invariant_failed("preprocess_image refused a decodable image");
  }
  return 0;
}
