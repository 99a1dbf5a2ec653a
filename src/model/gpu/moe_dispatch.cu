// MoE routing and dispatch on the device: top-k experts per token (as src/model/mlp.cpp),
// a stable sort of the token x choice entries by expert (cub radix sort), each expert's row
// range, and the gathered bf16 inputs, so that every expert runs one dense GEMM over a
// contiguous block of rows.
#include <cuda_bf16.h>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "kernels.h"

namespace msa::model::gpu {

using msa::cuda::launch_pdl;
using msa::cuda::pdl_launch_dependents;
using msa::cuda::pdl_wait;
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int key_bits(int64_t experts) {
  int bits = 1;
  while ((int64_t{1} << bits) < experts) ++bits;
  return bits;
}

// Workspace regions for `entries` = tokens * top_k.
struct Layout {
  size_t keys = 0, ids = 0, sorted_keys = 0, sorted_ids = 0, cub = 0, cub_bytes = 0, total = 0;
};

Layout layout_for(int64_t entries, int64_t experts) {
  Layout l;
  const size_t words = static_cast<size_t>(entries) * sizeof(uint32_t);
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, l.cub_bytes, static_cast<const uint32_t*>(nullptr),
                                                 static_cast<uint32_t*>(nullptr),
                                                 static_cast<const uint32_t*>(nullptr),
                                                 static_cast<uint32_t*>(nullptr),
                                                 static_cast<int>(entries), 0, key_bits(experts)));
  size_t at = 0;
  l.keys = at, at += align_up(words);
  l.ids = at, at += align_up(words);
  l.sorted_keys = at, at += align_up(words);
  l.sorted_ids = at, at += align_up(words);
  l.cub = at, at += align_up(l.cub_bytes);
  l.total = at;
  return l;
}

// One warp per token: a decode step has one token, and one thread's serial K x E loop
// (~0.16 ms measured on an H200 at E 128, K 4) would be the largest part of its MoE.
// Lane l holds the choices of experts e = l + 32 i in registers, loaded and computed once
// (every load issued together: one L2 round trip; reloading them in each of the k passes
// made the passes a chain of dependent round trips, ~12 us at E 128, K 4). In each pass
// every lane offers its best choice not yet taken and the warp reduces: the best sigmoid +
// bias, ties to the lower id (src/model/mlp.cpp's order). Comparisons are u64 keys (the
// choice's order bits, ~id): a total order (NaN read as -inf), so every lane of the
// butterfly agrees on the winner.
constexpr int kRouteWarps = kThreads / 32;
constexpr int kLaneExperts = kMaxRoutedExperts / 32;

__device__ __forceinline__ float router_sigmoid(float logit) { return 1.0f / (1.0f + expf(-logit)); }

__device__ __forceinline__ uint64_t choice_key(float choice, int expert) {
  const float v = choice != choice ? -INFINITY : choice + 0.0f;  // NaN last; -0 as +0
  const uint32_t bits = __float_as_uint(v);
  const uint32_t order = bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  return (static_cast<uint64_t>(order) << 32) | static_cast<uint32_t>(~expert);  // > 0 for any expert
}

// Routes token t with the calling warp: chosen[j] and score[j] (the j-th choice's expert and
// sigmoid) in every lane, and their sum. experts <= kMaxRoutedExperts (moe_dispatch checks).
__device__ __forceinline__ float route_token(const MoeDispatch& job, int64_t t, int lane,
                                             int (&chosen)[kMaxExpertsPerToken],
                                             float (&score)[kMaxExpertsPerToken]) {
  const float* logits = job.router_logits + t * job.experts;
  const int experts = static_cast<int>(job.experts);
  uint64_t key[kLaneExperts];  // 0: no expert, or taken
  float sigmoid[kLaneExperts];
#pragma unroll
  for (int i = 0; i < kLaneExperts; ++i) {
    const int e = lane + 32 * i;
    sigmoid[i] = e < experts ? router_sigmoid(logits[e]) : 0.0f;
    key[i] = e < experts ? choice_key(sigmoid[i] + job.bias[e], e) : 0;
  }
  float sum = 0;
  for (int j = 0; j < job.top_k; ++j) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < kLaneExperts; ++i) best = key[i] > best ? key[i] : best;
    for (int offset = 16; offset > 0; offset /= 2) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, best, offset);
      best = other > best ? other : best;
    }
    const int winner = static_cast<int>(~static_cast<uint32_t>(best));
    float mine = 0;  // the winner's sigmoid, in its lane (constant register indices only)
#pragma unroll
    for (int i = 0; i < kLaneExperts; ++i)
      if (key[i] == best) {
        mine = sigmoid[i];
        key[i] = 0;
      }
    chosen[j] = winner;
    score[j] = __shfl_sync(0xffffffffu, mine, winner % 32);
    sum += score[j];
  }
  return sum;
}

__device__ __forceinline__ float entry_weight_of(const MoeDispatch& job, float score, float sum) {
  return score / sum * job.routed_scaling;
}

__global__ void __launch_bounds__(kThreads) route_kernel(MoeDispatch job, uint32_t* keys, uint32_t* ids) {
  const int64_t t = blockIdx.x * int64_t{kRouteWarps} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= job.tokens) return;
  int chosen[kMaxExpertsPerToken];
  float score[kMaxExpertsPerToken];
  const float sum = route_token(job, t, lane, chosen, score);
  for (int j = lane; j < job.top_k; j += 32) {
    const int64_t entry = t * job.top_k + j;
    keys[entry] = static_cast<uint32_t>(chosen[j]);
    ids[entry] = static_cast<uint32_t>(entry);
    job.entry_weight[entry] = entry_weight_of(job, score[j], sum);
  }
}

// Copies token `token`'s input row to sorted row `row` with the CTA's threads.
__device__ __forceinline__ void copy_row(const MoeDispatch& job, int64_t token, int64_t row) {
  const uint16_t* src = job.x + token * job.hidden;
  uint16_t* dst = job.x_sorted + row * job.hidden;
  if (job.hidden % 8 == 0) {  // 16-byte vectors (the buffers are 256-byte aligned)
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < job.hidden / 8; i += blockDim.x) d[i] = s[i];
  } else {
    for (int64_t i = threadIdx.x; i < job.hidden; i += blockDim.x) dst[i] = src[i];
  }
}

// The whole dispatch of a decode-sized step in one launch: as four (routing, the stable sort
// by expert, the offsets, the gather) they cost ~25 us of a batch-1 MoE layer's latency
// chain. Grid: one CTA per sorted row. Every CTA routes all the step's tokens (a warp per
// token; at most kMaxFusedDispatchEntries entries, so a few passes at most), keeps the
// entries' experts in shared memory and ranks them: entry i goes to row (entries of a lower
// expert) + (entries of its expert before i), the order of the stable radix sort of the
// general path, so both paths give identical outputs. CTA r gathers the entry ranked r; CTA
// 0 also writes the entry weights and the offsets.
constexpr int kMaxFusedDispatchEntries = kThreads;

__global__ void __launch_bounds__(kThreads) dispatch_small_kernel(MoeDispatch job) {
  pdl_wait();  // PDL-launched (pdl.cuh): before any global access
  pdl_launch_dependents();
  __shared__ uint32_t expert_of[kMaxFusedDispatchEntries];
  __shared__ int32_t mine;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int entries = static_cast<int>(job.tokens * job.top_k);
  for (int64_t t = warp; t < job.tokens; t += kRouteWarps) {
    int chosen[kMaxExpertsPerToken];
    float score[kMaxExpertsPerToken];
    const float sum = route_token(job, t, lane, chosen, score);
    for (int j = lane; j < job.top_k; j += 32) {
      const int64_t entry = t * job.top_k + j;
      expert_of[entry] = static_cast<uint32_t>(chosen[j]);
      if (blockIdx.x == 0) job.entry_weight[entry] = entry_weight_of(job, score[j], sum);
    }
  }
  __syncthreads();  // every entry's expert is in shared memory
  const int i = threadIdx.x;
  if (i < entries) {
    const uint32_t e = expert_of[i];
    int rank = 0;
    for (int j = 0; j < entries; ++j) rank += expert_of[j] < e || (expert_of[j] == e && j < i);
    if (rank == static_cast<int>(blockIdx.x)) mine = i;
  }
  if (blockIdx.x == 0) {
    for (int64_t e = threadIdx.x; e <= job.experts; e += kThreads) {
      int below = 0;
      for (int j = 0; j < entries; ++j) below += static_cast<int64_t>(expert_of[j]) < e;
      job.offsets[e] = below;
    }
  }
  __syncthreads();  // `mine` is set (exactly one entry has each rank)
  const int64_t row = blockIdx.x, entry = mine;
  if (threadIdx.x == 0) job.entry_row[entry] = static_cast<int32_t>(row);
  copy_row(job, entry / job.top_k, row);
}

// offsets[e] = first sorted entry with expert >= e (binary search), e in [0, experts].
__global__ void offsets_kernel(const uint32_t* sorted_keys, int64_t entries, int64_t experts,
                               int32_t* offsets) {
  const int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (e > experts) return;
  int64_t lo = 0, hi = entries;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(sorted_keys[mid]) < e) lo = mid + 1;
    else hi = mid;
  }
  offsets[e] = static_cast<int32_t>(lo);
}

// One CTA per permuted row: copy its token's input row; record where the entry went.
__global__ void gather_kernel(MoeDispatch job, const uint32_t* sorted_ids) {
  const int64_t row = blockIdx.x;
  const uint32_t entry = sorted_ids[row];
  if (threadIdx.x == 0) job.entry_row[entry] = static_cast<int32_t>(row);
  copy_row(job, entry / job.top_k, row);
}

}  // namespace

size_t moe_dispatch_workspace_bytes(int64_t tokens, int64_t top_k, int64_t experts) {
  if (tokens == 0) return 0;
  return layout_for(tokens * top_k, experts).total;
}

void moe_dispatch(const MoeDispatch& job, void* workspace, size_t workspace_bytes, void* stream) {
  if (job.tokens == 0) return;
  MSA_CHECK_ARG(job.top_k >= 1 && job.top_k <= kMaxExpertsPerToken && job.top_k <= job.experts,
                "experts_per_token", "1.." + std::to_string(kMaxExpertsPerToken) + " (CUDA MoE)",
                job.top_k);
  const int64_t entries = job.tokens * job.top_k;
  MSA_CHECK_ARG(entries < (int64_t{1} << 31), "tokens x experts_per_token", "fewer than 2^31",
                entries);
  MSA_CHECK_ARG(job.experts >= 1 && job.experts <= kMaxRoutedExperts, "experts",
                "1.." + std::to_string(kMaxRoutedExperts) + " (CUDA MoE routing)", job.experts);
  MSA_CHECK_ARG(job.hidden % 8 != 0 || (reinterpret_cast<uintptr_t>(job.x) % 16 == 0 &&
                                        reinterpret_cast<uintptr_t>(job.x_sorted) % 16 == 0),
                "moe inputs", "16-byte aligned rows", "a misaligned pointer");
  const Layout l = layout_for(entries, job.experts);
  MSA_CHECK_ARG(workspace_bytes >= l.total, "moe workspace",
                std::to_string(l.total) + " bytes", workspace_bytes);
  char* ws = static_cast<char*>(workspace);
  uint32_t* keys = reinterpret_cast<uint32_t*>(ws + l.keys);
  uint32_t* ids = reinterpret_cast<uint32_t*>(ws + l.ids);
  uint32_t* sorted_keys = reinterpret_cast<uint32_t*>(ws + l.sorted_keys);
  uint32_t* sorted_ids = reinterpret_cast<uint32_t*>(ws + l.sorted_ids);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (entries <= kMaxFusedDispatchEntries) {
    launch_pdl(dispatch_small_kernel, dim3(static_cast<unsigned>(entries)), dim3(kThreads), 0, s, job);
    MSA_CUDA_CHECK_LAUNCH();
    return;
  }

  route_kernel<<<static_cast<unsigned>((job.tokens + kRouteWarps - 1) / kRouteWarps), kThreads, 0, s>>>(
      job, keys, ids);
  MSA_CUDA_CHECK_LAUNCH();
  size_t cub_bytes = l.cub_bytes;
  MSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.cub, cub_bytes, keys, sorted_keys, ids,
                                                 sorted_ids, static_cast<int>(entries), 0,
                                                 key_bits(job.experts), s));
  offsets_kernel<<<static_cast<unsigned>((job.experts + 1 + kThreads - 1) / kThreads), kThreads, 0, s>>>(
      sorted_keys, entries, job.experts, job.offsets);
  MSA_CUDA_CHECK_LAUNCH();
  gather_kernel<<<static_cast<unsigned>(entries), kThreads, 0, s>>>(job, sorted_ids);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
