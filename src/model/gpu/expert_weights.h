// Host-side checks of the routed experts' weight formats, shared by the expert kernels'
// launchers (expert_weights.cpp).
#pragma once
#include <cstdint>

#include "kernels.h"

namespace msa::model::gpu {

const char* expert_weights_name(ExpertWeights format);

// Throws msa::Error naming the argument unless `in` is a positive multiple of
// expert_weights_in_multiple(q.format) and the pointers fit the format: bf16 needs `w` (16-byte
// aligned) and no quantized pointers; mxfp8 codes (16-byte aligned) and scales, no `w`, no
// global scale; nvfp4 codes (8-byte aligned), scales and global scales (4-byte aligned), no `w`.
void check_expert_weights(const uint16_t* w, const QuantizedExpertWeights& q, int64_t in);

}  // namespace msa::model::gpu
