// msa bench --device cuda --training: cuDNN's dense SDPA forward (training mode: with the
// LSE stats) and backward as the dense baseline, causal, GQA, bf16, on the bench's packed q,
// k, v and dO. A packed batch of B equal sequences of n tokens is passed as cuDNN batch B of
// length n (the same memory and the same work; no ragged offsets needed).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "bench_cuda/inputs.h"
#include "bench_cuda/training.h"
#include "bench_cuda/bench_kernels.h"
#ifdef MSA_WITH_CUDNN
#include "cudnn/cudnn_sdpa_backward.h"
#endif

namespace msa::cli::bench_cuda {

#ifdef MSA_WITH_CUDNN
void measure_cudnn_training(Session& s, const DeviceBuffer& q, const DeviceBuffer& k, const DeviceBuffer& v,
                            const DeviceBuffer& grad_o, const float* dense_o, const DenseDqCheck& check_dq,
                            int repeats, TrainingRow& row) {
  const Config& c = s.config;
  const int64_t batch = row.layout.batch, n = row.layout.tokens;
  cuda::CudnnSdpaShape shape = causal_sdpa_shape(c, batch, n, n);
  shape.with_stats = true;
  // Each graph cuDNN cannot build is recorded (the forward alone still runs), never skipped silently.
  std::unique_ptr<cuda::CudnnSdpa> forward;
  std::unique_ptr<cuda::CudnnSdpaBackward> backward;
  try {
    forward = std::make_unique<cuda::CudnnSdpa>(shape);
    row.cudnn_plan = forward->plan_name();
    backward = std::make_unique<cuda::CudnnSdpaBackward>(shape);
    row.cudnn_plan += " / " + backward->plan_name();
  } catch (const std::exception& e) {
    row.cudnn_note = std::string(forward ? "backward" : "forward") + " unavailable: " + e.what();
    std::fprintf(stderr, "[bench]   cuDNN SDPA %s\n", row.cudnn_note.c_str());
    if (!forward) return;
  }
  const size_t q_bytes = q.bytes(), kv_bytes = k.bytes();
  auto& st = s.stream;
  try {  // a call cuDNN refuses at run time is recorded too; the row's other columns stay
    DeviceBuffer o(q_bytes), dq(q_bytes), dk(kv_bytes), dv(kv_bytes);
    DeviceBuffer stats(static_cast<size_t>(batch * n * c.heads) * sizeof(float));
    const cuda::CudnnSdpaArgs fwd{q.get(), k.get(), v.get(), o.get(), stats.as<float>()};
    const cuda::CudnnSdpaBackwardArgs bwd{q.get(),  k.get(),          v.get(),  o.get(), grad_o.get(),
                                          stats.as<float>(), dq.get(), dk.get(), dv.get()};
    std::fprintf(stderr, "[bench]   cuDNN forward (with stats), %d runs ...\n", repeats);
    row.cudnn_forward = time_events(st, std::max(c.warmup, 1), repeats, [&](int) { forward->run(fwd, st); });
    if (dense_o)  // o and stats now hold the forward's results, which the backward reads
      row.err_dense_cudnn =
          cuda::bench::relative_l2_error(dense_o, o.get(), true, q_bytes / sizeof(uint16_t), st);
    if (backward) {
      std::fprintf(stderr, "[bench]   cuDNN backward, %d runs ...\n", repeats);
      row.cudnn_backward = time_events(st, std::max(c.warmup, 1), repeats, [&](int) { backward->run(bwd, st); });
      if (check_dq) row.err_dq_cudnn = check_dq(o.get(), dq.get());
    }
    MSA_CUDA_CHECK(cudaStreamSynchronize(st));
  } catch (const std::exception& e) {
    row.cudnn_note += std::string(row.cudnn_note.empty() ? "" : "; ") + "run failed: " + e.what();
    std::fprintf(stderr, "[bench]   cuDNN SDPA training run failed: %s\n", e.what());
    MSA_CUDA_CHECK(cudaDeviceSynchronize());  // a sticky device error ends the row
  }
}
#else
void measure_cudnn_training(Session&, const DeviceBuffer&, const DeviceBuffer&, const DeviceBuffer&,
                            const DeviceBuffer&, const float*, const DenseDqCheck&, int, TrainingRow& row) {
  row.cudnn_note = "not built (no cuDNN frontend)";
}
#endif

}  // namespace msa::cli::bench_cuda
