// Quantizes bf16 index keys on the device into the fp8 / fp4 cache formats of
// msa/quantized_index_keys.h, with the same rounding rules as the CPU quantize functions
// (the same bytes for the same bf16 values). Host-only header (no CUDA headers).
#pragma once
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

// keys: bf16 [tokens, dim] (dim % 16 == 0, at most 1024). fp8: codes e4m3 [tokens, dim],
// scales f32 [tokens]; fp4: codes [tokens, dim / 2] (low nibble = even channel), scales
// e4m3 [tokens, dim / 16]. A paged cache [pages, B, dim] is tokens = pages * B. Kernels only,
// on `stream`: graph-capturable, no allocation. Non-finite keys give unspecified codes.
void quantize_index_keys(const uint16_t* keys, int64_t tokens, int64_t dim, KeyFormat format,
                         uint8_t* codes, uint8_t* scales, void* stream);

}  // namespace msa::cuda
