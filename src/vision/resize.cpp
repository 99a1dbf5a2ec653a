// resize_bicubic_antialias: the definition of resize.h with per-axis weight tables.
#include "vision/resize.h"

#include <algorithm>
#include <cmath>

namespace msa::vision {
namespace detail {

double bicubic_kernel(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

AxisFilter make_axis_filter(int64_t in_size, int64_t out_size) {
  AxisFilter filter;
  filter.in_size = in_size;
  filter.out_size = out_size;
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
  const double inverse_scale = scale >= 1.0 ? 1.0 / scale : 1.0;
  filter.taps = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  filter.first.resize(static_cast<size_t>(out_size));
  filter.count.resize(static_cast<size_t>(out_size));
  std::vector<double> weights(static_cast<size_t>(out_size * filter.taps), 0.0);
  double largest = 0.0;
  for (int64_t i = 0; i < out_size; ++i) {
    const double center = scale * (static_cast<double>(i) + 0.5);
    const int64_t first = std::max(static_cast<int64_t>(center - support + 0.5), int64_t{0});
    const int64_t count = std::clamp(
        std::min(static_cast<int64_t>(center + support + 0.5), in_size) - first, int64_t{0},
        filter.taps);
    double* w = weights.data() + i * filter.taps;
    double total = 0.0;
    for (int64_t j = 0; j < count; ++j) {
      w[j] = bicubic_kernel((static_cast<double>(j + first) - center + 0.5) * inverse_scale);
      total += w[j];
    }
    if (total != 0.0) {
      for (int64_t j = 0; j < count; ++j) {
        w[j] /= total;
        largest = std::max(largest, w[j]);
      }
    }
    filter.first[static_cast<size_t>(i)] = first;
    filter.count[static_cast<size_t>(i)] = count;
  }
  int precision = 0;
  while (precision < 22 &&
         static_cast<int>(0.5 + largest * static_cast<double>(1 << (precision + 1))) < (1 << 15))
    ++precision;
  filter.precision = precision;
  filter.weights.resize(weights.size());
  for (size_t k = 0; k < weights.size(); ++k) {
    const double v = weights[k] * static_cast<double>(1 << precision);
    filter.weights[k] = static_cast<int16_t>(v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v));
  }
  return filter;
}

namespace {

inline uint8_t clamp_to_u8(int32_t value) {
  return static_cast<uint8_t>(std::clamp(value, 0, 255));
}

// Rows keep their count; each output sample of a row reads `count` neighbours of its row.
Rgb8Image resize_horizontal(const Rgb8Image& in, const AxisFilter& filter) {
  Rgb8Image out;
  out.height = in.height;
  out.width = filter.out_size;
  out.rgb.resize(static_cast<size_t>(out.width * out.height * 3));
  const int32_t bias = int32_t{1} << (filter.precision - 1);
  const int shift = filter.precision;
#pragma omp parallel for schedule(static)
  for (int64_t y = 0; y < in.height; ++y) {
    const uint8_t* row = in.rgb.data() + y * in.width * 3;
    uint8_t* dst = out.rgb.data() + y * out.width * 3;
    for (int64_t x = 0; x < out.width; ++x) {
      const uint8_t* src = row + filter.first[static_cast<size_t>(x)] * 3;
      const int16_t* w = filter.weights.data() + x * filter.taps;
      int32_t r = bias, g = bias, b = bias;
      for (int64_t j = 0, n = filter.count[static_cast<size_t>(x)]; j < n; ++j) {
        r += src[3 * j] * w[j];
        g += src[3 * j + 1] * w[j];
        b += src[3 * j + 2] * w[j];
      }
      dst[3 * x] = clamp_to_u8(r >> shift);
      dst[3 * x + 1] = clamp_to_u8(g >> shift);
      dst[3 * x + 2] = clamp_to_u8(b >> shift);
    }
  }
  return out;
}

// Each output row is a weighted sum of `count` whole input rows: one contiguous multiply-add
// over width * 3 samples per input row.
Rgb8Image resize_vertical(const Rgb8Image& in, const AxisFilter& filter) {
  Rgb8Image out;
  out.width = in.width;
  out.height = filter.out_size;
  const int64_t row_samples = in.width * 3;
  out.rgb.resize(static_cast<size_t>(row_samples * out.height));
  const int32_t bias = int32_t{1} << (filter.precision - 1);
  const int shift = filter.precision;
#pragma omp parallel
  {
    std::vector<int32_t> sums(static_cast<size_t>(row_samples));
#pragma omp for schedule(static)
    for (int64_t y = 0; y < out.height; ++y) {
      std::fill(sums.begin(), sums.end(), bias);
      const int16_t* w = filter.weights.data() + y * filter.taps;
      const int64_t first = filter.first[static_cast<size_t>(y)];
      for (int64_t j = 0, n = filter.count[static_cast<size_t>(y)]; j < n; ++j) {
        const uint8_t* src = in.rgb.data() + (first + j) * row_samples;
        const int32_t weight = w[j];
        int32_t* __restrict acc = sums.data();
        for (int64_t k = 0; k < row_samples; ++k) acc[k] += src[k] * weight;
      }
      uint8_t* dst = out.rgb.data() + y * row_samples;
      for (int64_t k = 0; k < row_samples; ++k) dst[k] = clamp_to_u8(sums[static_cast<size_t>(k)] >> shift);
    }
  }
  return out;
}

}  // namespace
}  // namespace detail

namespace {
void check_resize_arguments(const Rgb8Image& image, int64_t height, int64_t width,
                            const char* who) {
  MSA_CHECK_ARG(image.width > 0 && image.height > 0, std::string(who) + " image",
                "a non-empty image", std::to_string(image.width) + "x" + std::to_string(image.height));
  MSA_CHECK_ARG(image.rgb.size() == static_cast<size_t>(image.width * image.height * 3),
                std::string(who) + " image", "width * height * 3 bytes", image.rgb.size());
  MSA_CHECK_ARG(height > 0 && width > 0 && height <= (int64_t{1} << 24) && width <= (int64_t{1} << 24),
                std::string(who) + " size", "sides in [1, 2^24]",
                std::to_string(width) + "x" + std::to_string(height));
}
}  // namespace

Rgb8Image resize_bicubic_antialias(const Rgb8Image& image, int64_t height, int64_t width) {
  check_resize_arguments(image, height, width, "resize_bicubic_antialias");
  if (image.width == width && image.height == height) return image;
  if (image.width == width)
    return detail::resize_vertical(image, detail::make_axis_filter(image.height, height));
  Rgb8Image wide = detail::resize_horizontal(image, detail::make_axis_filter(image.width, width));
  if (image.height == height) return wide;
  return detail::resize_vertical(wide, detail::make_axis_filter(image.height, height));
}

}  // namespace msa::vision
