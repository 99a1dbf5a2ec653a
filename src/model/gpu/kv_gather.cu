// Paged K/V -> contiguous THD rows (kv_gather.h): 16-byte vector copies, one CTA per
// (request, page-table block), threads over the block's (key, head, 16-byte chunk) in the
// destination's order so the writes are contiguous.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/workspace_layout.h"
#include "kv_gather.h"
#include "msa/error.h"

namespace msa::model::gpu {

using msa::cuda::is_aligned;

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkElements = 8;  // bf16 elements in 16 bytes

__global__ void gather_kv_kernel(KvGather job) {
  const int64_t r = blockIdx.y, block = blockIdx.x;
  const int64_t first = job.k_rows[r];
  const int64_t k_len = job.k_rows[r + 1] - first;
  const int64_t t0 = block * job.block_size;
  if (t0 >= k_len) return;  // past the request's keys
  const int keys = static_cast<int>(min(job.block_size, k_len - t0));
  const int64_t page = job.page_table[r * job.max_pages + block];
  const int heads = static_cast<int>(job.heads);
  const int chunks = static_cast<int>(job.head_dim / kChunkElements);
  const int count = keys * heads * chunks;
  const auto* k_src = reinterpret_cast<const uint4*>(job.k_cache);
  const auto* v_src = reinterpret_cast<const uint4*>(job.v_cache);
  auto* k_dst = reinterpret_cast<uint4*>(job.k_out);
  auto* v_dst = reinterpret_cast<uint4*>(job.v_out);
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int c = i % chunks;
    const int h = (i / chunks) % heads;
    const int t = i / (chunks * heads);
    const int64_t row = first + t0 + t;
    if (row >= job.rows) break;  // rows grow with i: none of this thread's later ones fit
    const int64_t src = ((page * heads + h) * job.block_size + t) * chunks + c;
    const int64_t dst = (row * heads + h) * chunks + c;
    k_dst[dst] = k_src[src];
    v_dst[dst] = v_src[src];
  }
}

}  // namespace

void gather_kv(const KvGather& job, void* stream) {
  MSA_CHECK_ARG(job.requests >= 0, "gather_kv requests", ">= 0", job.requests);
  if (job.requests == 0) return;
  MSA_CHECK_ARG(job.k_cache && job.v_cache && job.page_table && job.k_rows && job.k_out && job.v_out,
                "gather_kv pointers", "k_cache, v_cache, page_table, k_rows, k_out, v_out set", "a null pointer");
  MSA_CHECK_ARG(is_aligned(job.k_cache, 16) && is_aligned(job.v_cache, 16) && is_aligned(job.k_out, 16) &&
                    is_aligned(job.v_out, 16),
                "gather_kv K/V pointers", "16-byte aligned", "an unaligned pointer");
  MSA_CHECK_ARG(job.head_dim >= kChunkElements && job.head_dim % kChunkElements == 0, "gather_kv head_dim",
                "a positive multiple of 8 (16-byte copies)", job.head_dim);
  MSA_CHECK_ARG(job.heads >= 1 && job.block_size >= 1 && job.pages >= 1, "gather_kv cache",
                "heads, block_size, pages >= 1",
                detail::concat(job.heads, " heads, block ", job.block_size, ", ", job.pages, " pages"));
  // The per-block index math is int32: a page's keys x heads x chunks.
  MSA_CHECK_ARG(job.block_size * job.heads * (job.head_dim / kChunkElements) <= (int64_t{1} << 30),
                "gather_kv page", "at most 2^30 16-byte chunks",
                job.block_size * job.heads * (job.head_dim / kChunkElements));
  MSA_CHECK_ARG(job.max_pages >= 1 && job.max_pages <= 0x7fffffff, "gather_kv max_pages", "in [1, 2^31)",
                job.max_pages);
  MSA_CHECK_ARG(job.requests <= 65535, "gather_kv requests", "at most 65535 (the grid's y)", job.requests);
  MSA_CHECK_ARG(job.rows >= 0, "gather_kv rows", ">= 0", job.rows);
  const dim3 grid(static_cast<unsigned>(job.max_pages), static_cast<unsigned>(job.requests));
  gather_kv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(job);
  MSA_CUDA_CHECK_LAUNCH();
}

}  // namespace msa::model::gpu
