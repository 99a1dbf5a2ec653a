// Argument validation shared by every implementation of every op. Each check throws
// msa::Error naming the argument, the expectation and what came; none writes anything.
#pragma once
#include <initializer_list>
#include <string>
#include <vector>

#include "batch.h"
#include "msa/ops.h"
#include "msa/quantized_index_keys.h"
#include "msa/quantized_kv_cache.h"

namespace msa::detail {

// Rank and extents; -1 in `expected` accepts any extent. Requires a contiguous CPU tensor.
void check_shape(const Tensor& tensor, const std::string& name,
                 std::initializer_list<int64_t> expected);
void check_float(const Tensor& tensor, const std::string& name);  // f32, f64, bf16 or f16
void check_int32(const Tensor& tensor, const std::string& name);

// cu_seqlens pair for packed queries and keys; q_len <= k_len for every sequence.
Batch varlen_batch(const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t total_q,
                   int64_t total_k);
// Paged requests: seq_lens, page_table and the queries' cu_seqlens; every page a request
// uses must exist in a cache of `num_pages` pages.
Batch paged_batch(const Tensor& cu_seqlens_q, const Tensor& seq_lens, const Tensor& page_table,
                  int64_t num_pages, int64_t block_size, int64_t total_q);

// Selection rows [groups, total_q, k]: ids in [0, own block], no duplicates, -1 suffix.
void check_selection(const Tensor& topk, const Batch& batch, int64_t groups, int64_t block_size);

// The index keys of a paged cache (index_key_cache, index_key_scale) for index dim Di:
// plain float [pages, B, Di]; fp8 e4m3 [pages, B, Di] + f32 [pages, B]; fp4 u8
// [pages, B, Di/2] + e4m3 [pages, B, Di/16] (msa/quantized_index_keys.h). Returns the format.
IndexKeyFormat check_paged_index_keys(const PagedKvCache& cache, int64_t block_size,
                                      int64_t index_dim);

// Checks q/k/v of a varlen attention op and returns its dims.
AttentionDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v);
// Head dim, q heads and kv heads of q against a paged cache; checks the caches' shapes and
// formats: float k_cache and v_cache without scales, or e4m3 (fp8) k_cache and v_cache each
// with an f32 scale [pages, Hkv, B] or [1] (msa/quantized_kv_cache.h).
AttentionDims check_paged_qkv(const Tensor& q, const PagedKvCache& cache, int64_t block_size);
// The formats of k_cache / v_cache (shapes checked by the caller) and their scales, as above.
void check_kv_formats(const PagedKvCache& cache);
// append_kv_cache's arguments (msa/ops.h): the cache's K/V tensors (rank 4, as above), k and v
// float [T, Hkv, D] of the cache's Hkv and D, slot_mapping i64 or i32 [T] with every
// non-negative slot below pages * B and none twice, per-tensor fp8 scales positive and finite.
// Returns the slots.
std::vector<int64_t> check_kv_append(const PagedKvCache& cache, const Tensor& k, const Tensor& v,
                                     const Tensor& slot_mapping);
// Whether a cache that passed check_paged_qkv holds fp8 K/V.
inline bool is_fp8_kv(const PagedKvCache& cache) { return cache.k_cache.dtype() == DType::e4m3; }

// Tensor in `dtype` (the input itself when it already is, else a converted copy).
Tensor as_dtype(const Tensor& tensor, DType dtype);
// Compute dtype for an impl: f64 for the reference given f64 queries, else f32.
DType compute_dtype(Impl impl, const Tensor& queries);

}  // namespace msa::detail
