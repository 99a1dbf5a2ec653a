// Model loading and the forward step: embedding, decoder layers, final norm, lm_head.
#include <algorithm>
#include <filesystem>

#include "layers.h"
#include "msa/model.h"
#include "step_batch.h"
#include "tensor_math.h"
#ifdef MSA_WITH_CUDA
#include "gpu/cuda_model.h"
#endif

namespace msa {
namespace {

// Embedding rows as f32.
void embed(const Tensor& table, std::span<const int32_t> tokens, float* out) {
  const int64_t V = table.size(0), H = table.size(1);
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int32_t id = tokens[t];
    if (id < 0 || id >= V)
      throw_arg_error("tokens[" + std::to_string(t) + "]",
                      "a token id in [0, " + std::to_string(V) + ")", id);
    float* row = out + t * H;
    switch (table.dtype()) {
      case DType::f32: std::copy_n(table.data<float>() + id * H, H, row); break;
      case DType::bf16: {
        const uint16_t* src = static_cast<const uint16_t*>(table.raw()) + id * H;
        for (int64_t h = 0; h < H; ++h) row[h] = bf16_to_float(src[h]);
        break;
      }
      default: {
        const uint16_t* src = static_cast<const uint16_t*>(table.raw()) + id * H;
        for (int64_t h = 0; h < H; ++h) row[h] = f16_to_float(src[h]);
      }
    }
  }
}

Tensor activation(std::vector<float>& data, int64_t rows, int64_t cols) {
  return Tensor::wrap(data.data(), {rows, cols}, DType::f32, nullptr);
}

}  // namespace

Model Model::load(const std::string& dir, Device device, bool check_weights) {
  if (std::error_code error; !std::filesystem::is_directory(dir, error))
    throw_arg_error("model", "a model directory (config.json + safetensors)", dir);
#ifndef MSA_WITH_CUDA
  if (device == Device::cuda)
    throw Error("device cuda: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
#endif
  ModelConfig config = load_model_config(dir);
  SafetensorsModel file = SafetensorsModel::open(dir);
  if (check_weights) check_weights_finite(file);
  Model model(std::move(config), std::move(file));
#ifdef MSA_WITH_CUDA
  if (device == Device::cuda) {
    model.cuda_ = model::gpu::make_cuda_model(model.config_, model.weights_);
    model.device_ = Device::cuda;
  }
#endif
  return model;
}

Model::Model(ModelConfig config, SafetensorsModel file)
    : config_(std::move(config)),
      file_(std::move(file)),
      weights_(load_model_weights(file_, config_)),
      inv_freq_(model::rope_inverse_frequencies(config_.rotary_dim, config_.rope_theta)) {}

Tensor Model::forward(std::span<const ForwardRequest> requests, KvCache& cache,
                      const ForwardTap& tap) const {
  const ModelConfig& c = config_;
  if (cache.device() != device_)
    throw_arg_error("cache", "a " + std::string(device_name(device_)) + " KV cache (the model's device)",
                    std::string(device_name(cache.device())) + " cache");
#ifdef MSA_WITH_CUDA
  if (cuda_) return model::gpu::cuda_forward(*cuda_, requests, cache, tap);
#endif
  const model::PackedStep step = model::pack_step(requests, cache, c);
  const model::StepBatch& batch = step.batch;
  const std::vector<int32_t>& tokens = step.tokens;
  const std::vector<int64_t>& logit_rows = step.logit_rows;
  const int64_t T = batch.tokens, H = c.hidden_size;

  std::vector<float> x(T * H), xn(T * H), branch(T * H);
  embed(weights_.embed_tokens, tokens, x.data());
  if (tap) tap("embed", activation(x, T, H));
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    const std::string name = "layers." + std::to_string(layer);
    model::gemma_rms_norm(x.data(), xn.data(), T, H, w.input_norm, c.rms_norm_eps);
    model::attention_forward(xn.data(), w, c, layer, inv_freq_, batch, cache, impl_, tap,
                             branch.data());
    if (tap) tap(name + ".attn", activation(branch, T, H));
    for (int64_t i = 0; i < T * H; ++i) x[i] += branch[i];
    model::gemma_rms_norm(x.data(), xn.data(), T, H, w.post_attention_norm, c.rms_norm_eps);
    if (c.moe_layers[layer]) {
      Tensor chosen = Tensor::zeros({tap ? T : 0, c.experts_per_token}, DType::i32);
      model::moe_forward(xn.data(), T, w, c, branch.data(), tap ? chosen.data<int32_t>() : nullptr);
      if (tap) tap(name + ".experts", chosen);
    } else {
      model::mlp_forward(xn.data(), T, w.mlp, c, branch.data());
    }
    if (tap) tap(name + ".mlp", activation(branch, T, H));
    for (int64_t i = 0; i < T * H; ++i) x[i] += branch[i];
    if (tap) tap(name, activation(x, T, H));
  }
  // Only the rows whose logits are wanted go through the final norm and lm_head.
  const int64_t rows = static_cast<int64_t>(logit_rows.size());
  std::vector<float> picked(rows * H);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(x.data() + logit_rows[r] * H, H, picked.data() + r * H);
  model::gemma_rms_norm(picked.data(), rows, H, weights_.final_norm, c.rms_norm_eps);
  if (tap) tap("norm", activation(picked, rows, H));
  Tensor logits = Tensor::zeros({rows, c.vocab_size}, DType::f32);
  model::linear(picked.data(), rows, weights_.lm_head, logits.data<float>());

  model::advance_sequences(requests);
  return logits;
}

}  // namespace msa
