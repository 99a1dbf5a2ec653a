// msa bench-model --device cuda: the text model's CUDA forward (src/model/gpu) per layer, at
// long contexts: prefill (chunked over the paged cache) and decode (one token per step),
// each layer's device time split into attention, indexer, FFN (MoE or dense MLP) and the
// rest (CUDA events around each part, src/model/gpu/cuda_model.h), with the MSA layers run
// a second time with dense attention for comparison.
//
// The model: a checkpoint (--model DIR), or a preset with random weights made on the device
// (--config, default m3-layer widened to M3's 128 experts and three layers: one dense
// attention + dense MLP layer, two MSA + MoE layers; no checkpoint needs writing).
//
// Per context N: (1) a warm-up step on a scratch request (buffers and GEMM plans);
// (2) MSA prefill of N tokens in --chunk steps, summed; (3) --decode-steps decode steps
// (after one warm-up step), averaged; (4) the same decode steps with dense attention in the
// MSA layers; (5) for N <= --dense-prefill-max, the dense prefill too. The prefill times
// include the launch gaps and, where the MoE runs per-expert GEMMs (--moe-kernel), its host
// round trip per layer (the expert row counts);
// the decode steps are eager launches (the per-part events need them). Then (6) decode
// steps at batch 1, 32 (--decode-batches) over requests of --batch-context tokens, host wall
// time per step with CUDA decode graphs on and off (--decode-graphs; CudaModel's per-bucket
// graphs, which take no profile): what a serving step costs, launch gaps included.
// Decode rows of the MSA mode also give each layer's bandwidth floor at batch 1: the bytes a
// decoded token must read in that layer (its weights as stored on the device, with K of the
// E routed experts; the KV it attends: an MSA layer's index keys over the context plus the
// selected blocks' K and V per KV head, a dense layer's every K and V) at the streaming-read
// ceiling measured in the same run (issue target: the layer at >= 70% of its floor).
// --dense-engine picks the kernel of every dense attention (the dense layers, and the MSA
// layers in the dense comparison): ours (msa), cuDNN's SDPA over the paged cache (cudnn) or
// over K/V gathered out of it (cudnn-gathered), or auto; the report names it, counts the calls
// each engine really ran, and gives the gathered engine's K/V gather time (inside the
// attention time). With cuDNN, the warm-up prefills the whole context so that every bucketed
// cuDNN plan the timed steps need is built before them.
#include <cstdint>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda/common.h"
#include "cli_args.h"
#include "dense_engine_flag.h"
#include "bench_cuda/bench_kernels.h"
#include "model/gpu/cuda_model.h"
#include "model/gpu/expert_weights.h"
#include "model/layer_layout.h"
#include "msa/model.h"
#include "msa/model_weights.h"
#include "msa/safetensors.h"

namespace msa::cli {
namespace {

using msa::cuda::DeviceBuffer;
using model::gpu::CudaModel;
using model::gpu::DeviceWeights;
using model::gpu::kLayerParts;
using model::gpu::LayerPart;
using model::gpu::ExpertWeights;
using model::gpu::MoeKernel;
using model::gpu::StepProfile;

constexpr const char* kUsage =
    "usage: msa bench-model --device cuda [--model DIR | --config m3-layer|small|tiny]\n"
    "                       [--experts 128] [--layers 3] [--dense-layers 1] [--seed S]\n"
    "                       [--contexts 32768,131072,1048576] [--chunk 32768]\n"
    "                       [--decode-steps 8] [--dense-prefill-max 131072] [--no-dense]\n"
    "                       [--decode-batches 1,32] [--batch-context 8192]\n"
    "                       [--decode-graphs on|off|both] [--dense-engine auto|msa|cudnn|cudnn-gathered]\n"
    "                       [--moe-kernel auto|small|grouped|per-expert] [--expert-weights bf16|mxfp8|nvfp4]\n"
    "                       [--json FILE]\n"
    "  per-layer device time of the CUDA text model's prefill (N tokens in --chunk steps)\n"
    "  and decode (ms per token) at each context N, split into attention, indexer, ffn\n"
    "  (MoE or dense MLP) and other; MSA layers also with dense attention (decode always,\n"
    "  prefill where N <= --dense-prefill-max; --no-dense skips the comparison).\n"
    "  --dense-engine: the kernel of dense attention: ours (msa), cuDNN's SDPA over the paged\n"
    "  cache (cudnn) or over K/V gathered out of it (cudnn-gathered), or auto (gathered cuDNN\n"
    "  for steps of >= 64 queries, ours for decode); with cuDNN the warm-up prefills all N\n"
    "  tokens (plan builds).\n"
    "  --moe-kernel: the routed experts' GEMMs: small (CUDA-core, <= 64 token x expert entries),\n"
    "  grouped (one tensor-core launch per projection), per-expert (cuBLASLt per expert, one\n"
    "  host sync per MoE layer), or auto (by step size); each row names the kernels that ran.\n"
    "  --expert-weights: the preset's routed experts as bf16, or kept quantized on the device\n"
    "  (MXFP8 e4m3 codes + UE8M0 scales per 32, NVFP4 e2m1 + e4m3 scales per 16 + a global\n"
    "  scale), random codes; the experts' kernels widen them in registers.\n"
    "  --config makes random weights on the device (--experts, --layers, --dense-layers\n"
    "  override the preset; defaults: m3-layer with 128 experts, 1 dense + 2 MSA layers).\n"
    "  Decode steps of every --decode-batches size over requests of --batch-context tokens:\n"
    "  host wall ms per step with CUDA decode graphs on and off (--decode-graphs both, the\n"
    "  default; --decode-batches 0 skips them).\n"
    "  (msa bench-model --vision --help: the vision tower's bench.)\n";

struct Options {
  std::string model_dir, preset = "m3-layer";
  int64_t experts = 128, layers = 3, dense_layers = 1;
  uint64_t seed = 1;
  std::vector<int64_t> contexts;
  int64_t chunk = 32768, decode_steps = 8, dense_prefill_max = 131072;
  bool dense = true;
  std::vector<int64_t> decode_batches;  // empty: no graph comparison
  int64_t batch_context = 8192;
  std::vector<bool> graph_modes;  // decode graphs off and / or on
  DenseAttentionEngine dense_engine = DenseAttentionEngine::automatic;
  MoeKernel moe_kernel = MoeKernel::automatic;
  ExpertWeights expert_weights = ExpertWeights::bf16;  // a preset's routed experts
  std::string json_path;
};

Options parse_options(Args& args) {
  Options o;
  const std::string device = args.get_string("device", "cuda");
  if (device != "cuda") throw UsageError("--device: expected cuda (the CPU runtime: msa run), got \"" + device + "\"");
  o.model_dir = args.get_string("model", "");
  const bool preset_given = args.has("config");
  o.preset = args.get_string("config", o.preset);
  if (!o.model_dir.empty() && preset_given) throw UsageError("give --model or --config, not both");
  o.experts = args.get_int("experts", static_cast<int>(o.experts), 1, 1 << 16);
  o.layers = args.get_int("layers", static_cast<int>(o.layers), 1, 1 << 16);
  o.dense_layers = args.get_int("dense-layers", static_cast<int>(o.dense_layers), 0, 1 << 16);
  o.seed = args.get_seed("seed", 1);
  o.contexts = args.get_positive_list("contexts", "32768,131072,1048576", int64_t{1} << 22);
  o.chunk = args.get_int("chunk", static_cast<int>(o.chunk), 1, 1 << 22);
  o.decode_steps = args.get_int("decode-steps", static_cast<int>(o.decode_steps), 1, 1 << 20);
  o.dense_prefill_max =
      args.get_int("dense-prefill-max", static_cast<int>(o.dense_prefill_max), 0, 1 << 22);
  o.dense = !args.get_switch("no-dense");
  const std::string batches = args.get_string("decode-batches", "1,32");
  if (batches != "0") o.decode_batches = args.get_positive_list("decode-batches", "1,32", 256);
  o.batch_context = args.get_int("batch-context", static_cast<int>(o.batch_context), 1, 1 << 22);
  const std::string graphs = args.get_string("decode-graphs", "both");
  if (graphs == "both") o.graph_modes = {false, true};
  else if (graphs == "on") o.graph_modes = {true};
  else if (graphs == "off") o.graph_modes = {false};
  else throw UsageError("--decode-graphs: expected on, off or both, got \"" + graphs + "\"");
  o.dense_engine = read_dense_engine_flag(args, true);
  const std::string moe_kernel = args.get_string("moe-kernel", "auto");
  try {
    o.moe_kernel = model::gpu::parse_moe_kernel(moe_kernel, "--moe-kernel");
  } catch (const Error&) {
    throw UsageError("--moe-kernel: expected auto, small, grouped or per-expert, got \"" + moe_kernel + "\"");
  }
  const std::string experts_format = args.get_string("expert-weights", "bf16");
  if (experts_format == "bf16") o.expert_weights = ExpertWeights::bf16;
  else if (experts_format == "mxfp8") o.expert_weights = ExpertWeights::mxfp8;
  else if (experts_format == "nvfp4") o.expert_weights = ExpertWeights::nvfp4;
  else throw UsageError("--expert-weights: expected bf16, mxfp8 or nvfp4, got \"" + experts_format + "\"");
  if (!o.model_dir.empty() && args.has("expert-weights"))
    throw UsageError("--expert-weights: a preset's random experts; a checkpoint (--model) brings its own");
  o.json_path = args.get_string("json", "");
  if (o.experts < 1 || o.layers < 1 || o.dense_layers < 0 || o.dense_layers > o.layers)
    throw UsageError("--experts, --layers: expected positive counts, --dense-layers in [0, layers]");
  if (o.chunk < 1 || o.decode_steps < 1)
    throw UsageError("--chunk, --decode-steps: expected positive counts");
  return o;
}

ModelConfig preset_config(const Options& o) {
  ModelConfig c = model_config_preset(o.preset);
  c.num_experts = o.experts;
  c.experts_per_token = std::min(c.experts_per_token, c.num_experts);
  c = with_layers(c, o.layers, o.dense_layers);
  c.validate();
  return c;
}

// Random weights made on the device: matrices normal(0, 1/sqrt(in)) (the embedding
// normal(0, 1)), norm weights 0 (Gemma: scale 1), the router normal(0, 1/sqrt(H)) and a
// small correction bias from the host.
void fill_random(const ModelConfig& c, DeviceWeights& w, uint64_t seed, cudaStream_t stream) {
  uint64_t next_seed = seed * 1000003;
  auto matrix = [&](DeviceBuffer& buffer, int64_t in) {
    cuda::bench::fill_normal_bf16(buffer.as<uint16_t>(), buffer.bytes() / 2, next_seed++,
                                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))), stream);
  };
  auto zero = [&](DeviceBuffer& buffer) {
    if (buffer.bytes()) MSA_CUDA_CHECK(cudaMemsetAsync(buffer.get(), 0, buffer.bytes(), stream));
  };
  std::mt19937_64 rng(seed);
  auto host_normal = [&](DeviceBuffer& buffer, double stddev) {
    std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
    std::vector<float> values(buffer.bytes() / sizeof(float));
    for (float& v : values) v = dist(rng);
    MSA_CUDA_CHECK(cudaMemcpy(buffer.get(), values.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  };
  // Quantized experts (--expert-weights): codes without NaN and scales that keep the weights
  // O(0.01-1): MXFP8 e4m3 codes with random signs times 2^-9..2^-5 (UE8M0 118..122); NVFP4
  // e2m1 pairs (every byte is two valid codes) times positive e4m3 scales 2^-3..2^0 (0x20..0x38)
  // times a global scale of 1/64 per output row.
  auto quantized_experts = [&](model::gpu::DeviceLayer& l) {
    const bool mx = l.expert_format == ExpertWeights::mxfp8;
    for (DeviceBuffer* codes : {&l.experts_gate_up, &l.experts_down})
      cuda::bench::fill_uniform_bytes(codes->as<uint8_t>(), codes->bytes(), next_seed++, 0, mx ? 0x7e : 0xff,
                                      mx, stream);
    for (DeviceBuffer* scales : {&l.experts_gate_up_scales, &l.experts_down_scales})
      cuda::bench::fill_uniform_bytes(scales->as<uint8_t>(), scales->bytes(), next_seed++, mx ? 118 : 0x20,
                                      mx ? 122 : 0x38, false, stream);
    if (!mx)
      for (DeviceBuffer* global : {&l.experts_gate_up_global, &l.experts_down_global}) {
        const std::vector<float> values(global->bytes() / sizeof(float), 1.0f / 64);
        MSA_CUDA_CHECK(cudaMemcpy(global->get(), values.data(), global->bytes(), cudaMemcpyHostToDevice));
      }
  };
  const int64_t H = c.hidden_size;
  cuda::bench::fill_normal_bf16(w.embed_tokens.as<uint16_t>(), w.embed_tokens.bytes() / 2, next_seed++,
                                1.0f, stream);
  matrix(w.lm_head, H);
  zero(w.final_norm);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    model::gpu::DeviceLayer& l = w.layers[layer];
    for (DeviceBuffer* norm : {&l.input_norm, &l.post_attention_norm, &l.q_norm, &l.k_norm,
                               &l.index_q_norm, &l.index_k_norm})
      zero(*norm);
    matrix(l.qkv, H);
    matrix(l.o_proj, c.num_heads * c.head_dim);
    if (c.moe_layers[layer]) {
      host_normal(l.router, 1.0 / std::sqrt(static_cast<double>(H)));
      host_normal(l.router_bias, 0.01);
      if (l.expert_format == ExpertWeights::bf16) {
        matrix(l.experts_gate_up, H);
        matrix(l.experts_down, c.moe_intermediate_size);
      } else {
        quantized_experts(l);
      }
      if (l.shared_expert.inter > 0) {
        matrix(l.shared_expert.gate_up, H);
        matrix(l.shared_expert.down, l.shared_expert.inter);
      }
    } else {
      matrix(l.mlp.gate_up, H);
      matrix(l.mlp.down, l.mlp.inter);
    }
  }
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

struct Measurement {
  int64_t context = 0;
  std::string mode, phase;  // "msa" | "dense"; "prefill" | "decode"
  StepProfile profile;
  double scale = 1;          // 1 for prefill (sums), 1/steps for decode (per token)
  double wall_ms = 0;        // host wall time of the steps, scaled the same way
  int64_t steps = 0;
  std::string moe_kernels;   // the routed-expert kernels that ran (moe_kernels_between)
};

// The MoE kernels run between two snapshots of CudaModel::moe_kernel_calls() ("small",
// "grouped+per-expert", ...; "-" where no MoE layer ran).
std::string moe_kernels_between(const CudaModel::MoeKernelCalls& before, const CudaModel::MoeKernelCalls& after) {
  std::string names;
  auto add = [&](int64_t ran, MoeKernel kernel) {
    if (ran <= 0) return;
    if (!names.empty()) names += '+';
    names += model::gpu::moe_kernel_name(kernel);
  };
  add(after.small - before.small, MoeKernel::small);
  add(after.grouped - before.grouped, MoeKernel::grouped);
  add(after.per_expert - before.per_expert, MoeKernel::per_expert);
  return names.empty() ? "-" : names;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> dist(3, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t& t : tokens) t = dist(rng);
  return tokens;
}

// One row of the decode-graph comparison: host wall time per decode step.
struct GraphRow {
  int64_t batch = 0, context = 0;  // requests per step; the first request's context after the steps
  bool graphs = false;
  double step_ms = 0;
  int64_t steps = 0;
  int64_t captured = 0;  // decode graphs captured by then (0 with graphs off)
  std::string moe_kernels;  // the routed-expert kernels that ran (or were captured)
};

class Runner {
 public:
  Runner(CudaModel& model, KvCache& cache, const Options& options)
      : model_(model), cache_(cache), options_(options), rng_(options.seed) {}

  // Prefills `n` tokens into `sequence` in chunks; returns the summed profile.
  Measurement prefill(SequenceCache& sequence, int64_t n, const std::string& mode) {
    Measurement m{.context = n, .mode = mode, .phase = "prefill", .profile = {}, .scale = 1,
                  .wall_ms = 0, .steps = 0, .moe_kernels = {}};
    const CudaModel::MoeKernelCalls before = model_.moe_kernel_calls();
    const std::vector<int32_t> tokens = random_tokens(n, model_.config().vocab_size, rng_);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t begin = 0; begin < n; begin += options_.chunk) {
      const int64_t count = std::min(options_.chunk, n - begin);
      const ForwardRequest request{.sequence = &sequence,
                                   .tokens = std::span(tokens).subspan(begin, count),
                                   .all_logits = false};
      model_.forward({&request, 1}, cache_, nullptr, &m.profile);
      ++m.steps;
      std::fprintf(stderr, "\r[bench-model]   %s prefill %lld / %lld tokens", mode.c_str(),
                   static_cast<long long>(begin + count), static_cast<long long>(n));
    }
    std::fprintf(stderr, "\n");
    m.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    m.moe_kernels = moe_kernels_between(before, model_.moe_kernel_calls());
    return m;
  }

  // One warm-up step, then `steps` timed decode steps of one token.
  Measurement decode(SequenceCache& sequence, int64_t context, const std::string& mode) {
    Measurement m{.context = context, .mode = mode, .phase = "decode", .profile = {}, .scale = 1,
                  .wall_ms = 0, .steps = 0, .moe_kernels = {}};
    const CudaModel::MoeKernelCalls before = model_.moe_kernel_calls();
    auto step = [&](StepProfile* profile) {
      const std::vector<int32_t> token = random_tokens(1, model_.config().vocab_size, rng_);
      const ForwardRequest request{.sequence = &sequence, .tokens = token, .all_logits = false};
      model_.forward({&request, 1}, cache_, nullptr, profile);
    };
    step(nullptr);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < options_.decode_steps; ++i) step(&m.profile);
    m.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    m.steps = options_.decode_steps;
    m.scale = 1.0 / static_cast<double>(options_.decode_steps);
    m.moe_kernels = moe_kernels_between(before, model_.moe_kernel_calls());
    return m;
  }

  // Decode steps of one token for every sequence: two untimed ones (buffers, GEMM plans, a
  // decode graph's capture), then --decode-steps timed ones; host wall ms per step (the
  // step returns after its logits are on the host).
  GraphRow decode_batch(std::vector<SequenceCache>& sequences, bool graphs) {
    model_.set_decode_graphs(graphs);
    const CudaModel::MoeKernelCalls before = model_.moe_kernel_calls();  // a graph's MoE counts at its capture
    std::vector<std::vector<int32_t>> tokens(sequences.size());
    auto step = [&] {
      std::vector<ForwardRequest> requests;
      for (size_t r = 0; r < sequences.size(); ++r) {
        tokens[r] = random_tokens(1, model_.config().vocab_size, rng_);
        requests.push_back({.sequence = &sequences[r], .tokens = tokens[r], .all_logits = false});
      }
      model_.forward(requests, cache_);
    };
    step();
    step();
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < options_.decode_steps; ++i) step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    GraphRow row{.batch = static_cast<int64_t>(sequences.size()), .context = sequences[0].length, .graphs = graphs,
                 .step_ms = ms / static_cast<double>(options_.decode_steps), .steps = options_.decode_steps,
                 .captured = model_.captured_decode_graphs(),
                 .moe_kernels = moe_kernels_between(before, model_.moe_kernel_calls())};
    model_.set_decode_graphs(false);
    return row;
  }

  // Grows the model's buffers and GEMM plans to the chunk's size outside the timings.
  void warm_up(int64_t context) {
    SequenceCache scratch;
    const bool cudnn_plans = options_.dense_engine != DenseAttentionEngine::msa && dense_attention_cudnn_built();
    const int64_t n = cudnn_plans ? context : std::min(options_.chunk, context);
    prefill(scratch, n, "warm-up");
    decode(scratch, n, "warm-up");
    cache_.release(scratch);
  }

 private:
  CudaModel& model_;
  KvCache& cache_;
  const Options& options_;
  std::mt19937_64 rng_;
};

std::string layer_kind(const ModelConfig& c, int64_t layer) {
  return std::string(c.sparse_layers[layer] ? "MSA" : "dense attn") + " + " +
         (c.moe_layers[layer] ? "MoE" : "MLP");
}

// Bytes one decoded token (batch 1) must read in `layer` at `context` keys: see the header.
// KV in bf16 (the bench's cache), index keys one head of Di channels.
double decode_read_bytes(const ModelConfig& c, const model::gpu::DeviceLayer& w, int64_t layer,
                         int64_t context) {
  double bytes = static_cast<double>(w.input_norm.bytes() + w.post_attention_norm.bytes() + w.qkv.bytes() +
                                     w.o_proj.bytes() + w.q_norm.bytes() + w.k_norm.bytes() +
                                     w.index_q_norm.bytes() + w.index_k_norm.bytes());
  if (c.moe_layers[layer]) {
    // Codes, plus the scales of quantized experts (the NVFP4 global scales: 4 bytes per row).
    const double per_expert =
        static_cast<double>(w.experts_gate_up.bytes() + w.experts_down.bytes() + w.experts_gate_up_scales.bytes() +
                            w.experts_down_scales.bytes() + w.experts_gate_up_global.bytes() +
                            w.experts_down_global.bytes()) /
        static_cast<double>(w.experts);
    bytes += static_cast<double>(w.router.bytes() + w.router_bias.bytes()) +
             per_expert * static_cast<double>(std::min(c.experts_per_token, w.experts)) +
             static_cast<double>(w.shared_expert.gate_up.bytes() + w.shared_expert.down.bytes());
  } else {
    bytes += static_cast<double>(w.mlp.gate_up.bytes() + w.mlp.down.bytes());
  }
  const double kv_row = 2.0 * static_cast<double>(c.num_kv_heads * c.head_dim) * 2;  // K and V, bf16
  if (c.sparse_layers[layer]) {
    const int64_t selected = std::min<int64_t>(context, int64_t{c.topk_blocks} * c.block_size);
    bytes += static_cast<double>(context * c.index_head_dim) * 2 + kv_row * static_cast<double>(selected);
  } else {
    bytes += kv_row * static_cast<double>(context);
  }
  return bytes;
}

// The floor in ms of a decode row's layer at `read_gbs`, or NaN where none is given (prefill,
// the dense comparison).
double floor_ms(const Measurement& m, const ModelConfig& c, const DeviceWeights& w, int64_t layer,
                double read_gbs) {
  if (m.phase != "decode" || m.mode != "msa" || !(read_gbs > 0)) return NAN;
  return decode_read_bytes(c, w.layers[static_cast<size_t>(layer)], layer, m.context) / (read_gbs * 1e9) * 1e3;
}

void print_table(const std::vector<Measurement>& rows, const ModelConfig& c, const DeviceWeights& w,
                 double read_gbs) {
  std::printf(
      "\n| N | phase | attention in MSA layers | layer | kind | attention ms | indexer ms | ffn ms | "
      "other ms | layer ms | floor ms | of floor | steps | step wall ms | MoE kernel |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Measurement& m : rows) {
    for (int64_t layer = 0; layer < c.num_layers; ++layer) {
      const auto& t = m.profile.layer_ms.at(static_cast<size_t>(layer));
      double total = 0;
      for (double v : t) total += v;
      const double floor = floor_ms(m, c, w, layer, read_gbs);
      char floor_cells[64] = "- | -";
      if (!std::isnan(floor))
        std::snprintf(floor_cells, sizeof floor_cells, "%.3f | %.0f%%", floor, 100.0 * floor / (total * m.scale));
      std::printf("| %lld | %s | %s | %lld | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %s | %lld | %.2f | %s |\n",
                  static_cast<long long>(m.context),
                  m.phase == "prefill" ? "prefill (sum)" : "decode (per token)", m.mode.c_str(),
                  static_cast<long long>(layer), layer_kind(c, layer).c_str(), t[0] * m.scale,
                  t[1] * m.scale, t[2] * m.scale, t[3] * m.scale, total * m.scale, floor_cells,
                  static_cast<long long>(m.steps), m.wall_ms / static_cast<double>(std::max<int64_t>(m.steps, 1)),
                  c.moe_layers[layer] ? m.moe_kernels.c_str() : "-");
    }
  }
}

void write_json(const std::string& path, const std::vector<Measurement>& rows, const ModelConfig& c,
                const DeviceWeights& w, double read_gbs, const std::string& gpu, const char* dense_engine) {
  FILE* out = std::fopen(path.c_str(), "w");
  if (!out) throw Error("--json: cannot write " + path);
  for (const Measurement& m : rows)
    for (int64_t layer = 0; layer < c.num_layers; ++layer) {
      const auto& t = m.profile.layer_ms.at(static_cast<size_t>(layer));
      const double floor = floor_ms(m, c, w, layer, read_gbs);
      char floor_field[48] = "null";
      if (!std::isnan(floor)) std::snprintf(floor_field, sizeof floor_field, "%.6f", floor);
      std::fprintf(out,
                   "{\"bench\":\"model\",\"gpu\":\"%s\",\"context\":%lld,\"phase\":\"%s\",\"attention_mode\":\"%s\","
                   "\"layer\":%lld,\"kind\":\"%s\",\"attention_ms\":%.6f,\"indexer_ms\":%.6f,"
                   "\"ffn_ms\":%.6f,\"other_ms\":%.6f,\"per\":\"%s\",\"steps\":%lld,"
                   "\"hidden\":%lld,\"experts\":%lld,\"chunk_wall_ms\":%.3f,\"dense_engine\":\"%s\",\"floor_ms\":%s,"
                   "\"read_gbs\":%.1f,\"moe_kernel\":\"%s\",\"kv_gather_ms\":%.6f,\"expert_weights\":\"%s\"}\n",
                   gpu.c_str(), static_cast<long long>(m.context), m.phase.c_str(), m.mode.c_str(),
                   static_cast<long long>(layer), layer_kind(c, layer).c_str(), t[0] * m.scale,
                   t[1] * m.scale, t[2] * m.scale, t[3] * m.scale,
                   m.phase == "prefill" ? "prefill" : "token", static_cast<long long>(m.steps),
                   static_cast<long long>(c.hidden_size), static_cast<long long>(c.num_experts),
                   m.wall_ms / static_cast<double>(std::max<int64_t>(m.steps, 1)), dense_engine, floor_field,
                   read_gbs, c.moe_layers[layer] ? m.moe_kernels.c_str() : "-", m.profile.kv_gather_ms * m.scale,
                   c.moe_layers[layer] ? model::gpu::expert_weights_name(w.layers[static_cast<size_t>(layer)].expert_format)
                                       : "-");
    }
  std::fclose(out);
}

int run(Args& args) {
  if (args.get_switch("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const Options o = parse_options(args);
  args.finish();
  if (cuda::device_count() < 1) throw Error("--device cuda: no CUDA device is visible");
  const bench_cuda::Machine machine = bench_cuda::describe_machine();

  // ---- the model ----
  std::shared_ptr<CudaModel> model;
  std::string source;
  if (!o.model_dir.empty()) {
    // As Model::load(dir, Device::cuda) builds it: an MXFP8 / NVFP4 checkpoint's routed experts
    // stay quantized on the device.
    const Model host(load_model_config(o.model_dir), SafetensorsModel::open(o.model_dir),
                     WeightLoadOptions{.routed_experts = RoutedExperts::quantized});
    model = model::gpu::make_cuda_model(host.config(), host.weights());
    source = o.model_dir;
  } else {
    const ModelConfig c = preset_config(o);
    DeviceWeights weights = model::gpu::allocate_device_weights(c, o.expert_weights);
    model = std::make_shared<CudaModel>(c, std::move(weights));
    fill_random(c, model->weights(), o.seed, static_cast<cudaStream_t>(model->stream()));
    source = o.preset + " preset, random device weights";
  }
  const ModelConfig& c = model->config();
  const int64_t longest = *std::max_element(o.contexts.begin(), o.contexts.end());
  // The longest context, its decode steps (MSA and dense, each with a warm-up), and the
  // warm-up request, with a page of slack each.
  int64_t batch_tokens = 0;  // the graph comparison's requests, all at once
  for (int64_t b : o.decode_batches)
    batch_tokens = std::max(batch_tokens, b * (o.batch_context + 2 * (o.decode_steps + 2) + c.block_size));
  const int64_t cache_tokens = std::max(longest + 2 * (o.decode_steps + 1) + std::min(o.chunk, longest),
                                        batch_tokens) +
                               3 * c.block_size;
  KvCache cache(c, (cache_tokens + c.block_size - 1) / c.block_size, DType::bf16, Device::cuda);

  std::printf("msa bench-model: cuda, %s (sm_%d%d, %d SMs, %.1f GiB); %s\n", machine.gpu.c_str(),
              machine.cc_major, machine.cc_minor, machine.sms, machine.memory_gib, machine.date.c_str());
  std::printf("model: %s; hidden %lld, heads %lld/%lld x %lld, %lld layers (%lld dense), %lld experts "
              "(top-%lld, I %lld, shared %lld), dense MLP %lld, vocab %lld; MSA block %d, top-%d; "
              "KV cache %lld tokens bf16 (%.2f GiB)\n",
              source.c_str(), static_cast<long long>(c.hidden_size), static_cast<long long>(c.num_heads),
              static_cast<long long>(c.num_kv_heads), static_cast<long long>(c.head_dim),
              static_cast<long long>(c.num_layers),
              static_cast<long long>(std::count(c.sparse_layers.begin(), c.sparse_layers.end(), false)),
              static_cast<long long>(c.num_experts), static_cast<long long>(c.experts_per_token),
              static_cast<long long>(c.moe_intermediate_size), static_cast<long long>(c.shared_intermediate_size),
              static_cast<long long>(c.dense_intermediate_size), static_cast<long long>(c.vocab_size),
              c.block_size, c.topk_blocks, static_cast<long long>(cache.num_pages() * cache.page_size()),
              static_cast<double>(KvCache::bytes_per_page(c, DType::bf16) * cache.num_pages()) / (1 << 30));
  std::printf("times: CUDA events around each part of each layer (attention = attention kernel; "
              "indexer = indexer kernel; ffn = post-attention norm + MoE/MLP; other = input norm, "
              "projections, q/k norm + RoPE + cache append, o_proj); prefill = sum over the %lld-token "
              "chunks, decode = mean over %lld steps of one token\n",
              static_cast<long long>(o.chunk), static_cast<long long>(o.decode_steps));
  std::fflush(stdout);

  model->set_dense_attention_engine(o.dense_engine);
  const std::string automatic = "gathered cuDNN for steps of >= " +
                                std::to_string(model::gpu::kGatheredCudnnMinQueries) + " queries, ours otherwise";
  std::printf("dense attention engine: %s (%s)\n", dense_attention_engine_name(o.dense_engine),
              o.dense_engine == DenseAttentionEngine::msa            ? "ours"
              : !dense_attention_cudnn_built()                         ? "ours: this build has no cuDNN"
              : o.dense_engine == DenseAttentionEngine::cudnn          ? "cuDNN's SDPA over the paged cache"
              : o.dense_engine == DenseAttentionEngine::cudnn_gathered ? "cuDNN's SDPA over K/V gathered out of the pages"
                                                                       : automatic.c_str());
  std::fflush(stdout);
  model->set_moe_kernel(o.moe_kernel);
  const model::gpu::MoeKernelRule& rule = model->moe_kernel_rule();
  std::printf("MoE kernel: %s (auto: small for <= %lld token x expert entries, grouped for <= %lld, per-expert "
              "above); routed experts' weights %s\n",
              model::gpu::moe_kernel_name(o.moe_kernel), static_cast<long long>(rule.max_small_entries),
              static_cast<long long>(rule.max_grouped_entries), model::gpu::expert_weights_name(model->expert_format()));
  std::fflush(stdout);
  Runner runner(*model, cache, o);
  std::vector<Measurement> rows;
  for (int64_t n : o.contexts) {
    std::fprintf(stderr, "[bench-model] context %lld\n", static_cast<long long>(n));
    model->set_dense_attention(false);
    runner.warm_up(n);
    SequenceCache sequence;
    rows.push_back(runner.prefill(sequence, n, "msa"));
    rows.push_back(runner.decode(sequence, n, "msa"));
    if (o.dense) {
      model->set_dense_attention(true);
      rows.push_back(runner.decode(sequence, n, "dense"));
    }
    cache.release(sequence);
    if (o.dense && n <= o.dense_prefill_max) {
      SequenceCache dense_sequence;
      rows.push_back(runner.prefill(dense_sequence, n, "dense"));
      cache.release(dense_sequence);
    }
    model->set_dense_attention(false);
  }
  // The streaming-read ceiling of the floors, measured now (the model's buffers are allocated:
  // a 2 GiB scratch buffer fits on a GPU that holds the model and the cache).
  bench_cuda::Machine ceilings = machine;
  bench_cuda::measure_memory(ceilings, 10, static_cast<cudaStream_t>(model->stream()));
  std::printf("\nstreaming-read ceiling %.0f GB/s (floors below: a decoded token's bytes at it)\n", ceilings.read_gbs);
  print_table(rows, c, model->weights(), ceilings.read_gbs);
  const CudaModel::DenseAttentionCalls& calls = model->dense_attention_calls();
  std::printf("\ndense attention engine %s: %lld calls on ours, %lld on cuDNN paged, %lld on cuDNN gathered "
              "(%lld cuDNN plans built)\n",
              dense_attention_engine_name(o.dense_engine), static_cast<long long>(calls.msa),
              static_cast<long long>(calls.cudnn), static_cast<long long>(calls.cudnn_gathered),
              static_cast<long long>(model->cudnn_dense_plans()));
  for (const Measurement& m : rows)
    if (m.profile.kv_gather_ms > 0)
      std::printf("K/V gather (cudnn-gathered, inside the attention ms above): N %lld, %s, %s: %.3f ms %s\n",
                  static_cast<long long>(m.context), m.phase.c_str(), m.mode.c_str(),
                  m.profile.kv_gather_ms * m.scale, m.phase == "prefill" ? "(sum)" : "per token");

  std::vector<GraphRow> graph_rows;
  for (int64_t b : o.decode_batches) {
    std::fprintf(stderr, "[bench-model] decode batch %lld at %lld tokens\n", static_cast<long long>(b),
                 static_cast<long long>(o.batch_context));
    std::vector<SequenceCache> sequences(static_cast<size_t>(b));
    for (SequenceCache& sequence : sequences) runner.prefill(sequence, o.batch_context, "batch");
    for (bool graphs : o.graph_modes) graph_rows.push_back(runner.decode_batch(sequences, graphs));
    for (SequenceCache& sequence : sequences) cache.release(sequence);
  }
  if (!graph_rows.empty()) {
    std::printf("\n| batch | context | decode graphs | step wall ms | ms per token | steps | graphs captured | MoE "
                "kernel |\n"
                "|---|---|---|---|---|---|---|---|\n");
    for (const GraphRow& r : graph_rows)
      std::printf("| %lld | %lld | %s | %.3f | %.4f | %lld | %lld | %s |\n", static_cast<long long>(r.batch),
                  static_cast<long long>(r.context), r.graphs ? "on" : "off", r.step_ms,
                  r.step_ms / static_cast<double>(r.batch), static_cast<long long>(r.steps),
                  static_cast<long long>(r.captured), r.moe_kernels.c_str());
    // The whole step's floor at batch 1: every layer's bytes at the rows' context, plus the
    // token's embedding row, the final norm and the LM head.
    for (const GraphRow& r : graph_rows) {
      if (r.batch != 1) continue;
      const DeviceWeights& w = model->weights();
      double bytes = static_cast<double>(w.final_norm.bytes() + w.lm_head.bytes()) +
                     2.0 * static_cast<double>(c.hidden_size);
      for (int64_t layer = 0; layer < c.num_layers; ++layer)
        bytes += decode_read_bytes(c, w.layers[static_cast<size_t>(layer)], layer, r.context);
      const double floor = bytes / (ceilings.read_gbs * 1e9) * 1e3;
      std::printf("decode step at batch 1, context %lld, graphs %s: %.3f ms against a floor of %.3f ms "
                  "(%.1f MB at %.0f GB/s): %.0f%%\n",
                  static_cast<long long>(r.context), r.graphs ? "on" : "off", r.step_ms, floor, bytes / 1e6,
                  ceilings.read_gbs, 100.0 * floor / r.step_ms);
    }
  }
  if (!o.json_path.empty()) {
    write_json(o.json_path, rows, c, model->weights(), ceilings.read_gbs, machine.gpu,
               dense_attention_engine_name(o.dense_engine));
    FILE* out = std::fopen(o.json_path.c_str(), "a");
    if (!out) throw Error("--json: cannot write " + o.json_path);
    for (const GraphRow& r : graph_rows)
      std::fprintf(out,
                   "{\"bench\":\"model-decode-step\",\"gpu\":\"%s\",\"batch\":%lld,\"context\":%lld,"
                   "\"decode_graphs\":%s,\"step_wall_ms\":%.6f,\"steps\":%lld,\"hidden\":%lld,\"experts\":%lld,"
                   "\"layers\":%lld,\"dense_engine\":\"%s\",\"moe_kernel\":\"%s\",\"expert_weights\":\"%s\"}\n",
                   machine.gpu.c_str(), static_cast<long long>(r.batch), static_cast<long long>(r.context),
                   r.graphs ? "true" : "false", r.step_ms, static_cast<long long>(r.steps),
                   static_cast<long long>(c.hidden_size), static_cast<long long>(c.num_experts),
                   static_cast<long long>(c.num_layers), dense_attention_engine_name(o.dense_engine),
                   r.moe_kernels.c_str(), model::gpu::expert_weights_name(model->expert_format()));
    std::fclose(out);
  }
  return 0;
}

}  // namespace
}  // namespace msa::cli

int run_bench_model_command(int argc, char** argv) {
  using namespace msa::cli;
  return run_reporting_errors("bench-model", kUsage, [&] {
    Args args(argc, argv, {"help", "no-dense"});
    return run(args);
  });
}
