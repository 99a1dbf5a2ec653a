// MSA's index branch on the GPU (docs/msa.md, "Index branch"): block selection rows and,
// for training, the selected LSE. Public device API: see msa/cuda/types.h for the launch
// contract. Kernels: src/cuda/indexer/ (prefill scans), src/cuda/decode/ (decode scan and
// select).
//
//   msa::cuda::IndexerParams p{...};
//   void* ws = my_alloc(msa::cuda::indexer_workspace_bytes(p));
//   msa::cuda::indexer(p, ws, stream);
#pragma once
#include "msa/cuda/types.h"

namespace msa::cuda {

struct IndexerParams {
  const uint16_t* qi = nullptr;  // [total_q, heads, dim] bf16, 16-byte aligned
  int64_t heads = 0;             // index heads = KV groups, 1..16
  int64_t dim = 0;               // index head dim: 64 or 128
  Keys ki;                       // one head; bf16 (packed or paged) unless ki_format says
  KeyFormat ki_format = KeyFormat::bf16;
  QuantizedKeys ki_quantized;    // fp8 / fp4 caches (paged; decode path: max_seqlen_q <= 16)
  Sequences seqs;
  int block_size = 128;          // 64 or 128
  int topk = 16;                 // 1..32
  int local_blocks = 1, init_blocks = 0;
  // logit_scale = index_scale / temperature: the selected LSE's scale (lse_out only).
  float logit_scale = 0;
  int32_t* topk_out = nullptr;   // [heads, total_q, topk]: block ids, own block last, -1 suffix
  float* lse_out = nullptr;      // [heads, total_q] selected LSE, or null (bf16 keys only)
  // Rank blocks by fp8 scores (MsaParams::index_compute fp8): Di = B = 128, bf16 keys in
  // contiguous rows (ki_tokens of them at ki.data, all quantized into the workspace) or an
  // fp8 cache read as stored. lse_out stays exact.
  bool fp8_compute = false;
  int64_t ki_tokens = 0;
  Engine scan_engine = Engine::automatic;  // the prefill scan: wgmma or mma.sync
  IndexRanking ranking = IndexRanking::automatic;  // the prefill scan ranks, or select_rows (types.h)
  // > 0 caps the queries of one separate-ranking pass (default: as many as 512 MiB of block
  // maxima hold; a smaller workspace for more passes).
  int64_t max_chunk_queries = 0;
};

size_t indexer_workspace_bytes(const IndexerParams& params);
void indexer(const IndexerParams& params, void* workspace, Stream stream);
// Whether indexer() takes its decode path (split-K scan over all SMs, then a select kernel):
// max_seqlen_q <= 16 and topk > local + init blocks.
bool indexer_uses_decode_path(const IndexerParams& params);

}  // namespace msa::cuda
