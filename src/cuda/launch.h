// The launchers' internal interface: the public params of msa/cuda/*.h resolved to what the
// kernels read. Sequences become BatchLayout (int64 query starts and key lengths, the
// sequence of every query row), packed keys get their sequences' first tokens, and paged keys
// their block size. The public functions (src/cuda/device_api.cpp) derive that geometry on
// the device into their workspace and call these; DecodePlan (its own geometry kernel), the
// model runtime and the benchmark call them with geometry they already hold. The launch
// contract is the public one (msa/cuda/types.h).
//
// Decode path (batch.max_q_len <= 16: decode / multi-token prediction): grids and workspace
// depend only on host-known capacities: batch.batch, batch.total_q, batch.max_q_len,
// batch.max_k_len, heads, dims, topk/slots and the SM count - never on device data. Kernels
// read the actual geometry from q_start / k_len / seq_of_query / topk on the device; CTAs
// beyond the actual work exit. So one captured graph replays correctly for any lengths within
// the capacities: k_len[b] <= max_k_len, q_start[b + 1] - q_start[b] <= max_q_len,
// q_start[batch] <= total_q (rows of queries >= q_start[batch] are left untouched; total_q
// stays the row stride of topk_out / o). Decode kernels are launched with programmatic
// dependent launch (common/pdl.cuh): each waits for the previous kernel in the stream before
// touching memory. Dense attention (topk null) is capacity-safe the same way: with
// max_q_len <= 16 it is the decode path in dense mode (splits from max_k_len); otherwise the
// flash kernels, whose grid is an upper bound from total_q and batch (dense_tile_plan turns
// the device q_start into tiles, extra CTAs exit). Prefill paths size grids from total_q and
// max_k_len (host values) and need the actual lengths within them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "msa/cuda/types.h"

namespace msa::cuda {

struct GeometryStatus;  // common/sequence_geometry.h

// Keys (or values, or index keys) addressed by (sequence, block, head), as KeyBlocks in
// src/ops/batch.h: varlen when page_table is null (token t of sequence b is token
// seq_token_start[b] + t), else paged (block j of b is page page_table[b * stride + j]).
struct KeyLayout {
  const uint16_t* data = nullptr;  // bf16
  int64_t block_size = 0;
  int64_t token_stride = 0;  // elements between consecutive tokens of one head
  int64_t head_stride = 0;   // elements between heads
  int64_t block_stride = 0;  // elements between blocks (varlen) or pages (paged)
  const int64_t* seq_token_start = nullptr;  // [batch], varlen only
  const int32_t* page_table = nullptr;       // [batch, page_table_stride], paged only
  int64_t page_table_stride = 0;
  // Paged, checked (DecodePlan, whose page tables are device data it cannot see): the decode
  // kernels DecodePlan runs (the bf16 index-key scan, attention over bf16 or fp8 K/V) check
  // every page id they read against [0, pages) (common.cuh, checked_page). A bad one is read
  // as page 0, so no read leaves the cache, and the first found is recorded in *page_fault;
  // the step's outputs are then unspecified and DecodePlan::check_last_step() names the
  // entry. Null: the ids are trusted, as the public ops document (msa/cuda/types.h); the
  // prefill kernels and the fp8 / fp4 index-key scans always trust them.
  GeometryStatus* page_fault = nullptr;
  int64_t pages = 0;
};

// Request geometry: queries of sequence b are packed rows [q_start[b], q_start[b+1]) and
// sit at the end of its k_len[b] keys (pos = k_len - q_len + i).
struct BatchLayout {
  const int64_t* q_start = nullptr;     // [batch + 1]
  const int64_t* k_len = nullptr;       // [batch]
  const int32_t* seq_of_query = nullptr;  // [total_q]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t max_k_len = 0;  // host-known maxima, for grid sizing
  int64_t max_q_len = 0;
};

// Index branch: selection rows [heads, total_q, topk] (docs/msa.md §3) and optionally the
// selected LSE [heads, total_q] of logit_scale * score.
struct IndexerLaunch {
  const uint16_t* qi = nullptr;  // [total_q, heads, dim]
  int64_t heads = 0, dim = 0;
  KeyLayout ki;                  // one head; fp8 / fp4 use only its page table and block size
  KeyFormat ki_format = KeyFormat::bf16;
  QuantizedKeys ki_quantized;    // fp8 / fp4 (no lse_out; decode path only)
  BatchLayout batch;
  int block_size = 128, topk = 16, local_blocks = 1, init_blocks = 0;
  float logit_scale = 0;         // index_scale / temperature (LSE only)
  int32_t* topk_out = nullptr;   // [heads, total_q, topk]
  float* lse_out = nullptr;      // [heads, total_q] or null
  // MsaParams::index_compute fp8 (msa/ops.h): rank blocks by fp8 scores. Di = B = 128. qi rows
  // (and bf16 keys) are quantized into the workspace by the fp8 recipe, then the fp8
  // warpgroup-MMA tile scan runs (indexer_scan_producer.cuh) for every q_len (no decode
  // path); an fp8 cache (ki_format fp8) is read as stored; lse_out stays exact (bf16 keys).
  bool fp8_compute = false;
  // fp8_compute with bf16 keys: tokens stored at ki.data (varlen total_k, paged pages * B),
  // all of them quantized; ki must be contiguous rows of dim (token_stride == dim).
  int64_t ki_tokens = 0;
  Engine scan_engine = Engine::automatic;  // tile paths: the wgmma or the mma.sync scan
  IndexRanking ranking = IndexRanking::automatic;  // tile paths: in the scan or separate
  int64_t max_chunk_queries = 0;  // > 0 caps the queries of one separate-ranking pass
  // Benchmarks (msa bench's decode phases): the decode path's index scan alone, no selection
  // rows written. Refused off the decode path.
  bool decode_scan_only = false;
};
size_t indexer_workspace_bytes(const IndexerLaunch& params);
void indexer(const IndexerLaunch& params, void* workspace, void* stream);
// The selected LSE alone over the rows already in params.topk_out (read, not written):
// lse_out as indexer() computes it (the KL backward's student LSE). No workspace.
void indexer_selected_lse(const IndexerLaunch& params, void* stream);
// Whether indexer() takes its decode path for these params (capacity-only grids and
// workspace, see the launch contract): max_q_len <= 16, topk > local + init blocks, and the
// block maxima fit the workspace cap.
bool indexer_uses_decode_path(const IndexerLaunch& params);

// Main branch: attention over the selected blocks (topk given) or dense (null), causal or,
// with causal = false, bidirectional.
struct AttentionLaunch {
  const uint16_t* q = nullptr;  // [total_q, q_heads, head_dim]
  KeyLayout k, v;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  BatchLayout batch;
  const int32_t* topk = nullptr;  // [kv_heads, total_q, slots], -1 ends a row; null = dense
  int64_t slots = 0;
  float scale = 0;
  bool causal = true;  // dense only: false = bidirectional (AttentionParams::causal)
  void* o = nullptr;  // [total_q, q_heads, head_dim] of o_type
  OutputType o_type = OutputType::f32;
  float* lse = nullptr;  // [total_q, q_heads]
  Engine sparse_engine = Engine::automatic;
  TileLoad sparse_q_load = TileLoad::automatic;
  SparseOrder sparse_order = SparseOrder::automatic;
  Engine dense_engine = Engine::automatic;
  int64_t max_chunk_queries = 0;  // > 0 caps the sparse prefill's query chunks
  // fp8 K/V: the codes and scales; k / v keep their layout (paged, strides in bytes). The
  // decode path reads them; attention() widens them into a bf16 copy for prefill
  // (attention/fp8_kv_widen.h).
  KvFormat kv_format = KvFormat::bf16;
  Fp8Kv k_fp8, v_fp8;
  // Benchmarks (msa bench's decode phases): the decode path's split-K attention without the
  // merge of its partials (o / lse not written where the plan splits). Refused off the
  // decode path.
  bool decode_skip_merge = false;
};
size_t attention_workspace_bytes(const AttentionLaunch& params);
void attention(const AttentionLaunch& params, void* workspace, void* stream);
// Whether attention() takes its decode path (max_q_len <= 16): sparse with topk given,
// dense (split-K over the context) with topk null.
bool attention_uses_decode_path(const AttentionLaunch& params);

}  // namespace msa::cuda

namespace msa::cuda {

// MSA forward: the indexer, then sparse attention over its rows (attention.topk must be
// index.topk_out). Where every context is <= topk * block_size, every visible block is
// selected and MSA is dense causal attention exactly (docs/msa.md §4): then the indexer is
// skipped (topk_out is not written) and the dense kernel runs — never slower than dense.
struct MsaForwardLaunch {
  IndexerLaunch index;
  AttentionLaunch attention;
};
bool msa_is_dense(const IndexerLaunch& index);
size_t msa_forward_workspace_bytes(const MsaForwardLaunch& params);
void msa_forward(const MsaForwardLaunch& params, void* workspace, void* stream);

}  // namespace msa::cuda
