// decode_image: reads the file, recognises PNG / JPEG by their first bytes, runs the codec
// (png_decode.cpp, jpeg_decode.cpp) and converts its samples to RGB8 as transformers' file
// loaders do (load_image: PIL's convert("RGB"), which drops alpha and converts CMYK with
// PIL's formula; load_image_as_tensor: torchvision's RGB decode, the same pixels).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/text_file.h"
#include "msa/vision_media.h"
#include "vision/codecs.h"

namespace msa::vision {
namespace detail {

int samples_per_pixel(SampleLayout layout) {
  switch (layout) {
    case SampleLayout::grey: return 1;
    case SampleLayout::grey_alpha: return 2;
    case SampleLayout::rgb: return 3;
    case SampleLayout::rgba:
    case SampleLayout::cmyk_adobe: return 4;
  }
  return 0;
}

void check_image_size(int64_t width, int64_t height, const std::string& name,
                      const DecodeLimits& limits) {
  if (width <= 0 || height <= 0)
    throw Error(name + ": the image is " + std::to_string(width) + "x" + std::to_string(height) +
                " pixels (expected at least 1x1)");
  if (width > limits.max_side || height > limits.max_side)
    throw Error(name + ": the image is " + std::to_string(width) + "x" + std::to_string(height) +
                " pixels (expected sides of at most " + std::to_string(limits.max_side) + ")");
  if (width > limits.max_pixels / height)
    throw Error(name + ": the image is " + std::to_string(width) + "x" + std::to_string(height) +
                " pixels (expected at most " + std::to_string(limits.max_pixels) +
                " pixels; DecodeLimits::max_pixels)");
}

namespace {

// PIL's CMYK -> RGB (Convert.c cmyk2rgb) on Adobe's inverted samples: with c, k the ink
// amounts, each channel is (255 - k) - round((255 - k) * c / 255).
inline uint8_t cmyk_channel(uint32_t inverted_ink, uint32_t inverted_black) {
  const uint32_t ink = 255 - inverted_ink;
  const uint32_t paper = inverted_black;  // 255 - black ink
  const uint32_t product = ink * paper + 128;
  const uint32_t scaled = ((product >> 8) + product) >> 8;
  return static_cast<uint8_t>(paper >= scaled ? paper - scaled : 0);
}

// Converts in place: the RGB output of pixel i never overwrites input samples that a later
// step still needs (expanding layouts run from the last pixel, shrinking ones from the
// first).
Rgb8Image to_rgb8(detail::DecodedSamples decoded) {
  Rgb8Image image;
  image.width = decoded.width;
  image.height = decoded.height;
  const size_t pixels = static_cast<size_t>(decoded.width) * static_cast<size_t>(decoded.height);
  std::vector<uint8_t>& s = decoded.samples;
  switch (decoded.layout) {
    case detail::SampleLayout::rgb:
      break;
    case detail::SampleLayout::grey:
      s.resize(pixels * 3);
      for (size_t i = pixels; i-- > 0;) s[3 * i] = s[3 * i + 1] = s[3 * i + 2] = s[i];
      break;
    case detail::SampleLayout::grey_alpha:  // alpha dropped
      s.resize(pixels * 3);
      for (size_t i = pixels; i-- > 0;) {
        const uint8_t grey = s[2 * i];
        s[3 * i] = s[3 * i + 1] = s[3 * i + 2] = grey;
      }
      break;
    case detail::SampleLayout::rgba:  // alpha dropped
      for (size_t i = 0; i < pixels; ++i)
        for (int c = 0; c < 3; ++c) s[3 * i + c] = s[4 * i + c];
      s.resize(pixels * 3);
      break;
    case detail::SampleLayout::cmyk_adobe:
      for (size_t i = 0; i < pixels; ++i) {
        const uint8_t black = s[4 * i + 3];
        for (int c = 0; c < 3; ++c) s[3 * i + c] = cmyk_channel(s[4 * i + c], black);
      }
      s.resize(pixels * 3);
      break;
  }
  image.rgb = std::move(s);
  return image;
}

std::string hex_bytes(const uint8_t* data, size_t size) {
  std::string out;
  char text[4];
  for (size_t i = 0; i < std::min<size_t>(size, 8); ++i) {
    std::snprintf(text, sizeof text, i ? " %02x" : "%02x", data[i]);
    out += text;
  }
  return out;
}

bool starts_with(const uint8_t* data, size_t size, std::string_view prefix, size_t at = 0) {
  return size >= at + prefix.size() && std::memcmp(data + at, prefix.data(), prefix.size()) == 0;
}

// Formats people try that are not decoded here, for a clearer error than "unknown".
const char* other_image_format(const uint8_t* data, size_t size) {
  using namespace std::string_view_literals;  // "..."sv keeps embedded NULs
  if (starts_with(data, size, "GIF87a"sv) || starts_with(data, size, "GIF89a"sv)) return "GIF";
  if (starts_with(data, size, "RIFF"sv) && starts_with(data, size, "WEBP"sv, 8)) return "WebP";
  if (starts_with(data, size, "BM"sv)) return "BMP";
  if (starts_with(data, size, "II*\0"sv) || starts_with(data, size, "MM\0*"sv)) return "TIFF";
  if (starts_with(data, size, "ftypavif"sv, 4) || starts_with(data, size, "ftypheic"sv, 4))
    return "AVIF or HEIC";
  if (starts_with(data, size, "\0\0\0\x0cjP  "sv)) return "JPEG 2000";
  return nullptr;
}

}  // namespace
}  // namespace detail

MediaSupport media_support() {
  MediaSupport support;
#ifdef MSA_WITH_PNG
  support.png = true;
#endif
#ifdef MSA_WITH_JPEG
  support.jpeg = true;
#endif
#ifdef MSA_WITH_FFMPEG
  support.video_files = true;
#endif
  return support;
}

Rgb8Image decode_image_bytes(const uint8_t* data, size_t size, const std::string& name,
                             const DecodeLimits& limits) {
  if (size == 0) throw Error(name + ": the file is empty (expected a PNG or JPEG image)");
  static constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 8 && std::memcmp(data, kPngSignature, 8) == 0) {
#ifdef MSA_WITH_PNG
    return detail::to_rgb8(detail::decode_png(data, size, name, limits));
#else
    throw Error(name + ": a PNG image, but msa was built without libpng (install libpng-dev and rebuild)");
#endif
  }
  if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff) {
#ifdef MSA_WITH_JPEG
    return detail::to_rgb8(detail::decode_jpeg(data, size, name, limits));
#else
    throw Error(name + ": a JPEG image, but msa was built without libjpeg (install libjpeg-dev and rebuild)");
#endif
  }
  if (const char* format = detail::other_image_format(data, size))
    throw Error(name + ": a " + format + " image (msa decodes PNG and JPEG only)");
  throw Error(name + ": not a PNG or JPEG image (it starts with bytes " +
              detail::hex_bytes(data, size) + ")");
}

Rgb8Image decode_image(const std::string& path, const DecodeLimits& limits) {
  const std::string name = "image '" + path + "'";
  // (read_text_file reads any bytes; it refuses directories, devices, FIFOs and files over
  // the limit before reading)
  const std::string bytes = read_text_file(path, name, static_cast<uint64_t>(limits.max_file_bytes));
  return decode_image_bytes(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name,
                            limits);
}

}  // namespace msa::vision
