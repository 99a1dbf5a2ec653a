// msa bench --device cuda --training: the training-side kernels at M3's shape (by default
// Hq 64, Hkv 4, D 128, Di 128, B 128, k 16) on packed varlen batches (q_len == k_len per
// sequence): the training indexer (selection rows + selected LSE), sparse forward
// (cuda::attention with LSE), sparse backward (deterministic and fast), KL backward
// (deterministic and fast; and the deterministic pair handing the KL its teacher from the
// backward), one layer's whole training step (the chain of those launches),
// and the dense baselines: our dense causal forward and backward (both modes) and cuDNN's
// SDPA forward + backward (training_cudnn.cpp). Selection rows of the stage timings: random
// valid rows (own block last, the init / local blocks forced, the rest drawn uniformly from
// the sequence's earlier blocks), checked by count_selection; the step uses its indexer's
// rows. Times are medians of CUDA-event timed calls after warm-up; one input set (every call
// touches GBs, far beyond L2). Useful FLOPs and tables: training_report.cpp. Gates: fast-mode
// dQ (sparse, dense) and dki, and the handed-over teacher's KL loss and dki, within --tolerance
// (relative L2) of the deterministic ones, our
// dense O against cuDNN's, the KL loss and dki finite, selection rows well formed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_cuda/common.h"
#include "bench_cuda/inputs.h"
#include "bench_cuda/training.h"
#include "bench_cuda/bench_kernels.h"
#include "cuda/training/backward_launch.h"
#include "cuda/training/kl_launch.h"
#include "msa/cuda/training.h"  // backward_writes_kl_teacher

namespace msa::cli::bench_cuda {

namespace {

// "32768,131072,8x16384" -> layouts.
std::vector<TrainingLayout> parse_layouts(const std::string& text) {
  std::vector<TrainingLayout> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    TrainingLayout l;
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

TrainingRow measure(Session& s, const TrainingLayout& layout) {
  const Config& c = s.config;
  const int64_t Hq = c.heads, Hkv = c.kv_heads, D = c.head_dim, Di = c.index_dim;
  const int64_t B = c.params.block_size, k = c.params.topk;
  const int64_t n = layout.tokens, total = layout.batch * n;
  TrainingRow row;
  row.layout = layout;
  const size_t q_elems = static_cast<size_t>(total * Hq * D), kv_elems = static_cast<size_t>(total * Hkv * D);
  const size_t rows = static_cast<size_t>(total * Hq);
  const size_t qi_elems = static_cast<size_t>(total * Hkv * Di), ki_elems = static_cast<size_t>(total * Di);
  const size_t topk_elems = static_cast<size_t>(Hkv * total * k);

  Geometry geometry(layout.batch, n, n);
  DeviceBuffer q(q_elems * 2), kk(kv_elems * 2), v(kv_elems * 2), o_bf16(q_elems * 2), grad_o(q_elems * 2);
  DeviceBuffer qi(qi_elems * 2), ki(ki_elems * 2);
  uint64_t seed = s.seed;
  for (DeviceBuffer* b : {&q, &kk, &v, &o_bf16, &grad_o, &qi, &ki}) fill_normal(*b, seed++, s.stream);
  s.seed = seed;
  const std::vector<int32_t> host_topk = random_selection(Hkv, layout.batch, n, c.params, s.seed++);
  const DeviceBuffer topk = DeviceBuffer::from(host_topk);
  DeviceBuffer o(q_elems * 4), lse_sparse(rows * 4), lse_dense(rows * 4);
  DeviceBuffer dq(q_elems * 4), dq_fast(q_elems * 4), dk(kv_elems * 4), dv(kv_elems * 4);
  // The KL's outputs (dki twice: deterministic and fast) and the step's own indexer rows.
  DeviceBuffer loss(sizeof(float)), dqi(qi_elems * 4), dki(ki_elems * 4), dki_fast(ki_elems * 4);
  DeviceBuffer topk_step(topk_elems * 4), index_lse(static_cast<size_t>(Hkv * total) * 4);
  // The KL's teacher as the backward writes it (AttentionBackwardLaunch::kl_teacher), where the
  // group size lets it; the KL reading it writes its own loss and dki.
  const bool fused_teacher = cuda::backward_writes_kl_teacher(Hq / Hkv);
  DeviceBuffer teacher(fused_teacher ? topk_elems * static_cast<size_t>(B) * 4 : 0);
  DeviceBuffer loss_teacher(sizeof(float)), dki_teacher(fused_teacher ? ki_elems * 4 : 0);

  cuda::AttentionLaunch fwd;
  set_sparse_inputs(fwd, c, q, varlen_keys(kk, Hkv, D, B, geometry.k_start),
                    varlen_keys(v, Hkv, D, B, geometry.k_start), geometry.layout, topk);
  fwd.o = o.as<float>();
  fwd.lse = lse_sparse.as<float>();
  cuda::AttentionLaunch dense_fwd = dense_of(fwd);
  dense_fwd.lse = lse_dense.as<float>();

  cuda::AttentionBackwardLaunch bwd;
  set_sparse_inputs(bwd, c, q, fwd.k, fwd.v, geometry.layout, topk);
  bwd.o = o_bf16.as<uint16_t>();  // random bf16 O: Delta's value does not change the work
  bwd.grad_o = grad_o.as<uint16_t>();
  bwd.lse = lse_sparse.as<float>();
  bwd.total_k = total;
  bwd.dq = dq.as<float>();
  bwd.dk = dk.as<float>();
  bwd.dv = dv.as<float>();
  bwd.engine = c.backward_engine;  // --backward-engine (the dense launches copy it)
  cuda::AttentionBackwardLaunch sparse_fast = bwd;
  sparse_fast.deterministic = false;
  sparse_fast.dq = dq_fast.as<float>();
  cuda::AttentionBackwardLaunch dense_det = dense_of(bwd);
  dense_det.lse = lse_dense.as<float>();
  cuda::AttentionBackwardLaunch dense_fast = dense_det;
  dense_fast.deterministic = false;
  dense_fast.dq = dq_fast.as<float>();

  // The indexer into the step's rows: ranking only (index_rows, as msa::training_step on CUDA
  // runs it: the KL computes the selected LSE), and the training indexer with lse_out (index).
  const cuda::KeyLayout ki_layout = varlen_keys(ki, 1, Di, B, geometry.k_start);
  cuda::IndexerLaunch index = indexer_params(c, qi, ki_layout, geometry.layout, topk_step);
  const cuda::IndexerLaunch index_rows = index;
  index.lse_out = index_lse.as<float>();

  // KL backward over the random rows, teacher LSE from the sparse forward of those rows.
  cuda::IndexerKlLaunch kl;
  kl.q = q.as<uint16_t>();
  kl.k = fwd.k;
  kl.main_lse = lse_sparse.as<float>();
  kl.qi = qi.as<uint16_t>();
  kl.ki = ki_layout;
  kl.q_heads = Hq;
  kl.kv_heads = Hkv;
  kl.head_dim = D;
  kl.index_dim = Di;
  kl.batch = geometry.layout;
  kl.total_k = total;
  kl.topk = topk.as<int32_t>();
  kl.slots = k;
  kl.block_size = static_cast<int>(B);
  kl.scale = main_scale(c);
  kl.logit_scale = index_logit_scale(c);
  kl.loss_scale = c.params.kl_coefficient / static_cast<double>(Hkv * total);
  kl.loss = loss.as<float>();
  kl.dqi = dqi.as<float>();
  kl.dki = dki.as<float>();
  cuda::IndexerKlLaunch kl_fast = kl;
  kl_fast.deterministic = false;
  kl_fast.dki = dki_fast.as<float>();
  // The deterministic backward and KL handing the teacher over (null pointers: not run).
  cuda::AttentionBackwardLaunch bwd_teacher = bwd;
  bwd_teacher.kl_teacher = teacher.as<float>();
  cuda::IndexerKlLaunch kl_teacher = kl;
  kl_teacher.teacher = teacher.as<float>();
  kl_teacher.loss = loss_teacher.as<float>();
  kl_teacher.dki = dki_teacher.as<float>();

  // The step, as msa::training_step on CUDA chains it: the indexer ranking only, the sparse
  // forward, O to bf16, the backward (reading the real O) handing the KL its teacher where the
  // group size lets it, and the KL computing the selected index LSE. For comparison:
  // step_index_lse takes the LSE from the indexer (lse_out) instead, step_recompute lets the KL
  // recompute its teacher.
  cuda::AttentionLaunch step_fwd = fwd;
  step_fwd.topk = topk_step.as<int32_t>();
  cuda::AttentionBackwardLaunch step_bwd = bwd;
  step_bwd.topk = topk_step.as<int32_t>();
  cuda::IndexerKlLaunch step_kl = kl;
  step_kl.topk = topk_step.as<int32_t>();
  const cuda::AttentionBackwardLaunch step_bwd_recompute = step_bwd;
  const cuda::IndexerKlLaunch step_kl_recompute = step_kl;
  if (fused_teacher) {
    step_bwd.kl_teacher = teacher.as<float>();
    step_kl.teacher = teacher.as<float>();
  }
  cuda::IndexerKlLaunch step_kl_index_lse = step_kl;
  step_kl_index_lse.student_lse = index.lse_out;
  cuda::AttentionBackwardLaunch step_bwd_fast = step_bwd;
  step_bwd_fast.deterministic = false;
  step_bwd_fast.dq = dq_fast.as<float>();
  cuda::IndexerKlLaunch step_kl_fast = step_kl;
  step_kl_fast.deterministic = false;
  step_kl_fast.dki = dki_fast.as<float>();

  size_t ws_bytes = std::max(cuda::attention_workspace_bytes(fwd), cuda::attention_workspace_bytes(dense_fwd));
  for (const auto* p : {&bwd, &sparse_fast, &dense_det, &dense_fast, &bwd_teacher, &step_bwd_fast})
    ws_bytes = std::max(ws_bytes, cuda::attention_backward_workspace_bytes(*p));
  ws_bytes = std::max({ws_bytes, cuda::indexer_workspace_bytes(index), cuda::indexer_kl_workspace_bytes(kl),
                       cuda::indexer_kl_workspace_bytes(kl_fast), cuda::indexer_kl_workspace_bytes(kl_teacher),
                       cuda::indexer_kl_workspace_bytes(step_kl_fast)});
  DeviceBuffer workspace(ws_bytes);
  MSA_CUDA_CHECK(cudaDeviceSynchronize());

  const SelectionCount count = count_selection(host_topk, Hkv, layout.batch, n, n, k, B, D);
  row.malformed = count.malformed;
  row.kl_entries = count.keys;
  row.sparse_pairs = count.keys * static_cast<double>(Hq / Hkv);
  row.dense_pairs = static_cast<double>(layout.batch) * 0.5 * static_cast<double>(n) * (n + 1) * Hq;

  auto& st = s.stream;
  const int repeats = c.repeats;
  const int dense_repeats = c.dense_repeats > 0 ? c.dense_repeats : (n * layout.batch >= 65536 ? 5 : 20);
  const bool run_dense = c.dense_max_context == 0 || n <= c.dense_max_context;
  const auto timed = [&](const std::string& what, int count_runs, const std::function<void()>& call) {
    std::fprintf(stderr, "[bench]   %s, %d runs ...\n", what.c_str(), count_runs);
    return time_events(st, std::max(c.warmup, 1), count_runs, [&](int) { call(); });
  };
  // For either kind the deterministic backward writes dq, the fast one dq_fast.
  const auto time_kind = [&](const std::string& kind, int runs, const cuda::AttentionLaunch& forward,
                             const cuda::AttentionBackwardLaunch& det, const cuda::AttentionBackwardLaunch& fast) {
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
  // The sparse forward runs last before the KL stage, so lse_sparse is its teacher LSE; the
  // dense forward leaves its O in `o` for the cuDNN comparison.
  if (run_dense) row.dense = time_kind("dense", dense_repeats, dense_fwd, dense_det, dense_fast);
  // cuDNN's backward checked against ours on the same O (cuDNN's) and our dense LSE.
  const DenseDqCheck dense_dq_against = [&](const void* cudnn_o, const void* cudnn_dq) {
    cuda::AttentionBackwardLaunch p = dense_det;
    p.o = static_cast<const uint16_t*>(cudnn_o);
    cuda::attention_backward(p, workspace.get(), st);
    return cuda::bench::relative_l2_error(dq.as<float>(), cudnn_dq, true, q_elems, st);
  };
  if (run_dense && c.cudnn)
    measure_cudnn_training(s, q, kk, v, grad_o, o.as<float>(), dense_dq_against, dense_repeats, row);
  else
    row.cudnn_note = !c.cudnn ? "off (--cudnn 0)" : "skipped (--dense-max-context)";
  row.sparse = time_kind("sparse", repeats, fwd, bwd, sparse_fast);
  if (fused_teacher)  // leaves the random rows' teacher in `teacher` for the KL below
    row.bwd_det_teacher = timed("sparse backward (deterministic, writing the KL teacher)", repeats,
                                [&] { cuda::attention_backward(bwd_teacher, workspace.get(), st); });

  row.indexer = timed("training indexer (rows + selected LSE)", repeats,
                      [&] { cuda::indexer(index, workspace.get(), st); });
  row.kl_det = timed("KL backward (deterministic)", repeats, [&] { cuda::indexer_kl(kl, workspace.get(), st); });
  {  // cheap KL gate: the loss and dki finite (the GPU tests cover accuracy)
    MSA_CUDA_CHECK(cudaStreamSynchronize(st));
    float host_loss = NAN;
    loss.download(&host_loss, sizeof host_loss);
    std::vector<float> host_dki(ki_elems);
    dki.download(host_dki.data(), ki_elems * sizeof(float));
    row.kl_loss = host_loss;
    row.kl_nonfinite = std::isfinite(host_loss) ? 0 : 1;
    for (float x : host_dki) row.kl_nonfinite += std::isfinite(x) ? 0 : 1;
  }
  row.kl_fast = timed("KL backward (fast)", repeats, [&] { cuda::indexer_kl(kl_fast, workspace.get(), st); });
  row.err_dki = cuda::bench::relative_l2_error(dki_fast.as<float>(), dki.get(), false, ki_elems, st);
  if (fused_teacher) {
    row.kl_det_teacher = timed("KL backward (deterministic, the backward's teacher)", repeats,
                               [&] { cuda::indexer_kl(kl_teacher, workspace.get(), st); });
    row.err_dki_teacher = cuda::bench::relative_l2_error(dki_teacher.as<float>(), dki.get(), false, ki_elems, st);
    MSA_CUDA_CHECK(cudaStreamSynchronize(st));
    float host_loss = NAN;
    loss_teacher.download(&host_loss, sizeof host_loss);
    row.err_loss_teacher = std::fabs(host_loss - row.kl_loss) / std::max(std::fabs(row.kl_loss), 1e-30);
  }

  row.convert_o = timed("O f32 -> bf16", repeats,
                        [&] { cuda::bench::f32_to_bf16(o.as<float>(), o_bf16.as<uint16_t>(), q_elems, st); });
  const auto time_step = [&](const std::string& what, const cuda::IndexerLaunch& step_index,
                             const cuda::AttentionBackwardLaunch& step_backward,
                             const cuda::IndexerKlLaunch& step_kl_launch) {
    return timed("MSA training step (" + what + ")", repeats, [&] {
      cuda::indexer(step_index, workspace.get(), st);
      cuda::attention(step_fwd, workspace.get(), st);
      cuda::bench::f32_to_bf16(o.as<float>(), o_bf16.as<uint16_t>(), q_elems, st);
      cuda::attention_backward(step_backward, workspace.get(), st);
      cuda::indexer_kl(step_kl_launch, workspace.get(), st);
    });
  };
  row.indexer_rows = timed("indexer (rows only)", repeats, [&] { cuda::indexer(index_rows, workspace.get(), st); });
  row.step = time_step("as msa::training_step", index_rows, step_bwd, step_kl);
  row.step_fast = time_step("fast modes", index_rows, step_bwd_fast, step_kl_fast);
  row.step_index_lse = time_step("the index LSE from the indexer", index, step_bwd, step_kl_index_lse);
  if (fused_teacher)
    row.step_recompute = time_step("the KL recomputing its teacher", index_rows, step_bwd_recompute, step_kl_recompute);
  MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  row.step_malformed = count_selection(download_i32(topk_step), Hkv, layout.batch, n, n, k, B, D).malformed;
  return row;
}

}  // namespace

int run_training_bench(Session& s) {
  const Config& c = s.config;
  std::vector<TrainingRow> rows;
  bool failed = false;
  for (const TrainingLayout& layout : parse_layouts(c.training_seqs)) {
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
    failed |= training_row_failed(rows.back(), c.tolerance);
  }
  print_training(rows, c, s.machine);
  std::printf("\ntraining correctness gates: %s\n", failed ? "FAILED" : "passed");
  if (!c.json_path.empty()) write_training_json(c.json_path, rows, c, s.machine);
  if (failed) std::fprintf(stderr, "msa bench: error: a training gate failed or a row errored\n");
  return failed ? 1 : 0;
}

}  // namespace msa::cli::bench_cuda
