// Host launcher of the warpgroup-MMA dense prefill (see attention_dense_wgmma.h).
#include "cuda/common/kernel_attributes.h"
#include "cuda/attention/attention_dense_wgmma.h"
#include "cuda/attention/attention_inputs.h"
#include "cuda/attention/attention_dense_wgmma.cuh"
#include "msa/error.h"

namespace msa::cuda {

namespace {
template <int D>
void launch(const AttentionLaunch& p, int64_t* tile_start, cudaStream_t stream) {
  using T = attn::DenseWgmmaTraits<D>;
  const int64_t group = p.q_heads / p.kv_heads;
  attn::dense_tile_plan<<<1, attn::kPlanThreads, 0, stream>>>(p.batch.q_start, p.batch.batch, group, tile_start,
                                                             T::kRows);
  MSA_CUDA_CHECK_LAUNCH();

  attn::DenseArgs args{};
  set_dense_args(args, p, tile_start, attn::kLog2e);
  const int64_t tiles = dense_grid_tiles(p, T::kRows);
  auto kernel = attn::dense_wgmma_kernel<D>;
  require_dynamic_smem(kernel, T::kSmemBytes);
  kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.kv_heads)), T::kThreads, T::kSmemBytes,
           stream>>>(args, attn::TileUnions{});
  MSA_CUDA_CHECK_LAUNCH();
}
}  // namespace

void run_dense_wgmma(const AttentionLaunch& p, int64_t* tile_start, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.head_dim == 128)
    launch<128>(p, tile_start, stream);
  else if (p.head_dim == 80)
    launch<80>(p, tile_start, stream);
  else
    throw_arg_error("head_dim", "128 or 80 for the wgmma dense kernel", p.head_dim);
}

}  // namespace msa::cuda
