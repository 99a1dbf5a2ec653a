// Helpers shared by the tests: fresh random inputs, packed batches, comparisons, files,
// expected errors.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "msa/ops.h"

namespace msa::testing {

// Fresh random generator per test; the seed is printed on failure by SCOPED_TRACE users.
inline std::mt19937_64& rng() {
  static std::mt19937_64 generator{std::random_device{}()};
  return generator;
}

// Normal(0, stddev) values, never all zeros.
inline Tensor random_normal(const Shape& shape, double stddev = 1.0, DType dtype = DType::f32) {
  Tensor out = Tensor::zeros(shape, dtype);
  std::normal_distribution<double> dist(0.0, stddev);
  for (int64_t i = 0; i < out.numel(); ++i) out.set(i, dist(rng()));
  return out;
}

// int32 [n + 1] prefix sums of `lengths`.
inline Tensor cu_seqlens(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> offsets{0};
  for (int64_t length : lengths) offsets.push_back(offsets.back() + static_cast<int32_t>(length));
  return Tensor::from_vector(offsets, {static_cast<int64_t>(offsets.size())});
}

// ||a - b|| / ||b|| over all elements (both read as double); NaN when either holds NaN.
inline double relative_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) return std::nan("");
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// Largest |a - b| over elements; infinities must match exactly.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isnan(x) != std::isnan(y)) return std::numeric_limits<double>::infinity();
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::fabs(x - y));
  }
  return worst;
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// The whole file at `path` ("" when it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A fixture with a fresh empty directory per test (under gtest's TempDir, named after the
// test and this process), removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("msa_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

// The message of the msa::Error `body` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Expects `call` to throw msa::Error whose message contains `words`.
inline void expect_error(const std::function<void()>& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no msa::Error (expected one containing \"" << words << "\")";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(words), std::string::npos) << error.what();
  }
}

}  // namespace msa::testing
