// The GPU side of msa bench-model --vision (tools/bench_vision.h): CudaVisionTower calls
// timed with its VisionProfile (CUDA events around every GEMM, the attention and each
// layer), and the machine's bf16 matmul rate measured as `msa bench` measures it.
#include <cuda_runtime.h>

#include <chrono>

#include "bench_cuda/common.h"
#include "bench_vision.h"
#include "engine_flag.h"
#include "model/gpu/cuda_vision.h"

namespace msa::cli {

double cuda_matmul_peak_tflops(std::string& gpu) {
  cudaStream_t stream = nullptr;
  MSA_CUDA_CHECK(cudaStreamCreate(&stream));
  bench_cuda::Machine machine = bench_cuda::describe_machine();
  bench_cuda::measure_matmul(machine, 8192, 20, stream);
  MSA_CUDA_CHECK(cudaStreamDestroy(stream));
  gpu = machine.gpu;
  return machine.matmul_tflops;
}

std::vector<VisionTiming> time_vision_cuda(const VisionConfig& config, const VisionWeights& weights,
                                           const Tensor& pixels, const std::vector<VisionGrid>& grids,
                                           int warmup, int repeats, const std::string& attention_engine) {
  model::gpu::CudaVisionTower tower(config, weights);
  tower.set_attention_engine(cli::parse_engine_flag(attention_engine, "--attention-engine"));
  for (int i = 0; i < warmup; ++i) tower.encode(pixels, grids);
  std::vector<VisionTiming> runs;
  for (int i = 0; i < repeats; ++i) {
    model::gpu::VisionProfile profile;
    const auto start = std::chrono::steady_clock::now();
    tower.encode(pixels, grids, nullptr, &profile);
    VisionTiming t;
    t.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    t.layer_ms = profile.layer_ms;
    t.embed_ms = profile.embed_ms;
    t.projector_ms = profile.projector_ms;
    runs.push_back(t);
  }
  return runs;
}

}  // namespace msa::cli
