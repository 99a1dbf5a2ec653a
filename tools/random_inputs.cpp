#include "random_inputs.h"

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace msa::cli {

namespace {
// SplitMix64: a good 64-bit hash of a counter, so any element can be drawn independently.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }
}  // namespace

Tensor random_normal_tensor(const Shape& shape, uint64_t seed, float stddev) {
  Tensor out = Tensor::zeros(shape, DType::f32);
  float* data = out.data<float>();
  const int64_t pairs = (out.numel() + 1) / 2;
  const uint64_t stream = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < pairs; ++i) {
    // Box-Muller: two independent normals from two uniforms.
    const double u1 = uniform01(splitmix64(stream ^ (2 * i)));
    const double u2 = uniform01(splitmix64(stream ^ (2 * i + 1)));
    const double radius = std::sqrt(-2.0 * std::log(u1)) * stddev;
    data[2 * i] = static_cast<float>(radius * std::cos(2 * M_PI * u2));
    if (2 * i + 1 < out.numel()) data[2 * i + 1] = static_cast<float>(radius * std::sin(2 * M_PI * u2));
  }
  return out;
}

Tensor random_permutation(int64_t n, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 generator(seed);
  std::shuffle(ids.begin(), ids.end(), generator);
  return Tensor::from_vector(ids, {n});
}

}  // namespace msa::cli
