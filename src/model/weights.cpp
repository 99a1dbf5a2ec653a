// The checkpoint name table and the checks that every text tensor is present, expected
// and of the right shape.
#include <cstring>
#include <optional>
#include <set>

#include "msa/model_shard.h"
#include "msa/model_weights.h"
#include "mxfp8.h"
#include "nvfp4.h"

namespace msa {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// Tensors no part of the runtime reads: multi-token prediction (the release lists none, the
// config declares one module; transformers ignores them too).
bool is_unused(const std::string& name) {
  for (const char* prefix : {"mtp.", "model.mtp.", "language_model.model.mtp.", "model.language_model.mtp."})
    if (starts_with(name, prefix)) return true;
  return false;
}

// The vision tower and projectors, ignored when the config has no vision_config.
bool is_vision(const std::string& name) {
  for (const char* prefix : {"vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                             "model.multi_modal_projector.", "patch_merge_mlp."})
    if (starts_with(name, prefix)) return true;
  return false;
}

// The part of a tensor one rank loads: leading-axis rows [row_begin, row_end) and / or
// (matrices) columns [column_begin, column_end); an end of -1 takes the whole axis.
struct Part {
  int64_t row_begin = 0, row_end = -1;
  int64_t column_begin = 0, column_end = -1;
};
Part rows(int64_t begin, int64_t count) { return {.row_begin = begin, .row_end = begin + count}; }
Part columns(int64_t begin, int64_t count) {
  return {.column_begin = begin, .column_end = begin + count};
}

// Columns [begin, end) of a contiguous matrix, copied (a column slice is not a view).
Tensor copy_columns(const Tensor& matrix, int64_t begin, int64_t end) {
  const int64_t rows = matrix.size(0), width = matrix.size(1), count = end - begin;
  const size_t element = dtype_size(matrix.dtype());
  Tensor out = Tensor::zeros({rows, count}, matrix.dtype());
  const char* src = static_cast<const char*>(matrix.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * count * element, src + (r * width + begin) * element, count * element);
  return out;
}

class WeightReader {
 public:
  explicit WeightReader(const SafetensorsModel& file) : file_(file) {}

  // The first of `names` in the file, or nullopt.
  std::optional<std::string> find(std::initializer_list<std::string> names) const {
    for (const std::string& name : names)
      if (file_.contains(name)) return name;
    return std::nullopt;
  }
  bool has(std::initializer_list<std::string> names) const { return find(names).has_value(); }

  // A float tensor of exactly `shape`, as stored (a view into the mapping), or the part of
  // it that `part` names: leading-axis rows stay a view, columns are copied (only the owned
  // ones). A quantized matrix (MXFP8, NVFP4) is sliced before it is dequantized, so only the
  // owned part is.
  Tensor take(std::initializer_list<std::string> names, const Shape& shape, const Part& part = {}) {
    const std::string name = require(names, shape);
    Tensor tensor = file_.get(name);
    const Format format = format_of(name, tensor);
    check_stored_shape(name, tensor, format, shape);
    const bool rows = part.row_end >= 0, columns = part.column_end >= 0;
    if (rows) tensor = tensor.slice0(part.row_begin, part.row_end);
    if (format == Format::mxfp8) {  // model/mxfp8.h
      const std::string scale_name = name + "_scale_inv";
      try {
        Tensor scale = file_.get(scale_name);
        if (rows && scale.dim() == tensor.dim() && scale.size(0) == shape[0])
          scale = scale.slice0(part.row_begin, part.row_end);
        // Whole 32-column scale blocks: slice codes and scales; otherwise the full rows.
        const int64_t in = shape.back(), block = model::kMxfp8Block;
        const bool aligned = part.column_begin % block == 0 &&
                             (part.column_end % block == 0 || part.column_end == in);
        if (columns && aligned && scale.dim() == 2) {
          tensor = copy_columns(tensor, part.column_begin, part.column_end);
          scale = copy_columns(scale, part.column_begin / block, (part.column_end + block - 1) / block);
          tensor = model::dequantize_mxfp8(tensor, scale, name);
        } else {
          tensor = model::dequantize_mxfp8(tensor, scale, name);
          if (columns) tensor = copy_columns(tensor, part.column_begin, part.column_end);
        }
      } catch (const Error& e) {
        throw Error(where(name) + ": " + e.what());
      }
      used_.insert(scale_name);
    } else if (format == Format::nvfp4) {  // model/nvfp4.h
      try {
        Tensor scale = file_.get(name + "_scale");
        const Tensor global = take_nvfp4_scalars(name);
        if (rows && scale.dim() == tensor.dim() && scale.size(0) == shape[0])
          scale = scale.slice0(part.row_begin, part.row_end);
        // Whole 16-column groups: slice the packed codes (2 per byte) and the scales;
        // otherwise dequantize the owned rows and cut the columns out.
        const int64_t block = model::kNvfp4Block;
        const bool aligned = part.column_begin % block == 0 && part.column_end % block == 0;
        if (columns && aligned && scale.dim() == 2 && tensor.dim() == 2) {
          tensor = copy_columns(tensor, part.column_begin / 2, part.column_end / 2);
          scale = copy_columns(scale, part.column_begin / block, part.column_end / block);
          tensor = model::dequantize_nvfp4(tensor, scale, global, name);
        } else {
          tensor = model::dequantize_nvfp4(tensor, scale, global, name);
          if (columns) tensor = copy_columns(tensor, part.column_begin, part.column_end);
        }
      } catch (const Error& e) {
        throw Error(where(name) + ": " + e.what());
      }
      used_.insert(name + "_scale");
    } else if (columns) {
      tensor = copy_columns(tensor, part.column_begin, part.column_end);
    }
    used_.insert(name);
    return tensor;
  }
  // Another rank's tensor: its presence, shape and dtype are checked (so that every rank
  // reports the same missing or mis-shaped tensor), its values are not read.
  void skip(std::initializer_list<std::string> names, const Shape& shape) {
    const std::string name = require(names, shape);
    const Tensor tensor = file_.get(name);
    const Format format = format_of(name, tensor);
    check_stored_shape(name, tensor, format, shape);
    used_.insert(name);
    if (format == Format::mxfp8) used_.insert(name + "_scale_inv");
    if (format == Format::nvfp4) {
      used_.insert(name + "_scale");
      try {
        take_nvfp4_scalars(name);
      } catch (const Error& e) {
        throw Error(where(name) + ": " + e.what());
      }
    }
  }
  // How the first of `names` is stored (an msa::Error when none is in the file).
  QuantizedFormat stored_format(std::initializer_list<std::string> names, const Shape& shape) const {
    const std::string name = require(names, shape);
    switch (format_of(name, file_.get(name))) {
      case Format::mxfp8: return QuantizedFormat::mxfp8;
      case Format::nvfp4: return QuantizedFormat::nvfp4;
      case Format::plain: break;
    }
    return QuantizedFormat::none;
  }

  // An MXFP8 or NVFP4 matrix of `shape` as stored: codes and scales (views into the mapping,
  // the leading-axis rows `part` names), checked as the dequantizing take() checks them.
  QuantizedMatrix take_quantized(std::initializer_list<std::string> names, const Shape& shape,
                                 const Part& part = {}) {
    const std::string name = require(names, shape);
    const Tensor stored = file_.get(name);
    const Format format = format_of(name, stored);
    check_stored_shape(name, stored, format, shape);
    const bool rows = part.row_end >= 0;
    auto owned_rows = [&](Tensor tensor) {
      return rows && tensor.dim() >= 1 && tensor.size(0) == shape[0] ? tensor.slice0(part.row_begin, part.row_end)
                                                                    : tensor;
    };
    QuantizedMatrix matrix;
    matrix.codes = owned_rows(stored);
    try {
      if (format == Format::mxfp8) {
        matrix.format = QuantizedFormat::mxfp8;
        matrix.scales = owned_rows(file_.get(name + "_scale_inv"));
        model::check_mxfp8(matrix.codes, matrix.scales, name);
        used_.insert(name + "_scale_inv");
      } else if (format == Format::nvfp4) {
        matrix.format = QuantizedFormat::nvfp4;
        matrix.scales = owned_rows(file_.get(name + "_scale"));
        matrix.global_scale = model::check_nvfp4(matrix.codes, matrix.scales, take_nvfp4_scalars(name), name);
        used_.insert(name + "_scale");
      } else {
        throw Error("expected an MXFP8 or NVFP4 matrix, got " + std::string(dtype_name(stored.dtype())));
      }
    } catch (const Error& e) {
      throw Error(where(name) + ": " + e.what());
    }
    used_.insert(name);
    return matrix;
  }

  // "checkpoint DIR (file SHARD), tensor 'NAME'": where a bad tensor is.
  std::string where(const std::string& name) const {
    std::string text = "checkpoint " + file_.path();
    if (file_.contains(name) && file_.file_path(name) != file_.path())
      text += " (file " + file_.file_path(name) + ")";
    return text;
  }

  Tensor take_f32(std::initializer_list<std::string> names, const Shape& shape) {
    Tensor tensor = take(names, shape);
    return tensor.dtype() == DType::f32 ? tensor : tensor.to(DType::f32);
  }

  // Every tensor the loader did not consume is an error (a config/checkpoint mismatch), but
  // for the unused ones and, without a vision_config, the vision tensors.
  void check_all_used(bool vision_loaded) const {
    for (const std::string& name : file_.names()) {
      if (used_.count(name) || is_unused(name) || (!vision_loaded && is_vision(name))) continue;
      if (name.ends_with("_scale_inv"))
        throw Error("checkpoint " + file_.path() + ": tensor '" + name +
                    "': an MXFP8 scale whose weight is not a float8_e4m3fn tensor the text "
                    "model reads");
      if (name.ends_with("_scale") || name.ends_with("_scale_2") || name.ends_with("input_scale"))
        throw Error("checkpoint " + file_.path() + ": tensor '" + name +
                    "': an NVFP4 scale whose weight is not a uint8 NVFP4 tensor the text model "
                    "reads");
      throw Error("checkpoint " + file_.path() + ": unexpected tensor '" + name +
                  "' (not part of a MiniMax-M3 model with this config.json)");
    }
  }

 private:
  // How a matrix is stored: as floats, or quantized with scale tensors beside it.
  enum class Format { plain, mxfp8, nvfp4 };

  Format format_of(const std::string& name, const Tensor& tensor) const {
    if (tensor.dtype() == DType::e4m3 && file_.contains(name + "_scale_inv")) return Format::mxfp8;
    if (tensor.dtype() == DType::u8 && file_.contains(name + "_scale")) return Format::nvfp4;
    return Format::plain;
  }

  // The first of `names` in the file; a missing-tensor error otherwise.
  std::string require(std::initializer_list<std::string> names, const Shape& shape) const {
    const std::optional<std::string> name = find(names);
    if (name) return *name;
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "'" : " or '") + n + "'";
    throw Error("checkpoint " + file_.path() + ": missing tensor " + list + " (shape " +
                shape_string(shape) + ")");
  }

  // The stored shape and dtype for a matrix of `shape`: as is for floats and MXFP8 codes,
  // [..., in / 2] bytes for NVFP4.
  void check_stored_shape(const std::string& name, const Tensor& tensor, Format format,
                          const Shape& shape) const {
    if (format == Format::nvfp4) {
      Shape packed = shape;
      packed.back() /= 2;
      if (shape.back() % 2 != 0 || tensor.shape() != packed)
        throw Error(where(name) + ": tensor '" + name + "': expected NVFP4 codes of shape " +
                    shape_string(packed) + " (two e2m1 per byte of a " + shape_string(shape) +
                    " matrix), got " + shape_string(tensor.shape()));
      return;
    }
    if (tensor.shape() != shape)
      throw Error(where(name) + ": tensor '" + name + "': expected shape " + shape_string(shape) +
                  ", got " + shape_string(tensor.shape()));
    const DType dtype = tensor.dtype();
    if (format == Format::plain && dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
      throw Error(where(name) + ": tensor '" + name +
                  "': expected dtype f32, bf16 or f16 (or float8_e4m3fn with '" + name +
                  "_scale_inv', or uint8 NVFP4 codes with '" + name + "_scale'), got " +
                  std::string(dtype_name(dtype)));
  }

  // The NVFP4 weight's global scale (`<name>_scale_2`, required) and, when present, the
  // activation `input_scale` of its module (checked, not used: weights are dequantized).
  Tensor take_nvfp4_scalars(const std::string& name) {
    const std::string global_name = name + "_scale_2";
    if (!file_.contains(global_name))
      throw Error("tensor '" + global_name + "' is missing (the global scale of NVFP4 weight '" + name + "')");
    const Tensor global = file_.get(global_name);
    model::nvfp4_scalar(global, global_name);
    used_.insert(global_name);
    const std::string module = name.ends_with(".weight") ? name.substr(0, name.size() - 6) : name + ".";
    if (file_.contains(module + "input_scale")) {
      model::nvfp4_scalar(file_.get(module + "input_scale"), module + "input_scale");
      used_.insert(module + "input_scale");
    }
    return global;
  }

  const SafetensorsModel& file_;
  std::set<std::string> used_;
};

// gate/up of a dense MLP: separate (released) or fused [2I, H] with gate first (transformers).
// A rank loads intermediate columns [begin, begin + count) (count < 0: all of them): gate/up
// rows (views) and down columns (copied).
ExpertWeights load_mlp(WeightReader& reader, const std::string& prefix, int64_t hidden,
                       int64_t inter, int64_t begin = 0, int64_t count = -1) {
  const bool whole = count < 0;
  if (whole) count = inter;
  ExpertWeights mlp;
  if (reader.has({prefix + "gate_up_proj.weight"})) {
    const Shape fused = {2 * inter, hidden};
    if (whole) {
      const Tensor both = reader.take({prefix + "gate_up_proj.weight"}, fused);
      mlp.gate = both.slice0(0, inter);
      mlp.up = both.slice0(inter, 2 * inter);
    } else {
      mlp.gate = reader.take({prefix + "gate_up_proj.weight"}, fused, rows(begin, count));
      mlp.up = reader.take({prefix + "gate_up_proj.weight"}, fused, rows(inter + begin, count));
    }
  } else {
    const Part part = whole ? Part{} : rows(begin, count);
    mlp.gate = reader.take({prefix + "gate_proj.weight"}, {inter, hidden}, part);
    mlp.up = reader.take({prefix + "up_proj.weight"}, {inter, hidden}, part);
  }
  mlp.down = reader.take({prefix + "down_proj.weight"}, {hidden, inter},
                         whole ? Part{} : columns(begin, count));
  return mlp;
}

// Rows [begin, begin + count) of a quantized matrix (codes and scales; a view).
QuantizedMatrix quantized_rows(const QuantizedMatrix& m, int64_t begin, int64_t count) {
  return {.format = m.format,
          .codes = m.codes.slice0(begin, begin + count),
          .scales = m.scales.slice0(begin, begin + count),
          .global_scale = m.global_scale};
}

// Expert e of a stacked quantized matrix [E, out, ...] as [out, ...].
QuantizedMatrix quantized_expert(const QuantizedMatrix& m, int64_t e) {
  auto matrix = [&](const Tensor& t) { return t.slice0(e, e + 1).reshape({t.size(1), t.size(2)}); };
  return {.format = m.format, .codes = matrix(m.codes), .scales = matrix(m.scales), .global_scale = m.global_scale};
}

// Routed experts [first, first + count) of a MoE layer (a rank's; all of them without a plan).
// keep_quantized: an MXFP8 / NVFP4 layer's experts stay as stored (WeightLoadOptions).
void load_moe(WeightReader& reader, const std::string& layer, const ModelConfig& c,
              const ShardPlan* plan, bool keep_quantized, LayerWeights& w) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  const int64_t first = plan ? plan->expert_begin : 0, count = plan ? plan->experts : E;
  const std::string released = layer + "block_sparse_moe.", renamed = layer + "mlp.";
  w.router = reader.take_f32({released + "gate.weight", renamed + "gate.weight"}, {E, H});
  w.router_bias = reader.take_f32(
      {released + "e_score_correction_bias", renamed + "gate.e_score_correction_bias"}, {E});
  const bool fused = reader.has({renamed + "experts.gate_up_proj"});
  // The layer's format: its first routed matrix's; with keep_quantized every other one must
  // match (the device holds one format per layer).
  QuantizedFormat format = QuantizedFormat::none;
  if (keep_quantized) {
    format = fused ? reader.stored_format({renamed + "experts.gate_up_proj"}, {E, 2 * I, H})
                   : reader.stored_format({released + "experts.0.w1.weight"}, {I, H});
    const std::string first_name = fused ? renamed + "experts.gate_up_proj" : released + "experts.0.w1.weight";
    auto check_format = [&](const std::string& name, const Shape& shape) {
      const QuantizedFormat stored = reader.stored_format({name}, shape);
      if (stored != format)
        throw Error(reader.where(name) + ": tensor '" + name + "' is stored as " + quantized_format_name(stored) + ", but '" +
                    first_name + "' as " + quantized_format_name(format) +
                    ": the routed experts of one layer must share one format to stay quantized");
    };
    if (fused) {
      check_format(renamed + "experts.down_proj", {E, H, I});
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const std::string expert = released + "experts." + std::to_string(e) + ".";
        check_format(expert + "w1.weight", {I, H});
        check_format(expert + "w3.weight", {I, H});
        check_format(expert + "w2.weight", {H, I});
      }
    }
  }
  const bool quantized = format != QuantizedFormat::none;
  if (fused && quantized) {
    const Part part = plan ? rows(first, count) : Part{};
    const QuantizedMatrix gate_up = reader.take_quantized({renamed + "experts.gate_up_proj"}, {E, 2 * I, H}, part);
    const QuantizedMatrix down = reader.take_quantized({renamed + "experts.down_proj"}, {E, H, I}, part);
    for (int64_t e = 0; e < count; ++e) {
      ExpertWeights expert;
      const QuantizedMatrix both = quantized_expert(gate_up, e);
      expert.quantized = {.gate = quantized_rows(both, 0, I),
                          .up = quantized_rows(both, I, I),
                          .down = quantized_expert(down, e)};
      w.experts.push_back(std::move(expert));
    }
  } else if (fused) {
    const Part part = plan ? rows(first, count) : Part{};
    const Tensor gate_up = reader.take({renamed + "experts.gate_up_proj"}, {E, 2 * I, H}, part);
    const Tensor down = reader.take({renamed + "experts.down_proj"}, {E, H, I}, part);
    for (int64_t e = 0; e < count; ++e) {
      const Tensor expert = gate_up.slice0(e, e + 1).reshape({2 * I, H});
      w.experts.push_back({.gate = expert.slice0(0, I),
                           .up = expert.slice0(I, 2 * I),
                           .down = down.slice0(e, e + 1).reshape({H, I}),
                           .quantized = {}});
    }
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const std::string expert = released + "experts." + std::to_string(e) + ".";
      if (e < first || e >= first + count) {
        reader.skip({expert + "w1.weight"}, {I, H});
        reader.skip({expert + "w3.weight"}, {I, H});
        reader.skip({expert + "w2.weight"}, {H, I});
        continue;
      }
      if (quantized) {
        ExpertWeights weights;
        weights.quantized = {.gate = reader.take_quantized({expert + "w1.weight"}, {I, H}),
                             .up = reader.take_quantized({expert + "w3.weight"}, {I, H}),
                             .down = reader.take_quantized({expert + "w2.weight"}, {H, I})};
        w.experts.push_back(std::move(weights));
        continue;
      }
      w.experts.push_back({.gate = reader.take({expert + "w1.weight"}, {I, H}),
                           .up = reader.take({expert + "w3.weight"}, {I, H}),
                           .down = reader.take({expert + "w2.weight"}, {H, I}),
                           .quantized = {}});
    }
  }
  if (c.shared_intermediate_size > 0) {
    const std::string prefix = reader.has({released + "shared_experts.down_proj.weight"})
                                   ? released + "shared_experts."
                                   : renamed + "shared_experts.";
    w.shared_expert = plan ? load_mlp(reader, prefix, H, c.shared_intermediate_size,
                                      plan->shared_begin, plan->shared_columns)
                           : load_mlp(reader, prefix, H, c.shared_intermediate_size);
  }
}

// One decoder layer, or (plan) one rank's part of it: its heads' q/k/v and index-query rows,
// o_proj's columns of its heads, its MLP columns and experts.
LayerWeights load_layer(WeightReader& reader, const std::string& layer, const ModelConfig& c,
                        int64_t index, const ShardPlan* plan, const WeightLoadOptions& options) {
  const int64_t H = c.hidden_size, D = c.head_dim;
  const auto head_rows = [&](int64_t begin, int64_t heads, int64_t dim) {
    return plan ? rows(begin * dim, heads * dim) : Part{};
  };
  LayerWeights w;
  w.input_norm = reader.take_f32({layer + "input_layernorm.weight"}, {H});
  w.post_attention_norm = reader.take_f32({layer + "post_attention_layernorm.weight"}, {H});
  const std::string attn = layer + "self_attn.";
  w.q_proj = reader.take({attn + "q_proj.weight"}, {c.num_heads * D, H},
                         plan ? head_rows(plan->q_begin, plan->q_heads, D) : Part{});
  w.k_proj = reader.take({attn + "k_proj.weight"}, {c.num_kv_heads * D, H},
                         plan ? head_rows(plan->kv_begin, plan->kv_heads, D) : Part{});
  w.v_proj = reader.take({attn + "v_proj.weight"}, {c.num_kv_heads * D, H},
                         plan ? head_rows(plan->kv_begin, plan->kv_heads, D) : Part{});
  w.o_proj = reader.take({attn + "o_proj.weight"}, {H, c.num_heads * D},
                         plan ? columns(plan->q_begin * D, plan->q_heads * D) : Part{});
  w.q_norm = reader.take_f32({attn + "q_norm.weight"}, {D});
  w.k_norm = reader.take_f32({attn + "k_norm.weight"}, {D});
  if (c.sparse_layers[index]) {
    const int64_t Di = c.index_head_dim;
    // Index head g selects for KV group g: a rank takes its groups' heads and the one shared
    // index-key head whole.
    w.index_q_proj = reader.take({attn + "index_q_proj.weight", attn + "indexer.q_proj.weight"},
                                 {c.index_heads * Di, H},
                                 plan ? head_rows(plan->kv_begin, plan->kv_heads, Di) : Part{});
    w.index_k_proj =
        reader.take({attn + "index_k_proj.weight", attn + "indexer.k_proj.weight"}, {Di, H});
    w.index_q_norm =
        reader.take_f32({attn + "index_q_norm.weight", attn + "indexer.q_norm.weight"}, {Di});
    w.index_k_norm =
        reader.take_f32({attn + "index_k_norm.weight", attn + "indexer.k_norm.weight"}, {Di});
  }
  if (c.moe_layers[index])
    load_moe(reader, layer, c, plan, options.routed_experts == RoutedExperts::quantized, w);
  else if (plan) w.mlp = load_mlp(reader, layer + "mlp.", H, c.dense_intermediate_size, plan->dense_begin, plan->dense_columns);
  else w.mlp = load_mlp(reader, layer + "mlp.", H, c.dense_intermediate_size);
  return w;
}

// One linear layer with bias under either of two names (release, transformers).
LinearWeights take_linear(WeightReader& reader, const std::string& released,
                          const std::string& renamed, int64_t out, int64_t in) {
  return {.weight = reader.take({released + ".weight", renamed + ".weight"}, {out, in}),
          .bias = reader.take_f32({released + ".bias", renamed + ".bias"}, {out})};
}

LayerNormWeights take_layer_norm(WeightReader& reader, const std::string& released,
                                 const std::string& renamed, int64_t dim) {
  return {.weight = reader.take_f32({released + ".weight", renamed + ".weight"}, {dim}),
          .bias = reader.take_f32({released + ".bias", renamed + ".bias"}, {dim})};
}

VisionWeights load_vision(WeightReader& reader, const VisionConfig& v, int64_t text_hidden) {
  const int64_t Hv = v.hidden_size, Hp = v.projector_hidden_size, H = text_hidden;
  const std::string released = "vision_tower.vision_model.", renamed = "model.vision_tower.";
  VisionWeights w;
  // The release stores the patch embedding in f32; any float dtype is widened to f32 here
  // (it is one small matrix, read by every patch).
  w.patch_embedding =
      reader
          .take_f32({released + "embeddings.patch_embedding.weight", renamed + "embeddings.proj.weight"},
                    {Hv, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size})
          .reshape({Hv, v.patch_values()});
  w.pre_norm = take_layer_norm(reader, released + "pre_layrnorm", renamed + "pre_layrnorm", Hv);
  for (int64_t i = 0; i < v.num_layers; ++i) {
    const std::string a = released + "encoder.layers." + std::to_string(i) + ".",
                      b = renamed + "layers." + std::to_string(i) + ".";
    VisionLayerWeights layer;
    layer.norm1 = take_layer_norm(reader, a + "layer_norm1", b + "layer_norm1", Hv);
    layer.norm2 = take_layer_norm(reader, a + "layer_norm2", b + "layer_norm2", Hv);
    for (auto [field, name] : {std::pair{&VisionLayerWeights::q_proj, "q_proj"},
                               std::pair{&VisionLayerWeights::k_proj, "k_proj"},
                               std::pair{&VisionLayerWeights::v_proj, "v_proj"},
                               std::pair{&VisionLayerWeights::out_proj, "out_proj"}})
      layer.*field = take_linear(reader, a + "self_attn." + name, b + "self_attn." + name, Hv, Hv);
    layer.fc1 = take_linear(reader, a + "mlp.fc1", b + "mlp.fc1", v.intermediate_size, Hv);
    layer.fc2 = take_linear(reader, a + "mlp.fc2", b + "mlp.fc2", Hv, v.intermediate_size);
    w.layers.push_back(std::move(layer));
  }
  const std::string projector = "multi_modal_projector.", moved = "model.multi_modal_projector.";
  w.linear_1 = take_linear(reader, projector + "linear_1", moved + "linear_1", Hp, Hv);
  w.linear_2 = take_linear(reader, projector + "linear_2", moved + "linear_2", H, Hp);
  w.merge_linear_1 = take_linear(reader, "patch_merge_mlp.linear_1", moved + "merge_linear_1", Hp,
                                 v.merge_window() * H);
  w.merge_linear_2 = take_linear(reader, "patch_merge_mlp.linear_2", moved + "merge_linear_2", H, Hp);
  return w;
}

}  // namespace

namespace {

// The text tower (plan: one rank's part of it).
ModelWeights load_text_weights(const SafetensorsModel& file, const ModelConfig& c,
                               const ShardPlan* plan, const WeightLoadOptions& options) {
  c.validate();
  WeightReader reader(file);
  // The text tower's prefix: released VL checkpoint, transformers VL, transformers text-only.
  std::string prefix;
  bool found = false;
  for (const char* candidate : {"language_model.model.", "model.language_model.", "model.", ""}) {
    if (file.contains(std::string(candidate) + "embed_tokens.weight")) {
      prefix = candidate;
      found = true;
      break;
    }
  }
  if (!found)
    throw Error("checkpoint " + file.path() +
                ": missing tensor 'language_model.model.embed_tokens.weight' (nor "
                "'model.language_model.embed_tokens.weight' or 'model.embed_tokens.weight')");
  ModelWeights w;
  w.layout = prefix == "language_model.model." ? "released" : "transformers";
  const int64_t V = c.vocab_size, H = c.hidden_size;
  w.embed_tokens = reader.take({prefix + "embed_tokens.weight"}, {V, H});
  w.final_norm = reader.take_f32({prefix + "norm.weight"}, {H});
  if (c.tie_word_embeddings && !reader.has({"language_model.lm_head.weight", "lm_head.weight"}))
    w.lm_head = w.embed_tokens;
  else
    w.lm_head = reader.take({"language_model.lm_head.weight", "lm_head.weight"}, {V, H});
  for (int64_t i = 0; i < c.num_layers; ++i)
    w.layers.push_back(load_layer(reader, prefix + "layers." + std::to_string(i) + ".", c, i, plan, options));
  if (c.vision) w.vision = load_vision(reader, *c.vision, c.hidden_size);
  reader.check_all_used(c.vision.has_value());
  return w;
}

}  // namespace

const char* quantized_format_name(QuantizedFormat format) {
  switch (format) {
    case QuantizedFormat::none: return "floats";
    case QuantizedFormat::mxfp8: return "mxfp8";
    case QuantizedFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

ModelWeights load_model_weights(const SafetensorsModel& file, const ModelConfig& c,
                                const WeightLoadOptions& options) {
  return load_text_weights(file, c, nullptr, options);
}

ModelWeights load_model_weights(const SafetensorsModel& file, const ModelConfig& c,
                                const ShardPlan& plan, const WeightLoadOptions& options) {
  const ShardPlan expected = make_shard_plan(c, plan.rank, plan.world);
  if (expected.q_begin != plan.q_begin || expected.q_heads != plan.q_heads ||
      expected.experts != plan.experts || expected.expert_begin != plan.expert_begin)
    throw_arg_error("plan", "make_shard_plan(config, rank, world) of this config", "another plan");
  // One rank of one: the whole model, exactly as the single-rank loader (no copies).
  return load_text_weights(file, c, plan.covers_everything() ? nullptr : &plan, options);
}

void check_weights_finite(const SafetensorsModel& file) {
  for (const std::string& name : file.names()) {
    const Tensor tensor = file.get(name);
    if (const int64_t at = first_non_finite(tensor); at >= 0)
      throw Error("checkpoint " + file.path() + ": tensor '" + name + "' (" +
                  std::string(dtype_name(tensor.dtype())) + " " + shape_string(tensor.shape()) +
                  "): expected finite weights, got " + std::to_string(tensor.get(at)) +
                  " at index " + index_string(tensor.shape(), at));
  }
}

}  // namespace msa
