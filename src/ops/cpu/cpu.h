// The optimised CPU implementations: f32 storage and arithmetic (f32 accumulation),
// threads over queries/heads (OpenMP), vectorised inner loops, no token-score matrices.
// Same contracts as the reference in ../reference/reference.h.
#pragma once
#include <cstdint>
#include <variant>

#include "../batch.h"

namespace msa::detail::cpu {

// 16-bit float storage, one type per format so that a KeyBlocks names its element format.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// One byte of OCP FP8 E4M3.
struct E4m3 {
  uint8_t bits;
};

// Quantized paged index keys (msa/quantized_index_keys.h), as codes and scales addressed
// alike by (sequence, block): fp8 codes [.., B, Di] with one f32 scale per token; fp4 codes
// [.., B, Di/2] (two e2m1 per byte, low nibble = even channel) with one e4m3 per 16
// channels. `dim` is Di; block_size is B (as KeyBlocks, for BlockReader::block_size).
struct Fp8IndexKeys {
  KeyBlocks<E4m3> codes;   // dim Di
  KeyBlocks<float> scale;  // dim 1
  int64_t block_size = 0, dim = 0;
};
struct Fp4IndexKeys {
  KeyBlocks<uint8_t> codes;  // dim Di / 2
  KeyBlocks<E4m3> scale;     // dim Di / 16
  int64_t block_size = 0, dim = 0;
};

// K, V or index keys in their stored element type. The forward kernels read them block by
// block through a BlockReader (block_reader.h): f32 in place, bf16/f16 widened one block at
// a time (exactly), quantized index keys dequantized one block at a time, so a large cache
// is never converted whole per call.
using StoredBlocks = std::variant<KeyBlocks<float>, KeyBlocks<Bf16>, KeyBlocks<F16>,
                                  Fp8IndexKeys, Fp4IndexKeys>;

void attention_forward(const float* q, const StoredBlocks& k, const StoredBlocks& v,
                       const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                       float scale, float* o, float* lse);

// The training passes below take f32 keys (callers convert whole tensors).
// dk/dv have k's layout and are accumulated into (the caller zeroes them). Deterministic:
// the same inputs give bitwise-identical gradients for a fixed thread count.
void attention_backward(const float* q, const KeyBlocks<float>& k, const KeyBlocks<float>& v,
                        const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                        float scale, const float* o, const float* lse, const float* grad_o,
                        float* dq, float* dk, float* dv);

// Other inputs for the block ranking than for the LSE (IndexCompute::fp8: the rows rank by
// the quantize-dequantized qi and keys, the LSE scores the inputs as given).
struct IndexRanking {
  const float* qi;          // [total_q, Hi, Di], as the indexer's qi
  const StoredBlocks* ki;   // as the indexer's ki
};

// lse may be null (inference needs only the rows); ranking null: rank by qi and ki.
void indexer(const float* qi, int64_t index_heads, int64_t index_dim, const StoredBlocks& ki,
             const Batch& batch, const MsaParams& params, float index_scale, int32_t* topk,
             float* lse, const IndexRanking* ranking = nullptr);

// Returns the loss; dki is accumulated into (the caller zeroes it).
double indexer_kl(const float* q, const KeyBlocks<float>& k, const float* main_lse,
                  const AttentionDims& dims, const float* qi, const KeyBlocks<float>& ki,
                  int64_t index_dim, const Batch& batch, BlockSource selection,
                  const MsaParams& params, float scale, float index_scale, float* dqi,
                  float* dki);

}  // namespace msa::detail::cpu
