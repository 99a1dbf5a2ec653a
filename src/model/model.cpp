// Model loading and the forward step: embedding, decoder layers, final norm, lm_head.
#include <algorithm>
#include <filesystem>

#include "layers.h"
#include "msa/model.h"
#include "step_batch.h"
#include "tensor_math.h"

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

Model Model::load(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    throw_arg_error("model", "a model directory (config.json + safetensors)", dir);
  return Model(load_model_config(dir), SafetensorsModel::open(dir));
}

Model::Model(ModelConfig config, SafetensorsModel file)
    : config_(std::move(config)),
      file_(std::move(file)),
      weights_(load_model_weights(file_, config_)),
      inv_freq_(model::rope_inverse_frequencies(config_.rotary_dim, config_.rope_theta)) {}

Tensor Model::forward(std::span<const ForwardRequest> requests, KvCache& cache,
                      const ForwardTap& tap) const {
  const ModelConfig& c = config_;
  if (requests.empty()) throw_arg_error("requests", "at least one request", 0);
  if (cache.page_size() != c.block_size)
    throw_arg_error("cache", "pages of " + std::to_string(c.block_size) + " tokens",
                    cache.page_size());
  // Pack the step: positions, cache slots, page table, lengths.
  const int64_t batch_size = static_cast<int64_t>(requests.size());
  model::StepBatch batch;
  std::vector<int32_t> tokens, cu_q{0}, lens;
  std::vector<int64_t> logit_rows;
  int64_t max_pages = 1;
  for (int64_t b = 0; b < batch_size; ++b) {
    const ForwardRequest& r = requests[b];
    if (!r.sequence) throw_arg_error("requests[" + std::to_string(b) + "].sequence", "non-null", "null");
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    if (n < 1) throw_arg_error("requests[" + std::to_string(b) + "].tokens", "at least one token", 0);
    SequenceCache& seq = *r.sequence;
    cache.reserve(seq, seq.length + n);
    const int64_t first_row = static_cast<int64_t>(tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = seq.length + i;
      batch.positions.push_back(pos);
      batch.slot.push_back(int64_t{seq.pages[pos / c.block_size]} * c.block_size + pos % c.block_size);
      tokens.push_back(r.tokens[i]);
      if (r.all_logits || i == n - 1) logit_rows.push_back(first_row + i);
    }
    cu_q.push_back(static_cast<int32_t>(tokens.size()));
    lens.push_back(static_cast<int32_t>(seq.length + n));
    max_pages = std::max<int64_t>(max_pages, cache.pages_for(seq.length + n));
  }
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden_size;
  batch.tokens = T;
  batch.cu_seqlens_q = Tensor::from_vector(cu_q, {batch_size + 1});
  batch.seq_lens = Tensor::from_vector(lens, {batch_size});
  std::vector<int32_t> table(batch_size * max_pages, 0);
  for (int64_t b = 0; b < batch_size; ++b) {
    const SequenceCache& seq = *requests[b].sequence;
    const int64_t used = cache.pages_for(lens[b]);
    std::copy_n(seq.pages.begin(), used, table.begin() + b * max_pages);
  }
  batch.page_table = Tensor::from_vector(table, {batch_size, max_pages});

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
    if (c.moe_layers[layer]) model::moe_forward(xn.data(), T, w, c, branch.data());
    else model::mlp_forward(xn.data(), T, w.mlp, c, branch.data());
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

  for (int64_t b = 0; b < batch_size; ++b)
    requests[b].sequence->length += static_cast<int64_t>(requests[b].tokens.size());
  return logits;
}

}  // namespace msa
