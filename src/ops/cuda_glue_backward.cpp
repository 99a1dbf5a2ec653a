// Impl::cuda of sparse_attention_backward / dense_attention_backward: uploads the validated
// inputs (q, k, v, o, dO as bf16, lse as f32), poisons dq / dk / dv, runs
// cuda::attention_backward (msa/cuda/training.h) and downloads the f32 gradients; for the
// training step, it leaves the KL's teacher on the device.
#include "msa/cuda/training.h"
#include "cuda_glue.h"
#include "cuda_glue_device.h"

namespace msa::detail {

AttentionGrads cuda_attention_backward(const AttentionBackwardInputs& in, const Batch& batch,
                                       const Tensor* topk, const AttentionDims& dims,
                                       const MsaParams& params, double scale,
                                       DeviceBuffer* kl_teacher) {
  const DeviceSequences sequences(batch, /*paged=*/false);
  const DeviceKeys d_k({in.k, dims.kv_heads, dims.head_dim}, params.block_size, nullptr, 0);
  const DeviceKeys d_v({in.v, dims.kv_heads, dims.head_dim}, params.block_size, nullptr, 0);
  const DeviceBuffer d_q = upload_as(in.q, DType::bf16);
  const DeviceBuffer d_o = upload_as(in.o, DType::bf16);
  const DeviceBuffer d_grad_o = upload_as(in.grad_o, DType::bf16);
  const DeviceBuffer d_lse = upload_as(in.lse, DType::f32);
  const DeviceBuffer d_topk = topk ? upload_as(*topk, DType::i32) : DeviceBuffer();
  DeviceBuffer d_dq = poisoned(static_cast<size_t>(in.q.numel()) * 4);
  DeviceBuffer d_dk = poisoned(static_cast<size_t>(in.k.numel()) * 4);
  DeviceBuffer d_dv = poisoned(static_cast<size_t>(in.v.numel()) * 4);

  cuda::AttentionBackwardParams p;
  p.q = d_q.as<uint16_t>();
  p.k = d_k.keys;
  p.v = d_v.keys;
  p.o = d_o.as<uint16_t>();
  p.grad_o = d_grad_o.as<uint16_t>();
  p.lse = d_lse.as<float>();
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = dims.head_dim;
  p.total_k = in.k.size(0);
  p.seqs = sequences.seqs;
  p.block_size = params.block_size;
  p.topk = topk ? d_topk.as<int32_t>() : nullptr;
  p.slots = topk ? topk->size(2) : 0;
  p.scale = static_cast<float>(scale);
  p.deterministic = params.deterministic;
  p.max_chunk_queries = params.cuda.max_chunk_queries;
  p.engine = params.cuda.backward;
  p.dq = d_dq.as<float>();
  p.dk = d_dk.as<float>();
  p.dv = d_dv.as<float>();
  if (kl_teacher) {  // poisoned: an entry the kernels miss comes back as NaN through the KL
    *kl_teacher = poisoned(static_cast<size_t>(dims.kv_heads) * in.q.size(0) * p.slots * params.block_size * 4);
    p.kl_teacher = kl_teacher->as<float>();
  }
  DeviceBuffer workspace(cuda::attention_backward_workspace_bytes(p));
  cuda::attention_backward(p, workspace.get(), nullptr);
  cuda::synchronize();

  AttentionGrads grads;
  grads.dq = download(d_dq, in.q.shape(), DType::f32);
  grads.dk = download(d_dk, in.k.shape(), DType::f32);
  grads.dv = download(d_dv, in.v.shape(), DType::f32);
  return grads;
}

}  // namespace msa::detail
