// cuDNN SDPA backward through the cuDNN frontend graph API. See cudnn_sdpa_backward.h for
// the layouts; the pieces shared with the forward graph are in cudnn_sdpa_common.h.
#include "cudnn/cudnn_sdpa_backward.h"

#include <unordered_map>
#include <utility>

#include "cudnn/cudnn_sdpa_common.h"
#include "msa/error.h"

namespace msa::cuda {

using namespace cudnn_sdpa_detail;

struct CudnnSdpaBackward::State : BuiltGraph {};

CudnnSdpaBackward::CudnnSdpaBackward(const CudnnSdpaShape& shape, bool deterministic)
    : shape_(shape), deterministic_(deterministic), state_(std::make_unique<State>()) {
  validate(shape);
  MSA_CHECK_ARG(shape.block_size == 0, "cudnn sdpa backward block_size",
                "0 (contiguous K/V; no paged backward)", shape.block_size);
  const CudnnSdpaShape& s = shape_;
  const int64_t b = s.batch, hq = s.q_heads, hk = s.kv_heads, d = s.head_dim;
  const Layout4 q_layout = packed_bhsd(b, hq, s.q_len, d);   // q, o, grad_o, dq
  const Layout4 kv_layout = packed_bhsd(b, hk, s.k_len, d);  // k, v, dk, dv

  auto graph = new_bf16_graph();
  auto Q = add_tensor(*graph, "Q", kQ, q_layout);
  auto K = add_tensor(*graph, "K", kK, kv_layout);
  auto V = add_tensor(*graph, "V", kV, kv_layout);
  auto O = add_tensor(*graph, "O", kO, q_layout);
  auto dO = add_tensor(*graph, "dO", kGradO, q_layout);
  auto stats = add_tensor(*graph, "Stats", kStats, stats_bhsd(b, hq, s.q_len));
  stats->set_data_type(fe::DataType_t::FLOAT);

  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("msa_dense_baseline_backward")
                     .set_attn_scale(s.scale)
                     .set_deterministic_algorithm(deterministic);
  set_causal_mask(options, s);

  auto [dQ, dK, dV] = graph->sdpa_backward(Q, K, V, O, dO, stats, options);
  dQ->set_output(true).set_dim(q_layout.dim).set_stride(q_layout.stride).set_uid(kGradQ);
  dK->set_output(true).set_dim(kv_layout.dim).set_stride(kv_layout.stride).set_uid(kGradK);
  dV->set_output(true).set_dim(kv_layout.dim).set_stride(kv_layout.stride).set_uid(kGradV);
  state_->build(std::move(graph), "backward", s);
}

CudnnSdpaBackward::~CudnnSdpaBackward() = default;

void CudnnSdpaBackward::run(const CudnnSdpaBackwardArgs& a, void* stream) {
  MSA_CHECK_ARG(a.q && a.k && a.v && a.o && a.grad_o && a.stats && a.dq && a.dk && a.dv,
                "cudnn sdpa backward pointers", "q, k, v, o, grad_o, stats, dq, dk, dv set",
                "a null pointer");
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(a.q)},       {kK, const_cast<void*>(a.k)},
      {kV, const_cast<void*>(a.v)},       {kO, const_cast<void*>(a.o)},
      {kGradO, const_cast<void*>(a.grad_o)}, {kStats, const_cast<float*>(a.stats)},
      {kGradQ, a.dq},                     {kGradK, a.dk},
      {kGradV, a.dv},
  };
  state_->execute(pack, stream, "backward", shape_);
}

size_t CudnnSdpaBackward::workspace_bytes() const { return state_->workspace_bytes(); }

std::string CudnnSdpaBackward::plan_name() const { return state_->plan_name(); }

}  // namespace msa::cuda
