// msa bench --device cuda: CUDA-event timing (median and cv) and CUDA-graph replay of steps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "bench_cuda/common.h"

namespace msa::cli::bench_cuda {

namespace {

Timing summarize(const std::vector<double>& ms) {
  Timing t;
  if (ms.empty()) return t;
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  t.ms = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  double mean = 0, var = 0;
  for (double x : ms) mean += x / n;
  for (double x : ms) var += (x - mean) * (x - mean) / n;
  t.cv = mean > 0 ? std::sqrt(var) / mean : 0;
  t.runs = static_cast<int>(n);
  return t;
}

}  // namespace

// `warmup` untimed calls, then `repeats` calls each between two events on `stream`; call(i)
// gets the running call index (warm-up included), which callers use to rotate input sets.
Timing time_events(cudaStream_t stream, int warmup, int repeats,
                   const std::function<void(int)>& call) {
  for (int i = 0; i < warmup; ++i) call(i);
  Events events(2 * static_cast<size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    MSA_CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    call(warmup + i);
    MSA_CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  MSA_CUDA_CHECK(cudaEventSynchronize(events[2 * static_cast<size_t>(repeats) - 1]));
  std::vector<double> ms(repeats);
  for (int i = 0; i < repeats; ++i) {
    float elapsed = 0;
    MSA_CUDA_CHECK(cudaEventElapsedTime(&elapsed, events[2 * i], events[2 * i + 1]));
    ms[i] = elapsed;
  }
  return summarize(ms);
}

namespace {

// Captures body() on `stream` into `out`; false (with the reason) when it cannot be captured.
bool capture(cudaStream_t stream, const std::function<void()>& body, GraphExec& out,
             std::string& why) {
  cudaGraph_t graph = nullptr;
  if (const cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      e != cudaSuccess) {
    cudaGetLastError();
    why = cudaGetErrorString(e);
    return false;
  }
  std::string error;
  try {
    body();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  cudaGetLastError();  // a refused call during capture leaves a (non-sticky) error behind
  if (!error.empty() || end != cudaSuccess || !graph) {
    if (graph) cudaGraphDestroy(graph);
    why = !error.empty() ? error : cudaGetErrorString(end);
    return false;
  }
  const cudaError_t inst = cudaGraphInstantiate(&out.exec, graph, 0);
  cudaGraphDestroy(graph);
  if (inst != cudaSuccess) {
    cudaGetLastError();
    out.exec = nullptr;
    why = cudaGetErrorString(inst);
    return false;
  }
  return true;
}

}  // namespace

// One decode step per input set: a CUDA graph holding one step of every set in turn,
// replayed `repeats` times between events (time per step = replay / sets); eager steps
// between events when the step cannot be captured. `method` says which.
Timing time_steps(cudaStream_t stream, int sets, int warmup, int repeats,
                  const std::function<void(int)>& step, std::string& method) {
  for (int c = 0; c < sets; ++c) step(c);  // warm-up and lazy module loading, outside capture
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  GraphExec graph;
  std::string why;
  if (capture(stream, [&] { for (int c = 0; c < sets; ++c) step(c); }, graph, why)) {
    Timing t = time_events(stream, std::max(warmup, 1), repeats,
                           [&](int) { MSA_CUDA_CHECK(cudaGraphLaunch(graph.exec, stream)); });
    t.ms /= sets;
    method = "graph";
    return t;
  }
  std::fprintf(stderr, "[bench]     not capturable (%s): timing eager launches\n", why.c_str());
  MSA_CUDA_CHECK(cudaStreamSynchronize(stream));
  method = "eager";
  return time_events(stream, warmup, std::max(repeats, sets), [&](int i) { step(i % sets); });
}

}  // namespace msa::cli::bench_cuda
