// The CUDA forms of msa._ext's ops: the caller's device arrays go into the public device API
// (msa/cuda/*.h) as they are (bf16 inputs, int32 cu_seqlens, strided key layouts where the
// API takes strides), with the caller's outputs, workspace and stream. Nothing is allocated,
// copied or synchronised here, so every call can be captured in a CUDA graph. Host values
// (shapes, dtypes, devices, strides) are checked; device data (cu_seqlens, page tables,
// selection rows) is trusted, as the device API's contract says (msa/cuda/types.h).
#include <cmath>
#include <memory>
#include <string>

#include "ext.h"

#ifdef MSA_WITH_CUDA
#include <cuda_runtime_api.h>

#include "msa/cuda/attention.h"
#include "msa/cuda/decode_plan.h"
#include "msa/cuda/indexer.h"
#include "msa/cuda/training.h"
#endif

namespace msa::python {

#ifndef MSA_WITH_CUDA

namespace {
[[noreturn]] void no_cuda() {
  throw nb::value_error(
      "argument 'device': expected a CPU tensor (this msa build has no CUDA kernels: nvcc was not found "
      "when it was built; reinstall with nvcc on the PATH), got a CUDA tensor");
}
}  // namespace

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
int64_t indexer_cuda(const IndexerArgs&, const MsaParams&, const Launch&) { no_cuda(); }
int64_t attention_cuda(const AttentionArgs&, const MsaParams&, const Launch&) { no_cuda(); }
int64_t msa_forward_cuda(const MsaForwardArgs&, const MsaParams&, const Launch&) { no_cuda(); }
int64_t attention_backward_cuda(const BackwardArgs&, const MsaParams&, const Launch&) { no_cuda(); }
int64_t indexer_kl_cuda(const KlArgs&, const MsaParams&, const Launch&) { no_cuda(); }
void bind_decode_plan(nb::module_&) {}

#else

namespace {

using cuda::Stream;

// Makes the arrays' device current for the call (kernels launch on the current device) and
// restores the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      if (cudaSetDevice(device) != cudaSuccess)
        value_error("device", "a usable CUDA device", "cuda:" + std::to_string(device));
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

Stream stream_of(const Launch& l) { return reinterpret_cast<Stream>(l.stream); }

// Every present array on `ref`'s CUDA device.
void expect_on(const Array& a, const Array& ref) {
  if (!a.present) return;
  if (!a.cuda) value_error(a.name, "a CUDA tensor (the other inputs are on CUDA)", "a CPU tensor");
  expect_same_device(a, ref);
}

// bf16 values as the kernels read them. An f32 (or f16) tensor is refused, never rounded
// silently: the caller converts it, knowing.
const uint16_t* bf16(const Array& a) {
  if (a.dtype != DType::bf16)
    type_error(a.name, "dtype bfloat16 (msa's CUDA kernels read bf16; convert with .to(torch.bfloat16))",
               a.dtype_text());
  return static_cast<const uint16_t*>(a.data);
}

const int32_t* int32(const Array& a) {
  expect_dtype(a, DType::i32);
  return static_cast<const int32_t*>(a.data);
}

float* f32_out(const Array& a) {
  expect_dtype(a, DType::f32);
  expect_contiguous(a);
  return static_cast<float*>(a.data);
}

// A 1-D int32 array of `length` elements with unit stride (a slice of a larger one is fine).
const int32_t* int32_vector(const Array& a, int64_t length) {
  expect_shape(a, {length});
  if (length > 1 && a.stride(0) != 1) value_error(a.name, "unit stride", "stride " + std::to_string(a.stride(0)));
  return int32(a);
}

// Sequences of a call: packed (cu_seqlens_k) or paged (seq_lens) keys.
cuda::Sequences sequences(const Array& cu_q, const KeySource& keys, int64_t total_q, const Launch& l) {
  if (cu_q.rank != 1 || cu_q.size(0) < 1) value_error(cu_q.name, "shape [batch + 1]", cu_q.shape_text());
  const int64_t batch = cu_q.size(0) - 1;
  cuda::Sequences s;
  s.cu_seqlens_q = int32_vector(cu_q, batch + 1);
  if (keys.paged())
    s.seq_lens = int32_vector(keys.seq_lens, batch);
  else
    s.cu_seqlens_k = int32_vector(keys.cu_seqlens_k, batch + 1);
  s.batch = batch;
  s.total_q = total_q;
  s.max_seqlen_q = l.max_seqlen_q;
  s.max_seqlen_k = l.max_seqlen_k;
  return s;
}

cuda::Keys with_pages(cuda::Keys keys, const KeySource& ks) {
  if (!ks.paged()) return keys;
  const Array& table = ks.page_table;
  expect_rank(table, 2);
  if (table.size(1) > 1 && table.stride(1) != 1)
    value_error(table.name, "rows with unit stride", "stride " + std::to_string(table.stride(1)));
  keys.page_table = int32(table);
  keys.page_table_stride = table.stride(0);
  return keys;
}

// K / V as the device API addresses them: packed [total_k, heads, dim] or paged
// [pages, heads, B, dim], any strides with unit-stride token rows (vLLM's K and V halves of
// one [blocks, heads, B, 2 dim] cache are such views).
// Rows of one token are contiguous: the kernels copy them as 16-byte vectors.
void expect_unit_last_stride(const Array& a) {
  const int64_t last = a.stride(a.rank - 1);
  if (last != 1) value_error(a.name, "unit stride in the last dimension", "stride " + std::to_string(last));
}

// K or V (bf16; fp8: float8_e4m3fn codes, whose strides then count bytes) as cuda::Keys.
cuda::Keys keys_of(const Array& k, const KeySource& ks, int64_t block_size, bool fp8 = false) {
  if (fp8)
    expect_dtype(k, DType::e4m3);
  else
    bf16(k);
  cuda::Keys keys;
  keys.data = static_cast<const uint16_t*>(k.data);
  if (ks.paged()) {
    expect_shape(k, {-1, -1, block_size, -1});
    expect_unit_last_stride(k);
    keys.page_stride = k.stride(0);
    keys.head_stride = k.stride(1);
    keys.token_stride = k.stride(2);
  } else {
    expect_rank(k, 3);
    expect_unit_last_stride(k);
    keys.token_stride = k.stride(0);
    keys.head_stride = k.stride(1);
  }
  return with_pages(keys, ks);
}

// Index keys: packed [total_k, dim] or paged [pages, B, dim] (one head).
cuda::Keys index_keys_of(const Array& ki, const KeySource& ks, int64_t block_size) {
  bf16(ki);
  cuda::Keys keys;
  keys.data = static_cast<const uint16_t*>(ki.data);
  if (ks.paged()) {
    expect_shape(ki, {-1, block_size, -1});
    expect_unit_last_stride(ki);
    keys.page_stride = ki.stride(0);
    keys.token_stride = ki.stride(1);
    keys.head_stride = ki.size(2);
  } else {
    expect_rank(ki, 2);
    expect_unit_last_stride(ki);
    keys.token_stride = ki.stride(0);
    keys.head_stride = ki.size(1);
  }
  return with_pages(keys, ks);
}

void* workspace_of(const Array& ws, size_t bytes, const Array& ref) {
  expect_on(ws, ref);
  const int64_t have = ws.numel() * (ws.dtype ? static_cast<int64_t>(dtype_size(*ws.dtype)) : 1);
  if (have < static_cast<int64_t>(bytes))
    value_error(ws.name, "at least " + std::to_string(bytes) + " bytes", std::to_string(have) + " bytes");
  expect_contiguous(ws);
  return ws.data;
}

// The size the caller allocates: at least one byte, so that the workspace has an address.
int64_t needed(size_t bytes) { return static_cast<int64_t>(bytes > 0 ? bytes : 1); }

cuda::IndexerParams indexer_params(const Array& qi, const Array& ki, const Array& cu_q, const KeySource& ks,
                                   const Array& topk_out, const Array* lse_out, const MsaParams& p,
                                   const Launch& l) {
  expect_rank(qi, 3);
  expect_contiguous(qi);
  const int64_t total_q = qi.size(0), heads = qi.size(1), dim = qi.size(2);
  for (const Array* x : {&ki, &cu_q, &topk_out, &ks.cu_seqlens_k, &ks.page_table, &ks.seq_lens}) expect_on(*x, qi);
  cuda::IndexerParams ip;
  ip.qi = bf16(qi);
  ip.heads = heads;
  ip.dim = dim;
  ip.ki = index_keys_of(ki, ks, p.block_size);
  if (ki.size(ki.rank - 1) != dim) value_error(ki.name, "index keys of dim " + std::to_string(dim) + " (qi's)", ki.shape_text());
  ip.seqs = sequences(cu_q, ks, total_q, l);
  ip.block_size = p.block_size;
  ip.topk = p.topk;
  ip.local_blocks = p.local_blocks;
  ip.init_blocks = p.init_blocks;
  const double index_scale = p.index_scale != 0 ? p.index_scale : 1.0 / std::sqrt(static_cast<double>(dim));
  ip.logit_scale = static_cast<float>(index_scale / p.temperature);
  expect_shape(topk_out, {heads, total_q, p.topk});
  expect_dtype(topk_out, DType::i32);
  expect_contiguous(topk_out);
  ip.topk_out = static_cast<int32_t*>(topk_out.data);
  if (lse_out && lse_out->present) {
    expect_on(*lse_out, qi);
    expect_shape(*lse_out, {heads, total_q});
    ip.lse_out = f32_out(*lse_out);
  }
  ip.fp8_compute = (p.index_compute == IndexCompute::fp8);
  if ((p.index_compute == IndexCompute::fp8)) {
    expect_contiguous(ki);
    ip.ki_tokens = ks.paged() ? ki.size(0) * ki.size(1) : ki.size(0);
  }
  return ip;
}

// The f32 scales of an fp8 K or V cache `codes` [pages, heads, B, D]: [1] (per tensor) or
// [pages, heads, B] (per token and head, any strides).
cuda::KvScales kv_scales_of(const Array& scale, const Array& codes) {
  expect_dtype(scale, DType::f32);
  if (scale.numel() == 1) return cuda::kv_scale_per_tensor(static_cast<const float*>(scale.data));
  expect_shape(scale, {codes.size(0), codes.size(1), codes.size(2)});
  return {static_cast<const float*>(scale.data), scale.stride(2), scale.stride(1), scale.stride(0)};
}

// fp8 K/V: k_scale and v_scale given (both or neither), paged caches.
cuda::AttentionParams attention_params(const Array& q, const Array& k, const Array& v, const Array& topk,
                                       const Array& cu_q, const KeySource& ks, const Array& o, const Array& lse,
                                       const MsaParams& p, const Launch& l, const Array* k_scale = nullptr,
                                       const Array* v_scale = nullptr) {
  expect_rank(q, 3);
  expect_contiguous(q);
  const int64_t total_q = q.size(0), q_heads = q.size(1), dim = q.size(2);
  for (const Array* x : {&k, &v, &topk, &cu_q, &o, &lse, &ks.cu_seqlens_k, &ks.page_table, &ks.seq_lens})
    expect_on(*x, q);
  const bool fp8 = k_scale && k_scale->present;
  if ((v_scale && v_scale->present) != fp8)
    value_error(fp8 ? "v_scale" : "k_scale", "a scale for both K and V of an fp8 cache", "one of them");
  if (fp8 && !ks.paged()) value_error("k_scale", "paged fp8 K/V (a page_table)", "packed keys");
  cuda::AttentionParams ap;
  ap.q = bf16(q);
  ap.k = keys_of(k, ks, p.block_size, fp8);
  ap.v = keys_of(v, ks, p.block_size, fp8);
  if (fp8) {  // the codes at k / v's layout (bytes); their data pointers are not read as bf16
    expect_on(*k_scale, q);
    expect_on(*v_scale, q);
    ap.kv_format = cuda::KvFormat::fp8;
    ap.k_fp8 = {static_cast<const uint8_t*>(k.data), kv_scales_of(*k_scale, k)};
    ap.v_fp8 = {static_cast<const uint8_t*>(v.data), kv_scales_of(*v_scale, v)};
  }
  const int64_t kv_heads = k.size(1);
  for (const Array* x : {&k, &v})
    if (x->size(1) != kv_heads || x->size(x->rank - 1) != dim)
      value_error(x->name, "keys with " + std::to_string(kv_heads) + " heads of dim " + std::to_string(dim),
                  x->shape_text());
  if (v.rank != k.rank || v.size(0) != k.size(0)) value_error(v.name, "the shape of k " + k.shape_text(), v.shape_text());
  ap.q_heads = q_heads;
  ap.kv_heads = kv_heads;
  ap.head_dim = dim;
  ap.seqs = sequences(cu_q, ks, total_q, l);
  ap.block_size = p.block_size;
  if (topk.present) {
    expect_rank(topk, 3);
    expect_shape(topk, {kv_heads, total_q, -1});
    expect_contiguous(topk);
    ap.topk = int32(topk);
    ap.slots = topk.size(2);
  }
  ap.scale = static_cast<float>(p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(dim)));
  expect_shape(o, {total_q, q_heads, dim});
  expect_contiguous(o);
  if (o.dtype == DType::bf16)
    ap.o_type = cuda::OutputType::bf16;
  else if (o.dtype == DType::f32)
    ap.o_type = cuda::OutputType::f32;
  else
    type_error(o.name, "dtype bfloat16 or float32", o.dtype_text());
  ap.o = o.data;
  expect_shape(lse, {total_q, q_heads});
  ap.lse = f32_out(lse);
  return ap;
}

}  // namespace

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}


int64_t indexer_cuda(const IndexerArgs& a, const MsaParams& p, const Launch& l) {
  const cuda::IndexerParams ip =
      indexer_params(a.qi, a.ki, a.cu_seqlens_q, a.keys, a.topk_out, &a.lse_out, p, l);
  const size_t bytes = cuda::indexer_workspace_bytes(ip);
  if (!a.workspace.present) return needed(bytes);
  void* ws = workspace_of(a.workspace, bytes, a.qi);
  const DeviceGuard guard(a.qi.device_id);
  cuda::indexer(ip, ws, stream_of(l));
  return 0;
}

int64_t attention_cuda(const AttentionArgs& a, const MsaParams& p, const Launch& l) {
  const cuda::AttentionParams ap =
      attention_params(a.q, a.k, a.v, a.topk, a.cu_seqlens_q, a.keys, a.o, a.lse, p, l, &a.k_scale, &a.v_scale);
  const size_t bytes = cuda::attention_workspace_bytes(ap);
  if (!a.workspace.present) return needed(bytes);
  void* ws = workspace_of(a.workspace, bytes, a.q);
  const DeviceGuard guard(a.q.device_id);
  cuda::attention(ap, ws, stream_of(l));
  return 0;
}

int64_t msa_forward_cuda(const MsaForwardArgs& a, const MsaParams& p, const Launch& l) {
  cuda::MsaForwardParams fp;
  fp.index = indexer_params(a.qi, a.ki, a.cu_seqlens_q, a.keys, a.topk_out, nullptr, p, l);
  const Array no_topk;
  fp.attention = attention_params(a.q, a.k, a.v, no_topk, a.cu_seqlens_q, a.keys, a.o, a.lse, p, l);
  expect_same_device(a.qi, a.q);
  fp.attention.topk = fp.index.topk_out;
  fp.attention.slots = p.topk;
  if (a.qi.size(0) != a.q.size(0)) value_error("qi", "one row per query (" + std::to_string(a.q.size(0)) + ")", a.qi.shape_text());
  const size_t bytes = cuda::msa_forward_workspace_bytes(fp);
  if (!a.workspace.present) return needed(bytes);
  void* ws = workspace_of(a.workspace, bytes, a.q);
  const DeviceGuard guard(a.q.device_id);
  cuda::msa_forward(fp, ws, stream_of(l));
  return 0;
}

int64_t attention_backward_cuda(const BackwardArgs& a, const MsaParams& p, const Launch& l) {
  const Array& q = a.q;
  expect_rank(q, 3);
  for (const Array* x : {&q, &a.k, &a.v, &a.o, &a.grad_o}) expect_contiguous(*x);
  for (const Array* x : {&a.k, &a.v, &a.topk, &a.o, &a.lse, &a.grad_o, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.dq,
                         &a.dk, &a.dv})
    expect_on(*x, q);
  const int64_t total_q = q.size(0), q_heads = q.size(1), dim = q.size(2);
  expect_rank(a.k, 3);
  const int64_t total_k = a.k.size(0), kv_heads = a.k.size(1);
  expect_shape(a.k, {total_k, kv_heads, dim});
  expect_shape(a.v, {total_k, kv_heads, dim});
  expect_shape(a.o, {total_q, q_heads, dim});
  expect_shape(a.grad_o, {total_q, q_heads, dim});
  expect_shape(a.lse, {total_q, q_heads});
  expect_shape(a.dq, {total_q, q_heads, dim});
  expect_shape(a.dk, {total_k, kv_heads, dim});
  expect_shape(a.dv, {total_k, kv_heads, dim});
  KeySource ks;
  ks.cu_seqlens_k = a.cu_seqlens_k;
  cuda::AttentionBackwardParams bp;
  bp.q = bf16(q);
  bp.k = cuda::packed_keys(bf16(a.k), kv_heads, dim);
  bp.v = cuda::packed_keys(bf16(a.v), kv_heads, dim);
  bp.o = bf16(a.o);
  bp.grad_o = bf16(a.grad_o);
  expect_dtype(a.lse, DType::f32);
  expect_contiguous(a.lse);
  bp.lse = static_cast<const float*>(a.lse.data);
  bp.q_heads = q_heads;
  bp.kv_heads = kv_heads;
  bp.head_dim = dim;
  bp.total_k = total_k;
  bp.seqs = sequences(a.cu_seqlens_q, ks, total_q, l);
  bp.block_size = p.block_size;
  if (a.topk.present) {
    expect_shape(a.topk, {kv_heads, total_q, -1});
    expect_contiguous(a.topk);
    bp.topk = int32(a.topk);
    bp.slots = a.topk.size(2);
  }
  bp.scale = static_cast<float>(p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(dim)));
  bp.deterministic = p.deterministic;
  bp.dq = f32_out(a.dq);
  bp.dk = f32_out(a.dk);
  bp.dv = f32_out(a.dv);
  const size_t bytes = cuda::attention_backward_workspace_bytes(bp);
  if (!a.workspace.present) return needed(bytes);
  void* ws = workspace_of(a.workspace, bytes, q);
  const DeviceGuard guard(q.device_id);
  cuda::attention_backward(bp, ws, stream_of(l));
  return 0;
}

int64_t indexer_kl_cuda(const KlArgs& a, const MsaParams& p, const Launch& l) {
  const Array& q = a.q;
  expect_rank(q, 3);
  for (const Array* x : {&q, &a.k, &a.qi, &a.ki, &a.lse, &a.topk}) expect_contiguous(*x);
  for (const Array* x : {&a.k, &a.lse, &a.qi, &a.ki, &a.topk, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.loss, &a.dqi,
                         &a.dki, &a.student_lse})
    expect_on(*x, q);
  const int64_t total_q = q.size(0), q_heads = q.size(1), dim = q.size(2);
  expect_rank(a.k, 3);
  const int64_t total_k = a.k.size(0), kv_heads = a.k.size(1);
  expect_shape(a.k, {total_k, kv_heads, dim});
  expect_shape(a.lse, {total_q, q_heads});
  expect_rank(a.qi, 3);
  const int64_t index_dim = a.qi.size(2);
  expect_shape(a.qi, {total_q, kv_heads, index_dim});
  expect_shape(a.ki, {total_k, index_dim});
  expect_shape(a.topk, {kv_heads, total_q, -1});
  expect_shape(a.dqi, {total_q, kv_heads, index_dim});
  expect_shape(a.dki, {total_k, index_dim});
  if (a.loss.numel() != 1) value_error(a.loss.name, "one element", a.loss.shape_text());
  KeySource ks;
  ks.cu_seqlens_k = a.cu_seqlens_k;
  cuda::IndexerKlParams kp;
  kp.q = bf16(q);
  kp.k = cuda::packed_keys(bf16(a.k), kv_heads, dim);
  expect_dtype(a.lse, DType::f32);
  kp.main_lse = static_cast<const float*>(a.lse.data);
  kp.qi = bf16(a.qi);
  kp.ki = cuda::packed_keys(bf16(a.ki), 1, index_dim);
  kp.q_heads = q_heads;
  kp.kv_heads = kv_heads;
  kp.head_dim = dim;
  kp.index_dim = index_dim;
  kp.total_k = total_k;
  kp.seqs = sequences(a.cu_seqlens_q, ks, total_q, l);
  kp.topk = int32(a.topk);
  kp.slots = a.topk.size(2);
  kp.block_size = p.block_size;
  kp.scale = static_cast<float>(p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(dim)));
  const double index_scale = p.index_scale != 0 ? p.index_scale : 1.0 / std::sqrt(static_cast<double>(index_dim));
  kp.logit_scale = static_cast<float>(index_scale / p.temperature);
  if (a.student_lse.present) {
    expect_shape(a.student_lse, {kv_heads, total_q});
    expect_dtype(a.student_lse, DType::f32);
    expect_contiguous(a.student_lse);
    kp.student_lse = static_cast<const float*>(a.student_lse.data);
  }
  kp.loss_scale = total_q > 0 ? p.kl_coefficient / static_cast<double>(kv_heads * total_q) : 0.0;
  kp.deterministic = p.deterministic;
  kp.loss = f32_out(a.loss);
  kp.dqi = f32_out(a.dqi);
  kp.dki = f32_out(a.dki);
  const size_t bytes = cuda::indexer_kl_workspace_bytes(kp);
  if (!a.workspace.present) return needed(bytes);
  void* ws = workspace_of(a.workspace, bytes, q);
  const DeviceGuard guard(q.device_id);
  cuda::indexer_kl(kp, ws, stream_of(l));
  return 0;
}

// ---- DecodePlan ----

namespace {

// A planned decode step (msa/cuda/decode_plan.h): plan once from capacities on the host, then
// run() (capturable) as often as wanted with new device contents in the same buffers.
class PyDecodePlan {
 public:
  PyDecodePlan(int64_t max_batch, int64_t max_queries, int64_t max_total_queries, int64_t max_context,
               int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t index_dim, int block_size, int topk,
               int local_blocks, int init_blocks, double scale, double index_scale, bool fp8_index_compute,
               int device)
      : device_(device) {
    const MsaParams p = op_params(block_size, topk, local_blocks, init_blocks, scale, index_scale,
                                  /*temperature=*/1, /*kl_coefficient=*/1, /*deterministic=*/true,
                                  fp8_index_compute);
    const DeviceGuard guard(device);
    plan_ = std::make_unique<cuda::DecodePlan>(
        cuda::DecodeCapacities{max_batch, max_queries, max_total_queries, max_context},
        cuda::DecodeDims{q_heads, kv_heads, head_dim, index_dim}, p);
  }

  int64_t workspace_bytes() const { return needed(plan_->workspace_bytes()); }
  bool is_dense() const { return plan_->is_dense(); }

  void run(const Nd& q, const Nd& qi, const Nd& k_cache, const Nd& v_cache, const Nd& index_key_cache,
           const Nd& page_table, const Nd& cu_q, const Nd& seq_lens, const Nd& o, const Nd& lse, const OptNd& topk,
           const Nd& workspace, uintptr_t stream) const {
    const cuda::DecodeStep s = step(q, qi, k_cache, v_cache, index_key_cache, page_table, cu_q, seq_lens, o, lse,
                                    topk, workspace);
    const DeviceGuard guard(device_);
    plan_->run(s, reinterpret_cast<Stream>(stream));
  }

  void check_last_step(const Nd& q, const Nd& qi, const Nd& k_cache, const Nd& v_cache, const Nd& index_key_cache,
                       const Nd& page_table, const Nd& cu_q, const Nd& seq_lens, const Nd& o, const Nd& lse,
                       const OptNd& topk, const Nd& workspace, uintptr_t stream) const {
    const cuda::DecodeStep s = step(q, qi, k_cache, v_cache, index_key_cache, page_table, cu_q, seq_lens, o, lse,
                                    topk, workspace);
    const DeviceGuard guard(device_);
    plan_->check_last_step(s, reinterpret_cast<Stream>(stream));
  }

 private:
  cuda::DecodeStep step(const Nd& q_nd, const Nd& qi_nd, const Nd& k_nd, const Nd& v_nd, const Nd& ik_nd,
                        const Nd& table_nd, const Nd& cu_nd, const Nd& lens_nd, const Nd& o_nd, const Nd& lse_nd,
                        const OptNd& topk_nd, const Nd& ws_nd) const {
    const Array q = array(q_nd, "q"), qi = array(qi_nd, "qi"), k = array(k_nd, "k_cache"),
                v = array(v_nd, "v_cache"), ik = array(ik_nd, "index_key_cache"), table = array(table_nd, "page_table"),
                cu = array(cu_nd, "cu_seqlens_q"), lens = array(lens_nd, "seq_lens"), o = array(o_nd, "o"),
                lse = array(lse_nd, "lse"), topk = array(topk_nd, "topk"), ws = array(ws_nd, "workspace");
    if (!q.cuda || q.device_id != device_)
      value_error("q", "a tensor on cuda:" + std::to_string(device_) + " (the plan's device)", q.cuda ? "another GPU" : "a CPU tensor");
    for (const Array* x : {&qi, &k, &v, &ik, &table, &cu, &lens, &o, &lse, &topk, &ws}) expect_on(*x, q);
    for (const Array* x : {&q, &qi, &k, &v, &ik, &cu, &lens, &o, &lse, &topk, &ws}) if (x->present) expect_contiguous(*x);
    const auto& caps = plan_->capacities();
    const auto& dims = plan_->dims();
    const int64_t rows = caps.max_total_queries > 0 ? caps.max_total_queries : caps.max_batch * caps.max_queries;
    const int64_t block = plan_->params().block_size;
    expect_shape(q, {rows, dims.q_heads, dims.head_dim});
    expect_shape(qi, {rows, dims.kv_heads, dims.index_dim});
    expect_shape(k, {-1, dims.kv_heads, block, dims.head_dim});
    expect_shape(v, {k.size(0), dims.kv_heads, block, dims.head_dim});
    expect_shape(ik, {k.size(0), block, dims.index_dim});  // one page table for every cache
    expect_shape(table, {caps.max_batch, -1});
    if (table.size(1) > 1 && table.stride(1) != 1) value_error(table.name, "rows with unit stride", "a strided table");
    expect_shape(cu, {caps.max_batch + 1});
    expect_shape(lens, {caps.max_batch});
    expect_shape(o, {rows, dims.q_heads, dims.head_dim});
    expect_shape(lse, {rows, dims.q_heads});
    cuda::DecodeStep s;
    s.q = bf16(q);
    s.qi = bf16(qi);
    s.k_cache = bf16(k);
    s.v_cache = bf16(v);
    s.index_key_cache = bf16(ik);
    s.page_table = int32(table);
    s.page_table_stride = table.stride(0);
    s.num_pages = k.size(0);
    s.cu_seqlens_q = int32(cu);
    s.seq_lens = int32(lens);
    s.o = o.data;
    if (o.dtype == DType::bf16)
      s.o_type = cuda::OutputType::bf16;
    else if (o.dtype == DType::f32)
      s.o_type = cuda::OutputType::f32;
    else
      type_error(o.name, "dtype bfloat16 or float32", o.dtype_text());
    s.lse = f32_out(lse);
    if (topk.present) {
      expect_shape(topk, {dims.kv_heads, rows, plan_->params().topk});
      expect_dtype(topk, DType::i32);
      s.topk = static_cast<int32_t*>(topk.data);
    }
    s.workspace = workspace_of(ws, plan_->workspace_bytes(), q);
    return s;
  }

  std::unique_ptr<cuda::DecodePlan> plan_;
  int device_ = 0;
};

}  // namespace

void bind_decode_plan(nb::module_& m) {
  nb::class_<PyDecodePlan>(m, "DecodePlan",
                           "msa::cuda::DecodePlan: a decode step planned from capacities, run (capturable) "
                           "with new lengths in the same buffers.")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int,
                    double, double, bool, int>(),
           nb::arg("max_batch"), nb::arg("max_queries"), nb::arg("max_total_queries"), nb::arg("max_context"),
           nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("index_dim"),
           nb::arg("block_size"), nb::arg("topk"), nb::arg("local_blocks"), nb::arg("init_blocks"),
           nb::arg("scale"), nb::arg("index_scale"), nb::arg("fp8_index_compute"), nb::arg("device"))
      .def_prop_ro("workspace_bytes", &PyDecodePlan::workspace_bytes)
      .def_prop_ro("is_dense", &PyDecodePlan::is_dense)
      .def("run", &PyDecodePlan::run, nb::arg("q"), nb::arg("qi"), nb::arg("k_cache"), nb::arg("v_cache"),
           nb::arg("index_key_cache"), nb::arg("page_table"), nb::arg("cu_seqlens_q"), nb::arg("seq_lens"),
           nb::arg("o"), nb::arg("lse"), nb::arg("topk").none(), nb::arg("workspace"), nb::arg("stream"))
      .def("check_last_step", &PyDecodePlan::check_last_step, nb::arg("q"), nb::arg("qi"), nb::arg("k_cache"),
           nb::arg("v_cache"), nb::arg("index_key_cache"), nb::arg("page_table"), nb::arg("cu_seqlens_q"),
           nb::arg("seq_lens"), nb::arg("o"), nb::arg("lse"), nb::arg("topk").none(), nb::arg("workspace"),
           nb::arg("stream"));
}

#endif  // MSA_WITH_CUDA

}  // namespace msa::python
