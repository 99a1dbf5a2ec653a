// Allocation and upload of the device weights (layout: device_weights.h).
#include "device_weights.h"

#include <cuda_runtime.h>

#include <string>

#include "cuda/common/cuda_check.h"
#include "device_tensor.h"

namespace msa::model::gpu {
namespace {

constexpr size_t kBf16 = 2, kF32 = 4;

int64_t qkv_rows(const ModelConfig& c, int64_t layer) {
  int64_t rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  if (c.sparse_layers[layer]) rows += (c.index_heads + 1) * c.index_head_dim;
  return rows;
}

// Calls take(bytes) for every buffer allocate_device_weights makes (keep the two in step).
template <class Take>
void for_each_buffer(const ModelConfig& c, int64_t held_experts, Take&& take) {
  const int64_t H = c.hidden_size, D = c.head_dim, Di = c.index_head_dim;
  take(c.vocab_size * H * kBf16);  // embed
  take(H * kF32);                  // final norm
  take(c.vocab_size * H * kBf16);  // lm_head
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    take(2 * H * kF32);
    take(qkv_rows(c, layer) * H * kBf16);
    take(H * c.num_heads * D * kBf16);
    take(2 * D * kF32);
    if (c.sparse_layers[layer]) take(2 * Di * kF32);
    if (c.moe_layers[layer]) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size, S = c.shared_intermediate_size;
      take(E * H * kF32 + E * kF32);
      take(held_experts * 3 * I * H * kBf16);
      if (S > 0) take(3 * S * H * kBf16);
    } else {
      take(3 * c.dense_intermediate_size * H * kBf16);
    }
  }
}

DeviceBuffer f32_buffer(int64_t count) { return DeviceBuffer(static_cast<size_t>(count) * kF32); }
DeviceBuffer bf16_buffer(int64_t count) { return DeviceBuffer(static_cast<size_t>(count) * kBf16); }

DeviceMlp allocate_mlp(int64_t inter, int64_t hidden) {
  DeviceMlp mlp;
  mlp.inter = inter;
  mlp.gate_up = bf16_buffer(2 * inter * hidden);
  mlp.down = bf16_buffer(hidden * inter);
  return mlp;
}

// Copies `tensor` (any float dtype, any strides) converted to `dtype` into `dst` at element
// `offset`; its element count must be `expected` (a layout check).
void put(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype, int64_t expected,
         const std::string& what) {
  MSA_CHECK_ARG(tensor.defined() && tensor.numel() == expected, what,
                std::to_string(expected) + " elements",
                tensor.defined() ? std::to_string(tensor.numel()) : std::string("no tensor"));
  const Tensor host = tensor.dtype() == dtype && tensor.is_contiguous() ? tensor : tensor.to(dtype);
  const size_t element = dtype_size(dtype);
  const size_t at = static_cast<size_t>(offset) * element;
  MSA_CHECK_ARG(at + host.nbytes() <= dst.bytes(), what, "to fit its device buffer",
                std::to_string(at + host.nbytes()) + " bytes into " + std::to_string(dst.bytes()));
  MSA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst.get()) + at, host.raw(), host.nbytes(),
                            cudaMemcpyHostToDevice));
}

void put_mlp(DeviceMlp& dst, const ExpertWeights& w, int64_t hidden, const std::string& what) {
  const int64_t I = dst.inter;
  put(dst.gate_up, 0, w.gate, DType::bf16, I * hidden, what + ".gate_proj");
  put(dst.gate_up, I * hidden, w.up, DType::bf16, I * hidden, what + ".up_proj");
  put(dst.down, 0, w.down, DType::bf16, hidden * I, what + ".down_proj");
}

}  // namespace

void copy_to_device(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype, int64_t expected,
                    const std::string& what) {
  put(dst, offset, tensor, dtype, expected, what);
}

size_t device_weight_bytes(const ModelConfig& c) { return device_weight_bytes(c, c.num_experts); }

size_t device_weight_bytes(const ModelConfig& c, int64_t held_experts) {
  size_t total = 0;
  for_each_buffer(c, held_experts, [&](int64_t bytes) { total += static_cast<size_t>(bytes); });
  return total;
}

DeviceWeights allocate_device_weights(const ModelConfig& c) { return allocate_device_weights(c, c.num_experts); }

DeviceWeights allocate_device_weights(const ModelConfig& c, int64_t held_experts) {
  c.validate();
  MSA_CHECK_ARG(held_experts >= 0 && held_experts <= c.num_experts, "held_experts",
                "a count in [0, config.num_local_experts = " + std::to_string(c.num_experts) + "]", held_experts);
  const size_t bytes = device_weight_bytes(c, held_experts);
  const DeviceMemory memory = device_memory();
  if (static_cast<double>(bytes) > 0.95 * static_cast<double>(memory.free_bytes))
    throw Error("model weights need " + gib_text(static_cast<double>(bytes)) +
                " on the CUDA device (bf16 matrices), more than 95% of its free " +
                gib_text(static_cast<double>(memory.free_bytes)) + " (of " +
                gib_text(static_cast<double>(memory.total_bytes)) + ")");
  const int64_t H = c.hidden_size, D = c.head_dim, Di = c.index_head_dim;
  DeviceWeights w;
  w.embed_tokens = bf16_buffer(c.vocab_size * H);
  w.final_norm = f32_buffer(H);
  w.lm_head = bf16_buffer(c.vocab_size * H);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    DeviceLayer l;
    l.input_norm = f32_buffer(H);
    l.post_attention_norm = f32_buffer(H);
    l.qkv_rows = qkv_rows(c, layer);
    l.qkv = bf16_buffer(l.qkv_rows * H);
    l.o_proj = bf16_buffer(H * c.num_heads * D);
    l.q_norm = f32_buffer(D);
    l.k_norm = f32_buffer(D);
    if (c.sparse_layers[layer]) {
      l.index_q_norm = f32_buffer(Di);
      l.index_k_norm = f32_buffer(Di);
    }
    if (c.moe_layers[layer]) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size;
      l.router = f32_buffer(E * H);
      l.router_bias = f32_buffer(E);
      l.experts = held_experts;
      l.experts_gate_up = bf16_buffer(held_experts * 2 * I * H);
      l.experts_down = bf16_buffer(held_experts * H * I);
      if (c.shared_intermediate_size > 0) l.shared_expert = allocate_mlp(c.shared_intermediate_size, H);
    } else {
      l.mlp = allocate_mlp(c.dense_intermediate_size, H);
    }
    w.layers.push_back(std::move(l));
  }
  return w;
}

void upload_device_weights(const ModelConfig& c, const ModelWeights& host, DeviceWeights& w) {
  const int64_t H = c.hidden_size, D = c.head_dim, Di = c.index_head_dim;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads;
  put(w.embed_tokens, 0, host.embed_tokens, DType::bf16, c.vocab_size * H, "embed_tokens");
  put(w.final_norm, 0, host.final_norm, DType::f32, H, "norm");
  put(w.lm_head, 0, host.lm_head, DType::bf16, c.vocab_size * H, "lm_head");
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& h = host.layers[layer];
    DeviceLayer& l = w.layers[layer];
    const std::string name = "layers." + std::to_string(layer) + ".";
    put(l.input_norm, 0, h.input_norm, DType::f32, H, name + "input_layernorm");
    put(l.post_attention_norm, 0, h.post_attention_norm, DType::f32, H, name + "post_attention_layernorm");
    int64_t row = 0;
    auto stack = [&](const Tensor& t, int64_t rows, const std::string& what) {
      put(l.qkv, row * H, t, DType::bf16, rows * H, name + what);
      row += rows;
    };
    stack(h.q_proj, Hq * D, "q_proj");
    stack(h.k_proj, Hkv * D, "k_proj");
    stack(h.v_proj, Hkv * D, "v_proj");
    if (c.sparse_layers[layer]) {
      stack(h.index_q_proj, c.index_heads * Di, "index_q_proj");
      stack(h.index_k_proj, Di, "index_k_proj");
      put(l.index_q_norm, 0, h.index_q_norm, DType::f32, Di, name + "index_q_norm");
      put(l.index_k_norm, 0, h.index_k_norm, DType::f32, Di, name + "index_k_norm");
    }
    put(l.o_proj, 0, h.o_proj, DType::bf16, H * Hq * D, name + "o_proj");
    put(l.q_norm, 0, h.q_norm, DType::f32, D, name + "q_norm");
    put(l.k_norm, 0, h.k_norm, DType::f32, D, name + "k_norm");
    if (c.moe_layers[layer]) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size;
      put(l.router, 0, h.router, DType::f32, E * H, name + "router");
      put(l.router_bias, 0, h.router_bias, DType::f32, E, name + "e_score_correction_bias");
      MSA_CHECK_ARG(static_cast<int64_t>(h.experts.size()) == l.experts, name + "experts",
                    std::to_string(l.experts) + " experts", h.experts.size());
      for (int64_t e = 0; e < l.experts; ++e) {
        const std::string expert = name + "experts." + std::to_string(e);
        put(l.experts_gate_up, e * 2 * I * H, h.experts[e].gate, DType::bf16, I * H, expert + ".w1");
        put(l.experts_gate_up, (e * 2 + 1) * I * H, h.experts[e].up, DType::bf16, I * H, expert + ".w3");
        put(l.experts_down, e * H * I, h.experts[e].down, DType::bf16, H * I, expert + ".w2");
      }
      if (l.shared_expert.inter > 0) put_mlp(l.shared_expert, h.shared_expert, H, name + "shared_experts");
    } else {
      put_mlp(l.mlp, h.mlp, H, name + "mlp");
    }
    MSA_CHECK_ARG(row == l.qkv_rows, name + "qkv", std::to_string(l.qkv_rows) + " rows", row);
  }
}

}  // namespace msa::model::gpu
