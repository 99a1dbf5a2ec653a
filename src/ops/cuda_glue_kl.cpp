// Impl::cuda of indexer_kl: uploads q, k, qi, ki (bf16), the main-branch LSE (f32) and the
// selection rows, runs cuda::indexer_kl (msa/cuda/training.h) and downloads the loss and
// gradients. Outputs are poisoned first (NaN), so an element the kernels miss fails tests.
#include "msa/cuda/training.h"
#include "cuda_glue.h"
#include "cuda_glue_device.h"

namespace msa::detail {

IndexerKlOutput cuda_indexer_kl(const KlInputs& in, const Batch& batch, const AttentionDims& dims,
                                const MsaParams& params, double scale, double index_scale,
                                const DeviceBuffer* teacher, Tensor* student_lse_out) {
  const int64_t index_dim = in.qi.size(2), total_q = batch.total_q(), total_k = in.k.size(0);
  const DeviceSequences sequences(batch, /*paged=*/false);
  const DeviceKeys d_k({in.k, dims.kv_heads, dims.head_dim}, params.block_size, nullptr, 0);
  const DeviceKeys d_ki({in.ki, 1, index_dim}, params.block_size, nullptr, 0);
  const DeviceBuffer d_q = upload_as(in.q, DType::bf16);
  const DeviceBuffer d_qi = upload_as(in.qi, DType::bf16);
  const DeviceBuffer d_lse = upload_as(in.lse, DType::f32);
  const DeviceBuffer d_topk = upload_as(in.topk, DType::i32);
  const DeviceBuffer d_student_lse = in.student_lse ? upload_as(*in.student_lse, DType::f32) : DeviceBuffer();
  DeviceBuffer d_loss = poisoned(sizeof(float));
  DeviceBuffer d_dqi = poisoned(static_cast<size_t>(in.qi.numel()) * sizeof(float));
  DeviceBuffer d_dki = poisoned(static_cast<size_t>(in.ki.numel()) * sizeof(float));

  cuda::IndexerKlParams p;
  p.q = d_q.as<uint16_t>();
  p.k = d_k.keys;
  p.main_lse = d_lse.as<float>();
  p.qi = d_qi.as<uint16_t>();
  p.ki = d_ki.keys;
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = dims.head_dim;
  p.index_dim = index_dim;
  p.seqs = sequences.seqs;
  p.total_k = total_k;
  p.topk = d_topk.as<int32_t>();
  p.slots = in.topk.size(2);
  p.block_size = params.block_size;
  p.scale = static_cast<float>(scale);
  p.logit_scale = static_cast<float>(index_scale / params.temperature);
  p.student_lse = in.student_lse ? d_student_lse.as<float>() : nullptr;
  p.teacher = teacher ? teacher->as<float>() : nullptr;
  DeviceBuffer d_student_lse_out =
      student_lse_out && !in.student_lse ? poisoned(static_cast<size_t>(dims.kv_heads) * total_q * sizeof(float))
                                         : DeviceBuffer();
  p.student_lse_out = d_student_lse_out.as<float>();
  p.loss_scale = params.kl_coefficient / static_cast<double>(dims.kv_heads * total_q);
  p.deterministic = params.deterministic;
  p.loss = d_loss.as<float>();
  p.dqi = d_dqi.as<float>();
  p.dki = d_dki.as<float>();
  DeviceBuffer workspace(cuda::indexer_kl_workspace_bytes(p));
  cuda::indexer_kl(p, workspace.get(), nullptr);
  cuda::synchronize();

  IndexerKlOutput out;
  out.loss = download(d_loss, {}, DType::f32);
  out.dqi = download(d_dqi, in.qi.shape(), DType::f32);
  out.dki = download(d_dki, in.ki.shape(), DType::f32);
  if (p.student_lse_out) *student_lse_out = download(d_student_lse_out, {dims.kv_heads, total_q}, DType::f32);
  return out;
}

}  // namespace msa::detail
