// `msa op` as a library call, for the fuzz target of its input validation
// (tests/fuzz/fuzz_op_inputs.cpp): the same lookup, narrowing, finite-value checks and op.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "msa/ops.h"
#include "msa/safetensors.h"

namespace msa::cli {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// The op names `msa op` knows, in its table's order.
std::vector<std::string> op_command_names();

// Runs op `name` on the tensors of `file` exactly as `msa op` does (without writing them):
// requires its inputs, narrows int64 index tensors to int32, refuses non-finite float
// inputs when check_finite, then calls the op. Bad input throws msa::Error.
NamedTensors run_op_on_inputs(const std::string& name, const SafetensorsModel& file,
                              const MsaParams& params, Impl impl, bool check_finite = true);

}  // namespace msa::cli
