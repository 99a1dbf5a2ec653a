// The MiniMax-M3 text model on a CUDA device: the forward step of src/model/model.cpp with
// every activation on the device (weights bf16, residual stream f32, GEMMs through
// cuBLASLt with f32 accumulation, norms/RoPE/softmax in f32), attention through the
// launchers of src/cuda/launch.h over the paged device KV cache (KvCache with
// Device::cuda). One CUDA stream per model; a step synchronises with the host at the end (the
// logits), and once per MoE layer only where its routed experts run one cuBLASLt GEMM per
// expert (MoeKernel::per_expert: the row counts come to the host). Not thread-safe.
//
// Decode graphs (set_decode_graphs): a step where every request brings exactly one token
// (no tap, no profile, no visual rows) runs as one CUDA graph per shape bucket: the request
// slots rounded up to a power of two and the page-table width (the longest context's pages
// rounded up to a power of two, at most the cache's pages). The bucket owns its step buffers
// and workspaces (allocated before its capture, never reallocated), its attention runs
// through msa::cuda::DecodePlan (sparse on MSA layers where the bucket's context exceeds
// top-k blocks, dense plans elsewhere), and its MoE reads the expert offsets on the device.
// A step then costs one metadata upload, one graph launch and one logits download (with the
// plans' status word: bad lengths become an msa::Error). Other steps run eagerly.
//
// msa::Model::load(dir, Device::cuda) wraps this; benchmarks use it directly (random
// device weights, per-layer timing). Host-only header.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device_weights.h"
#include "msa/communicator.h"
#include "msa/model.h"
#include "msa/model_shard.h"

namespace msa::model {
struct PackedStep;  // model/step_batch.h
}

namespace msa::model::gpu {

struct MoeDispatch;  // kernels.h

// Which kernel runs the routed experts' GEMMs of a (single-device) MoE step of N = tokens x
// experts_per_token entries. small (moe_experts_small: CUDA-core GEMV, N <= 64) and grouped
// (moe_experts_grouped: one tensor-core launch per projection) read the expert offsets on the
// device; per_expert brings them to the host (one sync per MoE layer) and runs one cuBLASLt
// GEMM per expert with rows. A forced kernel that does not take the step throws msa::Error
// from forward() (never a silent fallback). Routed experts kept quantized (MXFP8 / NVFP4,
// DeviceLayer::expert_format) run small or grouped only: automatic takes grouped above the
// small bound whatever the rule's grouped bound, and set_moe_kernel refuses per_expert.
enum class MoeKernel { automatic, small, grouped, per_expert };
const char* moe_kernel_name(MoeKernel kernel);  // "auto", "small", "grouped", "per-expert"
// Parses those names; anything else throws msa::Error naming `argument`.
MoeKernel parse_moe_kernel(const std::string& text, const std::string& argument);

// MoeKernel::automatic's rule: small for N <= max_small_entries, grouped for N <=
// max_grouped_entries, per_expert above. Measured on an H200 (m3-layer, 128 experts, top-4,
// msa bench-model, bench/results/h200.md): decode batch 1 (4 entries) small 0.886 vs grouped
// 0.947 ms per step, batch 8 (32) equal, batch 32 (128) grouped 5.36 vs per-expert 6.79;
// prefill chunks of 512 tokens (2048 entries) grouped 72 vs per-expert 81-84 ms, of 1024
// (4096) 44.7 vs 42.2-42.9, of 2048 (8192) 34.9 vs 24.3-25.5: the crossover lies between
// 2048 and 4096 entries.
struct MoeKernelRule {
  int64_t max_small_entries = 64;  // at most kMaxSmallMoeEntries (kernels.h)
  int64_t max_grouped_entries = 2048;
};

// Where a layer's device time goes (StepProfile):
//   attention  the attention kernel (sparse over the selection, or dense causal)
//   indexer    the indexer kernel (block scores + top-k selection), MSA layers
//   ffn        post-attention norm, dense MLP or MoE (router, dispatch, experts, combine)
//   other      the rest: input norm, q/k/v(/index) projections, q/k norm + RoPE + cache
//              append, o_proj, residual adds
enum class LayerPart : int { attention = 0, indexer = 1, ffn = 2, other = 3 };
constexpr int kLayerParts = 4;
const char* layer_part_name(LayerPart part);

// Device time (CUDA events) of forward steps, summed over the steps that were given it.
struct StepProfile {
  std::vector<std::array<double, kLayerParts>> layer_ms;  // [layer][part]
  double head_ms = 0;  // embedding before the layers, final norm + lm_head after them
  // The cudnn_gathered engine's K/V gathers, summed over layers (already inside their
  // layers' attention time).
  double kv_gather_ms = 0;
  int64_t steps = 0;
};

// The rule of DenseAttentionEngine::automatic for one eager step (decode-graph steps always
// run ours): cudnn_gathered when the build has cuDNN, the step's longest query run is at least
// kGatheredCudnnMinQueries and its offsets fit cuDNN's int32 (`gathered_fits`), else msa
// (ours: 20-30x faster than cuDNN at decode, measured on the H200). Measured at the
// threshold: chunks of 64 queries over a 32K context, the gathered engine 1.44x faster than
// ours (dense_attention_cudnn.h gives the numbers); 17-63 queries were not measured and keep
// ours. Returns msa or cudnn_gathered.
constexpr int64_t kGatheredCudnnMinQueries = 64;
DenseAttentionEngine automatic_dense_engine(int64_t max_q_len, bool cudnn_built, bool gathered_fits);

class CudaModel {
 public:
  CudaModel(const ModelConfig& config, DeviceWeights weights);
  // One rank of a tensor- / expert-parallel model (docs/parallel.md): `config` is the rank's
  // rank_config(whole, plan), `weights` its part (allocate_device_weights(config,
  // plan.experts)). Each layer's branches (o_proj over the rank's heads, the dense MLP or
  // shared expert over its columns plus the routed rows of its home tokens) go to a scratch
  // buffer that comm.all_reduce_sum completes on this model's stream before they join the
  // residual stream; the MoE sends rows to the experts' owners and back by all_to_all_v.
  // Every rank calls forward() with the same requests and its own cache (KvCache(config, ...)
  // with this rank's KV heads) and gets the same logits. `comm` must outlive the model.
  CudaModel(const ModelConfig& config, DeviceWeights weights, Communicator& comm, const ShardPlan& plan);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  DeviceWeights& weights() { return weights_; }
  void* stream() const;  // cudaStream_t of every launch

  // Model::forward on the device; `cache` must be a Device::cuda bf16 or e4m3 KvCache. With
  // `profile`, adds this step's per-layer device times to it (events around each part;
  // waits for the step to finish).
  Tensor forward(std::span<const ForwardRequest> requests, KvCache& cache,
                 const ForwardTap& tap = nullptr, StepProfile* profile = nullptr);

  // MSA layers run dense causal attention instead of indexer + sparse attention (the index
  // keys are still written): the benchmark's comparison.
  void set_dense_attention(bool dense);

  // Decode-only steps through per-bucket CUDA graphs (see the top of this file); off runs
  // every step eagerly. Turning them off (or changing the attention mode, or a different
  // KV cache) drops the captured graphs and their buffers.
  void set_decode_graphs(bool on);
  bool decode_graphs() const { return decode_graphs_; }
  int64_t captured_decode_graphs() const;  // buckets captured so far (tests, benchmarks)

  // Which kernel runs dense attention (msa/model.h DenseAttentionEngine; automatic by
  // default: automatic_dense_engine per step, see dense_attention_cudnn.h for the engines).
  // cudnn / cudnn_gathered in a build without cuDNN throw msa::Error here; with either, a
  // step cuDNN refuses throws from forward() (never a silent fallback).
  void set_dense_attention_engine(DenseAttentionEngine engine);
  DenseAttentionEngine dense_attention_engine() const { return dense_engine_; }
  // Dense attention calls (one per layer that ran dense, per step) by engine, since
  // construction: which engine really ran (cudnn: over the paged cache; cudnn_gathered: over
  // the gathered K/V).
  struct DenseAttentionCalls {
    int64_t msa = 0, cudnn = 0, cudnn_gathered = 0;
  };
  const DenseAttentionCalls& dense_attention_calls() const { return dense_calls_; }
  int64_t cudnn_dense_plans() const;  // cuDNN plans built so far (bucketed shapes, both engines)

  // The routed experts' kernel (MoeKernel; automatic by default, choosing by `rule`). Changing
  // it drops the captured decode graphs (a bucket's admission depends on it). per_expert with
  // quantized routed experts throws msa::Error here.
  void set_moe_kernel(MoeKernel kernel, MoeKernelRule rule = {});
  MoeKernel moe_kernel() const { return moe_kernel_; }
  const MoeKernelRule& moe_kernel_rule() const { return moe_rule_; }
  // The kernel a single-device MoE step of `entries` rows runs; throws msa::Error where a
  // forced kernel does not take it.
  MoeKernel moe_kernel_for(int64_t entries) const;
  // Routed-expert runs (one per MoE layer, per eager step or graph capture) by kernel, since
  // construction: which kernel really ran.
  struct MoeKernelCalls {
    int64_t small = 0, grouped = 0, per_expert = 0;
  };
  const MoeKernelCalls& moe_kernel_calls() const { return moe_calls_; }
  // The routed experts' format (bf16, or mxfp8 / nvfp4 kept quantized).
  ExpertWeights expert_format() const { return expert_format_; }

 private:
  struct State;
  struct Step;  // one step's device state (cuda_model.cpp)
  struct DecodeGraph;  // one bucket's graph, buffers and decode plans (cuda_model.cpp)
  // The phases of forward(): the step's metadata upload, the embedding, each layer's
  // attention and feed-forward halves (dense MLP or mixture of experts), the head.
  void upload_step(Step& step, const PackedStep& packed, int64_t requests);
  void embed(Step& step, const PackedStep& packed);  // token rows, then the visual rows
  void attention(Step& step, int64_t layer);
  // Dense attention engine: the step's choice (in upload_step) and the cuDNN calls (over the
  // paged cache; over K/V gathered out of it).
  void choose_dense_engine(Step& step, int64_t max_q_len, int64_t max_k_len, int64_t total_k);
  void dense_on_cudnn(Step& step, int64_t layer);
  void dense_on_cudnn_gathered(Step& step, int64_t layer);
  void decode_plan_attention(Step& step, int64_t layer);  // a decode graph's attention
  void feed_forward(Step& step, int64_t layer);
  void mlp(Step& step, const uint16_t* in, int64_t rows, const DeviceMlp& weights);
  void mixture_of_experts(Step& step, int64_t layer);
  void expert_parallel_moe(Step& step, int64_t layer);  // a rank's MoE (parallel models)
  // The router over tokens [first, first + tokens) of the step and the dispatch's arguments
  // for them (the dispatch itself: the caller, with its workspace).
  MoeDispatch route(Step& step, int64_t layer, int64_t first, int64_t tokens);
  void final_logits(Step& step);  // final norm + lm_head into the step's logits rows
  Tensor head(Step& step);
  void layers(Step& step);
  // A decode-only step through its bucket's graph; nothing where the step does not qualify
  // (then forward() runs it eagerly).
  std::optional<Tensor> forward_decode_graph(std::span<const ForwardRequest> requests, KvCache& cache,
                              const PackedStep& packed);
  DecodeGraph* decode_graph_for(int64_t batch, int64_t pages, KvCache& cache);
  void capture(DecodeGraph& graph, KvCache& cache);

  ModelConfig config_;
  DeviceWeights weights_;
  Communicator* comm_ = nullptr;  // set: one rank of a parallel model
  ShardPlan plan_;
  std::unique_ptr<State> state_;
  bool dense_attention_ = false;
  DenseAttentionEngine dense_engine_ = DenseAttentionEngine::automatic;
  DenseAttentionCalls dense_calls_;
  MoeKernel moe_kernel_ = MoeKernel::automatic;
  MoeKernelRule moe_rule_;
  MoeKernelCalls moe_calls_;
  ExpertWeights expert_format_ = ExpertWeights::bf16;  // the routed experts' (DeviceLayer::expert_format)
  bool decode_graphs_ = true;  // off for a parallel model's rank (its constructor)
};

// Used by msa::Model (model.cpp).
std::shared_ptr<CudaModel> make_cuda_model(const ModelConfig& config, const ModelWeights& host);
// Used by msa::ParallelModel on Device::cuda: `config` the whole model's, `host` the rank's part
// (load_model_weights(file, config, plan)); uploads it to the calling thread's current device.
std::shared_ptr<CudaModel> make_cuda_parallel_model(const ModelConfig& config, const ModelWeights& host,
                                                    const ShardPlan& plan, Communicator& comm);
Tensor cuda_forward(CudaModel& model, std::span<const ForwardRequest> requests, KvCache& cache,
                    const ForwardTap& tap);
void set_cuda_decode_graphs(CudaModel& model, bool on);
bool cuda_decode_graphs(const CudaModel& model);
int64_t cuda_decode_graphs_captured(const CudaModel& model);

}  // namespace msa::model::gpu
