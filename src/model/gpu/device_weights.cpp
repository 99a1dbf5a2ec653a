// Allocation and upload of the device weights (layout: device_weights.h).
#include "device_weights.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cuda/common/cuda_check.h"
#include "device_tensor.h"
#include "expert_weights.h"

namespace msa::model::gpu {
namespace {

constexpr size_t kBf16 = 2, kF32 = 4;

// Bytes of one routed-expert matrix [rows, in] in `format`: codes, block scales, global scales.
struct ExpertMatrixBytes {
  int64_t codes = 0, scales = 0, global = 0;
};
ExpertMatrixBytes expert_matrix_bytes(ExpertWeights format, int64_t rows, int64_t in) {
  const int64_t block = expert_weights_in_multiple(format);  // channels per block scale
  switch (format) {
    case ExpertWeights::bf16: return {.codes = rows * in * static_cast<int64_t>(kBf16)};
    case ExpertWeights::mxfp8: return {.codes = rows * in, .scales = rows * (in / block)};
    case ExpertWeights::nvfp4:
      return {.codes = rows * (in / 2), .scales = rows * (in / block), .global = rows * static_cast<int64_t>(kF32)};
  }
  return {};
}

int64_t qkv_rows(const ModelConfig& c, int64_t layer) {
  int64_t rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  if (c.sparse_layers[layer]) rows += (c.index_heads + 1) * c.index_head_dim;
  return rows;
}

// Calls take(bytes) for every buffer allocate_device_weights makes (keep the two in step).
template <class Take>
void for_each_buffer(const ModelConfig& c, int64_t held_experts, ExpertWeights format, Take&& take) {
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
      for (const ExpertMatrixBytes m : {expert_matrix_bytes(format, held_experts * 2 * I, H),
                                        expert_matrix_bytes(format, held_experts * H, I)}) {
        take(m.codes);
        if (m.scales > 0) take(m.scales);
        if (m.global > 0) take(m.global);
      }
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

void put_mlp(DeviceMlp& dst, const msa::ExpertWeights& w, int64_t hidden, const std::string& what) {
  const int64_t I = dst.inter;
  put(dst.gate_up, 0, w.gate, DType::bf16, I * hidden, what + ".gate_proj");
  put(dst.gate_up, I * hidden, w.up, DType::bf16, I * hidden, what + ".up_proj");
  put(dst.down, 0, w.down, DType::bf16, hidden * I, what + ".down_proj");
}

// Copies `tensor`'s bytes as they are (codes and scales: never converted) into `dst` at byte
// `offset`; its dtype must be `dtype` and its byte count `expected`.
void put_bytes(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype, int64_t expected,
               const std::string& what) {
  MSA_CHECK_ARG(tensor.defined() && tensor.dtype() == dtype, what, std::string(dtype_name(dtype)) + " codes",
                tensor.defined() ? std::string(dtype_name(tensor.dtype())) : std::string("no tensor"));
  MSA_CHECK_ARG(static_cast<int64_t>(tensor.nbytes()) == expected, what, std::to_string(expected) + " bytes",
                tensor.nbytes());
  const Tensor host = tensor.is_contiguous() ? tensor : tensor.clone();
  MSA_CHECK_ARG(static_cast<size_t>(offset) + host.nbytes() <= dst.bytes(), what, "to fit its device buffer",
                std::to_string(offset + host.nbytes()) + " bytes into " + std::to_string(dst.bytes()));
  MSA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst.get()) + offset, host.raw(), host.nbytes(),
                            cudaMemcpyHostToDevice));
}

ExpertWeights device_format(QuantizedFormat format) {
  switch (format) {
    case QuantizedFormat::none: return ExpertWeights::bf16;
    case QuantizedFormat::mxfp8: return ExpertWeights::mxfp8;
    case QuantizedFormat::nvfp4: return ExpertWeights::nvfp4;
  }
  return ExpertWeights::bf16;
}

// One quantized matrix [rows, in] of expert e into a layer's stacked code / scale / global
// buffers at row `row` of [experts * rows_per_expert, in].
void put_quantized(const QuantizedMatrix& m, ExpertWeights format, int64_t row, int64_t rows, int64_t in,
                   DeviceBuffer& codes, DeviceBuffer& scales, std::vector<float>& global, const std::string& what) {
  const ExpertMatrixBytes at = expert_matrix_bytes(format, row, in), size = expert_matrix_bytes(format, rows, in);
  const bool mxfp8 = format == ExpertWeights::mxfp8;
  put_bytes(codes, at.codes, m.codes, mxfp8 ? DType::e4m3 : DType::u8, size.codes, what);
  put_bytes(scales, at.scales, m.scales, mxfp8 ? DType::u8 : DType::e4m3, size.scales, what + " scales");
  if (format == ExpertWeights::nvfp4) std::fill_n(global.begin() + row, rows, m.global_scale);
}

}  // namespace

namespace {

// One projection's quantized expert weights of a layer (empty for bf16 experts).
QuantizedExpertWeights quantized_view(ExpertWeights format, const DeviceBuffer& codes, const DeviceBuffer& scales,
                                      const DeviceBuffer& global) {
  if (format == ExpertWeights::bf16) return {};
  return {.format = format,
          .codes = codes.as<uint8_t>(),
          .scales = scales.as<uint8_t>(),
          .global_scale = format == ExpertWeights::nvfp4 ? global.as<float>() : nullptr};
}

}  // namespace

QuantizedExpertWeights gate_up_expert_weights(const DeviceLayer& l) {
  return quantized_view(l.expert_format, l.experts_gate_up, l.experts_gate_up_scales, l.experts_gate_up_global);
}

QuantizedExpertWeights down_expert_weights(const DeviceLayer& l) {
  return quantized_view(l.expert_format, l.experts_down, l.experts_down_scales, l.experts_down_global);
}

ExpertWeights host_expert_format(const ModelConfig& c, const ModelWeights& host) {
  std::optional<ExpertWeights> format;
  int64_t first_layer = -1;
  for (int64_t layer = 0; layer < c.num_layers && layer < static_cast<int64_t>(host.layers.size()); ++layer) {
    if (!c.moe_layers[layer] || host.layers[layer].experts.empty()) continue;
    const ExpertWeights here = device_format(host.layers[layer].experts[0].quantized.format());
    if (!format) {
      format = here;
      first_layer = layer;
    } else if (*format != here) {
      throw Error("model weights: the routed experts of layer " + std::to_string(layer) + " are " +
                  expert_weights_name(here) + ", those of layer " + std::to_string(first_layer) + " " +
                  expert_weights_name(*format) + ": the CUDA model holds one expert format (load with "
                  "RoutedExperts::dequantized for bf16 experts)");
    }
  }
  return format.value_or(ExpertWeights::bf16);
}

void copy_to_device(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype, int64_t expected,
                    const std::string& what) {
  put(dst, offset, tensor, dtype, expected, what);
}

size_t device_weight_bytes(const ModelConfig& c, ExpertWeights experts) {
  return device_weight_bytes(c, c.num_experts, experts);
}

size_t device_weight_bytes(const ModelConfig& c, int64_t held_experts, ExpertWeights experts) {
  size_t total = 0;
  for_each_buffer(c, held_experts, experts, [&](int64_t bytes) { total += static_cast<size_t>(bytes); });
  return total;
}

DeviceWeights allocate_device_weights(const ModelConfig& c, ExpertWeights experts) {
  return allocate_device_weights(c, c.num_experts, experts);
}

DeviceWeights allocate_device_weights(const ModelConfig& c, int64_t held_experts, ExpertWeights format) {
  c.validate();
  MSA_CHECK_ARG(held_experts >= 0 && held_experts <= c.num_experts, "held_experts",
                "a count in [0, config.num_local_experts = " + std::to_string(c.num_experts) + "]", held_experts);
  MSA_CHECK_ARG(format == ExpertWeights::bf16 || format == ExpertWeights::mxfp8 || format == ExpertWeights::nvfp4,
                "experts", "bf16, mxfp8 or nvfp4", static_cast<int>(format));
  if (format != ExpertWeights::bf16) {
    const int64_t multiple = expert_weights_in_multiple(format);
    if (c.hidden_size % multiple != 0 || c.moe_intermediate_size % multiple != 0)
      throw Error(std::string(expert_weights_name(format)) + " routed experts on CUDA need hidden_size (" +
                  std::to_string(c.hidden_size) + ") and moe_intermediate_size (" +
                  std::to_string(c.moe_intermediate_size) + ") to be multiples of " + std::to_string(multiple) +
                  " (one scale block per kernel chunk); load with RoutedExperts::dequantized");
  }
  const size_t bytes = device_weight_bytes(c, held_experts, format);
  const DeviceMemory memory = device_memory();
  if (static_cast<double>(bytes) > 0.95 * static_cast<double>(memory.free_bytes))
    throw Error("model weights need " + gib_text(static_cast<double>(bytes)) +
                " on the CUDA device (bf16 matrices, routed experts " +
                std::string(expert_weights_name(format)) + "), more than 95% of its free " +
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
      l.expert_format = format;
      const ExpertMatrixBytes gate_up = expert_matrix_bytes(format, held_experts * 2 * I, H),
                              down = expert_matrix_bytes(format, held_experts * H, I);
      l.experts_gate_up = DeviceBuffer(static_cast<size_t>(gate_up.codes));
      l.experts_down = DeviceBuffer(static_cast<size_t>(down.codes));
      if (format != ExpertWeights::bf16) {
        l.experts_gate_up_scales = DeviceBuffer(static_cast<size_t>(gate_up.scales));
        l.experts_down_scales = DeviceBuffer(static_cast<size_t>(down.scales));
      }
      if (format == ExpertWeights::nvfp4) {
        l.experts_gate_up_global = DeviceBuffer(static_cast<size_t>(gate_up.global));
        l.experts_down_global = DeviceBuffer(static_cast<size_t>(down.global));
      }
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
      const ExpertWeights format = l.expert_format;
      std::vector<float> gate_up_global, down_global;  // nvfp4: per output row
      if (format == ExpertWeights::nvfp4) {
        gate_up_global.resize(static_cast<size_t>(l.experts * 2 * I));
        down_global.resize(static_cast<size_t>(l.experts * H));
      }
      for (int64_t e = 0; e < l.experts; ++e) {
        const std::string expert = name + "experts." + std::to_string(e);
        const msa::ExpertWeights& x = h.experts[e];
        const ExpertWeights stored = device_format(x.quantized.format());
        if (stored != format)
          throw Error("model weights: " + expert + " is " + expert_weights_name(stored) +
                      ", the device's routed experts " + expert_weights_name(format) +
                      " (allocate_device_weights(..., host_expert_format(config, host)))");
        if (format == ExpertWeights::bf16) {
          put(l.experts_gate_up, e * 2 * I * H, x.gate, DType::bf16, I * H, expert + ".w1");
          put(l.experts_gate_up, (e * 2 + 1) * I * H, x.up, DType::bf16, I * H, expert + ".w3");
          put(l.experts_down, e * H * I, x.down, DType::bf16, H * I, expert + ".w2");
          continue;
        }
        put_quantized(x.quantized.gate, format, e * 2 * I, I, H, l.experts_gate_up, l.experts_gate_up_scales,
                      gate_up_global, expert + ".w1");
        put_quantized(x.quantized.up, format, e * 2 * I + I, I, H, l.experts_gate_up, l.experts_gate_up_scales,
                      gate_up_global, expert + ".w3");
        put_quantized(x.quantized.down, format, e * H, H, I, l.experts_down, l.experts_down_scales, down_global,
                      expert + ".w2");
      }
      if (format == ExpertWeights::nvfp4) {
        MSA_CUDA_CHECK(cudaMemcpy(l.experts_gate_up_global.get(), gate_up_global.data(),
                                  gate_up_global.size() * sizeof(float), cudaMemcpyHostToDevice));
        MSA_CUDA_CHECK(cudaMemcpy(l.experts_down_global.get(), down_global.data(),
                                  down_global.size() * sizeof(float), cudaMemcpyHostToDevice));
      }
      if (l.shared_expert.inter > 0) put_mlp(l.shared_expert, h.shared_expert, H, name + "shared_experts");
    } else {
      put_mlp(l.mlp, h.mlp, H, name + "mlp");
    }
    MSA_CHECK_ARG(row == l.qkv_rows, name + "qkv", std::to_string(l.qkv_rows) + " rows", row);
  }
}

}  // namespace msa::model::gpu
