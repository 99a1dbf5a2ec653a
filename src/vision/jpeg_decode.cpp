// JPEG through libjpeg(-turbo). Its default error handler prints and calls exit(); ours
// records the message and longjmps back to the setjmp of the reading function that is
// running. As in png_decode.cpp only the two small functions below call setjmp, and nothing
// with a destructor lives in their frames; buffers belong to their caller.
#include <stdio.h>  // jpeglib.h needs FILE and size_t declared first

#include <jerror.h>
#include <jpeglib.h>

#include <algorithm>
#include <csetjmp>
#include <cstring>

#include "vision/codecs.h"

namespace msa::vision::detail {
namespace {

// A progressive JPEG may hold any number of scans, each a pass over the whole image: a
// small file can cost minutes. Real encoders write about ten; libjpeg-turbo's own tools
// suggest a limit of 500.
constexpr int kMaxScans = 500;

struct JpegErrorManager {
  jpeg_error_mgr base;  // first: libjpeg sees a jpeg_error_mgr*
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
};

[[noreturn]] void on_jpeg_error(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

// libjpeg warns (level -1) and carries on where data is lost: a file that ends early is
// padded with grey, corrupt entropy-coded data is skipped. Those are errors here, as in
// PIL, which refuses truncated JPEGs. Warnings that lose no pixels pass.
void on_jpeg_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  switch (cinfo->err->msg_code) {
    case JWRN_ADOBE_XFORM:            // an unknown Adobe transform code (libjpeg guesses)
    case JWRN_JFIF_MAJOR:             // a newer JFIF version
    case JWRN_BOGUS_ICC:              // a malformed ICC chunk (ignored anyway)
    case JWRN_EXTRANEOUS_DATA:        // stray bytes between markers
      return;
    default:
      on_jpeg_error(cinfo);
  }
}

void on_jpeg_progress(j_common_ptr cinfo) {
  if (cinfo->is_decompressor &&
      reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number > kMaxScans) {
    auto* errors = reinterpret_cast<JpegErrorManager*>(cinfo->err);
    std::snprintf(errors->message, sizeof errors->message,
                  "more than %d progressive scans", kMaxScans);
    std::longjmp(errors->jump, 1);
  }
}

// Reads the header and chooses the output colour space: grey stays grey, CMYK and YCCK
// become CMYK (libjpeg undoes YCCK's colour transform), everything else RGB.
bool read_jpeg_header(jpeg_decompress_struct& cinfo, JpegErrorManager& errors,
                      const uint8_t* data, size_t size) {
  if (setjmp(errors.jump)) return false;
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_GRAYSCALE) {
    cinfo.out_color_space = JCS_GRAYSCALE;
  } else if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    cinfo.out_color_space = JCS_CMYK;
  } else {
    cinfo.out_color_space = JCS_RGB;
  }
  jpeg_calc_output_dimensions(&cinfo);
  return true;
}

// Decodes every scanline into rows[0 .. output_height) and reads to the end of the image.
bool read_jpeg_rows(jpeg_decompress_struct& cinfo, JpegErrorManager& errors, JSAMPROW* rows) {
  if (setjmp(errors.jump)) return false;
  jpeg_start_decompress(&cinfo);
  while (cinfo.output_scanline < cinfo.output_height) {
    if (jpeg_read_scanlines(&cinfo, rows + cinfo.output_scanline,
                            cinfo.output_height - cinfo.output_scanline) == 0)
      ERREXIT(&cinfo, JERR_INPUT_EOF);
  }
  jpeg_finish_decompress(&cinfo);
  return true;
}

struct JpegCleanup {
  jpeg_decompress_struct& cinfo;
  ~JpegCleanup() { jpeg_destroy_decompress(&cinfo); }
};

}  // namespace

DecodedSamples decode_jpeg(const uint8_t* data, size_t size, const std::string& name,
                           const DecodeLimits& limits) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);
  JpegErrorManager errors;
  cinfo.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = on_jpeg_error;
  errors.base.emit_message = on_jpeg_message;
  jpeg_progress_mgr progress{};
  progress.progress_monitor = on_jpeg_progress;
  // jpeg_destroy_decompress on a struct that jpeg_create_decompress never reached (mem is
  // null) does nothing, so the cleanup can be armed now.
  JpegCleanup cleanup{cinfo};
  if (!read_jpeg_header(cinfo, errors, data, size))
    throw Error(name + ": not a readable JPEG image (libjpeg: " + errors.message + ")");
  cinfo.progress = &progress;
  check_image_size(cinfo.image_width, cinfo.image_height, name, limits);
  // libjpeg's own working memory (a progressive image's coefficients: 2 bytes a sample)
  // stays within the pixel limit's budget too.
  cinfo.mem->max_memory_to_use = static_cast<long>(std::min<int64_t>(
      limits.max_pixels * 4 * 2 + (int64_t{64} << 20), int64_t{1} << 40));

  DecodedSamples out;
  out.width = cinfo.output_width;
  out.height = cinfo.output_height;
  const int components = cinfo.output_components;
  out.layout = cinfo.out_color_space == JCS_GRAYSCALE ? SampleLayout::grey
               : cinfo.out_color_space == JCS_CMYK    ? SampleLayout::cmyk_adobe
                                                      : SampleLayout::rgb;
  if (out.width != cinfo.image_width || out.height != cinfo.image_height ||
      components != samples_per_pixel(out.layout))
    throw Error(name + ": libjpeg would decode " + std::to_string(out.width) + "x" +
                std::to_string(out.height) + " with " + std::to_string(components) +
                " components, not the header's " + std::to_string(cinfo.image_width) + "x" +
                std::to_string(cinfo.image_height));
  const size_t row_bytes = static_cast<size_t>(out.width) * static_cast<size_t>(components);
  out.samples.resize(row_bytes * static_cast<size_t>(out.height));
  std::vector<JSAMPROW> rows(static_cast<size_t>(out.height));
  for (size_t y = 0; y < rows.size(); ++y) rows[y] = out.samples.data() + y * row_bytes;
  if (!read_jpeg_rows(cinfo, errors, rows.data()))
    throw Error(name + ": corrupt or truncated JPEG image data (libjpeg: " + errors.message + ")");
  return out;
}

}  // namespace msa::vision::detail
