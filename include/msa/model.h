// The MiniMax-M3 text model on the CPU: load a Hugging Face checkpoint directory and run
// forward steps (chunked prefill and decode, several requests at once) over a paged KV cache.
//
//   msa::Model model = msa::Model::load("path/to/model");
//   msa::KvCache cache(model.config(), /*num_pages=*/64);
//   msa::SequenceCache seq;
//   std::vector<int32_t> prompt = {1, 2, 3};
//   msa::ForwardRequest step{.sequence = &seq, .tokens = prompt, .all_logits = true};
//   msa::Tensor logits = model.forward({&step, 1}, cache);   // f32 [3, vocab]
//
// On a CUDA device (docs/model-cuda.md): msa::Model::load(dir, msa::Device::cuda) with a
// msa::KvCache(config, pages, msa::DType::bf16, msa::Device::cuda).
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "msa/model_config.h"
#include "msa/model_kv_cache.h"
#include "msa/model_weights.h"
#include "msa/ops.h"
#include "msa/safetensors.h"

namespace msa {

namespace model::gpu {
class CudaModel;  // src/model/gpu/cuda_model.h (builds with CUDA only)
}

// One request's part of a forward step: append `tokens` to `sequence` (whose first
// sequence->length tokens are already in the cache).
struct ForwardRequest {
  SequenceCache* sequence = nullptr;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits of every token (true) or of the last one only
};

// Observes named intermediates of a step (for layer-by-layer comparisons):
// "embed", "layers.N.attn" (o_proj output), "layers.N.topk" (int32 [Hkv, T, k], MSA layers),
// "layers.N.mlp", "layers.N" (the layer's output), "norm" (after the final norm).
// Activations are f32 [T, hidden] over the step's packed tokens.
// The CPU forward also shows what each layer's attention reads and writes (the attention
// maps of msa/attention_map.h recompute the probabilities from them): "layers.N.q" f32
// [T, Hq, D] and "layers.N.k", "layers.N.v" f32 [T, Hkv, D] after the norms and RoPE, as
// they enter the cache (a bf16 cache then rounds k and v), and "layers.N.attn_heads" f32
// [T, Hq, D], the attention output before o_proj. In a layer they come in the order q, k, v,
// topk (MSA), attn_heads, attn. The CUDA forward does not emit these four.
// Values are views of scratch buffers, valid during the call only (clone() to keep them).
using ForwardTap = std::function<void(const std::string& name, const Tensor& value)>;

class Model {
 public:
  // Reads `dir`/config.json and the weights (model.safetensors or the sharded index).
  // Device::cuda uploads the weights to the current CUDA device as bf16 (norms and the
  // router f32) and runs every step there; it then needs a CUDA KV cache (bf16). Throws
  // msa::Error when this build has no CUDA backend, there is no device or it lacks memory.
  // check_weights: scan every float tensor for NaN / infinity first (check_weights_finite).
  static Model load(const std::string& dir, Device device = Device::cpu, bool check_weights = false);
  Model(ModelConfig config, SafetensorsModel file);

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  const ModelWeights& weights() const { return weights_; }

  // Runs one step for every request, writing their new K/V (and index keys) into `cache`
  // (growing their page lists; the cache must live on the model's device) and advancing
  // their lengths. Returns f32 logits (on the host), rows in request order: every token of
  // requests with all_logits, else each request's last token.
  Tensor forward(std::span<const ForwardRequest> requests, KvCache& cache,
                 const ForwardTap& tap = nullptr) const;

  // Implementation used for the attention ops of the CPU forward (Impl::cpu by default).
  void set_attention_impl(Impl impl) { impl_ = impl; }

 private:
  ModelConfig config_;
  SafetensorsModel file_;  // keeps the mapping alive
  ModelWeights weights_;
  std::vector<float> inv_freq_;
  Impl impl_ = Impl::cpu;
  Device device_ = Device::cpu;
  std::shared_ptr<model::gpu::CudaModel> cuda_;  // set when device_ is cuda
};

}  // namespace msa
