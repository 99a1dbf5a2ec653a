// derive_decode_geometry (decode_geometry.h): one CTA turns a step's cu_seqlens_q / seq_lens
// into q_start / k_len / seq_of_query, after checking every request against the plan's
// capacities. Decode batches are small (tens to hundreds of requests, <= 16 queries each):
// one CTA striding over them suffices. The next kernel is PDL-launched (its launch overlaps
// this one) and waits for this grid in pdl_wait before reading anything.
#include <climits>

#include "cuda/decode_geometry.h"
#include "kernels/pdl.cuh"

namespace msa::cuda {

namespace {

constexpr int kGeometryThreads = 256;

struct RequestCheck {
  DecodeGeometryError error = DecodeGeometryError::none;
  int64_t value = 0;
};

// Request b's lengths against the capacities. Valid requests 0..b-1 imply
// 0 <= cu_seqlens_q[b] <= max_total_queries, so the checks of b alone bound its rows.
__device__ RequestCheck check_request(const DecodeGeometryArgs& a, int64_t b) {
  const int64_t begin = a.cu_seqlens_q[b], end = a.cu_seqlens_q[b + 1];
  const int64_t q_len = end - begin, tokens = a.seq_lens[b];
  if (b == 0 && begin != 0) return {DecodeGeometryError::first_offset, begin};
  if (q_len < 0) return {DecodeGeometryError::negative_queries, q_len};
  if (q_len > a.max_queries) return {DecodeGeometryError::too_many_queries, q_len};
  if (end > a.max_total_queries) return {DecodeGeometryError::too_many_rows, end};
  if (tokens < q_len) return {DecodeGeometryError::too_few_tokens, tokens};
  if (tokens > a.max_context) return {DecodeGeometryError::context_too_long, tokens};
  return {};
}

__global__ void __launch_bounds__(kGeometryThreads) decode_geometry_kernel(const DecodeGeometryArgs a) {
  pdl_launch_dependents();  // the next (PDL-launched) kernel still waits for our completion
  __shared__ unsigned long long first_bad;
  if (threadIdx.x == 0) first_bad = ULLONG_MAX;
  __syncthreads();
  for (int64_t b = threadIdx.x; b < a.batch; b += kGeometryThreads)
    if (check_request(a, b).error != DecodeGeometryError::none)
      atomicMin(&first_bad, static_cast<unsigned long long>(b));
  __syncthreads();
  const bool valid = first_bad == ULLONG_MAX;  // CTA-uniform

  if (threadIdx.x == 0) {
    DecodeGeometryStatus status;
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
  for (int64_t b = threadIdx.x; b <= a.batch; b += kGeometryThreads) {
    a.q_start[b] = valid ? a.cu_seqlens_q[b] : 0;
    if (b < a.batch) a.k_len[b] = valid ? a.seq_lens[b] : 0;
  }
  if (valid)
    for (int64_t b = threadIdx.x; b < a.batch; b += kGeometryThreads)
      for (int64_t row = a.cu_seqlens_q[b]; row < a.cu_seqlens_q[b + 1]; ++row)
        a.seq_of_query[row] = static_cast<int32_t>(b);
  // Rows beyond the step's queries: a valid request id, though no decode kernel reads them.
  const int64_t rows = valid ? a.cu_seqlens_q[a.batch] : 0;
  for (int64_t row = rows + threadIdx.x; row < a.max_total_queries; row += kGeometryThreads)
    a.seq_of_query[row] = 0;
}

}  // namespace

void derive_decode_geometry(const DecodeGeometryArgs& args, void* stream) {
  decode_geometry_kernel<<<1, kGeometryThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
  MSA_CUDA_CHECK_LAUNCH();
}

DecodeGeometryStatus read_decode_geometry_status(const DecodeGeometryStatus* status, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  DecodeGeometryStatus host;
  MSA_CUDA_CHECK(cudaMemcpyAsync(&host, status, sizeof host, cudaMemcpyDeviceToHost, cuda_stream));
  MSA_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
  return host;
}

}  // namespace msa::cuda
