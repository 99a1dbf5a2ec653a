// MSA's main branch on the GPU (docs/msa.md, "Main branch"): exact attention over selected
// blocks (sparse) or dense causal GQA attention, prefill and decode, packed or paged; and
// msa_forward, the index branch then the main branch in one call. Dense attention also has a
// bidirectional mode (causal = false: the vision tower's attention within an image). Public device API: see
// msa/cuda/types.h for the launch contract. Kernels: src/cuda/attention/ (prefill),
// src/cuda/decode/ (<= 16 queries per sequence).
#pragma once
#include "msa/cuda/indexer.h"
#include "msa/cuda/types.h"

namespace msa::cuda {

struct AttentionParams {
  const uint16_t* q = nullptr;  // [total_q, q_heads, head_dim] bf16
  Keys k, v;                    // [*, kv_heads, head_dim] bf16, packed or paged
  int64_t q_heads = 0, kv_heads = 0;  // q_heads / kv_heads = group size, 1..16
  int64_t head_dim = 0;               // 64 or 128; 80 (the vision tower's) for dense prefill
  Sequences seqs;
  int64_t block_size = 128;  // 64 or 128: the selection's blocks and the pages of k / v
  // Selection rows [kv_heads, total_q, slots] (block ids < the query's own block + 1, -1
  // suffix; indexer()'s topk_out); null = dense causal attention.
  const int32_t* topk = nullptr;
  int64_t slots = 0;
  float scale = 0;  // softmax scale (the caller's; 1/sqrt(head_dim) for M3)
  // Dense only (topk null): false = bidirectional, every query of sequence b attends to all
  // its seq_lens[b] keys (the vision tower's attention within a segment; the prefill kernels
  // for any q_len, never the decode path). MSA (topk given) is causal by definition: false
  // with a selection throws msa::Error.
  bool causal = true;
  void* o = nullptr;  // [total_q, q_heads, head_dim] of o_type
  OutputType o_type = OutputType::f32;
  float* lse = nullptr;  // [total_q, q_heads] natural-log LSE; empty selection: -inf, o = 0
  Engine sparse_engine = Engine::automatic;  // sparse prefill: wgmma (D = B = 128, scale > 0) or mma.sync
  TileLoad sparse_q_load = TileLoad::automatic;
  SparseOrder sparse_order = SparseOrder::automatic;  // sparse prefill's work order (types.h)
  Engine dense_engine = Engine::automatic;   // dense prefill: wgmma (D = 80 or 128) or mma.sync
                                             // (automatic: by measurement, attention.cu)
  // Sparse prefill runs in chunks of queries whose workspace fits 8 GiB; a positive value
  // caps the chunk (tests exercise the chunking with it).
  int64_t max_chunk_queries = 0;
  // fp8 K/V (docs/msa.md §6.6): k_fp8 / v_fp8 hold the e4m3 codes and their scales; k / v give
  // the codes' paged layout (strides in bytes, multiples of 16; the page table) and their data
  // is not read. The decode path (max_seqlen_q <= 16) reads the codes; longer calls widen the
  // sequences' blocks into a bf16 copy in the workspace first and run the bf16 prefill kernels
  // on it (docs/device-api.md).
  KvFormat kv_format = KvFormat::bf16;
  Fp8Kv k_fp8, v_fp8;
};

size_t attention_workspace_bytes(const AttentionParams& params);
void attention(const AttentionParams& params, void* workspace, Stream stream);
// Whether attention() takes its decode path (max_seqlen_q <= 16): split-K over the selected
// blocks or, dense, over the context.
bool attention_uses_decode_path(const AttentionParams& params);

// MSA forward: indexer then sparse attention over its rows (attention.topk must be
// index.topk_out, and both must describe the same sequences). Where every context is at most
// topk * block_size, every visible block would be selected and MSA equals dense causal
// attention exactly: then the indexer is skipped (topk_out is not written) and the dense
// kernels run, so MSA is never slower than dense.
struct MsaForwardParams {
  IndexerParams index;
  AttentionParams attention;
};
bool msa_is_dense(const IndexerParams& index);
size_t msa_forward_workspace_bytes(const MsaForwardParams& params);
void msa_forward(const MsaForwardParams& params, void* workspace, Stream stream);

}  // namespace msa::cuda
