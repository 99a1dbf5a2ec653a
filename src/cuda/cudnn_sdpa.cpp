// cuDNN SDPA forward through the cuDNN frontend graph API (header-only, fetched into
// .deps/cudnn_frontend by scripts/install_deps.sh). See cudnn_sdpa.h for layouts.
#include "cuda/cudnn_sdpa.h"
#include "cuda/cuda_check.h"

#include <cuda_runtime.h>
#include <cudnn.h>

#include <cudnn_frontend.h>

#include <unordered_map>
#include <vector>

#include "msa/error.h"

namespace msa::cuda {

namespace fe = cudnn_frontend;

namespace {

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
};

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

// Frontend status -> msa::Error naming the step, the shape, the frontend's code and message
// and cuDNN's last error string.
void check(fe::error_t status, const char* step, const CudnnSdpaShape& s) {
  if (status.is_good()) return;
  char last[1024] = "";
  cudnnGetLastErrorString(last, sizeof last);
  MSA_FAIL("cuDNN SDPA ", step, " failed for batch ", s.batch, ", heads ", s.q_heads, "/",
           s.kv_heads, ", head dim ", s.head_dim, ", q_len ", s.q_len, ", k_len ", s.k_len,
           s.block_size ? " (paged)" : "", ": ", error_code_name(status.get_code()), ": ",
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
}

}  // namespace

struct CudnnSdpa::State {
  cudnnHandle_t handle = nullptr;
  std::shared_ptr<fe::graph::Graph> graph;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;

  ~State() {
    if (workspace) cudaFree(workspace);
    graph.reset();
    if (handle) cudnnDestroy(handle);
  }
};

CudnnSdpa::CudnnSdpa(const CudnnSdpaShape& shape) : shape_(shape), state_(std::make_unique<State>()) {
  validate(shape);
  const CudnnSdpaShape& s = shape_;
  const int64_t b = s.batch, hq = s.q_heads, hk = s.kv_heads, d = s.head_dim;
  const int64_t sq = s.q_len, sk = s.k_len;
  const bool paged = s.block_size > 0;

  MSA_CUDNN_CHECK(cudnnCreate(&state_->handle));
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);

  // q, o: ours [b * sq, hq, d] -> cuDNN [b, hq, sq, d].
  const std::vector<int64_t> q_dim{b, hq, sq, d}, q_stride{sq * hq * d, d, hq * d, 1};
  auto Q = graph->tensor(
      fe::graph::Tensor_attributes().set_name("Q").set_uid(kQ).set_dim(q_dim).set_stride(q_stride));
  std::shared_ptr<fe::graph::Tensor_attributes> K, V;
  if (paged) {  // [pages, hk, B, d], cuDNN's container layout exactly
    const int64_t B = s.block_size;
    const std::vector<int64_t> dim{s.pages, hk, B, d}, stride{hk * B * d, B * d, d, 1};
    K = graph->tensor(fe::graph::Tensor_attributes()
                          .set_name("container_K").set_uid(kK).set_dim(dim).set_stride(stride));
    V = graph->tensor(fe::graph::Tensor_attributes()
                          .set_name("container_V").set_uid(kV).set_dim(dim).set_stride(stride));
  } else {  // ours [b * sk, hk, d] -> cuDNN [b, hk, sk, d]
    const std::vector<int64_t> dim{b, hk, sk, d}, stride{sk * hk * d, d, hk * d, 1};
    K = graph->tensor(
        fe::graph::Tensor_attributes().set_name("K").set_uid(kK).set_dim(dim).set_stride(stride));
    V = graph->tensor(
        fe::graph::Tensor_attributes().set_name("V").set_uid(kV).set_dim(dim).set_stride(stride));
  }

  auto options = fe::graph::SDPA_attributes()
                     .set_name("msa_dense_baseline")
                     .set_generate_stats(s.with_stats)
                     .set_attn_scale(s.scale);
  // One query per request sees every key: no mask at all (the widest engine support).
  if (s.causal && sq > 1) {
    // Equal lengths without padding: both alignments coincide; top-left is the classic path.
    const auto alignment = (!paged && sq == sk) ? fe::DiagonalAlignment_t::TOP_LEFT
                                                : fe::DiagonalAlignment_t::BOTTOM_RIGHT;
    options.set_diagonal_alignment(alignment).set_diagonal_band_right_bound(0);
  }
  if (paged) {
    auto lengths = [&](const char* name, int64_t uid) {
      return graph->tensor(fe::graph::Tensor_attributes()
                               .set_name(name)
                               .set_uid(uid)
                               .set_dim({b, 1, 1, 1})
                               .set_stride({1, 1, 1, 1})
                               .set_data_type(fe::DataType_t::INT32));
    };
    options.set_padding_mask(true)
        .set_seq_len_q(lengths("seq_len_q", kSeqLenQ))
        .set_seq_len_kv(lengths("seq_len_kv", kSeqLenKv));
    auto table = [&](const char* name, int64_t uid) {
      return graph->tensor(fe::graph::Tensor_attributes()
                               .set_name(name)
                               .set_uid(uid)
                               .set_dim({b, 1, s.table_stride, 1})
                               .set_stride({s.table_stride, s.table_stride, 1, 1})
                               .set_data_type(fe::DataType_t::INT32));
    };
    options.set_paged_attention_k_table(table("page_table_k", kPageTableK));
    options.set_paged_attention_v_table(table("page_table_v", kPageTableV));
    options.set_paged_attention_max_seq_len_kv(static_cast<int>(sk));
  }

  auto [O, stats] = graph->sdpa(Q, K, V, options);
  O->set_output(true).set_dim(q_dim).set_stride(q_stride).set_uid(kO);
  if (s.with_stats)
    stats->set_output(true)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({b, hq, sq, 1})
        .set_stride({hq * sq, sq, 1, 1})
        .set_uid(kStats);

  check(graph->build(state_->handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "build", s);
  check(graph->get_workspace_size(state_->workspace_bytes), "get_workspace_size", s);
  if (state_->workspace_bytes > 0)
    MSA_CUDA_CHECK(
        cudaMalloc(&state_->workspace, static_cast<size_t>(state_->workspace_bytes)));
  state_->graph = std::move(graph);
}

CudnnSdpa::~CudnnSdpa() = default;

void CudnnSdpa::run(const CudnnSdpaArgs& args, void* stream) {
  const bool paged = shape_.block_size > 0;
  MSA_CHECK_ARG(args.q && args.k && args.v && args.o, "cudnn sdpa pointers", "q, k, v, o set",
                "a null pointer");
  MSA_CHECK_ARG(!shape_.with_stats || args.lse, "cudnn sdpa lse", "a pointer (with_stats)", "null");
  MSA_CHECK_ARG(!paged || (args.page_table && args.seq_len_q && args.seq_len_kv),
                "cudnn sdpa paged arguments", "page_table, seq_len_q and seq_len_kv set",
                "a null pointer");
  MSA_CUDNN_CHECK(cudnnSetStream(state_->handle, static_cast<cudaStream_t>(stream)));
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(args.q)},
      {kK, const_cast<void*>(args.k)},
      {kV, const_cast<void*>(args.v)},
      {kO, args.o},
  };
  if (shape_.with_stats) pack[kStats] = args.lse;
  if (paged) {
    pack[kPageTableK] = const_cast<int32_t*>(args.page_table);
    pack[kPageTableV] = const_cast<int32_t*>(args.page_table);
    pack[kSeqLenQ] = const_cast<int32_t*>(args.seq_len_q);
    pack[kSeqLenKv] = const_cast<int32_t*>(args.seq_len_kv);
  }
  check(state_->graph->execute(state_->handle, pack, state_->workspace), "execute", shape_);
}

size_t CudnnSdpa::workspace_bytes() const { return static_cast<size_t>(state_->workspace_bytes); }

std::string CudnnSdpa::plan_name() const {
  std::string name;
  if (state_->graph->get_plan_name(name).is_bad()) return "?";
  return name;
}

namespace {
std::vector<std::unique_ptr<CudnnSdpa>>& cache() {
  static std::vector<std::unique_ptr<CudnnSdpa>> objects;
  return objects;
}
}  // namespace

CudnnSdpa& CudnnSdpa::cached(const CudnnSdpaShape& shape) {
  for (const auto& object : cache())
    if (object->shape() == shape) return *object;
  cache().push_back(std::make_unique<CudnnSdpa>(shape));
  return *cache().back();
}

void CudnnSdpa::clear_cache() { cache().clear(); }

std::string cudnn_version_string() {
  const size_t v = cudnnGetVersion();  // major * 10000 + minor * 100 + patch (cuDNN 9)
  return detail::concat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

std::string cudnn_frontend_version_string() {
  return detail::concat(CUDNN_FRONTEND_MAJOR_VERSION, ".", CUDNN_FRONTEND_MINOR_VERSION, ".",
                        CUDNN_FRONTEND_PATCH_VERSION);
}

}  // namespace msa::cuda
