// Test media made at test time: PNG and JPEG files written through libpng / libjpeg (every
// colour type, bit depth, transparency and colour space the decoder handles), and video
// files through FFmpeg's encoders. Used by test_vision_media.cpp and by the fuzz seeds
// (tests/fuzz/make_seeds.cpp). The inputs here are valid by construction; a writer that
// fails anyway throws std::runtime_error.
#pragma once
#include <stdio.h>  // jpeglib.h needs FILE declared first

#include <jpeglib.h>
#include <png.h>

#include <csetjmp>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace msa::testing {

// ---- PNG ----

struct PngSpec {
  uint32_t width = 1, height = 1;
  int color_type = PNG_COLOR_TYPE_RGB;  // PNG_COLOR_TYPE_GRAY, _GRAY_ALPHA, _PALETTE, _RGB, _RGB_ALPHA
  int bit_depth = 8;                    // 1, 2, 4, 8, 16 as the colour type allows
  bool interlaced = false;
  // Rows as stored: samples packed to bit_depth, 16-bit samples big-endian, each row
  // ceil(width * channels * bit_depth / 8) bytes.
  std::vector<uint8_t> rows;
  std::vector<png_color> palette;
  std::vector<uint8_t> palette_alpha;          // tRNS of a palette image
  std::optional<png_color_16> transparent;     // tRNS of a grey or RGB image
};

inline size_t png_row_bytes(const PngSpec& spec) {
  const int channels = spec.color_type == PNG_COLOR_TYPE_GRAY         ? 1
                       : spec.color_type == PNG_COLOR_TYPE_GRAY_ALPHA  ? 2
                       : spec.color_type == PNG_COLOR_TYPE_PALETTE     ? 1
                       : spec.color_type == PNG_COLOR_TYPE_RGB         ? 3
                                                                       : 4;
  return (static_cast<size_t>(spec.width) * channels * spec.bit_depth + 7) / 8;
}

inline std::string png_bytes(const PngSpec& spec) {
  struct Output {
    std::string bytes;
  } output;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) throw std::runtime_error("png_bytes: libpng could not start");
  const size_t row_bytes = png_row_bytes(spec);
  if (spec.rows.size() != row_bytes * spec.height) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("png_bytes: rows hold the wrong number of bytes");
  }
  std::vector<png_bytep> rows(spec.height);
  for (uint32_t y = 0; y < spec.height; ++y)
    rows[y] = const_cast<png_bytep>(spec.rows.data() + y * row_bytes);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("png_bytes: libpng failed");
  }
  png_set_write_fn(
      png, &output,
      [](png_structp p, png_bytep data, size_t size) {
        static_cast<Output*>(png_get_io_ptr(p))->bytes.append(reinterpret_cast<const char*>(data), size);
      },
      nullptr);
  png_set_IHDR(png, info, spec.width, spec.height, spec.bit_depth, spec.color_type,
               spec.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!spec.palette.empty())
    png_set_PLTE(png, info, spec.palette.data(), static_cast<int>(spec.palette.size()));
  if (!spec.palette_alpha.empty())
    png_set_tRNS(png, info, spec.palette_alpha.data(), static_cast<int>(spec.palette_alpha.size()), nullptr);
  if (spec.transparent) {
    png_color_16 color = *spec.transparent;
    png_set_tRNS(png, info, nullptr, 0, &color);
  }
  png_set_rows(png, info, rows.data());
  png_write_png(png, info, PNG_TRANSFORM_IDENTITY, nullptr);
  png_destroy_write_struct(&png, &info);
  return output.bytes;
}

// An 8-bit PNG of interleaved samples (1 to 4 channels: grey, grey + alpha, RGB, RGBA).
inline std::string png_of_samples(uint32_t width, uint32_t height, int channels,
                                  const std::vector<uint8_t>& samples) {
  PngSpec spec;
  spec.width = width;
  spec.height = height;
  spec.color_type = channels == 1   ? PNG_COLOR_TYPE_GRAY
                    : channels == 2 ? PNG_COLOR_TYPE_GRAY_ALPHA
                    : channels == 3 ? PNG_COLOR_TYPE_RGB
                                    : PNG_COLOR_TYPE_RGB_ALPHA;
  spec.rows = samples;
  return png_bytes(spec);
}

// ---- JPEG ----

struct JpegSpec {
  int width = 1, height = 1;
  int components = 3;                       // of `samples`: 1 grey, 3 RGB, 4 CMYK
  J_COLOR_SPACE input_space = JCS_RGB;      // JCS_GRAYSCALE, JCS_RGB, JCS_CMYK
  std::optional<J_COLOR_SPACE> file_space;  // e.g. JCS_YCCK for CMYK input; default libjpeg's
  int quality = 95;
  bool progressive = false;
  bool full_chroma = true;                  // no chroma subsampling
  std::vector<uint8_t> samples;             // interleaved, rows top to bottom
};

inline std::string jpeg_bytes(const JpegSpec& spec) {
  struct Errors {
    jpeg_error_mgr base;
    jmp_buf jump;
  } errors;
  jpeg_compress_struct cinfo;
  cinfo.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = [](j_common_ptr c) { std::longjmp(reinterpret_cast<Errors*>(c->err)->jump, 1); };
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  if (setjmp(errors.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(buffer);
    throw std::runtime_error("jpeg_bytes: libjpeg failed");
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = static_cast<JDIMENSION>(spec.width);
  cinfo.image_height = static_cast<JDIMENSION>(spec.height);
  cinfo.input_components = spec.components;
  cinfo.in_color_space = spec.input_space;
  jpeg_set_defaults(&cinfo);
  if (spec.file_space) jpeg_set_colorspace(&cinfo, *spec.file_space);
  jpeg_set_quality(&cinfo, spec.quality, TRUE);
  if (spec.full_chroma)
    for (int c = 0; c < cinfo.num_components; ++c)
      cinfo.comp_info[c].h_samp_factor = cinfo.comp_info[c].v_samp_factor = 1;
  if (spec.progressive) jpeg_simple_progression(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(spec.samples.data() +
                                        static_cast<size_t>(cinfo.next_scanline) * spec.width * spec.components);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string bytes(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  return bytes;
}

}  // namespace msa::testing
