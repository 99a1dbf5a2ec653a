// msa bench: MSA (indexer + sparse attention) against dense attention, one layer of
// MiniMax-M3's attention shape by default, at several context lengths, on the CPU.
//
// Each context N gets a paged cache of N tokens (shuffled page table) and two workloads:
//   prefill: the last --chunk queries of the N-token context (chunked prefill over a
//            cached prefix), so the dense baseline stays affordable on a CPU;
//   decode:  one request, one new query at position N - 1.
// Times are medians of --repeats calls after one warm-up; small caches are replicated and
// rotated so repeated calls do not run from the last-level cache.
#include <cstdint>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench_shape.h"
#include "cli_args.h"
#include "commands.h"
#include "machine_peak.h"
#include "msa/ops.h"
#include "random_inputs.h"

namespace msa::cli {

#ifdef MSA_WITH_CUDA
int run_bench_cuda(Args& args);  // tools/bench_cuda.cpp: msa bench --device cuda
#endif

namespace {

constexpr const char* kUsage =
    "usage: msa bench [--device cpu|cuda] [--contexts 2048,8192,32768,131072] [--chunk 256]\n"
    "                 [--heads 64 --kv-heads 4 --head-dim 128 --index-dim 128]\n"
    "                 [--block-size 128 --topk 16 --local-blocks 1 --init-blocks 0]\n"
    "                 [--repeats 5 --dense-repeats 3 --decode-repeats 20] [--threads N]\n"
    "                 [--json FILE]\n"
    "Times MSA (paged_msa_attention: indexer + sparse attention, or the dense path where\n"
    "every context is <= topk * block-size) against dense attention per context length;\n"
    "checks that they agree where every context is <= topk * block-size.\n"
    "`msa bench --device cuda --help`: the GPU benchmark's options.\n";

struct Config : BenchShape {  // heads, kv_heads, head_dim, index_dim, params
  std::vector<int64_t> contexts;
  int64_t chunk;
  int repeats, dense_repeats, decode_repeats;
  std::string json_path;
};

struct Timing {
  double median_ms, cv;
};

// Median and coefficient of variation of `repeats` timed calls after one warm-up call.
Timing time_calls(int repeats, const std::function<void(int)>& call) {
  call(0);
  std::vector<double> ms;
  for (int i = 1; i <= repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call(i);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                          : 0.5 * (sorted[sorted.size() / 2 - 1] +
                                                   sorted[sorted.size() / 2]);
  double mean = 0, var = 0;
  for (double x : ms) mean += x / ms.size();
  for (double x : ms) var += (x - mean) * (x - mean) / ms.size();
  return {median, mean > 0 ? std::sqrt(var) / mean : 0};
}

// Cache copies of one context, rotated between timed calls.
struct Workload {
  std::vector<PagedKvCache> caches;
  Tensor q, qi, cu_seqlens_q;
};

Workload make_workload(const Config& config, int64_t context, int64_t queries, uint64_t seed) {
  const int64_t B = config.params.block_size;
  const int64_t pages = (context + B - 1) / B;
  const double cache_bytes =
      4.0 * pages * B * (2 * config.kv_heads * config.head_dim + config.index_dim);
  const int copies = static_cast<int>(std::clamp(std::ceil(256e6 / cache_bytes), 1.0, 8.0));
  Workload work;
  for (int c = 0; c < copies; ++c) {
    const uint64_t s = seed * 1000 + c * 10;
    work.caches.push_back(PagedKvCache{
        .k_cache = random_normal_tensor({pages, config.kv_heads, B, config.head_dim}, s + 1),
        .v_cache = random_normal_tensor({pages, config.kv_heads, B, config.head_dim}, s + 2),
        .index_key_cache = random_normal_tensor({pages, B, config.index_dim}, s + 3),
        .page_table = random_permutation(pages, s + 4).reshape({1, pages}),
        .seq_lens = Tensor::from_vector(std::vector<int32_t>{static_cast<int32_t>(context)}, {1}),
    });
  }
  work.q = random_normal_tensor({queries, config.heads, config.head_dim}, seed * 1000 + 5);
  work.qi = random_normal_tensor({queries, config.kv_heads, config.index_dim}, seed * 1000 + 6);
  work.cu_seqlens_q =
      Tensor::from_vector(std::vector<int32_t>{0, static_cast<int32_t>(queries)}, {2});
  return work;
}

// Useful FLOPs (multiply-add = 2) of each stage for the last `queries` positions of `context`.
struct Flops {
  double indexer = 0, sparse = 0, dense = 0;
};

Flops count_flops(const Config& config, int64_t context, int64_t queries, const Tensor& topk) {
  const int64_t B = config.params.block_size, D = config.head_dim;
  const int64_t G = config.heads / config.kv_heads;
  Flops flops;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t pos = context - queries + i;
    flops.dense += 4.0 * D * config.heads * (pos + 1);
    flops.indexer += 2.0 * config.index_dim * config.kv_heads * (pos / B) * B;
    for (int64_t g = 0; g < config.kv_heads; ++g) {
      const int32_t* row = topk.data<int32_t>() + (g * queries + i) * topk.size(2);
      for (int64_t s = 0; s < topk.size(2) && row[s] >= 0; ++s)
        flops.sparse += 4.0 * D * G * std::min(B, pos - row[s] * B + 1);
    }
  }
  return flops;
}

struct Row {
  int64_t context;
  std::string phase;
  int64_t queries;
  Timing indexer, sparse, msa, dense;
  Flops flops;
  double check_error = -1;  // relative error MSA vs dense when they must agree
};

Row measure(const Config& config, int64_t context, int64_t queries, const std::string& phase,
            uint64_t seed) {
  Workload work = make_workload(config, context, queries, seed);
  const MsaParams& p = config.params;
  const size_t copies = work.caches.size();
  auto cache = [&](int call) -> const PagedKvCache& { return work.caches[call % copies]; };
  const int repeats = phase == "decode" ? config.decode_repeats : config.repeats;
  const int dense_repeats = phase == "decode" ? config.decode_repeats : config.dense_repeats;

  Row row;
  row.context = context;
  row.phase = phase;
  row.queries = queries;
  std::vector<IndexerOutput> selections(copies);
  row.indexer = time_calls(repeats, [&](int call) {
    selections[call % copies] = paged_indexer(work.qi, cache(call), work.cu_seqlens_q, p, Impl::cpu);
  });
  row.sparse = time_calls(repeats, [&](int call) {
    paged_sparse_attention(work.q, cache(call), selections[call % copies].topk, work.cu_seqlens_q,
                           p, Impl::cpu);
  });
  AttentionOutput msa_out, dense_out;
  // paged_msa_attention: indexer + sparse attention, or the dense path where they are equal.
  row.msa = time_calls(repeats, [&](int call) {
    msa_out = paged_msa_attention(work.q, work.qi, cache(call), work.cu_seqlens_q, p, Impl::cpu)
                  .attention;
  });
  row.dense = time_calls(dense_repeats, [&](int call) {
    dense_out = paged_dense_attention(work.q, cache(call), work.cu_seqlens_q, p, Impl::cpu);
  });
  row.flops = count_flops(config, context, queries, selections[0].topk);
  if (msa_equals_dense(context, p.topk, p.block_size)) {
    // Both outputs come from the same cache copy only when the last calls used the same one.
    const AttentionOutput msa_last = paged_sparse_attention(
        work.q, cache(0), paged_indexer(work.qi, cache(0), work.cu_seqlens_q, p, Impl::cpu).topk,
        work.cu_seqlens_q, p, Impl::cpu);
    const AttentionOutput dense_last = paged_dense_attention(work.q, cache(0), work.cu_seqlens_q, p,
                                                             Impl::cpu);
    double diff = 0, norm = 0;
    const float* a = msa_last.o.data<float>();
    const float* b = dense_last.o.data<float>();
    for (int64_t i = 0; i < msa_last.o.numel(); ++i) {
      diff += (a[i] - b[i]) * double(a[i] - b[i]);
      norm += b[i] * double(b[i]);
    }
    row.check_error = std::sqrt(diff / norm);
  }
  return row;
}

std::string format_rate(double flops, double ms, double peak) {
  char text[64];
  const double gflops = flops / (ms * 1e-3) / 1e9;
  std::snprintf(text, sizeof text, "%.1f (%.0f%%)", gflops, 100.0 * gflops / peak);
  return text;
}

void print_table(const std::vector<Row>& rows, const MachinePeak& peak) {
  std::printf(
      "\n| context | phase | queries | indexer ms | sparse ms | MSA ms (cv) | dense ms (cv) | "
      "speed-up | indexer GFLOP/s (%% peak) | sparse GFLOP/s | dense GFLOP/s | MSA == dense |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    char check[32] = "n/a (N > k*B)";
    if (r.check_error >= 0) std::snprintf(check, sizeof check, "rel err %.1e", r.check_error);
    std::printf("| %lld | %s | %lld | %.3f | %.3f | %.3f (%.2f) | %.3f (%.2f) | %.1fx | %s | %s | %s | %s |\n",
                static_cast<long long>(r.context), r.phase.c_str(),
                static_cast<long long>(r.queries), r.indexer.median_ms, r.sparse.median_ms,
                r.msa.median_ms, r.msa.cv, r.dense.median_ms, r.dense.cv,
                r.dense.median_ms / r.msa.median_ms,
                format_rate(r.flops.indexer, r.indexer.median_ms, peak.gflops).c_str(),
                format_rate(r.flops.sparse, r.sparse.median_ms, peak.gflops).c_str(),
                format_rate(r.flops.dense, r.dense.median_ms, peak.gflops).c_str(), check);
  }
}

void write_json(const std::string& path, const std::vector<Row>& rows, const MachinePeak& peak,
                const Config& config) {
  std::ofstream out(path);
  if (!out) throw Error("--json: cannot write \"" + path + "\"");
  for (const Row& r : rows) {
    char line[1024];
    std::snprintf(line, sizeof line,
                  "{\"device\":\"cpu\",\"threads\":%d,\"context\":%lld,\"phase\":\"%s\","
                  "\"queries\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"head_dim\":%lld,"
                  "\"index_dim\":%lld,\"block_size\":%d,\"topk\":%d,"
                  "\"indexer_ms\":%.4f,\"sparse_ms\":%.4f,\"msa_ms\":%.4f,\"msa_cv\":%.4f,"
                  "\"dense_ms\":%.4f,\"dense_cv\":%.4f,\"speedup\":%.3f,"
                  "\"indexer_flops\":%.6e,\"sparse_flops\":%.6e,\"dense_flops\":%.6e,"
                  "\"peak_gflops\":%.2f,\"read_gb_per_s\":%.2f,\"check_rel_err\":%.3e}\n",
                  num_threads(), static_cast<long long>(r.context), r.phase.c_str(),
                  static_cast<long long>(r.queries), static_cast<long long>(config.heads),
                  static_cast<long long>(config.kv_heads), static_cast<long long>(config.head_dim),
                  static_cast<long long>(config.index_dim), config.params.block_size,
                  config.params.topk, r.indexer.median_ms, r.sparse.median_ms, r.msa.median_ms,
                  r.msa.cv, r.dense.median_ms, r.dense.cv, r.dense.median_ms / r.msa.median_ms,
                  r.flops.indexer, r.flops.sparse, r.flops.dense, peak.gflops, peak.read_gb_per_s,
                  r.check_error);
    out << line;
  }
}

Config parse_config(Args& args) {
  Config config;
  const std::string device = args.get_string("device", "cpu");
  if (device != "cpu")
#ifdef MSA_WITH_CUDA
    throw UsageError("--device: expected cpu or cuda, got \"" + device + "\"");
#else
    throw UsageError("--device: expected cpu (this build has no CUDA backend), got \"" + device + "\"");
#endif
  config.contexts = args.get_positive_list("contexts", "2048,8192,32768,131072", int64_t{1} << 22);
  config.chunk = args.get_int("chunk", 256, 1, 1 << 20);
  static_cast<BenchShape&>(config) = read_bench_shape(args);
  config.repeats = args.get_int("repeats", 5, 1, 100000);
  config.dense_repeats = args.get_int("dense-repeats", 3, 1, 100000);
  config.decode_repeats = args.get_int("decode-repeats", 20, 1, 100000);
  const int threads = args.get_threads();
  config.json_path = args.get_string("json", "");
  args.finish();
  try {
    validate_params(config.params);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  if (config.kv_heads < 1 || config.heads % config.kv_heads != 0)
    throw UsageError("--heads: expected a multiple of --kv-heads");
  set_num_threads(threads);
  return config;
}

}  // namespace
}  // namespace msa::cli

int run_bench_command(int argc, char** argv) {
  using namespace msa;
  using namespace msa::cli;
  return run_reporting_errors("bench", kUsage, [&] {
    Args args(argc, argv, {"help", "training", "sparse-orders"});  // the CUDA bench's switches
#ifdef MSA_WITH_CUDA
    if (args.get_string("device", "cpu") == "cuda") return run_bench_cuda(args);
#endif
    if (args.get_switch("help")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    const Config config = parse_config(args);
    std::fprintf(stderr, "[bench] measuring this machine's peak ...\n");
    const MachinePeak peak = measure_machine_peak();
    std::printf("msa bench: cpu, %d threads; measured peak %.1f GFLOP/s (f32 FMA, 8 lanes), "
                "read %.1f GB/s\n",
                num_threads(), peak.gflops, peak.read_gb_per_s);
    std::printf("shape: Hq %lld, Hkv %lld, D %lld, Hi %lld, Di %lld, block %d, top-%d, local %d, "
                "init %d; f32; prefill = the last %lld queries of the context\n",
                static_cast<long long>(config.heads), static_cast<long long>(config.kv_heads),
                static_cast<long long>(config.head_dim), static_cast<long long>(config.kv_heads),
                static_cast<long long>(config.index_dim), config.params.block_size,
                config.params.topk, config.params.local_blocks, config.params.init_blocks,
                static_cast<long long>(config.chunk));
    std::vector<Row> rows;
    bool check_failed = false;
    uint64_t seed = 1;
    for (int64_t context : config.contexts) {
      for (const char* phase : {"prefill", "decode"}) {
        const int64_t queries = std::string(phase) == "decode" ? 1 : std::min(config.chunk, context);
        std::fprintf(stderr, "[bench] context %lld, %s (%lld queries) ...\n",
                     static_cast<long long>(context), phase, static_cast<long long>(queries));
        rows.push_back(measure(config, context, queries, phase, seed++));
        const Row& r = rows.back();
        std::fprintf(stderr, "[bench]   MSA %.3f ms, dense %.3f ms, %.1fx\n", r.msa.median_ms,
                     r.dense.median_ms, r.dense.median_ms / r.msa.median_ms);
        if (r.check_error > 1e-5) check_failed = true;
      }
    }
    print_table(rows, peak);
    if (!config.json_path.empty()) write_json(config.json_path, rows, peak, config);
    if (check_failed) {
      std::fprintf(stderr, "msa bench: error: MSA and dense attention disagree where every "
                           "context is <= topk * block-size (see the last column)\n");
      return 1;
    }
    return 0;
  });
}
