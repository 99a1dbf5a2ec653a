// MiniMax-M3's vision tower and projector on a CUDA device: Model::encode_vision of a model
// loaded with Device::cuda. The math of src/model/vision_tower.cpp and vision_projector.cpp,
// batch by batch of whole segments (model::vision_batches, the CPU's batching) with every
// activation on the device:
//   x = pixels W_patch^T                    f32 x f32 GEMM (exact f32: the Conv3d weight is f32)
//   x = pre_layrnorm(x)                     layer_norm_rows, in place, f32
//   per layer:
//     xn = LN1(x)                           bf16
//     proj = xn [q;k;v]^T                   one GEMM, f32
//     q, k = RoPE(proj + bias), v = proj + bias      head_norm_rope with the 3D angle table, bf16
//     o = attention(q, k, v)                bidirectional within each segment (src/cuda/launch.h)
//     x += o W_out^T; x += b_out            GEMM accumulating into x, bias_gelu
//     xn = LN2(x); h = gelu(xn W1^T + b1)   bf16
//     x += h W2^T; x += b2
//   projector: linear_1, GELU, linear_2, the m^2 rows of a window side by side, merge_linear_1,
//   GELU, merge_linear_2 (GEMM inputs bf16, f32 outputs and bias/GELU math).
// Matrices are bf16 [out, in] (as the text model's), the patch embedding, norms and biases
// f32. The attention kernel takes head dims 64, 80 and 128: a ViT head of another width
// (tiny-vl's 20) runs zero-padded to the next of these (q.k and the first D output channels
// are unchanged by zero channels; out_proj's weight gets zero columns for the pad), with the
// scale of the real head dim. Activations and the attention workspace are sized for the
// call's largest batch once per call; the only host syncs are the per-batch download (and
// the tap's downloads). One CUDA stream; not thread-safe. Host-only header.
#pragma once
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "msa/cuda/types.h"
#include "msa/model.h"
#include "msa/model_vision.h"

namespace msa::model::gpu {

// Device time (CUDA events) of encode() calls, summed over the calls that were given it.
struct VisionProfile {
  // Per ViT layer: the five GEMMs (q;k;v, out_proj, fc1, fc2), the attention kernel, and the
  // rest (norms, bias / GELU, RoPE): the layer's time minus the other two.
  enum Part : int { gemm = 0, attention = 1, other = 2 };
  std::vector<std::array<double, 3>> layer_ms;
  double embed_ms = 0;      // patch embedding GEMM + pre_layrnorm
  double projector_ms = 0;  // both projector stages
  int64_t calls = 0;
};

class CudaVisionTower {
 public:
  // Uploads `host` (the checkpoint's f32 / bf16 / f16 views) to the current device; throws
  // msa::Error when the head dim exceeds 128 (the attention kernels) or a tensor's size is off.
  CudaVisionTower(const VisionConfig& config, const VisionWeights& host);
  ~CudaVisionTower();
  CudaVisionTower(const CudaVisionTower&) = delete;
  CudaVisionTower& operator=(const CudaVisionTower&) = delete;

  const VisionConfig& config() const { return config_; }
  int64_t text_hidden() const { return text_hidden_; }
  int64_t attention_head_dim() const { return attention_head_dim_; }  // D or its padded width
  // The dense attention kernel (AttentionLaunch::dense_engine): automatic (the default: the
  // measured choice between the wgmma and mma.sync kernels at head dim 80), or one pinned
  // (the benchmark compares them).
  void set_attention_engine(msa::cuda::Engine engine) { attention_engine_ = engine; }
  void* stream() const;  // cudaStream_t of every launch

  // Model::encode_vision: pixel_values [N, C*T*P*P] on the host (checked as the CPU path
  // checks them), one f32 [patches / m^2, hidden] host tensor per grid. The tap sees the CPU
  // path's names per batch ("vision.patch_embed", "vision.pre_norm", "vision.layers.N",
  // "projector.patches", "projector"), each downloaded (a host sync per tap). With
  // `profile`, adds the call's device times to it.
  std::vector<Tensor> encode(const Tensor& pixel_values, std::span<const VisionGrid> grids,
                             const ForwardTap& tap = nullptr, VisionProfile* profile = nullptr);

 private:
  struct Weights;
  struct State;
  struct Batch;
  void run_batch(Batch& batch, const ForwardTap& tap, VisionProfile* profile);

  VisionConfig config_;
  int64_t text_hidden_ = 0;
  int64_t attention_head_dim_ = 0;
  msa::cuda::Engine attention_engine_ = msa::cuda::Engine::automatic;
  std::unique_ptr<Weights> weights_;
  std::unique_ptr<State> state_;
};

// Used by msa::Model (model.cpp): the tower of a config with a vision_config.
std::shared_ptr<CudaVisionTower> make_cuda_vision_tower(const ModelConfig& config, const ModelWeights& host);
std::vector<Tensor> cuda_encode_vision(CudaVisionTower& tower, const Tensor& pixel_values,
                                       std::span<const VisionGrid> grids, const ForwardTap& tap);

}  // namespace msa::model::gpu
