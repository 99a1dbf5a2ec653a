// MSA decode over a paged cache as plan + run (docs/msa.md, "Paged inference"), so that a
// whole decode step can be captured once in a CUDA graph and replayed with new lengths.
// Public device API (msa/cuda/types.h); the step's kernels: src/cuda/decode/.
//
//   DecodePlan plan(capacities, dims, params);  // host, outside capture: sizes the workspace
//   ... allocate the step's buffers and plan.workspace_bytes() once ...
//   plan.run(step, stream);                     // capturable: kernels only, on `stream`
//   // between replays: write new cu_seqlens_q / seq_lens / page_table / q / qi / cache
//   // contents into the SAME device buffers (cudaMemcpy outside the graph), then replay.
//
// plan() fixes everything the host decides: the grids and the workspace come from the
// capacities alone (the decode path's contract), and so does the dense/sparse
// choice of msa_forward: max_context <= topk * B gives a DENSE plan (every visible block of
// every request would be selected, so MSA is dense causal attention exactly: the indexer
// never runs, `topk` is never written, and attention runs the decode kernels in dense mode,
// split-K over the context); a larger max_context gives a SPARSE plan, which
// runs the indexer and sparse attention for every step, short requests included (exact for
// them too: a request of <= topk * B tokens selects every visible block).
//
// run() first derives the step's request geometry on the device from cu_seqlens_q and
// seq_lens, checking them against the capacities, then launches msa_forward. It never allocates, copies or
// synchronises, and checks only host-known values (pointers, strides, alignment). Lengths
// are device data: a step whose lengths exceed the plan (or are inconsistent) computes
// nothing, leaves every output untouched and records the first bad request in the
// workspace; check_last_step() (which synchronises: not for the hot loop) throws it. Page
// ids are device data too: each is checked where a kernel reads it (a compare, no extra
// pass over the table), so a bad one is found mid-step; it is read as page 0 and recorded,
// and check_last_step() throws it (the step's outputs are then unspecified).
//
// Host-only header (no CUDA headers).
#pragma once
#include <cstddef>
#include <cstdint>

#include "msa/cuda/types.h"
#include "msa/ops.h"

namespace msa::cuda {

struct MsaForwardLaunch;  // the launchers' internal form of a step (src/cuda/launch.h)

// Upper bounds of every step a plan serves.
struct DecodeCapacities {
  int64_t max_batch = 1;          // request slots per step (unused slots: 0 queries)
  int64_t max_queries = 1;        // new tokens per request: 1..16
  int64_t max_total_queries = 0;  // packed query rows per step; 0 means max_batch * max_queries
  int64_t max_context = 1;        // cached tokens of one request, new ones included
};

// Heads and head dims of the layer. The index branch has one query head per KV head and a
// single shared index-key head (docs/msa.md §3).
struct DecodeDims {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, index_dim = 0;
};

// One step's device buffers, all allocated for the plan's capacities (rows beyond a step's
// queries are neither read for output nor written). bf16 as 16-bit patterns.
struct DecodeStep {
  const uint16_t* q = nullptr;                // [max_total_queries, q_heads, head_dim]
  const uint16_t* qi = nullptr;               // [max_total_queries, kv_heads, index_dim]
  const uint16_t* k_cache = nullptr;          // [pages, kv_heads, B, head_dim]
  const uint16_t* v_cache = nullptr;          // [pages, kv_heads, B, head_dim]
  const uint16_t* index_key_cache = nullptr;  // [pages, B, index_dim]
  const int32_t* page_table = nullptr;        // [max_batch, page_table_stride]: block -> page
  int64_t page_table_stride = 0;              // host value: >= ceil(max_context / B)
  // Host value: the pages of each cache (k / v / index keys, or the fp8 codes), 1 .. 2^31.
  // Every page id the step reads is checked against [0, num_pages) on the device: a bad one
  // is read as page 0 (no read leaves the caches), the step's outputs are unspecified, and
  // check_last_step() names the first entry found.
  int64_t num_pages = 0;
  // Device arrays the caller rewrites between replays (as the paged ops of msa/ops.h):
  const int32_t* cu_seqlens_q = nullptr;  // [max_batch + 1], 0 = cu[0] <= cu[1] <= ...
  const int32_t* seq_lens = nullptr;      // [max_batch], tokens per request incl. new ones
  // Outputs: rows [0, cu_seqlens_q[max_batch]) are written, later rows left untouched.
  void* o = nullptr;       // [max_total_queries, q_heads, head_dim] of o_type
  OutputType o_type = OutputType::f32;
  float* lse = nullptr;    // [max_total_queries, q_heads]
  int32_t* topk = nullptr;  // [kv_heads, max_total_queries, topk]; sparse plans (may be
                            // null for dense plans, which never write it)
  void* workspace = nullptr;  // workspace_bytes(), 256-byte aligned, owned by this step only
  // fp8 K/V caches (docs/msa.md §6.6): with kv_format fp8, attention reads k_fp8 / v_fp8
  // (e4m3 codes [pages, kv_heads, B, head_dim], 16-byte aligned, and their scales: per token
  // and head [pages, kv_heads, B] or one per tensor, msa/cuda/types.h) and k_cache / v_cache
  // are not read. The same plan serves both formats (grids and workspace do not depend on it).
  KvFormat kv_format = KvFormat::bf16;
  Fp8Kv k_fp8, v_fp8;
};

class DecodePlan {
 public:
  // Validates the capacities, dims and params (msa::Error naming the bad one) and sizes the
  // workspace. Needs the CUDA device that run() will use to be current (grids depend on its
  // SM count). Throws where a capacity would leave the capacity-safe decode kernels.
  DecodePlan(const DecodeCapacities& capacities, const DecodeDims& dims, const MsaParams& params);

  size_t workspace_bytes() const { return workspace_bytes_; }
  bool is_dense() const { return dense_; }  // the indexer is skipped, topk never written
  const DecodeCapacities& capacities() const { return capacities_; }

  // Launches one step on `stream` (a cudaStream_t; null = the legacy default stream, which
  // graph capture does not allow). No allocation, no copy, no host synchronisation.
  void run(const DecodeStep& step, Stream stream) const;

  // Waits for `stream`, then throws msa::Error naming the first request whose lengths did
  // not fit the plan in the last run() on step.workspace (that step computed nothing), or
  // the page-table entry found out of range (its outputs unspecified).
  void check_last_step(const DecodeStep& step, Stream stream) const;
  // Where run() records that status: a device address inside step.workspace, 16 bytes whose
  // first int32 is -1 for a valid step. A caller that synchronises after each step anyway
  // (a graph's output download) copies it alongside and calls check_last_step() only when it
  // is not -1, so the hot loop needs no extra synchronisation.
  const void* step_status(const DecodeStep& step) const;
  static constexpr size_t kStepStatusBytes = 16;

  const DecodeDims& dims() const { return dims_; }
  const MsaParams& params() const { return params_; }  // the scale resolved

 private:
  MsaForwardLaunch forward_launch(const DecodeStep& step) const;

  DecodeCapacities capacities_;
  DecodeDims dims_;
  MsaParams params_;
  bool dense_ = false;
  size_t q_start_offset_ = 0, k_len_offset_ = 0, seq_of_query_offset_ = 0, status_offset_ = 0;
  size_t forward_offset_ = 0, workspace_bytes_ = 0;
};

}  // namespace msa::cuda
