// The resize definition of resize.h as plain loops: every output sample derives its own
// window and weights from the formulas; no tables, no threads. The tests compare
// resize_bicubic_antialias with it bit for bit.
#include <algorithm>
#include <cmath>

#include "vision/resize.h"

namespace msa::vision::detail {
namespace {

// The f64 weights of output sample i of an axis in_size -> out_size, and its window.
struct Window {
  int64_t first = 0;
  std::vector<double> weights;
};

Window window_of(int64_t i, int64_t in_size, int64_t out_size) {
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
  const int64_t max_count = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  const double center = scale * (static_cast<double>(i) + 0.5);
  Window window;
  window.first = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size);
  const int64_t count = std::clamp<int64_t>(end - window.first, 0, max_count);
  double total = 0;
  for (int64_t j = 0; j < count; ++j) {
    const double distance = static_cast<double>(window.first + j) - center + 0.5;
    const double w = bicubic_kernel(scale >= 1.0 ? distance * (1.0 / scale) : distance);
    window.weights.push_back(w);
    total += w;
  }
  if (total != 0)
    for (double& w : window.weights) w /= total;
  return window;
}

// The axis's fixed-point precision: the most fraction bits (up to 22) for which twice the
// largest weight of any output sample, rounded, stays below 2^15.
int precision_of(int64_t in_size, int64_t out_size) {
  double largest = 0;
  for (int64_t i = 0; i < out_size; ++i)
    for (double w : window_of(i, in_size, out_size).weights) largest = std::max(largest, w);
  int bits = 0;
  while (bits < 22 && static_cast<int>(0.5 + largest * std::ldexp(1.0, bits + 1)) < 32768) ++bits;
  return bits;
}

int32_t fixed_point(double weight, int bits) {
  const double scaled = weight * std::ldexp(1.0, bits);
  return scaled < 0 ? static_cast<int32_t>(scaled - 0.5) : static_cast<int32_t>(scaled + 0.5);
}

// One pass along x (horizontal) or y: every output sample is the rounded, clamped
// fixed-point sum over its window.
Rgb8Image resize_axis(const Rgb8Image& in, int64_t out_size, bool horizontal) {
  const int64_t in_size = horizontal ? in.width : in.height;
  const int bits = precision_of(in_size, out_size);
  Rgb8Image out;
  out.width = horizontal ? out_size : in.width;
  out.height = horizontal ? in.height : out_size;
  out.rgb.assign(static_cast<size_t>(out.width * out.height * 3), 0);
  for (int64_t y = 0; y < out.height; ++y) {
    for (int64_t x = 0; x < out.width; ++x) {
      const Window window = window_of(horizontal ? x : y, in_size, out_size);
      for (int64_t c = 0; c < 3; ++c) {
        int64_t sum = int64_t{1} << (bits - 1);
        for (size_t j = 0; j < window.weights.size(); ++j) {
          const int64_t source = window.first + static_cast<int64_t>(j);
          const int64_t sx = horizontal ? source : x;
          const int64_t sy = horizontal ? y : source;
          sum += int64_t{in.rgb[static_cast<size_t>((sy * in.width + sx) * 3 + c)]} *
                 fixed_point(window.weights[j], bits);
        }
        // (an arithmetic shift: floor for negative sums, as PyTorch's int arithmetic)
        out.rgb[static_cast<size_t>((y * out.width + x) * 3 + c)] =
            static_cast<uint8_t>(std::clamp<int64_t>(sum >> bits, 0, 255));
      }
    }
  }
  return out;
}

}  // namespace

Rgb8Image resize_bicubic_antialias_reference(const Rgb8Image& image, int64_t height, int64_t width) {
  Rgb8Image out = image;
  if (width != image.width) out = resize_axis(out, width, /*horizontal=*/true);
  if (height != image.height) out = resize_axis(out, height, /*horizontal=*/false);
  return out;
}

}  // namespace msa::vision::detail
