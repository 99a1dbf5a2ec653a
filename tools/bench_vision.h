// msa bench-model --vision: the vision tower's time per layer on one 672 x 672 image and a
// 64-frame 448 x 448 video, on the CPU (tools/bench_vision.cpp) or the GPU
// (tools/bench_vision_cuda.cpp, CudaVisionTower), in ms and as a fraction of the machine's
// measured matmul peak.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/model_vision.h"
#include "msa/model_weights.h"

namespace msa::cli {

// One measured call of the tower + projector over `grids`: per ViT layer the GEMMs, the
// attention and the rest (the CPU reports the layer's total as `other`: its parts are not
// timed separately), the patch embedding + pre-norm, the projector, and the call's wall time.
struct VisionTiming {
  std::vector<std::array<double, 3>> layer_ms;  // [layer][gemm, attention, other]
  double embed_ms = 0, projector_ms = 0, wall_ms = 0;
  double vit_ms() const;  // embedding + layers
};

#ifdef MSA_WITH_CUDA
// The GPU's measured bf16 matmul rate (TFLOP/s) and its name.
double cuda_matmul_peak_tflops(std::string& gpu);
// `warmup` unmeasured calls, then `repeats` measured ones (CUDA events, CudaVisionTower's
// VisionProfile), in call order.
// attention_engine: "automatic", "wgmma" or "mma_sync" (CudaVisionTower::set_attention_engine).
std::vector<VisionTiming> time_vision_cuda(const VisionConfig& config, const VisionWeights& weights,
                                           const Tensor& pixels, const std::vector<VisionGrid>& grids,
                                           int warmup, int repeats, const std::string& attention_engine);
#endif

}  // namespace msa::cli

int run_bench_vision_command(int argc, char** argv);  // msa bench-model --vision
