// Host launcher of the warpgroup-MMA dense prefill (see attention_dense_wgmma.h).
#include "cuda/attention_dense_wgmma.h"
#include "cuda/attention_inputs.h"
#include "cuda/engine_setting.h"
#include "kernels/attention_dense_wgmma.cuh"
#include "msa/error.h"

namespace msa::cuda {

void run_dense_wgmma(const AttentionParams& p, int64_t* tile_start, void* stream_ptr) {
  using T = attn::DenseWgmmaTraits;
  if (p.head_dim != T::kD) throw_arg_error("head_dim", "128 for the wgmma dense kernel", p.head_dim);
  // The overlapped loop (P V of tile t - 1 during the softmax of tile t), opt-in until
  // measured; a bad value throws here, before anything is launched.
  const bool overlap = wgmma_engine_override("MSA_DENSE_WGMMA_OVERLAP").value_or(false);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t group = p.q_heads / p.kv_heads;
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start,
                                                             T::kRows);
  MSA_CUDA_CHECK_LAUNCH();

  attn::DenseArgs args{};
  set_dense_args(args, p, tile_start, attn::kLog2e);
  const int64_t tiles = dense_grid_tiles(p, T::kRows);
  const auto kernel = overlap ? attn::dense_wgmma_kernel<true> : attn::dense_wgmma_kernel<false>;
  const size_t smem = overlap ? T::kOverlapSmemBytes : T::kSmemBytes;
  MSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), T::kThreads, smem, stream>>>(
      args);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::cuda
