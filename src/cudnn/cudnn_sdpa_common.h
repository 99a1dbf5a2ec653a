// What the cuDNN SDPA forward (cudnn_sdpa.cpp) and backward (cudnn_sdpa_backward.cpp) graphs
// share: tensor uids, error checks with the shape in the message, our packed layouts as cuDNN
// [batch, heads, len, dim] strides, the causal mask, and a built graph with its handle and
// workspace. Internal to those files (includes the cuDNN frontend); see cudnn_sdpa.h for the
// layouts and the mask convention.
#pragma once
#include <cudnn.h>

#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cudnn/cudnn_sdpa.h"
#include "msa/error.h"

#define MSA_CUDNN_CHECK(call)                                                          \
  do {                                                                                 \
    const cudnnStatus_t msa_cudnn_status = (call);                                     \
    if (msa_cudnn_status != CUDNN_STATUS_SUCCESS) {                                    \
      char msa_cudnn_last[1024] = "";                                                  \
      cudnnGetLastErrorString(msa_cudnn_last, sizeof msa_cudnn_last);                  \
      MSA_FAIL("cuDNN error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",          \
               cudnnGetErrorString(msa_cudnn_status), " ", msa_cudnn_last);            \
    }                                                                                  \
  } while (0)

namespace msa::cuda::cudnn_sdpa_detail {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum Uid : int64_t {
  kQ = 1,
  kK = 2,
  kV = 3,
  kO = 4,
  kStats = 5,
  kSeqLenQ = 7,
  kSeqLenKv = 8,
  kPageTableK = 9,
  kPageTableV = 10,
  kGradO = 11,
  kGradQ = 12,
  kGradK = 13,
  kGradV = 14,
  kQOffsets = 15,
  kOOffsets = 16,
  kKOffsets = 17,
  kVOffsets = 18,
};

// Frontend status -> msa::Error naming the step, the shape, the frontend's code and message
// and cuDNN's last error string.
void check(fe::error_t status, const char* step, const CudnnSdpaShape& s);

// The shape's own consistency (heads, dims, lengths, paged fields).
void validate(const CudnnSdpaShape& s);

// Dims and strides of one 4-d cuDNN tensor.
struct Layout4 {
  std::vector<int64_t> dim, stride;
};
// Ours [batch * len, heads, dim] (request b's rows [b * len, (b + 1) * len)) as cuDNN's
// [batch, heads, len, dim], by strides only.
Layout4 packed_bhsd(int64_t batch, int64_t heads, int64_t len, int64_t dim);
// The softmax stats (LSE, f32) [batch, heads, len, 1], packed (cuDNN's own layout).
Layout4 stats_bhsd(int64_t batch, int64_t heads, int64_t len);

// A named tensor of `layout` in `graph`, of the graph's io data type.
TensorPtr add_tensor(fe::graph::Graph& graph, const char* name, int64_t uid, const Layout4& layout);

// A graph of bf16 tensors with f32 intermediates and compute.
std::shared_ptr<fe::graph::Graph> new_bf16_graph();

// The causal mask of `s` on forward (SDPA_attributes) or backward attributes alike. One query
// per request sees every key: no mask at all (the widest engine support). Equal lengths
// without padding: both alignments coincide and top-left is the classic path.
template <class Attributes>
void set_causal_mask(Attributes& options, const CudnnSdpaShape& s) {
  if (!s.causal || s.q_len <= 1) return;
  // With the padding mask (paged or ragged kv) the real lengths differ from q_len / k_len:
  // only bottom-right alignment follows them.
  const bool padded = s.block_size > 0 || s.ragged_kv;
  const auto alignment = (!padded && s.q_len == s.k_len) ? fe::DiagonalAlignment_t::TOP_LEFT
                                                         : fe::DiagonalAlignment_t::BOTTOM_RIGHT;
  options.set_diagonal_alignment(alignment).set_diagonal_band_right_bound(0);
}

// One built graph: its own cuDNN handle, the graph and its workspace.
class BuiltGraph {
 public:
  BuiltGraph();
  ~BuiltGraph();
  BuiltGraph(const BuiltGraph&) = delete;
  BuiltGraph& operator=(const BuiltGraph&) = delete;

  cudnnHandle_t handle() const { return handle_; }
  // Validates and builds `graph` (heuristics A, then the fallback list) and allocates its
  // workspace (unless s.external_workspace); `what` and `s` name the graph in errors.
  void build(std::shared_ptr<fe::graph::Graph> graph, const char* what, const CudnnSdpaShape& s);
  // Binds `pack` (uid -> device pointer) and launches on `stream` (a cudaStream_t), with
  // `workspace` (external_workspace) or the graph's own.
  void execute(std::unordered_map<int64_t, void*>& pack, void* stream, const char* what,
               const CudnnSdpaShape& s, void* workspace = nullptr);
  size_t workspace_bytes() const { return static_cast<size_t>(workspace_bytes_); }
  std::string plan_name() const;

 private:
  cudnnHandle_t handle_ = nullptr;
  std::shared_ptr<fe::graph::Graph> graph_;
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;
};

}  // namespace msa::cuda::cudnn_sdpa_detail
