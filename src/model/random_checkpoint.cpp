// `msa make-model`: random weights under the released checkpoint's names, in floats or in
// the MXFP8 / NVFP4 layouts of the quantized releases, single file or sharded with an index,
// plus config.json; and a byte-level BPE tokenizer for them.
//
// The weights are streamed: every tensor is planned first (name, dtype, shape, how its
// bytes are drawn), then each file is written a chunk at a time, each tensor drawn from its
// own generator (seeded by the seed and its name), so a checkpoint of hundreds of GB needs
// one chunk of memory and its bytes do not depend on the shard size.
#include <cmath>
#include <filesystem>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/text_file.h"
#include "msa/model_random.h"
#include "msa/safetensors.h"

namespace msa {
namespace {

// splitmix64: fast, seedable, and the same on every platform.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

// How a tensor's bytes are drawn.
enum class Fill {
  uniform,          // floats (f32/bf16/f16): mean + U(-half_width, half_width)
  constant,         // f32: every element `value`
  mxfp8_codes,      // e4m3 codes of magnitude 2^-3 .. 1.875, random sign (RMS ~0.80)
  ue8m0_exponents,  // uint8 exponents `code` or `code` + 1 (never 255, E8M0's NaN)
  e2m1_pairs,       // random bytes: every nibble is a valid e2m1 code (RMS 2.93)
  e4m3_scales,      // positive e4m3 codes 0x70..0x7e: 128 .. 448, never NaN (0x7f)
};

// RMS of the drawn codes' values, to aim a quantized matrix at the float one's spread.
constexpr double kMxfp8CodeRms = 0.80;
constexpr double kE2m1CodeRms = 2.93;    // sqrt(mean of 0, .25, 1, 2.25, 4, 9, 16, 36)
constexpr double kNvfp4ScaleRms = 270;   // of the e4m3 values 128 .. 448 above

struct PlannedTensor {
  std::string name;
  DType dtype;
  Shape shape;
  Fill fill;
  float mean = 0, half_width = 0;  // uniform; constant uses `mean`
  uint8_t code = 0;                // ue8m0_exponents: the lower exponent
  int64_t group = 0;               // tensors of one weight (codes + scales) share a shard
  int64_t bytes() const { return shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype)); }
};

uint64_t name_hash(const std::string& name) {  // FNV-1a
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) hash = (hash ^ ch) * 0x100000001b3ull;
  return hash;
}

// Fills `bytes` bytes of `t` (whole elements) from `random`.
void draw(const PlannedTensor& t, Random& random, void* data, int64_t bytes) {
  auto* out = static_cast<uint8_t*>(data);
  switch (t.fill) {
    case Fill::uniform: {
      const int64_t n = bytes / static_cast<int64_t>(dtype_size(t.dtype));
      constexpr float kUnit = 1.0f / 16777216.0f;
      for (int64_t i = 0; i < n;) {
        uint64_t bits = random.next();  // two 24-bit uniforms per draw
        for (int k = 0; k < 2 && i < n; ++k, ++i, bits >>= 32) {
          const float value = t.mean + t.half_width * (2 * static_cast<float>(bits & 0xffffff) * kUnit - 1);
          if (t.dtype == DType::f32) std::memcpy(out + 4 * i, &value, 4);
          else {
            const uint16_t half = t.dtype == DType::bf16 ? float_to_bf16(value) : float_to_f16(value);
            std::memcpy(out + 2 * i, &half, 2);
          }
        }
      }
      return;
    }
    case Fill::constant:
      for (int64_t i = 0; i < bytes / 4; ++i) std::memcpy(out + 4 * i, &t.mean, 4);
      return;
    case Fill::mxfp8_codes:
      for (int64_t i = 0; i < bytes;) {
        uint64_t bits = random.next();  // 6 bits per code: sign, exponent 4..7, mantissa
        for (int k = 0; k < 10 && i < bytes; ++k, ++i, bits >>= 6)
          out[i] = static_cast<uint8_t>(((bits & 1) << 7) | ((4 + ((bits >> 1) & 3)) << 3) | ((bits >> 3) & 7));
      }
      return;
    case Fill::ue8m0_exponents:
      for (int64_t i = 0; i < bytes;) {
        uint64_t bits = random.next();
        for (int k = 0; k < 64 && i < bytes; ++k, ++i, bits >>= 1) out[i] = static_cast<uint8_t>(t.code + (bits & 1));
      }
      return;
    case Fill::e2m1_pairs:
      for (int64_t i = 0; i < bytes; i += 8) {
        const uint64_t bits = random.next();
        std::memcpy(out + i, &bits, static_cast<size_t>(std::min<int64_t>(8, bytes - i)));
      }
      return;
    case Fill::e4m3_scales:
      for (int64_t i = 0; i < bytes;) {
        uint64_t bits = random.next();
        for (int k = 0; k < 4 && i < bytes; ++k, ++i, bits >>= 16)
          out[i] = static_cast<uint8_t>(0x70 + (bits & 0xffff) % 15);
      }
      return;
  }
}

// What the matrix is in the model: it decides which checkpoint format quantizes it.
enum class Role {
  other,         // embeddings, lm_head, vision tower, projectors: floats in every release
  layer_linear,  // a Linear of a decoder layer (attention, indexer, dense MLP, shared expert)
  expert,        // a routed expert's w1 / w3 / w2
};

class Planner {
 public:
  Planner(DType dtype, CheckpointFormat format) : dtype_(dtype), format_(format) {}

  // Uniform with the given standard deviation (mean `mean`).
  void add(const std::string& name, const Shape& shape, double std, double mean = 0,
           bool keep_f32 = false) {
    tensors_.push_back({.name = name,
                        .dtype = keep_f32 ? DType::f32 : dtype_,
                        .shape = shape,
                        .fill = Fill::uniform,
                        .mean = static_cast<float>(mean),
                        .half_width = static_cast<float>(std * std::sqrt(3.0)),
                        .group = group_++});
    parameters_ += shape_numel(shape);
  }
  void linear(const std::string& name, int64_t out, int64_t in, Role role = Role::other) {
    const double std = 1.0 / std::sqrt(static_cast<double>(in));
    if (format_ == CheckpointFormat::mxfp8 && role != Role::other) {
      // value = e4m3 * 2^(u - 127): u aimed so that the RMS is about `std`.
      const int u = 127 + static_cast<int>(std::lround(std::log2(std / kMxfp8CodeRms)));
      const int64_t blocks = (in + 31) / 32;
      tensors_.push_back({.name = name, .dtype = DType::e4m3, .shape = {out, in}, .fill = Fill::mxfp8_codes,
                          .group = group_});
      tensors_.push_back({.name = name + "_scale_inv", .dtype = DType::u8, .shape = {out, blocks},
                          .fill = Fill::ue8m0_exponents, .code = static_cast<uint8_t>(u - 1), .group = group_++});
    } else if (format_ == CheckpointFormat::nvfp4 && role == Role::expert) {
      if (in % 16 != 0)
        throw_arg_error("config", "input widths of NVFP4 matrices that are multiples of 16 ('" + name + "')", in);
      // value = e2m1 * e4m3 * scale_2, RMS about `std`; with a code of 6 and a scale of 448
      // the largest value is 6 * 448 * scale_2, ModelOpt's scale_2 = amax / (6 * 448).
      const float global = static_cast<float>(std / (kE2m1CodeRms * kNvfp4ScaleRms));
      const std::string module = name.substr(0, name.size() - std::string("weight").size());
      tensors_.push_back({.name = name, .dtype = DType::u8, .shape = {out, in / 2}, .fill = Fill::e2m1_pairs,
                          .group = group_});
      tensors_.push_back({.name = name + "_scale", .dtype = DType::e4m3, .shape = {out, in / 16},
                          .fill = Fill::e4m3_scales, .group = group_});
      tensors_.push_back({.name = name + "_scale_2", .dtype = DType::f32, .shape = {}, .fill = Fill::constant,
                          .mean = global, .group = group_});
      // The activations' scale of a W4A4 GEMM (amax / (6 * 448)); activations of RMS ~1 here.
      tensors_.push_back({.name = module + "input_scale", .dtype = DType::f32, .shape = {},
                          .fill = Fill::constant, .mean = 8.0f / (6 * 448), .group = group_++});
    } else {
      add(name, {out, in}, std);
      return;
    }
    parameters_ += out * in;
  }
  void norm(const std::string& name, int64_t dim) { add(name, {dim}, 0.1); }

  const std::vector<PlannedTensor>& tensors() const { return tensors_; }
  int64_t parameters() const { return parameters_; }

 private:
  DType dtype_;
  CheckpointFormat format_;
  std::vector<PlannedTensor> tensors_;
  int64_t parameters_ = 0;
  int64_t group_ = 0;
};

void add_mlp(Planner& b, const std::string& prefix, int64_t hidden, int64_t inter) {
  b.linear(prefix + "gate_proj.weight", inter, hidden, Role::layer_linear);
  b.linear(prefix + "up_proj.weight", inter, hidden, Role::layer_linear);
  b.linear(prefix + "down_proj.weight", hidden, inter, Role::layer_linear);
}

// The vision tower and projector under the release's names: LayerNorm weights around 1,
// biases small, matrices 1/sqrt(in) (O(1) activations through every block), the patch
// embedding in f32 as released.
void add_vision(Planner& b, const VisionConfig& v, int64_t text_hidden) {
  const int64_t Hv = v.hidden_size, Hp = v.projector_hidden_size;
  const auto layer_norm = [&](const std::string& name) {
    b.add(name + ".weight", {Hv}, 0.1, 1.0);
    b.add(name + ".bias", {Hv}, 0.1);
  };
  const auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    b.linear(name + ".weight", out, in);
    b.add(name + ".bias", {out}, 0.1);
  };
  const std::string p = "vision_tower.vision_model.";
  b.add(p + "embeddings.patch_embedding.weight",
        {Hv, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size},
        1.0 / std::sqrt(static_cast<double>(v.patch_values())), 0, /*keep_f32=*/true);
  layer_norm(p + "pre_layrnorm");
  for (int64_t i = 0; i < v.num_layers; ++i) {
    const std::string layer = p + "encoder.layers." + std::to_string(i) + ".";
    layer_norm(layer + "layer_norm1");
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"})
      linear(layer + "self_attn." + proj, Hv, Hv);
    layer_norm(layer + "layer_norm2");
    linear(layer + "mlp.fc1", v.intermediate_size, Hv);
    linear(layer + "mlp.fc2", Hv, v.intermediate_size);
  }
  linear("multi_modal_projector.linear_1", Hp, Hv);
  linear("multi_modal_projector.linear_2", text_hidden, Hp);
  linear("patch_merge_mlp.linear_1", Hp, v.merge_window() * text_hidden);
  linear("patch_merge_mlp.linear_2", text_hidden, Hp);
}

// The processors' settings transformers' MiniMaxM3VL{Image,Video}Processor read (M3's values;
// patch, merge and temporal sizes and the video segment length from the vision config).
void write_processor_configs(const VisionConfig& v, const std::filesystem::path& dir) {
  using Json = nlohmann::json;
  const Json mean = {0.48145466, 0.4578275, 0.40821073}, std = {0.26862954, 0.26130258, 0.27577711};
  const Json image = {{"image_processor_type", "MiniMaxM3VLImageProcessor"},
                      {"do_convert_rgb", true},
                      {"do_resize", true},
                      {"resample", 3},  // bicubic
                      {"do_rescale", true},
                      {"rescale_factor", 1.0 / 255.0},
                      {"do_normalize", true},
                      {"image_mean", mean},
                      {"image_std", std},
                      {"min_pixels", 3136},
                      {"max_pixels", 451584},
                      {"size", {{"shortest_edge", 3136}, {"longest_edge", 451584}}},
                      {"patch_size", v.patch_size},
                      {"temporal_patch_size", v.temporal_patch_size},
                      {"merge_size", v.spatial_merge_size}};
  const Json video = {{"video_processor_type", "MiniMaxM3VLVideoProcessor"},
                      {"do_convert_rgb", true},
                      {"do_resize", true},
                      {"resample", 3},
                      {"do_rescale", true},
                      {"rescale_factor", 1.0 / 255.0},
                      {"do_normalize", true},
                      {"image_mean", mean},
                      {"image_std", std},
                      {"do_sample_frames", false},
                      {"fps", 1.0},
                      {"min_frames", 4},
                      {"max_frames", 768},
                      {"min_pixels", 3136},
                      {"max_pixels", 602112},
                      {"total_pixels", 45158400},
                      {"size", {{"height", 672}, {"width", 672}}},
                      {"patch_size", v.patch_size},
                      {"temporal_patch_size", v.temporal_patch_size},
                      {"merge_size", v.spatial_merge_size},
                      {"vision_segment_max_frames", v.segment_max_frames}};
  write_text_file((dir / "preprocessor_config.json").string(), image.dump(2) + "\n", "make-model");
  write_text_file((dir / "video_preprocessor_config.json").string(), video.dump(2) + "\n",
                  "make-model");
}

// Every tensor of the checkpoint, in the release's order.
Planner plan_checkpoint(const ModelConfig& c, const RandomCheckpointOptions& options) {
  c.validate();
  if (options.format != CheckpointFormat::floats && options.dtype != DType::bf16)
    throw_arg_error("dtype", "bf16 for the unquantized tensors of an MXFP8 / NVFP4 checkpoint",
                    dtype_name(options.dtype));
  if (options.dtype != DType::f32 && options.dtype != DType::bf16 && options.dtype != DType::f16)
    throw_arg_error("dtype", "f32, bf16 or f16", dtype_name(options.dtype));
  Planner b(options.dtype, options.format);
  const int64_t H = c.hidden_size, D = c.head_dim;
  const std::string p = "language_model.model.";
  b.add(p + "embed_tokens.weight", {c.vocab_size, H}, 1.0);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string layer = p + "layers." + std::to_string(i) + ".";
    b.norm(layer + "input_layernorm.weight", H);
    b.norm(layer + "post_attention_layernorm.weight", H);
    const std::string attn = layer + "self_attn.";
    b.linear(attn + "q_proj.weight", c.num_heads * D, H, Role::layer_linear);
    b.linear(attn + "k_proj.weight", c.num_kv_heads * D, H, Role::layer_linear);
    b.linear(attn + "v_proj.weight", c.num_kv_heads * D, H, Role::layer_linear);
    b.linear(attn + "o_proj.weight", H, c.num_heads * D, Role::layer_linear);
    b.norm(attn + "q_norm.weight", D);
    b.norm(attn + "k_norm.weight", D);
    if (c.sparse_layers[i]) {
      b.linear(attn + "index_q_proj.weight", c.index_heads * c.index_head_dim, H, Role::layer_linear);
      b.linear(attn + "index_k_proj.weight", c.index_head_dim, H, Role::layer_linear);
      b.norm(attn + "index_q_norm.weight", c.index_head_dim);
      b.norm(attn + "index_k_norm.weight", c.index_head_dim);
    }
    if (c.moe_layers[i]) {
      const std::string moe = layer + "block_sparse_moe.";
      b.add(moe + "gate.weight", {c.num_experts, H}, 1.0 / std::sqrt(static_cast<double>(H)), 0,
            /*keep_f32=*/true);
      b.add(moe + "e_score_correction_bias", {c.num_experts}, 0.05, 0, /*keep_f32=*/true);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        b.linear(expert + "w1.weight", c.moe_intermediate_size, H, Role::expert);
        b.linear(expert + "w3.weight", c.moe_intermediate_size, H, Role::expert);
        b.linear(expert + "w2.weight", H, c.moe_intermediate_size, Role::expert);
      }
      if (c.shared_intermediate_size > 0)
        add_mlp(b, moe + "shared_experts.", H, c.shared_intermediate_size);
    } else {
      add_mlp(b, layer + "mlp.", H, c.dense_intermediate_size);
    }
  }
  b.norm(p + "norm.weight", H);
  b.linear("language_model.lm_head.weight", c.vocab_size, H);
  if (c.vision) add_vision(b, *c.vision, H);
  return b;
}

// Writes `tensors` to `path`, each drawn from its own generator.
void write_file(const std::string& path, const std::vector<PlannedTensor>& tensors, uint64_t seed) {
  std::vector<SafetensorsEntry> entries;
  for (const PlannedTensor& t : tensors) entries.push_back({t.name, t.dtype, t.shape});
  Random random{0};
  save_safetensors_streamed(path, entries, {{"format", "pt"}},
                            [&](size_t index, int64_t offset, void* data, int64_t bytes) {
                              const PlannedTensor& t = tensors[index];
                              if (offset == 0) random.state = seed ^ name_hash(t.name);
                              draw(t, random, data, bytes);
                            });
}

// Shards of at most `shard_bytes` (a tensor larger than that gets a shard of its own; the
// tensors of one quantized weight stay together) and the index naming each tensor's shard.
void write_sharded(const std::filesystem::path& dir, const std::vector<PlannedTensor>& tensors,
                   int64_t shard_bytes, uint64_t seed) {
  std::vector<std::vector<PlannedTensor>> shards(1);
  int64_t size = 0;
  for (size_t i = 0; i < tensors.size();) {
    size_t end = i;
    int64_t bytes = 0;
    while (end < tensors.size() && tensors[end].group == tensors[i].group) bytes += tensors[end++].bytes();
    if (!shards.back().empty() && size + bytes > shard_bytes) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().insert(shards.back().end(), tensors.begin() + static_cast<std::ptrdiff_t>(i),
                         tensors.begin() + static_cast<std::ptrdiff_t>(end));
    size += bytes;
    i = end;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  char name[64];
  for (size_t i = 0; i < shards.size(); ++i) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    for (const PlannedTensor& t : shards[i]) {
      weight_map[t.name] = name;
      total += t.bytes();
    }
    write_file((dir / name).string(), shards[i], seed);
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_file((dir / "model.safetensors.index.json").string(), index.dump(2) + "\n",
                  "make-model");
}

}  // namespace

int64_t random_checkpoint_bytes(const ModelConfig& config, const RandomCheckpointOptions& options) {
  const Planner plan = plan_checkpoint(config, options);
  int64_t total = 0;
  for (const PlannedTensor& t : plan.tensors()) total += t.bytes();
  return total;
}

int64_t write_random_checkpoint(const ModelConfig& c, const std::string& dir_name,
                                const RandomCheckpointOptions& options) {
  namespace fs = std::filesystem;
  const Planner plan = plan_checkpoint(c, options);
  ModelConfig config = c;
  config.dtype = options.dtype == DType::f32 ? "float32" : options.dtype == DType::bf16 ? "bfloat16" : "float16";
  config.quantization = options.format == CheckpointFormat::nvfp4   ? "nvfp4"
                        : options.format == CheckpointFormat::mxfp8 ? "mxfp8"
                                                                    : "";
  const fs::path dir(dir_name);
  create_directories(dir_name, "make-model");
  int64_t total = 0;
  for (const PlannedTensor& t : plan.tensors()) total += t.bytes();
  std::error_code space_error;
  const fs::space_info space = fs::space(dir, space_error);
  if (!space_error && static_cast<uintmax_t>(total) > space.available)
    throw Error("make-model: the checkpoint needs " + std::to_string(total) + " bytes, but '" +
                dir_name + "' has " + std::to_string(space.available) + " bytes free");
  // A stale single file or index would shadow what is written now.
  std::error_code ignored;  // absent is fine; a failure shows when writing
  fs::remove(dir / "model.safetensors", ignored);
  fs::remove(dir / "model.safetensors.index.json", ignored);
  fs::remove(dir / "hf_quant_config.json", ignored);
  if (!c.vision) {  // a text-only model has no processors
    fs::remove(dir / "preprocessor_config.json", ignored);
    fs::remove(dir / "video_preprocessor_config.json", ignored);
  }
  if (c.vision) write_processor_configs(*c.vision, dir);
  const std::string config_json = model_config_to_json(config);
  write_text_file((dir / "config.json").string(), config_json, "make-model");
  if (options.format == CheckpointFormat::nvfp4) {
    // ModelOpt writes its quantization block to hf_quant_config.json too (what vLLM and
    // TensorRT-LLM read), under "quantization" with a "producer".
    nlohmann::json block = nlohmann::json::parse(config_json)["quantization_config"];
    block.erase("quant_method");
    const nlohmann::json quant = {{"producer", {{"name", "msa make-model"}}}, {"quantization", block}};
    write_text_file((dir / "hf_quant_config.json").string(), quant.dump(2) + "\n", "make-model");
  }
  if (options.shard_bytes > 0) write_sharded(dir, plan.tensors(), options.shard_bytes, options.seed);
  else write_file((dir / "model.safetensors").string(), plan.tensors(), options.seed);
  return plan.parameters();
}

namespace {

// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for
// U+0100 + n in byte order. Returns the UTF-8 text of the symbol of `byte`.
std::string byte_symbol(int byte) {
  int code = byte;
  if (!((byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174 && byte <= 255))) {
    int n = 0;
    for (int b = 0; b < byte; ++b)
      if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) ++n;
    code = 256 + n;
  }
  std::string text;
  if (code < 0x80) {
    text += static_cast<char>(code);
  } else {  // < 0x800 for every symbol
    text += static_cast<char>(0xC0 | (code >> 6));
    text += static_cast<char>(0x80 | (code & 0x3F));
  }
  return text;
}

constexpr const char* kBos = "]~!b[";
constexpr const char* kEos = "[e~[";
constexpr const char* kPad = "]!p~[";
constexpr const char* kRole = "]~b]";
constexpr const char* kImage = "]<]image[>[";
constexpr const char* kVideo = "]<]video[>[";
constexpr const char* kImageStart = "]<]start of image[>[";
constexpr const char* kImageEnd = "]<]end of image[>[";

// M3's chat layout: ]~!b[ then ]~b]ROLE\nCONTENT[e~[\n per message, assistant as "ai".
// CONTENT is a string, or a list of items as transformers' multimodal messages have them:
// {"type": "image"} and {"type": "video"} print their marker (which MiniMaxM3VLProcessor,
// and msa run --image, expand into the placeholder tokens), {"type": "text"} its text.
// (No newline right after a block tag: transformers renders with trim_blocks.)
constexpr const char* kChatTemplate =
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}]~b]ai\n"
    "{% else %}]~b]{{ message['role'] }}\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}]<]image[>[{% elif item['type'] == 'video' %}]<]video[>["
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "[e~[\n{% endfor %}{% if add_generation_prompt %}]~b]ai\n{% endif %}";

}  // namespace

void write_random_tokenizer(const ModelConfig& c, const std::string& dir_name) {
  namespace fs = std::filesystem;
  using Json = nlohmann::json;
  const int64_t V = c.vocab_size;
  const int32_t eos = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
  const bool bos_fixed = c.bos_token_id >= 0 && c.bos_token_id < V;
  const bool eos_fixed = eos >= 0 && eos < V && eos != c.bos_token_id;
  const int64_t base = 256 + 4;
  if (V < base)
    throw_arg_error("vocab_size", "at least " + std::to_string(base) + " for a byte-level tokenizer", V);

  // id -> token; bos/eos at the config's ids, the rest filled from the lowest free id.
  std::vector<std::string> tokens(static_cast<size_t>(V));
  std::map<std::string, int32_t> ids;
  const auto place = [&](const std::string& token, int64_t id) {
    tokens[static_cast<size_t>(id)] = token;
    ids[token] = static_cast<int32_t>(id);
  };
  if (bos_fixed) place(kBos, c.bos_token_id);
  if (eos_fixed) place(kEos, eos);
  // The vision placeholders and image brackets at the config's ids (validated: in the
  // vocabulary and distinct from each other).
  std::vector<std::string> vision_tokens;
  if (c.vision) {
    const VisionConfig& v = *c.vision;
    for (const auto& [token, id] : {std::pair{kImage, v.image_token_id}, std::pair{kVideo, v.video_token_id},
                                    std::pair{kImageStart, v.vision_start_token_id},
                                    std::pair{kImageEnd, v.vision_end_token_id}})
      if (id < V && tokens[static_cast<size_t>(id)].empty()) {
        place(token, id);
        vision_tokens.push_back(token);
      }
  }
  int64_t next = 0;
  const auto append = [&](const std::string& token) {
    while (next < V && !tokens[static_cast<size_t>(next)].empty()) ++next;
    if (next == V) return false;
    place(token, next);
    return true;
  };
  std::vector<std::string> specials = {kPad, kRole};
  if (!bos_fixed) specials.push_back(kBos);
  if (!eos_fixed) specials.push_back(kEos);
  for (const std::string& token : specials) append(token);
  for (int byte = 0; byte < 256; ++byte) append(byte_symbol(byte));

  // Merges: words of lowercase letters (and a leading space) grown one letter at a time,
  // shortest first, until the vocabulary is full.
  Json merges = Json::array();
  std::vector<std::string> level = {byte_symbol(' ')};
  for (char letter = 'a'; letter <= 'z'; ++letter) level.push_back(std::string(1, letter));
  bool full = static_cast<int64_t>(ids.size()) == V;
  while (!full && !level.empty()) {
    std::vector<std::string> grown;
    for (const std::string& word : level) {
      for (char letter = 'a'; letter <= 'z' && !full; ++letter) {
        const std::string merged = word + letter;
        if (ids.count(merged)) continue;
        append(merged);
        merges.push_back({word, std::string(1, letter)});
        grown.push_back(merged);
        full = static_cast<int64_t>(ids.size()) == V;
      }
      if (full) break;
    }
    level = std::move(grown);
  }

  Json vocab = Json::object();
  for (const auto& [token, id] : ids) vocab[token] = id;
  Json added = Json::array();
  std::vector<std::string> special_tokens = {kPad, kRole, kEos, kBos};
  special_tokens.insert(special_tokens.end(), vision_tokens.begin(), vision_tokens.end());
  for (const std::string& token : special_tokens)
    added.push_back({{"id", ids.at(token)}, {"content", token}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", true}});
  const Json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                           {"trim_offsets", true}, {"use_regex", true}};
  Json post_processor = nullptr;
  if (bos_fixed) {
    const Json bos_piece = {{"SpecialToken", {{"id", kBos}, {"type_id", 0}}}};
    post_processor = {
        {"type", "TemplateProcessing"},
        {"single", {bos_piece, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {bos_piece, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens",
         {{kBos, {{"id", kBos}, {"ids", {c.bos_token_id}}, {"tokens", {kBos}}}}}}};
  }
  const Json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", post_processor},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
        {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}}};
  const Json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                       {"bos_token", kBos},
                       {"eos_token", kEos},
                       {"pad_token", kPad},
                       {"clean_up_tokenization_spaces", false},
                       {"model_max_length", 1048576},
                       {"chat_template", kChatTemplate}};
  const fs::path dir(dir_name);
  create_directories(dir_name, "make-model");
  write_text_file((dir / "tokenizer.json").string(), tokenizer.dump(2) + "\n", "make-model");
  write_text_file((dir / "tokenizer_config.json").string(), config.dump(2) + "\n", "make-model");
}

}  // namespace msa
