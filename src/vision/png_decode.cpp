// PNG through libpng. libpng reports errors by calling an error function that must not
// return; ours records the message and longjmps back to the setjmp of the reading function
// that is running. Only the two small functions below call setjmp, and nothing with a
// destructor lives in their frames (a longjmp over a C++ destructor is undefined): buffers
// are owned by their caller, which runs no libpng code itself.
#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "vision/codecs.h"

namespace msa::vision::detail {
namespace {

struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t offset = 0;
  char message[256] = {};
  char warning[256] = {};  // the latest warning: libpng's errors often only sum them up
};

void on_png_error(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->message, sizeof reader->message, "%s", message ? message : "unknown error");
  png_longjmp(png, 1);
}

// Warnings (an ancillary chunk with a bad CRC, a known-incorrect sRGB profile) leave the
// pixels intact; libpng has already decided they are not errors. The latest is kept for
// the message of an error that follows ("Invalid IHDR data" says no more than that).
void on_png_warning(png_structp png, png_const_charp message) {
  auto* reader = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(reader->warning, sizeof reader->warning, "%s", message ? message : "");
}

std::string libpng_says(const PngReader& reader) {
  std::string text = "libpng: " + std::string(reader.message);
  if (reader.warning[0]) text += "; after the warning: " + std::string(reader.warning);
  return text;
}

void read_png_bytes(png_structp png, png_bytep out, size_t count) {
  auto* reader = static_cast<PngReader*>(png_get_io_ptr(png));
  if (count > reader->size - reader->offset) png_error(png, "the file ends early (truncated)");
  std::memcpy(out, reader->data + reader->offset, count);
  reader->offset += count;
}

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int channels = 0;
  size_t row_bytes = 0;
};

// Reads the chunks up to the image data and sets the transformations: palette to RGB, grey
// below 8 bits to 8 (scaled: 1-bit 1 -> 255), tRNS to an alpha channel (which
// image_decode.cpp then drops, as PIL's convert("RGB") ignores transparency), 16-bit samples
// to their high byte (PIL's RGB;16B, LA;16B and RGBA;16B unpacking), interlacing undone.
// False on a libpng error (message in reader.message).
bool read_png_header(PngReader& reader, PngHeader& header, png_uint_32 max_side) {
  if (setjmp(png_jmpbuf(reader.png))) return false;
  png_set_read_fn(reader.png, &reader, read_png_bytes);
  png_set_user_limits(reader.png, max_side, max_side);
  png_read_info(reader.png, reader.info);
  png_set_expand(reader.png);
  png_set_strip_16(reader.png);
  png_set_interlace_handling(reader.png);
  png_read_update_info(reader.png, reader.info);
  header.width = png_get_image_width(reader.png, reader.info);
  header.height = png_get_image_height(reader.png, reader.info);
  header.channels = png_get_channels(reader.png, reader.info);
  header.row_bytes = png_get_rowbytes(reader.png, reader.info);
  return true;
}

// Decodes every row into `rows` and reads the chunks after the image data (their CRCs and
// the end of the file are checked too).
bool read_png_rows(PngReader& reader, png_bytepp rows) {
  if (setjmp(png_jmpbuf(reader.png))) return false;
  png_read_image(reader.png, rows);
  png_read_end(reader.png, nullptr);
  return true;
}

struct PngReaderCleanup {
  PngReader& reader;
  ~PngReaderCleanup() {
    if (reader.png) png_destroy_read_struct(&reader.png, reader.info ? &reader.info : nullptr, nullptr);
  }
};

}  // namespace

DecodedSamples decode_png(const uint8_t* data, size_t size, const std::string& name,
                          const DecodeLimits& limits) {
  PngReader reader;
  reader.data = data;
  reader.size = size;
  PngReaderCleanup cleanup{reader};
  reader.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, on_png_error, on_png_warning);
  if (!reader.png) throw Error(name + ": libpng could not start (out of memory)");
  reader.info = png_create_info_struct(reader.png);
  if (!reader.info) throw Error(name + ": libpng could not start (out of memory)");

  // The size, straight from the IHDR chunk (which must come first), is checked before libpng
  // runs, so that an image beyond the limits gets the same message whichever limit it breaks.
  if (size >= 24 && std::memcmp(data + 12, "IHDR", 4) == 0) {
    const auto be32 = [&](size_t at) {
      return int64_t{data[at]} << 24 | int64_t{data[at + 1]} << 16 | int64_t{data[at + 2]} << 8 | data[at + 3];
    };
    if (be32(16) > 0 && be32(20) > 0) check_image_size(be32(16), be32(20), name, limits);
  }
  const auto max_side = static_cast<png_uint_32>(
      std::clamp<int64_t>(limits.max_side, 1, PNG_UINT_31_MAX));
  PngHeader header;
  if (!read_png_header(reader, header, max_side))
    throw Error(name + ": not a readable PNG image (" + libpng_says(reader) + ")");
  check_image_size(header.width, header.height, name, limits);

  DecodedSamples out;
  out.width = header.width;
  out.height = header.height;
  switch (header.channels) {
    case 1: out.layout = SampleLayout::grey; break;
    case 2: out.layout = SampleLayout::grey_alpha; break;
    case 3: out.layout = SampleLayout::rgb; break;
    case 4: out.layout = SampleLayout::rgba; break;
    default:
      throw Error(name + ": PNG with " + std::to_string(header.channels) +
                  " channels after expansion (expected 1 to 4)");
  }
  const size_t row_bytes = static_cast<size_t>(out.width) * static_cast<size_t>(header.channels);
  if (header.row_bytes != row_bytes)
    throw Error(name + ": PNG rows of " + std::to_string(header.row_bytes) +
                " bytes after the 8-bit expansion (expected " + std::to_string(row_bytes) + ")");
  out.samples.resize(row_bytes * static_cast<size_t>(out.height));
  std::vector<png_bytep> rows(static_cast<size_t>(out.height));
  for (size_t y = 0; y < rows.size(); ++y) rows[y] = out.samples.data() + y * row_bytes;
  if (!read_png_rows(reader, rows.data()))
    throw Error(name + ": corrupt or truncated PNG image data (" + libpng_says(reader) + ")");
  return out;
}

}  // namespace msa::vision::detail
