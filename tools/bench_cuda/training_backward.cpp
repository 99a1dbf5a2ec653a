// msa bench --device cuda --training: the training-side attention kernels at M3's shape
// (by default Hq 64, Hkv 4, D 128, B 128, k 16) on packed varlen batches (q_len == k_len per
// sequence): sparse forward (cuda::attention with LSE), sparse backward (deterministic and
// fast), dense causal forward and backward (both modes). Selection rows: random valid rows
// (own block last, the init / local blocks forced, the rest drawn uniformly from the
// sequence's earlier blocks), checked by count_selection. Times are medians of CUDA-event
// timed calls after warm-up; one input set (every call touches GBs, far beyond L2).
// Useful FLOPs: forward 2 (D + D) per (query head, visible key) pair, backward
// 2 (3 D + 2 D) (S and dP recomputed, dQ, dK, dV); sparse pairs are the selected visible
// keys, dense pairs the causal ones. Gates: fast-mode dQ within --tolerance (relative L2) of
// the deterministic dQ, sparse and dense; selection rows well formed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_cuda/inputs.h"
#include "cuda/bench_kernels.h"
#include "cuda/launch_backward.h"

namespace msa::cli::bench_cuda {

namespace {

struct Layout {
  int64_t batch = 1, tokens = 0;  // `batch` sequences of `tokens` tokens, all of them queries
  std::string name() const {
    return batch == 1 ? std::to_string(tokens) : std::to_string(batch) + "x" + std::to_string(tokens);
  }
};

// "32768,131072,8x16384" -> layouts.
std::vector<Layout> parse_layouts(const std::string& text) {
  std::vector<Layout> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    Layout l;
    const size_t x = item.find('x');
    try {
      if (x == std::string::npos) {
        l.tokens = std::stoll(item);
      } else {
        l.batch = std::stoll(item.substr(0, x));
        l.tokens = std::stoll(item.substr(x + 1));
      }
    } catch (const std::exception&) {
      throw UsageError("--training-seqs: expected items N or BxN, got '" + item + "'");
    }
    if (l.batch < 1 || l.tokens < 1) throw UsageError("--training-seqs: expected positive sizes, got '" + item + "'");
    out.push_back(l);
  }
  return out;
}

// Random valid selection rows [heads, batch * n, k] for `batch` sequences of n tokens
// (q_len == k_len): the init blocks and the local blocks ending at the own block L are
// forced, the rest are distinct blocks drawn uniformly from the others < L; L in the last
// valid slot, -1 suffix.
std::vector<int32_t> random_selection(int64_t heads, int64_t batch, int64_t n, const MsaParams& params,
                                      uint64_t seed) {
  const int64_t k = params.topk, B = params.block_size;
  std::vector<int32_t> rows(static_cast<size_t>(heads * batch * n * k), -1);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> chosen;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < batch * n; ++r) {
      const int64_t L = (r % n) / B;
      int32_t* row = rows.data() + (h * batch * n + r) * k;
      chosen.clear();
      if (L + 1 <= k) {
        for (int64_t j = 0; j < L; ++j) chosen.push_back(static_cast<int32_t>(j));
      } else {
        const int64_t local_first = std::max<int64_t>(0, L - params.local_blocks + 1);
        for (int64_t j = 0; j < std::min<int64_t>(params.init_blocks, local_first); ++j)
          chosen.push_back(static_cast<int32_t>(j));
        for (int64_t j = local_first; j < L; ++j) chosen.push_back(static_cast<int32_t>(j));
        const int64_t lo = std::min<int64_t>(params.init_blocks, local_first), span = local_first - lo;
        while (static_cast<int64_t>(chosen.size()) < k - 1 && span > 0) {
          const int32_t j = static_cast<int32_t>(lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(span)));
          if (std::find(chosen.begin(), chosen.end(), j) == chosen.end()) chosen.push_back(j);
        }
      }
      std::copy(chosen.begin(), chosen.end(), row);
      row[chosen.size()] = static_cast<int32_t>(L);
    }
  return rows;
}

// One attention kind (sparse or dense): forward, deterministic and fast backward, and the
// fast dQ's relative L2 error against the deterministic dQ (-1: not run).
struct KindTimes {
  Timing forward, det, fast;
  double err_dq = -1;
};

struct TrainingRow {
  Layout layout;
  KindTimes sparse, dense;
  double sparse_pairs = 0, dense_pairs = 0;  // (query head, visible key) pairs
  int64_t malformed = -1;
  std::string error;
};

TrainingRow measure(Session& s, const Layout& layout) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, B = c.params.block_size, k = c.params.topk;
  const int64_t n = layout.tokens, total = layout.batch * n;
  TrainingRow row;
  row.layout = layout;
  const size_t q_elems = static_cast<size_t>(total * Hq * D), kv_elems = static_cast<size_t>(total * Hkv * D);
  const size_t rows = static_cast<size_t>(total * Hq);

  Geometry geometry(layout.batch, n, n);
  DeviceBuffer q(q_elems * 2), kk(kv_elems * 2), v(kv_elems * 2), o_bf16(q_elems * 2), grad_o(q_elems * 2);
  uint64_t seed = s.seed;
  for (DeviceBuffer* b : {&q, &kk, &v, &o_bf16, &grad_o}) fill_normal(*b, seed++, s.stream);
  s.seed = seed;
  const std::vector<int32_t> host_topk = random_selection(Hkv, layout.batch, n, c.params, s.seed++);
  const DeviceBuffer topk = DeviceBuffer::from(host_topk);
  DeviceBuffer o(q_elems * 4), lse_sparse(rows * 4), lse_dense(rows * 4);
  DeviceBuffer dq(q_elems * 4), dq_fast(q_elems * 4), dk(kv_elems * 4), dv(kv_elems * 4);

  cuda::AttentionParams fwd;
  set_sparse_inputs(fwd, c, q, varlen_keys(kk, Hkv, D, B, geometry.k_start),
                    varlen_keys(v, Hkv, D, B, geometry.k_start), geometry.layout, topk);
  fwd.o = o.as<float>();
  fwd.lse = lse_sparse.as<float>();
  cuda::AttentionParams dense_fwd = dense_of(fwd);
  dense_fwd.lse = lse_dense.as<float>();

  cuda::AttentionBackwardParams bwd;
  set_sparse_inputs(bwd, c, q, fwd.k, fwd.v, geometry.layout, topk);
  bwd.o = o_bf16.as<uint16_t>();  // random bf16 O: Delta's value does not change the work
  bwd.grad_o = grad_o.as<uint16_t>();
  bwd.lse = lse_sparse.as<float>();
  bwd.total_k = total;
  bwd.dq = dq.as<float>();
  bwd.dk = dk.as<float>();
  bwd.dv = dv.as<float>();
  cuda::AttentionBackwardParams sparse_fast = bwd;
  sparse_fast.deterministic = false;
  sparse_fast.dq = dq_fast.as<float>();
  cuda::AttentionBackwardParams dense_det = dense_of(bwd);
  dense_det.lse = lse_dense.as<float>();
  cuda::AttentionBackwardParams dense_fast = dense_det;
  dense_fast.deterministic = false;
  dense_fast.dq = dq_fast.as<float>();

  size_t ws_bytes = std::max(cuda::attention_workspace_bytes(fwd), cuda::attention_workspace_bytes(dense_fwd));
  for (const auto* p : {&bwd, &sparse_fast, &dense_det, &dense_fast})
    ws_bytes = std::max(ws_bytes, cuda::attention_backward_workspace_bytes(*p));
  DeviceBuffer workspace(ws_bytes);
  MSA_CUDA_CHECK(cudaDeviceSynchronize());

  const SelectionCount count = count_selection(host_topk, Hkv, layout.batch, n, n, k, B, D);
  row.malformed = count.malformed;
  row.sparse_pairs = count.keys * static_cast<double>(Hq / Hkv);
  row.dense_pairs = static_cast<double>(layout.batch) * 0.5 * static_cast<double>(n) * (n + 1) * Hq;

  auto& st = s.stream;
  const int repeats = c.repeats;
  const int dense_repeats = c.dense_repeats > 0 ? c.dense_repeats : (n * layout.batch >= 65536 ? 5 : 20);
  const auto timed = [&](const std::string& what, int count_runs, const std::function<void()>& call) {
    std::fprintf(stderr, "[bench]   %s, %d runs ...\n", what.c_str(), count_runs);
    return time_events(st, std::max(c.warmup, 1), count_runs, [&](int) { call(); });
  };
  // For either kind the deterministic backward writes dq, the fast one dq_fast.
  const auto time_kind = [&](const std::string& kind, int runs, const cuda::AttentionParams& forward,
                             const cuda::AttentionBackwardParams& det, const cuda::AttentionBackwardParams& fast) {
    KindTimes t;
    t.forward = timed(kind + " forward", runs, [&] { cuda::attention(forward, workspace.get(), st); });
    t.det = timed(kind + " backward (deterministic)", runs,
                  [&] { cuda::attention_backward(det, workspace.get(), st); });
    t.fast = timed(kind + " backward (fast)", runs, [&] { cuda::attention_backward(fast, workspace.get(), st); });
    t.err_dq = cuda::bench::relative_l2_error(dq_fast.as<float>(), dq.get(), false, q_elems, st);
    return t;
  };
  std::fprintf(stderr, "[bench] training %s (%lld tokens): workspace %.2f GB\n", layout.name().c_str(),
               static_cast<long long>(total), ws_bytes / 1e9);
  row.sparse = time_kind("sparse", repeats, fwd, bwd, sparse_fast);
  if (c.dense_max_context == 0 || n <= c.dense_max_context)
    row.dense = time_kind("dense", dense_repeats, dense_fwd, dense_det, dense_fast);
  MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  return row;
}

std::string cell(const Timing& t, double flops) {  // "12.345 (0.01) 123"
  if (!t.ok()) return "- | -";
  char text[96];
  std::snprintf(text, sizeof text, "%.3f (%.2f) | %.0f", t.ms, t.cv, flops / (t.ms * 1e-3) / 1e12);
  return text;
}

std::string error_text(double e) {
  if (e == -1) return "-";
  char text[32];
  std::snprintf(text, sizeof text, "%.1e", e);
  return std::isnan(e) ? "NaN" : text;
}

void print_rows(const std::vector<TrainingRow>& rows, const Config& c, const Machine& m) {
  const int64_t D = c.head_dim;
  std::printf(
      "\ntraining: packed varlen batches (q_len == k_len per sequence), random valid selection rows; ms = "
      "median of CUDA-event timed calls (cv) | TFLOP/s of useful work (measured matmul ceiling %.0f): "
      "forward 4 D per (query head, visible key) pair, backward 10 D; sparse pairs = selected visible keys, "
      "dense = causal pairs. det = deterministic (bitwise reproducible), fast = atomic dQ\n\n"
      "| tokens | sparse fwd ms (cv) | TFLOP/s | sparse bwd det ms (cv) | TFLOP/s | sparse bwd fast ms (cv) | "
      "TFLOP/s | dense fwd ms (cv) | TFLOP/s | dense bwd det ms (cv) | TFLOP/s | dense bwd fast ms (cv) | "
      "TFLOP/s | dQ fast-det err sparse / dense | bad rows |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      m.matmul_tflops);
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) {
      std::printf("| %s | error: %s |\n", r.layout.name().c_str(), r.error.c_str());
      continue;
    }
    const double sf = 4.0 * D * r.sparse_pairs, sb = 10.0 * D * r.sparse_pairs;
    const double df = 4.0 * D * r.dense_pairs, db = 10.0 * D * r.dense_pairs;
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s / %s | %lld |\n", r.layout.name().c_str(),
                cell(r.sparse.forward, sf).c_str(), cell(r.sparse.det, sb).c_str(), cell(r.sparse.fast, sb).c_str(),
                cell(r.dense.forward, df).c_str(), cell(r.dense.det, db).c_str(), cell(r.dense.fast, db).c_str(),
                error_text(r.sparse.err_dq).c_str(), error_text(r.dense.err_dq).c_str(),
                static_cast<long long>(r.malformed));
  }
}

void write_json_rows(const std::string& path, const std::vector<TrainingRow>& rows, const Config& c,
                     const Machine& m) {
  std::ofstream out(path, std::ios::app);
  if (!out) throw Error("--json: cannot open " + path);
  const auto t = [](const Timing& timing) { return timing.ok() ? timing.ms : -1.0; };
  for (const TrainingRow& r : rows) {
    out << "{\"phase\":\"training\",\"gpu\":\"" << m.gpu << "\",\"layout\":\"" << r.layout.name()
        << "\",\"tokens\":" << r.layout.batch * r.layout.tokens << ",\"heads\":" << c.heads
        << ",\"kv_heads\":" << c.kv_heads << ",\"head_dim\":" << c.head_dim
        << ",\"block_size\":" << c.params.block_size << ",\"topk\":" << c.params.topk
        << ",\"sparse_pairs\":" << r.sparse_pairs << ",\"dense_pairs\":" << r.dense_pairs
        << ",\"sparse_forward_ms\":" << t(r.sparse.forward) << ",\"sparse_backward_det_ms\":" << t(r.sparse.det)
        << ",\"sparse_backward_fast_ms\":" << t(r.sparse.fast) << ",\"dense_forward_ms\":" << t(r.dense.forward)
        << ",\"dense_backward_det_ms\":" << t(r.dense.det) << ",\"dense_backward_fast_ms\":" << t(r.dense.fast)
        << ",\"err_sparse_dq\":" << r.sparse.err_dq << ",\"err_dense_dq\":" << r.dense.err_dq
        << ",\"malformed\":" << r.malformed << ",\"error\":\"" << r.error << "\"}\n";
  }
}

}  // namespace

int run_training_bench(Session& s) {
  const Config& c = s.config;
  std::vector<TrainingRow> rows;
  bool failed = false;
  for (const Layout& layout : parse_layouts(c.training_seqs)) {
    try {
      rows.push_back(measure(s, layout));
    } catch (const std::exception& e) {
      TrainingRow r;
      r.layout = layout;
      r.error = e.what();
      rows.push_back(r);
      std::fprintf(stderr, "[bench]   error: %s\n", e.what());
      if (cudaDeviceSynchronize() != cudaSuccess) break;  // the device is unusable
    }
    const TrainingRow& r = rows.back();
    failed |= !r.error.empty() || r.malformed != 0 || check_failed(r.sparse.err_dq, c.tolerance) ||
              check_failed(r.dense.err_dq, c.tolerance);
  }
  print_rows(rows, c, s.machine);
  std::printf("\ncorrectness gates: fast-mode dQ within %.0e (relative L2) of the deterministic dQ; selection "
              "rows well formed: %s\n",
              c.tolerance, failed ? "FAILED" : "passed");
  if (!c.json_path.empty()) write_json_rows(c.json_path, rows, c, s.machine);
  if (failed) std::fprintf(stderr, "msa bench: error: a training gate failed or a row errored\n");
  return failed ? 1 : 0;
}

}  // namespace msa::cli::bench_cuda
