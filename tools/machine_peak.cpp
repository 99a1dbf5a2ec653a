#include "machine_peak.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace msa::cli {

namespace {
typedef float f32x8 __attribute__((vector_size(32)));

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// 12 independent FMA chains per thread hide the FMA latency on current x86 cores.
double fma_gflops() {
  constexpr int kChains = 12;
  constexpr long kIterations = 1 << 24;
  float sink = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
  {
    f32x8 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = f32x8{} + 1.0f + c * 1e-3f;
    // Operands from volatile memory: the compiler cannot fold the loop away.
    volatile float multiplier = 0.9999999f, addend = 1e-7f;
    const f32x8 mul = f32x8{} + multiplier, add = f32x8{} + addend;
    for (long i = 0; i < kIterations; ++i)
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * mul + add;
    for (int c = 0; c < kChains; ++c)
      for (int lane = 0; lane < 8; ++lane) sink += acc[c][lane];
  }
  const double elapsed = seconds_since(start);
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 8 * kChains * static_cast<double>(kIterations) * omp_get_max_threads() / elapsed /
         1e9;
}

double read_bandwidth() {
  const size_t floats = size_t{1} << 28;  // 1 GiB, far past every cache
  std::vector<float> buffer(floats);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < floats; ++i) buffer[i] = static_cast<float>(i & 1023);
  double best = 0;
  for (int repeat = 0; repeat < 3; ++repeat) {
    float total = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (size_t i = 0; i < floats; i += 8) {
      f32x8 v;
      std::memcpy(&v, &buffer[i], sizeof v);
      total += v[0] + v[7];
    }
    const double elapsed = seconds_since(start);
    volatile float keep = total;
    (void)keep;
    best = std::max(best, floats * 4.0 / elapsed / 1e9);
  }
  return best;
}
}  // namespace

// Best of three: a shared machine can only make a run slower, never faster.
MachinePeak measure_machine_peak() {
  double gflops = 0;
  for (int repeat = 0; repeat < 3; ++repeat) gflops = std::max(gflops, fma_gflops());
  return {gflops, read_bandwidth()};
}

}  // namespace msa::cli
