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
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/model_kv_cache.h"
#include "msa/model_vision.h"
#include "msa/model_weights.h"
#include "msa/ops.h"
#include "msa/safetensors.h"

namespace msa {

namespace model::gpu {
class CudaModel;        // src/model/gpu/cuda_model.h (builds with CUDA only)
class CudaVisionTower;  // src/model/gpu/cuda_vision.h
}

// One request's part of a forward step: append `tokens` to `sequence` (whose first
// sequence->length tokens are already in the cache).
struct ForwardRequest {
  SequenceCache* sequence = nullptr;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits of every token (true) or of the last one only
  // Visual rows for some of `tokens`, non-overlapping (empty: text only). A prefill chunk
  // may cut through an image: pass the part of its rows that falls into the chunk
  // (visual_rows_in_range, msa/model_vision.h, does the slicing). Read during forward() only.
  std::span<const VisualRows> visual = {};
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
// The vision path (Model::encode_vision) reports "vision.patch_embed", "vision.pre_norm",
// "vision.layers.N" (f32 [patches, vision hidden]), "projector.patches" (linear_2's output,
// [patches, hidden]) and "projector" (the merged rows, [patches / m^2, hidden]).
// Values are views of scratch buffers, valid during the call only (clone() to keep them).
using ForwardTap = std::function<void(const std::string& name, const Tensor& value)>;

// Which kernel runs the dense causal attention of the CUDA text model (the dense layers,
// and MSA layers whose every visible block would be selected; docs/model-cuda.md "Dense
// attention engine"):
//   automatic       per step: cudnn_gathered for steps with a long query run (prefill) in a
//                   build with cuDNN, ours otherwise (decode: ours measured 20-30x faster);
//                   the rule is CudaModel::choose_dense_engine (src/model/gpu/cuda_model.cpp)
//   msa             our kernel (src/cuda/launch.h) always
//   cudnn           cuDNN's SDPA over the paged cache always (measured slower than ours)
//   cudnn_gathered  each request's K/V gathered out of the pages into contiguous buffers,
//                   then cuDNN's non-paged SDPA, always
// A build without cuDNN refuses cudnn and cudnn_gathered (msa::Error).
enum class DenseAttentionEngine { automatic, msa, cudnn, cudnn_gathered };
// "auto", "msa", "cudnn", "cudnn-gathered".
const char* dense_attention_engine_name(DenseAttentionEngine engine);
// Parses "auto" (or "automatic"), "msa", "cudnn", "cudnn-gathered"; anything else: msa::Error
// naming `what`.
DenseAttentionEngine parse_dense_attention_engine(const std::string& text,
                                                  const std::string& what = "dense attention engine");
// Whether the engine runs on cuDNN (cudnn, cudnn_gathered): those need a build with cuDNN.
bool dense_attention_engine_needs_cudnn(DenseAttentionEngine engine);
// Whether this build links cuDNN's SDPA (so the cuDNN engines can run).
bool dense_attention_cudnn_built();

class Model {
 public:
  // Reads `dir`/config.json and the weights (model.safetensors or the sharded index).
  // Device::cuda uploads the weights to the current CUDA device as bf16 (norms and the
  // router f32) and runs every step there; it then needs a CUDA KV cache (bf16). Throws
  // msa::Error when this build has no CUDA backend, there is no device or it lacks memory.
  // check_weights: scan every float tensor for NaN / infinity first (check_weights_finite).
  // routed_experts: how the routed experts of an MXFP8 / NVFP4 checkpoint are held (no effect
  // on a float checkpoint). Unset: quantized on Device::cuda (the device keeps the codes and
  // scales, 1 or ~0.56 byte per weight, and the expert kernels widen them in registers),
  // dequantized on the CPU; quantized with Device::cpu is refused (the CPU reads bf16).
  static Model load(const std::string& dir, Device device = Device::cpu, bool check_weights = false,
                    std::optional<RoutedExperts> routed_experts = std::nullopt);
  Model(ModelConfig config, SafetensorsModel file, const WeightLoadOptions& options = {});

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  const ModelWeights& weights() const { return weights_; }

  // Runs one step for every request, writing their new K/V (and index keys) into `cache`
  // (growing their page lists; the cache must live on the model's device) and advancing
  // their lengths. Returns f32 logits (on the host), rows in request order: every token of
  // requests with all_logits, else each request's last token.
  Tensor forward(std::span<const ForwardRequest> requests, KvCache& cache,
                 const ForwardTap& tap = nullptr) const;

  // The vision path (docs/vision.md "Vision tower"): pixel_values [N, C*T*P*P] (f32, bf16 or
  // f16, on the host; rows of every grid in order, each in the media front end's patch
  // order) through the ViT and the projector, on the model's device (Device::cuda: bf16
  // GEMM inputs and attention, f32 accumulation, norms and residual stream; docs/vision.md
  // "On the GPU"). Returns one f32 [patches / m^2, hidden] host tensor per grid: the rows for
  // that image's or video's placeholder tokens, in order. Throws msa::Error when the config
  // has no vision_config or the inputs do not match it.
  std::vector<Tensor> encode_vision(const Tensor& pixel_values, std::span<const VisionGrid> grids,
                                    const ForwardTap& tap = nullptr) const;

  // Implementation used for the attention ops of the CPU forward and of the ViT (Impl::cpu by
  // default).
  void set_attention_impl(Impl impl) { impl_ = impl; }

  // The CUDA text model's dense attention engine (DenseAttentionEngine; automatic by
  // default). Throws msa::Error for cudnn / cudnn_gathered in a build without cuDNN, or on a
  // CPU model (which has no engine to choose); automatic and msa are accepted on either
  // device.
  void set_dense_attention_engine(DenseAttentionEngine engine);
  // Device::cuda: run decode-only steps (one new token per request, no tap) as CUDA graphs,
  // one per shape bucket (docs/model-cuda.md); off (the default) runs every step eagerly.
  // No effect on the CPU model.
  void set_decode_graphs(bool on);
  bool decode_graphs() const;
  int64_t decode_graphs_captured() const;  // buckets captured so far (0 on the CPU)

 private:
  ModelConfig config_;
  SafetensorsModel file_;  // keeps the mapping alive
  ModelWeights weights_;
  std::vector<float> inv_freq_;
  Impl impl_ = Impl::cpu;
  Device device_ = Device::cpu;
  std::shared_ptr<model::gpu::CudaModel> cuda_;  // set when device_ is cuda
  std::shared_ptr<model::gpu::CudaVisionTower> cuda_vision_;  // device_ cuda with a vision tower
};

}  // namespace msa
