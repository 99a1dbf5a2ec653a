// msa bench --device cuda --training: the training tables on stdout and the --json lines.
// Useful FLOPs (issue 4): forward 2 (D + D) per (query head, selected visible key) pair,
// backward 2 (3 D + 2 D) (S and dP recomputed, dQ, dK, dV), indexer 2 Di Hi per causal
// (query, key) pair, KL 2 (D G + 3 Di) per (query, index head, selected visible key) triple
// (= 2 (D Hq + 3 Di Hi) per selected pair: teacher logits of the group's G query heads,
// student logits, dqi, dki); dense pairs are the causal ones.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_cuda/report_text.h"
#include "bench_cuda/training.h"

namespace msa::cli::bench_cuda {

namespace {

struct Flops {
  double indexer = 0, sparse_fwd = 0, sparse_bwd = 0, kl = 0, dense_fwd = 0, dense_bwd = 0;
};

Flops flops_of(const TrainingRow& r, const Config& c) {
  const double D = static_cast<double>(c.head_dim), Di = static_cast<double>(c.index_dim);
  const double Hq = static_cast<double>(c.heads), Hi = static_cast<double>(c.kv_heads), G = Hq / Hi;
  Flops f;
  f.indexer = 2.0 * Di * Hi * (r.dense_pairs / Hq);
  f.sparse_fwd = 4.0 * D * r.sparse_pairs;
  f.sparse_bwd = 10.0 * D * r.sparse_pairs;
  f.kl = 2.0 * (D * G + 3.0 * Di) * r.kl_entries;
  f.dense_fwd = 4.0 * D * r.dense_pairs;
  f.dense_bwd = 10.0 * D * r.dense_pairs;
  return f;
}

// a + b as one time (medians added; no cv), unset unless both ran.
Timing sum(const Timing& a, const Timing& b) {
  Timing t;
  if (!a.ok() || !b.ok()) return t;
  t.ms = a.ms + b.ms;
  t.runs = std::min(a.runs, b.runs);
  return t;
}

std::string ms_cell(const Timing& t) { return time_cv(t, 1, "%.3f"); }

double percent_of_peak(double work, const Timing& t, double peak) {
  return t.ok() ? 100.0 * work / (t.ms * 1e-3) / 1e12 / peak : NAN;
}

}  // namespace

bool training_row_failed(const TrainingRow& r, double tolerance) {
  return !r.error.empty() || r.malformed != 0 || r.step_malformed > 0 || r.kl_nonfinite > 0 ||
         check_failed(r.sparse.err_dq, tolerance) || check_failed(r.dense.err_dq, tolerance) ||
         check_failed(r.err_dki, tolerance) || check_failed(r.err_dense_cudnn, tolerance) ||
         check_failed(r.err_dq_cudnn, tolerance) || check_failed(r.err_dki_teacher, tolerance) ||
         check_failed(r.err_loss_teacher, tolerance);
}

void print_training(const std::vector<TrainingRow>& rows, const Config& c, const Machine& m) {
  const double peak = m.matmul_tflops;
  std::printf(
      "\ntraining stages: packed varlen batches (q_len == k_len per sequence), random valid selection "
      "rows (indexer: its own rows); ms = median of CUDA-event timed calls (cv); TFLOP/s of useful work "
      "(%% of the measured %.0f TFLOP/s bf16 matmul): indexer 2 Di Hi per causal pair, sparse forward "
      "4 D per (query head, selected visible key), backward 10 D, KL 2 (D G + 3 Di) per (query, index "
      "head, selected visible key) (= 2 (D Hq + 3 Di Hi) per selected pair). indexer = the training "
      "indexer (selection rows + selected LSE, cuda::indexer with lse_out; the step runs it without: see below); det = "
      "deterministic (bitwise reproducible), fast = atomic dQ / dki; O->bf16 = the sparse forward's f32 O "
      "converted for the backward\n\n"
      "| tokens | indexer ms (cv) | TFLOP/s | sparse fwd ms (cv) | TFLOP/s | sparse bwd det ms (cv) | "
      "TFLOP/s | sparse bwd fast ms (cv) | TFLOP/s | KL det ms (cv) | TFLOP/s | KL fast ms (cv) | TFLOP/s | "
      "O->bf16 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      peak);
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) {
      std::printf("| %s | error: %s |\n", r.layout.name().c_str(), r.error.c_str());
      continue;
    }
    const Flops f = flops_of(r, c);
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                r.layout.name().c_str(), ms_cell(r.indexer).c_str(), rate(f.indexer, r.indexer, 1e12, peak).c_str(),
                ms_cell(r.sparse.forward).c_str(), rate(f.sparse_fwd, r.sparse.forward, 1e12, peak).c_str(),
                ms_cell(r.sparse.det).c_str(), rate(f.sparse_bwd, r.sparse.det, 1e12, peak).c_str(),
                ms_cell(r.sparse.fast).c_str(), rate(f.sparse_bwd, r.sparse.fast, 1e12, peak).c_str(),
                ms_cell(r.kl_det).c_str(), rate(f.kl, r.kl_det, 1e12, peak).c_str(), ms_cell(r.kl_fast).c_str(),
                rate(f.kl, r.kl_fast, 1e12, peak).c_str(), ms_cell(r.convert_o).c_str());
  }

  std::printf(
      "\ntraining step vs dense: MSA step = one layer's training step as the chain of device launches "
      "msa::training_step makes on CUDA through the ops (indexer ranking -> sparse forward -> O to bf16 -> sparse "
      "backward det writing the KL's teacher -> KL backward det reading it and computing the index LSE), on device "
      "pointers with no host copies, timed as one call (msa::training_step itself takes host tensors); dense (ours) = cuda::attention / "
      "cuda::attention_backward with topk = null; cuDNN = SDPA forward with stats + SDPA backward "
      "(cuDNN frontend, heuristics A, non-deterministic dQ), causal, bf16; a BxN layout is cuDNN batch B "
      "of length N (equal lengths: the same work as the packed varlen batch). speed-up = dense fwd + bwd "
      "/ MSA step\n\n"
      "| tokens | MSA step ms (cv) | dense fwd ms (cv) | TFLOP/s | dense bwd det ms (cv) | TFLOP/s | "
      "dense bwd fast ms (cv) | TFLOP/s | cuDNN fwd ms (cv) | TFLOP/s | cuDNN bwd ms (cv) | TFLOP/s | "
      "speed-up vs dense (ours, det) | speed-up vs cuDNN |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) continue;
    const Flops f = flops_of(r, c);
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                r.layout.name().c_str(), ms_cell(r.step).c_str(), ms_cell(r.dense.forward).c_str(),
                rate(f.dense_fwd, r.dense.forward, 1e12, peak).c_str(), ms_cell(r.dense.det).c_str(),
                rate(f.dense_bwd, r.dense.det, 1e12, peak).c_str(), ms_cell(r.dense.fast).c_str(),
                rate(f.dense_bwd, r.dense.fast, 1e12, peak).c_str(), ms_cell(r.cudnn_forward).c_str(),
                rate(f.dense_fwd, r.cudnn_forward, 1e12, peak).c_str(), ms_cell(r.cudnn_backward).c_str(),
                rate(f.dense_bwd, r.cudnn_backward, 1e12, peak).c_str(),
                ratio(sum(r.dense.forward, r.dense.det), r.step).c_str(),
                ratio(sum(r.cudnn_forward, r.cudnn_backward), r.step).c_str());
  }

  std::printf("\nthe step's modes: det = as above (msa::training_step's default: every gradient summed in a "
              "fixed order); fast = the same chain with the backward's dQ and the KL's dki added by atomics "
              "(deterministic = false), as cuDNN's backward adds its dQ here\n\n"
              "| tokens | MSA step det ms | MSA step fast ms | cuDNN fwd + bwd ms | det vs cuDNN | fast vs cuDNN |\n"
              "|---|---|---|---|---|---|\n");
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) continue;
    const Timing cudnn = sum(r.cudnn_forward, r.cudnn_backward);
    std::printf("| %s | %s | %s | %s | %s | %s |\n", r.layout.name().c_str(), ms_cell(r.step).c_str(),
                ms_cell(r.step_fast).c_str(), ms_cell(cudnn).c_str(), ratio(cudnn, r.step).c_str(),
                ratio(cudnn, r.step_fast).c_str());
  }

  std::printf("\ntargets (issue 22): sparse forward >= 55%% and sparse backward >= 45%% of the measured "
              "matmul peak; the step's KL (deterministic, the backward's teacher given) <= 0.5x the sparse "
              "forward; the MSA step >= 10x cuDNN's forward + backward at 128K, >= 1.5x at 8 x 16K, >= 1x at 32K\n\n"
              "| tokens | sparse fwd %% of peak | sparse bwd det %% | sparse bwd fast %% | step's KL / sparse fwd | "
              "step speed-up vs cuDNN | vs dense (ours) |\n|---|---|---|---|---|---|---|\n");
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) continue;
    const Flops f = flops_of(r, c);
    const std::string kl_fwd = r.kl_det_teacher.ok() && r.sparse.forward.ok()
                                   ? num(r.kl_det_teacher.ms / r.sparse.forward.ms, "%.2fx")
                                   : "-";
    std::printf("| %s | %s | %s | %s | %s | %s | %s |\n", r.layout.name().c_str(),
                num(percent_of_peak(f.sparse_fwd, r.sparse.forward, peak), "%.0f%%").c_str(),
                num(percent_of_peak(f.sparse_bwd, r.sparse.det, peak), "%.0f%%").c_str(),
                num(percent_of_peak(f.sparse_bwd, r.sparse.fast, peak), "%.0f%%").c_str(),
                kl_fwd.c_str(),
                ratio(sum(r.cudnn_forward, r.cudnn_backward), r.step).c_str(),
                ratio(sum(r.dense.forward, r.dense.det), r.step).c_str());
  }

  std::printf("\nthe KL's teacher handed over by the backward (AttentionBackwardLaunch::kl_teacher -> "
              "IndexerKlLaunch::teacher; group sizes 1, 2, 4, 8, 16), deterministic, random rows: the backward "
              "writing it and the KL reading it instead of recomputing Q K^T and P; step = the whole step both "
              "ways; errors: the handed-over KL's dki (relative L2) and loss (relative) against the KL's own\n\n"
              "| tokens | sparse bwd det ms | + writing the teacher ms | KL det ms | KL det, teacher given ms | "
              "step ms (KL's own teacher) | step ms (handed over) | dki / loss error |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (const TrainingRow& r : rows) {
    if (!r.error.empty() || !r.kl_det_teacher.ok()) continue;
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s / %s |\n", r.layout.name().c_str(),
                ms_cell(r.sparse.det).c_str(), ms_cell(r.bwd_det_teacher).c_str(), ms_cell(r.kl_det).c_str(),
                ms_cell(r.kl_det_teacher).c_str(), ms_cell(r.step_recompute).c_str(), ms_cell(r.step).c_str(),
                error_text(r.err_dki_teacher).c_str(), error_text(r.err_loss_teacher).c_str());
  }

  std::printf("\nthe selected index LSE (the KL's student LSE): from the KL (the indexer ranking only, with "
              "its prefill kernels; the step's default) or from the indexer (lse_out, its LSE-producing scan)\n\n"
              "| tokens | indexer rows only ms | indexer + LSE ms | step ms, LSE from the KL | step ms, LSE from "
              "the indexer |\n|---|---|---|---|---|\n");
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) continue;
    std::printf("| %s | %s | %s | %s | %s |\n", r.layout.name().c_str(), ms_cell(r.indexer_rows).c_str(),
                ms_cell(r.indexer).c_str(), ms_cell(r.step).c_str(), ms_cell(r.step_index_lse).c_str());
  }

  std::printf("\ntraining gates (relative L2 < %.0e where compared): fast vs deterministic dQ (sparse / "
              "dense) and dki; our dense O vs cuDNN's, and our dense dQ (run on cuDNN's O) vs cuDNN's dQ; KL "
              "loss and dki finite; selection rows well formed (random rows / the step's indexer rows)\n\n"
              "| tokens | dQ fast-det sparse / dense | dki fast-det | dense-cuDNN O / dQ | KL loss | KL non-finite | "
              "bad rows (random / indexer) | cuDNN plans (fwd / bwd) |\n|---|---|---|---|---|---|---|---|\n",
              c.tolerance);
  for (const TrainingRow& r : rows) {
    if (!r.error.empty()) continue;
    const std::string plans = r.cudnn_note.empty() ? r.cudnn_plan : r.cudnn_plan + " (" + r.cudnn_note + ")";
    std::printf("| %s | %s / %s | %s | %s / %s | %s | %lld | %lld / %lld | %s |\n", r.layout.name().c_str(),
                error_text(r.sparse.err_dq).c_str(), error_text(r.dense.err_dq).c_str(),
                error_text(r.err_dki).c_str(), error_text(r.err_dense_cudnn).c_str(),
                error_text(r.err_dq_cudnn).c_str(),
                num(r.kl_loss, "%.4g").c_str(), static_cast<long long>(r.kl_nonfinite),
                static_cast<long long>(r.malformed), static_cast<long long>(r.step_malformed), plans.c_str());
  }
}

void write_training_json(const std::string& path, const std::vector<TrainingRow>& rows, const Config& c,
                         const Machine& m) {
  std::ofstream out(path, std::ios::app);
  if (!out) throw Error("--json: cannot open " + path);
  const auto error_or_nan = [](double e) { return e == -1 ? NAN : e; };
  for (const TrainingRow& r : rows) {
    const Flops f = flops_of(r, c);
    JsonLine j;
    j.add("phase", "training").add("gpu", m.gpu).add("date", m.date).add("cudnn", m.cudnn)
        .add("matmul_tflops", m.matmul_tflops).add("layout", r.layout.name())
        .add("tokens", r.layout.batch * r.layout.tokens).add("heads", c.heads).add("kv_heads", c.kv_heads)
        .add("head_dim", c.head_dim).add("index_dim", c.index_dim).add("block_size", c.params.block_size)
        .add("topk", c.params.topk)
        .add("backward_engine", cuda::engine_name(c.backward_engine))
        .add("sparse_pairs", r.sparse_pairs).add("dense_pairs", r.dense_pairs)
        .add("kl_entries", r.kl_entries)
        .add("indexer_flops", f.indexer).add("sparse_forward_flops", f.sparse_fwd)
        .add("sparse_backward_flops", f.sparse_bwd).add("kl_flops", f.kl)
        .add("dense_forward_flops", f.dense_fwd).add("dense_backward_flops", f.dense_bwd)
        .add("indexer", r.indexer).add("sparse_forward", r.sparse.forward)
        .add("sparse_backward_det", r.sparse.det).add("sparse_backward_fast", r.sparse.fast)
        .add("kl_det", r.kl_det).add("kl_fast", r.kl_fast).add("convert_o", r.convert_o).add("step", r.step)
        .add("step_recompute", r.step_recompute).add("step_fast", r.step_fast).add("sparse_backward_det_teacher", r.bwd_det_teacher)
        .add("kl_det_teacher", r.kl_det_teacher).add("indexer_rows", r.indexer_rows)
        .add("step_index_lse", r.step_index_lse).add("err_dki_teacher", error_or_nan(r.err_dki_teacher))
        .add("err_loss_teacher", error_or_nan(r.err_loss_teacher))
        .add("dense_forward", r.dense.forward).add("dense_backward_det", r.dense.det)
        .add("dense_backward_fast", r.dense.fast).add("cudnn_forward", r.cudnn_forward)
        .add("cudnn_backward", r.cudnn_backward)
        .add("step_vs_dense", r.step.ok() && r.dense.forward.ok() && r.dense.det.ok()
                                  ? (r.dense.forward.ms + r.dense.det.ms) / r.step.ms : NAN)
        .add("step_vs_cudnn", r.step.ok() && r.cudnn_forward.ok() && r.cudnn_backward.ok()
                                  ? (r.cudnn_forward.ms + r.cudnn_backward.ms) / r.step.ms : NAN)
        .add("step_fast_vs_cudnn", r.step_fast.ok() && r.cudnn_forward.ok() && r.cudnn_backward.ok()
                                       ? (r.cudnn_forward.ms + r.cudnn_backward.ms) / r.step_fast.ms : NAN)
        .add("err_sparse_dq", error_or_nan(r.sparse.err_dq)).add("err_dense_dq", error_or_nan(r.dense.err_dq))
        .add("err_dki", error_or_nan(r.err_dki)).add("err_dense_cudnn", error_or_nan(r.err_dense_cudnn))
        .add("err_dq_cudnn", error_or_nan(r.err_dq_cudnn))
        .add("kl_loss", r.kl_loss).add("kl_nonfinite", r.kl_nonfinite)
        .add("malformed", r.malformed).add("step_malformed", r.step_malformed)
        .add("checks_passed", training_row_failed(r, c.tolerance) ? 0 : 1)
        .add("cudnn_plan", r.cudnn_plan).add("cudnn_note", r.cudnn_note).add("error", r.error);
    out << j.str() << "\n";
  }
}

}  // namespace msa::cli::bench_cuda
