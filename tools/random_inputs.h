// Fast random tensors for benchmarks: normal(0, 1) values from a counter-based generator,
// filled in parallel, so multi-GB inputs take a moment instead of minutes.
#pragma once
#include <cstdint>

#include "msa/tensor.h"

namespace msa::cli {

// New f32 tensor of normal(0, stddev) values; `seed` selects the stream.
Tensor random_normal_tensor(const Shape& shape, uint64_t seed, float stddev = 1.0f);

// Random permutation of [0, n) as int32 (a shuffled page table), from `seed`.
Tensor random_permutation(int64_t n, uint64_t seed);

}  // namespace msa::cli
