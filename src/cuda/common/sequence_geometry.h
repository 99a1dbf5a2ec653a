// A call's sequence geometry derived on the device, from the int32 cu_seqlens_q and
// cu_seqlens_k / seq_lens of the public API (msa/cuda/types.h) to the BatchLayout arrays the
// kernels read (int64 q_start and k_len, the first key row k_start of packed keys, int32
// seq_of_query per query row). One kernel on the caller's stream, graph-capturable.
//
// Checked mode (a status pointer given; DecodePlan): every request is checked against the
// capacities first; a step with any bad request becomes an empty one (every q_start and k_len
// 0: the capacity-safe decode kernels then exit at once and write no output) and the first bad
// request is recorded in `status`, which read_geometry_status() fetches (synchronising). The
// kernels after it may record a page id out of range there too (KeyLayout::page_fault).
// Unchecked mode (null status; the public prefill entry points): the arrays are trusted, as
// their documentation requires.
// Host-only header (no CUDA headers).
#pragma once
#include <cstdint>

#include "msa/cuda/types.h"

namespace msa::cuda {

enum class GeometryError : int32_t {
  none = 0,
  first_offset,      // cu_seqlens_q[0] != 0
  negative_queries,  // cu_seqlens_q[b + 1] < cu_seqlens_q[b]
  too_many_queries,  // q_len > max_seqlen_q
  too_many_rows,     // cu_seqlens_q[b + 1] > total_q
  too_few_tokens,    // seq_lens[b] < q_len (the new tokens are part of the cache)
  context_too_long,  // seq_lens[b] > max_seqlen_k
  // Recorded by the kernels that read page ids (KeyLayout::page_fault), after this kernel:
  // page_table[b, j] outside the caches' pages; value = page_fault_value(j, id).
  page_out_of_range,
};

// Written whole by every checked derive_sequence_geometry (device memory, 16 bytes).
struct GeometryStatus {
  int32_t request = -1;  // first bad request slot, -1 when the step is valid
  GeometryError error = GeometryError::none;
  int64_t value = 0;  // the offending value
};

// A page fault's (block, page id) in GeometryStatus::value: the block in the high 32 bits
// (blocks of an int32-length context fit), the id's bits in the low 32.
constexpr int64_t page_fault_value(int64_t block, int32_t id) {
  return static_cast<int64_t>(static_cast<uint64_t>(block) << 32 | static_cast<uint32_t>(id));
}
constexpr int64_t page_fault_block(int64_t value) { return static_cast<int64_t>(static_cast<uint64_t>(value) >> 32); }
constexpr int32_t page_fault_id(int64_t value) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(value) & 0xffffffffu));
}

struct SequenceGeometryArgs {
  // The call's sequences: cu_seqlens_k (packed keys, unchecked mode only) or seq_lens; the
  // maxima are the capacities checked against in checked mode.
  Sequences seqs;
  int64_t* q_start = nullptr;       // [batch + 1]
  int64_t* k_len = nullptr;         // [batch]
  int64_t* k_start = nullptr;       // [batch], packed keys only
  int32_t* seq_of_query = nullptr;  // [total_q]; rows beyond cu_seqlens_q[batch]: 0
  GeometryStatus* status = nullptr;  // checked mode
};

void derive_sequence_geometry(const SequenceGeometryArgs& args, void* stream);

// Copies `status` (device) to the host after the work queued on `stream`; synchronises.
GeometryStatus read_geometry_status(const GeometryStatus* status, void* stream);

}  // namespace msa::cuda
