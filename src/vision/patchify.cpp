// smart_resize, preprocess_image, preprocess_video: resized frames -> normalised pixel
// patches in the vision tower's order (include/msa/vision_media.h, docs/vision.md).
#include <array>
#include <cmath>

#include "msa/vision_media.h"

namespace msa::vision {
namespace {

void check_image(const Rgb8Image& image, const std::string& what) {
  MSA_CHECK_ARG(image.width > 0 && image.height > 0, what, "an image of at least 1x1 pixels",
                std::to_string(image.width) + "x" + std::to_string(image.height));
  MSA_CHECK_ARG(image.width <= (int64_t{1} << 24) && image.height <= (int64_t{1} << 24) &&
                    image.rgb.size() == static_cast<size_t>(image.width * image.height * 3),
                what, "width * height * 3 bytes of RGB (sides up to 2^24)",
                std::to_string(image.rgb.size()) + " bytes for " + std::to_string(image.width) +
                    "x" + std::to_string(image.height));
}

void check_settings(const PixelSettings& p, const std::string& origin) {
  const auto fail = [&](const std::string& what) { throw Error(origin + ": " + what); };
  if (p.patch_size < 1 || p.merge_size < 1 || p.temporal_patch_size < 1 || p.patch_size > 1024 ||
      p.merge_size > 64 || p.temporal_patch_size > 64)
    fail("patch_size in [1, 1024], merge_size and temporal_patch_size in [1, 64] expected");
  if (p.min_pixels < 1 || p.max_pixels < 1 || p.min_pixels > (int64_t{1} << 32) ||
      p.max_pixels > (int64_t{1} << 32))
    fail("min_pixels and max_pixels in [1, 2^32] expected");
  for (int c = 0; c < 3; ++c)
    if (!(p.image_std[c] > 0) || !std::isfinite(p.image_mean[c]) || !std::isfinite(p.image_std[c]))
      fail("finite image_mean and positive finite image_std expected");
  if (!(p.rescale_factor > 0) || !std::isfinite(p.rescale_factor)) fail("a positive rescale_factor expected");
}

// The f32 value of each uint8 sample per channel, computed as transformers' torchvision
// backend does: with rescale and normalise fused (rescale_and_normalize), mean and std are
// f32 tensors times 1 / rescale_factor (the scalar taken as f32), then (x - mean) / std in
// f32; normalise alone uses mean and std as they are; rescale alone is x * rescale_factor.
using ChannelTables = std::array<std::array<float, 256>, 3>;
ChannelTables value_tables(const PixelSettings& p) {
  ChannelTables tables{};
  for (int c = 0; c < 3; ++c) {
    float mean = static_cast<float>(p.image_mean[c]);
    float std_dev = static_cast<float>(p.image_std[c]);
    if (p.do_rescale && p.do_normalize) {
      const float inverse = static_cast<float>(1.0 / p.rescale_factor);
      mean = mean * inverse;
      std_dev = std_dev * inverse;
    }
    for (int v = 0; v < 256; ++v) {
      const float x = static_cast<float>(v);
      if (p.do_normalize) {
        const float centred = x - mean;  // two statements: no contraction into one rounding
        tables[c][v] = centred / std_dev;
      } else if (p.do_rescale) {
        tables[c][v] = x * static_cast<float>(p.rescale_factor);
      } else {
        tables[c][v] = x;
      }
    }
  }
  return tables;
}

// frames[i] (all width x height) as grid_t = ceil(n / T) temporal patches, the last frame
// repeated to fill the last one.
Tensor patchify(const std::vector<Rgb8Image>& frames, const PixelSettings& p, int64_t grid_t) {
  const int64_t ps = p.patch_size, m = p.merge_size, tp = p.temporal_patch_size;
  const int64_t width = frames.front().width, height = frames.front().height;
  const int64_t grid_h = height / ps, grid_w = width / ps;
  const int64_t windows_w = grid_w / m;
  const int64_t rows = grid_t * grid_h * grid_w;
  const int64_t cols = p.patch_values();
  Tensor out = Tensor::zeros({rows, cols}, DType::f32);
  float* dst = out.data<float>();
  const ChannelTables tables = value_tables(p);
  const int64_t last = static_cast<int64_t>(frames.size()) - 1;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    // row = ((t * windows_h + hb) * windows_w + wb) * m * m + mh * m + mw
    const int64_t mw = row % m, mh = row / m % m;
    const int64_t window = row / (m * m);
    const int64_t wb = window % windows_w;
    const int64_t hb = window / windows_w % (grid_h / m);
    const int64_t t = window / windows_w / (grid_h / m);
    const int64_t y0 = (hb * m + mh) * ps, x0 = (wb * m + mw) * ps;
    float* v = dst + row * cols;
    for (int64_t c = 0; c < 3; ++c) {
      const std::array<float, 256>& table = tables[static_cast<size_t>(c)];
      for (int64_t f = 0; f < tp; ++f) {
        const Rgb8Image& frame = frames[static_cast<size_t>(std::min(t * tp + f, last))];
        for (int64_t py = 0; py < ps; ++py) {
          const uint8_t* src = frame.rgb.data() + ((y0 + py) * width + x0) * 3 + c;
          for (int64_t px = 0; px < ps; ++px) *v++ = table[src[3 * px]];
        }
      }
    }
  }
  return out;
}

// The size frames of height x width are resized to (or kept at, without do_resize).
std::pair<int64_t, int64_t> target_size(int64_t height, int64_t width, const PixelSettings& p,
                                        const std::string& what) {
  if (p.do_resize) return smart_resize(height, width, p.factor(), p.min_pixels, p.max_pixels);
  if (height % p.factor() != 0 || width % p.factor() != 0)
    throw Error(what + ": without do_resize the size must be a multiple of patch_size * merge_size = " +
                std::to_string(p.factor()) + ", got " + std::to_string(width) + "x" +
                std::to_string(height));
  return {height, width};
}

}  // namespace

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor,
                                         int64_t min_pixels, int64_t max_pixels) {
  MSA_CHECK_ARG(height >= 1 && width >= 1 && height <= (int64_t{1} << 24) && width <= (int64_t{1} << 24),
                "smart_resize size", "sides in [1, 2^24]",
                std::to_string(width) + "x" + std::to_string(height));
  MSA_CHECK_ARG(factor >= 1 && factor <= (1 << 16), "smart_resize factor", "[1, 65536]", factor);
  const double ratio = static_cast<double>(std::max(height, width)) /
                       static_cast<double>(std::min(height, width));
  if (ratio > 200)
    throw Error("image of " + std::to_string(width) + "x" + std::to_string(height) +
                ": expected an aspect ratio of at most 200 (transformers' smart_resize), got " +
                msa::detail::concat(ratio));
  const double f = static_cast<double>(factor);
  const double h = static_cast<double>(height), w = static_cast<double>(width);
  // Python's round() of a float rounds half to even, as nearbyint in the default mode.
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height * width) / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / static_cast<double>(height * width));
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return {h_bar, w_bar};
}

PixelPatches preprocess_image(const Rgb8Image& image, const ImageProcessorConfig& config) {
  check_image(image, "preprocess_image image");
  const PixelSettings& p = config.pixels;
  check_settings(p, config.origin);
  const auto [height, width] = target_size(image.height, image.width, p, "preprocess_image image");
  PixelPatches out;
  out.resized.push_back(resize_bicubic_antialias(image, height, width));
  out.grid_t = 1;
  out.grid_h = height / p.patch_size;
  out.grid_w = width / p.patch_size;
  // One frame stands for all temporal_patch_size frames of the patch.
  out.pixel_values = patchify(out.resized, p, 1);
  return out;
}

PixelPatches preprocess_video(const VideoFrames& video, const VideoProcessorConfig& config) {
  const std::string what = "video " + (video.origin.empty() ? std::string("frames") : video.origin);
  if (video.frames.empty()) throw Error(what + ": no frames");
  const PixelSettings& p = config.pixels;
  check_settings(p, config.origin);
  const int64_t source_h = video.source_height > 0 ? video.source_height : video.frames[0].height;
  const int64_t source_w = video.source_width > 0 ? video.source_width : video.frames[0].width;
  const auto [height, width] = target_size(source_h, source_w, p, what);
  PixelPatches out;
  out.resized.reserve(video.frames.size());
  for (size_t i = 0; i < video.frames.size(); ++i) {
    const Rgb8Image& frame = video.frames[i];
    check_image(frame, what + " frame " + std::to_string(i));
    // Frames come at the source size, or already at the target (VideoLoadOptions::resize_on_load).
    if (frame.height == height && frame.width == width) {
      out.resized.push_back(frame);
    } else if (frame.height == source_h && frame.width == source_w) {
      out.resized.push_back(resize_bicubic_antialias(frame, height, width));
    } else {
      throw Error(what + ": frame " + std::to_string(i) + " is " + std::to_string(frame.width) +
                  "x" + std::to_string(frame.height) + " (expected the source's " +
                  std::to_string(source_w) + "x" + std::to_string(source_h) + " or the resized " +
                  std::to_string(width) + "x" + std::to_string(height) + ")");
    }
  }
  const int64_t frames = static_cast<int64_t>(out.resized.size());
  out.grid_t = (frames + p.temporal_patch_size - 1) / p.temporal_patch_size;
  out.grid_h = height / p.patch_size;
  out.grid_w = width / p.patch_size;
  out.pixel_values = patchify(out.resized, p, out.grid_t);
  if (video.source_fps > 0 && video.frame_indices.size() == video.frames.size()) {
    for (int64_t t = 0; t < out.grid_t; ++t) {
      const int64_t first = std::min(t * p.temporal_patch_size, frames - 1);
      out.timestamps.push_back(static_cast<double>(video.frame_indices[static_cast<size_t>(first)]) /
                               video.source_fps);
    }
  }
  return out;
}

std::vector<std::array<int64_t, 3>> video_segments(int64_t grid_t, int64_t grid_h, int64_t grid_w,
                                                   int64_t max_temporal_patches) {
  MSA_CHECK_ARG(grid_t >= 1 && grid_h >= 1 && grid_w >= 1, "video_segments grid",
                "positive t, h, w", std::to_string(grid_t) + ", " + std::to_string(grid_h) + ", " +
                                        std::to_string(grid_w));
  MSA_CHECK_ARG(max_temporal_patches >= 0, "video_segments max_temporal_patches", ">= 0",
                max_temporal_patches);
  const int64_t step = max_temporal_patches == 0 ? grid_t : max_temporal_patches;
  std::vector<std::array<int64_t, 3>> segments;
  for (int64_t start = 0; start < grid_t; start += step)
    segments.push_back({std::min(step, grid_t - start), grid_h, grid_w});
  return segments;
}

}  // namespace msa::vision
