// The README's C++ example, built against the installed package: MSA of one sequence on the
// CPU, checked against dense attention where they must agree (every block selected), and,
// in a CUDA build, the public device API's workspace query.
#include <cmath>
#include <cstdio>
#include <vector>

#include "msa/ops.h"
#ifdef MSA_WITH_CUDA
#include "msa/cuda/attention.h"
#endif

#ifdef MSA_WITH_CUDA
// The README's device-API example, compiled against the installed headers (not run: it
// needs device buffers).
[[maybe_unused]] void readme_device_example(const int32_t* cu_q, const int32_t* cu_k, int64_t b, int64_t n_q,
                                            int64_t max_q, int64_t max_k, const uint16_t* qi,
                                            const uint16_t* ki, const uint16_t* q, const uint16_t* k,
                                            const uint16_t* v, int32_t* rows, void* o, float* lse,
                                            void* (*my_allocator)(size_t), msa::cuda::Stream stream) {
  msa::cuda::Sequences seqs{.cu_seqlens_q = cu_q, .cu_seqlens_k = cu_k, .batch = b,
                            .total_q = n_q, .max_seqlen_q = max_q, .max_seqlen_k = max_k};
  msa::cuda::MsaForwardParams p;
  p.index = {.qi = qi, .heads = 4, .dim = 128, .ki = msa::cuda::packed_keys(ki, 1, 128),
             .seqs = seqs, .topk_out = rows};
  p.attention = {.q = q, .k = msa::cuda::packed_keys(k, 4, 128), .v = msa::cuda::packed_keys(v, 4, 128),
                 .q_heads = 64, .kv_heads = 4, .head_dim = 128, .seqs = seqs, .topk = rows,
                 .slots = 16, .scale = 0.08838835f, .o = o, .o_type = msa::cuda::OutputType::bf16,
                 .lse = lse};
  void* ws = my_allocator(msa::cuda::msa_forward_workspace_bytes(p));
  msa::cuda::msa_forward(p, ws, stream);
}
#endif

int main() {
  const int64_t n = 300, heads = 2, kv_heads = 1, dim = 64;
  msa::MsaParams params;
  params.block_size = 64;
  params.topk = 8;  // 8 blocks of 64 cover all 300 keys: MSA equals dense attention here
  const auto random = [](msa::Shape shape, unsigned seed) {
    msa::Tensor t = msa::Tensor::zeros(shape, msa::DType::f32);
    unsigned state = seed;
    for (float& x : t.span<float>()) x = static_cast<float>((state = state * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    return t;
  };
  const msa::Tensor q = random({n, heads, dim}, 1), k = random({n, kv_heads, dim}, 2), v = random({n, kv_heads, dim}, 3);
  const msa::Tensor qi = random({n, kv_heads, dim}, 4), ki = random({n, dim}, 5);
  const msa::Tensor cu = msa::Tensor::from_vector(std::vector<int32_t>{0, static_cast<int32_t>(n)}, {2});

  const auto selection = msa::indexer(qi, ki, cu, cu, params, msa::Impl::cpu);
  const auto sparse = msa::sparse_attention(q, k, v, selection.topk, cu, cu, params, msa::Impl::cpu);
  const auto dense = msa::dense_attention(q, k, v, cu, cu, params, msa::Impl::cpu);
  double worst = 0;
  for (int64_t i = 0; i < sparse.o.numel(); ++i) worst = std::fmax(worst, std::fabs(sparse.o.get(i) - dense.o.get(i)));
  std::printf("msa vs dense: max |diff| = %g\n", worst);
  if (!(worst < 1e-5)) return 1;

#ifdef MSA_WITH_CUDA
  // Host values only: sizing needs no device memory, and a bad field is a clear error.
  msa::cuda::AttentionParams p;
  p.seqs.batch = 1;
  p.seqs.total_q = n;
  p.seqs.max_seqlen_q = n;
  p.seqs.max_seqlen_k = n;
  try {
    (void)msa::cuda::attention_workspace_bytes(p);  // no cu_seqlens_q: refused
    return 1;
  } catch (const msa::Error& e) {
    std::printf("device API check: %s\n", e.what());
  }
#endif
  return 0;
}
