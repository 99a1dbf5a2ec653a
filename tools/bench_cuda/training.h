// msa bench --device cuda --training: what the training pieces share. training_backward.cpp
// measures a layout (run_training_bench), training_cudnn.cpp the cuDNN dense baseline,
// training_report.cpp prints the tables and writes the JSON lines.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench_cuda/common.h"

namespace msa::cli::bench_cuda {

struct TrainingLayout {
  int64_t batch = 1, tokens = 0;  // `batch` sequences of `tokens` tokens, all of them queries
  std::string name() const {
    return batch == 1 ? std::to_string(tokens) : std::to_string(batch) + "x" + std::to_string(tokens);
  }
};

// One attention kind (sparse or dense): forward, deterministic and fast backward, and the
// fast dQ's relative L2 error against the deterministic dQ (-1: not run).
struct KindTimes {
  Timing forward, det, fast;
  double err_dq = -1;
};

struct TrainingRow {
  TrainingLayout layout;
  KindTimes sparse, dense;
  Timing indexer;          // the indexer with lse_out: selection rows + selected LSE
  Timing kl_det, kl_fast;  // KL backward over the random rows
  Timing convert_o;        // sparse forward's f32 O -> the bf16 O the backward reads
  // As msa::training_step on CUDA: indexer (rows only) -> sparse fwd -> O to bf16 -> sparse bwd
  // (det) -> KL (det) computing the index LSE, the backward handing the KL its teacher where the
  // group size lets it. step_index_lse: the index LSE from the indexer (lse_out) instead;
  // step_recompute: the KL recomputing its teacher (unset where there is no hand-over).
  Timing step, step_index_lse, step_recompute;
  // The same chain with the backward's dQ and the KL's dki by atomics (deterministic = false),
  // the mode cuDNN's backward runs in here.
  Timing step_fast;
  // The hand-over timed alone on the random rows (unset where the group size has none): the
  // deterministic backward writing the teacher, the KL reading it, and that KL's dki (relative
  // L2) and loss (relative) against the deterministic KL's own.
  Timing bwd_det_teacher, kl_det_teacher;
  Timing indexer_rows;  // the indexer without lse_out, as the step runs it
  double err_dki_teacher = -1, err_loss_teacher = -1;
  Timing cudnn_forward, cudnn_backward;  // cuDNN SDPA, training mode (stats), causal
  double sparse_pairs = 0, dense_pairs = 0;  // (query head, visible key) pairs
  double kl_entries = 0;     // (query, index head, selected visible key) triples
  double kl_loss = NAN;      // deterministic KL loss of the random rows
  int64_t kl_nonfinite = -1;   // non-finite entries of loss and dki (-1: not checked)
  double err_dki = -1;         // fast dki against deterministic dki, relative L2
  double err_dense_cudnn = -1; // our dense O against cuDNN's O, relative L2
  double err_dq_cudnn = -1;    // our dense dQ (from cuDNN's O) against cuDNN's dQ, relative L2
  int64_t malformed = -1;      // random selection rows
  int64_t step_malformed = -1; // the step's indexer rows
  std::string cudnn_plan, cudnn_note, error;
};

// Our dense backward run on cuDNN's bf16 O (device pointer), its f32 dQ's relative L2 error
// against cuDNN's bf16 dQ (device pointer).
using DenseDqCheck = std::function<double(const void* cudnn_o, const void* cudnn_dq)>;

// The cuDNN SDPA forward (with stats) and backward of `row.layout` on our packed q, k, v and
// dO: times into row.cudnn_forward / cudnn_backward; cuDNN's O against `dense_o` (our dense
// forward's f32 O) into row.err_dense_cudnn and `check_dq`'s result into row.err_dq_cudnn.
// A shape cuDNN cannot build leaves the times unset and its reason in row.cudnn_note; builds
// without cuDNN say so there.
void measure_cudnn_training(Session& s, const DeviceBuffer& q, const DeviceBuffer& k, const DeviceBuffer& v,
                            const DeviceBuffer& grad_o, const float* dense_o, const DenseDqCheck& check_dq,
                            int repeats, TrainingRow& row);

// Whether the row failed a gate (or errored).
bool training_row_failed(const TrainingRow& r, double tolerance);

void print_training(const std::vector<TrainingRow>& rows, const Config& c, const Machine& m);
void write_training_json(const std::string& path, const std::vector<TrainingRow>& rows, const Config& c,
                         const Machine& m);

}  // namespace msa::cli::bench_cuda
