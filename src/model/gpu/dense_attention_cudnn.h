// The CUDA text model's dense causal attention on cuDNN's fused SDPA (src/cudnn/cudnn_sdpa.h)
// instead of our kernel, two ways (DenseAttentionEngine, msa/model.h):
//
//   cudnn           straight over the paged device KV cache: q packed [T, Hq, D] bf16 (cuDNN's
//                   ragged THD layout, so prefill chunks and decode rows of different lengths
//                   share one call), K/V caches [pages, Hkv, B, D] through a page table.
//   cudnn_gathered  each request's visible keys first copied out of the pages into contiguous
//                   THD buffers [total_k, Hkv, D] (kv_gather.h), then cuDNN's non-paged SDPA
//                   with ragged Q/O and ragged K/V.
// Both: causal bottom-right (query i of a request sees keys t <= k_len - q_len + i), the
// padding mask with the real per-request lengths, the bf16 output into our `o`.
//
// Why both exist: on contiguous K/V with equal query counts (the kernel benchmark's baseline)
// cuDNN's SDPA runs dense causal prefill at 550-650 TFLOP/s where ours runs ~340 (the dense
// layer's 128K prefill: 503 ms against our 808). Over the paged cache (ragged Q/O, bucketed
// plans) it measured slower than ours in the model (H200, m3-layer dense layer, msa
// bench-model): 1110 vs 851 ms at 128K prefill, 63.5 vs 52.8 ms at 32K, 2.97 vs 0.089 ms per
// decode token at 128K. The gather costs one read and one write of the step's K/V (256 MB at
// 128K for Hkv 4, D 128: 0.38 ms measured over the four 32K chunks of a 128K prefill) and
// hands cuDNN the contiguous layout it is fast on. Measured in the model (H200, same
// bench-model command): the dense layer's attention over a 128K prefill 538 ms gathered
// against 846 ms ours, 26.6 vs 52.6 ms at 32K; over a 32K context in chunks of 64 / 256 /
// 2048 queries 171 / 46.0 / 29.7 ms against 246 / 68.4 / 53.8 ms. Per decode token cuDNN
// stays 20-30x slower (0.71 vs 0.034 ms at 32K). Hence automatic_dense_engine
// (cuda_model.h).
//
// Plans: cuDNN compiles a kernel per graph shape, which costs far more than a step, so the
// sizes a plan bakes in are bucketed to powers of two (requests, the longest query count,
// and the paged path's page-table stride, hence max_seq_len_kv = stride * B, or the gathered
// path's longest key count): a serving process builds a few plans per (batch, chunk) size
// class rather than one per step. The padded requests have seq_len_q = seq_len_kv = 0 (cuDNN
// writes nothing for them). The frontend's dynamic shapes + kernel cache would avoid even
// that, but its unified SDPA node refuses dynamic shapes and the composite node's support of
// them with paged K/V and ragged Q is undocumented: not used.
//
// The step's cuDNN metadata (int32: seq_len_q, seq_len_kv, the Q/O offsets, and the page
// table at the bucketed stride or the K/V offsets and gather rows) is staged by the host with
// the step's other metadata and uploaded in the same copy (CudaModel::upload_step), so no
// extra host round trip. Host-only header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace msa::model::gpu {

// The sizes one step's cuDNN call is planned for.
struct CudnnDenseGeometry {
  int64_t batch = 0;         // the step's requests, rounded up to a power of two
  int64_t max_q_len = 0;     // the longest request's query count, rounded up likewise
  int64_t table_stride = 0;  // the step's page-table width (max pages), rounded up likewise
};

// Whether cuDNN's ragged SDPA can take a step of `total_q` query rows of `q_row_elements`
// (Hq * D) elements each: the element offsets are int32.
bool cudnn_dense_fits(int64_t total_q, int64_t q_row_elements);
CudnnDenseGeometry cudnn_dense_geometry(int64_t requests, int64_t max_q_len, int64_t max_pages);

// Byte offsets of the metadata in its region (each 256-byte aligned).
struct CudnnDenseMetadataLayout {
  size_t seq_len_q = 0, seq_len_kv = 0, q_offsets = 0, page_table = 0, bytes = 0;
};
CudnnDenseMetadataLayout cudnn_dense_metadata_layout(const CudnnDenseGeometry& g);

// Writes the metadata of a step (the StepBatch's cu_seqlens_q [requests + 1], seq_lens
// [requests], page_table [requests, max_pages]) into `dst` (layout's bytes, host staging).
void stage_cudnn_dense_metadata(const CudnnDenseGeometry& g, std::span<const int32_t> cu_seqlens_q,
                                std::span<const int32_t> seq_lens, const int32_t* page_table,
                                int64_t max_pages, int64_t q_row_elements, char* dst);

// One dense attention call: device pointers and the model's shape.
struct CudnnDenseCall {
  const void* q = nullptr;        // bf16 [T, q_heads, head_dim]
  const void* k_cache = nullptr;  // bf16 [pages, kv_heads, block_size, head_dim]
  const void* v_cache = nullptr;
  void* o = nullptr;              // bf16 [T, q_heads, head_dim]
  const char* metadata = nullptr; // the step's region, cudnn_dense_metadata_layout(geometry)
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, block_size = 0, pages = 0;
  float scale = 0;
  CudnnDenseGeometry geometry;
};

// ---- cudnn_gathered: contiguous (gathered) ragged K/V ----

// The sizes one step's gathered cuDNN call is planned for.
struct CudnnGatheredGeometry {
  int64_t batch = 0;      // the step's requests, rounded up to a power of two
  int64_t max_q_len = 0;  // the longest request's query count, rounded up likewise
  int64_t max_k_len = 0;  // the longest request's key count (its k_len), rounded up likewise
};

// Whether the gathered call can take a step of `total_q` query rows of `q_row_elements`
// (Hq * D) and `total_k` key rows of `kv_row_elements` (Hkv * D): the offsets are int32.
bool cudnn_gathered_fits(int64_t total_q, int64_t q_row_elements, int64_t total_k, int64_t kv_row_elements);
CudnnGatheredGeometry cudnn_gathered_geometry(int64_t requests, int64_t max_q_len, int64_t max_k_len);

// Byte offsets of the gathered call's metadata in its region (each 256-byte aligned), all
// int32: seq_len_q, seq_len_kv [batch]; q_offsets, k_offsets [batch + 1] (element offsets,
// cuDNN's); k_rows [batch + 1] (row offsets: the gather's destination, KvGather::k_rows).
struct CudnnGatheredMetadataLayout {
  size_t seq_len_q = 0, seq_len_kv = 0, q_offsets = 0, k_offsets = 0, k_rows = 0, bytes = 0;
};
CudnnGatheredMetadataLayout cudnn_gathered_metadata_layout(const CudnnGatheredGeometry& g);

// Writes the gathered metadata of a step (the StepBatch's cu_seqlens_q [requests + 1] and
// seq_lens [requests]) into `dst` (layout's bytes, host staging). Request r's keys go to rows
// [sum of seq_lens before r, + seq_lens[r]); padded requests get no queries and no keys.
// Throws msa::Error when the step does not fit `g` or the int32 offsets.
void stage_cudnn_gathered_metadata(const CudnnGatheredGeometry& g, std::span<const int32_t> cu_seqlens_q,
                                   std::span<const int32_t> seq_lens, int64_t q_row_elements,
                                   int64_t kv_row_elements, char* dst);

// One gathered attention call: device pointers and the model's shape.
struct CudnnGatheredCall {
  const void* q = nullptr;         // bf16 [T, q_heads, head_dim]
  const void* k = nullptr;         // bf16 [total_k, kv_heads, head_dim] (the gather's output)
  const void* v = nullptr;
  void* o = nullptr;               // bf16 [T, q_heads, head_dim]
  const char* metadata = nullptr;  // the step's region, cudnn_gathered_metadata_layout(geometry)
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0;
  CudnnGatheredGeometry geometry;
};

// The plans of one model (both calls), built lazily per bucketed shape. Not thread-safe (like
// CudaModel). Exists in every CUDA build; in a build without cuDNN every call throws
// msa::Error.
class CudnnDenseAttention {
 public:
  CudnnDenseAttention();
  ~CudnnDenseAttention();
  CudnnDenseAttention(const CudnnDenseAttention&) = delete;
  CudnnDenseAttention& operator=(const CudnnDenseAttention&) = delete;

  // Builds (first use) the plan of `call`'s shape; returns the workspace it needs. Throws
  // msa::Error with cuDNN's reason when cuDNN does not support the shape.
  size_t prepare(const CudnnDenseCall& call);
  size_t prepare(const CudnnGatheredCall& call);
  // Enqueues the attention on `stream` (a cudaStream_t), after prepare(call), with a
  // workspace of at least prepare()'s bytes. Never synchronises.
  void run(const CudnnDenseCall& call, void* workspace, void* stream);
  void run(const CudnnGatheredCall& call, void* workspace, void* stream);
  int64_t plans() const;  // built so far, both calls

 private:
  struct Plans;
  std::unique_ptr<Plans> plans_;
};

}  // namespace msa::model::gpu
