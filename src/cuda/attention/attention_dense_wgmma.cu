// Host launcher of the warpgroup-MMA dense prefill (see attention_dense_wgmma.h).
#include "cuda/common/kernel_attributes.h"
#include "cuda/attention/attention_dense_wgmma.h"
#include "cuda/attention/attention_inputs.h"
#include "cuda/attention/attention_dense_wgmma.cuh"
#include "msa/error.h"

namespace msa::cuda {

void run_dense_wgmma(const AttentionLaunch& p, int64_t* tile_start, void* stream_ptr) {
  using T = attn::DenseWgmmaTraits;
  if (p.head_dim != T::kD) throw_arg_error("head_dim", "128 for the wgmma dense kernel", p.head_dim);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t group = p.q_heads / p.kv_heads;
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start,
                                                             T::kRows);
  MSA_CUDA_CHECK_LAUNCH();

  attn::DenseArgs args{};
  set_dense_args(args, p, tile_start, attn::kLog2e);
  const int64_t tiles = dense_grid_tiles(p, T::kRows);
  require_dynamic_smem(attn::dense_wgmma_kernel, T::kSmemBytes);
  attn::dense_wgmma_kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), T::kThreads,
                             T::kSmemBytes, stream>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
