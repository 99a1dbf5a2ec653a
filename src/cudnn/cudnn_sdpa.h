// cuDNN's fused flash-attention forward (cuDNN 9 SDPA through the cuDNN frontend graph API):
// the dense causal GQA baseline our kernels are measured against. Host-only header: no
// CUDA or cuDNN headers, so any host file may include it; implemented in cudnn_sdpa.cpp,
// which exists in builds with MSA_WITH_CUDNN defined. The backward graph (training baseline):
// cudnn_sdpa_backward.h; what both graphs share: cudnn_sdpa_common.h.
//
// Layouts are ours, passed to cuDNN as strides (no copies, no transposes); bf16 values:
//   contiguous: q, o [batch * q_len, q_heads, head_dim] (request b's queries are rows
//               [b * q_len, (b + 1) * q_len)); k, v [batch * k_len, kv_heads, head_dim];
//   paged:      q, o as above; k, v caches [pages, kv_heads, block_size, head_dim];
//               page_table int32 [batch, table_stride] (logical block -> page).
//   ragged q:   (paged only) q, o [total_q, q_heads, head_dim] with request b's queries at
//               rows [q_offsets[b], q_offsets[b + 1]) / (q_heads * head_dim) (cuDNN's THD
//               layout: q_offsets int32 [batch + 1] element offsets); q_len is then the
//               longest request's query count, the real counts come in seq_len_q. Requests
//               of a step may so have different query counts (prefill chunks with decode
//               rows), and a request with seq_len_q = seq_len_kv = 0 is padding.
//   ragged kv:  (contiguous only) k, v [total_k, kv_heads, head_dim] with request b's keys at
//               rows [k_offsets[b], k_offsets[b + 1]) / (kv_heads * head_dim) (THD again:
//               k_offsets int32 [batch + 1] element offsets, the same for v); k_len is then
//               the longest request's key count, the real counts come in seq_len_kv. Needs
//               ragged q (both sides padded by the same lengths).
// Masking: causal, bottom-right aligned (query i of a request sees keys t <= k_len - q_len
// + i, our convention), through cuDNN's DiagonalAlignment_t::BOTTOM_RIGHT with a right
// bound of 0. Optional stats: the natural-log LSE of the scaled logits, f32, in cuDNN's
// layout [batch, q_heads, q_len] (not ours: [total_q, q_heads]).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace msa::cuda {

struct CudnnSdpaShape {
  int64_t batch = 1;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_len = 0;  // queries per request (equal for all requests)
  int64_t k_len = 0;  // keys per request: contiguous, the exact length; paged, the maximum
                      // (table_stride * block_size); ragged kv, the maximum; the real
                      // lengths come at run time
  float scale = 0;
  bool causal = true;        // bottom-right aligned; needs q_len <= k_len
  bool with_stats = false;   // write the LSE
  // Paged K/V (block_size > 0): caches of `pages` pages; adds cuDNN's padding mask with
  // per-request lengths (device int32 [batch] each) given to run().
  int64_t block_size = 0;
  int64_t pages = 0;
  int64_t table_stride = 0;
  bool ragged_q = false;  // q and o in the THD layout above (paged or ragged kv)
  // k and v in the THD layout above (contiguous, with ragged_q): adds the padding mask with
  // per-request lengths like a paged shape.
  bool ragged_kv = false;
  // The caller passes the workspace (CudnnSdpaArgs::workspace, workspace_bytes() of it)
  // instead of the object allocating its own: a runtime grows one buffer for all its plans.
  bool external_workspace = false;

  bool operator==(const CudnnSdpaShape&) const = default;
};

// Device pointers of one call. `lse` only with shape.with_stats; the paged fields only for
// a paged shape (the lengths also for a ragged kv one).
struct CudnnSdpaArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  const int32_t* page_table = nullptr;  // [batch, table_stride]
  const int32_t* seq_len_q = nullptr;   // [batch] queries per request (paged or ragged_kv)
  const int32_t* seq_len_kv = nullptr;  // [batch] keys per request (paged or ragged_kv)
  const int32_t* q_offsets = nullptr;   // [batch + 1] element offsets (ragged_q only)
  const int32_t* k_offsets = nullptr;   // [batch + 1] element offsets of k and v (ragged_kv only)
  void* workspace = nullptr;            // workspace_bytes() (external_workspace only)
};

// One cuDNN SDPA forward graph for one shape: built (heuristics, plan compilation) in the
// constructor, so construction is the warm-up; run() only binds pointers and launches.
// Owns its cuDNN handle and workspace. Every failure throws msa::Error with cuDNN's message.
class CudnnSdpa {
 public:
  explicit CudnnSdpa(const CudnnSdpaShape& shape);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // Enqueues the attention on `stream` (a cudaStream_t; null = the legacy default stream).
  // Never synchronises; graph-capturable when the chosen cuDNN engine is.
  void run(const CudnnSdpaArgs& args, void* stream);
  // Contiguous shapes: the brief form.
  void run(const void* q, const void* k, const void* v, void* o, void* stream,
           float* lse = nullptr) {
    run(CudnnSdpaArgs{q, k, v, o, lse}, stream);
  }

  const CudnnSdpaShape& shape() const { return shape_; }
  size_t workspace_bytes() const;
  std::string plan_name() const;  // the engine cuDNN chose

  // The process-wide object for `shape`, built on first use (not thread-safe).
  static CudnnSdpa& cached(const CudnnSdpaShape& shape);
  static void clear_cache();

 private:
  struct State;
  CudnnSdpaShape shape_;
  std::unique_ptr<State> state_;
};

// "9.19.0" (the loaded library, cudnnGetVersion) and the frontend's version.
std::string cudnn_version_string();
std::string cudnn_frontend_version_string();

}  // namespace msa::cuda
