// The CUDA forward step (see cuda_model.h). Per layer, on one stream:
//   xn = norm(x)                          rms_norm_rows                         bf16
//   proj = xn [q;k;v(;iq;ik)]^T           one cuBLASLt GEMM                     f32
//   q, k -> cache, v -> cache, (iq, ik -> index cache): head_norm_rope          bf16
//   attention (dense) or indexer + sparse attention (src/cuda/launch.h)       bf16 o
//   x += o_proj(o)                        GEMM accumulating into x (beta = 1)
//   xn = norm(x)                          (+ f32 copy for the router on MoE layers)
//   dense MLP: x += down(swiglu(xn [gate;up]^T))
//   MoE: router GEMM (f32) -> dispatch (top-k, sort by expert, gather) -> the routed
//        experts' gate_up, swiglu, down (decode-sized steps: one launch each, offsets read
//        on the device; larger: the host reads the offsets, one sync per MoE layer, and runs
//        a GEMM per expert) -> x += shared expert + sum_j w_j * expert_j (combine)
// With a tap, each branch goes to a scratch buffer first (observed, then added to x). One rank
// of a parallel model (docs/parallel.md) also writes its branches to the scratch buffer: its
// partial sums, completed by the communicator's all-reduce before they are added; its MoE is
// expert_parallel_moe.
#include "cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "cuda/common/cuda_check.h"
#include "cuda/common/sequence_geometry.h"
#include "cuda/common/workspace_layout.h"
#include "event_pool.h"
#include "expert_weights.h"
#include "cuda/launch.h"
#include "dense_attention_cudnn.h"
#include "gemm.h"
#include "kernels.h"
#include "kv_gather.h"
#include "model/step_batch.h"
#include "model/tensor_math.h"
#include "msa/cuda/decode_plan.h"
#include "msa/cuda/quantize.h"

namespace msa::model::gpu {

namespace {

// Grows `buffer` to at least `bytes` (contents are not kept).
void ensure(DeviceBuffer& buffer, size_t bytes) {
  if (buffer.bytes() >= bytes) return;
  buffer = DeviceBuffer();  // free first: the old and new buffers need not coexist
  buffer = DeviceBuffer(bytes + bytes / 8);
}

}  // namespace

const char* layer_part_name(LayerPart part) {
  switch (part) {
    case LayerPart::attention: return "attention";
    case LayerPart::indexer: return "indexer";
    case LayerPart::ffn: return "ffn";
    case LayerPart::other: return "other";
  }
  return "?";
}

namespace {

// What the kernels take (src/cuda/attention/attention.cu, src/cuda/indexer/indexer.cu;
// kernels.h): refused at load rather than at the first step.
void check_cuda_support(const ModelConfig& c) {
  c.validate();
  auto one_of = [](int64_t value, const char* field) {
    if (value != 64 && value != 128)
      throw_arg_error(std::string("config.") + field, "64 or 128 (the CUDA attention kernels)", value);
  };
  one_of(c.head_dim, "head_dim");
  one_of(c.block_size, "index_block_size (KV page size)");
  if (c.num_heads / c.num_kv_heads > 16)
    throw_arg_error("config.num_attention_heads / num_key_value_heads",
                    "a GQA group of at most 16 (the CUDA attention kernels)", c.num_heads / c.num_kv_heads);
  if (c.any_sparse_layer()) {
    one_of(c.index_head_dim, "index_head_dim");
    if (c.topk_blocks > 32) throw_arg_error("config.index_topk_blocks", "at most 32 (the CUDA indexer)", c.topk_blocks);
  }
  for (bool moe : c.moe_layers) {
    if (moe && c.experts_per_token > kMaxExpertsPerToken)
      throw_arg_error("config.num_experts_per_tok",
                      "at most " + std::to_string(kMaxExpertsPerToken) + " (the CUDA MoE routing)",
                      c.experts_per_token);
    if (moe && c.num_experts > kMaxRoutedExperts)
      throw_arg_error("config.num_local_experts",
                      "at most " + std::to_string(kMaxRoutedExperts) + " (the CUDA MoE routing)", c.num_experts);
  }
}

}  // namespace

namespace {

// Everything one step needs on the device, as offsets into State::activations. The
// metadata comes first so that one host-to-device copy of [0, meta_end) uploads it.
struct StepLayout {
  // metadata (uploaded)
  size_t tokens, positions, slots, q_start, k_len, seq_of_query, page_table, logit_rows;
  size_t cu_seqlens_q, seq_lens;  // int32, decode-plan steps only (DecodeStep's inputs)
  size_t meta_end;
  // activations
  size_t x, branch, xn, xn_f32, proj, q, qi, topk, attn_lse, o, gate_up, act;
  size_t k_new, v_new;  // fp8 caches: the new tokens' K and V (bf16) before append_kv_fp8 quantizes them
  size_t router_logits, entry_weight, entry_row, offsets, x_sorted, y_sorted;
  size_t all_offsets, x_recv, y_recv;  // expert parallel: every rank's offsets, the rows received
  size_t peer_offsets;  // expert parallel, quantized experts: each peer's offsets of this rank's experts
  size_t normed, normed_f32, logits;
  size_t cudnn_meta;  // the cuDNN dense attention's metadata (dense_attention_cudnn.h, either call)
  size_t total;
};

struct StepShape {
  int64_t T = 0, R = 0, batch = 0, max_pages = 0;
  bool tap = false;
  int world = 0;  // > 0: one rank of a parallel model of this many ranks
  bool decode_plan = false;  // attention through DecodePlan (a decode graph's bucket)
  size_t cudnn_meta_bytes = 0;  // 0: dense attention runs ours this step
  bool fp8_kv = false;  // the cache holds e4m3 K/V (KvCache DType::e4m3)
};

StepLayout plan_step(const ModelConfig& c, const StepShape& s) {
  bool any_moe = false, any_dense_mlp = false, any_sparse = false;
  int64_t proj_cols = 0;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    (c.moe_layers[layer] ? any_moe : any_dense_mlp) = true;
    any_sparse |= static_cast<bool>(c.sparse_layers[layer]);
    int64_t cols = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    if (c.sparse_layers[layer]) cols += (c.index_heads + 1) * c.index_head_dim;
    proj_cols = std::max(proj_cols, cols);
  }
  const int64_t T = s.T, H = c.hidden_size, QD = c.num_heads * c.head_dim;
  const int64_t N = any_moe ? T * c.experts_per_token : 0;  // MoE entries
  int64_t gate_up = 0;
  if (any_dense_mlp) gate_up = std::max(gate_up, T * 2 * c.dense_intermediate_size);
  if (any_moe) {
    gate_up = std::max(gate_up, N * 2 * c.moe_intermediate_size);
    gate_up = std::max(gate_up, T * 2 * c.shared_intermediate_size);
  }
  StepLayout l{};
  msa::cuda::WorkspaceCursor a;  // 256-byte aligned regions of one device allocation
  l.tokens = a.take_elements<int32_t>(T);
  l.positions = a.take_elements<int64_t>(T);
  l.slots = a.take_elements<int64_t>(T);
  l.q_start = a.take_elements<int64_t>(s.batch + 1);
  l.k_len = a.take_elements<int64_t>(s.batch);
  l.seq_of_query = a.take_elements<int32_t>(T);
  l.page_table = a.take_elements<int32_t>(s.batch * s.max_pages);
  l.logit_rows = a.take_elements<int64_t>(s.R);
  l.cu_seqlens_q = a.take_elements<int32_t>(s.decode_plan ? s.batch + 1 : 0);
  l.seq_lens = a.take_elements<int32_t>(s.decode_plan ? s.batch : 0);
  l.cudnn_meta = a.take(s.cudnn_meta_bytes);
  l.meta_end = a.total();
  l.x = a.take_elements<float>(T * H);
  l.branch = a.take_elements<float>(s.tap || s.world > 0 ? T * H : 0);
  l.xn = a.take_elements<uint16_t>(T * H);
  l.xn_f32 = a.take_elements<float>(any_moe ? T * H : 0);
  l.proj = a.take_elements<float>(T * proj_cols);
  l.q = a.take_elements<uint16_t>(T * QD);
  l.qi = a.take_elements<uint16_t>(any_sparse ? T * c.index_heads * c.index_head_dim : 0);
  l.k_new = a.take_elements<uint16_t>(s.fp8_kv ? T * c.num_kv_heads * c.head_dim : 0);
  l.v_new = a.take_elements<uint16_t>(s.fp8_kv ? T * c.num_kv_heads * c.head_dim : 0);
  l.topk = a.take_elements<int32_t>(any_sparse ? c.index_heads * T * c.topk_blocks : 0);
  l.attn_lse = a.take_elements<float>(T * c.num_heads);
  l.o = a.take_elements<uint16_t>(T * QD);
  l.gate_up = a.take_elements<float>(gate_up);
  l.act = a.take_elements<uint16_t>(gate_up / 2);
  l.router_logits = a.take_elements<float>(any_moe ? T * c.num_experts : 0);
  l.entry_weight = a.take_elements<float>(N);
  l.entry_row = a.take_elements<int32_t>(N);
  l.offsets = a.take_elements<int32_t>(any_moe ? c.num_experts + 1 : 0);
  l.x_sorted = a.take_elements<uint16_t>(N * H);
  l.y_sorted = a.take_elements<float>(N * H);
  // A rank receives at most every rank's home tokens' entries: N rows in all.
  const bool expert_parallel = any_moe && s.world > 0;
  l.all_offsets = a.take_elements<int32_t>(expert_parallel ? s.world * (c.num_experts + 1) : 0);
  l.peer_offsets = a.take_elements<int32_t>(expert_parallel ? s.world * (c.num_experts + 1) : 0);
  l.x_recv = a.take_elements<uint16_t>(expert_parallel ? N * H : 0);
  l.y_recv = a.take_elements<float>(expert_parallel ? N * H : 0);
  l.normed = a.take_elements<uint16_t>(s.R * H);
  l.normed_f32 = a.take_elements<float>(s.tap ? s.R * H : 0);
  l.logits = a.take_elements<float>(s.R * c.vocab_size);
  l.total = a.total();
  return l;
}

// Host copies of the step's metadata, in the layout's order.
template <class T>
void stage(std::vector<char>& staging, size_t offset, const std::vector<T>& values) {
  std::copy_n(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T),
              staging.data() + offset);
}

}  // namespace

// One decode-graph bucket: the step layout at its capacity (T = R = batch rows), the buffers
// and workspaces the graph bakes in (allocated before the capture, never reallocated while
// the graph lives), the decode plans and the instantiated graph.
struct CudaModel::DecodeGraph {
  StepShape shape;  // T = R = batch = request slots, max_pages = page-table columns
  StepLayout layout;
  DeviceBuffer activations, attention_workspace, moe_workspace;
  // sparse: the config's MSA params (MSA layers; itself dense where the bucket's context is
  // <= top-k blocks); dense: top-k covering the bucket's context (dense layers, or every
  // layer with set_dense_attention). Null where no layer uses it.
  std::unique_ptr<msa::cuda::DecodePlan> sparse_plan, dense_plan;
  const msa::cuda::DecodePlan* last_plan = nullptr;  // the last layer's: its status is the step's
  cudaGraphExec_t exec = nullptr;

  ~DecodeGraph() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

struct CudaModel::State {
  cudaStream_t stream = nullptr;
  Gemm gemm;
  DeviceBuffer inv_freq;  // f32 [rotary_dim / 2]
  DeviceBuffer activations, attention_workspace, moe_workspace;
  std::vector<char> staging;  // the step's metadata, uploaded in one copy
  int32_t* host_offsets = nullptr;  // pinned [experts + 1], of every rank in a parallel model
  cudaEvent_t offsets_ready = nullptr;
  EventPool events;
  // Decode graphs by bucket (request slots, page-table columns), and the cache they were
  // captured over: every K / V / index-key page tensor's address (a graph bakes them in).
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<DecodeGraph>> graphs;
  std::vector<const void*> graph_cache;
  msa::cuda::GeometryStatus* host_status = nullptr;  // pinned: a replay's plan status
  // Dense attention on cuDNN (dense_attention_cudnn.h): its plans and their workspace, and
  // the gathered engine's contiguous K and V (one layer's at a time).
  CudnnDenseAttention cudnn_dense;
  DeviceBuffer cudnn_workspace, kv_gather;

  State(const ModelConfig& c, int world) {
    MSA_CUDA_CHECK(cudaStreamCreate(&stream));  // blocking: ordered after legacy-stream copies
    const std::vector<float> inv = rope_inverse_frequencies(c.rotary_dim, c.rope_theta);
    inv_freq = DeviceBuffer::from(inv);
    MSA_CUDA_CHECK(cudaMallocHost(&host_offsets, static_cast<size_t>(world) * (c.num_experts + 1) * sizeof(int32_t)));
    MSA_CUDA_CHECK(cudaEventCreateWithFlags(&offsets_ready, cudaEventDisableTiming));
    MSA_CUDA_CHECK(cudaMallocHost(&host_status, sizeof(msa::cuda::GeometryStatus)));
  }
  ~State() {
    graphs.clear();  // graphs before the stream they were captured on
    if (host_status) cudaFreeHost(host_status);
    if (offsets_ready) cudaEventDestroy(offsets_ready);
    if (host_offsets) cudaFreeHost(host_offsets);
    if (stream) cudaStreamDestroy(stream);
  }
};

namespace {

// The routed experts' format of device weights (one for every MoE layer; bf16 without any).
ExpertWeights routed_expert_format(const DeviceWeights& weights) {
  ExpertWeights format = ExpertWeights::bf16;
  for (const DeviceLayer& layer : weights.layers) {
    if (layer.experts == 0) continue;
    if (format != ExpertWeights::bf16 && layer.expert_format != format)
      MSA_FAIL("device weights: MoE layers hold routed experts in ", expert_weights_name(format), " and ",
               expert_weights_name(layer.expert_format), "; the CUDA model takes one format");
    format = layer.expert_format;
  }
  return format;
}

// Quantized routed experts run only in the small and grouped expert kernels (per-expert
// cuBLASLt reads bf16): above the small kernel's bound the grouped one must fit.
void check_quantized_experts_fit(const ModelConfig& c, ExpertWeights format) {
  if (format == ExpertWeights::bf16) return;
  if (!(moe_experts_grouped_fits(c.hidden_size, 2 * c.moe_intermediate_size, format) &&
        moe_experts_grouped_fits(c.moe_intermediate_size, c.hidden_size, format)))
    MSA_FAIL("CUDA model: ", expert_weights_name(format), " routed experts with hidden ", c.hidden_size,
             " and expert intermediate ", c.moe_intermediate_size,
             " do not fit the grouped expert kernel, the only one above the small kernel's bound that reads "
             "quantized weights (dims multiples of ",
             expert_weights_in_multiple(format), ")");
}

// One projection of the routed experts by the small or grouped kernel, which read the expert
// offsets on the device: y [entries, out] = x [entries, in] times each row's expert's
// w [out, in] (bf16 `w`, or `quantized`), rows sorted by expert.
void routed_experts_on_device(MoeKernel kernel, const uint16_t* x, const uint16_t* w,
                              const QuantizedExpertWeights& quantized, const int32_t* offsets, int64_t entries,
                              int64_t experts, int64_t in, int64_t out, float* y, cudaStream_t stream) {
  if (kernel == MoeKernel::small)
    moe_experts_small({.x = x, .w = w, .offsets = offsets, .entries = entries, .experts = experts, .in = in,
                       .out = out, .y = y, .quantized = quantized},
                      stream);
  else if (kernel == MoeKernel::grouped)
    moe_experts_grouped({.x = x, .w = w, .offsets = offsets, .entries = entries, .experts = experts, .in = in,
                         .out = out, .y = y, .quantized = quantized},
                        stream);
  else
    MSA_FAIL("routed experts: the per-expert kernel needs the offsets on the host");
}

}  // namespace

CudaModel::CudaModel(const ModelConfig& config, DeviceWeights weights)
    : config_(config), weights_(std::move(weights)), state_(std::make_unique<State>(config_, 1)) {
  check_cuda_support(config_);
  expert_format_ = routed_expert_format(weights_);
  check_quantized_experts_fit(config_, expert_format_);
}

CudaModel::CudaModel(const ModelConfig& config, DeviceWeights weights, Communicator& comm, const ShardPlan& plan)
    : config_(config),
      weights_(std::move(weights)),
      comm_(&comm),
      plan_(plan),
      state_(std::make_unique<State>(config_, plan.world)) {
  check_cuda_support(config_);
  expert_format_ = routed_expert_format(weights_);
  check_quantized_experts_fit(config_, expert_format_);
  decode_graphs_ = false;  // a rank's collectives are not captured (set_decode_graphs)
  MSA_CHECK_ARG(comm.world_size() == plan.world && comm.rank() == plan.rank, "comm",
                "rank " + std::to_string(plan.rank) + " of " + std::to_string(plan.world) + " (the plan's)",
                "rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.world_size()));
  for (const DeviceLayer& layer : weights_.layers)
    MSA_CHECK_ARG(layer.experts == 0 || layer.experts == plan.experts, "weights",
                  std::to_string(plan.experts) + " routed experts per MoE layer (the plan's)", layer.experts);
}

CudaModel::~CudaModel() = default;

void* CudaModel::stream() const { return state_->stream; }

void CudaModel::set_dense_attention_engine(DenseAttentionEngine engine) {
  if (dense_attention_engine_needs_cudnn(engine) && !dense_attention_cudnn_built())
    throw Error(std::string("dense attention engine ") + dense_attention_engine_name(engine) +
                ": this build of msa has no cuDNN (it needs the cuDNN frontend in .deps/cudnn_frontend, libcudnn "
                "and cudnn.h; scripts/install_deps.sh)");
  dense_engine_ = engine;
}

DenseAttentionEngine automatic_dense_engine(int64_t max_q_len, bool cudnn_built, bool gathered_fits) {
  return cudnn_built && gathered_fits && max_q_len >= kGatheredCudnnMinQueries ? DenseAttentionEngine::cudnn_gathered
                                                                               : DenseAttentionEngine::msa;
}

int64_t CudaModel::cudnn_dense_plans() const { return state_->cudnn_dense.plans(); }

const char* moe_kernel_name(MoeKernel kernel) {
  switch (kernel) {
    case MoeKernel::automatic: return "auto";
    case MoeKernel::small: return "small";
    case MoeKernel::grouped: return "grouped";
    case MoeKernel::per_expert: return "per-expert";
  }
  return "?";
}

MoeKernel parse_moe_kernel(const std::string& text, const std::string& argument) {
  for (MoeKernel kernel : {MoeKernel::automatic, MoeKernel::small, MoeKernel::grouped, MoeKernel::per_expert})
    if (text == moe_kernel_name(kernel)) return kernel;
  throw_arg_error(argument, "auto, small, grouped or per-expert", "\"" + text + "\"");
}

void CudaModel::set_moe_kernel(MoeKernel kernel, MoeKernelRule rule) {
  MSA_CHECK_ARG(rule.max_small_entries >= 0 && rule.max_small_entries <= kMaxSmallMoeEntries,
                "rule.max_small_entries", "0.." + std::to_string(kMaxSmallMoeEntries), rule.max_small_entries);
  MSA_CHECK_ARG(rule.max_grouped_entries >= 0, "rule.max_grouped_entries", "non-negative", rule.max_grouped_entries);
  if (kernel == MoeKernel::per_expert && expert_format_ != ExpertWeights::bf16)
    MSA_FAIL("MoE kernel per-expert: this model's routed experts are ", expert_weights_name(expert_format_),
             " and the per-expert cuBLASLt GEMMs read bf16 only; use auto, small or grouped (or load the "
             "model with RoutedExperts::dequantized)");
  if (kernel != moe_kernel_ || rule.max_small_entries != moe_rule_.max_small_entries ||
      rule.max_grouped_entries != moe_rule_.max_grouped_entries)
    state_->graphs.clear();  // a bucket's admission and its captured MoE follow the kernel
  moe_kernel_ = kernel;
  moe_rule_ = rule;
}

MoeKernel CudaModel::moe_kernel_for(int64_t entries) const {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size;
  const ExpertWeights f = expert_format_;
  const bool small_fits = moe_experts_small_fits(entries, H, 2 * I, f) && moe_experts_small_fits(entries, I, H, f);
  const bool grouped_fits = moe_experts_grouped_fits(H, 2 * I, f) && moe_experts_grouped_fits(I, H, f);
  switch (moe_kernel_) {
    case MoeKernel::small:
      if (!small_fits)
        MSA_FAIL("MoE kernel small: a step of ", entries, " token x expert entries with hidden ", H,
                 " and expert intermediate ", I, " does not fit it (1..", kMaxSmallMoeEntries,
                 " entries, dims multiples of 8); use auto, grouped or per-expert");
      return MoeKernel::small;
    case MoeKernel::grouped:
      if (!grouped_fits)
        MSA_FAIL("MoE kernel grouped: hidden ", H, " and expert intermediate ", I,
                 " must be multiples of 8; use auto or per-expert");
      return MoeKernel::grouped;
    case MoeKernel::per_expert: return MoeKernel::per_expert;
    case MoeKernel::automatic: break;
  }
  if (small_fits && entries <= moe_rule_.max_small_entries) return MoeKernel::small;
  // Quantized experts: grouped at every size above the small bound (per-expert cuBLASLt
  // cannot read them; the constructor checked that grouped fits).
  if (grouped_fits && (entries <= moe_rule_.max_grouped_entries || f != ExpertWeights::bf16))
    return MoeKernel::grouped;
  return MoeKernel::per_expert;
}

namespace {

// Records CUDA events around the parts of each layer (only when a profile is wanted).
class PartTimer {
 public:
  PartTimer(EventPool& events, cudaStream_t stream, StepProfile* profile, int64_t layers)
      : events_(events), stream_(stream), profile_(profile) {
    if (profile_) {
      events_.next = 0;
      if (static_cast<int64_t>(profile_->layer_ms.size()) < layers) profile_->layer_ms.resize(layers);
    }
  }
  cudaEvent_t mark() { return profile_ ? events_.record(stream_) : nullptr; }
  // A part of `layer` (or, with layer < 0, head time) between two marks.
  void add(int64_t layer, int part, cudaEvent_t start, cudaEvent_t stop) {
    if (profile_) spans_.push_back({layer, part, start, stop});
  }
  // A K/V gather between two marks (StepProfile::kv_gather_ms; inside an attention span too).
  void add_gather(cudaEvent_t start, cudaEvent_t stop) {
    if (profile_) gathers_.push_back({-1, 0, start, stop});
  }
  // After the step's last launch: waits and adds the times (other = layer - parts).
  void finish() {
    if (!profile_) return;
    MSA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<std::array<double, kLayerParts + 1>> step(profile_->layer_ms.size());
    for (const Span& s : spans_) {
      float ms = 0;
      MSA_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.stop));
      if (s.layer < 0) profile_->head_ms += ms;
      else step[s.layer][s.part] += ms;
    }
    for (const Span& s : gathers_) {
      float ms = 0;
      MSA_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.stop));
      profile_->kv_gather_ms += ms;
    }
    for (size_t layer = 0; layer < step.size(); ++layer) {
      const auto& t = step[layer];
      auto& out = profile_->layer_ms[layer];
      const double parts = t[0] + t[1] + t[2];
      out[0] += t[0];
      out[1] += t[1];
      out[2] += t[2];
      out[3] += std::max(0.0, t[kLayerParts] - parts);  // kLayerParts = the whole layer
    }
    ++profile_->steps;
  }

 private:
  struct Span {
    int64_t layer;
    int part;
    cudaEvent_t start, stop;
  };
  EventPool& events_;
  cudaStream_t stream_;
  StepProfile* profile_;
  std::vector<Span> spans_, gathers_;
};

// An e4m3 page tensor [pages, heads, block, dim] and its f32 scales [pages, heads, block].
msa::cuda::Fp8Kv fp8_kv(const Tensor& codes, const Tensor& scale, int64_t heads, int64_t block) {
  return {static_cast<const uint8_t*>(codes.raw()),
          msa::cuda::kv_scales_per_token_head(static_cast<const float*>(scale.raw()), heads, block)};
}

msa::cuda::KeyLayout paged_layout(const Tensor& cache, int64_t heads, int64_t dim, int64_t block,
                                  const int32_t* page_table, int64_t page_table_stride) {
  msa::cuda::KeyLayout layout;
  layout.data = static_cast<const uint16_t*>(cache.raw());
  layout.block_size = block;
  layout.token_stride = dim;
  layout.head_stride = block * dim;
  layout.block_stride = heads * block * dim;
  layout.page_table = page_table;
  layout.page_table_stride = page_table_stride;
  return layout;
}

}  // namespace

// One step's device state, shared by the phases of forward(): the activation regions, the
// sequences, the residual stream and where branch outputs go, the timer and the tap.
struct CudaModel::Step {
  const ModelConfig& c;
  State& st;
  KvCache& cache;
  const ForwardTap& tap;
  PartTimer& timer;
  cudaStream_t stream;
  StepShape shape{};
  StepLayout l{};
  char* base = nullptr;
  DecodeGraph* graph = nullptr;  // set in a decode graph's step: attention through its plans
  msa::cuda::BatchLayout sequences{};
  float* x = nullptr;       // the residual stream [T, H]
  float* target = nullptr;  // where branch outputs go: x itself, or a scratch buffer when observed
  bool accumulate = true;   // or summed over the ranks of a parallel model first
  Communicator* comm = nullptr;
  float eps = 0, alpha = 0, limit = 0;
  // This step's dense attention engine: msa, cudnn (paged) or cudnn_gathered, and the
  // geometry of its cuDNN call.
  DenseAttentionEngine dense_engine = DenseAttentionEngine::msa;
  CudnnDenseGeometry cudnn_geometry{};
  CudnnGatheredGeometry gathered_geometry{};
  int64_t total_k = 0;  // the step's keys, all requests (the gathered rows)

  // The residual stream and the branch target in the step's activations at `base`.
  void bind_residual(Communicator* ranks) {
    eps = static_cast<float>(c.rms_norm_eps);
    alpha = static_cast<float>(c.swiglu_alpha);
    limit = static_cast<float>(c.swiglu_limit);
    x = f32(l.x);
    // Branch outputs accumulate straight into the residual stream, unless observed or partial
    // sums of a parallel model's rank.
    comm = ranks;
    const bool separate = tap || ranks;
    target = separate ? f32(l.branch) : x;
    accumulate = !separate;
  }

  float* f32(size_t offset) const { return reinterpret_cast<float*>(base + offset); }
  uint16_t* bf16(size_t offset) const { return reinterpret_cast<uint16_t*>(base + offset); }
  int32_t* i32(size_t offset) const { return reinterpret_cast<int32_t*>(base + offset); }
  int64_t* i64(size_t offset) const { return reinterpret_cast<int64_t*>(base + offset); }

  // Downloads an intermediate for the tap (synchronises; only with a tap).
  void observe(const std::string& name, const void* data, const Shape& dims, DType dtype) const {
    Tensor host = Tensor::zeros(dims, dtype);
    MSA_CUDA_CHECK(cudaMemcpyAsync(host.raw(), data, host.nbytes(), cudaMemcpyDeviceToHost, stream));
    MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
    tap(name, host);
  }
  // A branch output in `target` joins the residual stream: summed over the ranks of a
  // parallel model (stream-ordered), observed when tapped, then added.
  void add_branch(const std::string& name) const {
    if (accumulate) return;  // already in x
    if (comm) comm->all_reduce_sum(target, shape.T * c.hidden_size, CommStream{stream});
    if (tap) observe(name, target, {shape.T, c.hidden_size}, DType::f32);
    add_in_place(x, target, shape.T * c.hidden_size, stream);
  }
};

Tensor CudaModel::forward(std::span<const ForwardRequest> requests, KvCache& cache,
                          const ForwardTap& tap, StepProfile* profile) {
  const ModelConfig& c = config_;
  State& st = *state_;
  MSA_CHECK_ARG(cache.device() == Device::cuda, "cache", "a CUDA KV cache (Device::cuda)",
                std::string(device_name(cache.device())) + " cache");
  MSA_CHECK_ARG(cache.dtype() == DType::bf16 || cache.dtype() == DType::e4m3, "cache", "bf16 or e4m3 (fp8) pages",
                dtype_name(cache.dtype()));
  const PackedStep packed = pack_step(requests, cache, c);
  for (size_t t = 0; t < packed.tokens.size(); ++t)
    if (packed.tokens[t] < 0 || packed.tokens[t] >= c.vocab_size)
      throw_arg_error("tokens[" + std::to_string(t) + "]",
                      "a token id in [0, " + std::to_string(c.vocab_size) + ")", packed.tokens[t]);

  if (decode_graphs_ && !tap && !profile) {
    if (std::optional<Tensor> logits = forward_decode_graph(requests, cache, packed)) {
      advance_sequences(requests);
      return std::move(*logits);
    }
  }

  PartTimer timer(st.events, st.stream, profile, c.num_layers);
  Step step{c, st, cache, tap, timer, st.stream};
  upload_step(step, packed, static_cast<int64_t>(requests.size()));
  embed(step, packed);
  layers(step);
  Tensor logits = head(step);
  timer.finish();
  advance_sequences(requests);
  return logits;
}

void CudaModel::layers(Step& step) {
  for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
    cudaEvent_t layer_start = step.timer.mark();
    attention(step, layer);
    feed_forward(step, layer);
    if (step.tap)
      step.observe("layers." + std::to_string(layer), step.x, {step.shape.T, config_.hidden_size}, DType::f32);
    step.timer.add(layer, kLayerParts, layer_start, step.timer.mark());
  }
}

// This step's dense attention engine (DenseAttentionEngine; automatic: automatic_dense_engine,
// the engines and their measurements: dense_attention_cudnn.h), and the metadata region a
// cuDNN call then needs. cudnn and cudnn_gathered refuse a step cuDNN cannot take (msa::Error);
// automatic then runs ours. Decode-graph steps never get here: their attention is the
// bucket's DecodePlan (ours).
void CudaModel::choose_dense_engine(Step& s, int64_t max_q_len, int64_t max_k_len, int64_t total_k) {
  const StepShape& shape = s.shape;
  s.dense_engine = DenseAttentionEngine::msa;
  s.shape.cudnn_meta_bytes = 0;
  s.total_k = total_k;
  const int64_t q_row = s.c.num_heads * s.c.head_dim, kv_row = s.c.num_kv_heads * s.c.head_dim;
  const bool gathered_fits = cudnn_gathered_fits(shape.T, q_row, total_k, kv_row);
  DenseAttentionEngine engine = dense_engine_;
  if (s.shape.fp8_kv) {  // cuDNN's SDPA reads bf16 pages: fp8 caches run ours
    if (engine != DenseAttentionEngine::automatic && engine != DenseAttentionEngine::msa)
      throw_arg_error("dense attention engine", "auto or msa with an fp8 KV cache (cuDNN reads bf16 pages)",
                      dense_attention_engine_name(engine));
    return;
  }
  if (engine == DenseAttentionEngine::automatic)
    engine = automatic_dense_engine(max_q_len, dense_attention_cudnn_built(), gathered_fits);
  if (engine == DenseAttentionEngine::msa || !dense_attention_cudnn_built()) return;
  const std::string name = dense_attention_engine_name(engine);
  if (!cudnn_dense_fits(shape.T, q_row))
    throw_arg_error("requests (dense attention engine " + name + ")",
                    "at most " + std::to_string(std::numeric_limits<int32_t>::max() / q_row) +
                        " query rows in a step (cuDNN's int32 ragged offsets)",
                    shape.T);
  if (engine == DenseAttentionEngine::cudnn) {
    s.cudnn_geometry = cudnn_dense_geometry(shape.batch, max_q_len, shape.max_pages);
    s.shape.cudnn_meta_bytes = cudnn_dense_metadata_layout(s.cudnn_geometry).bytes;
  } else {
    if (!gathered_fits)
      throw_arg_error("requests (dense attention engine " + name + ")",
                      "at most " + std::to_string(std::numeric_limits<int32_t>::max() / kv_row) +
                          " keys over a step's requests (cuDNN's int32 ragged offsets)",
                      total_k);
    s.gathered_geometry = cudnn_gathered_geometry(shape.batch, max_q_len, max_k_len);
    s.shape.cudnn_meta_bytes = cudnn_gathered_metadata_layout(s.gathered_geometry).bytes;
  }
  s.dense_engine = engine;
}

// The step's geometry and metadata: one host-to-device copy of tokens, positions, cache
// slots, the sequences (q_start, k_len, seq_of_query) and page table, and the logit rows.
void CudaModel::upload_step(Step& s, const PackedStep& packed, int64_t requests) {
  const StepBatch& batch = packed.batch;
  s.shape.T = batch.tokens;
  s.shape.R = static_cast<int64_t>(packed.logit_rows.size());
  s.shape.batch = requests;
  s.shape.max_pages = batch.page_table.size(1);
  s.shape.tap = static_cast<bool>(s.tap);
  s.shape.world = comm_ ? plan_.world : 0;
  s.shape.fp8_kv = s.cache.dtype() == DType::e4m3;
  std::vector<int64_t> q_start(requests + 1), k_len(requests);
  std::vector<int32_t> seq_of_query(s.shape.T);
  int64_t max_k_len = 0, max_q_len = 0, total_k = 0;
  for (int64_t b = 0; b < requests; ++b) {
    q_start[b] = batch.cu_seqlens_q.data<int32_t>()[b];
    q_start[b + 1] = batch.cu_seqlens_q.data<int32_t>()[b + 1];
    k_len[b] = batch.seq_lens.data<int32_t>()[b];
    for (int64_t t = q_start[b]; t < q_start[b + 1]; ++t) seq_of_query[t] = static_cast<int32_t>(b);
    max_k_len = std::max(max_k_len, k_len[b]);
    max_q_len = std::max(max_q_len, q_start[b + 1] - q_start[b]);
    total_k += k_len[b];
  }
  choose_dense_engine(s, max_q_len, max_k_len, total_k);

  s.l = plan_step(s.c, s.shape);
  ensure(s.st.activations, s.l.total);
  s.base = static_cast<char*>(s.st.activations.get());
  std::vector<char>& staging = s.st.staging;
  staging.assign(s.l.meta_end, 0);
  stage(staging, s.l.tokens, packed.tokens);
  stage(staging, s.l.positions, batch.positions);
  stage(staging, s.l.slots, batch.slot);
  stage(staging, s.l.q_start, q_start);
  stage(staging, s.l.k_len, k_len);
  stage(staging, s.l.seq_of_query, seq_of_query);
  std::copy_n(static_cast<const char*>(batch.page_table.raw()), batch.page_table.nbytes(),
              staging.data() + s.l.page_table);
  stage(staging, s.l.logit_rows, packed.logit_rows);
  if (s.dense_engine == DenseAttentionEngine::cudnn)
    stage_cudnn_dense_metadata(s.cudnn_geometry, batch.cu_seqlens_q.span<int32_t>(), batch.seq_lens.span<int32_t>(),
                               batch.page_table.data<int32_t>(), s.shape.max_pages, s.c.num_heads * s.c.head_dim,
                               staging.data() + s.l.cudnn_meta);
  if (s.dense_engine == DenseAttentionEngine::cudnn_gathered)
    stage_cudnn_gathered_metadata(s.gathered_geometry, batch.cu_seqlens_q.span<int32_t>(),
                                  batch.seq_lens.span<int32_t>(), s.c.num_heads * s.c.head_dim,
                                  s.c.num_kv_heads * s.c.head_dim, staging.data() + s.l.cudnn_meta);
  MSA_CUDA_CHECK(cudaMemcpyAsync(s.base, staging.data(), s.l.meta_end, cudaMemcpyHostToDevice, s.stream));

  s.sequences.q_start = s.i64(s.l.q_start);
  s.sequences.k_len = s.i64(s.l.k_len);
  s.sequences.seq_of_query = s.i32(s.l.seq_of_query);
  s.sequences.batch = requests;
  s.sequences.total_q = s.shape.T;
  s.sequences.max_k_len = max_k_len;
  s.sequences.max_q_len = max_q_len;

  s.bind_residual(comm_);
}

void CudaModel::embed(Step& s, const PackedStep& packed) {
  cudaEvent_t start = s.timer.mark();
  embed_rows(weights_.embed_tokens.as<uint16_t>(), s.c.hidden_size, s.i32(s.l.tokens), s.shape.T, s.x,
             s.stream);
  // Image / video placeholders: the visual rows (host f32, checked by pack_step) overwrite
  // their rows of the residual stream. Stream-ordered after the embedding; the copies from
  // pageable memory return once the source is consumed, so the caller's rows may go after
  // forward() returns.
  for (const PackedVisualRows& rows : packed.visual)
    MSA_CUDA_CHECK(cudaMemcpyAsync(s.x + rows.row * s.c.hidden_size, rows.data,
                                   static_cast<size_t>(rows.count * s.c.hidden_size) * sizeof(float),
                                   cudaMemcpyHostToDevice, s.stream));
  s.timer.add(-1, 0, start, s.timer.mark());
  if (s.tap) s.observe("embed", s.x, {s.shape.T, s.c.hidden_size}, DType::f32);
}

// The attention half of a layer: input norm, q/k/v(/index) projections, q/k norm + RoPE
// and the cache append, attention (dense causal, or indexer + sparse attention over its
// selection) with its bf16 output, o_proj into the residual stream.
void CudaModel::attention(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const DeviceLayer& w = weights_.layers[layer];
  const StepLayout& l = s.l;
  const bool sparse = c.sparse_layers[layer];
  const int64_t T = s.shape.T, H = c.hidden_size, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t Hi = c.index_heads, Di = c.index_head_dim, B = c.block_size;
  Gemm& gemm = s.st.gemm;

  rms_norm_rows(s.x, nullptr, T, H, w.input_norm.as<float>(), s.eps, s.bf16(l.xn), nullptr, s.stream);
  const int64_t P = w.qkv_rows;
  gemm.linear(s.bf16(l.xn), H, w.qkv.get(), DType::bf16, T, P, H, s.f32(l.proj), DType::f32, P, false,
              s.stream);
  HeadTransform job;
  job.src_stride = P;
  job.tokens = T;
  job.eps = s.eps;
  job.inv_freq = s.st.inv_freq.as<float>();
  job.positions = s.i64(l.positions);
  job.block_size = B;
  std::vector<HeadTransform> jobs;  // one launch for all of them
  auto transform = [&](int64_t column, int64_t heads, int64_t dim, const DeviceBuffer* norm,
                       bool rope, uint16_t* dst, bool paged) {
    job.src = s.f32(l.proj) + column;
    job.heads = heads;
    job.dim = dim;
    job.norm_weight = norm ? norm->as<float>() : nullptr;
    job.rotary_dim = rope ? c.rotary_dim : 0;
    job.dst = dst;
    job.slots = paged ? s.i64(l.slots) : nullptr;
    jobs.push_back(job);
  };
  KvCache& cache = s.cache;
  const bool fp8 = s.shape.fp8_kv;  // K and V staged in bf16, then quantized into the pages
  transform(0, Hq, D, &w.q_norm, true, s.bf16(l.q), false);
  transform(Hq * D, Hkv, D, &w.k_norm, true, fp8 ? s.bf16(l.k_new) : static_cast<uint16_t*>(cache.k(layer).raw()),
            !fp8);
  transform((Hq + Hkv) * D, Hkv, D, nullptr, false,
            fp8 ? s.bf16(l.v_new) : static_cast<uint16_t*>(cache.v(layer).raw()), !fp8);
  if (sparse) {
    const int64_t column = (Hq + 2 * Hkv) * D;
    transform(column, Hi, Di, &w.index_q_norm, true, s.bf16(l.qi), false);
    transform(column + Hi * Di, 1, Di, &w.index_k_norm, true,
              static_cast<uint16_t*>(cache.index_keys(layer).raw()), true);
  }
  head_norm_rope(jobs.data(), static_cast<int>(jobs.size()), s.stream);
  if (fp8) {
    msa::cuda::KvAppendParams append;
    append.k = s.bf16(l.k_new);
    append.v = s.bf16(l.v_new);
    append.input = msa::cuda::InputType::bf16;
    append.tokens = T;
    append.kv_heads = Hkv;
    append.head_dim = D;
    append.block_size = B;
    append.slot_mapping = s.i64(l.slots);
    append.k_cache = static_cast<uint8_t*>(cache.k(layer).raw());
    append.v_cache = static_cast<uint8_t*>(cache.v(layer).raw());
    append.k_scale = static_cast<float*>(cache.k_scale(layer).raw());
    append.v_scale = static_cast<float*>(cache.v_scale(layer).raw());
    msa::cuda::append_kv_fp8(append, s.stream);
  }

  const int32_t* page_table = s.i32(l.page_table);
  msa::cuda::AttentionLaunch attention;
  attention.q = s.bf16(l.q);
  attention.k = paged_layout(cache.k(layer), Hkv, D, B, page_table, s.shape.max_pages);
  attention.v = paged_layout(cache.v(layer), Hkv, D, B, page_table, s.shape.max_pages);
  attention.q_heads = Hq;
  attention.kv_heads = Hkv;
  attention.head_dim = D;
  attention.batch = s.sequences;
  attention.scale = static_cast<float>(c.msa_params().scale);
  attention.o = s.bf16(l.o);  // o_proj's input, rounded by the kernel's epilogue
  attention.o_type = msa::cuda::OutputType::bf16;
  attention.lse = s.f32(l.attn_lse);
  if (fp8) {  // the codes at the pages' layout (strides in bytes), one f32 scale per token and head
    attention.kv_format = msa::cuda::KvFormat::fp8;
    attention.k_fp8 = fp8_kv(cache.k(layer), cache.k_scale(layer), Hkv, B);
    attention.v_fp8 = fp8_kv(cache.v(layer), cache.v_scale(layer), Hkv, B);
  }
  bool selected = false;
  if (s.graph) {  // a decode graph's step: the bucket's DecodePlan (grids from capacities)
    decode_plan_attention(s, layer);
    selected = true;
  } else if (sparse && !dense_attention_) {
    msa::cuda::IndexerLaunch index;
    index.qi = s.bf16(l.qi);
    index.heads = Hi;
    index.dim = Di;
    index.ki = paged_layout(cache.index_keys(layer), 1, Di, B, page_table, s.shape.max_pages);
    index.batch = s.sequences;
    index.block_size = static_cast<int>(B);
    index.topk = c.topk_blocks;
    index.local_blocks = c.local_blocks;
    index.init_blocks = c.init_blocks;
    index.logit_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Di)));
    index.topk_out = s.i32(l.topk);
    // Every visible block would be selected: MSA is dense attention exactly (docs/msa.md §4).
    if (!msa::cuda::msa_is_dense(index)) {
      selected = true;
      attention.topk = index.topk_out;
      attention.slots = c.topk_blocks;
      const size_t index_bytes = msa::cuda::align_up(msa::cuda::indexer_workspace_bytes(index));
      ensure(s.st.attention_workspace, index_bytes + msa::cuda::attention_workspace_bytes(attention));
      char* ws = static_cast<char*>(s.st.attention_workspace.get());
      cudaEvent_t start = s.timer.mark();
      msa::cuda::indexer(index, ws, s.stream);
      cudaEvent_t between = s.timer.mark();
      msa::cuda::attention(attention, ws + index_bytes, s.stream);
      s.timer.add(layer, static_cast<int>(LayerPart::indexer), start, between);
      s.timer.add(layer, static_cast<int>(LayerPart::attention), between, s.timer.mark());
      if (s.tap)
        s.observe("layers." + std::to_string(layer) + ".topk", s.i32(l.topk), {Hi, T, c.topk_blocks},
                  DType::i32);
    }
  }
  if (!selected && s.dense_engine == DenseAttentionEngine::cudnn) {
    dense_on_cudnn(s, layer);
    ++dense_calls_.cudnn;
  } else if (!selected && s.dense_engine == DenseAttentionEngine::cudnn_gathered) {
    dense_on_cudnn_gathered(s, layer);
    ++dense_calls_.cudnn_gathered;
  } else if (!selected) {
    ensure(s.st.attention_workspace, msa::cuda::attention_workspace_bytes(attention));
    cudaEvent_t start = s.timer.mark();
    msa::cuda::attention(attention, s.st.attention_workspace.get(), s.stream);
    s.timer.add(layer, static_cast<int>(LayerPart::attention), start, s.timer.mark());
    ++dense_calls_.msa;
  }
  gemm.linear(s.bf16(l.o), Hq * D, w.o_proj.get(), DType::bf16, T, H, Hq * D, s.target, DType::f32, H,
              s.accumulate, s.stream);
  s.add_branch("layers." + std::to_string(layer) + ".attn");
}

// The layer's dense causal attention on cuDNN's SDPA over the paged cache, into the same bf16
// `o` as our kernel (no LSE: nothing reads the dense path's). Builds the plan of the step's
// bucketed shape on first use (a shape cuDNN refuses: its msa::Error).
void CudaModel::dense_on_cudnn(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  CudnnDenseCall call;
  call.q = s.bf16(s.l.q);
  call.k_cache = s.cache.k(layer).raw();
  call.v_cache = s.cache.v(layer).raw();
  call.o = s.bf16(s.l.o);
  call.metadata = s.base + s.l.cudnn_meta;
  call.q_heads = c.num_heads;
  call.kv_heads = c.num_kv_heads;
  call.head_dim = c.head_dim;
  call.block_size = c.block_size;
  call.pages = s.cache.num_pages();
  call.scale = static_cast<float>(c.msa_params().scale);
  call.geometry = s.cudnn_geometry;
  const size_t workspace = s.st.cudnn_dense.prepare(call);
  ensure(s.st.cudnn_workspace, workspace);
  cudaEvent_t start = s.timer.mark();
  s.st.cudnn_dense.run(call, s.st.cudnn_workspace.get(), s.stream);
  s.timer.add(layer, static_cast<int>(LayerPart::attention), start, s.timer.mark());
}

// The layer's dense causal attention as the gathered cuDNN engine: each request's keys [0,
// k_len) of K and V copied out of the pages into the model's contiguous buffer (THD rows, the
// metadata's k_rows), then cuDNN's non-paged SDPA with ragged Q/O and K/V into the same bf16
// `o`. The buffer holds one layer's K/V of the step's requests (reused by every layer), so it
// is at most a 1/num_layers share of the cache the step reads.
void CudaModel::dense_on_cudnn_gathered(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const size_t one = static_cast<size_t>(s.total_k * Hkv * D) * sizeof(uint16_t);
  const size_t half = msa::cuda::align_up(one);  // V after K, 256-byte aligned
  ensure(s.st.kv_gather, 2 * half);
  char* gathered = static_cast<char*>(s.st.kv_gather.get());
  const CudnnGatheredMetadataLayout meta = cudnn_gathered_metadata_layout(s.gathered_geometry);

  KvGather job;
  job.k_cache = static_cast<const uint16_t*>(s.cache.k(layer).raw());
  job.v_cache = static_cast<const uint16_t*>(s.cache.v(layer).raw());
  job.pages = s.cache.num_pages();
  job.heads = Hkv;
  job.block_size = c.block_size;
  job.head_dim = D;
  job.page_table = s.i32(s.l.page_table);
  job.requests = s.shape.batch;
  job.max_pages = s.shape.max_pages;
  job.k_rows = reinterpret_cast<const int32_t*>(s.base + s.l.cudnn_meta + meta.k_rows);
  job.rows = s.total_k;
  job.k_out = reinterpret_cast<uint16_t*>(gathered);
  job.v_out = reinterpret_cast<uint16_t*>(gathered + half);

  CudnnGatheredCall call;
  call.q = s.bf16(s.l.q);
  call.k = job.k_out;
  call.v = job.v_out;
  call.o = s.bf16(s.l.o);
  call.metadata = s.base + s.l.cudnn_meta;
  call.q_heads = c.num_heads;
  call.kv_heads = Hkv;
  call.head_dim = D;
  call.scale = static_cast<float>(c.msa_params().scale);
  call.geometry = s.gathered_geometry;
  const size_t workspace = s.st.cudnn_dense.prepare(call);
  ensure(s.st.cudnn_workspace, workspace);

  cudaEvent_t start = s.timer.mark();
  gather_kv(job, s.stream);
  cudaEvent_t gathered_at = s.timer.mark();
  s.st.cudnn_dense.run(call, s.st.cudnn_workspace.get(), s.stream);
  s.timer.add_gather(start, gathered_at);
  s.timer.add(layer, static_cast<int>(LayerPart::attention), start, s.timer.mark());
}

// A dense (SwiGLU) MLP of `rows` bf16 rows into the branch target.
void CudaModel::mlp(Step& s, const uint16_t* in, int64_t rows, const DeviceMlp& w) {
  const int64_t H = s.c.hidden_size, I = w.inter;
  s.st.gemm.linear(in, H, w.gate_up.get(), DType::bf16, rows, 2 * I, H, s.f32(s.l.gate_up), DType::f32,
                   2 * I, false, s.stream);
  swiglu_oai(s.f32(s.l.gate_up), rows, I, s.alpha, s.limit, s.bf16(s.l.act), s.stream);
  s.st.gemm.linear(s.bf16(s.l.act), I, w.down.get(), DType::bf16, rows, H, I, s.target, DType::f32, H,
                   s.accumulate, s.stream);
}

// The FFN half of a layer: post-attention norm, then the dense MLP or the MoE.
void CudaModel::feed_forward(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const DeviceLayer& w = weights_.layers[layer];
  cudaEvent_t start = s.timer.mark();
  const bool moe = c.moe_layers[layer];
  rms_norm_rows(s.x, nullptr, s.shape.T, c.hidden_size, w.post_attention_norm.as<float>(), s.eps,
                s.bf16(s.l.xn), moe ? s.f32(s.l.xn_f32) : nullptr, s.stream);
  if (moe && comm_)
    expert_parallel_moe(s, layer);
  else if (moe)
    mixture_of_experts(s, layer);
  else
    mlp(s, s.bf16(s.l.xn), s.shape.T, w.mlp);
  s.timer.add(layer, static_cast<int>(LayerPart::ffn), start, s.timer.mark());
  s.add_branch("layers." + std::to_string(layer) + ".mlp");
}

MoeDispatch CudaModel::route(Step& s, int64_t layer, int64_t first, int64_t tokens) {
  const ModelConfig& c = s.c;
  const DeviceLayer& w = weights_.layers[layer];
  const StepLayout& l = s.l;
  const int64_t H = c.hidden_size, E = c.num_experts;
  if (tokens > 0)
    s.st.gemm.linear(s.f32(l.xn_f32) + first * H, H, w.router.get(), DType::f32, tokens, E, H,
                     s.f32(l.router_logits), DType::f32, E, false, s.stream);
  MoeDispatch dispatch;
  dispatch.router_logits = s.f32(l.router_logits);
  dispatch.bias = w.router_bias.as<float>();
  dispatch.x = s.bf16(l.xn) + first * H;
  dispatch.tokens = tokens;
  dispatch.experts = E;
  dispatch.top_k = c.experts_per_token;
  dispatch.hidden = H;
  dispatch.routed_scaling = static_cast<float>(c.routed_scaling_factor);
  dispatch.entry_weight = s.f32(l.entry_weight);
  dispatch.entry_row = s.i32(l.entry_row);
  dispatch.offsets = s.i32(l.offsets);
  dispatch.x_sorted = s.bf16(l.x_sorted);
  return dispatch;
}

// The MoE: router GEMM (f32) -> dispatch (top-k, sort by expert, gather) -> the routed
// experts' GEMMs gate_up, swiglu, down -> combine into the branch target; the shared expert
// runs after the dispatch. The routed experts run by moe_kernel_for(N): small and grouped run
// each projection of all routed experts as one launch that reads the expert offsets on the
// device (no host round trip); per_expert brings the offsets to the host (the step's one sync
// per MoE layer, overlapped with the shared expert) and runs one cuBLASLt GEMM per expert.
void CudaModel::mixture_of_experts(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const DeviceLayer& w = weights_.layers[layer];
  const StepLayout& l = s.l;
  State& st = s.st;
  const int64_t T = s.shape.T, H = c.hidden_size;
  const int64_t E = c.num_experts, K = c.experts_per_token, I = c.moe_intermediate_size;
  const int64_t N = T * K;
  const MoeDispatch dispatch = route(s, layer, 0, T);
  const size_t dispatch_bytes = moe_dispatch_workspace_bytes(T, K, E);
  DeviceBuffer& workspace = s.graph ? s.graph->moe_workspace : st.moe_workspace;
  ensure(workspace, dispatch_bytes);  // a graph's was sized at its bucket's creation
  moe_dispatch(dispatch, workspace.get(), workspace.bytes(), s.stream);
  const MoeKernel kernel = moe_kernel_for(N);
  // decode_graph_for admits only buckets whose MoE stays on the device (no host round trip).
  if (s.graph && kernel == MoeKernel::per_expert)
    MSA_FAIL("decode graph of ", T, " rows: the MoE would need the host's offsets");
  ++(kernel == MoeKernel::small ? moe_calls_.small : kernel == MoeKernel::grouped ? moe_calls_.grouped
                                                                                   : moe_calls_.per_expert);
  // The host needs the offsets for the per-expert GEMMs, and a tap for the chosen experts.
  const bool host_offsets = kernel == MoeKernel::per_expert || s.tap;
  if (host_offsets) {
    MSA_CUDA_CHECK(cudaMemcpyAsync(st.host_offsets, dispatch.offsets, static_cast<size_t>(E + 1) * sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, s.stream));
    MSA_CUDA_CHECK(cudaEventRecord(st.offsets_ready, s.stream));
  }
  // The shared expert runs while the host waits for the offsets.
  if (w.shared_expert.inter > 0)
    mlp(s, s.bf16(l.xn), T, w.shared_expert);
  else if (s.tap)
    MSA_CUDA_CHECK(cudaMemsetAsync(s.target, 0, static_cast<size_t>(T * H) * sizeof(float), s.stream));
  const int32_t* offsets = st.host_offsets;
  if (host_offsets) {
    MSA_CUDA_CHECK(cudaEventSynchronize(st.offsets_ready));
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e] > offsets[e + 1] || offsets[e] < 0)
        MSA_FAIL("MoE dispatch of layer ", layer, " produced bad expert offsets: offsets[", e, "] = ", offsets[e],
                 ", offsets[", e + 1, "] = ", offsets[e + 1]);
    if (offsets[0] != 0 || offsets[E] != N)
      MSA_FAIL("MoE dispatch of layer ", layer, " covers rows [", offsets[0], ", ", offsets[E], "), expected [0, ",
               N, ")");
  }
  if (s.tap) {  // each entry's expert: the offsets range holding its sorted row
    Tensor chosen = Tensor::zeros({T, K}, DType::i32);
    MSA_CUDA_CHECK(cudaMemcpyAsync(chosen.raw(), dispatch.entry_row, chosen.nbytes(), cudaMemcpyDeviceToHost,
                                   s.stream));
    MSA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    for (int32_t& row : chosen.span<int32_t>())
      row = static_cast<int32_t>(std::upper_bound(offsets, offsets + E + 1, row) - offsets - 1);
    s.tap("layers." + std::to_string(layer) + ".experts", chosen);
  }
  // One projection of every routed expert: y [N, out] = x [N, in] times each expert's w [out, in].
  // Quantized experts: `quantized` holds the codes and expert_w is null (moe_kernel_for never
  // picks per_expert for them).
  auto experts = [&](const uint16_t* x, const uint16_t* expert_w, const QuantizedExpertWeights& quantized,
                     int64_t in, int64_t out, float* y) {
    if (kernel != MoeKernel::per_expert) {
      routed_experts_on_device(kernel, x, expert_w, quantized, dispatch.offsets, N, E, in, out, y, s.stream);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        st.gemm.linear(x + begin * in, in, expert_w + e * out * in, DType::bf16, rows, out, in, y + begin * out,
                       DType::f32, out, false, s.stream);
      }
    }
  };
  const bool bf16 = w.expert_format == ExpertWeights::bf16;
  experts(s.bf16(l.x_sorted), bf16 ? w.experts_gate_up.as<uint16_t>() : nullptr, gate_up_expert_weights(w), H, 2 * I,
          s.f32(l.gate_up));
  swiglu_oai(s.f32(l.gate_up), N, I, s.alpha, s.limit, s.bf16(l.act), s.stream);
  experts(s.bf16(l.act), bf16 ? w.experts_down.as<uint16_t>() : nullptr, down_expert_weights(w), I, H,
          s.f32(l.y_sorted));
  moe_combine(s.f32(l.y_sorted), s.f32(l.entry_weight), s.i32(l.entry_row), T, K, H, s.target, s.stream);
}

// The MoE of one rank of a parallel model, as src/parallel/expert_parallel.cpp does it on the
// host. Each rank routes only its home tokens [T r / N, T (r + 1) / N) (the router is
// replicated, so no routing is repeated); the dispatch sorts their (token, choice) rows by
// expert, and since rank p owns experts [p E / N, (p + 1) E / N), the rows for each owner are
// contiguous: the send buffer is x_sorted as it is. One all_gather of every rank's expert
// offsets gives each rank all the all-to-all-v counts and the (peer, expert) segments of what
// it receives; the host needs them for the counts and the GEMMs' row counts, which is this
// layer's one host sync (overlapped with the shared expert). The owners run their experts
// over what came (one GEMM per peer and expert) and send the rows back in the same order;
// the home rank weights them (moe_combine, in choice order like the single-rank model) into
// its home rows of the branch, whose other rows hold the shared expert's column-split partial
// sums: add_branch's all-reduce completes the layer on every rank.
void CudaModel::expert_parallel_moe(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const DeviceLayer& w = weights_.layers[layer];
  const StepLayout& l = s.l;
  State& st = s.st;
  Communicator& comm = *comm_;
  const CommStream comm_stream{s.stream};
  const int world = plan_.world, rank = plan_.rank;
  const int64_t T = s.shape.T, H = c.hidden_size;
  const int64_t E = c.num_experts, K = c.experts_per_token, I = c.moe_intermediate_size;
  const int64_t owned = plan_.experts;
  auto home_begin = [&](int r) { return T * r / world; };
  const int64_t begin = home_begin(rank), home = home_begin(rank + 1) - begin;
  const MoeDispatch dispatch = route(s, layer, begin, home);
  int32_t* offsets = dispatch.offsets;
  if (home > 0) {
    ensure(st.moe_workspace, moe_dispatch_workspace_bytes(home, K, E));
    moe_dispatch(dispatch, st.moe_workspace.get(), st.moe_workspace.bytes(), s.stream);
  } else {
    MSA_CUDA_CHECK(cudaMemsetAsync(offsets, 0, static_cast<size_t>(E + 1) * sizeof(int32_t), s.stream));
  }
  int32_t* all_offsets = s.i32(l.all_offsets);
  comm.all_gather(offsets, 1, E + 1, DType::i32, all_offsets, comm_stream);
  MSA_CUDA_CHECK(cudaMemcpyAsync(st.host_offsets, all_offsets, static_cast<size_t>(world * (E + 1)) * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, s.stream));
  MSA_CUDA_CHECK(cudaEventRecord(st.offsets_ready, s.stream));
  // The shared expert's partial sums (all tokens, this rank's columns) while the host waits.
  if (w.shared_expert.inter > 0)
    mlp(s, s.bf16(l.xn), T, w.shared_expert);
  else
    MSA_CUDA_CHECK(cudaMemsetAsync(s.target, 0, static_cast<size_t>(T * H) * sizeof(float), s.stream));
  MSA_CUDA_CHECK(cudaEventSynchronize(st.offsets_ready));
  auto offset = [&](int r, int64_t e) -> int64_t { return st.host_offsets[static_cast<int64_t>(r) * (E + 1) + e]; };
  for (int r = 0; r < world; ++r) {
    const int64_t entries = (home_begin(r + 1) - home_begin(r)) * K;
    for (int64_t e = 0; e < E; ++e)
      if (offset(r, e) > offset(r, e + 1) || offset(r, e) < 0)
        MSA_FAIL("MoE dispatch of layer ", layer, " on rank ", r, " produced bad expert offsets: offsets[", e,
                 "] = ", offset(r, e), ", offsets[", e + 1, "] = ", offset(r, e + 1));
    if (offset(r, 0) != 0 || offset(r, E) != entries)
      MSA_FAIL("MoE dispatch of layer ", layer, " on rank ", r, " covers rows [", offset(r, 0), ", ", offset(r, E),
               "), expected [0, ", entries, ")");
  }
  if (s.tap) {  // each home entry's expert (whole-model ids), as mixture_of_experts taps it
    Tensor chosen = Tensor::zeros({home, K}, DType::i32);
    if (home > 0) {
      MSA_CUDA_CHECK(cudaMemcpyAsync(chosen.raw(), dispatch.entry_row, chosen.nbytes(), cudaMemcpyDeviceToHost,
                                     s.stream));
      MSA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    }
    const int32_t* mine = st.host_offsets + static_cast<int64_t>(rank) * (E + 1);
    for (int32_t& row : chosen.span<int32_t>())
      row = static_cast<int32_t>(std::upper_bound(mine, mine + E + 1, row) - mine - 1);
    s.tap("layers." + std::to_string(layer) + ".experts", chosen);
  }
  std::vector<int64_t> send_rows(world), recv_rows(world);
  for (int p = 0; p < world; ++p) {
    send_rows[p] = offset(rank, (p + 1) * owned) - offset(rank, p * owned);
    recv_rows[p] = offset(p, (rank + 1) * owned) - offset(p, rank * owned);
  }
  comm.all_to_all_v(s.bf16(l.x_sorted), send_rows, s.bf16(l.x_recv), recv_rows, H, DType::bf16, comm_stream);

  // The received rows: from peer 0 its rows for this rank's experts in expert order, then
  // peer 1's, ...: one segment per (peer, expert).
  struct Segment {
    int64_t begin, rows, expert;
  };
  std::vector<Segment> segments;
  int64_t received = 0;
  for (int p = 0; p < world; ++p)
    for (int64_t e = 0; e < owned; ++e) {
      const int64_t first = offset(p, rank * owned + e), rows = offset(p, rank * owned + e + 1) - first;
      if (rows > 0) segments.push_back({received, rows, e});
      received += rows;
    }
  if (w.expert_format == ExpertWeights::bf16) {
    const uint16_t* gate_up_w = w.experts_gate_up.as<uint16_t>();
    const uint16_t* down_w = w.experts_down.as<uint16_t>();
    for (const Segment& g : segments)
      st.gemm.linear(s.bf16(l.x_recv) + g.begin * H, H, gate_up_w + g.expert * 2 * I * H, DType::bf16, g.rows,
                     2 * I, H, s.f32(l.gate_up) + g.begin * 2 * I, DType::f32, 2 * I, false, s.stream);
    if (received > 0) swiglu_oai(s.f32(l.gate_up), received, I, s.alpha, s.limit, s.bf16(l.act), s.stream);
    for (const Segment& g : segments)
      st.gemm.linear(s.bf16(l.act) + g.begin * I, I, down_w + g.expert * H * I, DType::bf16, g.rows, H, I,
                     s.f32(l.y_recv) + g.begin * H, DType::f32, H, false, s.stream);
  } else {
    // Experts kept quantized (MXFP8 / NVFP4) are read by the small and grouped kernels only.
    // Each peer's rows arrive sorted by this rank's experts, so one launch per peer and
    // projection covers them, given that peer's expert offsets counted from its first row.
    std::vector<int32_t> peer_offsets(static_cast<size_t>(world) * (owned + 1));
    for (int p = 0; p < world; ++p)
      for (int64_t e = 0; e <= owned; ++e)
        peer_offsets[p * (owned + 1) + e] =
            static_cast<int32_t>(offset(p, rank * owned + e) - offset(p, rank * owned));
    int32_t* device_offsets = s.i32(l.peer_offsets);
    // Pageable source: the call returns once the values are staged, so the vector may go.
    MSA_CUDA_CHECK(cudaMemcpyAsync(device_offsets, peer_offsets.data(), peer_offsets.size() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, s.stream));
    const auto per_peer = [&](const uint16_t* x, const QuantizedExpertWeights& quantized, int64_t in, int64_t out,
                              float* y) {
      int64_t first = 0;
      for (int p = 0; p < world; ++p) {
        if (recv_rows[p] > 0)
          routed_experts_on_device(moe_kernel_for(recv_rows[p]), x + first * in, nullptr, quantized,
                                   device_offsets + p * (owned + 1), recv_rows[p], owned, in, out, y + first * out,
                                   s.stream);
        first += recv_rows[p];
      }
    };
    per_peer(s.bf16(l.x_recv), gate_up_expert_weights(w), H, 2 * I, s.f32(l.gate_up));
    if (received > 0) swiglu_oai(s.f32(l.gate_up), received, I, s.alpha, s.limit, s.bf16(l.act), s.stream);
    per_peer(s.bf16(l.act), down_expert_weights(w), I, H, s.f32(l.y_recv));
  }
  comm.all_to_all_v(s.f32(l.y_recv), recv_rows, s.f32(l.y_sorted), send_rows, H, DType::f32, comm_stream);
  moe_combine(s.f32(l.y_sorted), s.f32(l.entry_weight), s.i32(l.entry_row), home, K, H, s.target + begin * H,
              s.stream);
}

// The final norm of the rows whose logits are wanted, lm_head, and the logits' download.
void CudaModel::final_logits(Step& s) {
  const int64_t R = s.shape.R, H = s.c.hidden_size, V = s.c.vocab_size;
  cudaEvent_t start = s.timer.mark();
  rms_norm_rows(s.x, s.i64(s.l.logit_rows), R, H, weights_.final_norm.as<float>(), s.eps, s.bf16(s.l.normed),
                s.tap ? s.f32(s.l.normed_f32) : nullptr, s.stream);
  if (s.tap) s.observe("norm", s.f32(s.l.normed_f32), {R, H}, DType::f32);
  s.st.gemm.linear(s.bf16(s.l.normed), H, weights_.lm_head.get(), DType::bf16, R, V, H, s.f32(s.l.logits),
                   DType::f32, V, false, s.stream);
  s.timer.add(-1, 0, start, s.timer.mark());
}

Tensor CudaModel::head(Step& s) {
  final_logits(s);
  Tensor logits = Tensor::zeros({s.shape.R, s.c.vocab_size}, DType::f32);
  MSA_CUDA_CHECK(cudaMemcpyAsync(logits.raw(), s.f32(s.l.logits), logits.nbytes(), cudaMemcpyDeviceToHost,
                                 s.stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  return logits;
}

// ---- decode graphs ----

namespace {

// The largest bucket of request slots: a serving batch (msa serve's --max-batch is 32 by
// default); bigger decode steps run eagerly.
constexpr int64_t kMaxGraphBatch = 256;

// The addresses a graph bakes in from the cache: every layer's page tensors.
std::vector<const void*> cache_addresses(const KvCache& cache, const ModelConfig& c) {
  std::vector<const void*> addresses;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    addresses.push_back(cache.k(layer).raw());
    addresses.push_back(cache.v(layer).raw());
    addresses.push_back(c.sparse_layers[layer] ? cache.index_keys(layer).raw() : nullptr);
    addresses.push_back(cache.k_scale(layer).defined() ? cache.k_scale(layer).raw() : nullptr);
    addresses.push_back(cache.v_scale(layer).defined() ? cache.v_scale(layer).raw() : nullptr);
  }
  addresses.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(cache.num_pages())));
  return addresses;
}

}  // namespace

void CudaModel::set_dense_attention(bool dense) {
  if (dense != dense_attention_) state_->graphs.clear();  // their plans follow the mode
  dense_attention_ = dense;
}

void CudaModel::set_decode_graphs(bool on) {
  // A rank's collectives synchronise with the host (the expert-parallel MoE's row counts):
  // not capturable.
  if (on && comm_)
    throw_arg_error("decode_graphs", "off for one rank of a parallel model (its collectives are not captured)",
                    "on");
  if (!on) state_->graphs.clear();
  decode_graphs_ = on;
}

int64_t CudaModel::captured_decode_graphs() const {
  int64_t count = 0;
  for (const auto& [key, graph] : state_->graphs) count += graph && graph->exec;
  return count;
}

// The bucket of (request slots, page-table columns), made on first use: its step layout at
// capacity, its buffers and its decode plans. Null when the bucket cannot run as a graph
// (its MoE would need the host's expert offsets, or no capacity-safe decode plan exists for
// it): such steps run eagerly, as before. A different cache drops every graph first.
CudaModel::DecodeGraph* CudaModel::decode_graph_for(int64_t batch, int64_t pages, KvCache& cache) {
  const ModelConfig& c = config_;
  State& st = *state_;
  std::vector<const void*> addresses = cache_addresses(cache, c);
  if (addresses != st.graph_cache) {
    st.graphs.clear();
    st.graph_cache = std::move(addresses);
  }
  const auto key = std::make_pair(batch, pages);
  if (auto found = st.graphs.find(key); found != st.graphs.end()) return found->second.get();
  std::unique_ptr<DecodeGraph>& slot = st.graphs[key];  // stays null for an unsupported bucket

  bool any_moe = false, uses_sparse = false, uses_dense = false;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    any_moe |= static_cast<bool>(c.moe_layers[layer]);
    (c.sparse_layers[layer] && !dense_attention_ ? uses_sparse : uses_dense) = true;
  }
  const int64_t entries = batch * c.experts_per_token;
  if (any_moe && moe_kernel_for(entries) == MoeKernel::per_expert) return nullptr;

  auto graph = std::make_unique<DecodeGraph>();
  graph->shape = {.T = batch, .R = batch, .batch = batch, .max_pages = pages, .tap = false, .decode_plan = true,
                  .fp8_kv = cache.dtype() == DType::e4m3};
  graph->layout = plan_step(c, graph->shape);
  const msa::cuda::DecodeCapacities capacities{
      .max_batch = batch, .max_queries = 1, .max_total_queries = batch, .max_context = pages * c.block_size};
  const msa::cuda::DecodeDims dims{.q_heads = c.num_heads,
                                   .kv_heads = c.num_kv_heads,
                                   .head_dim = c.head_dim,
                                   .index_dim = c.any_sparse_layer() ? c.index_head_dim : c.head_dim};
  size_t workspace = 0;
  try {
    if (uses_sparse) {
      graph->sparse_plan = std::make_unique<msa::cuda::DecodePlan>(capacities, dims, c.msa_params());
      workspace = std::max(workspace, graph->sparse_plan->workspace_bytes());
    }
    if (uses_dense) {
      // Top-k covering every block of the bucket's context: the plan is dense causal attention.
      MsaParams params = c.msa_params();
      params.topk = static_cast<int>(std::max<int64_t>(pages, c.local_blocks + c.init_blocks));
      graph->dense_plan = std::make_unique<msa::cuda::DecodePlan>(capacities, dims, params);
      if (!graph->dense_plan->is_dense()) MSA_FAIL("decode graph: the dense layers' plan is not dense");
      workspace = std::max(workspace, graph->dense_plan->workspace_bytes());
    }
  } catch (const msa::Error&) {
    return nullptr;  // no capacity-safe decode path for this bucket (a plan's own checks)
  }
  const int64_t last = c.num_layers - 1;
  graph->last_plan = c.sparse_layers[last] && !dense_attention_ ? graph->sparse_plan.get() : graph->dense_plan.get();
  graph->activations = DeviceBuffer(graph->layout.total);
  // Padding rows read activations no step wrote: zeros keep them finite.
  MSA_CUDA_CHECK(cudaMemsetAsync(graph->activations.get(), 0, graph->layout.total, st.stream));
  graph->attention_workspace = DeviceBuffer(workspace);
  if (any_moe) ensure(graph->moe_workspace, moe_dispatch_workspace_bytes(batch, c.experts_per_token, c.num_experts));
  slot = std::move(graph);
  return slot.get();
}

void CudaModel::decode_plan_attention(Step& s, int64_t layer) {
  const ModelConfig& c = s.c;
  const DecodeGraph& g = *s.graph;
  const StepLayout& l = s.l;
  const bool sparse = c.sparse_layers[layer] && !dense_attention_;
  const msa::cuda::DecodePlan& plan = sparse ? *g.sparse_plan : *g.dense_plan;
  msa::cuda::DecodeStep step;
  step.q = s.bf16(l.q);
  step.k_cache = static_cast<const uint16_t*>(s.cache.k(layer).raw());
  step.v_cache = static_cast<const uint16_t*>(s.cache.v(layer).raw());
  if (s.shape.fp8_kv) {
    step.kv_format = msa::cuda::KvFormat::fp8;
    step.k_fp8 = fp8_kv(s.cache.k(layer), s.cache.k_scale(layer), c.num_kv_heads, c.block_size);
    step.v_fp8 = fp8_kv(s.cache.v(layer), s.cache.v_scale(layer), c.num_kv_heads, c.block_size);
  }
  if (sparse) {
    step.qi = s.bf16(l.qi);
    step.index_key_cache = static_cast<const uint16_t*>(s.cache.index_keys(layer).raw());
    step.topk = s.i32(l.topk);
  }
  step.page_table = s.i32(l.page_table);
  step.page_table_stride = s.shape.max_pages;
  step.num_pages = s.cache.num_pages();
  step.cu_seqlens_q = s.i32(l.cu_seqlens_q);
  step.seq_lens = s.i32(l.seq_lens);
  step.o = s.bf16(l.o);  // o_proj's input, rounded by the kernel's epilogue
  step.o_type = msa::cuda::OutputType::bf16;
  step.lse = s.f32(l.attn_lse);
  step.workspace = g.attention_workspace.get();
  plan.run(step, s.stream);
}

// Warm-up, then capture: the bucket's launches run once eagerly (GEMM plans, lazily loaded
// kernels and any workspace growth happen outside the capture; the step they compute is the
// replay's own, every write recomputed identically), then the same launches are captured.
void CudaModel::capture(DecodeGraph& g, KvCache& cache) {
  State& st = *state_;
  const ForwardTap no_tap;
  PartTimer timer(st.events, st.stream, nullptr, config_.num_layers);
  Step step{config_, st, cache, no_tap, timer, st.stream};
  step.graph = &g;
  step.shape = g.shape;
  step.l = g.layout;
  step.base = static_cast<char*>(g.activations.get());
  step.bind_residual(nullptr);  // never a parallel model's rank (set_decode_graphs)
  const PackedStep no_visual_rows;  // embed() reads only its visual rows
  auto launches = [&] {
    embed(step, no_visual_rows);
    layers(step);
    final_logits(step);
  };
  launches();
  MSA_CUDA_CHECK(cudaStreamSynchronize(st.stream));
  MSA_CUDA_CHECK(cudaStreamBeginCapture(st.stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    launches();
  } catch (...) {
    cudaStreamEndCapture(st.stream, &graph);  // leaves the stream usable; the error is the launch's
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  MSA_CUDA_CHECK(cudaStreamEndCapture(st.stream, &graph));
  const cudaError_t instantiated = cudaGraphInstantiate(&g.exec, graph, 0);
  cudaGraphDestroy(graph);
  MSA_CUDA_CHECK(instantiated);
}

std::optional<Tensor> CudaModel::forward_decode_graph(std::span<const ForwardRequest> requests, KvCache& cache,
                                                      const PackedStep& packed) {
  const ModelConfig& c = config_;
  State& st = *state_;
  const StepBatch& batch = packed.batch;
  const int64_t n = static_cast<int64_t>(requests.size());
  if (batch.tokens != n || !packed.visual.empty() || n > kMaxGraphBatch) return std::nullopt;
  const int64_t used_pages = batch.page_table.size(1);
  const int64_t slots = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n)));
  const int64_t pages = std::min(static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(used_pages))),
                                 cache.num_pages());
  DecodeGraph* g = decode_graph_for(slots, pages, cache);
  if (!g) return std::nullopt;

  // The step's metadata in the bucket's layout; padding slots: token 0 at position 0, no
  // cache slot (-1: head_norm_rope writes nothing), no queries, an empty context.
  const StepLayout& l = g->layout;
  std::vector<int32_t> tokens(slots, 0), cu_q(slots + 1), seq_lens(slots, 0);
  std::vector<int64_t> positions(slots, 0), cache_slots(slots, -1), logit_rows(slots);
  std::vector<int32_t> page_table(static_cast<size_t>(slots * pages), 0);
  for (int64_t b = 0; b < slots; ++b) {
    cu_q[b + 1] = static_cast<int32_t>(std::min(b + 1, n));
    logit_rows[b] = b;
  }
  for (int64_t b = 0; b < n; ++b) {
    tokens[b] = packed.tokens[b];
    positions[b] = batch.positions[b];
    cache_slots[b] = batch.slot[b];
    seq_lens[b] = batch.seq_lens.data<int32_t>()[b];
    std::copy_n(batch.page_table.data<int32_t>() + b * used_pages, used_pages, page_table.begin() + b * pages);
  }
  std::vector<char>& staging = st.staging;
  staging.assign(l.meta_end, 0);
  stage(staging, l.tokens, tokens);
  stage(staging, l.positions, positions);
  stage(staging, l.slots, cache_slots);
  stage(staging, l.page_table, page_table);
  stage(staging, l.logit_rows, logit_rows);
  stage(staging, l.cu_seqlens_q, cu_q);
  stage(staging, l.seq_lens, seq_lens);
  char* base = static_cast<char*>(g->activations.get());
  MSA_CUDA_CHECK(cudaMemcpyAsync(base, staging.data(), l.meta_end, cudaMemcpyHostToDevice, st.stream));

  if (!g->exec) capture(*g, cache);
  MSA_CUDA_CHECK(cudaGraphLaunch(g->exec, st.stream));

  // The plans' status (written by every layer's geometry kernel; the last layer's stands
  // for all: same lengths, same capacities) comes back with the logits, in the one sync.
  msa::cuda::DecodeStep status_step;
  status_step.workspace = g->attention_workspace.get();
  MSA_CUDA_CHECK(cudaMemcpyAsync(st.host_status, g->last_plan->step_status(status_step),
                                 sizeof(msa::cuda::GeometryStatus), cudaMemcpyDeviceToHost, st.stream));
  Tensor logits = Tensor::zeros({n, c.vocab_size}, DType::f32);
  MSA_CUDA_CHECK(cudaMemcpyAsync(logits.raw(), base + l.logits, logits.nbytes(), cudaMemcpyDeviceToHost,
                                 st.stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(st.stream));
  if (st.host_status->request != -1) {
    g->last_plan->check_last_step(status_step, st.stream);  // throws the named length
    MSA_FAIL("decode graph: the step's lengths were refused (request ", st.host_status->request, ")");
  }
  return logits;
}

void set_cuda_decode_graphs(CudaModel& model, bool on) { model.set_decode_graphs(on); }
bool cuda_decode_graphs(const CudaModel& model) { return model.decode_graphs(); }
int64_t cuda_decode_graphs_captured(const CudaModel& model) { return model.captured_decode_graphs(); }

std::shared_ptr<CudaModel> make_cuda_model(const ModelConfig& config, const ModelWeights& host) {
  check_cuda_support(config);  // before uploading anything
  DeviceWeights weights = allocate_device_weights(config, host_expert_format(config, host));
  upload_device_weights(config, host, weights);
  return std::make_shared<CudaModel>(config, std::move(weights));
}

std::shared_ptr<CudaModel> make_cuda_parallel_model(const ModelConfig& config, const ModelWeights& host,
                                                    const ShardPlan& plan, Communicator& comm) {
  const ModelConfig local = rank_config(config, plan);
  check_cuda_support(local);  // before uploading anything
  DeviceWeights weights = allocate_device_weights(local, plan.experts, host_expert_format(local, host));
  upload_device_weights(local, host, weights);
  return std::make_shared<CudaModel>(local, std::move(weights), comm, plan);
}

Tensor cuda_forward(CudaModel& model, std::span<const ForwardRequest> requests, KvCache& cache,
                    const ForwardTap& tap) {
  return model.forward(requests, cache, tap);
}

}  // namespace msa::model::gpu
