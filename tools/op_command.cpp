// `msa op NAME --in IN.safetensors --out OUT.safetensors [options]`: runs one op on tensors
// read from a file and writes its outputs (f32, int32 for topk) to another.
#include <cstdint>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <functional>
#include <new>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "msa/ops.h"
#include "op_command.h"
#include "output_paths.h"
#include "msa/safetensors.h"
#include "msa/training.h"

namespace msa::cli {
namespace {

// Integer inputs: int32 expected; int64 (PyTorch's default) is accepted and narrowed.
bool is_index_input(const std::string& name) {
  return name == "cu_seqlens_q" || name == "cu_seqlens_k" || name == "topk" ||
         name == "page_table" || name == "seq_lens";
}

Tensor narrow_to_int32(const Tensor& tensor, const std::string& name) {
  const Tensor contiguous = tensor.is_contiguous() ? tensor : tensor.clone();
  const int64_t* values = contiguous.data<int64_t>();
  for (int64_t i = 0; i < contiguous.numel(); ++i)
    if (values[i] < INT32_MIN || values[i] > INT32_MAX)
      throw_arg_error(name + "[" + std::to_string(i) + "]", "a value that fits in int32",
                      values[i]);
  return contiguous.to(DType::i32);
}

// Paged caches: only the slots the page table and sequence lengths reach hold data (a cache
// from a serving engine has stale or uninitialised pages and slots past each sequence's end).
bool is_cache_input(const std::string& name) {
  return name == "k_cache" || name == "v_cache" || name == "index_key_cache" ||
         name == "index_key_scale" || name == "k_scale" || name == "v_scale";
}

[[noreturn]] void non_finite_error(const std::string& name, const Tensor& tensor, int64_t at) {
  throw Error("input tensor '" + name + "': expected finite values" +
              (name == "lse" ? std::string(" (or -inf, an empty set's LSE)") : std::string()) +
              ", got " + std::to_string(tensor.get(at)) + " at index " +
              index_string(tensor.shape(), at) + " (flat " + std::to_string(at) + ")");
}

// The op's input tensors, looked up by name in the input file. With check_finite, a float
// input holding NaN or an infinity is refused with its name and index: the ops define no
// result for those (msa/ops.h), and a NaN would otherwise come out as a plausible-looking
// selection or a finite loss with NaN gradients.
class Inputs {
 public:
  Inputs(SafetensorsModel file, std::string op, bool check_finite)
      : file_(std::move(file)), op_(std::move(op)), check_finite_(check_finite) {}

  // Throws one error naming every tensor of `names` that the file lacks.
  void require(const std::vector<std::string>& names) const {
    std::string missing;
    for (const std::string& name : names)
      if (!file_.contains(name)) missing += (missing.empty() ? "'" : ", '") + name + "'";
    if (!missing.empty())
      MSA_FAIL("op '", op_, "': input tensor(s) ", missing, " not found in '", file_.path(),
               "'");
  }

  Tensor operator[](const std::string& name) const {
    require({name});
    const Tensor tensor = file_.get(name);
    if (is_index_input(name) && tensor.dtype() == DType::i64) return narrow_to_int32(tensor, name);
    if (check_finite_ && !is_cache_input(name))
      if (const int64_t at = first_non_finite(tensor, /*allow_negative_infinity=*/name == "lse");
          at >= 0)
        non_finite_error(name, tensor, at);
    return tensor;
  }

  // Checks the slots of a paged cache tensor [pages, (heads,) B, ...] that sequence b's
  // first seq_lens[b] tokens occupy. Entries the op will reject (bad pages, lengths, shapes)
  // are skipped here: its own validation names them.
  void check_cache(const std::string& name, const Tensor& cache, const Tensor& page_table,
                   const Tensor& seq_lens) const {
    if (!check_finite_ || !dtype_is_float(cache.dtype())) return;
    // K/V caches [pages, Hkv, B, D] and their per-(token, head) scales [pages, Hkv, B] have a
    // head axis before the slot axis (a per-tensor scale [1] has no slot axis: not scanned).
    const bool has_heads = name == "k_cache" || name == "v_cache" || name == "k_scale" || name == "v_scale";
    const int64_t slot_axis = has_heads ? 2 : 1;
    if (cache.dim() <= slot_axis || page_table.dim() != 2 || seq_lens.dim() != 1 ||
        page_table.dtype() != DType::i32 || seq_lens.dtype() != DType::i32 ||
        seq_lens.size(0) != page_table.size(0) || !cache.is_contiguous() ||
        !page_table.is_contiguous() || !seq_lens.is_contiguous())
      return;
    const int64_t pages = cache.size(0), block = cache.size(slot_axis);
    const int64_t heads = has_heads ? cache.size(1) : 1;
    int64_t row = 1;  // elements per (head, slot)
    for (int64_t axis = slot_axis + 1; axis < cache.dim(); ++axis) row *= cache.size(axis);
    const int32_t* table = page_table.data<int32_t>();
    const int32_t* lens = seq_lens.data<int32_t>();
    const int64_t columns = page_table.size(1);
    if (block < 1) return;
    for (int64_t b = 0; b < seq_lens.size(0); ++b) {
      const int64_t len = lens[b];
      for (int64_t j = 0; j < columns && j * block < len; ++j) {
        const int64_t page = table[b * columns + j];
        if (page < 0 || page >= pages) continue;
        const int64_t slots = std::min(block, len - j * block);
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t begin = ((page * heads + h) * block) * row;
          if (const int64_t at = first_non_finite(cache, begin, slots * row); at >= 0)
            non_finite_error(name, cache, at);
        }
      }
    }
  }

  const SafetensorsModel& file() const { return file_; }

 private:
  SafetensorsModel file_;
  std::string op_;
  bool check_finite_;
};

struct OpSpec {
  const char* name;
  const char* math;
  std::vector<std::string> inputs;   // "name [shape]"
  std::vector<std::string> outputs;  // "name [shape] dtype"
  std::function<NamedTensors(const Inputs&, const MsaParams&, Impl)> run;
};

std::string tensor_name(const std::string& spec) { return spec.substr(0, spec.find(' ')); }

PagedKvCache paged_cache(const Inputs& in, bool with_kv, bool with_index_keys) {
  PagedKvCache cache;
  if (with_kv) {
    cache.k_cache = in["k_cache"];
    cache.v_cache = in["v_cache"];
    // Optional: fp8 K/V (include/msa/quantized_kv_cache.h).
    if (in.file().contains("k_scale")) cache.k_scale = in["k_scale"];
    if (in.file().contains("v_scale")) cache.v_scale = in["v_scale"];
  }
  if (with_index_keys) {
    cache.index_key_cache = in["index_key_cache"];
    // Optional: quantized index keys (include/msa/quantized_index_keys.h).
    if (in.file().contains("index_key_scale")) cache.index_key_scale = in["index_key_scale"];
  }
  cache.page_table = in["page_table"];
  cache.seq_lens = in["seq_lens"];
  for (const auto& [name, tensor] :
       {std::pair<const char*, const Tensor*>{"k_cache", &cache.k_cache},
        {"v_cache", &cache.v_cache},
        {"index_key_cache", &cache.index_key_cache},
        {"index_key_scale", &cache.index_key_scale},
        {"k_scale", &cache.k_scale},
        {"v_scale", &cache.v_scale}})
    if (tensor->defined()) in.check_cache(name, *tensor, cache.page_table, cache.seq_lens);
  return cache;
}

NamedTensors attention_outputs(const AttentionOutput& out) {
  return {{"o", out.o}, {"lse", out.lse}};
}
NamedTensors grad_outputs(const AttentionGrads& out) {
  return {{"dq", out.dq}, {"dk", out.dk}, {"dv", out.dv}};
}

const std::vector<OpSpec>& op_table() {
  static const std::vector<OpSpec> table = {
      {"indexer", "topk = per-group top-k blocks by max_t qi.ki(t); lse = log sum exp(iscale s/T)",
       {"qi [total_q,Hi,Di]", "ki [total_k,Di]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"topk [Hi,total_q,k] i32", "lse [Hi,total_q] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) -> NamedTensors {
         const IndexerOutput out =
             indexer(in["qi"], in["ki"], in["cu_seqlens_q"], in["cu_seqlens_k"], p, impl);
         return {{"topk", out.topk}, {"lse", out.lse}};
       }},
      {"sparse_attention", "o = softmax(scale q.k) v over the selected blocks (causal)",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "v [total_k,Hkv,D]", "topk [Hkv,total_q,k]",
        "cu_seqlens_q [batch+1]", "cu_seqlens_k [batch+1]"},
       {"o [total_q,Hq,D] f32", "lse [total_q,Hq] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return attention_outputs(sparse_attention(in["q"], in["k"], in["v"], in["topk"],
                                                   in["cu_seqlens_q"], in["cu_seqlens_k"], p,
                                                   impl));
       }},
      {"sparse_attention_backward", "flash-attention backward restricted to the selected blocks",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "v [total_k,Hkv,D]", "topk [Hkv,total_q,k]",
        "o [total_q,Hq,D]", "lse [total_q,Hq]", "do [total_q,Hq,D]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"dq [total_q,Hq,D] f32", "dk [total_k,Hkv,D] f32", "dv [total_k,Hkv,D] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return grad_outputs(sparse_attention_backward(in["q"], in["k"], in["v"], in["topk"],
                                                       in["o"], in["lse"], in["do"],
                                                       in["cu_seqlens_q"], in["cu_seqlens_k"],
                                                       p, impl));
       }},
      {"indexer_kl", "loss = c/(Hi total_q) sum KL(group-mean attention || index softmax)",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "lse [total_q,Hq]", "qi [total_q,Hi,Di]",
        "ki [total_k,Di]", "topk [Hkv,total_q,k]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"loss [] f32", "dqi [total_q,Hi,Di] f32", "dki [total_k,Di] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) -> NamedTensors {
         const IndexerKlOutput out =
             indexer_kl(in["q"], in["k"], in["lse"], in["qi"], in["ki"], in["topk"],
                        in["cu_seqlens_q"], in["cu_seqlens_k"], p, impl);
         return {{"loss", out.loss}, {"dqi", out.dqi}, {"dki", out.dki}};
       }},
      {"train_step",
       "one MSA layer's training step: indexer -> sparse_attention -> its backward (dO) -> "
       "indexer_kl",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "v [total_k,Hkv,D]", "qi [total_q,Hi,Di]",
        "ki [total_k,Di]", "do [total_q,Hq,D]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"topk [Hi,total_q,k] i32", "index_lse [Hi,total_q] f32", "o [total_q,Hq,D] f32",
        "lse [total_q,Hq] f32", "dq [total_q,Hq,D] f32", "dk [total_k,Hkv,D] f32",
        "dv [total_k,Hkv,D] f32", "loss [] f32", "dqi [total_q,Hi,Di] f32",
        "dki [total_k,Di] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) -> NamedTensors {
         TrainingStepInputs step_in;
         step_in.q = in["q"];
         step_in.k = in["k"];
         step_in.v = in["v"];
         step_in.qi = in["qi"];
         step_in.ki = in["ki"];
         step_in.grad_o = in["do"];
         step_in.cu_seqlens_q = in["cu_seqlens_q"];
         step_in.cu_seqlens_k = in["cu_seqlens_k"];
         const TrainingStepOutput out = training_step(step_in, p, impl);
         return {{"topk", out.index.topk},   {"index_lse", out.index.lse},
                 {"o", out.attention.o},     {"lse", out.attention.lse},
                 {"dq", out.grads.dq},       {"dk", out.grads.dk},
                 {"dv", out.grads.dv},       {"loss", out.kl.loss},
                 {"dqi", out.kl.dqi},        {"dki", out.kl.dki}};
       }},
      {"dense_attention", "o = softmax(scale q.k) v over all causal keys",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "v [total_k,Hkv,D]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"o [total_q,Hq,D] f32", "lse [total_q,Hq] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return attention_outputs(dense_attention(in["q"], in["k"], in["v"], in["cu_seqlens_q"],
                                                  in["cu_seqlens_k"], p, impl));
       }},
      {"dense_attention_backward", "flash-attention backward over all causal keys",
       {"q [total_q,Hq,D]", "k [total_k,Hkv,D]", "v [total_k,Hkv,D]", "o [total_q,Hq,D]",
        "lse [total_q,Hq]", "do [total_q,Hq,D]", "cu_seqlens_q [batch+1]",
        "cu_seqlens_k [batch+1]"},
       {"dq [total_q,Hq,D] f32", "dk [total_k,Hkv,D] f32", "dv [total_k,Hkv,D] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return grad_outputs(dense_attention_backward(in["q"], in["k"], in["v"], in["o"],
                                                      in["lse"], in["do"], in["cu_seqlens_q"],
                                                      in["cu_seqlens_k"], p, impl));
       }},
      {"paged_indexer",
       "indexer over a paged index-key cache (fp8/fp4 caches: add index_key_scale, "
       "see include/msa/quantized_index_keys.h)",
       {"qi [total_q,Hi,Di]", "index_key_cache [pages,B,Di]", "page_table [batch,max_pages]",
        "seq_lens [batch]", "cu_seqlens_q [batch+1]"},
       {"topk [Hi,total_q,k] i32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) -> NamedTensors {
         const IndexerOutput out =
             paged_indexer(in["qi"], paged_cache(in, false, true), in["cu_seqlens_q"], p, impl);
         return {{"topk", out.topk}};
       }},
      {"paged_sparse_attention",
       "sparse_attention over paged K/V caches (fp8 caches: add k_scale and v_scale, see "
       "include/msa/quantized_kv_cache.h)",
       {"q [total_q,Hq,D]", "k_cache [pages,Hkv,B,D]", "v_cache [pages,Hkv,B,D]",
        "page_table [batch,max_pages]", "seq_lens [batch]", "topk [Hkv,total_q,k]",
        "cu_seqlens_q [batch+1]"},
       {"o [total_q,Hq,D] f32", "lse [total_q,Hq] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return attention_outputs(paged_sparse_attention(
             in["q"], paged_cache(in, true, false), in["topk"], in["cu_seqlens_q"], p, impl));
       }},
      {"paged_dense_attention",
       "dense causal attention over paged K/V caches (fp8: add k_scale and v_scale)",
       {"q [total_q,Hq,D]", "k_cache [pages,Hkv,B,D]", "v_cache [pages,Hkv,B,D]",
        "page_table [batch,max_pages]", "seq_lens [batch]", "cu_seqlens_q [batch+1]"},
       {"o [total_q,Hq,D] f32", "lse [total_q,Hq] f32"},
       [](const Inputs& in, const MsaParams& p, Impl impl) {
         return attention_outputs(
             paged_dense_attention(in["q"], paged_cache(in, true, false), in["cu_seqlens_q"], p,
                                   impl));
       }},
  };
  return table;
}

const OpSpec* find_op(const std::string& name) {
  for (const OpSpec& op : op_table())
    if (name == op.name) return &op;
  return nullptr;
}

std::string op_names() {
  std::string out;
  for (const OpSpec& op : op_table()) out += (out.empty() ? "" : ", ") + std::string(op.name);
  return out;
}

constexpr const char* kUsageLine =
    "usage: msa op NAME --in IN.safetensors --out OUT.safetensors [options]\n";
constexpr const char* kUsage =
    "\n"
    "options:\n"
    "  --device cpu|reference|cuda   implementation (default cpu)\n"
    "  --block-size N      tokens per block / KV page (default 128)\n"
    "  --topk N            selected blocks per query and KV group (default 16)\n"
    "  --local-blocks N    always-selected blocks ending at the query's block (default 1)\n"
    "  --init-blocks N     always-selected blocks at the sequence start (default 0)\n"
    "  --scale S           main softmax scale (default 0 = 1/sqrt(D))\n"
    "  --index-scale S     index-score scale (default 0 = 1/sqrt(Di))\n"
    "  --temperature T     index softmax temperature (default 1)\n"
    "  --kl-coef C         KL loss coefficient (default 1)\n"
    "  --index-compute exact|fp8  index scores the selection ranks by (default exact; fp8:\n"
    "                      e4m3 qi rows and keys, MsaParams::index_compute)\n"
    "  --bidirectional     dense ops: every query sees every key of its sequence\n"
    "                      (MsaParams::causal = false; the MSA ops and --device cuda refuse it)\n"
    "  --atomic-grads      CUDA backward ops: atomicAdd for gradients with many writers\n"
    "                      (dk, dv, dki; faster, not bitwise reproducible run to run)\n"
    "  --threads N         threads for --device cpu (default 0 = all cores; at most the core\n"
    "                      count)\n"
    "\n"
    "Float inputs may be f32, bf16, f16 or f64; integer inputs int32 (int64 is narrowed).\n"
    "Outputs are f32 (topk int32). Extra tensors in the input file are ignored.\n"
    "Float inputs must be finite (lse may also hold -inf); paged caches are checked over the\n"
    "slots that page_table and seq_lens reach. --out may not be --in (or inside it).\n"
    "Exit codes: 0 success, 2 bad usage or an error from the op or the files.\n";

void print_help() {
  std::cout << kUsageLine << kUsage << "\nops (inputs -> outputs):\n";
  for (const OpSpec& op : op_table()) {
    std::cout << "  " << op.name << ": " << op.math << "\n    in: ";
    for (size_t i = 0; i < op.inputs.size(); ++i) std::cout << (i ? ", " : "") << op.inputs[i];
    std::cout << "\n    out: ";
    for (size_t i = 0; i < op.outputs.size(); ++i)
      std::cout << (i ? ", " : "") << op.outputs[i];
    std::cout << "\n";
  }
}

// Flag ranges: far above any real use, low enough that a typo is not taken for a request.
constexpr int kMaxBlockFlag = 1 << 16;  // --block-size, --topk, --local-blocks, --init-blocks
constexpr double kMaxScale = 1e6;       // --scale, --index-scale, --temperature, --kl-coef

struct OpRequest {
  const OpSpec* op = nullptr;
  std::string input_path, output_path;
  Impl impl = Impl::cpu;
  MsaParams params;
  int threads = 0;
};

OpRequest parse_request(int argc, char** argv) {
  Args args(argc, argv, {"help", "atomic-grads", "bidirectional"});
  OpRequest request;
  if (args.positional().size() != 1)
    throw UsageError("expected one op name (one of: " + op_names() + "), got " +
                     std::to_string(args.positional().size()) + " positional arguments");
  request.op = find_op(args.positional()[0]);
  if (!request.op)
    throw UsageError("unknown op \"" + args.positional()[0] + "\" (one of: " + op_names() + ")");
  const std::string device = args.get_string("device", "cpu");
  if (device != "cpu" && device != "reference" && device != "cuda")
    throw UsageError("--device: expected cpu, reference or cuda, got \"" + device + "\"");
  request.impl = impl_from_name(device);
  MsaParams& p = request.params;
  p.block_size = args.get_int("block-size", p.block_size, 1, kMaxBlockFlag);
  p.topk = args.get_int("topk", p.topk, 1, kMaxBlockFlag);
  p.local_blocks = args.get_int("local-blocks", p.local_blocks, 1, kMaxBlockFlag);
  p.init_blocks = args.get_int("init-blocks", p.init_blocks, 0, kMaxBlockFlag);
  p.scale = args.get_double("scale", p.scale, -kMaxScale, kMaxScale);
  p.index_scale = args.get_double("index-scale", p.index_scale, -kMaxScale, kMaxScale);
  p.temperature = args.get_double("temperature", p.temperature, 0, kMaxScale, /*min_open=*/true);
  p.kl_coefficient = args.get_double("kl-coef", p.kl_coefficient, -kMaxScale, kMaxScale);
  p.deterministic = !args.get_switch("atomic-grads");
  p.causal = !args.get_switch("bidirectional");
  const std::string compute = args.get_string("index-compute", "exact");
  if (compute != "exact" && compute != "fp8")
    throw UsageError("--index-compute: expected exact or fp8, got \"" + compute + "\"");
  p.index_compute = index_compute_from_name(compute);
  request.threads = args.get_threads();
  request.input_path = args.get_string("in");
  request.output_path = args.get_string("out");
  args.finish();
  try {
    validate_params(p);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  check_output_path("out", request.output_path, {{"in", request.input_path}});
  return request;
}

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// The params as used: scales of 0 resolved from the input head dims where known.
std::map<std::string, std::string> output_metadata(const OpRequest& request,
                                                   const Inputs& inputs) {
  const MsaParams& p = request.params;
  const auto resolved_scale = [&](double scale, const char* tensor) {
    if (scale != 0 || !inputs.file().contains(tensor)) return scale;
    const Tensor t = inputs.file().get(tensor);
    return t.dim() >= 1 ? 1.0 / std::sqrt(static_cast<double>(t.size(-1))) : scale;
  };
  return {{"op", request.op->name},
          {"device", std::string(impl_name(request.impl))},
          {"msa_version", kVersion},
          {"block_size", std::to_string(p.block_size)},
          {"topk", std::to_string(p.topk)},
          {"local_blocks", std::to_string(p.local_blocks)},
          {"init_blocks", std::to_string(p.init_blocks)},
          {"scale", number_text(resolved_scale(p.scale, "q"))},
          {"index_scale", number_text(resolved_scale(p.index_scale, "qi"))},
          {"temperature", number_text(p.temperature)},
          {"kl_coefficient", number_text(p.kl_coefficient)},
          {"deterministic", p.deterministic ? "1" : "0"},
          {"causal", p.causal ? "1" : "0"},
          {"threads", std::to_string(num_threads())}};
}

NamedTensors as_output_dtypes(NamedTensors outputs) {
  for (auto& [name, tensor] : outputs)
    if (tensor.defined() && dtype_is_float(tensor.dtype()) && tensor.dtype() != DType::f32)
      tensor = tensor.to(DType::f32);
  return outputs;
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

NamedTensors run_op(const OpSpec& op, const Inputs& inputs, const MsaParams& params, Impl impl) {
  std::vector<std::string> input_names;
  for (const std::string& spec : op.inputs) input_names.push_back(tensor_name(spec));
  inputs.require(input_names);
  return as_output_dtypes(op.run(inputs, params, impl));
}

void run_request(const OpRequest& request) {
  const auto start = std::chrono::steady_clock::now();
  set_num_threads(request.threads);
  const Inputs inputs(SafetensorsModel::open(request.input_path), request.op->name,
                      /*check_finite=*/true);
  const auto op_start = std::chrono::steady_clock::now();
  const NamedTensors outputs = run_op(*request.op, inputs, request.params, request.impl);
  const double op_ms = milliseconds_since(op_start);
  save_safetensors(request.output_path, outputs, output_metadata(request, inputs));

  std::string written;
  for (const auto& [name, tensor] : outputs)
    written += (written.empty() ? "" : ", ") + name + " " + shape_string(tensor.shape()) + " " +
               std::string(dtype_name(tensor.dtype()));
  std::printf("msa op %s: device %s, wrote %s to %s; op %.3f ms, total %.3f ms\n",
              request.op->name, std::string(impl_name(request.impl)).c_str(), written.c_str(),
              request.output_path.c_str(), op_ms, milliseconds_since(start));
}

}  // namespace

std::vector<std::string> op_command_names() {
  std::vector<std::string> names;
  for (const OpSpec& op : op_table()) names.push_back(op.name);
  return names;
}

NamedTensors run_op_on_inputs(const std::string& name, const SafetensorsModel& file,
                              const MsaParams& params, Impl impl, bool check_finite) {
  const OpSpec* op = find_op(name);
  if (!op) throw_arg_error("op", "one of " + op_names(), name);
  validate_params(params);
  return run_op(*op, Inputs(file, name, check_finite), params, impl);
}

}  // namespace msa::cli

int run_op_command(int argc, char** argv) {
  using namespace msa::cli;
  OpRequest request;
  try {
    if (Args(argc, argv, {"help", "atomic-grads", "bidirectional"}).has("help")) {
      print_help();
      return 0;
    }
    request = parse_request(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "msa op: " << e.what() << "\n"
              << kUsageLine << "(msa op --help lists the options and the ops)\n";
    return 2;
  }
  try {
    run_request(request);
    return 0;
  } catch (const msa::Error& e) {
    std::cerr << "msa op: error: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "msa op: error: out of memory\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "msa op: error: " << e.what() << "\n";
    return 2;
  }
}
