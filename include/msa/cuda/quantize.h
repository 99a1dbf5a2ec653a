// Quantization of bf16 index keys into the fp8 / fp4 cache formats of
// msa/quantized_index_keys.h on the GPU, with the CPU quantizers' rounding (the same bytes
// for the same bf16 values). Public device API: see msa/cuda/types.h. Kernel:
// src/cuda/indexer/quantize_index_keys.cu.
#pragma once
#include "msa/cuda/types.h"

namespace msa::cuda {

// keys: bf16 [tokens, dim] (dim % 16 == 0, at most 1024). fp8: codes e4m3 [tokens, dim],
// scales f32 [tokens]; fp4: codes [tokens, dim / 2] (low nibble = even channel), scales
// e4m3 [tokens, dim / 16]. A paged cache [pages, B, dim] is tokens = pages * B.
void quantize_index_keys(const uint16_t* keys, int64_t tokens, int64_t dim, KeyFormat format,
                         uint8_t* codes, uint8_t* scales, Stream stream);

}  // namespace msa::cuda
