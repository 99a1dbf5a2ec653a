// Quantizers of msa's fp8 / 4-bit caches on the GPU, with the CPU quantizers' rounding (the
// same bytes for the same values). Public device API: see msa/cuda/types.h. Kernels:
// src/cuda/indexer/quantize_index_keys.cu (index keys), src/cuda/decode/append_kv_fp8.cu (K/V).
#pragma once
#include "msa/cuda/types.h"

namespace msa::cuda {

// ---- index keys (msa/quantized_index_keys.h) ----

// keys: bf16 [tokens, dim] (dim % 16 == 0, at most 1024). fp8: codes e4m3 [tokens, dim],
// scales f32 [tokens]; fp4: codes [tokens, dim / 2] (low nibble = even channel), scales
// e4m3 [tokens, dim / 16]. A paged cache [pages, B, dim] is tokens = pages * B.
void quantize_index_keys(const uint16_t* keys, int64_t tokens, int64_t dim, KeyFormat format,
                         uint8_t* codes, uint8_t* scales, Stream stream);

// ---- fp8 K/V caches (msa/quantized_kv_cache.h, docs/msa.md §6.6) ----

enum class KvScaleLayout : uint8_t { per_token_head, per_tensor };
enum class InputType : uint8_t { bf16, f32 };

// Quantize-on-append: the new tokens' K and V go into an fp8 paged cache, token t of every
// KV head to page slot_mapping[t] / block_size, row slot_mapping[t] % block_size (vLLM's slot
// mapping; a negative slot skips the token). Per token and head, each (token, head) row gets
// scale = amax / 448 and codes e4m3(x / scale), its scale written to the scale tensor; per
// tensor, the codes are e4m3(x / scale[0]) and the scale is only read. The host op
// msa::append_kv_cache (msa/ops.h) writes the same bytes.
struct KvAppendParams {
  const void* k = nullptr;  // [tokens, kv_heads, head_dim] of `input`, contiguous
  const void* v = nullptr;  // [tokens, kv_heads, head_dim] of `input`, contiguous
  InputType input = InputType::bf16;
  int64_t tokens = 0, kv_heads = 0, head_dim = 0;
  int64_t block_size = 0;                 // B: tokens per page
  const int64_t* slot_mapping = nullptr;  // [tokens]: page * B + row, distinct; < 0 skips
  uint8_t* k_cache = nullptr;             // e4m3 [pages, kv_heads, B, head_dim]
  uint8_t* v_cache = nullptr;
  float* k_scale = nullptr;  // per token and head: f32 [pages, kv_heads, B] (written);
  float* v_scale = nullptr;  //   per tensor: f32 [1], positive and finite (read)
  KvScaleLayout k_layout = KvScaleLayout::per_token_head;
  KvScaleLayout v_layout = KvScaleLayout::per_token_head;
};
void append_kv_fp8(const KvAppendParams& params, Stream stream);

}  // namespace msa::cuda
