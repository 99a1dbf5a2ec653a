// The refusals shared by the MXFP8 and NVFP4 weight checks (mxfp8.cpp, nvfp4.cpp): a bad
// block scale or a bad weight, named by tensor and position.
#pragma once
#include <cstdint>
#include <string>

#include "msa/error.h"

namespace msa::model {

// Block `block` of row `row` of the scale tensor `scale_tensor`.
[[noreturn]] inline void refuse_block_scale(const std::string& scale_tensor, int64_t row, int64_t block,
                                            const std::string& expected, const std::string& got) {
  throw_arg_error("tensor '" + scale_tensor + "' at [" + std::to_string(row) + ", " + std::to_string(block) + "]",
                  expected, got);
}

// Weight `flat_index` of tensor `name` after its scales.
[[noreturn]] inline void refuse_scaled_weight(const std::string& name, int64_t flat_index, const std::string& got) {
  throw_arg_error("tensor '" + name + "' at flat index " + std::to_string(flat_index), "a finite weight", got);
}

}  // namespace msa::model
