// PNG files in the tests, through libpng's simplified API (an independent decoder for what
// cairo writes, and test images for what the attention maps overlay).
#pragma once
#include <png.h>

#include <cstdint>
#include <string>
#include <vector>

namespace msa::testing {

struct DecodedPng {
  bool ok = false;
  std::string error;  // libpng's message when !ok
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // height * width * 3
  const uint8_t* at(int64_t x, int64_t y) const { return rgb.data() + (y * width + x) * 3; }
};

// Decodes `path` to RGB8 (libpng composites any alpha onto black).
inline DecodedPng decode_png(const std::string& path) {
  DecodedPng out;
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, path.c_str())) {
    out.error = image.message;
    return out;
  }
  image.format = PNG_FORMAT_RGB;
  out.width = image.width;
  out.height = image.height;
  out.rgb.resize(PNG_IMAGE_SIZE(image));
  out.ok = png_image_finish_read(&image, nullptr, out.rgb.data(), 0, nullptr) != 0;
  if (!out.ok) out.error = image.message;
  png_image_free(&image);
  return out;
}

// Writes `pixels` (height * width * channels bytes; 3: RGB, 4: RGBA) as a PNG.
inline bool write_png(const std::string& path, int64_t width, int64_t height, int channels,
                      const std::vector<uint8_t>& pixels) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = channels == 4 ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
  return png_image_write_to_file(&image, path.c_str(), 0, pixels.data(), 0, nullptr) != 0;
}

}  // namespace msa::testing
