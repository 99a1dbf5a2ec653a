// The resize of images and video frames: torchvision's antialiased bicubic on uint8 CPU
// tensors (what transformers' MiniMax-M3 processors call), as
//   - resize_bicubic_antialias (resize.cpp): per-axis weight tables, OpenMP over rows, the
//     vertical pass as contiguous row sums the compiler vectorises;
//   - resize_bicubic_antialias_reference (resize_reference.cpp): the definition as plain
//     loops, weights derived per output pixel; the tests hold the two equal bit for bit.
//
// The definition (PyTorch's separable "aa" interpolation, which follows PIL's resample):
// along an axis of in -> out samples, scale = in / out (f64); output i is centred at
// scale * (i + 0.5) in input coordinates and reads inputs [xmin, xmin + xsize) with
//   support = 2 * max(scale, 1),  xmin = max(int(center - support + 0.5), 0),
//   xsize = min(int(center + support + 0.5), in) - xmin   (at most ceil(support) * 2 + 1),
//   w_j = cubic((xmin + j - center + 0.5) / max(scale, 1)), then divided by their sum,
// cubic being Keys' kernel with a = -0.5. The weights become int16 with `precision`
// fraction bits, the most (up to 22) for which the axis's largest weight times 2^(p + 1)
// stays below 2^15, each rounded half away from zero. A pass computes
//   out = clamp((2^(p - 1) + sum_j sample_j * weight_j) >> p, 0, 255)
// in integers. The horizontal pass runs first (into uint8), then the vertical one; an
// axis whose size does not change is copied. f64 arithmetic of the weights is compiled
// without FMA contraction (src/CMakeLists.txt) so the int16 roundings are PyTorch's.
#pragma once
#include <cstdint>
#include <vector>

#include "msa/vision_media.h"

namespace msa::vision::detail {

// Keys' cubic convolution kernel with a = -0.5, written as PyTorch's
// cubic_convolution1 / cubic_convolution2 so that the f64 results are the same.
double bicubic_kernel(double x);

// One axis's weights.
struct AxisFilter {
  int64_t in_size = 0, out_size = 0;
  int64_t taps = 0;            // weights stored per output sample
  std::vector<int64_t> first;  // [out_size] first input sample read
  std::vector<int64_t> count;  // [out_size] input samples read (<= taps)
  std::vector<int16_t> weights;  // [out_size][taps], zero beyond count
  int precision = 0;           // fraction bits of the weights
};
AxisFilter make_axis_filter(int64_t in_size, int64_t out_size);

Rgb8Image resize_bicubic_antialias_reference(const Rgb8Image& image, int64_t height, int64_t width);

}  // namespace msa::vision::detail
