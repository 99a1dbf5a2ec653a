// msa bench --device cuda: flags, their checks and the usage text.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_shape.h"
#include "engine_flag.h"

namespace msa::cli::bench_cuda {

const char* const kUsage =
    "usage: msa bench --device cuda [--contexts 2048,8192,32768,131072]\n"
    "                 [--decode-contexts 8192,131072 --batches 1,8 --queries 1,8]\n"
    "                 [--heads 64 --kv-heads 4 --head-dim 128 --index-dim 128]\n"
    "                 [--block-size 128 --topk 16 --local-blocks 1 --init-blocks 0]\n"
    "                 [--repeats 20 --dense-repeats AUTO --decode-repeats 50 --warmup 1]\n"
    "                 [--dense-max-context N] [--ours-dense-max-context N] [--cudnn 1] [--rotate-mb 1024]\n"
    "                 [--tolerance 1e-2] [--matmul-size 8192] [--json FILE]\n"
    "                 [--index-keys bf16|fp8|fp4|all (or a list: fp8,fp4)] [--index-compute exact|fp8]\n"
    "                 [--index-coherence C] [--sparse-orders] [--index-ranking automatic|in_scan|separate]\n"
    "                 [--kv-cache bf16|fp8|fp8-tensor|all (or a list: fp8,fp8-tensor)]\n"
    "                 [--training [--training-seqs 32768,131072,8x16384]\n"
    "                  [--backward-engine automatic|wgmma|mma_sync]]\n"
    "Times our MSA kernels (indexer, sparse attention, both) against dense causal attention\n"
    "(our kernel with topk = null, and cuDNN SDPA when built with the cuDNN frontend) on one\n"
    "GPU, after measuring the GPU's matmul, copy and read ceilings. `--contexts none` or\n"
    "`--decode-contexts none` skips a phase. --dense-repeats defaults to 20 below 512K tokens\n"
    "and 2 from 512K; --dense-max-context skips both dense prefills above that length,\n"
    "--ours-dense-max-context only ours (cuDNN still runs; its error vs ours is then not checked).\n"
    "Decode rows on the decode kernels are also split by phase (scan, select, attention,\n"
    "merge): graph replays of the step's prefixes, each phase = what it adds to the step.\n"
    "Exit status 1 when a correctness gate fails: MSA vs our dense where N <= topk*block,\n"
    "our dense vs cuDNN everywhere, malformed selection rows.\n"
    "--index-keys fp8/fp4/all also times each decode row's indexer and MSA step with the index\n"
    "keys quantized (fp8: e4m3 + f32 per token; fp4: e2m1 + e4m3 per 16 channels) and counts\n"
    "the rows whose selection differs from the bf16 keys' (a second decode table).\n"
    "--kv-cache fp8/fp8-tensor/all also times each decode row's selected-K/V phase (sparse\n"
    "attention over the bf16 rows' selection), MSA step and dense decode with the K/V caches in\n"
    "fp8 (e4m3 codes; fp8: one f32 scale per token and head, fp8-tensor: one per tensor),\n"
    "quantized on the device, and O's error against the bf16 caches' (a third decode table);\n"
    "on prefill rows, sparse and dense attention over paged fp8 caches of the same K/V.\n"
    "--index-coherence C > 0 makes the prefill rows' index queries of each 128-token block one\n"
    "base row plus C x the token's own noise (planted structure: neighbouring queries select\n"
    "mostly the same blocks, as with a trained indexer); --sparse-orders also times the sparse\n"
    "stage with kv_major and query_major pinned (MsaParams::cuda.sparse_order).\n"
    "--index-ranking pins where the prefill rows' index scan ranks (MsaParams::cuda.index_ranking:\n"
    "in_scan, or separate: block maxima to the workspace, then a ranking kernel).\n"
    "--index-compute fp8 runs the prefill rows' indexer (alone and inside MSA) with fp8 index\n"
    "scores (MsaParams::index_compute; Di = B = 128); decode and training rows stay exact.\n"
    "--training times the training kernels instead: the training indexer, sparse forward,\n"
    "sparse backward and KL backward (deterministic and fast), one layer's whole training\n"
    "step, and dense causal forward / backward (ours, both modes, and cuDNN SDPA with\n"
    "--cudnn 1) on packed batches of sequences (--training-seqs: N = one sequence of N\n"
    "tokens, BxN = B of them; random selection rows; --dense-repeats defaults to 5 from 64K\n"
    "tokens, else 20; --dense-max-context skips the dense baselines above that length).\n"
    "--backward-engine pins the attention backward's dK / dV kernel of the training rows\n"
    "(MsaParams::cuda.backward; automatic: warpgroup MMA where D = B = 128).\n";


namespace {
// A comma list of named formats for --index-keys / --kv-cache: each name adds its formats
// (once each, in first-named order); "bf16", the default rows only, adds none.
template <class Format>
std::vector<Format> parse_format_list(const std::string& text, const std::string& flag,
                                      const std::vector<std::pair<std::string, std::vector<Format>>>& names,
                                      const std::string& expected) {
  std::vector<Format> formats;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    const auto named = std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == item; });
    if (named == names.end() && item != "bf16")
      throw UsageError("--" + flag + ": expected " + expected + " (or a comma list), got \"" + item + "\"");
    if (named != names.end())
      for (Format f : named->second)
        if (std::find(formats.begin(), formats.end(), f) == formats.end()) formats.push_back(f);
    begin = end + 1;
  }
  return formats;
}

// --index-keys: "bf16" (the default rows only), "fp8", "fp4", "all" or a comma list.
std::vector<cuda::KeyFormat> parse_index_keys(const std::string& text) {
  using F = cuda::KeyFormat;
  return parse_format_list<F>(text, "index-keys", {{"fp8", {F::fp8}}, {"fp4", {F::fp4}}, {"all", {F::fp8, F::fp4}}},
                              "bf16, fp8, fp4 or all");
}

// --kv-cache: "bf16" (the default rows only), "fp8" (per token and head scales),
// "fp8-tensor" (one scale per tensor), "all" or a comma list.
std::vector<cuda::KvScaleLayout> parse_kv_cache(const std::string& text) {
  using L = cuda::KvScaleLayout;
  return parse_format_list<L>(text, "kv-cache",
                              {{"fp8", {L::per_token_head}},
                               {"fp8-tensor", {L::per_tensor}},
                               {"all", {L::per_token_head, L::per_tensor}}},
                              "bf16, fp8, fp8-tensor or all");
}
}  // namespace

Config parse_config(Args& args) {
  Config c;
  args.get_string("device", "cuda");
  constexpr int64_t kMaxTokens = int64_t{1} << 22;
  c.contexts = args.get_positive_list("contexts", "2048,8192,32768,131072", kMaxTokens, true);
  c.decode_contexts = args.get_positive_list("decode-contexts", "8192,131072", kMaxTokens, true);
  c.batches = args.get_positive_list("batches", "1,8", 4096, true);
  c.decode_queries = args.get_positive_list("queries", "1,8", 4096, true);
  static_cast<BenchShape&>(c) = read_bench_shape(args);
  c.repeats = args.get_int("repeats", 20, 1, 100000);
  c.dense_repeats = args.get_int("dense-repeats", 0, 0, 100000);
  c.decode_repeats = args.get_int("decode-repeats", 50, 1, 100000);
  c.warmup = args.get_int("warmup", 1, 0, 100000);
  c.dense_max_context = args.get_int("dense-max-context", 0, 0, int(kMaxTokens));
  c.ours_dense_max_context = args.get_int("ours-dense-max-context", 0, 0, int(kMaxTokens));
  c.cudnn = args.get_int("cudnn", 1, 0, 1) != 0;
  c.rotate_bytes = args.get_double("rotate-mb", 1024, 0, 1 << 20) * 1024 * 1024;
  c.tolerance = args.get_double("tolerance", 1e-2, 0, 1, /*min_open=*/true);
  c.matmul_size = args.get_int("matmul-size", 8192, 256, 65536);
  c.json_path = args.get_string("json", "");
  c.quantized_index_keys = parse_index_keys(args.get_string("index-keys", "bf16"));
  c.fp8_kv_layouts = parse_kv_cache(args.get_string("kv-cache", "bf16"));
  const std::string index_compute = args.get_string("index-compute", "exact");
  if (index_compute != "exact" && index_compute != "fp8")
    throw UsageError("--index-compute: expected exact or fp8, got \"" + index_compute + "\"");
  c.params.index_compute = index_compute_from_name(index_compute);
  c.index_coherence = args.get_double("index-coherence", 0, 0, 1e6);
  c.sparse_orders = args.get_switch("sparse-orders");
  const std::string ranking = args.get_string("index-ranking", "automatic");
  bool ranking_known = false;
  for (cuda::IndexRanking r : {cuda::IndexRanking::automatic, cuda::IndexRanking::in_scan,
                               cuda::IndexRanking::separate})
    if (ranking == cuda::index_ranking_name(r)) {
      c.index_ranking = r;
      ranking_known = true;
    }
  if (!ranking_known)
    throw UsageError("--index-ranking: expected automatic, in_scan or separate, got \"" + ranking + "\"");
  c.training = args.get_switch("training");
  c.training_seqs = args.get_string("training-seqs", "32768,131072,8x16384");
  c.backward_engine = parse_engine_flag(args.get_string("backward-engine", "automatic"), "--backward-engine");
  args.finish();
  validate_params(c.params);
  if (c.repeats < 1 || c.dense_repeats < 0 || c.decode_repeats < 1 || c.warmup < 0)
    throw UsageError("--repeats/--decode-repeats: expected positive counts (--dense-repeats, "
                     "--warmup: >= 0)");
  if (c.kv_heads < 1 || c.heads % c.kv_heads != 0)
    throw UsageError("--heads: expected a multiple of --kv-heads");
  if (c.head_dim < 8 || c.index_dim < 8) throw UsageError("--head-dim/--index-dim: expected >= 8");
  if (!c.fp8_kv_layouts.empty() && c.head_dim % 16 != 0)
    throw UsageError("--kv-cache fp8: expected a --head-dim that is a multiple of 16 (16-byte code rows)");
  if (c.matmul_size < 256 || c.matmul_size % 256)
    throw UsageError("--matmul-size: expected a multiple of 256");
  for (int64_t n : c.contexts)
    if (n > (int64_t{1} << 20) * 4) throw UsageError("--contexts: at most 4194304 tokens");
  if ((!c.decode_contexts.empty()) && (c.batches.empty() || c.decode_queries.empty()))
    throw UsageError("--batches/--queries: expected at least one value when decoding");
  for (int64_t n : c.decode_contexts)
    for (int64_t q : c.decode_queries)
      if (q > n) throw UsageError("--queries: each must be <= every --decode-contexts value");
  return c;
}

}  // namespace msa::cli::bench_cuda
