// Helpers shared by the tests: fresh random inputs, packed batches, comparisons, files,
// expected errors.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "msa/ops.h"

namespace msa::testing {

// The tests' random generator (op_cases.h: fixed seeds unless MSA_TEST_SEED asks otherwise).
inline std::mt19937_64& rng() {
  static std::mt19937_64 generator{0x5eed};  // fixed: MSA_RESEED_AND_TRACE reseeds per test
  return generator;
}

// n token ids in [3, vocab) from a 64-bit LCG seeded by `salt`: prompts that differ per
// salt, the same on every run and machine (ids 0-2 stay free for special tokens).
inline std::vector<int32_t> some_tokens(int64_t n, int64_t vocab, int32_t salt) {
  std::vector<int32_t> tokens;
  uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(salt + 1);
  for (int64_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    tokens.push_back(static_cast<int32_t>(3 + (state >> 33) % static_cast<uint64_t>(vocab - 3)));
  }
  return tokens;
}

// Normal(0, stddev) values, never all zeros. (Drawn into an f64 buffer and converted once:
// the same values as setting each element, without the per-element checks of Tensor::set,
// which dominated the GPU tests' set-up at 10^8 elements.)
inline Tensor random_normal(const Shape& shape, double stddev = 1.0, DType dtype = DType::f32) {
  Tensor values = Tensor::zeros(shape, DType::f64);
  std::normal_distribution<double> dist(0.0, stddev);
  double* out = values.data<double>();
  for (int64_t i = 0, n = values.numel(); i < n; ++i) out[i] = dist(rng());
  return dtype == DType::f64 ? values : values.to(dtype);
}

// Calls visit(i, x, y) for every element of a and b read as double (typed reads for f32 and
// f64, one conversion otherwise) and stops early when it returns false.
template <class Visit>
void for_each_pair(const Tensor& a, const Tensor& b, Visit visit) {
  const auto as_readable = [](const Tensor& t) {
    return t.dtype() == DType::f32 || t.dtype() == DType::f64 ? t : t.to(DType::f64);
  };
  const Tensor ra = as_readable(a), rb = as_readable(b);
  const auto read = [](const Tensor& t) {
    return [f = t.dtype() == DType::f32 ? t.data<float>() : nullptr,
            d = t.dtype() == DType::f64 ? t.data<double>() : nullptr](int64_t i) {
      return f ? static_cast<double>(f[i]) : d[i];
    };
  };
  const auto x_at = read(ra), y_at = read(rb);
  for (int64_t i = 0, n = std::min(ra.numel(), rb.numel()); i < n; ++i)
    if (!visit(i, x_at(i), y_at(i))) return;
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
  double diff = 0, norm = 0, verdict = 0;  // verdict: NaN or inf once decided
  for_each_pair(a, b, [&](int64_t, double x, double y) {
    if (std::isnan(x) || std::isnan(y)) {
      verdict = std::nan("");
      return false;
    }
    if (std::isinf(x) || std::isinf(y)) {
      if (x == y) return true;
      verdict = std::numeric_limits<double>::infinity();
      return false;
    }
    diff += (x - y) * (x - y);
    norm += y * y;
    return true;
  });
  if (verdict != 0 || std::isnan(verdict)) return verdict;
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// Largest |a - b| over elements; infinities must match exactly.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double worst = 0;
  for_each_pair(a, b, [&](int64_t, double x, double y) {
    if (std::isnan(x) != std::isnan(y) || ((std::isinf(x) || std::isinf(y)) && x != y)) {
      worst = std::numeric_limits<double>::infinity();
      return false;
    }
    if (!std::isinf(x) && !std::isinf(y)) worst = std::max(worst, std::fabs(x - y));
    return true;
  });
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
