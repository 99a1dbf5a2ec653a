// The public device API (msa/cuda/*.h) as a CUDA user calls it: device buffers of their own,
// int32 cu_seqlens as given, a stream of their own, bf16 or f32 outputs. The results must be
// bitwise those of the host-tensor ops (Impl::cuda, which run the same kernels and are checked
// against the CPU elsewhere), and every bf16 output bitwise the f32 output rounded to nearest
// even. The host-value checks run without a device too (DeviceApiChecks). GPU tests skip
// without a device; ctest label "gpu".
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "gpu_checks.h"
#include "msa/cuda/attention.h"
#include "msa/cuda/training.h"
#include "ops/cuda_glue.h"
#include "ops/checks.h"

namespace msa::testing {
namespace {

using cuda::DeviceBuffer;

DeviceBuffer upload(const Tensor& t, DType dtype) {
  const Tensor converted = t.to(dtype);
  DeviceBuffer buffer(converted.nbytes());
  buffer.upload(converted.raw(), converted.nbytes());
  return buffer;
}

Tensor download(const DeviceBuffer& buffer, const Shape& shape, DType dtype) {
  Tensor out = Tensor::zeros(shape, dtype);
  buffer.download(out.raw(), out.nbytes());
  return out;
}

DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer buffer(bytes);
  buffer.fill_bytes(0xff);
  return buffer;
}

// A caller-owned stream for the whole test.
struct Stream {
  cudaStream_t stream = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream); }
  void sync() const { ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess); }
};

// A varlen case on the device, as a user holds it.
struct DeviceCase {
  DeviceBuffer q, k, v, qi, ki, cu_q, cu_k;
  cuda::Sequences seqs;
  int64_t total_q = 0, q_heads = 0, kv_heads = 0, head_dim = 0, index_dim = 0;

  explicit DeviceCase(const VarlenCase& c)
      : q(upload(c.q, DType::bf16)), k(upload(c.k, DType::bf16)), v(upload(c.v, DType::bf16)),
        qi(upload(c.qi, DType::bf16)), ki(upload(c.ki, DType::bf16)),
        cu_q(upload(c.cu_seqlens_q, DType::i32)), cu_k(upload(c.cu_seqlens_k, DType::i32)) {
    total_q = c.total_q();
    q_heads = c.shape.q_heads();
    kv_heads = c.shape.kv_heads;
    head_dim = c.shape.head_dim;
    index_dim = c.shape.index_dim;
    seqs.cu_seqlens_q = cu_q.as<int32_t>();
    seqs.cu_seqlens_k = cu_k.as<int32_t>();
    seqs.batch = static_cast<int64_t>(c.seqs.size());
    seqs.total_q = total_q;
    for (const Seq& s : c.seqs) {
      seqs.max_seqlen_q = std::max(seqs.max_seqlen_q, s.q_len);
      seqs.max_seqlen_k = std::max(seqs.max_seqlen_k, s.k_len);
    }
  }

  cuda::IndexerParams indexer(const MsaParams& p, int32_t* topk_out) const {
    cuda::IndexerParams ip;
    ip.qi = qi.as<uint16_t>();
    ip.heads = kv_heads;
    ip.dim = index_dim;
    ip.ki = cuda::packed_keys(ki.as<uint16_t>(), 1, index_dim);
    ip.seqs = seqs;
    ip.block_size = p.block_size;
    ip.topk = p.topk;
    ip.local_blocks = p.local_blocks;
    ip.init_blocks = p.init_blocks;
    ip.topk_out = topk_out;
    return ip;
  }

  cuda::AttentionParams attention(const MsaParams& p, const int32_t* topk, void* o, cuda::OutputType type,
                                  float* lse) const {
    cuda::AttentionParams ap;
    ap.q = q.as<uint16_t>();
    ap.k = cuda::packed_keys(k.as<uint16_t>(), kv_heads, head_dim);
    ap.v = cuda::packed_keys(v.as<uint16_t>(), kv_heads, head_dim);
    ap.q_heads = q_heads;
    ap.kv_heads = kv_heads;
    ap.head_dim = head_dim;
    ap.seqs = seqs;
    ap.block_size = p.block_size;
    ap.topk = topk;
    ap.slots = topk ? p.topk : 0;
    ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    ap.o = o;
    ap.o_type = type;
    ap.lse = lse;
    return ap;
  }
};

// Runs attention through the public API with an f32 and a bf16 output.
struct BothOutputs {
  Tensor o_f32, o_bf16, lse;
};
BothOutputs run_attention(const DeviceCase& d, const MsaParams& p, const int32_t* topk, const Stream& stream) {
  BothOutputs out;
  const size_t elems = static_cast<size_t>(d.total_q * d.q_heads * d.head_dim);
  DeviceBuffer o32 = poisoned(elems * 4), o16 = poisoned(elems * 2);
  DeviceBuffer lse = poisoned(static_cast<size_t>(d.total_q * d.q_heads) * 4), lse16 = poisoned(lse.bytes());
  for (const bool bf16 : {false, true}) {
    const cuda::AttentionParams ap =
        d.attention(p, topk, bf16 ? o16.get() : o32.get(), bf16 ? cuda::OutputType::bf16 : cuda::OutputType::f32,
                    bf16 ? lse16.as<float>() : lse.as<float>());
    DeviceBuffer workspace(cuda::attention_workspace_bytes(ap));
    cuda::attention(ap, workspace.get(), stream.stream);
    stream.sync();
  }
  const Shape shape{d.total_q, d.q_heads, d.head_dim};
  out.o_f32 = download(o32, shape, DType::f32);
  out.o_bf16 = download(o16, shape, DType::bf16);
  out.lse = download(lse, {d.total_q, d.q_heads}, DType::f32);
  EXPECT_TRUE(bitwise_equal(out.lse, download(lse16, {d.total_q, d.q_heads}, DType::f32)))
      << "the lse must not depend on o's type";
  return out;
}

void expect_bf16_is_rounded_f32(const Tensor& bf16, const Tensor& f32, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(bf16, f32.to(DType::bf16))) << what << ": bf16 o is not the f32 o rounded";
}

// Varlen prefill (and decode-sized) batches through the public API: indexer rows, sparse and
// dense attention, msa_forward, each bitwise the host ops' Impl::cuda result.
TEST(GpuDeviceApi, VarlenCallsMatchTheHostOps) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const Stream stream;
  for (const CaseShape& shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    const MsaParams& p = shape.params;
    const int64_t B = p.block_size, k = p.topk;
    for (const std::vector<Seq>& seqs :
         {mixed_sequences(edge_lengths(B, k)),
          std::vector<Seq>{{.q_len = 1, .k_len = k * B + 1}, {.q_len = 3, .k_len = 5 * B - 1}, {.q_len = 0, .k_len = 7}}}) {
      SCOPED_TRACE(shape.describe() + ", " + std::to_string(seqs.size()) + " sequences");
      const VarlenCase c = gpu_case(shape, seqs);
      const DeviceCase d(c);

      // Indexer.
      DeviceBuffer topk(static_cast<size_t>(d.kv_heads * d.total_q * k) * 4);
      topk.fill_bytes(0x7f);
      const cuda::IndexerParams ip = d.indexer(p, topk.as<int32_t>());
      DeviceBuffer index_ws(cuda::indexer_workspace_bytes(ip));
      cuda::indexer(ip, index_ws.get(), stream.stream);
      stream.sync();
      const Tensor rows = download(topk, {d.kv_heads, d.total_q, k}, DType::i32);
      const IndexerOutput host_rows = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
      EXPECT_TRUE(bitwise_equal(rows, host_rows.topk)) << "indexer rows";

      // Sparse and dense attention, f32 and bf16 outputs.
      const BothOutputs sparse = run_attention(d, p, topk.as<int32_t>(), stream);
      const AttentionOutput host_sparse =
          sparse_attention(c.q, c.k, c.v, rows, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
      EXPECT_TRUE(bitwise_equal(sparse.o_f32, host_sparse.o)) << "sparse o";
      EXPECT_TRUE(bitwise_equal(sparse.lse, host_sparse.lse)) << "sparse lse";
      expect_bf16_is_rounded_f32(sparse.o_bf16, sparse.o_f32, "sparse");
      const BothOutputs dense = run_attention(d, p, nullptr, stream);
      const AttentionOutput host_dense = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
      EXPECT_TRUE(bitwise_equal(dense.o_f32, host_dense.o)) << "dense o";
      EXPECT_TRUE(bitwise_equal(dense.lse, host_dense.lse)) << "dense lse";
      expect_bf16_is_rounded_f32(dense.o_bf16, dense.o_f32, "dense");

      // msa_forward: the indexer's rows then sparse attention (or dense where equal).
      DeviceBuffer forward_topk(topk.bytes()), o(static_cast<size_t>(d.total_q * d.q_heads * d.head_dim) * 4),
          lse(static_cast<size_t>(d.total_q * d.q_heads) * 4);
      cuda::MsaForwardParams fp{d.indexer(p, forward_topk.as<int32_t>()),
                                d.attention(p, forward_topk.as<int32_t>(), o.get(), cuda::OutputType::f32,
                                            lse.as<float>())};
      DeviceBuffer forward_ws(cuda::msa_forward_workspace_bytes(fp));
      cuda::msa_forward(fp, forward_ws.get(), stream.stream);
      stream.sync();
      const Tensor forward_o = download(o, {d.total_q, d.q_heads, d.head_dim}, DType::f32);
      EXPECT_TRUE(bitwise_equal(forward_o, cuda::msa_is_dense(fp.index) ? dense.o_f32 : sparse.o_f32))
          << "msa_forward o";
    }
  }
}

// Paged caches (shuffled pages, garbage in unused slots) with <= 16 queries per request: the
// decode path through the public API against the host paged ops.
TEST(GpuDeviceApi, PagedDecodeMatchesTheHostOps) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const Stream stream;
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  const MsaParams& p = shape.params;
  const VarlenCase c = gpu_case(shape, {{.q_len = 1, .k_len = 40000}, {.q_len = 8, .k_len = 2049}, {.q_len = 3, .k_len = 130}});
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  const DeviceCase d(c);
  const DeviceBuffer k_cache = upload(paged.cache.k_cache, DType::bf16), v_cache = upload(paged.cache.v_cache, DType::bf16),
                     ki_cache = upload(paged.cache.index_key_cache, DType::bf16),
                     table = upload(paged.cache.page_table, DType::i32), seq_lens = upload(paged.cache.seq_lens, DType::i32),
                     cu_q = upload(paged.cu_seqlens_q, DType::i32);
  const int64_t stride = paged.cache.page_table.size(1), k = p.topk;
  cuda::Sequences seqs = d.seqs;
  seqs.cu_seqlens_q = cu_q.as<int32_t>();
  seqs.cu_seqlens_k = nullptr;
  seqs.seq_lens = seq_lens.as<int32_t>();

  DeviceBuffer topk(static_cast<size_t>(d.kv_heads * d.total_q * k) * 4);
  cuda::IndexerParams ip = d.indexer(p, topk.as<int32_t>());
  ip.seqs = seqs;
  ip.ki = cuda::paged_keys(ki_cache.as<uint16_t>(), 1, p.block_size, d.index_dim, table.as<int32_t>(), stride);
  ASSERT_TRUE(cuda::indexer_uses_decode_path(ip));
  DeviceBuffer index_ws(cuda::indexer_workspace_bytes(ip));
  cuda::indexer(ip, index_ws.get(), stream.stream);
  stream.sync();
  const Tensor rows = download(topk, {d.kv_heads, d.total_q, k}, DType::i32);
  EXPECT_TRUE(bitwise_equal(rows, paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cuda).topk));

  for (const bool sparse : {true, false}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    const size_t elems = static_cast<size_t>(d.total_q * d.q_heads * d.head_dim);
    DeviceBuffer o32 = poisoned(elems * 4), o16 = poisoned(elems * 2), lse = poisoned(static_cast<size_t>(d.total_q * d.q_heads) * 4);
    for (const bool bf16 : {false, true}) {
      cuda::AttentionParams ap = d.attention(p, sparse ? topk.as<int32_t>() : nullptr, bf16 ? o16.get() : o32.get(),
                                             bf16 ? cuda::OutputType::bf16 : cuda::OutputType::f32, lse.as<float>());
      ap.seqs = seqs;
      ap.k = cuda::paged_keys(k_cache.as<uint16_t>(), d.kv_heads, p.block_size, d.head_dim, table.as<int32_t>(), stride);
      ap.v = cuda::paged_keys(v_cache.as<uint16_t>(), d.kv_heads, p.block_size, d.head_dim, table.as<int32_t>(), stride);
      ASSERT_TRUE(cuda::attention_uses_decode_path(ap));
      DeviceBuffer ws(cuda::attention_workspace_bytes(ap));
      cuda::attention(ap, ws.get(), stream.stream);
      stream.sync();
    }
    const AttentionOutput host =
        sparse ? paged_sparse_attention(c.q, paged.cache, rows, paged.cu_seqlens_q, p, Impl::cuda)
               : paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::cuda);
    const Tensor o_f32 = download(o32, host.o.shape(), DType::f32);
    EXPECT_TRUE(bitwise_equal(o_f32, host.o));
    EXPECT_TRUE(bitwise_equal(download(lse, host.lse.shape(), DType::f32), host.lse));
    expect_bf16_is_rounded_f32(download(o16, host.o.shape(), DType::bf16), o_f32, sparse ? "paged sparse" : "paged dense");
  }
}

// Every kernel that writes o takes the bf16 output: the sparse prefill merge, both dense
// prefill engines (wgmma for D 128, mma.sync for D 64), the decode kernel without splits and
// the decode merge, sparse and dense.
TEST(GpuDeviceApi, Bf16OutputOfEveryPathIsTheRoundedF32Output) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 0)}) {
    const int64_t B = shape.params.block_size, k = shape.params.topk;
    for (const std::vector<Seq>& seqs : {std::vector<Seq>{{.q_len = 300, .k_len = 300}, {.q_len = 40, .k_len = 4000}},
                                         std::vector<Seq>{{.q_len = 1, .k_len = 100}},
                                         std::vector<Seq>{{.q_len = 2, .k_len = 30000}, {.q_len = 1, .k_len = k * B + 3}}}) {
      SCOPED_TRACE(shape.describe() + ", q_len " + std::to_string(seqs[0].q_len));
      const VarlenCase c = gpu_case(shape, seqs);
      const detail::Batch batch =
          detail::varlen_batch(c.cu_seqlens_q, c.cu_seqlens_k, c.q.size(0), c.k.size(0));
      const Tensor rows = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
      const detail::AttentionDims dims{shape.q_heads(), shape.kv_heads, shape.head_dim};
      const double scale = 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
      for (const Tensor* topk : {&rows, static_cast<const Tensor*>(nullptr)}) {
        const auto run = [&](cuda::OutputType type) {
          return detail::cuda_attention(c.q, {c.k, shape.kv_heads, shape.head_dim}, {c.v, shape.kv_heads, shape.head_dim},
                                        batch, nullptr, topk, dims, c.params(), scale, type);
        };
        const AttentionOutput f32 = run(cuda::OutputType::f32), bf16 = run(cuda::OutputType::bf16);
        EXPECT_EQ(bf16.o.dtype(), DType::bf16);
        expect_bf16_is_rounded_f32(bf16.o, f32.o, topk ? "sparse" : "dense");
        EXPECT_TRUE(bitwise_equal(bf16.lse, f32.lse));
      }
    }
  }
}

// One layer's training step as msa::training_step chains it on CUDA, through the public API on
// caller-owned buffers: indexer (rows only), sparse attention (bf16 O and LSE), the backward
// writing the KL's teacher, the KL reading it and handing back the index LSE; deterministic
// modes. Captured in ONE CUDA graph in global capture mode (any allocation, synchronous copy
// or host synchronisation in a launcher fails the capture), then replayed twice into poisoned
// outputs: every output bitwise the eager run's.
TEST(GpuDeviceApi, TrainingStepChainReplaysInOneGraph) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const Stream stream;
  for (const CaseShape& shape : {make_shape(2, 16, 128, 128, 128, 4, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    SCOPED_TRACE(shape.describe());
    const MsaParams& p = shape.params;
    const int64_t B = p.block_size, k = p.topk;
    const VarlenCase c = gpu_case(shape, mixed_sequences(edge_lengths(B, k)));
    const DeviceCase d(c);
    const int64_t rows = d.total_q * d.q_heads, q_elems = rows * d.head_dim;
    const int64_t total_k = c.k.size(0), kv_elems = total_k * d.kv_heads * d.head_dim;
    const DeviceBuffer grad_o = upload(bf16_rounded(random_normal(c.q.shape())), DType::bf16);
    // Outputs (poisoned before each run) and the attention's O / LSE, which the backward reads.
    DeviceBuffer topk(size_t(d.kv_heads * d.total_q * k) * 4), o(size_t(q_elems) * 2), lse(size_t(rows) * 4);
    DeviceBuffer dq(size_t(q_elems) * 4), dk(size_t(kv_elems) * 4), dv(size_t(kv_elems) * 4);
    DeviceBuffer teacher(size_t(d.kv_heads * d.total_q * k * B) * 4), loss(4);
    DeviceBuffer dqi(size_t(d.total_q * d.kv_heads * d.index_dim) * 4), dki(size_t(total_k * d.index_dim) * 4);
    DeviceBuffer index_lse(size_t(d.kv_heads * d.total_q) * 4);

    const cuda::IndexerParams ip = d.indexer(p, topk.as<int32_t>());
    const cuda::AttentionParams ap = d.attention(p, topk.as<int32_t>(), o.get(), cuda::OutputType::bf16, lse.as<float>());
    cuda::AttentionBackwardParams bp;
    bp.q = d.q.as<uint16_t>();
    bp.k = ap.k;
    bp.v = ap.v;
    bp.o = o.as<uint16_t>();
    bp.grad_o = grad_o.as<uint16_t>();
    bp.lse = lse.as<float>();
    bp.q_heads = d.q_heads;
    bp.kv_heads = d.kv_heads;
    bp.head_dim = d.head_dim;
    bp.total_k = total_k;
    bp.seqs = d.seqs;
    bp.block_size = B;
    bp.topk = topk.as<int32_t>();
    bp.slots = k;
    bp.scale = ap.scale;
    bp.dq = dq.as<float>();
    bp.dk = dk.as<float>();
    bp.dv = dv.as<float>();
    bp.kl_teacher = teacher.as<float>();
    cuda::IndexerKlParams kp;
    kp.qi = d.qi.as<uint16_t>();
    kp.ki = ip.ki;
    kp.q_heads = d.q_heads;
    kp.kv_heads = d.kv_heads;
    kp.index_dim = d.index_dim;
    kp.total_k = total_k;
    kp.seqs = d.seqs;
    kp.topk = topk.as<int32_t>();
    kp.slots = k;
    kp.block_size = static_cast<int>(B);
    kp.logit_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.index_dim)));
    kp.teacher = teacher.as<float>();
    kp.student_lse_out = index_lse.as<float>();
    kp.loss_scale = 1.0 / static_cast<double>(d.kv_heads * d.total_q);
    kp.loss = loss.as<float>();
    kp.dqi = dqi.as<float>();
    kp.dki = dki.as<float>();
    DeviceBuffer index_ws(cuda::indexer_workspace_bytes(ip)), attention_ws(cuda::attention_workspace_bytes(ap)),
        backward_ws(cuda::attention_backward_workspace_bytes(bp)), kl_ws(cuda::indexer_kl_workspace_bytes(kp));
    const auto chain = [&] {
      cuda::indexer(ip, index_ws.get(), stream.stream);
      cuda::attention(ap, attention_ws.get(), stream.stream);
      cuda::attention_backward(bp, backward_ws.get(), stream.stream);
      cuda::indexer_kl(kp, kl_ws.get(), stream.stream);
    };
    std::vector<DeviceBuffer*> outputs{&topk, &o, &lse, &dq, &dk, &dv, &teacher, &loss, &dqi, &dki, &index_lse};
    const auto results = [&] {
      std::vector<Tensor> out;
      for (const DeviceBuffer* b : outputs) out.push_back(download(*b, {static_cast<int64_t>(b->bytes())}, DType::u8));
      return out;
    };
    for (DeviceBuffer* b : outputs) b->fill_bytes(0xff);
    chain();
    stream.sync();
    const std::vector<Tensor> eager = results();

    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    chain();
    ASSERT_EQ(cudaStreamEndCapture(stream.stream, &graph), cudaSuccess) << "a launcher broke the capture";
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 2; ++replay) {
      for (DeviceBuffer* b : outputs) b->fill_bytes(0xff);
      ASSERT_EQ(cudaGraphLaunch(exec, stream.stream), cudaSuccess);
      stream.sync();
      const std::vector<Tensor> replayed = results();
      const char* names[] = {"topk", "o", "lse", "dq", "dk", "dv", "teacher", "loss", "dqi", "dki", "index lse"};
      for (size_t i = 0; i < outputs.size(); ++i)
        EXPECT_TRUE(bitwise_equal(replayed[i], eager[i])) << names[i] << ", replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// Host values are checked before anything touches the device (no GPU needed).
TEST(DeviceApiChecks, BadHostValuesNameTheField) {
  const auto error = [](const cuda::AttentionParams& ap) {
    try {
      cuda::attention_workspace_bytes(ap);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  alignas(16) static int32_t stand_in[4];
  alignas(16) static uint16_t data[64];
  cuda::AttentionParams ap;
  ap.q = data;
  ap.k = ap.v = cuda::packed_keys(data, 1, 64);
  ap.q_heads = ap.kv_heads = 1;
  ap.head_dim = 64;
  ap.block_size = 64;
  ap.seqs = {.cu_seqlens_q = stand_in, .cu_seqlens_k = nullptr, .seq_lens = nullptr, .batch = 1, .total_q = 4,
             .max_seqlen_q = 4, .max_seqlen_k = 8};
  EXPECT_NE(error(ap).find("cu_seqlens_k"), std::string::npos) << error(ap);
  ap.seqs.cu_seqlens_k = stand_in;
  ap.seqs.max_seqlen_q = 5;
  EXPECT_NE(error(ap).find("max_seqlen_q"), std::string::npos) << error(ap);
  ap.seqs.max_seqlen_q = 4;
  ap.seqs.max_seqlen_k = 3;
  EXPECT_NE(error(ap).find("max_seqlen_k"), std::string::npos) << error(ap);
  ap.seqs.max_seqlen_k = 8;
  ap.seqs.batch = 0;
  EXPECT_NE(error(ap).find("seqs.batch"), std::string::npos) << error(ap);
  ap.seqs.batch = 1;
  ap.seqs.cu_seqlens_q = nullptr;
  EXPECT_NE(error(ap).find("cu_seqlens_q"), std::string::npos) << error(ap);
  ap.seqs.cu_seqlens_q = stand_in;
  ap.k.page_table = stand_in;  // k paged, v packed
  EXPECT_NE(error(ap).find("seq_lens"), std::string::npos) << error(ap);
  ap.k.page_table = nullptr;
  // Bidirectional attention is dense only; head dim 80 (the vision tower's) too.
  ap.topk = stand_in;
  ap.slots = 1;
  ap.causal = false;
  EXPECT_NE(error(ap).find("argument 'causal'"), std::string::npos) << error(ap);
  ap.causal = true;
  ap.head_dim = 80;
  EXPECT_NE(error(ap).find("argument 'head_dim'"), std::string::npos) << error(ap);
  ap.topk = nullptr;
  ap.head_dim = 96;
  EXPECT_NE(error(ap).find("argument 'head_dim'"), std::string::npos) << error(ap);
}

// The backward writes the KL's teacher only where it can: with a selection, and for group sizes
// 1, 2, 4, 8 and 16 (cuda::backward_writes_kl_teacher); elsewhere kl_teacher is an error that
// names it, raised on the host before anything runs. Likewise the KL's student LSE hand-back.
TEST(DeviceApiChecks, KlHandOversAreCheckedOnTheHost) {
  alignas(16) static int32_t cu_seqlens[2] = {0, 4};
  alignas(16) static int32_t topk[16];
  alignas(16) static uint16_t data[1024];
  alignas(16) static float out[1024];
  cuda::AttentionBackwardParams p;
  p.q = p.o = p.grad_o = data;
  p.lse = out;
  p.k = p.v = cuda::packed_keys(data, 1, 64);
  p.q_heads = 3;
  p.kv_heads = 1;
  p.head_dim = 64;
  p.block_size = 64;
  p.total_k = 4;
  p.seqs = {.cu_seqlens_q = cu_seqlens, .cu_seqlens_k = cu_seqlens, .seq_lens = nullptr, .batch = 1, .total_q = 4,
            .max_seqlen_q = 4, .max_seqlen_k = 4};
  p.scale = 0.125f;
  p.dq = p.dk = p.dv = out;
  p.kl_teacher = out;
  const auto size_it = [&p] { cuda::attention_backward_workspace_bytes(p); };
  expect_error(size_it, "argument 'kl_teacher'");  // dense
  p.topk = topk;
  p.slots = 1;
  expect_error(size_it, "group size 3");
  p.q_heads = 4;  // accepted (sizing the workspace further on needs a device: no error or another one)
  try {
    size_it();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find("kl_teacher"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(cuda::backward_writes_kl_teacher(16));
  EXPECT_FALSE(cuda::backward_writes_kl_teacher(12));

  // The KL either reads the student LSE or computes it and hands it back, not both.
  cuda::IndexerKlParams kl;
  kl.q = kl.qi = data;
  kl.k = cuda::packed_keys(data, 1, 64);
  kl.ki = cuda::packed_keys(data, 1, 64);
  kl.main_lse = out;
  kl.q_heads = kl.kv_heads = 1;
  kl.head_dim = kl.index_dim = 64;
  kl.block_size = 64;
  kl.total_k = 4;
  kl.seqs = p.seqs;
  kl.topk = topk;
  kl.slots = 1;
  kl.loss = kl.dqi = kl.dki = out;
  kl.student_lse = out;
  kl.student_lse_out = out;
  expect_error([&kl] { cuda::indexer_kl_workspace_bytes(kl); }, "student_lse_out");
}

}  // namespace
}  // namespace msa::testing
