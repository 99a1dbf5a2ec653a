// The MiniMax-M3 text model on a CUDA device: the forward step of src/model/model.cpp with
// every activation on the device (weights bf16, residual stream f32, GEMMs through
// cuBLASLt with f32 accumulation, norms/RoPE/softmax in f32), attention through the
// launchers of src/cuda/launch.h over the paged device KV cache (KvCache with
// Device::cuda). One CUDA stream per model; a step synchronises with the host once per MoE
// layer (the experts' row counts) and at the end (the logits). Not thread-safe.
//
// msa::Model::load(dir, Device::cuda) wraps this; benchmarks use it directly (random
// device weights, per-layer timing). Host-only header.
#pragma once
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "device_weights.h"
#include "msa/model.h"

namespace msa::model {
struct PackedStep;  // model/step_batch.h
}

namespace msa::model::gpu {

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
  int64_t steps = 0;
};

class CudaModel {
 public:
  CudaModel(const ModelConfig& config, DeviceWeights weights);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  DeviceWeights& weights() { return weights_; }
  void* stream() const;  // cudaStream_t of every launch

  // Model::forward on the device; `cache` must be a Device::cuda bf16 KvCache. With
  // `profile`, adds this step's per-layer device times to it (events around each part;
  // waits for the step to finish).
  Tensor forward(std::span<const ForwardRequest> requests, KvCache& cache,
                 const ForwardTap& tap = nullptr, StepProfile* profile = nullptr);

  // MSA layers run dense causal attention instead of indexer + sparse attention (the index
  // keys are still written): the benchmark's comparison.
  void set_dense_attention(bool dense) { dense_attention_ = dense; }

  // Which kernel runs dense attention (msa/model.h DenseAttentionEngine; automatic by
  // default: cuDNN's SDPA where the build has it and it serves the step, see
  // dense_attention_cudnn.h). cudnn in a build without cuDNN throws msa::Error here; with
  // cudnn, a step cuDNN refuses throws from forward() (never a silent fallback).
  void set_dense_attention_engine(DenseAttentionEngine engine);
  DenseAttentionEngine dense_attention_engine() const { return dense_engine_; }
  // Dense attention calls (one per layer that ran dense, per step) by engine, since
  // construction: which engine really ran.
  struct DenseAttentionCalls {
    int64_t msa = 0, cudnn = 0;
  };
  const DenseAttentionCalls& dense_attention_calls() const { return dense_calls_; }
  int64_t cudnn_dense_plans() const;  // cuDNN plans built so far (bucketed shapes)

 private:
  struct State;
  struct Step;  // one step's device state (cuda_model.cpp)
  // The phases of forward(): the step's metadata upload, the embedding, each layer's
  // attention and feed-forward halves (dense MLP or mixture of experts), the head.
  void upload_step(Step& step, const PackedStep& packed, int64_t requests);
  void embed(Step& step, const PackedStep& packed);  // token rows, then the visual rows
  void attention(Step& step, int64_t layer);
  // Dense attention engine: the step's choice (in upload_step) and the cuDNN call.
  void choose_dense_engine(Step& step, int64_t max_q_len);
  bool dense_on_cudnn(Step& step, int64_t layer);
  void feed_forward(Step& step, int64_t layer);
  void mlp(Step& step, const uint16_t* in, int64_t rows, const DeviceMlp& weights);
  void mixture_of_experts(Step& step, int64_t layer);
  Tensor head(Step& step);

  ModelConfig config_;
  DeviceWeights weights_;
  std::unique_ptr<State> state_;
  bool dense_attention_ = false;
  DenseAttentionEngine dense_engine_ = DenseAttentionEngine::automatic;
  DenseAttentionCalls dense_calls_;
};

// Used by msa::Model (model.cpp).
std::shared_ptr<CudaModel> make_cuda_model(const ModelConfig& config, const ModelWeights& host);
Tensor cuda_forward(CudaModel& model, std::span<const ForwardRequest> requests, KvCache& cache,
                    const ForwardTap& tap);

}  // namespace msa::model::gpu
