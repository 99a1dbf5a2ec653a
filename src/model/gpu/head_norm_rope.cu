// Per-head (bias +) Gemma RMSNorm + partial NeoX RoPE + bf16 store (into a packed tensor or a
// paged cache), the math of src/model/tensor_math.cpp: norm in f32, then channel i < rot/2
// pairs with i + rot/2 at angle = f32(position) * inv_freq[i] (text) or the given per-token
// angle (the ViT's 3D RoPE, model::apply_rope_angles).
#include <cuda_bf16.h>

#include <string>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "kernels.h"

namespace msa::model::gpu {

using msa::cuda::launch_pdl;
using msa::cuda::pdl_launch_dependents;
using msa::cuda::pdl_wait;
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint16_t to_bf16(float value) {
  const __nv_bfloat16 b = __float2bfloat16_rn(value);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// Several transforms in one launch (a layer's q, k, v, index q and index k): in a decode
// step each separate launch would add a few microseconds to the layer's latency chain.
// Warp w of the grid takes item w - first_item[j] of the job j whose range holds it.
struct HeadTransformBatch {
  HeadTransform jobs[kMaxHeadTransforms];
  int64_t first_item[kMaxHeadTransforms + 1] = {};
  int count = 0;
};

// One warp per (token, head) of `job`; lanes stride over the channels. No shared memory, no
// block barrier: a warp past the end returns on its own.
__device__ __forceinline__ void transform_head(const HeadTransform& job, int64_t item, int lane) {
  const int64_t t = item / job.heads, h = item % job.heads, dim = job.dim;
  if (job.slots && job.slots[t] < 0) return;  // a padding row of a decode graph: no cache slot
  const float* in = job.src + t * job.src_stride + h * dim;
  const float* bias = job.bias ? job.bias + h * dim : nullptr;
  auto value = [&](int64_t i) { return bias ? in[i] + bias[i] : in[i]; };

  float inv = 1.0f;
  if (job.norm_weight) {
    float sum = 0;
    for (int64_t i = lane; i < dim; i += 32) sum += value(i) * value(i);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + job.eps);
  }
  const float* w = job.norm_weight;
  auto normed = [&](int64_t i) { return w ? (value(i) * inv) * (1.0f + w[i]) : value(i); };

  uint16_t* out;
  const int64_t dst_dim = job.dst_dim > 0 ? job.dst_dim : dim;
  if (job.slots) {
    const int64_t slot = job.slots[t], page = slot / job.block_size, row = slot % job.block_size;
    out = job.dst + ((page * job.heads + h) * job.block_size + row) * dim;
  } else {
    out = job.dst + (t * job.heads + h) * dst_dim;
  }

  const int64_t half = job.rotary_dim / 2;
  if (half > 0) {
    const float position = job.angles ? 0.0f : static_cast<float>(job.positions[t]);
    for (int64_t i = lane; i < half; i += 32) {
      const float a = normed(i), b = normed(i + half);
      const float angle = job.angles ? job.angles[t * half + i] : position * job.inv_freq[i];
      float sin_angle, cos_angle;
      sincosf(angle, &sin_angle, &cos_angle);
      out[i] = to_bf16(a * cos_angle - b * sin_angle);
      out[i + half] = to_bf16(b * cos_angle + a * sin_angle);
    }
  }
  for (int64_t i = 2 * half + lane; i < dim; i += 32) out[i] = to_bf16(normed(i));
  // The padding channels of a padded head: zeros, so that q.k and the output's first `dim`
  // channels are those of the unpadded head.
  for (int64_t i = dim + lane; i < dst_dim; i += 32) out[i] = 0;
}

__global__ void __launch_bounds__(kThreads) head_norm_rope_kernel(const HeadTransformBatch batch) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  const int64_t item = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // Unrolled with constant indices: the jobs stay in the parameter space (no local copy).
#pragma unroll
  for (int j = 0; j < kMaxHeadTransforms; ++j) {
    if (j < batch.count && item >= batch.first_item[j] && item < batch.first_item[j + 1]) {
      transform_head(batch.jobs[j], item - batch.first_item[j], lane);
      return;
    }
  }
}

}  // namespace

void head_norm_rope(const HeadTransform* jobs, int count, void* stream) {
  MSA_CHECK_ARG(count >= 0 && count <= kMaxHeadTransforms, "head transforms",
                "0.." + std::to_string(kMaxHeadTransforms) + " in one launch", count);
  HeadTransformBatch batch;
  for (int j = 0; j < count; ++j) {
    const HeadTransform& job = jobs[j];
    MSA_CHECK_ARG(job.rotary_dim % 2 == 0 && job.rotary_dim <= job.dim, "rotary_dim",
                  "an even count <= head dim " + std::to_string(job.dim), job.rotary_dim);
    MSA_CHECK_ARG(!job.slots || job.block_size > 0, "block_size", "a positive page size with slots",
                  job.block_size);
    MSA_CHECK_ARG(job.dst_dim == 0 || (job.dst_dim >= job.dim && !job.slots), "dst_dim",
                  "0, or >= head dim " + std::to_string(job.dim) + " with a dense dst", job.dst_dim);
    const int64_t items = job.tokens * job.heads;
    if (items == 0) continue;
    batch.jobs[batch.count] = job;
    batch.first_item[batch.count + 1] = batch.first_item[batch.count] + items;
    ++batch.count;
  }
  const int64_t items = batch.first_item[batch.count];
  if (items == 0) return;
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  MSA_CHECK_ARG(blocks < (int64_t{1} << 31), "tokens x heads", "fewer than 2^34 rows", items);
  launch_pdl(head_norm_rope_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
             static_cast<cudaStream_t>(stream), batch);
  MSA_CUDA_CHECK_LAUNCH();
}

void head_norm_rope(const HeadTransform& job, void* stream) { head_norm_rope(&job, 1, stream); }

}  // namespace msa::model::gpu
