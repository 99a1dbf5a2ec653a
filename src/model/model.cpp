// Model loading and the forward step: embedding, decoder layers, final norm, lm_head.
#include <algorithm>
#include <filesystem>

#include "layers.h"
#include "msa/model.h"
#include "step_batch.h"
#include "tensor_math.h"
#include "vision_internal.h"
#ifdef MSA_WITH_CUDA
#include "gpu/cuda_model.h"
#include "gpu/cuda_vision.h"
#endif

namespace msa {
namespace model {

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

}  // namespace model
namespace {

Tensor activation(std::vector<float>& data, int64_t rows, int64_t cols) {
  return Tensor::wrap(data.data(), {rows, cols}, DType::f32, nullptr);
}

}  // namespace

Model Model::load(const std::string& dir, Device device, bool check_weights,
                  std::optional<RoutedExperts> routed_experts) {
  if (std::error_code error; !std::filesystem::is_directory(dir, error))
    throw_arg_error("model", "a model directory (config.json + safetensors)", dir);
#ifndef MSA_WITH_CUDA
  if (device == Device::cuda)
    throw Error("device cuda: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
#endif
  if (device == Device::cpu && routed_experts == RoutedExperts::quantized)
    throw_arg_error("routed_experts", "dequantized (or unset) for a CPU model, which reads bf16 experts",
                    "quantized");
  const RoutedExperts experts =
      routed_experts.value_or(device == Device::cuda ? RoutedExperts::quantized : RoutedExperts::dequantized);
  ModelConfig config = load_model_config(dir);
  SafetensorsModel file = SafetensorsModel::open(dir);
  if (check_weights) check_weights_finite(file);
  Model model(std::move(config), std::move(file), WeightLoadOptions{.routed_experts = experts});
#ifdef MSA_WITH_CUDA
  if (device == Device::cuda) {
    model.cuda_ = model::gpu::make_cuda_model(model.config_, model.weights_);
    model.cuda_vision_ = model::gpu::make_cuda_vision_tower(model.config_, model.weights_);
    model.device_ = Device::cuda;
  }
#endif
  return model;
}

const char* dense_attention_engine_name(DenseAttentionEngine engine) {
  switch (engine) {
    case DenseAttentionEngine::automatic: return "auto";
    case DenseAttentionEngine::msa: return "msa";
    case DenseAttentionEngine::cudnn: return "cudnn";
    case DenseAttentionEngine::cudnn_gathered: return "cudnn-gathered";
  }
  return "?";
}

DenseAttentionEngine parse_dense_attention_engine(const std::string& text, const std::string& what) {
  if (text == "auto" || text == "automatic") return DenseAttentionEngine::automatic;
  if (text == "msa") return DenseAttentionEngine::msa;
  if (text == "cudnn") return DenseAttentionEngine::cudnn;
  if (text == "cudnn-gathered") return DenseAttentionEngine::cudnn_gathered;
  throw_arg_error(what, "auto, msa, cudnn or cudnn-gathered", "\"" + text + "\"");
}

bool dense_attention_engine_needs_cudnn(DenseAttentionEngine engine) {
  return engine == DenseAttentionEngine::cudnn || engine == DenseAttentionEngine::cudnn_gathered;
}

bool dense_attention_cudnn_built() {
#ifdef MSA_WITH_CUDNN
  return true;
#else
  return false;
#endif
}

void Model::set_dense_attention_engine(DenseAttentionEngine engine) {
  const std::string name = dense_attention_engine_name(engine);
  if (dense_attention_engine_needs_cudnn(engine) && !dense_attention_cudnn_built())
    throw Error("dense attention engine " + name +
                ": this build of msa has no cuDNN (configure with -DMSA_CUDA=ON and the cuDNN frontend in "
                ".deps/cudnn_frontend, libcudnn and cudnn.h; scripts/install_deps.sh)");
  if (dense_attention_engine_needs_cudnn(engine) && device_ != Device::cuda)
    throw Error("dense attention engine " + name + ": the model runs on the CPU (load it with Device::cuda)");
#ifdef MSA_WITH_CUDA
  if (cuda_) cuda_->set_dense_attention_engine(engine);
#endif
}

Model::Model(ModelConfig config, SafetensorsModel file, const WeightLoadOptions& options)
    : config_(std::move(config)),
      file_(std::move(file)),
      weights_(load_model_weights(file_, config_, options)),
      inv_freq_(model::rope_inverse_frequencies(config_.rotary_dim, config_.rope_theta)) {}

void Model::set_decode_graphs(bool on) {
#ifdef MSA_WITH_CUDA
  if (cuda_) model::gpu::set_cuda_decode_graphs(*cuda_, on);
#else
  (void)on;
#endif
}

int64_t Model::decode_graphs_captured() const {
#ifdef MSA_WITH_CUDA
  if (cuda_) return model::gpu::cuda_decode_graphs_captured(*cuda_);
#endif
  return 0;
}

bool Model::decode_graphs() const {
#ifdef MSA_WITH_CUDA
  if (cuda_) return model::gpu::cuda_decode_graphs(*cuda_);
#endif
  return false;
}

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
  model::embed(weights_.embed_tokens, tokens, x.data());
  // Image / video placeholders: their embeddings are the visual rows (overwritten in place).
  for (const model::PackedVisualRows& rows : step.visual)
    std::copy_n(rows.data, rows.count * H, x.data() + rows.row * H);
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

std::vector<Tensor> Model::encode_vision(const Tensor& pixel_values,
                                         std::span<const VisionGrid> grids,
                                         const ForwardTap& tap) const {
  if (!config_.vision || !weights_.vision)
    throw_arg_error("model", "a model with a vision tower (config.json with vision_config)",
                    "a text-only config");
  const VisionConfig& v = *config_.vision;
  const VisionWeights& w = *weights_.vision;
  if (grids.empty()) throw_arg_error("grids", "at least one image or video grid", 0);
  const std::vector<VisionSegment> segments = vision_segments(grids, v);
  int64_t patches = 0;
  for (const VisionGrid& grid : grids) patches += grid.patches();
  const Tensor pixels = model::checked_pixel_values(pixel_values, v, patches);
#ifdef MSA_WITH_CUDA
  if (cuda_vision_) return model::gpu::cuda_encode_vision(*cuda_vision_, pixels, grids, tap);
#endif
  const int64_t m2 = v.merge_window(), H = config_.hidden_size;
  std::vector<Tensor> out;
  for (const VisionGrid& grid : grids) out.push_back(Tensor::zeros({grid.patches() / m2, H}, DType::f32));
  // Batch by batch of whole segments: the ViT, then the projector (merge windows never
  // cross a frame, so never a segment) into the rows of each segment's grid.
  std::vector<int64_t> grid_first_row(grids.size(), 0);
  for (size_t i = 1; i < grids.size(); ++i) grid_first_row[i] = grid_first_row[i - 1] + grids[i - 1].patches();
  for (const auto& [begin, end] : model::vision_batches(segments)) {
    const std::span<const VisionSegment> batch(segments.data() + begin, end - begin);
    int64_t rows = 0;
    for (const VisionSegment& segment : batch) rows += segment.grid.patches();
    std::vector<float> features(rows * v.hidden_size), projected(rows / m2 * H);
    model::vit_batch(w, v, pixels.data<float>(), batch, impl_, tap, features.data());
    model::project_rows(w, v, features.data(), rows, projected.data(), tap);
    int64_t at = 0;
    for (const VisionSegment& segment : batch) {
      const int64_t n = segment.grid.patches() / m2;
      float* dst = out[segment.source].data<float>() +
                   (segment.first_row - grid_first_row[segment.source]) / m2 * H;
      std::copy_n(projected.data() + at * H, n * H, dst);
      at += n;
    }
  }
  return out;
}

}  // namespace msa
