// --cache-dtype f32|bf16|fp8 (msa run, msa serve, msa bench-serve): the KV cache's element
// type.
#pragma once
#include <string>

#include "cli_args.h"
#include "msa/dtype.h"
#include "msa/tensor.h"

namespace msa::cli {

// f32 (the CPU's default; the CUDA model refuses it), bf16 (half the memory; the CUDA
// device's default) or fp8 (e4m3 K/V with per-token-and-head scales, bf16 index keys).
inline DType read_cache_dtype_flag(Args& args, Device device) {
  const std::string text = args.get_string("cache-dtype", device == Device::cuda ? "bf16" : "f32");
  if (text == "f32" || text == "float32") return DType::f32;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  if (text == "fp8" || text == "e4m3") return DType::e4m3;
  throw UsageError("--cache-dtype: expected f32, bf16 or fp8, got \"" + text + "\"");
}

}  // namespace msa::cli
