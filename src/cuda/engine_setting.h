// Environment switches that force one of two kernel engines (tests and benchmarks time and
// check both in one process): "1" forces the warpgroup-MMA engine, "0" the mma.sync one,
// unset or empty keeps the measured default. Anything else is an error naming the variable,
// never a silent default. Read per call.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "msa/error.h"

namespace msa::cuda {

inline std::optional<bool> wgmma_engine_override(const char* variable) {
  const char* text = std::getenv(variable);
  if (!text || !*text) return std::nullopt;
  const std::string value(text);
  if (value != "0" && value != "1")
    throw_arg_error(variable, "0 or 1 (unset: the measured default)", "\"" + value + "\"");
  return value == "1";
}

}  // namespace msa::cuda
