// The CUDA forward step (see cuda_model.h). Per layer, on one stream:
//   xn = norm(x)                          rms_norm_rows                         bf16
//   proj = xn [q;k;v(;iq;ik)]^T           one cuBLASLt GEMM                     f32
//   q, k -> cache, v -> cache, (iq, ik -> index cache): head_norm_rope          bf16
//   attention (dense) or indexer + sparse attention (launch.h)                 f32 o
//   x += o_proj(bf16(o))                  GEMM accumulating into x (beta = 1)
//   xn = norm(x)                          (+ f32 copy for the router on MoE layers)
//   dense MLP: x += down(swiglu(xn [gate;up]^T))
//   MoE: router GEMM (f32) -> dispatch (top-k, sort by expert, gather) -> host reads the
//        per-expert row offsets (the step's one sync per MoE layer) -> per-expert GEMMs
//        gate_up, swiglu, down -> x += shared expert + sum_j w_j * expert_j (combine)
// With a tap, each branch goes to a scratch buffer first (observed, then added to x).
#include "cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/cuda_check.h"
#include "cuda/launch.h"
#include "gemm.h"
#include "kernels.h"
#include "model/step_batch.h"
#include "model/tensor_math.h"

namespace msa::model::gpu {

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Offsets of named regions in one device allocation (256-byte aligned each).
class Layout {
 public:
  template <class T>
  size_t add(int64_t count) {
    const size_t offset = at_;
    at_ += align_up(static_cast<size_t>(std::max<int64_t>(count, 0)) * sizeof(T));
    return offset;
  }
  size_t total() const { return at_; }

 private:
  size_t at_ = 0;
};

// CUDA events for timing, created on first use and reused by every step.
struct EventPool {
  std::vector<cudaEvent_t> events;
  size_t next = 0;

  ~EventPool() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
  cudaEvent_t record(cudaStream_t stream) {
    if (next == events.size()) {
      cudaEvent_t e = nullptr;
      MSA_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
    }
    cudaEvent_t e = events[next++];
    MSA_CUDA_CHECK(cudaEventRecord(e, stream));
    return e;
  }
};

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

struct CudaModel::State {
  cudaStream_t stream = nullptr;
  Gemm gemm;
  DeviceBuffer inv_freq;  // f32 [rotary_dim / 2]
  DeviceBuffer activations, attention_workspace, moe_workspace;
  std::vector<char> staging;  // the step's metadata, uploaded in one copy
  int32_t* host_offsets = nullptr;  // pinned [experts + 1]
  cudaEvent_t offsets_ready = nullptr;
  EventPool events;

  explicit State(const ModelConfig& c) {
    MSA_CUDA_CHECK(cudaStreamCreate(&stream));  // blocking: ordered after legacy-stream copies
    const std::vector<float> inv = rope_inverse_frequencies(c.rotary_dim, c.rope_theta);
    inv_freq = DeviceBuffer::from(inv);
    MSA_CUDA_CHECK(cudaMallocHost(&host_offsets, static_cast<size_t>(c.num_experts + 1) * sizeof(int32_t)));
    MSA_CUDA_CHECK(cudaEventCreateWithFlags(&offsets_ready, cudaEventDisableTiming));
  }
  ~State() {
    if (offsets_ready) cudaEventDestroy(offsets_ready);
    if (host_offsets) cudaFreeHost(host_offsets);
    if (stream) cudaStreamDestroy(stream);
  }
};

namespace {

// What the kernels take (src/cuda/attention.cu, indexer.cu; kernels.h): refused at load
// rather than at the first step.
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
  for (bool moe : c.moe_layers)
    if (moe && c.experts_per_token > kMaxExpertsPerToken)
      throw_arg_error("config.num_experts_per_tok",
                      "at most " + std::to_string(kMaxExpertsPerToken) + " (the CUDA MoE routing)",
                      c.experts_per_token);
}

}  // namespace

CudaModel::CudaModel(const ModelConfig& config, DeviceWeights weights)
    : config_(config), weights_(std::move(weights)), state_(std::make_unique<State>(config_)) {
  check_cuda_support(config_);
}

CudaModel::~CudaModel() = default;

void* CudaModel::stream() const { return state_->stream; }

namespace {

// Everything one step needs on the device, as offsets into State::activations. The
// metadata comes first so that one host-to-device copy of [0, meta_end) uploads it.
struct StepLayout {
  // metadata (uploaded)
  size_t tokens, positions, slots, q_start, k_len, seq_of_query, page_table, logit_rows, meta_end;
  // activations
  size_t x, branch, xn, xn_f32, proj, q, qi, topk, attn_o, attn_lse, o, gate_up, act;
  size_t router_logits, entry_weight, entry_row, offsets, x_sorted, y_sorted;
  size_t normed, normed_f32, logits;
  size_t total;
};

struct StepShape {
  int64_t T = 0, R = 0, batch = 0, max_pages = 0;
  bool tap = false;
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
  Layout a;
  l.tokens = a.add<int32_t>(T);
  l.positions = a.add<int64_t>(T);
  l.slots = a.add<int64_t>(T);
  l.q_start = a.add<int64_t>(s.batch + 1);
  l.k_len = a.add<int64_t>(s.batch);
  l.seq_of_query = a.add<int32_t>(T);
  l.page_table = a.add<int32_t>(s.batch * s.max_pages);
  l.logit_rows = a.add<int64_t>(s.R);
  l.meta_end = a.total();
  l.x = a.add<float>(T * H);
  l.branch = a.add<float>(s.tap ? T * H : 0);
  l.xn = a.add<uint16_t>(T * H);
  l.xn_f32 = a.add<float>(any_moe ? T * H : 0);
  l.proj = a.add<float>(T * proj_cols);
  l.q = a.add<uint16_t>(T * QD);
  l.qi = a.add<uint16_t>(any_sparse ? T * c.index_heads * c.index_head_dim : 0);
  l.topk = a.add<int32_t>(any_sparse ? c.index_heads * T * c.topk_blocks : 0);
  l.attn_o = a.add<float>(T * QD);
  l.attn_lse = a.add<float>(T * c.num_heads);
  l.o = a.add<uint16_t>(T * QD);
  l.gate_up = a.add<float>(gate_up);
  l.act = a.add<uint16_t>(gate_up / 2);
  l.router_logits = a.add<float>(any_moe ? T * c.num_experts : 0);
  l.entry_weight = a.add<float>(N);
  l.entry_row = a.add<int32_t>(N);
  l.offsets = a.add<int32_t>(any_moe ? c.num_experts + 1 : 0);
  l.x_sorted = a.add<uint16_t>(N * H);
  l.y_sorted = a.add<float>(N * H);
  l.normed = a.add<uint16_t>(s.R * H);
  l.normed_f32 = a.add<float>(s.tap ? s.R * H : 0);
  l.logits = a.add<float>(s.R * c.vocab_size);
  l.total = a.total();
  return l;
}

// Host copies of the step's metadata, in the layout's order.
template <class T>
void stage(std::vector<char>& staging, size_t offset, const std::vector<T>& values) {
  std::copy_n(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T),
              staging.data() + offset);
}

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
  std::vector<Span> spans_;
};

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

Tensor CudaModel::forward(std::span<const ForwardRequest> requests, KvCache& cache,
                          const ForwardTap& tap, StepProfile* profile) {
  const ModelConfig& c = config_;
  State& st = *state_;
  const cudaStream_t stream = st.stream;
  MSA_CHECK_ARG(cache.device() == Device::cuda, "cache", "a CUDA KV cache (Device::cuda)",
                std::string(device_name(cache.device())) + " cache");
  MSA_CHECK_ARG(cache.dtype() == DType::bf16, "cache", "bf16 pages", dtype_name(cache.dtype()));
  const PackedStep step = pack_step(requests, cache, c);
  const StepBatch& batch = step.batch;
  for (size_t t = 0; t < step.tokens.size(); ++t)
    if (step.tokens[t] < 0 || step.tokens[t] >= c.vocab_size)
      throw_arg_error("tokens[" + std::to_string(t) + "]",
                      "a token id in [0, " + std::to_string(c.vocab_size) + ")", step.tokens[t]);

  // ---- the step's geometry ----
  StepShape shape;
  shape.T = batch.tokens;
  shape.R = static_cast<int64_t>(step.logit_rows.size());
  shape.batch = static_cast<int64_t>(requests.size());
  shape.max_pages = batch.page_table.size(1);
  shape.tap = static_cast<bool>(tap);
  const int64_t T = shape.T, R = shape.R, H = c.hidden_size, V = c.vocab_size;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t Hi = c.index_heads, Di = c.index_head_dim, B = c.block_size;
  std::vector<int64_t> q_start(shape.batch + 1), k_len(shape.batch);
  std::vector<int32_t> seq_of_query(T);
  int64_t max_k_len = 0, max_q_len = 0;
  for (int64_t b = 0; b < shape.batch; ++b) {
    q_start[b] = batch.cu_seqlens_q.data<int32_t>()[b];
    q_start[b + 1] = batch.cu_seqlens_q.data<int32_t>()[b + 1];
    k_len[b] = batch.seq_lens.data<int32_t>()[b];
    for (int64_t t = q_start[b]; t < q_start[b + 1]; ++t) seq_of_query[t] = static_cast<int32_t>(b);
    max_k_len = std::max(max_k_len, k_len[b]);
    max_q_len = std::max(max_q_len, q_start[b + 1] - q_start[b]);
  }

  const StepLayout l = plan_step(c, shape);
  ensure(st.activations, l.total);
  char* base = static_cast<char*>(st.activations.get());
  auto f32 = [&](size_t offset) { return reinterpret_cast<float*>(base + offset); };
  auto bf16 = [&](size_t offset) { return reinterpret_cast<uint16_t*>(base + offset); };
  auto i32 = [&](size_t offset) { return reinterpret_cast<int32_t*>(base + offset); };
  auto i64 = [&](size_t offset) { return reinterpret_cast<int64_t*>(base + offset); };

  st.staging.assign(l.meta_end, 0);
  stage(st.staging, l.tokens, step.tokens);
  stage(st.staging, l.positions, batch.positions);
  stage(st.staging, l.slots, batch.slot);
  stage(st.staging, l.q_start, q_start);
  stage(st.staging, l.k_len, k_len);
  stage(st.staging, l.seq_of_query, seq_of_query);
  std::copy_n(static_cast<const char*>(batch.page_table.raw()), batch.page_table.nbytes(),
              st.staging.data() + l.page_table);
  stage(st.staging, l.logit_rows, step.logit_rows);
  MSA_CUDA_CHECK(cudaMemcpyAsync(base, st.staging.data(), l.meta_end, cudaMemcpyHostToDevice, stream));

  msa::cuda::BatchLayout batch_layout;
  batch_layout.q_start = i64(l.q_start);
  batch_layout.k_len = i64(l.k_len);
  batch_layout.seq_of_query = i32(l.seq_of_query);
  batch_layout.batch = shape.batch;
  batch_layout.total_q = T;
  batch_layout.max_k_len = max_k_len;
  batch_layout.max_q_len = max_q_len;

  // ---- observing intermediates (downloads; only with a tap) ----
  auto observe = [&](const std::string& name, const void* data, const Shape& dims, DType dtype) {
    Tensor host = Tensor::zeros(dims, dtype);
    MSA_CUDA_CHECK(cudaMemcpyAsync(host.raw(), data, host.nbytes(), cudaMemcpyDeviceToHost, stream));
    MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
    tap(name, host);
  };

  const float eps = static_cast<float>(c.rms_norm_eps);
  const float alpha = static_cast<float>(c.swiglu_alpha), limit = static_cast<float>(c.swiglu_limit);
  Gemm& gemm = st.gemm;
  float* x = f32(l.x);
  // Branch outputs accumulate straight into the residual stream, unless observed.
  float* target = tap ? f32(l.branch) : x;
  const bool accumulate = !tap;

  auto mlp = [&](const uint16_t* in, int64_t rows, const DeviceMlp& w) {
    const int64_t I = w.inter;
    gemm.linear(in, H, w.gate_up.get(), DType::bf16, rows, 2 * I, H, f32(l.gate_up), DType::f32,
                2 * I, false, stream);
    swiglu_oai(f32(l.gate_up), rows, I, alpha, limit, bf16(l.act), stream);
    gemm.linear(bf16(l.act), I, w.down.get(), DType::bf16, rows, H, I, target, DType::f32, H,
                accumulate, stream);
  };

  PartTimer timer(st.events, stream, profile, c.num_layers);
  cudaEvent_t head_start = timer.mark();
  embed_rows(weights_.embed_tokens.as<uint16_t>(), H, i32(l.tokens), T, x, stream);
  timer.add(-1, 0, head_start, timer.mark());
  if (tap) observe("embed", x, {T, H}, DType::f32);

  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const DeviceLayer& w = weights_.layers[layer];
    const std::string name = "layers." + std::to_string(layer);
    const bool sparse = c.sparse_layers[layer];
    cudaEvent_t layer_start = timer.mark();

    // ---- attention half: projections, q/k norm + RoPE, cache append ----
    rms_norm_rows(x, nullptr, T, H, w.input_norm.as<float>(), eps, bf16(l.xn), nullptr, stream);
    const int64_t P = w.qkv_rows;
    gemm.linear(bf16(l.xn), H, w.qkv.get(), DType::bf16, T, P, H, f32(l.proj), DType::f32, P, false,
                stream);
    HeadTransform job;
    job.src_stride = P;
    job.tokens = T;
    job.eps = eps;
    job.inv_freq = st.inv_freq.as<float>();
    job.positions = i64(l.positions);
    job.block_size = B;
    auto transform = [&](int64_t column, int64_t heads, int64_t dim, const DeviceBuffer* norm,
                         bool rope, uint16_t* dst, bool paged) {
      job.src = f32(l.proj) + column;
      job.heads = heads;
      job.dim = dim;
      job.norm_weight = norm ? norm->as<float>() : nullptr;
      job.rotary_dim = rope ? c.rotary_dim : 0;
      job.dst = dst;
      job.slots = paged ? i64(l.slots) : nullptr;
      head_norm_rope(job, stream);
    };
    transform(0, Hq, D, &w.q_norm, true, bf16(l.q), false);
    transform(Hq * D, Hkv, D, &w.k_norm, true, static_cast<uint16_t*>(cache.k(layer).raw()), true);
    transform((Hq + Hkv) * D, Hkv, D, nullptr, false, static_cast<uint16_t*>(cache.v(layer).raw()), true);
    if (sparse) {
      const int64_t column = (Hq + 2 * Hkv) * D;
      transform(column, Hi, Di, &w.index_q_norm, true, bf16(l.qi), false);
      transform(column + Hi * Di, 1, Di, &w.index_k_norm, true,
                static_cast<uint16_t*>(cache.index_keys(layer).raw()), true);
    }

    // ---- attention: dense causal, or indexer + sparse attention over its selection ----
    const int32_t* page_table = i32(l.page_table);
    msa::cuda::AttentionParams attention;
    attention.q = bf16(l.q);
    attention.k = paged_layout(cache.k(layer), Hkv, D, B, page_table, shape.max_pages);
    attention.v = paged_layout(cache.v(layer), Hkv, D, B, page_table, shape.max_pages);
    attention.q_heads = Hq;
    attention.kv_heads = Hkv;
    attention.head_dim = D;
    attention.batch = batch_layout;
    attention.scale = static_cast<float>(c.msa_params().scale);
    attention.o = f32(l.attn_o);
    attention.lse = f32(l.attn_lse);
    bool selected = false;
    if (sparse && !dense_attention_) {
      msa::cuda::IndexerParams index;
      index.qi = bf16(l.qi);
      index.heads = Hi;
      index.dim = Di;
      index.ki = paged_layout(cache.index_keys(layer), 1, Di, B, page_table, shape.max_pages);
      index.batch = batch_layout;
      index.block_size = static_cast<int>(B);
      index.topk = c.topk_blocks;
      index.local_blocks = c.local_blocks;
      index.init_blocks = c.init_blocks;
      index.logit_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Di)));
      index.topk_out = i32(l.topk);
      // Every visible block would be selected: MSA is dense attention exactly (msa-spec §4).
      if (!msa::cuda::msa_is_dense(index)) {
        selected = true;
        attention.topk = index.topk_out;
        attention.slots = c.topk_blocks;
        const size_t index_bytes = align_up(msa::cuda::indexer_workspace_bytes(index));
        ensure(st.attention_workspace, index_bytes + msa::cuda::attention_workspace_bytes(attention));
        char* ws = static_cast<char*>(st.attention_workspace.get());
        cudaEvent_t start = timer.mark();
        msa::cuda::indexer(index, ws, stream);
        cudaEvent_t between = timer.mark();
        msa::cuda::attention(attention, ws + index_bytes, stream);
        timer.add(layer, static_cast<int>(LayerPart::indexer), start, between);
        timer.add(layer, static_cast<int>(LayerPart::attention), between, timer.mark());
        if (tap) observe(name + ".topk", i32(l.topk), {Hi, T, c.topk_blocks}, DType::i32);
      }
    }
    if (!selected) {
      ensure(st.attention_workspace, msa::cuda::attention_workspace_bytes(attention));
      cudaEvent_t start = timer.mark();
      msa::cuda::attention(attention, st.attention_workspace.get(), stream);
      timer.add(layer, static_cast<int>(LayerPart::attention), start, timer.mark());
    }
    f32_to_bf16(f32(l.attn_o), T * Hq * D, bf16(l.o), stream);
    gemm.linear(bf16(l.o), Hq * D, w.o_proj.get(), DType::bf16, T, H, Hq * D, target, DType::f32, H,
                accumulate, stream);
    if (tap) {
      observe(name + ".attn", target, {T, H}, DType::f32);
      add_in_place(x, target, T * H, stream);
    }

    // ---- FFN half ----
    cudaEvent_t ffn_start = timer.mark();
    const bool moe = c.moe_layers[layer];
    rms_norm_rows(x, nullptr, T, H, w.post_attention_norm.as<float>(), eps, bf16(l.xn),
                  moe ? f32(l.xn_f32) : nullptr, stream);
    if (!moe) {
      mlp(bf16(l.xn), T, w.mlp);
    } else {
      const int64_t E = c.num_experts, K = c.experts_per_token, I = c.moe_intermediate_size;
      const int64_t N = T * K;
      gemm.linear(f32(l.xn_f32), H, w.router.get(), DType::f32, T, E, H, f32(l.router_logits),
                  DType::f32, E, false, stream);
      MoeDispatch dispatch;
      dispatch.router_logits = f32(l.router_logits);
      dispatch.bias = w.router_bias.as<float>();
      dispatch.x = bf16(l.xn);
      dispatch.tokens = T;
      dispatch.experts = E;
      dispatch.top_k = K;
      dispatch.hidden = H;
      dispatch.routed_scaling = static_cast<float>(c.routed_scaling_factor);
      dispatch.entry_weight = f32(l.entry_weight);
      dispatch.entry_row = i32(l.entry_row);
      dispatch.offsets = i32(l.offsets);
      dispatch.x_sorted = bf16(l.x_sorted);
      const size_t dispatch_bytes = moe_dispatch_workspace_bytes(T, K, E);
      ensure(st.moe_workspace, dispatch_bytes);
      moe_dispatch(dispatch, st.moe_workspace.get(), st.moe_workspace.bytes(), stream);
      MSA_CUDA_CHECK(cudaMemcpyAsync(st.host_offsets, dispatch.offsets,
                                     static_cast<size_t>(E + 1) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream));
      MSA_CUDA_CHECK(cudaEventRecord(st.offsets_ready, stream));
      // The shared expert runs while the host waits for the offsets.
      if (w.shared_expert.inter > 0) mlp(bf16(l.xn), T, w.shared_expert);
      else if (tap) MSA_CUDA_CHECK(cudaMemsetAsync(target, 0, static_cast<size_t>(T * H) * sizeof(float), stream));
      MSA_CUDA_CHECK(cudaEventSynchronize(st.offsets_ready));
      const int32_t* offsets = st.host_offsets;
      for (int64_t e = 0; e < E; ++e)
        if (offsets[e] > offsets[e + 1] || offsets[e] < 0)
          MSA_FAIL("MoE dispatch of layer ", layer, " produced bad expert offsets: offsets[", e,
                   "] = ", offsets[e], ", offsets[", e + 1, "] = ", offsets[e + 1]);
      if (offsets[0] != 0 || offsets[E] != N)
        MSA_FAIL("MoE dispatch of layer ", layer, " covers rows [", offsets[0], ", ", offsets[E],
                 "), expected [0, ", N, ")");
      if (tap) {  // each entry's expert: the offsets range holding its sorted row
        Tensor chosen = Tensor::zeros({T, K}, DType::i32);
        MSA_CUDA_CHECK(cudaMemcpyAsync(chosen.raw(), dispatch.entry_row, chosen.nbytes(),
                                       cudaMemcpyDeviceToHost, stream));
        MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (int32_t& row : chosen.span<int32_t>())
          row = static_cast<int32_t>(std::upper_bound(offsets, offsets + E + 1, row) - offsets - 1);
        tap(name + ".experts", chosen);
      }
      const uint16_t* gate_up_w = w.experts_gate_up.as<uint16_t>();
      const uint16_t* down_w = w.experts_down.as<uint16_t>();
      for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        gemm.linear(bf16(l.x_sorted) + begin * H, H, gate_up_w + e * 2 * I * H, DType::bf16, rows,
                    2 * I, H, f32(l.gate_up) + begin * 2 * I, DType::f32, 2 * I, false, stream);
      }
      swiglu_oai(f32(l.gate_up), N, I, alpha, limit, bf16(l.act), stream);
      for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        gemm.linear(bf16(l.act) + begin * I, I, down_w + e * H * I, DType::bf16, rows, H, I,
                    f32(l.y_sorted) + begin * H, DType::f32, H, false, stream);
      }
      moe_combine(f32(l.y_sorted), f32(l.entry_weight), i32(l.entry_row), T, K, H, target, stream);
    }
    timer.add(layer, static_cast<int>(LayerPart::ffn), ffn_start, timer.mark());
    if (tap) {
      observe(name + ".mlp", target, {T, H}, DType::f32);
      add_in_place(x, target, T * H, stream);
      observe(name, x, {T, H}, DType::f32);
    }
    timer.add(layer, kLayerParts, layer_start, timer.mark());
  }

  // ---- final norm of the rows whose logits are wanted, lm_head ----
  cudaEvent_t tail_start = timer.mark();
  rms_norm_rows(x, i64(l.logit_rows), R, H, weights_.final_norm.as<float>(), eps, bf16(l.normed),
                tap ? f32(l.normed_f32) : nullptr, stream);
  if (tap) observe("norm", f32(l.normed_f32), {R, H}, DType::f32);
  gemm.linear(bf16(l.normed), H, weights_.lm_head.get(), DType::bf16, R, V, H, f32(l.logits),
              DType::f32, V, false, stream);
  timer.add(-1, 0, tail_start, timer.mark());
  Tensor logits = Tensor::zeros({R, V}, DType::f32);
  MSA_CUDA_CHECK(cudaMemcpyAsync(logits.raw(), f32(l.logits), logits.nbytes(), cudaMemcpyDeviceToHost,
                                 stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  timer.finish();
  advance_sequences(requests);
  return logits;
}

std::shared_ptr<CudaModel> make_cuda_model(const ModelConfig& config, const ModelWeights& host) {
  check_cuda_support(config);  // before uploading anything
  DeviceWeights weights = allocate_device_weights(config);
  upload_device_weights(config, host, weights);
  return std::make_shared<CudaModel>(config, std::move(weights));
}

Tensor cuda_forward(CudaModel& model, std::span<const ForwardRequest> requests, KvCache& cache,
                    const ForwardTap& tap) {
  return model.forward(requests, cache, tap);
}

}  // namespace msa::model::gpu
