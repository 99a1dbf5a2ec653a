// The vocabulary of msa's public device API (msa/cuda/*.h): streams, packed and paged
// sequences, key layouts, output types and engine choices. Host-only: no CUDA header is
// needed to include it, and every pointer in these structs is device memory unless noted.
// bf16 values are passed as their 16-bit patterns (uint16_t); a `__nv_bfloat16*` or a
// PyTorch bfloat16 data pointer casts to it.
//
// Launch contract of every function of the device API:
// - No allocation, no host synchronisation, no cudaMemcpy: kernels (and cudaMemsetAsync)
//   on the caller's stream only, so every call can be captured into a CUDA graph.
// - The workspace comes from the matching *_workspace_bytes() of the same params, is sized
//   from host values only, is 256-byte aligned and belongs to one call at a time.
// - Host values (counts, maxima, strides, dims) are checked and a bad one throws msa::Error
//   naming it. Device data (cu_seqlens, page tables, selection rows, values) is trusted: it
//   must satisfy the preconditions documented beside each field, which checking would cost
//   a host synchronisation; the host-tensor ops of msa/ops.h and `msa op` check everything.
//   Non-finite values give unspecified outputs, never an out-of-bounds access.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;  // cudaStream_t is `CUstream_st*`: pass a cudaStream_t as it is

namespace msa::cuda {

using Stream = CUstream_st*;  // null = the legacy default stream (graph capture refuses it)

// Packed sequences of one call: sequence b owns query rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]), and its queries are the last q_len of its k_len keys
// (pos = k_len - q_len + i, docs/msa.md). int32 device arrays as PyTorch and flash-attn code
// have them; the kernels take them as given (no host conversion).
struct Sequences {
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]: 0 = cu[0] <= cu[1] <= ... <= total_q
  // Keys, one of the two: packed (varlen) keys, token rows [cu_seqlens_k[b], cu_seqlens_k[b+1]);
  // or, with paged key layouts, the tokens in the cache per sequence, its queries included.
  const int32_t* cu_seqlens_k = nullptr;  // [batch + 1], packed keys
  const int32_t* seq_lens = nullptr;      // [batch], paged keys
  // Host values: launch sizes. Every sequence must have q_len <= max_seqlen_q,
  // q_len <= k_len <= max_seqlen_k (as flash-attn's max_seqlen_q / max_seqlen_k).
  int64_t batch = 0;
  int64_t total_q = 0;  // rows of q and of every per-query output
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
};

// Keys, values or index keys: token t of head h of sequence b lives at
//   packed: data + (cu_seqlens_k[b] + t) * token_stride + h * head_stride
//   paged:  data + page_table[b * page_table_stride + t / B] * page_stride
//                + h * head_stride + (t % B) * token_stride
// (elements; B = the call's block size). Rows of one token are contiguous and 16-byte
// aligned: strides are multiples of 8 elements. Page ids must be valid pages of `data` for
// every block a sequence's tokens reach.
struct Keys {
  const uint16_t* data = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t page_stride = 0;                // paged only
  const int32_t* page_table = nullptr;    // [batch, page_table_stride]; null = packed
  int64_t page_table_stride = 0;
};

// The standard layouts: packed [total_k, heads, dim] and paged [pages, heads, B, dim]
// (msa/ops.h's paged ops; vLLM's caches are paged with other strides).
inline Keys packed_keys(const uint16_t* data, int64_t heads, int64_t dim) {
  return {data, heads * dim, dim, 0, nullptr, 0};
}
inline Keys paged_keys(const uint16_t* data, int64_t heads, int64_t block_size, int64_t dim,
                       const int32_t* page_table, int64_t page_table_stride) {
  return {data, dim, block_size * dim, heads * block_size * dim, page_table, page_table_stride};
}

// How cached index keys are stored (msa/quantized_index_keys.h). fp8 and fp4 caches are
// paged and read by the decode path only.
enum class KeyFormat : uint8_t { bf16, fp8, fp4 };
struct QuantizedKeys {
  const uint8_t* codes = nullptr;   // fp8: e4m3 [pages, B, Di]; fp4: e2m1 pairs [pages, B, Di/2]
                                    //   (low nibble = even channel)
  const uint8_t* scales = nullptr;  // fp8: f32 [pages, B]; fp4: e4m3 [pages, B, Di/16]
};

// How cached K and V are stored (docs/msa.md §6.6, msa/quantized_kv_cache.h): bf16, or fp8
// (e4m3 codes with f32 scales). fp8 K/V are paged; the decode path reads the codes, prefill a
// bf16 copy of them.
enum class KvFormat : uint8_t { bf16, fp8 };

// The f32 scales of an fp8 K or V cache: the scale of token t of head h of a sequence whose
// block t / B is page p sits at data[p * page_stride + h * head_stride + (t % B) * token_stride]
// (elements). One scale per token and head, [pages, heads, B]: kv_scales_per_token_head();
// one scale per tensor (vLLM's k_scale / v_scale): kv_scale_per_tensor(), every stride 0.
struct KvScales {
  const float* data = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int64_t page_stride = 0;
};
inline KvScales kv_scales_per_token_head(const float* data, int64_t heads, int64_t block_size) {
  return {data, 1, block_size, heads * block_size};
}
inline KvScales kv_scale_per_tensor(const float* data) { return {data, 0, 0, 0}; }

// An fp8 K or V cache: its e4m3 codes, addressed like paged Keys (the layout's strides count
// bytes, one per element; token rows 16-byte aligned), and their scales. A value is
// e4m3(code) * scale.
struct Fp8Kv {
  const uint8_t* codes = nullptr;
  KvScales scales;
};

// Element type of an attention output `o` (lse is always f32).
enum class OutputType : uint8_t { f32, bf16 };

// Kernel engine choices. `automatic` is the measured default (bench/results/h200.md); tests
// and benchmarks pin one to check or time both. Pinning an engine where it cannot run (shape,
// scale sign) is an error naming the field, never a silent substitute.
enum class Engine : uint8_t { automatic, wgmma, mma_sync };
constexpr const char* engine_name(Engine engine) {
  return engine == Engine::wgmma ? "wgmma" : engine == Engine::mma_sync ? "mma_sync" : "automatic";
}
// How the wgmma sparse kernel loads its Q tiles: the bulk tensor copy engine (group sizes 8
// and 16) or per-thread cp.async gathers.
enum class TileLoad : uint8_t { automatic, tma, cp_async };
// The order of the sparse prefill's work. kv_major: one work item per selected (group, block)
// and up to 1024 rows, a partial output per (query, head, block) merged afterwards; it loads
// each selected block once per item whatever the queries select. query_major: one CTA per
// tile of 128 (query, head) rows walks the union of its queries' selected blocks with an
// online softmax and writes O directly (no partials, no merge), computing every (row, union
// block) pair: fast where neighbouring queries select the same blocks, slow where they do not
// (G = q_heads / kv_heads of 4, 8 or 16, head_dim = block_size = 128). automatic: per tile,
// on the device, query-major where the union is small enough (attention.cu).
enum class SparseOrder : uint8_t { automatic, kv_major, query_major };
// Where the prefill index scan ranks the blocks (its tile paths; calls of <= 16 queries per
// request take the decode path whatever this says). in_scan: each tile scan's epilogue keeps
// its rows' best blocks (the fused path). separate: the scan writes every block max to the
// workspace and select_rows_kernel ranks them (the split path), in passes over the queries
// whose maxima fit the workspace cap (512 MiB; IndexerParams::max_chunk_queries caps a pass).
// automatic: separate for short contexts (few query tiles) and for the bf16 and fp8 wgmma
// scans (M3's shape) at any length; in_scan for the mma.sync scan (other shapes, training's
// lse_out) (indexer.cu make_plan; separate measured 1.4-1.7x faster at 32K-128K and level at
// 1M, bench/results/h200.md).
enum class IndexRanking : uint8_t { automatic, in_scan, separate };
constexpr const char* index_ranking_name(IndexRanking ranking) {
  return ranking == IndexRanking::in_scan ? "in_scan" : ranking == IndexRanking::separate ? "separate" : "automatic";
}
constexpr const char* sparse_order_name(SparseOrder order) {
  return order == SparseOrder::query_major ? "query_major" : order == SparseOrder::kv_major ? "kv_major" : "automatic";
}

}  // namespace msa::cuda
