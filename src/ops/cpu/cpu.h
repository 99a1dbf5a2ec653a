// The optimised CPU implementations: f32 storage and arithmetic (f32 accumulation),
// threads over queries/heads (OpenMP), vectorised inner loops, no token-score matrices.
// Same contracts as the reference in ../reference/reference.h.
#pragma once
#include <cstdint>
#include <variant>
#include <vector>

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

// fp8 values as e4m3 codes and f32 scales addressed alike by (sequence, block, head): the
// fp8 index keys (msa/quantized_index_keys.h: one head, one scale per token) and fp8 K/V
// (msa/quantized_kv_cache.h: one scale per token and head, or one per tensor, which is a
// scale KeyBlocks whose strides are all 0). `dim` is the row length (Di or D); block_size is
// B (as KeyBlocks, for BlockReader::block_size).
struct Fp8Blocks {
  KeyBlocks<E4m3> codes;   // dim Di or D
  KeyBlocks<float> scale;  // dim 1
  int64_t block_size = 0, dim = 0;
};
// Quantized paged index keys in the fp4 format (msa/quantized_index_keys.h): codes
// [.., B, Di/2] (two e2m1 per byte, low nibble = even channel) with one e4m3 per 16 channels.
struct Fp4IndexKeys {
  KeyBlocks<uint8_t> codes;  // dim Di / 2
  KeyBlocks<E4m3> scale;     // dim Di / 16
  int64_t block_size = 0, dim = 0;
};

// K, V or index keys in their stored element type. The forward kernels read them block by
// block through a BlockReader (block_reader.h): f32 in place, bf16/f16 widened one block at
// a time (exactly), fp8 K/V and quantized index keys dequantized one block at a time, so a
// large cache is never converted whole per call.
using StoredBlocks = std::variant<KeyBlocks<float>, KeyBlocks<Bf16>, KeyBlocks<F16>,
                                  Fp8Blocks, Fp4IndexKeys>;

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

// ref::append_kv's contract (reference.h), threaded over tokens; the same bytes.
void append_kv(const Tensor& values, const std::vector<int64_t>& slots, const Tensor& cache,
               const Tensor& scale);

}  // namespace msa::detail::cpu
