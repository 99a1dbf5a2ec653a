// Prefill over an fp8 K/V cache (docs/msa.md §6.6): the cache's blocks that the call's
// sequences hold are widened once into a bf16 copy in the workspace, and the bf16 prefill
// kernels (dense, sparse in either order, every engine) run on that copy. The decode path
// (max_q_len <= 16) reads the e4m3 codes directly and never comes here.
//
// Why a copy rather than widening inside the prefill kernels: a prefill tile reads every K/V
// tile of its context once per 128-row query tile, so the copy's cost (1 byte read and 2
// written per element, once per call) is small against the attention it feeds, and every
// prefill kernel keeps one operand format. The widening rounds e4m3(code) x scale (exact in
// f32) to bf16: a relative 2^-9 on top of the code's own 2^-4, where the decode kernels apply
// the scales in f32.
//
// The copy: packed [batch x max_blocks x B tokens, kv_heads, head_dim] bf16 per operand, each
// sequence at token b x max_blocks x B (a varlen KeyLayout), tokens at or past k_len[b] zero
// (an unwritten page tail may hold NaN codes or scales). M3 (4 KV heads, D 128): 2 KB per
// token of max_k_len per sequence, K and V together.
#pragma once
#include <cstddef>

#include "cuda/launch.h"

namespace msa::cuda {

// Whether attention() widens for these params: fp8 K/V and not the decode path.
bool attention_widens_fp8(const AttentionLaunch& params);
// Bytes of the bf16 copy (both operands) and the sequences' start tokens.
size_t fp8_widen_workspace_bytes(const AttentionLaunch& params);
// params with k / v at the bf16 copy in `workspace` (kv_format bf16); with a null workspace
// only the shape (for sizing the attention's own workspace after it).
AttentionLaunch fp8_widened_launch(const AttentionLaunch& params, void* workspace);
// Writes the copy into `workspace` (fp8_widen_workspace_bytes), on `stream`.
void widen_fp8_kv(const AttentionLaunch& params, void* workspace, void* stream);

}  // namespace msa::cuda
