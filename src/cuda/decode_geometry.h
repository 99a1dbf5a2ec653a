// A decode step's request geometry, derived on the device (DecodePlan::run's first kernel):
// from the int32 cu_seqlens_q / seq_lens that a serving loop rewrites between graph replays
// to the BatchLayout arrays the kernels read (int64 q_start, k_len; int32 seq_of_query).
// The lengths are checked against the plan's capacities there, on the device: a step with
// any bad request becomes an empty step (every q_start and k_len 0, so every later kernel
// exits at once and no output is written) and the first bad request is recorded in
// `status`, which read_decode_geometry_status() fetches (synchronising) for the host.
// Host-only header (no CUDA headers); implemented in decode_geometry.cu.
#pragma once
#include <cstdint>

namespace msa::cuda {

enum class DecodeGeometryError : int32_t {
  none = 0,
  first_offset,      // cu_seqlens_q[0] != 0
  negative_queries,  // cu_seqlens_q[b + 1] < cu_seqlens_q[b]
  too_many_queries,  // q_len > max_queries
  too_many_rows,     // cu_seqlens_q[b + 1] > max_total_queries
  too_few_tokens,    // seq_lens[b] < q_len (the new tokens are part of the cache)
  context_too_long,  // seq_lens[b] > max_context
};

// Written whole by every derive_decode_geometry (device memory, 16 bytes).
struct DecodeGeometryStatus {
  int32_t request = -1;  // first bad request slot, -1 when the step is valid
  DecodeGeometryError error = DecodeGeometryError::none;
  int64_t value = 0;  // the offending value
};

struct DecodeGeometryArgs {
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* seq_lens = nullptr;      // [batch]
  int64_t batch = 0, max_queries = 0, max_total_queries = 0, max_context = 0;
  int64_t* q_start = nullptr;       // [batch + 1]
  int64_t* k_len = nullptr;         // [batch]
  int32_t* seq_of_query = nullptr;  // [max_total_queries]; rows beyond the step's: 0
  DecodeGeometryStatus* status = nullptr;
};

// One small kernel on `stream` (a cudaStream_t); graph-capturable.
void derive_decode_geometry(const DecodeGeometryArgs& args, void* stream);

// Copies `status` (device) to the host after the work queued on `stream`; synchronises.
DecodeGeometryStatus read_decode_geometry_status(const DecodeGeometryStatus* status, void* stream);

}  // namespace msa::cuda
