// The cuDNN SDPA graphs' shared pieces (cudnn_sdpa_common.h).
#include "cudnn/cudnn_sdpa_common.h"

#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/cuda_check.h"

namespace msa::cuda::cudnn_sdpa_detail {

namespace {

const char* error_code_name(fe::error_code_t code) {
  switch (code) {
    case fe::error_code_t::OK: return "OK";
    case fe::error_code_t::ATTRIBUTE_NOT_SET: return "ATTRIBUTE_NOT_SET";
    case fe::error_code_t::SHAPE_DEDUCTION_FAILED: return "SHAPE_DEDUCTION_FAILED";
    case fe::error_code_t::INVALID_TENSOR_NAME: return "INVALID_TENSOR_NAME";
    case fe::error_code_t::INVALID_VARIANT_PACK: return "INVALID_VARIANT_PACK";
    case fe::error_code_t::GRAPH_NOT_SUPPORTED: return "GRAPH_NOT_SUPPORTED";
    case fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED:
      return "GRAPH_EXECUTION_PLAN_CREATION_FAILED";
    case fe::error_code_t::GRAPH_EXECUTION_FAILED: return "GRAPH_EXECUTION_FAILED";
    case fe::error_code_t::HEURISTIC_QUERY_FAILED: return "HEURISTIC_QUERY_FAILED";
    case fe::error_code_t::UNSUPPORTED_GRAPH_FORMAT: return "UNSUPPORTED_GRAPH_FORMAT";
    case fe::error_code_t::CUDA_API_FAILED: return "CUDA_API_FAILED";
    case fe::error_code_t::CUDNN_BACKEND_API_FAILED: return "CUDNN_BACKEND_API_FAILED";
    case fe::error_code_t::INVALID_CUDA_DEVICE: return "INVALID_CUDA_DEVICE";
    case fe::error_code_t::HANDLE_ERROR: return "HANDLE_ERROR";
    case fe::error_code_t::INVALID_VALUE: return "INVALID_VALUE";
    case fe::error_code_t::NVRTC_COMPILATION_FAILED: return "NVRTC_COMPILATION_FAILED";
  }
  return "unknown";
}

}  // namespace

void check(fe::error_t status, const char* step, const CudnnSdpaShape& s) {
  if (status.is_good()) return;
  char last[1024] = "";
  cudnnGetLastErrorString(last, sizeof last);
  MSA_FAIL("cuDNN SDPA ", step, " failed for batch ", s.batch, ", heads ", s.q_heads, "/",
           s.kv_heads, ", head dim ", s.head_dim, ", q_len ", s.q_len, ", k_len ", s.k_len,
           s.block_size ? " (paged)" : "", s.ragged_kv ? " (ragged kv)" : "", ": ", error_code_name(status.get_code()), ": ",
           status.get_message(), last[0] ? std::string(" [cuDNN: ") + last + "]" : std::string());
}

void validate(const CudnnSdpaShape& s) {
  MSA_CHECK_ARG(s.batch >= 1, "cudnn sdpa batch", ">= 1", s.batch);
  MSA_CHECK_ARG(s.q_heads >= 1 && s.kv_heads >= 1 && s.q_heads % s.kv_heads == 0,
                "cudnn sdpa heads", "q_heads a positive multiple of kv_heads",
                detail::concat(s.q_heads, "/", s.kv_heads));
  MSA_CHECK_ARG(s.head_dim >= 8 && s.head_dim % 8 == 0, "cudnn sdpa head_dim",
                "a multiple of 8", s.head_dim);
  MSA_CHECK_ARG(s.q_len >= 1 && s.k_len >= 1, "cudnn sdpa lengths", "positive",
                detail::concat(s.q_len, "/", s.k_len));
  MSA_CHECK_ARG(!s.causal || s.q_len <= s.k_len, "cudnn sdpa q_len",
                "<= k_len (bottom-right causal)", detail::concat(s.q_len, " > ", s.k_len));
  if (s.block_size > 0) {
    MSA_CHECK_ARG(s.pages >= 1 && s.table_stride >= 1, "cudnn sdpa paged cache",
                  "pages >= 1 and table_stride >= 1",
                  detail::concat(s.pages, " pages, stride ", s.table_stride));
    MSA_CHECK_ARG(s.k_len == s.table_stride * s.block_size, "cudnn sdpa k_len (paged)",
                  s.table_stride * s.block_size, s.k_len);
  }
  MSA_CHECK_ARG(!s.ragged_q || s.block_size > 0 || s.ragged_kv, "cudnn sdpa ragged_q",
                "a paged or ragged kv shape (the ragged layout needs the padding mask's seq_len_q)",
                "contiguous K/V");
  MSA_CHECK_ARG(!s.ragged_kv || (s.block_size == 0 && s.ragged_q), "cudnn sdpa ragged_kv",
                "contiguous K/V (block_size 0) with ragged_q",
                detail::concat("block_size ", s.block_size, s.ragged_q ? ", ragged_q" : ", without ragged_q"));
  MSA_CHECK_ARG(!s.ragged_q || !s.with_stats, "cudnn sdpa ragged_q", "without stats",
                "with_stats");
}

Layout4 packed_bhsd(int64_t batch, int64_t heads, int64_t len, int64_t dim) {
  return {{batch, heads, len, dim}, {len * heads * dim, dim, heads * dim, 1}};
}

Layout4 stats_bhsd(int64_t batch, int64_t heads, int64_t len) {
  return {{batch, heads, len, 1}, {heads * len, len, 1, 1}};
}

TensorPtr add_tensor(fe::graph::Graph& graph, const char* name, int64_t uid, const Layout4& layout) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(layout.dim)
                          .set_stride(layout.stride));
}

std::shared_ptr<fe::graph::Graph> new_bf16_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

BuiltGraph::BuiltGraph() { MSA_CUDNN_CHECK(cudnnCreate(&handle_)); }

BuiltGraph::~BuiltGraph() {
  if (workspace_) cudaFree(workspace_);
  graph_.reset();
  if (handle_) cudnnDestroy(handle_);
}

void BuiltGraph::build(std::shared_ptr<fe::graph::Graph> graph, const char* what,
                       const CudnnSdpaShape& s) {
  const std::string step = std::string(what) + " build";
  check(graph->build(handle_, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), step.c_str(), s);
  check(graph->get_workspace_size(workspace_bytes_), (std::string(what) + " workspace size").c_str(), s);
  if (workspace_bytes_ > 0 && !s.external_workspace)
    MSA_CUDA_CHECK(cudaMalloc(&workspace_, static_cast<size_t>(workspace_bytes_)));
  graph_ = std::move(graph);
}

void BuiltGraph::execute(std::unordered_map<int64_t, void*>& pack, void* stream, const char* what,
                         const CudnnSdpaShape& s, void* workspace) {
  if (s.external_workspace)
    MSA_CHECK_ARG(workspace || workspace_bytes_ == 0, "cudnn sdpa workspace",
                  detail::concat(workspace_bytes_, " bytes (external_workspace)"), "a null pointer");
  MSA_CUDNN_CHECK(cudnnSetStream(handle_, static_cast<cudaStream_t>(stream)));
  check(graph_->execute(handle_, pack, s.external_workspace ? workspace : workspace_),
        (std::string(what) + " execute").c_str(), s);
}

std::string BuiltGraph::plan_name() const {
  std::string name;
  if (!graph_ || graph_->get_plan_name(name).is_bad()) return "?";
  return name;
}

}  // namespace msa::cuda::cudnn_sdpa_detail
