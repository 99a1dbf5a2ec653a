// cuDNN's fused flash-attention backward (cuDNN 9 SDPA backward through the cuDNN frontend
// graph API): the dense causal GQA training baseline. Host-only header like cudnn_sdpa.h;
// implemented in cudnn_sdpa_backward.cpp (builds with MSA_WITH_CUDNN only).
//
// Contiguous layouts only (CudnnSdpaShape with block_size 0), ours, passed as strides; bf16:
//   q, o, grad_o, dq [batch * q_len, q_heads, head_dim]; k, v, dk, dv [batch * k_len,
//   kv_heads, head_dim] (dk, dv summed over each group's query heads by cuDNN).
// stats: the forward's natural-log LSE, f32, cuDNN's layout [batch, q_heads, q_len] as a
// CudnnSdpa forward of the same shape with with_stats writes it (training mode). The causal
// mask is the forward's (cudnn_sdpa.h). Equal-length batches only: a packed varlen batch of
// B sequences of n tokens is the same as batch B of length n.
#pragma once
#include <memory>
#include <string>

#include "cudnn/cudnn_sdpa.h"

namespace msa::cuda {

// Device pointers of one backward call.
struct CudnnSdpaBackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* grad_o = nullptr;
  const float* stats = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};

// One cuDNN SDPA backward graph for one shape: built in the constructor (heuristics, plan
// compilation), run() only binds pointers and launches. `deterministic` asks cuDNN for its
// deterministic dQ algorithm. shape.with_stats is ignored (the stats are an input). Owns its
// cuDNN handle and workspace; every failure (an unsupported shape included) throws
// msa::Error with cuDNN's message.
class CudnnSdpaBackward {
 public:
  explicit CudnnSdpaBackward(const CudnnSdpaShape& shape, bool deterministic = false);
  ~CudnnSdpaBackward();
  CudnnSdpaBackward(const CudnnSdpaBackward&) = delete;
  CudnnSdpaBackward& operator=(const CudnnSdpaBackward&) = delete;

  // Enqueues the backward on `stream` (a cudaStream_t); never synchronises.
  void run(const CudnnSdpaBackwardArgs& args, void* stream);

  const CudnnSdpaShape& shape() const { return shape_; }
  bool deterministic() const { return deterministic_; }
  size_t workspace_bytes() const;
  std::string plan_name() const;

 private:
  struct State;
  CudnnSdpaShape shape_;
  bool deterministic_;
  std::unique_ptr<State> state_;
};

}  // namespace msa::cuda
