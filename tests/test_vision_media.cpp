// The vision tower's media input (include/msa/vision_media.h): decoding (every PNG and JPEG
// kind, and bad files), the resize against its plain reference, smart_resize, the patch
// order, processor configs, frame sampling, frame folders and video files. Every input is
// made here; transformers parity is tests/parity/test_vision_parity.py. Built where libpng and
// libjpeg are (their writers make the test files); video files where FFmpeg is
// (MSA_TEST_VIDEO_FILES).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "cli_runner.h"
#include "msa/safetensors.h"
#include "msa/vision_media.h"
#include "test_util.h"
#include "vision/resize.h"
#include "vision_media_files.h"
#ifdef MSA_TEST_VIDEO_FILES
#include "vision_video_files.h"
#endif

namespace msa::testing {
namespace {

using vision::Rgb8Image;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

Rgb8Image decode(const std::string& bytes, const vision::DecodeLimits& limits = {}) {
  return vision::decode_image_bytes(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                    "test image", limits);
}

Rgb8Image random_image(int64_t width, int64_t height, std::mt19937_64& rng) {
  Rgb8Image image{width, height, std::vector<uint8_t>(static_cast<size_t>(width * height * 3))};
  for (uint8_t& v : image.rgb) v = static_cast<uint8_t>(rng() & 0xff);
  return image;
}

// Smooth gradients with a hard edge: the content real photos have, where a wrong filter shows.
Rgb8Image pattern_image(int64_t width, int64_t height) {
  Rgb8Image image{width, height, std::vector<uint8_t>(static_cast<size_t>(width * height * 3))};
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x) {
      uint8_t* p = &image.rgb[static_cast<size_t>((y * width + x) * 3)];
      p[0] = static_cast<uint8_t>((x * 255) / std::max<int64_t>(width - 1, 1));
      p[1] = static_cast<uint8_t>((y * 255) / std::max<int64_t>(height - 1, 1));
      p[2] = ((x / 7 + y / 5) % 2) ? 230 : 20;
    }
  return image;
}

const uint8_t* pixel(const Rgb8Image& image, int64_t x, int64_t y) {
  return &image.rgb[static_cast<size_t>((y * image.width + x) * 3)];
}


// ---------------------------------------------------------------------------------------
// Decoding

TEST(VisionDecode, RgbPngRoundTripsExactly) {
  std::mt19937_64 rng(101);
  for (const bool interlaced : {false, true}) {
    const Rgb8Image image = random_image(37, 23, rng);
    PngSpec spec;
    spec.width = 37;
    spec.height = 23;
    spec.interlaced = interlaced;
    spec.rows = image.rgb;
    const Rgb8Image back = decode(png_bytes(spec));
    EXPECT_EQ(back.width, 37);
    EXPECT_EQ(back.height, 23);
    EXPECT_EQ(back.rgb, image.rgb) << "interlaced " << interlaced;
  }
}

TEST(VisionDecode, GreyPngsOfEveryDepthScaleToEightBits) {
  // 8 pixels in one row: every value a depth has, packed MSB first.
  for (const int depth : {1, 2, 4, 8}) {
    const int levels = 1 << depth;
    PngSpec spec;
    spec.width = 8;
    spec.color_type = PNG_COLOR_TYPE_GRAY;
    spec.bit_depth = depth;
    spec.rows.assign(png_row_bytes(spec), 0);
    std::vector<int> values;
    for (int x = 0; x < 8; ++x) {
      const int v = (x * 37) % levels;
      values.push_back(v);
      const int bit = x * depth;
      spec.rows[static_cast<size_t>(bit / 8)] |= static_cast<uint8_t>(v << (8 - depth - bit % 8));
    }
    const Rgb8Image back = decode(png_bytes(spec));
    for (int x = 0; x < 8; ++x) {
      const int expected = values[static_cast<size_t>(x)] * 255 / (levels - 1);
      for (int c = 0; c < 3; ++c) EXPECT_EQ(pixel(back, x, 0)[c], expected) << "depth " << depth << " x " << x;
    }
  }
}

// Alpha is dropped, as PIL's convert("RGB") (transformers' load_image) does: the colour
// under any alpha, from 0 to 255, comes through as it is.
TEST(VisionDecode, AlphaIsDropped) {
  const std::vector<uint8_t> values = {0, 200, 100, 37, 255, 12};
  const std::vector<uint8_t> alphas = {128, 1, 254, 77, 0, 255};
  std::vector<uint8_t> grey_alpha, rgba, expected;
  for (size_t i = 0; i < values.size(); ++i) {
    grey_alpha.insert(grey_alpha.end(), {values[i], alphas[i]});
    rgba.insert(rgba.end(), {values[i], static_cast<uint8_t>(values[i] ^ 0x55), static_cast<uint8_t>(255 - values[i]), alphas[i]});
  }
  const uint32_t n = static_cast<uint32_t>(values.size());
  const Rgb8Image grey = decode(png_of_samples(n, 1, 2, grey_alpha));
  const Rgb8Image colour = decode(png_of_samples(n, 1, 4, rgba));
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(std::vector<uint8_t>(pixel(grey, i, 0), pixel(grey, i, 0) + 3),
              std::vector<uint8_t>(3, values[i])) << i;
    EXPECT_EQ(std::vector<uint8_t>(pixel(colour, i, 0), pixel(colour, i, 0) + 3),
              std::vector<uint8_t>(&rgba[4 * i], &rgba[4 * i + 3])) << i;
  }
}

// Transparency of palette entries and colour keys is ignored too: the colours stay.
TEST(VisionDecode, PaletteAndColourKeyTransparency) {
  PngSpec palette;
  palette.width = 4;
  palette.color_type = PNG_COLOR_TYPE_PALETTE;
  palette.palette = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}, {0, 128, 128}};
  palette.palette_alpha = {255, 0, 128};  // entry 3 has no alpha: opaque
  palette.rows = {0, 1, 2, 3};
  const Rgb8Image p = decode(png_bytes(palette));
  EXPECT_EQ(p.rgb, (std::vector<uint8_t>{255, 0, 0, 0, 255, 0, 0, 0, 255, 0, 128, 128}));

  PngSpec keyed;  // RGB with one transparent colour
  keyed.width = 2;
  keyed.rows = {1, 2, 3, 4, 5, 6};
  keyed.transparent = png_color_16{0, 4, 5, 6, 0};
  EXPECT_EQ(decode(png_bytes(keyed)).rgb, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));

  PngSpec grey_keyed;
  grey_keyed.width = 2;
  grey_keyed.color_type = PNG_COLOR_TYPE_GRAY;
  grey_keyed.rows = {9, 70};
  grey_keyed.transparent = png_color_16{0, 0, 0, 0, 70};
  EXPECT_EQ(decode(png_bytes(grey_keyed)).rgb, (std::vector<uint8_t>{9, 9, 9, 70, 70, 70}));
}

TEST(VisionDecode, SixteenBitPngsKeepTheHighByte) {
  // Samples 0x1234, 0xfedc, 0x00ff, 0x8000 (big-endian in the file).
  const std::vector<uint8_t> samples16 = {0x12, 0x34, 0xfe, 0xdc, 0x00, 0xff, 0x80, 0x00};
  PngSpec grey;
  grey.width = 4;
  grey.color_type = PNG_COLOR_TYPE_GRAY;
  grey.bit_depth = 16;
  grey.rows = samples16;
  const Rgb8Image g = decode(png_bytes(grey));
  EXPECT_EQ(g.rgb, (std::vector<uint8_t>{0x12, 0x12, 0x12, 0xfe, 0xfe, 0xfe, 0, 0, 0, 0x80, 0x80, 0x80}));

  PngSpec rgb;
  rgb.width = 1;
  rgb.bit_depth = 16;
  rgb.rows = {0x12, 0x34, 0xfe, 0xdc, 0x00, 0xff};
  EXPECT_EQ(decode(png_bytes(rgb)).rgb, (std::vector<uint8_t>{0x12, 0xfe, 0x00}));

  PngSpec rgba;  // alpha 0xffff: opaque
  rgba.width = 1;
  rgba.color_type = PNG_COLOR_TYPE_RGB_ALPHA;
  rgba.bit_depth = 16;
  rgba.rows = {0x12, 0x34, 0xfe, 0xdc, 0x00, 0xff, 0xff, 0xff};
  EXPECT_EQ(decode(png_bytes(rgba)).rgb, (std::vector<uint8_t>{0x12, 0xfe, 0x00}));
}

TEST(VisionDecode, OnePixelImages) {
  const Rgb8Image one = decode(png_of_samples(1, 1, 3, {7, 8, 9}));
  EXPECT_EQ(one.width, 1);
  EXPECT_EQ(one.rgb, (std::vector<uint8_t>{7, 8, 9}));
  // The smallest image is upscaled to min_pixels: 56 x 56, a 4 x 4 grid, all one colour.
  const vision::PixelPatches patches = vision::preprocess_image(one, {});
  EXPECT_EQ(patches.grid_t, 1);
  EXPECT_EQ(patches.grid_h, 4);
  EXPECT_EQ(patches.grid_w, 4);
  for (size_t i = 0; i < patches.resized[0].rgb.size(); i += 3)
    ASSERT_EQ(patches.resized[0].rgb[i], 7) << i;
}

TEST(VisionDecode, JpegRgbAndGrey) {
  const Rgb8Image image = pattern_image(40, 24);
  JpegSpec spec;
  spec.width = 40;
  spec.height = 24;
  spec.samples = image.rgb;
  spec.quality = 100;
  for (const bool progressive : {false, true}) {
    spec.progressive = progressive;
    const Rgb8Image back = decode(jpeg_bytes(spec));
    ASSERT_EQ(back.width, 40);
    ASSERT_EQ(back.height, 24);
    double total = 0;
    for (size_t i = 0; i < back.rgb.size(); ++i) total += std::abs(back.rgb[i] - image.rgb[i]);
    EXPECT_LT(total / static_cast<double>(back.rgb.size()), 3.0) << "progressive " << progressive;
  }
  JpegSpec grey;
  grey.width = 16;
  grey.height = 8;
  grey.components = 1;
  grey.input_space = JCS_GRAYSCALE;
  grey.samples.assign(16 * 8, 0);
  for (size_t i = 0; i < grey.samples.size(); ++i) grey.samples[i] = static_cast<uint8_t>(i % 16 < 8 ? 40 : 200);
  const Rgb8Image g = decode(jpeg_bytes(grey));
  for (int64_t i = 0; i < 16 * 8; ++i) {
    const uint8_t* p = pixel(g, i % 16, i / 16);
    EXPECT_EQ(p[0], p[1]);
    EXPECT_EQ(p[1], p[2]);
    EXPECT_NEAR(p[0], grey.samples[static_cast<size_t>(i)], 12);
  }
}

// CMYK JPEGs hold Adobe's inverted samples; RGB follows PIL's formula (values from PIL 13:
// Image.fromarray(CMYK ink).convert("RGB")).
TEST(VisionDecode, CmykAndYcckJpegsAsAdobeInvertedCmyk) {
  struct Ink {
    uint8_t c, m, y, k;
    uint8_t r, g, b;
  };
  const Ink inks[] = {{0, 0, 255, 0, 255, 255, 0},   {255, 0, 255, 0, 0, 255, 0},
                      {0, 0, 255, 255, 0, 0, 0},     {100, 0, 255, 50, 125, 205, 0},
                      {30, 0, 255, 200, 49, 55, 0}};
  // One flat 8 x 8 block per ink: JPEG keeps flat blocks (up to rounding of their DC).
  const int n = static_cast<int>(std::size(inks));
  JpegSpec spec;
  spec.width = 8 * n;
  spec.height = 8;
  spec.components = 4;
  spec.input_space = JCS_CMYK;
  spec.quality = 100;
  spec.samples.resize(static_cast<size_t>(spec.width * 8 * 4));
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < spec.width; ++x) {
      const Ink& ink = inks[x / 8];
      uint8_t* s = &spec.samples[static_cast<size_t>((y * spec.width + x) * 4)];
      s[0] = 255 - ink.c;
      s[1] = 255 - ink.m;
      s[2] = 255 - ink.y;
      s[3] = 255 - ink.k;
    }
  for (const std::optional<J_COLOR_SPACE> space : {std::optional<J_COLOR_SPACE>{}, std::optional(JCS_YCCK)}) {
    spec.file_space = space;
    const Rgb8Image back = decode(jpeg_bytes(spec));
    for (int i = 0; i < n; ++i) {
      const uint8_t* p = pixel(back, i * 8 + 3, 4);
      EXPECT_NEAR(p[0], inks[i].r, 2) << "ink " << i << (space ? " ycck" : " cmyk");
      EXPECT_NEAR(p[1], inks[i].g, 2) << "ink " << i << (space ? " ycck" : " cmyk");
      EXPECT_NEAR(p[2], inks[i].b, 2) << "ink " << i << (space ? " ycck" : " cmyk");
    }
  }
}

TEST(VisionDecode, MissingEmptyAndNonImageFiles) {
  const std::filesystem::path dir = fresh_dir("vision_decode_files");
  expect_error([&] { vision::decode_image((dir / "nope.png").string()); }, "nope.png': cannot open");
  write_file((dir / "empty.png").string(), "");
  expect_error([&] { vision::decode_image((dir / "empty.png").string()); }, "the file is empty");
  expect_error([&] { vision::decode_image(dir.string()); }, "expected a regular file");
  write_file((dir / "notes.png").string(), "<!DOCTYPE html> not an image");
  expect_error([&] { vision::decode_image((dir / "notes.png").string()); },
               "not a PNG or JPEG image (it starts with bytes 3c 21 44 4f 43 54 59 50)");
  write_file((dir / "anim.png").string(), "GIF89a\x01\x00\x01\x00");
  expect_error([&] { vision::decode_image((dir / "anim.png").string()); }, "a GIF image (msa decodes PNG and JPEG only)");
  // The extension does not matter: a PNG named .jpg decodes.
  write_file((dir / "really_png.jpg").string(), png_of_samples(2, 1, 3, {1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(vision::decode_image((dir / "really_png.jpg").string()).rgb, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));
  // File size limit, checked before reading.
  vision::DecodeLimits small;
  small.max_file_bytes = 4;
  expect_error([&] { vision::decode_image((dir / "notes.png").string(), small); }, "expected at most 4 bytes");
}

// Every prefix of a valid file is refused with an error naming the file (never a crash or a
// partial image), and so is every single-byte corruption that libpng's CRCs catch.
TEST(VisionDecode, TruncatedAndCorruptPngs) {
  std::mt19937_64 rng(202);
  const Rgb8Image image = random_image(19, 11, rng);
  const std::string good = png_of_samples(19, 11, 3, image.rgb);
  for (size_t cut = 1; cut < good.size(); ++cut) {
    const std::string message = error_of([&] { decode(good.substr(0, cut)); });
    ASSERT_NE(message.find("test image: "), std::string::npos) << "cut " << cut << ": " << message;
  }
  size_t refused = 0;
  for (size_t at = 8; at < good.size(); at += 3) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0x5a);
    const std::string message = error_of([&] {
      const Rgb8Image back = decode(bad);
      EXPECT_EQ(back.rgb.size(), static_cast<size_t>(back.width * back.height * 3));
    });
    if (message != "(no error)") {
      ++refused;
      EXPECT_NE(message.find("test image: "), std::string::npos) << message;
    }
  }
  // The CRC covers every chunk's type and data: a flipped byte there is refused (only an
  // ancillary chunk's damage would be a warning, and this file has none).
  EXPECT_GT(refused, (good.size() - 8) / 3 * 9 / 10);
}

TEST(VisionDecode, TruncatedAndCorruptJpegs) {
  JpegSpec spec;
  spec.width = 32;
  spec.height = 24;
  spec.samples = pattern_image(32, 24).rgb;
  const std::string good = jpeg_bytes(spec);
  for (size_t cut = 1; cut < good.size(); ++cut) {
    const std::string message = error_of([&] { decode(good.substr(0, cut)); });
    ASSERT_NE(message.find("test image: "), std::string::npos) << "cut " << cut << ": " << message;
  }
  expect_error([&] { decode(good.substr(0, good.size() / 2)); }, "Premature end of JPEG file");
  // Corrupt bytes: an error or an image of the right size, never a crash.
  for (size_t at = 2; at < good.size(); ++at) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0xa5);
    const std::string message = error_of([&] {
      const Rgb8Image back = decode(bad);
      EXPECT_EQ(back.rgb.size(), static_cast<size_t>(back.width * back.height * 3));
    });
    if (message != "(no error)") EXPECT_NE(message.find("test image: "), std::string::npos) << message;
  }
}

// Sizes beyond the limits are refused from the header: a 60000 x 60000 PNG whose IHDR is
// all there is (decoding it would need 10 GB) fails at once.
TEST(VisionDecode, SizeLimitsAreCheckedBeforeAllocating) {
  std::string header = png_of_samples(1, 1, 3, {0, 0, 0}).substr(0, 33);  // signature + IHDR
  const auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) header[at + i] = static_cast<char>(v >> (24 - 8 * i));
  };
  put32(16, 60000);
  put32(20, 60000);
  // The IHDR's CRC over its type and data, so that libpng reads the size.
  uint32_t crc = 0xffffffffu;
  for (size_t i = 12; i < 29; ++i) {
    crc ^= static_cast<uint8_t>(header[i]);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
  }
  put32(29, ~crc);
  header += std::string("\0\0\0\0IDAT\x35\xaf\x06\x1e", 12);  // an empty IDAT: png_read_info stops there
  expect_error([&] { decode(header); }, "60000x60000 pixels (expected at most 268435456 pixels");
  vision::DecodeLimits limits;
  limits.max_pixels = 100;
  expect_error([&] { decode(png_of_samples(11, 10, 1, std::vector<uint8_t>(110)), limits); },
               "11x10 pixels (expected at most 100 pixels");
  EXPECT_EQ(decode(png_of_samples(10, 10, 1, std::vector<uint8_t>(100)), limits).width, 10);
  limits.max_side = 8;
  expect_error([&] { decode(png_of_samples(9, 1, 1, std::vector<uint8_t>(9)), limits); },
               "expected sides of at most 8");
  JpegSpec spec;
  spec.width = 11;
  spec.height = 10;
  spec.samples.assign(11 * 10 * 3, 128);
  limits.max_side = 1000;
  expect_error([&] { decode(jpeg_bytes(spec), limits); }, "11x10 pixels (expected at most 100 pixels");
}

// ---------------------------------------------------------------------------------------
// Resize

// The optimised resize equals the plain reference bit for bit over a matrix of sizes: every
// pair of up / down / equal per axis, sides of 1 and 2, scale factors near 1 and far from it.
TEST(VisionResize, MatchesTheReferenceBitForBit) {
  std::mt19937_64 rng(303);
  const int64_t sides[] = {1, 2, 3, 5, 13, 28, 57};
  const int64_t targets[] = {1, 2, 4, 27, 28, 56, 99};
  int cases = 0;
  for (const int64_t in_w : sides)
    for (const int64_t in_h : sides) {
      // Every target width with a random target height, and the reverse: each axis meets
      // every size while the case count stays linear.
      for (const int64_t out_w : targets) {
        const int64_t out_h = targets[rng() % std::size(targets)];
        for (const bool noise : {true, false}) {
          const Rgb8Image image = noise ? random_image(in_w, in_h, rng) : pattern_image(in_w, in_h);
          const Rgb8Image fast = vision::resize_bicubic_antialias(image, out_h, out_w);
          const Rgb8Image slow = vision::detail::resize_bicubic_antialias_reference(image, out_h, out_w);
          ASSERT_EQ(fast.width, out_w);
          ASSERT_EQ(fast.height, out_h);
          ASSERT_EQ(fast.rgb, slow.rgb) << in_w << "x" << in_h << " -> " << out_w << "x" << out_h
                                        << (noise ? " noise" : " pattern");
          ++cases;
        }
      }
      const int64_t out_h = targets[rng() % std::size(targets)];
      const Rgb8Image image = random_image(in_w, in_h, rng);
      ASSERT_EQ(vision::resize_bicubic_antialias(image, out_h, in_w).rgb,
                vision::detail::resize_bicubic_antialias_reference(image, out_h, in_w).rgb);
    }
  // The sizes of real use: a photo down to the processor's size, a thumbnail up to it; and
  // reductions by more than 64x, where the weights are small enough for 22 fraction bits.
  for (const auto [w, h, ow, oh] : {std::array<int64_t, 4>{640, 480, 644, 476},
                                    std::array<int64_t, 4>{517, 333, 504, 336},
                                    std::array<int64_t, 4>{40, 30, 84, 56},
                                    std::array<int64_t, 4>{4000, 40, 12, 40},
                                    std::array<int64_t, 4>{30, 3000, 30, 9}}) {
    const Rgb8Image image = random_image(w, h, rng);
    ASSERT_EQ(vision::resize_bicubic_antialias(image, oh, ow).rgb,
              vision::detail::resize_bicubic_antialias_reference(image, oh, ow).rgb)
        << w << "x" << h << " -> " << ow << "x" << oh;
    ++cases;
  }
  EXPECT_GT(cases, 600);
}

TEST(VisionResize, SameSizeIsACopyAndFlatStaysFlat) {
  std::mt19937_64 rng(404);
  const Rgb8Image image = random_image(31, 17, rng);
  EXPECT_EQ(vision::resize_bicubic_antialias(image, 17, 31).rgb, image.rgb);
  for (const uint8_t level : {uint8_t{0}, uint8_t{1}, uint8_t{128}, uint8_t{255}}) {
    const Rgb8Image flat{23, 9, std::vector<uint8_t>(23 * 9 * 3, level)};
    for (const auto [oh, ow] : {std::pair<int64_t, int64_t>{1, 1}, {9, 50}, {40, 23}, {100, 7}}) {
      const Rgb8Image out = vision::resize_bicubic_antialias(flat, oh, ow);
      for (const uint8_t v : out.rgb) ASSERT_EQ(v, level) << oh << "x" << ow;
    }
  }
  expect_error([&] { vision::resize_bicubic_antialias(image, 0, 5); }, "sides in [1, 2^24]");
  expect_error([&] { vision::resize_bicubic_antialias(Rgb8Image{2, 2, {1, 2, 3}}, 4, 4); },
               "width * height * 3 bytes");
}

// The integer pipeline stays within 2 levels of the same filter in exact arithmetic (f64
// weights, an f64 intermediate, one rounding at the end): int16 weights are off by at most
// 2^-(precision + 1) each, and the uint8 intermediate adds half a level that the vertical
// filter (sum of |weights| < 1.3) carries on.
TEST(VisionResize, StaysWithinTwoLevelsOfExactArithmetic) {
  const auto weights = [](int64_t in, int64_t out, int64_t i, int64_t& first) {
    const double scale = static_cast<double>(in) / static_cast<double>(out);
    const double support = 2.0 * std::max(scale, 1.0);
    const double center = scale * (static_cast<double>(i) + 0.5);
    first = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in);
    std::vector<double> w;
    double total = 0;
    for (int64_t j = first; j < end; ++j) {
      w.push_back(vision::detail::bicubic_kernel((static_cast<double>(j) - center + 0.5) / std::max(scale, 1.0)));
      total += w.back();
    }
    for (double& v : w) v /= total;
    return w;
  };
  for (const auto [w, h, ow, oh] : {std::array<int64_t, 4>{90, 70, 33, 150}, std::array<int64_t, 4>{64, 48, 200, 20},
                                    std::array<int64_t, 4>{300, 200, 56, 28}}) {
    const Rgb8Image image = pattern_image(w, h);
    std::vector<double> wide(static_cast<size_t>(h * ow * 3));
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < ow; ++x) {
        int64_t first = 0;
        const std::vector<double> k = weights(w, ow, x, first);
        for (int c = 0; c < 3; ++c) {
          double sum = 0;
          for (size_t j = 0; j < k.size(); ++j) sum += k[j] * pixel(image, first + static_cast<int64_t>(j), y)[c];
          wide[static_cast<size_t>((y * ow + x) * 3 + c)] = sum;
        }
      }
    const Rgb8Image out = vision::resize_bicubic_antialias(image, oh, ow);
    int worst = 0;
    for (int64_t y = 0; y < oh; ++y) {
      int64_t first = 0;
      const std::vector<double> k = weights(h, oh, y, first);
      for (int64_t x = 0; x < ow; ++x)
        for (int c = 0; c < 3; ++c) {
          double sum = 0;
          for (size_t j = 0; j < k.size(); ++j)
            sum += k[j] * wide[static_cast<size_t>(((first + static_cast<int64_t>(j)) * ow + x) * 3 + c)];
          const int exact = static_cast<int>(std::clamp(std::round(sum), 0.0, 255.0));
          worst = std::max(worst, std::abs(exact - pixel(out, x, y)[c]));
        }
    }
    EXPECT_LE(worst, 2) << w << "x" << h << " -> " << ow << "x" << oh;
  }
}

// ---------------------------------------------------------------------------------------
// smart_resize, patches, normalisation

// Expected sizes from transformers 5.24's smart_resize (factor 28).
TEST(VisionPatches, SmartResizeMatchesTransformers) {
  struct Case {
    int64_t h, w, min_pixels, max_pixels, out_h, out_w;
  };
  const Case cases[] = {
      {480, 640, 3136, 451584, 476, 644},   {37, 53, 3136, 451584, 56, 84},
      {1, 1, 3136, 451584, 56, 56},         {1200, 1800, 3136, 451584, 532, 812},
      {28, 5000, 3136, 451584, 28, 5012},   {42, 70, 3136, 451584, 56, 56},  // 1.5 and 2.5 round to 2
      {70, 98, 3136, 451584, 56, 112},      {3000, 4000, 3136, 451584, 560, 756},
      {1080, 1920, 3136, 602112, 560, 1008}, {100, 19900, 3136, 451584, 28, 9464},
      {56, 84, 3136, 451584, 56, 84},       {10, 2000, 3136, 451584, 28, 812},
  };
  for (const Case& c : cases)
    EXPECT_EQ(vision::smart_resize(c.h, c.w, 28, c.min_pixels, c.max_pixels),
              std::make_pair(c.out_h, c.out_w))
        << c.h << "x" << c.w;
  expect_error([] { vision::smart_resize(10, 2001, 28, 3136, 451584); }, "expected an aspect ratio of at most 200");
  expect_error([] { vision::smart_resize(0, 5, 28, 3136, 451584); }, "sides in [1, 2^24]");
}

// Pixel values of a raw (unnormalised) image name the sample they came from: R = y, G = x,
// B = x + 2y + 50 * frame. The expected rows are generated in the documented order
// (docs/vision.md): t, merge window (raster), patch in the window (raster); inside a row
// channel, frame of the pair, patch row, patch column.
void expect_patch_order(const vision::PixelPatches& patches, int64_t frames, int64_t height, int64_t width) {
  const int64_t ps = 14, m = 2, tp = 2;
  ASSERT_EQ(patches.grid_h, height / ps);
  ASSERT_EQ(patches.grid_w, width / ps);
  ASSERT_EQ(patches.grid_t, (frames + 1) / 2);
  ASSERT_EQ(patches.pixel_values.shape(), (Shape{patches.grid_t * patches.grid_h * patches.grid_w, 3 * tp * ps * ps}));
  const float* v = patches.pixel_values.data<float>();
  int64_t row = 0;
  for (int64_t t = 0; t < patches.grid_t; ++t)
    for (int64_t hb = 0; hb < patches.grid_h / m; ++hb)
      for (int64_t wb = 0; wb < patches.grid_w / m; ++wb)
        for (int64_t mh = 0; mh < m; ++mh)
          for (int64_t mw = 0; mw < m; ++mw, ++row) {
            int64_t col = 0;
            for (int64_t c = 0; c < 3; ++c)
              for (int64_t f = 0; f < tp; ++f)
                for (int64_t py = 0; py < ps; ++py)
                  for (int64_t px = 0; px < ps; ++px, ++col) {
                    const int64_t frame = std::min(t * tp + f, frames - 1);  // padding repeats the last
                    const int64_t y = (hb * m + mh) * ps + py, x = (wb * m + mw) * ps + px;
                    const int64_t expected = c == 0 ? y : c == 1 ? x : (x + 2 * y + 50 * frame) % 256;
                    ASSERT_EQ(v[row * 3 * tp * ps * ps + col], static_cast<float>(expected))
                        << "row " << row << " col " << col << " (t " << t << ", window " << hb << "," << wb
                        << ", patch " << mh << "," << mw << ", channel " << c << ", frame " << f << ", y "
                        << y << ", x " << x << ")";
                  }
          }
}

Rgb8Image coded_frame(int64_t width, int64_t height, int64_t frame) {
  Rgb8Image image{width, height, std::vector<uint8_t>(static_cast<size_t>(width * height * 3))};
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x) {
      uint8_t* p = &image.rgb[static_cast<size_t>((y * width + x) * 3)];
      p[0] = static_cast<uint8_t>(y);
      p[1] = static_cast<uint8_t>(x);
      p[2] = static_cast<uint8_t>((x + 2 * y + 50 * frame) % 256);
    }
  return image;
}

TEST(VisionPatches, ImagePatchOrder) {
  vision::ImageProcessorConfig config;
  config.pixels.do_rescale = config.pixels.do_normalize = false;
  // 112 x 84: a multiple of 28 inside [min, max] pixels, kept as it is; the frame stands
  // for both frames of the temporal patch.
  const vision::PixelPatches patches = vision::preprocess_image(coded_frame(84, 112, 0), config);
  expect_patch_order(patches, 1, 112, 84);
  EXPECT_EQ(patches.resized.size(), 1u);
}

TEST(VisionPatches, VideoPatchOrderPairsFramesAndPadsTheLast) {
  vision::VideoProcessorConfig config;
  config.pixels.do_rescale = config.pixels.do_normalize = false;
  for (const int64_t count : {1, 4, 5}) {
    vision::VideoFrames video;
    for (int64_t f = 0; f < count; ++f) {
      video.frames.push_back(coded_frame(56, 84, f));
      video.frame_indices.push_back(3 * f);
    }
    video.source_fps = 2.0;
    const vision::PixelPatches patches = vision::preprocess_video(video, config);
    expect_patch_order(patches, count, 84, 56);
    EXPECT_EQ(patches.resized.size(), static_cast<size_t>(count));
    // Each temporal patch is stamped with its first frame's time (index / fps).
    ASSERT_EQ(patches.timestamps.size(), static_cast<size_t>(patches.grid_t));
    for (int64_t t = 0; t < patches.grid_t; ++t)
      EXPECT_DOUBLE_EQ(patches.timestamps[static_cast<size_t>(t)], 3.0 * std::min(2 * t, count - 1) / 2.0);
  }
}

// Normalisation is transformers' fused rescale + normalise in f32: (x - mean * 255) /
// (std * 255) with mean and std rounded to f32 first (tests/parity checks the bits against
// torch); here against the f64 formula (x / 255 - mean) / std.
TEST(VisionPatches, NormalisedValues) {
  Rgb8Image image{56, 56, std::vector<uint8_t>(56 * 56 * 3)};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>((i / 3) % 256);
  const vision::ImageProcessorConfig config;
  const vision::PixelPatches patches = vision::preprocess_image(image, config);
  const float* v = patches.pixel_values.data<float>();
  const int64_t cols = patches.pixel_values.size(1);
  double worst = 0;
  for (int64_t row = 0; row < patches.pixel_values.size(0); ++row)
    for (int64_t col = 0; col < cols; ++col) {
      const int64_t c = col / (cols / 3);
      // Undo the value: find the sample through its f64 formula's inverse, then compare.
      const double value = v[row * cols + col];
      const double x = (value * config.pixels.image_std[c] + config.pixels.image_mean[c]) * 255.0;
      const double rounded = std::round(x);
      ASSERT_NEAR(x, rounded, 1e-3);
      worst = std::max(worst, std::abs(value - (rounded / 255.0 - config.pixels.image_mean[c]) / config.pixels.image_std[c]));
    }
  EXPECT_LT(worst, 1e-6);

  vision::ImageProcessorConfig rescale_only;
  rescale_only.pixels.do_normalize = false;
  const vision::PixelPatches rescaled = vision::preprocess_image(image, rescale_only);
  for (int64_t i = 0; i < rescaled.pixel_values.numel(); i += 97) {
    const float got = rescaled.pixel_values.data<float>()[i];
    EXPECT_NEAR(got * 255.0, std::round(got * 255.0), 1e-4);
  }
}

TEST(VisionPatches, BadSettingsAndSizes) {
  std::mt19937_64 rng(505);
  vision::ImageProcessorConfig config;
  config.pixels.do_resize = false;
  expect_error([&] { vision::preprocess_image(random_image(30, 28, rng), config); },
               "without do_resize the size must be a multiple of patch_size * merge_size = 28, got 30x28");
  config = {};
  config.pixels.image_std[1] = 0;
  expect_error([&] { vision::preprocess_image(random_image(30, 28, rng), config); }, "positive finite image_std");
  expect_error([&] { vision::preprocess_image(Rgb8Image{}, {}); }, "an image of at least 1x1 pixels");
  expect_error([&] { vision::preprocess_video(vision::VideoFrames{}, {}); }, "no frames");
  vision::VideoFrames mixed;
  mixed.frames = {random_image(40, 30, rng), random_image(41, 30, rng)};
  expect_error([&] { vision::preprocess_video(mixed, {}); }, "frame 1 is 41x30");
  EXPECT_EQ(vision::video_segments(9, 4, 6, 4),
            (std::vector<std::array<int64_t, 3>>{{4, 4, 6}, {4, 4, 6}, {1, 4, 6}}));
  EXPECT_EQ(vision::video_segments(9, 4, 6, 0), (std::vector<std::array<int64_t, 3>>{{9, 4, 6}}));
}

// ---------------------------------------------------------------------------------------
// Processor configs

class VisionConfig : public TempDirTest {
 protected:
  void write(const std::string& name, const std::string& text) { write_file(path(name), text); }
};

TEST_F(VisionConfig, DefaultsWithoutFiles) {
  const vision::ImageProcessorConfig image = vision::load_image_processor_config(dir_.string());
  EXPECT_EQ(image.origin, "defaults");
  EXPECT_EQ(image.pixels.min_pixels, 3136);
  EXPECT_EQ(image.pixels.max_pixels, 451584);
  EXPECT_EQ(image.pixels.patch_size, 14);
  const vision::VideoProcessorConfig video = vision::load_video_processor_config(dir_.string());
  EXPECT_EQ(video.pixels.min_pixels, 3136);
  EXPECT_EQ(video.pixels.max_pixels, 602112);
  EXPECT_EQ(video.fps, 1.0);
  EXPECT_EQ(video.min_frames, 4);
  EXPECT_EQ(video.max_frames, 768);
  EXPECT_EQ(video.vision_segment_max_frames, 4);
  expect_error([&] { vision::load_image_processor_config(path("missing")); }, "not a directory");
}

TEST_F(VisionConfig, FilesInTransformersOrder) {
  write("preprocessor_config.json",
        R"({"image_processor_type": "MiniMaxM3VLImageProcessor", "size": {"shortest_edge": 1000,
            "longest_edge": 90000}, "max_pixels": 80000, "image_mean": [0.5, 0.5, 0.5], "image_std": 0.25,
            "resample": 3, "do_convert_rgb": true, "unknown_key": [1, 2]})");
  vision::ImageProcessorConfig image = vision::load_image_processor_config(dir_.string());
  EXPECT_NE(image.origin.find("preprocessor_config.json"), std::string::npos);
  EXPECT_EQ(image.pixels.min_pixels, 1000);
  EXPECT_EQ(image.pixels.max_pixels, 80000);  // max_pixels overrides size.longest_edge
  EXPECT_EQ(image.pixels.image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
  EXPECT_EQ(image.pixels.image_std, (std::array<double, 3>{0.25, 0.25, 0.25}));
  // Without a video config the video processor reads preprocessor_config.json (its
  // min_pixels / max_pixels only: size is the image processor's).
  vision::VideoProcessorConfig video = vision::load_video_processor_config(dir_.string());
  EXPECT_EQ(video.pixels.min_pixels, 3136);
  EXPECT_EQ(video.pixels.max_pixels, 80000);
  write("video_preprocessor_config.json",
        R"({"fps": 2, "min_frames": 2, "max_frames": 64, "vision_segment_max_frames": null, "max_pixels": 50176})");
  video = vision::load_video_processor_config(dir_.string());
  EXPECT_EQ(video.fps, 2.0);
  EXPECT_EQ(video.min_frames, 2);
  EXPECT_EQ(video.max_frames, 64);
  EXPECT_EQ(video.vision_segment_max_frames, 0);
  EXPECT_EQ(video.pixels.max_pixels, 50176);
  // processor_config.json's nested objects come first.
  write("processor_config.json", R"({"image_processor": {"min_pixels": 5000}, "video_processor": {"fps": 0.5}})");
  EXPECT_EQ(vision::load_image_processor_config(dir_.string()).pixels.min_pixels, 5000);
  EXPECT_EQ(vision::load_image_processor_config(dir_.string()).pixels.max_pixels, 451584);
  EXPECT_EQ(vision::load_video_processor_config(dir_.string()).fps, 0.5);
  // The released checkpoint's "size": [672, 672] means the defaults.
  image = vision::parse_image_processor_config(R"({"size": [672, 672]})", "legacy");
  EXPECT_EQ(image.pixels.min_pixels, 3136);
  EXPECT_EQ(image.pixels.max_pixels, 451584);
}

TEST_F(VisionConfig, BadValuesNameTheField) {
  const auto image_error = [](const std::string& text, const std::string& words) {
    expect_error([&] { vision::parse_image_processor_config(text, "cfg.json"); }, words);
  };
  image_error(R"({"patch_size": 0})", "cfg.json: field 'patch_size': expected an integer in [1, 1024], got number 0");
  image_error(R"({"merge_size": 2.5})", "field 'merge_size'");
  image_error(R"({"image_std": [0.2, 0, 0.2]})", "field 'image_std': expected positive numbers");
  image_error(R"({"image_mean": [0.2, 0.3]})", "field 'image_mean'");
  image_error(R"({"resample": 2})", "field 'resample': expected 3 (bicubic");
  image_error(R"({"do_resize": "yes"})", "field 'do_resize': expected true or false");
  image_error(R"({"rescale_factor": -1})", "field 'rescale_factor'");
  image_error(R"({"size": {"height": 672, "width": 672}})", "field 'size': expected shortest_edge and longest_edge");
  image_error(R"({"size": [10, 20]})", "field 'size'");
  image_error(R"([1, 2])", "expected a JSON object");
  image_error(R"({"a": )", "cfg.json: ");
  image_error(std::string(200, '[') + std::string(200, ']'), "nested deeper");
  const auto video_error = [](const std::string& text, const std::string& words) {
    expect_error([&] { vision::parse_video_processor_config(text, "v.json"); }, words);
  };
  video_error(R"({"fps": 0})", "field 'fps': expected a number in (0, 1000]");
  video_error(R"({"min_frames": 10, "max_frames": 5})", "expected min_frames <= max_frames");
  video_error(R"({"max_frames": -1})", "field 'max_frames'");
  write("preprocessor_config.json", "{\"patch_size\": true}");
  expect_error([&] { vision::load_image_processor_config(dir_.string()); }, "preprocessor_config.json': field 'patch_size'");
}

// ---------------------------------------------------------------------------------------
// Video: sampling, folders of frames, files

TEST(VisionVideo, FrameSampling) {
  using V = std::vector<int64_t>;
  // In range: transformers' default_sample_indices_fn (n = int(total / fps * target)).
  EXPECT_EQ(vision::sample_frame_indices(100, 10, 1, 0, 4, 768), (V{0, 10, 20, 30, 40, 50, 60, 70, 80, 90}));
  EXPECT_EQ(vision::sample_frame_indices(37, 2, 1, 0, 4, 768).size(), 18u);
  EXPECT_EQ(vision::sample_frame_indices(30, 4, 1, 0, 4, 768), (V{0, 4, 8, 12, 17, 21, 25}));
  // Clamped to min_frames, to max_frames and to the frames there are.
  EXPECT_EQ(vision::sample_frame_indices(30, 30, 1, 0, 4, 768), (V{0, 7, 15, 22}));
  EXPECT_EQ(vision::sample_frame_indices(3, 30, 1, 0, 4, 768), (V{0, 1, 2}));
  EXPECT_EQ(vision::sample_frame_indices(100000, 1, 1, 0, 4, 5), (V{0, 20000, 40000, 60000, 80000}));
  EXPECT_EQ(vision::sample_frame_indices(10, 1, 1e9, 0, 1, 768).size(), 10u);
  // num_frames replaces the rate.
  EXPECT_EQ(vision::sample_frame_indices(12, 30, 1, 6, 4, 768), (V{0, 2, 4, 6, 8, 10}));
  expect_error([] { vision::sample_frame_indices(0, 30, 1, 0, 4, 768); }, "total_frames");
  expect_error([] { vision::sample_frame_indices(10, 0, 1, 0, 4, 768); }, "source_fps");
  expect_error([] { vision::sample_frame_indices(10, 30, 1, 0, 5, 4); }, "min_frames <= max_frames");
}

class VisionVideoFolder : public TempDirTest {};

TEST_F(VisionVideoFolder, FramesInNaturalOrderSampledAtTheFolderRate) {
  // 12 frames at 4 fps named f1 .. f12 (f10 after f9), plus files that are not frames.
  for (int i = 1; i <= 12; ++i) {
    Rgb8Image frame{30, 20, std::vector<uint8_t>(30 * 20 * 3, static_cast<uint8_t>(i * 10))};
    write_file(path("f" + std::to_string(i) + ".png"), png_of_samples(30, 20, 3, frame.rgb));
  }
  write_file(path("notes.txt"), "not a frame");
  write_file(path(".hidden.png"), "not a frame either");
  vision::VideoProcessorConfig config;  // fps 1, at least 4 frames
  vision::VideoLoadOptions options;
  options.folder_fps = 4;
  options.resize_on_load = false;
  const vision::VideoFrames video = vision::load_video(dir_.string(), config, options);
  EXPECT_EQ(video.source_frames, 12);
  EXPECT_EQ(video.source_fps, 4.0);
  EXPECT_EQ(video.frame_indices, (std::vector<int64_t>{0, 3, 6, 9}));  // 3 at 1 fps, clamped to 4
  ASSERT_EQ(video.frames.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(video.frames[i].rgb[0], (video.frame_indices[i] + 1) * 10);
  EXPECT_EQ(video.frames[0].width, 30);
  const vision::PixelPatches patches = vision::preprocess_video(video, config);
  EXPECT_EQ(patches.timestamps, (std::vector<double>{0.0, 1.5}));
  // Stored at the processor's size as they load: the same patches.
  options.resize_on_load = true;
  const vision::VideoFrames resized = vision::load_video(dir_.string(), config, options);
  EXPECT_EQ(resized.frames[0].width, 84);  // smart_resize(20, 30): 56 x 84
  EXPECT_EQ(resized.frames[0].height, 56);
  EXPECT_EQ(resized.source_width, 30);
  EXPECT_TRUE(bitwise_equal(vision::preprocess_video(resized, config).pixel_values, patches.pixel_values));
  // Without folder_fps the folder holds frames already sampled: all are used.
  EXPECT_EQ(vision::load_video(dir_.string(), config).frames.size(), 12u);
  // The budget on stored frames is checked before decoding them all.
  options.max_stored_bytes = 84 * 56 * 3 * 3;
  expect_error([&] { vision::load_video(dir_.string(), config, options); }, "4 frames of 84x56 take more than");
}

TEST_F(VisionVideoFolder, BadFolders) {
  const vision::VideoProcessorConfig config;
  expect_error([&] { vision::load_video(dir_.string(), config); }, "no frames (expected .png, .jpg or .jpeg files)");
  write_file(path("readme.txt"), "text");
  expect_error([&] { vision::load_video(dir_.string(), config); }, "no frames");
  expect_error([&] { vision::load_video(path("absent"), config); }, "absent': no such file or folder");
  write_file(path("a1.png"), png_of_samples(4, 4, 3, std::vector<uint8_t>(48, 1)));
  write_file(path("a2.png"), png_of_samples(5, 4, 3, std::vector<uint8_t>(60, 1)));
  expect_error([&] { vision::load_video(dir_.string(), config); }, "frame 1 is 5x4, the first kept frame 4x4");
  write_file(path("a2.png"), "broken");
  expect_error([&] { vision::load_video(dir_.string(), config); }, "a2.png': not a PNG or JPEG image");
  vision::VideoLoadOptions options;
  options.sample_fps = -1;
  expect_error([&] { vision::load_video(dir_.string(), config, options); }, "argument 'sample_fps': expected >= 0");
}

class VisionVideoFile : public TempDirTest {};

#ifdef MSA_TEST_VIDEO_FILES
TEST_F(VisionVideoFile, LosslessFileSampledAtOneFps) {
  ASSERT_TRUE(vision::media_support().video_files);
  // 12 frames at 4 fps, frame i flat at 20 * i (+1 in green, +2 in blue).
  std::vector<Rgb8Image> frames;
  for (int i = 0; i < 12; ++i) {
    Rgb8Image frame{32, 24, std::vector<uint8_t>(32 * 24 * 3)};
    for (size_t k = 0; k < frame.rgb.size(); ++k) frame.rgb[k] = static_cast<uint8_t>(20 * i + k % 3);
    frames.push_back(frame);
  }
  write_video_file(path("clip.nut"), frames, 32, 24, 4, "rawvideo", "nut");
  vision::VideoLoadOptions options;
  options.resize_on_load = false;
  const vision::VideoFrames video = vision::load_video(path("clip.nut"), {}, options);
  EXPECT_EQ(video.source_frames, 12);
  EXPECT_DOUBLE_EQ(video.source_fps, 4.0);
  EXPECT_EQ(video.frame_indices, (std::vector<int64_t>{0, 3, 6, 9}));
  ASSERT_EQ(video.frames.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(video.frames[i].rgb, frames[static_cast<size_t>(video.frame_indices[i])].rgb);
  const vision::PixelPatches patches = vision::preprocess_video(video, {});
  EXPECT_EQ(patches.timestamps, (std::vector<double>{0.0, 1.5}));
  EXPECT_EQ(patches.grid_t, 2);
}

TEST_F(VisionVideoFile, LossyYuvFileKeepsItsColours) {
  std::vector<Rgb8Image> frames;
  for (int i = 0; i < 10; ++i) frames.push_back(Rgb8Image{64, 48, std::vector<uint8_t>(64 * 48 * 3, static_cast<uint8_t>(20 + 20 * i))});
  write_video_file(path("clip.mp4"), frames, 64, 48, 5, "mpeg4", "mp4");
  vision::VideoProcessorConfig config;
  config.fps = 2.5;  // 10 frames at 5 fps: 5 frames
  vision::VideoLoadOptions options;
  options.resize_on_load = false;
  const vision::VideoFrames video = vision::load_video(path("clip.mp4"), config, options);
  EXPECT_EQ(video.source_frames, 10);
  EXPECT_NEAR(video.source_fps, 5.0, 1e-9);
  EXPECT_EQ(video.frame_indices, (std::vector<int64_t>{0, 2, 4, 6, 8}));
  for (size_t i = 0; i < video.frames.size(); ++i)
    EXPECT_NEAR(video.frames[i].rgb[(24 * 64 + 32) * 3], 20 + 20 * video.frame_indices[i], 6) << i;
}

TEST_F(VisionVideoFile, EmptyTruncatedAndNonVideoFiles) {
  const vision::VideoProcessorConfig config;
  write_video_file(path("empty.avi"), {}, 32, 24, 4, "mpeg4", "avi");  // a stream without packets
  expect_error([&] { vision::load_video(path("empty.avi"), config); }, "empty.avi': the video has no frames");
  write_file(path("zero.mp4"), "");
  expect_error([&] { vision::load_video(path("zero.mp4"), config); }, "zero.mp4'");
  write_file(path("text.mp4"), std::string(2000, 'x'));
  expect_error([&] { vision::load_video(path("text.mp4"), config); }, "text.mp4'");
  std::vector<Rgb8Image> frames(6, Rgb8Image{32, 24, std::vector<uint8_t>(32 * 24 * 3, 90)});
  write_video_file(path("whole.mp4"), frames, 32, 24, 4, "mpeg4", "mp4");
  const std::string whole = read_bytes(path("whole.mp4"));
  for (const size_t cut : {size_t{16}, whole.size() / 3, whole.size() / 2, whole.size() - 9}) {
    write_file(path("cut.mp4"), whole.substr(0, cut));
    const std::string message = error_of([&] { vision::load_video(path("cut.mp4"), config); });
    if (message != "(no error)") EXPECT_NE(message.find("cut.mp4'"), std::string::npos) << message;
  }
}
#else
TEST_F(VisionVideoFile, WithoutFfmpegAVideoFileIsAClearError) {
  write_file(path("clip.mp4"), std::string(100, 'x'));
  expect_error([&] { vision::load_video(path("clip.mp4"), {}); }, "built without FFmpeg");
}
#endif

// ---------------------------------------------------------------------------------------
// msa preprocess

TEST(VisionCli, PreprocessWritesPatchesAndRefusesBadInput) {
  const std::filesystem::path dir = fresh_dir("vision_cli");
  const std::string image = (dir / "img.png").string();
  write_file(image, png_of_samples(50, 30, 3, pattern_image(50, 30).rgb));
  const std::string out = (dir / "out.safetensors").string();
  CliResult r = run_cli("preprocess --image " + shell_quote(image) + " --out " + shell_quote(out));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const SafetensorsFile file = SafetensorsFile::open(out);
  EXPECT_EQ(file.get("grid_thw").shape(), (Shape{1, 3}));
  const Tensor pixels = file.get("pixel_values");
  const vision::PixelPatches expected = vision::preprocess_image(vision::decode_image(image), {});
  EXPECT_TRUE(bitwise_equal(pixels, expected.pixel_values));
  EXPECT_EQ(file.get("resized").shape(), (Shape{1, 56, 84, 3}));

  r = run_cli("preprocess --image " + shell_quote((dir / "none.png").string()) + " --out " + shell_quote(out));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("msa preprocess: error: image '"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("none.png': cannot open"), std::string::npos) << r.out;
  r = run_cli("preprocess --image " + shell_quote(image) + " --out " + shell_quote(image));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--out"), std::string::npos) << r.out;
  r = run_cli("preprocess --image " + shell_quote(image) + " --video " + shell_quote(image) + " --out " + shell_quote(out));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("expected one of --image and --video"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace msa::testing
