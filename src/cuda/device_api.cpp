// The public device API (msa/cuda/indexer.h, attention.h, training.h): each call checks the
// host values of its params, derives the sequence geometry on the device into the front of
// its workspace (derive_sequence_geometry: one small kernel), and runs the launcher of its op
// family (src/cuda/launch.h) on the rest of the workspace.
#include <string>

#include "cuda/common/sequence_geometry.h"
#include "cuda/common/workspace_layout.h"
#include "cuda/launch.h"
#include "cuda/training/backward_launch.h"
#include "cuda/training/kl_launch.h"
#include "msa/cuda/attention.h"
#include "msa/cuda/training.h"
#include "msa/error.h"
#include "msa/ops.h"

namespace msa::cuda {

namespace {

bool is_paged(const Keys& keys) { return keys.page_table != nullptr; }

void check_sequences(const Sequences& s, bool paged, const char* keys_name) {
  MSA_CHECK_ARG(s.batch >= 0 && s.batch < (int64_t{1} << 31), "seqs.batch", "0 .. 2^31 - 1",
                s.batch);
  MSA_CHECK_ARG(s.total_q >= 0 && s.total_q < (int64_t{1} << 31), "seqs.total_q",
                "0 .. 2^31 - 1 rows (int32 cu_seqlens)", s.total_q);
  if (s.total_q == 0) return;
  MSA_CHECK_ARG(s.batch >= 1, "seqs.batch", "at least 1 with total_q > 0", s.batch);
  MSA_CHECK_ARG(s.cu_seqlens_q != nullptr, "seqs.cu_seqlens_q", "a device pointer", "null");
  MSA_CHECK_ARG(s.max_seqlen_q >= 1 && s.max_seqlen_q <= s.total_q, "seqs.max_seqlen_q",
                "1 .. total_q = " + std::to_string(s.total_q), s.max_seqlen_q);
  MSA_CHECK_ARG(s.max_seqlen_k >= s.max_seqlen_q && s.max_seqlen_k < (int64_t{1} << 31),
                "seqs.max_seqlen_k",
                "max_seqlen_q = " + std::to_string(s.max_seqlen_q) + " .. 2^31 - 1 (queries are "
                "the last tokens of their keys)",
                s.max_seqlen_k);
  if (paged) {
    MSA_CHECK_ARG(s.seq_lens != nullptr && s.cu_seqlens_k == nullptr, "seqs",
                  std::string("seq_lens (and no cu_seqlens_k) for the paged ") + keys_name,
                  s.seq_lens ? "both" : "no seq_lens");
  } else {
    MSA_CHECK_ARG(s.cu_seqlens_k != nullptr && s.seq_lens == nullptr, "seqs",
                  std::string("cu_seqlens_k (and no seq_lens) for the packed ") + keys_name,
                  s.cu_seqlens_k ? "both" : "no cu_seqlens_k");
  }
}

// The geometry region at the front of a public call's workspace.
struct GeometryRegion {
  size_t q_start = 0, k_len = 0, k_start = 0, seq_of_query = 0, bytes = 0;
};

GeometryRegion geometry_region(const Sequences& s, bool paged) {
  WorkspaceCursor ws;
  GeometryRegion r;
  r.q_start = ws.take(size_t(s.batch + 1) * sizeof(int64_t));
  r.k_len = ws.take(size_t(s.batch) * sizeof(int64_t));
  r.k_start = paged ? 0 : ws.take(size_t(s.batch) * sizeof(int64_t));
  r.seq_of_query = ws.take(size_t(s.total_q) * sizeof(int32_t));
  r.bytes = ws.at;
  return r;
}

template <class T>
T* at(void* base, size_t offset) {
  return base ? reinterpret_cast<T*>(static_cast<char*>(base) + offset) : nullptr;
}

// Sizing (a null workspace) reads no device pointer, but the launchers' checks want the
// geometry arrays present: in that case they point here, never dereferenced.
alignas(kWorkspaceAlign) char sizing_stand_in[kWorkspaceAlign];

template <class T>
T* geometry_at(void* workspace, size_t offset) {
  return workspace ? at<T>(workspace, offset) : reinterpret_cast<T*>(sizing_stand_in);
}

// The BatchLayout of `s` in the geometry region of `workspace` (null workspace: sizing only).
BatchLayout batch_layout(const Sequences& s, const GeometryRegion& r, void* workspace) {
  BatchLayout b;
  b.q_start = geometry_at<int64_t>(workspace, r.q_start);
  b.k_len = geometry_at<int64_t>(workspace, r.k_len);
  b.seq_of_query = geometry_at<int32_t>(workspace, r.seq_of_query);
  b.batch = s.batch;
  b.total_q = s.total_q;
  b.max_q_len = s.max_seqlen_q;
  b.max_k_len = s.max_seqlen_k;
  return b;
}

KeyLayout key_layout(const Keys& keys, int64_t block_size, const GeometryRegion& r, void* workspace,
                     bool paged) {
  KeyLayout l;
  l.data = keys.data;
  l.block_size = block_size;
  l.token_stride = keys.token_stride;
  l.head_stride = keys.head_stride;
  if (paged) {
    l.block_stride = keys.page_stride;
    l.page_table = keys.page_table;
    l.page_table_stride = keys.page_table_stride;
  } else {
    l.block_stride = block_size * keys.token_stride;
    l.seq_token_start = geometry_at<int64_t>(workspace, r.k_start);
  }
  return l;
}

void derive(const Sequences& s, const GeometryRegion& r, void* workspace, Stream stream) {
  MSA_CHECK_ARG(workspace != nullptr, "workspace", "a device pointer (*_workspace_bytes())", "null");
  MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign == 0, "workspace",
                "a 256-byte aligned pointer", "a misaligned pointer");
  SequenceGeometryArgs a;
  a.seqs = s;
  a.q_start = at<int64_t>(workspace, r.q_start);
  a.k_len = at<int64_t>(workspace, r.k_len);
  a.k_start = s.cu_seqlens_k ? at<int64_t>(workspace, r.k_start) : nullptr;
  a.seq_of_query = at<int32_t>(workspace, r.seq_of_query);
  derive_sequence_geometry(a, stream);
}

IndexerLaunch indexer_launch(const IndexerParams& p, const GeometryRegion& r, void* workspace) {
  IndexerLaunch l;
  l.qi = p.qi;
  l.heads = p.heads;
  l.dim = p.dim;
  const bool paged = p.ki_format != KeyFormat::bf16 || is_paged(p.ki);
  l.ki = key_layout(p.ki, p.block_size, r, workspace, paged);
  l.ki_format = p.ki_format;
  l.ki_quantized = p.ki_quantized;
  l.batch = batch_layout(p.seqs, r, workspace);
  l.block_size = p.block_size;
  l.topk = p.topk;
  l.local_blocks = p.local_blocks;
  l.init_blocks = p.init_blocks;
  l.logit_scale = p.logit_scale;
  l.topk_out = p.topk_out;
  l.lse_out = p.lse_out;
  l.fp8_compute = p.fp8_compute;
  l.ki_tokens = p.ki_tokens;
  l.scan_engine = p.scan_engine;
  l.ranking = p.ranking;
  l.max_chunk_queries = p.max_chunk_queries;
  return l;
}

bool indexer_paged(const IndexerParams& p) {
  return p.ki_format != KeyFormat::bf16 || is_paged(p.ki);
}

AttentionLaunch attention_launch(const AttentionParams& p, const GeometryRegion& r, void* workspace) {
  AttentionLaunch l;
  const bool paged = is_paged(p.k);
  MSA_CHECK_ARG(is_paged(p.v) == paged, "v", std::string("a ") + (paged ? "paged" : "packed") +
                " layout like k", paged ? "a packed one" : "a paged one");
  l.q = p.q;
  l.k = key_layout(p.k, p.block_size, r, workspace, paged);
  l.v = key_layout(p.v, p.block_size, r, workspace, paged);
  l.q_heads = p.q_heads;
  l.kv_heads = p.kv_heads;
  l.head_dim = p.head_dim;
  l.batch = batch_layout(p.seqs, r, workspace);
  l.topk = p.topk;
  l.slots = p.slots;
  l.scale = p.scale;
  l.causal = p.causal;
  l.o = p.o;
  l.o_type = p.o_type;
  l.lse = p.lse;
  l.sparse_engine = p.sparse_engine;
  l.sparse_q_load = p.sparse_q_load;
  l.sparse_order = p.sparse_order;
  l.dense_engine = p.dense_engine;
  l.max_chunk_queries = p.max_chunk_queries;
  l.kv_format = p.kv_format;
  l.k_fp8 = p.k_fp8;
  l.v_fp8 = p.v_fp8;
  return l;
}

AttentionBackwardLaunch backward_launch(const AttentionBackwardParams& p, const GeometryRegion& r,
                                        void* workspace) {
  MSA_CHECK_ARG(!is_paged(p.k) && !is_paged(p.v), "k", "packed keys (training layouts)",
                "a paged layout");
  AttentionBackwardLaunch l;
  l.q = p.q;
  l.k = key_layout(p.k, p.block_size, r, workspace, false);
  l.v = key_layout(p.v, p.block_size, r, workspace, false);
  l.o = p.o;
  l.grad_o = p.grad_o;
  l.lse = p.lse;
  l.q_heads = p.q_heads;
  l.kv_heads = p.kv_heads;
  l.head_dim = p.head_dim;
  l.total_k = p.total_k;
  l.batch = batch_layout(p.seqs, r, workspace);
  l.topk = p.topk;
  l.slots = p.slots;
  l.scale = p.scale;
  l.deterministic = p.deterministic;
  l.dq = p.dq;
  l.dk = p.dk;
  l.dv = p.dv;
  l.max_chunk_queries = p.max_chunk_queries;
  l.engine = p.engine;
  l.kl_teacher = p.kl_teacher;
  return l;
}

IndexerKlLaunch kl_launch(const IndexerKlParams& p, const GeometryRegion& r, void* workspace) {
  MSA_CHECK_ARG(!is_paged(p.k) && !is_paged(p.ki), "k", "packed keys (training layouts)",
                "a paged layout");
  IndexerKlLaunch l;
  l.q = p.q;
  l.k = key_layout(p.k, p.block_size, r, workspace, false);
  l.main_lse = p.main_lse;
  l.qi = p.qi;
  l.ki = key_layout(p.ki, p.block_size, r, workspace, false);
  l.q_heads = p.q_heads;
  l.kv_heads = p.kv_heads;
  l.head_dim = p.head_dim;
  l.index_dim = p.index_dim;
  l.batch = batch_layout(p.seqs, r, workspace);
  l.total_k = p.total_k;
  l.topk = p.topk;
  l.slots = p.slots;
  l.block_size = p.block_size;
  l.scale = p.scale;
  l.logit_scale = p.logit_scale;
  l.student_lse = p.student_lse;
  l.student_lse_out = p.student_lse_out;
  l.teacher = p.teacher;
  l.loss_scale = p.loss_scale;
  l.deterministic = p.deterministic;
  l.loss = p.loss;
  l.dqi = p.dqi;
  l.dki = p.dki;
  return l;
}

// Every public call: check the sequences, lay the geometry out at the front of the workspace,
// and size or run the launcher of the op on the rest. `to_launch(region, workspace)` resolves
// the params; `bytes(launch)` and `run(launch, workspace, stream)` are the launcher's.
template <class ToLaunch, class Bytes>
size_t public_workspace_bytes(const Sequences& seqs, bool paged, const char* keys, ToLaunch to_launch,
                              Bytes bytes) {
  check_sequences(seqs, paged, keys);
  const GeometryRegion r = geometry_region(seqs, paged);
  return r.bytes + bytes(to_launch(r, nullptr));
}

template <class ToLaunch, class Run>
void public_launch(const Sequences& seqs, bool paged, const char* keys, void* workspace, Stream stream,
                   ToLaunch to_launch, Run run) {
  check_sequences(seqs, paged, keys);
  const GeometryRegion r = geometry_region(seqs, paged);
  const auto launch = to_launch(r, workspace);  // checks the params before anything runs
  // Without queries the launchers read no geometry (the backward and the KL still write
  // their zero gradients and loss).
  if (seqs.total_q > 0) derive(seqs, r, workspace, stream);
  run(launch, at<char>(workspace, r.bytes), stream);
}

}  // namespace

// ---- indexer ----

size_t indexer_workspace_bytes(const IndexerParams& params) {
  return public_workspace_bytes(
      params.seqs, indexer_paged(params), "index keys",
      [&](const GeometryRegion& r, void* ws) { return indexer_launch(params, r, ws); },
      [](const IndexerLaunch& l) { return indexer_workspace_bytes(l); });
}

bool indexer_uses_decode_path(const IndexerParams& params) {
  check_sequences(params.seqs, indexer_paged(params), "index keys");
  const GeometryRegion r = geometry_region(params.seqs, indexer_paged(params));
  return indexer_uses_decode_path(indexer_launch(params, r, nullptr));
}

void indexer(const IndexerParams& params, void* workspace, Stream stream) {
  public_launch(
      params.seqs, indexer_paged(params), "index keys", workspace, stream,
      [&](const GeometryRegion& r, void* ws) { return indexer_launch(params, r, ws); },
      [](const IndexerLaunch& l, void* ws, Stream s) { indexer(l, ws, s); });
}

// ---- attention ----

size_t attention_workspace_bytes(const AttentionParams& params) {
  return public_workspace_bytes(
      params.seqs, is_paged(params.k), "keys",
      [&](const GeometryRegion& r, void* ws) { return attention_launch(params, r, ws); },
      [](const AttentionLaunch& l) { return attention_workspace_bytes(l); });
}

bool attention_uses_decode_path(const AttentionParams& params) {
  check_sequences(params.seqs, is_paged(params.k), "keys");
  const GeometryRegion r = geometry_region(params.seqs, is_paged(params.k));
  return attention_uses_decode_path(attention_launch(params, r, nullptr));
}

void attention(const AttentionParams& params, void* workspace, Stream stream) {
  public_launch(
      params.seqs, is_paged(params.k), "keys", workspace, stream,
      [&](const GeometryRegion& r, void* ws) { return attention_launch(params, r, ws); },
      [](const AttentionLaunch& l, void* ws, Stream s) { attention(l, ws, s); });
}

// ---- MSA forward: one geometry for both branches ----

namespace {
MsaForwardLaunch forward_launch(const MsaForwardParams& p, const GeometryRegion& r, void* workspace) {
  const Sequences &a = p.index.seqs, &b = p.attention.seqs;
  MSA_CHECK_ARG(a.cu_seqlens_q == b.cu_seqlens_q && a.cu_seqlens_k == b.cu_seqlens_k &&
                    a.seq_lens == b.seq_lens && a.batch == b.batch && a.total_q == b.total_q &&
                    a.max_seqlen_q == b.max_seqlen_q && a.max_seqlen_k == b.max_seqlen_k,
                "index.seqs", "the same sequences as attention.seqs", "different ones");
  MSA_CHECK_ARG(indexer_paged(p.index) == is_paged(p.attention.k), "index.ki",
                "the same layout (paged or packed) as attention.k",
                indexer_paged(p.index) ? "paged" : "packed");
  MSA_CHECK_ARG(p.index.block_size == p.attention.block_size, "index.block_size",
                "attention.block_size = " + std::to_string(p.attention.block_size),
                p.index.block_size);
  return {indexer_launch(p.index, r, workspace), attention_launch(p.attention, r, workspace)};
}
}  // namespace

bool msa_is_dense(const IndexerParams& index) {
  return msa_equals_dense(index.seqs.max_seqlen_k, index.topk, index.block_size);
}

size_t msa_forward_workspace_bytes(const MsaForwardParams& params) {
  return public_workspace_bytes(
      params.attention.seqs, is_paged(params.attention.k), "keys",
      [&](const GeometryRegion& r, void* ws) { return forward_launch(params, r, ws); },
      [](const MsaForwardLaunch& l) { return msa_forward_workspace_bytes(l); });
}

void msa_forward(const MsaForwardParams& params, void* workspace, Stream stream) {
  public_launch(
      params.attention.seqs, is_paged(params.attention.k), "keys", workspace, stream,
      [&](const GeometryRegion& r, void* ws) { return forward_launch(params, r, ws); },
      [](const MsaForwardLaunch& l, void* ws, Stream s) { msa_forward(l, ws, s); });
}

// ---- training (packed keys) ----

size_t attention_backward_workspace_bytes(const AttentionBackwardParams& params) {
  return public_workspace_bytes(
      params.seqs, false, "keys",
      [&](const GeometryRegion& r, void* ws) { return backward_launch(params, r, ws); },
      [](const AttentionBackwardLaunch& l) { return attention_backward_workspace_bytes(l); });
}

void attention_backward(const AttentionBackwardParams& params, void* workspace, Stream stream) {
  public_launch(
      params.seqs, false, "keys", workspace, stream,
      [&](const GeometryRegion& r, void* ws) { return backward_launch(params, r, ws); },
      [](const AttentionBackwardLaunch& l, void* ws, Stream s) { attention_backward(l, ws, s); });
}

size_t indexer_kl_workspace_bytes(const IndexerKlParams& params) {
  return public_workspace_bytes(
      params.seqs, false, "keys",
      [&](const GeometryRegion& r, void* ws) { return kl_launch(params, r, ws); },
      [](const IndexerKlLaunch& l) { return indexer_kl_workspace_bytes(l); });
}

void indexer_kl(const IndexerKlParams& params, void* workspace, Stream stream) {
  public_launch(
      params.seqs, false, "keys", workspace, stream,
      [&](const GeometryRegion& r, void* ws) { return kl_launch(params, r, ws); },
      [](const IndexerKlLaunch& l, void* ws, Stream s) { indexer_kl(l, ws, s); });
}

}  // namespace msa::cuda
