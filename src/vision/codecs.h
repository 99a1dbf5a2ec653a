// The codec back ends of decode_image (png_decode.cpp, jpeg_decode.cpp): each turns a whole
// file in memory into samples as the codec delivers them; image_decode.cpp converts those to
// RGB8. Both are built only where their library is (MSA_WITH_PNG, MSA_WITH_JPEG).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "msa/vision_media.h"

namespace msa::vision::detail {

// The samples of one decoded image, interleaved, 8 bits each.
enum class SampleLayout : uint8_t {
  grey,        // 1 a pixel
  grey_alpha,  // 2
  rgb,         // 3
  rgba,        // 4
  cmyk_adobe,  // 4, Adobe's inverted CMYK (255 = no ink)
};

struct DecodedSamples {
  int64_t width = 0, height = 0;
  SampleLayout layout = SampleLayout::rgb;
  std::vector<uint8_t> samples;
};

int samples_per_pixel(SampleLayout layout);

// Refuses (msa::Error naming `name`) a size of zero or beyond `limits`. Called with the
// header's size before any pixel buffer is allocated.
void check_image_size(int64_t width, int64_t height, const std::string& name,
                      const DecodeLimits& limits);

DecodedSamples decode_png(const uint8_t* data, size_t size, const std::string& name,
                          const DecodeLimits& limits);
DecodedSamples decode_jpeg(const uint8_t* data, size_t size, const std::string& name,
                           const DecodeLimits& limits);

}  // namespace msa::vision::detail
