// One rank's forward step of the tensor- / expert-parallel text model (msa/parallel_model.h):
// the single-rank layers over this rank's heads and columns, completed by collectives.
#include <filesystem>

#include "model/layers.h"
#include "model/step_batch.h"
#include "model/tensor_math.h"
#include "msa/parallel_model.h"
#include "parallel/parallel_layers.h"
#ifdef MSA_WITH_CUDA
#include "model/gpu/cuda_model.h"
#endif

namespace msa {

ParallelModel ParallelModel::load(const std::string& dir, Communicator& comm) {
  return load(dir, comm, Device::cpu);
}

ParallelModel ParallelModel::load(const std::string& dir, Communicator& comm, Device device) {
  if (std::error_code error; !std::filesystem::is_directory(dir, error))
    throw_arg_error("model", "a model directory (config.json + safetensors)", dir);
  ModelConfig config = load_model_config(dir);
  return ParallelModel(std::move(config), SafetensorsModel::open(dir), comm, device);
}

// A CUDA rank keeps MXFP8 / NVFP4 routed experts as stored (its expert kernels widen them in
// registers); the CPU ranks read them dequantized to bf16.
ParallelModel::ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm, Device device)
    : ParallelModel(std::move(config), std::move(file), comm,
                    WeightLoadOptions{.routed_experts = device == Device::cuda ? RoutedExperts::quantized
                                                                               : RoutedExperts::dequantized}) {
#ifdef MSA_WITH_CUDA
  if (device == Device::cuda) {
    cuda_ = model::gpu::make_cuda_parallel_model(config_, weights_, plan_, comm);
    device_ = Device::cuda;
  }
#else
  if (device == Device::cuda)
    throw Error("device cuda: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
#endif
}

ParallelModel::ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm)
    : ParallelModel(std::move(config), std::move(file), comm, WeightLoadOptions{}) {}

ParallelModel::ParallelModel(ModelConfig config, SafetensorsModel file, Communicator& comm,
                             const WeightLoadOptions& options)
    : config_(std::move(config)),
      plan_(make_shard_plan(config_, comm.rank(), comm.world_size())),
      rank_config_(msa::rank_config(config_, plan_)),
      file_(std::move(file)),
      weights_(load_model_weights(file_, config_, plan_, options)),
      inv_freq_(model::rope_inverse_frequencies(config_.rotary_dim, config_.rope_theta)),
      comm_(&comm) {}

Tensor ParallelModel::forward(std::span<const ForwardRequest> requests, KvCache& cache, const ForwardTap& tap) const {
  const ModelConfig& c = config_;
  const ModelConfig& local = rank_config_;
  if (cache.device() != device_)
    throw_arg_error("cache", "a " + std::string(device_name(device_)) + " KV cache (the model's device)",
                    std::string(device_name(cache.device())) + " cache");
  if (cache.k(0).size(1) != plan_.kv_heads)
    throw_arg_error("cache", "a KV cache of this rank's " + std::to_string(plan_.kv_heads) +
                                 " KV heads (KvCache(model.rank_config(), pages))",
                    std::to_string(cache.k(0).size(1)) + " KV heads");
#ifdef MSA_WITH_CUDA
  if (cuda_) return cuda_->forward(requests, cache, tap);
#endif
  if (tap) throw_arg_error("tap", "none on a CPU parallel model (taps need device cuda)", "a tap");
  const model::PackedStep step = model::pack_step(requests, cache, local);
  const model::StepBatch& batch = step.batch;
  const int64_t T = batch.tokens, H = c.hidden_size;
  const bool reduce = plan_.world > 1;  // one rank has the whole sums already

  std::vector<float> x(T * H), xn(T * H), branch(T * H);
  model::embed(weights_.embed_tokens, step.tokens, x.data());
  for (const model::PackedVisualRows& rows : step.visual)
    std::copy_n(rows.data, rows.count * H, x.data() + rows.row * H);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    model::gemma_rms_norm(x.data(), xn.data(), T, H, w.input_norm, c.rms_norm_eps);
    // This rank's heads; o_proj over their columns gives a partial sum of the output.
    model::attention_forward(xn.data(), w, local, layer, inv_freq_, batch, cache, impl_, nullptr,
                             branch.data());
    if (reduce) comm_->all_reduce_sum(branch.data(), T * H);
    for (int64_t i = 0; i < T * H; ++i) x[i] += branch[i];
    model::gemma_rms_norm(x.data(), xn.data(), T, H, w.post_attention_norm, c.rms_norm_eps);
    if (c.moe_layers[layer]) {
      parallel::moe_expert_parallel(xn.data(), T, w, c, plan_, *comm_, branch.data());
    } else {
      model::mlp_forward(xn.data(), T, w.mlp, local, branch.data());
      if (reduce) comm_->all_reduce_sum(branch.data(), T * H);
    }
    for (int64_t i = 0; i < T * H; ++i) x[i] += branch[i];
  }
  const int64_t rows = static_cast<int64_t>(step.logit_rows.size());
  std::vector<float> picked(rows * H);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(x.data() + step.logit_rows[r] * H, H, picked.data() + r * H);
  model::gemma_rms_norm(picked.data(), rows, H, weights_.final_norm, c.rms_norm_eps);
  Tensor logits = Tensor::zeros({rows, c.vocab_size}, DType::f32);
  model::linear(picked.data(), rows, weights_.lm_head, logits.data<float>());
  model::advance_sequences(requests);
  return logits;
}

}  // namespace msa
