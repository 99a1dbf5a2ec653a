// cuDNN SDPA forward through the cuDNN frontend graph API (header-only, fetched into
// .deps/cudnn_frontend by scripts/install_deps.sh). See cudnn_sdpa.h for layouts.
#include "cudnn/cudnn_sdpa.h"

#include <cuda_runtime.h>

#include <vector>

#include "cudnn/cudnn_sdpa_common.h"
#include "msa/error.h"

namespace msa::cuda {

using namespace cudnn_sdpa_detail;

struct CudnnSdpa::State : BuiltGraph {};

CudnnSdpa::CudnnSdpa(const CudnnSdpaShape& shape) : shape_(shape), state_(std::make_unique<State>()) {
  validate(shape);
  const CudnnSdpaShape& s = shape_;
  const int64_t b = s.batch, hq = s.q_heads, hk = s.kv_heads, d = s.head_dim;
  const int64_t sq = s.q_len, sk = s.k_len;
  const bool paged = s.block_size > 0;
  const bool padded = paged || s.ragged_kv;  // per-request lengths: the padding mask

  auto graph = new_bf16_graph();
  const Layout4 q_layout = packed_bhsd(b, hq, sq, d);  // q and o
  auto Q = add_tensor(*graph, "Q", kQ, q_layout);
  TensorPtr K, V;
  if (paged) {  // [pages, hk, B, d], cuDNN's container layout exactly
    const int64_t B = s.block_size;
    const Layout4 cache{{s.pages, hk, B, d}, {hk * B * d, B * d, d, 1}};
    K = add_tensor(*graph, "container_K", kK, cache);
    V = add_tensor(*graph, "container_V", kV, cache);
  } else {
    const Layout4 kv_layout = packed_bhsd(b, hk, sk, d);
    K = add_tensor(*graph, "K", kK, kv_layout);
    V = add_tensor(*graph, "V", kV, kv_layout);
  }

  auto options = fe::graph::SDPA_attributes()
                     .set_name("msa_dense_baseline")
                     .set_generate_stats(s.with_stats)
                     .set_attn_scale(s.scale);
  set_causal_mask(options, s);
  if (padded) {
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
  }
  if (paged) {
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

  // Ragged Q / O (and K / V): the layout's batch stride is never used, each request starts
  // at its offset. One offset tensor per operand (as the frontend wants them), Q's and O's
  // bound to the same device array, K's and V's to another.
  auto offsets = [&](const char* name, int64_t uid) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({b + 1, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::INT32));
  };
  if (s.ragged_q) Q->set_ragged_offset(offsets("q_offsets", kQOffsets));
  if (s.ragged_kv) {
    K->set_ragged_offset(offsets("k_offsets", kKOffsets));
    V->set_ragged_offset(offsets("v_offsets", kVOffsets));
  }

  auto [O, stats] = graph->sdpa(Q, K, V, options);
  O->set_output(true).set_dim(q_layout.dim).set_stride(q_layout.stride).set_uid(kO);
  if (s.ragged_q) O->set_ragged_offset(offsets("o_offsets", kOOffsets));
  if (s.with_stats) {
    const Layout4 stats_layout = stats_bhsd(b, hq, sq);
    stats->set_output(true)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_layout.dim)
        .set_stride(stats_layout.stride)
        .set_uid(kStats);
  }
  state_->build(std::move(graph), "forward", s);
}

CudnnSdpa::~CudnnSdpa() = default;

void CudnnSdpa::run(const CudnnSdpaArgs& args, void* stream) {
  const bool paged = shape_.block_size > 0;
  const bool padded = paged || shape_.ragged_kv;
  MSA_CHECK_ARG(args.q && args.k && args.v && args.o, "cudnn sdpa pointers", "q, k, v, o set",
                "a null pointer");
  MSA_CHECK_ARG(!shape_.with_stats || args.lse, "cudnn sdpa lse", "a pointer (with_stats)", "null");
  MSA_CHECK_ARG(!paged || (args.page_table && args.seq_len_q && args.seq_len_kv),
                "cudnn sdpa paged arguments", "page_table, seq_len_q and seq_len_kv set",
                "a null pointer");
  MSA_CHECK_ARG(!shape_.ragged_kv || (args.seq_len_q && args.seq_len_kv && args.k_offsets),
                "cudnn sdpa ragged kv arguments", "seq_len_q, seq_len_kv and k_offsets set",
                "a null pointer");
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(args.q)},
      {kK, const_cast<void*>(args.k)},
      {kV, const_cast<void*>(args.v)},
      {kO, args.o},
  };
  MSA_CHECK_ARG(!shape_.ragged_q || args.q_offsets, "cudnn sdpa q_offsets", "a pointer (ragged_q)", "null");
  if (shape_.with_stats) pack[kStats] = args.lse;
  if (shape_.ragged_q) {
    pack[kQOffsets] = const_cast<int32_t*>(args.q_offsets);
    pack[kOOffsets] = const_cast<int32_t*>(args.q_offsets);
  }
  if (shape_.ragged_kv) {
    pack[kKOffsets] = const_cast<int32_t*>(args.k_offsets);
    pack[kVOffsets] = const_cast<int32_t*>(args.k_offsets);
  }
  if (padded) {
    pack[kSeqLenQ] = const_cast<int32_t*>(args.seq_len_q);
    pack[kSeqLenKv] = const_cast<int32_t*>(args.seq_len_kv);
  }
  if (paged) {
    pack[kPageTableK] = const_cast<int32_t*>(args.page_table);
    pack[kPageTableV] = const_cast<int32_t*>(args.page_table);
  }
  state_->execute(pack, stream, "forward", shape_, args.workspace);
}

size_t CudnnSdpa::workspace_bytes() const { return state_->workspace_bytes(); }

std::string CudnnSdpa::plan_name() const { return state_->plan_name(); }

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
