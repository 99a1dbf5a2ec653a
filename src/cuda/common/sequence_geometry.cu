// derive_sequence_geometry (sequence_geometry.h). Checked mode: one CTA checks every request,
// then writes a valid step's geometry or an empty one. Decode batches are small (tens to
// hundreds of requests, <= 16 queries each), so one CTA striding over them suffices; the next
// kernel is PDL-launched (its launch overlaps this one) and waits for this grid in pdl_wait
// before reading anything. Unchecked mode: a grid over the query rows (a 1M-token prefill has
// 1M of them); each row finds its sequence by binary search in cu_seqlens_q, CTA 0 also
// writes the per-sequence arrays.
#include <climits>

#include "cuda/common/cuda_check.h"
#include "cuda/common/pdl.cuh"
#include "cuda/common/sequence_geometry.h"

namespace msa::cuda {

namespace {

constexpr int kGeometryThreads = 256;
constexpr int64_t kRowsPerCta = 4 * kGeometryThreads;  // unchecked mode

struct RequestCheck {
  GeometryError error = GeometryError::none;
  int64_t value = 0;
};

// Request b's lengths against the capacities. Valid requests 0..b-1 imply
// 0 <= cu_seqlens_q[b] <= total_q, so the checks of b alone bound its rows.
__device__ RequestCheck check_request(const SequenceGeometryArgs& a, int64_t b) {
  const int64_t begin = a.seqs.cu_seqlens_q[b], end = a.seqs.cu_seqlens_q[b + 1];
  const int64_t q_len = end - begin, tokens = a.seqs.seq_lens[b];
  if (b == 0 && begin != 0) return {GeometryError::first_offset, begin};
  if (q_len < 0) return {GeometryError::negative_queries, q_len};
  if (q_len > a.seqs.max_seqlen_q) return {GeometryError::too_many_queries, q_len};
  if (end > a.seqs.total_q) return {GeometryError::too_many_rows, end};
  if (tokens < q_len) return {GeometryError::too_few_tokens, tokens};
  if (tokens > a.seqs.max_seqlen_k) return {GeometryError::context_too_long, tokens};
  return {};
}

__device__ int64_t key_count(const SequenceGeometryArgs& a, int64_t b) {
  return a.seqs.seq_lens ? int64_t{a.seqs.seq_lens[b]} : int64_t{a.seqs.cu_seqlens_k[b + 1]} - a.seqs.cu_seqlens_k[b];
}

__global__ void __launch_bounds__(kGeometryThreads) checked_geometry_kernel(const SequenceGeometryArgs a) {
  pdl_launch_dependents();  // the next (PDL-launched) kernel still waits for our completion
  __shared__ unsigned long long first_bad;
  if (threadIdx.x == 0) first_bad = ULLONG_MAX;
  __syncthreads();
  for (int64_t b = threadIdx.x; b < a.seqs.batch; b += kGeometryThreads)
    if (check_request(a, b).error != GeometryError::none)
      atomicMin(&first_bad, static_cast<unsigned long long>(b));
  __syncthreads();
  const bool valid = first_bad == ULLONG_MAX;  // CTA-uniform

  if (threadIdx.x == 0) {
    GeometryStatus status;
    if (!valid) {
      const int64_t bad = static_cast<int64_t>(first_bad);
      const RequestCheck check = check_request(a, bad);
      status.request = static_cast<int32_t>(bad);
      status.error = check.error;
      status.value = check.value;
    }
    *a.status = status;
  }
  // A bad step becomes an empty one: no request has queries or keys, every kernel exits.
  for (int64_t b = threadIdx.x; b <= a.seqs.batch; b += kGeometryThreads) {
    a.q_start[b] = valid ? a.seqs.cu_seqlens_q[b] : 0;
    if (b < a.seqs.batch) a.k_len[b] = valid ? a.seqs.seq_lens[b] : 0;
  }
  if (valid)
    for (int64_t b = threadIdx.x; b < a.seqs.batch; b += kGeometryThreads)
      for (int64_t row = a.seqs.cu_seqlens_q[b]; row < a.seqs.cu_seqlens_q[b + 1]; ++row)
        a.seq_of_query[row] = static_cast<int32_t>(b);
  // Rows beyond the step's queries: a valid request id, though no decode kernel reads them.
  const int64_t rows = valid ? a.seqs.cu_seqlens_q[a.seqs.batch] : 0;
  for (int64_t row = rows + threadIdx.x; row < a.seqs.total_q; row += kGeometryThreads)
    a.seq_of_query[row] = 0;
}

__global__ void __launch_bounds__(kGeometryThreads) geometry_kernel(const SequenceGeometryArgs a) {
  if (blockIdx.x == 0) {
    for (int64_t b = threadIdx.x; b <= a.seqs.batch; b += kGeometryThreads) {
      a.q_start[b] = a.seqs.cu_seqlens_q[b];
      if (b < a.seqs.batch) {
        a.k_len[b] = key_count(a, b);
        if (a.k_start) a.k_start[b] = a.seqs.cu_seqlens_k[b];
      }
    }
  }
  const int64_t first = blockIdx.x * kRowsPerCta;
  const int64_t end = min(first + kRowsPerCta, a.seqs.total_q);
  for (int64_t row = first + threadIdx.x; row < end; row += kGeometryThreads) {
    // The last sequence b with cu_seqlens_q[b] <= row (empty sequences share offsets: the last
    // of them owns the row); rows at or past cu_seqlens_q[batch] belong to none: 0.
    int64_t lo = 0, hi = a.seqs.batch;  // answer in [lo, hi)
    if (row >= a.seqs.cu_seqlens_q[a.seqs.batch]) {
      a.seq_of_query[row] = 0;
      continue;
    }
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (a.seqs.cu_seqlens_q[mid] <= row) lo = mid;
      else hi = mid;
    }
    a.seq_of_query[row] = static_cast<int32_t>(lo);
  }
}

}  // namespace

void derive_sequence_geometry(const SequenceGeometryArgs& args, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (args.status) {
    checked_geometry_kernel<<<1, kGeometryThreads, 0, cuda_stream>>>(args);
  } else {
    const int64_t ctas = args.seqs.total_q > 0 ? (args.seqs.total_q + kRowsPerCta - 1) / kRowsPerCta : 1;
    geometry_kernel<<<static_cast<unsigned>(ctas), kGeometryThreads, 0, cuda_stream>>>(args);
  }
  MSA_CUDA_CHECK_LAUNCH();
}

GeometryStatus read_geometry_status(const GeometryStatus* status, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  GeometryStatus host;
  MSA_CUDA_CHECK(cudaMemcpyAsync(&host, status, sizeof host, cudaMemcpyDeviceToHost, cuda_stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
  return host;
}

}  // namespace msa::cuda
