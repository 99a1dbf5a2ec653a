// The CUDA text model's dense causal attention on cuDNN's fused SDPA (src/cudnn/cudnn_sdpa.h)
// instead of our kernel, straight over the paged device KV cache: q packed [T, Hq, D] bf16
// (cuDNN's ragged THD layout, so prefill chunks and decode rows of different lengths share
// one call), K/V caches [pages, Hkv, B, D] through a page table, causal bottom-right (query i
// of a request sees keys t <= k_len - q_len + i), the bf16 output into our `o`.
//
// Why it exists: on contiguous K/V with equal query counts (the kernel benchmark's baseline)
// cuDNN's SDPA runs dense causal prefill at 550-650 TFLOP/s where ours runs ~340. Through
// this path (paged K/V, ragged Q/O, bucketed plans) it measured slower than ours in the model
// (H200, m3-layer dense layer, msa bench-model): 1110 vs 851 ms at 128K prefill, 63.5 vs
// 52.8 ms at 32K, 2.97 vs 0.089 ms per decode token at 128K. So DenseAttentionEngine::automatic
// (msa/model.h) runs ours; this engine runs only when asked for (cudnn).
//
// Plans: cuDNN compiles a kernel per graph shape, which costs far more than a step, so the
// sizes a plan bakes in are bucketed to powers of two (requests, the longest query count,
// the page-table stride, hence max_seq_len_kv = stride * B): a serving process builds a few
// plans per (batch, chunk) size class rather than one per step. The padded requests have
// seq_len_q = seq_len_kv = 0 (cuDNN writes nothing for them). The frontend's dynamic shapes
// + kernel cache would avoid even that, but its unified SDPA node refuses dynamic shapes and
// the composite node's support of them with paged K/V and ragged Q is undocumented: not used.
//
// The step's cuDNN metadata (int32: seq_len_q, seq_len_kv, the Q/O offsets, the page table
// at the bucketed stride) is staged by the host with the step's other metadata and uploaded
// in the same copy (CudaModel::upload_step), so no extra host round trip. Host-only header.
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

// The plans of one model, built lazily per bucketed shape. Not thread-safe (like CudaModel).
// Exists in every CUDA build; in a build without cuDNN every call throws msa::Error.
class CudnnDenseAttention {
 public:
  CudnnDenseAttention();
  ~CudnnDenseAttention();
  CudnnDenseAttention(const CudnnDenseAttention&) = delete;
  CudnnDenseAttention& operator=(const CudnnDenseAttention&) = delete;

  // Builds (first use) the plan of `call`'s shape; returns the workspace it needs. Throws
  // msa::Error with cuDNN's reason when cuDNN does not support the shape.
  size_t prepare(const CudnnDenseCall& call);
  // Enqueues the attention on `stream` (a cudaStream_t), after prepare(call), with a
  // workspace of at least prepare()'s bytes. Never synchronises.
  void run(const CudnnDenseCall& call, void* workspace, void* stream);
  int64_t plans() const;  // built so far

 private:
  struct Plans;
  std::unique_ptr<Plans> plans_;
};

}  // namespace msa::model::gpu
