// The public ops: validate every argument, then run the chosen implementation on inputs
// converted to its compute type (f64 reference, f32 cpu; the cpu forward ops read bf16/f16
// keys and values in place, see key_storage) and return new output tensors.
#include <cmath>
#include <string>
#include <type_traits>

#include "checks.h"
#ifdef MSA_WITH_CUDA
#include "cuda/common/device_buffer.h"
#include "msa/cuda/training.h"  // backward_writes_kl_teacher
#include "cuda_glue.h"
#endif
#include "cpu/cpu.h"
#include "msa/ops.h"
#include "msa/quantized_kv_cache.h"
#include "reference/reference.h"
#include "validated_ops.h"

namespace msa::cuda {
class DeviceBuffer;  // the KL teacher hand-over (CUDA builds; null pointers elsewhere)
}

namespace msa {

namespace detail {
namespace {

// The reference runs on double, the optimised CPU code on float: overloads pick the one.
using cpu::attention_backward;
using cpu::attention_forward;
using cpu::indexer;
using cpu::indexer_kl;
using ref::attention_backward;
using ref::attention_forward;
using ref::indexer;
using ref::indexer_kl;

// Runs `body` with a value of the impl's compute type, then converts the float outputs it
// returns to the output dtype (f64 only for the reference given f64 queries).
template <class Outputs, class Body>
Outputs dispatch(Impl impl, const Tensor& queries, Body body) {
  Outputs outputs;
  switch (impl) {
    case Impl::reference: outputs = body(double{}); break;
    case Impl::cpu: outputs = body(float{}); break;
    case Impl::cuda:
      throw Error(impl_available(Impl::cuda)
                      ? "impl 'cuda': this op has no CUDA kernel yet; use 'cpu' or 'reference'"
                      : "impl 'cuda': this build has no CUDA backend (configure with "
                        "-DMSA_CUDA=ON on a machine with nvcc)");
  }
  const DType out = impl == Impl::reference && queries.dtype() == DType::f64 ? DType::f64
                                                                              : DType::f32;
  outputs.for_each_float([out](Tensor& tensor) {
    if (tensor.defined() && tensor.dtype() != out) tensor = tensor.to(out);
  });
  return outputs;
}

// Output structs with a way to visit their float tensors.
struct Indexer : IndexerOutput {
  template <class F> void for_each_float(F f) { f(lse); }
};
struct Attention : AttentionOutput {
  template <class F> void for_each_float(F f) { f(o); f(lse); }
};
struct Grads : AttentionGrads {
  template <class F> void for_each_float(F f) { f(dq); f(dk); f(dv); }
};
struct Kl : IndexerKlOutput {
  template <class F> void for_each_float(F f) { f(loss); f(dqi); f(dki); }
};

double main_scale(const MsaParams& params, int64_t head_dim) {
  return params.scale != 0 ? params.scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}
double index_scale(const MsaParams& params, int64_t index_dim) {
  return params.index_scale != 0 ? params.index_scale
                                 : 1.0 / std::sqrt(static_cast<double>(index_dim));
}

// The dtype of tensors whose elements are T (the CPU kernels' 16-bit storage types too).
template <class T>
constexpr DType storage_dtype() {
  if constexpr (std::is_same_v<T, cpu::Bf16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, cpu::F16>) return DType::f16;
  else return dtype_of<T>();
}

template <class T>
const T* ptr(const Tensor& tensor) {
  if (tensor.dtype() != storage_dtype<T>())
    throw Error("internal: expected a " + std::string(dtype_name(storage_dtype<T>())) +
                " tensor, got " + std::string(dtype_name(tensor.dtype())));
  return static_cast<const T*>(tensor.raw());
}

// Keys/values laid out as KeyBlocks: varlen [total, heads, dim] with batch.k_start when
// `page_table` is null, else a paged cache [pages, heads, B, dim].
template <class T>
KeyBlocks<T> key_blocks(const Tensor& keys, int64_t heads, int64_t dim, const Batch& batch,
                        const Tensor* page_table, int block_size) {
  return page_table ? paged_blocks(ptr<T>(keys), heads, dim, block_size,
                                   page_table->data<int32_t>(), page_table->size(1))
                    : varlen_blocks(ptr<T>(keys), heads, dim, block_size, batch.k_start);
}

// Key-side tensors (k, v, index keys) of the forward ops as compute type T reads them. The
// reference widens everything to f64. The CPU kernels read bf16/f16 in place, widening one
// block at a time (cpu::StoredBlocks), rather than copying a whole (possibly many-GB) paged
// cache to f32 on every call; only f64 keys are converted.
template <class T>
Tensor key_storage(const Tensor& keys) {
  if (std::is_same_v<T, float> && (keys.dtype() == DType::bf16 || keys.dtype() == DType::f16))
    return keys;
  return as_dtype(keys, dtype_of<T>());
}

// key_blocks over a tensor from key_storage<T>, typed as T's kernels take it.
template <class T>
auto forward_key_blocks(const Tensor& keys, int64_t heads, int64_t dim, const Batch& batch,
                        const Tensor* page_table, int block_size) {
  if constexpr (std::is_same_v<T, double>) {
    return key_blocks<double>(keys, heads, dim, batch, page_table, block_size);
  } else {
    const auto as = [&]<class S>(S) -> cpu::StoredBlocks {
      return key_blocks<S>(keys, heads, dim, batch, page_table, block_size);
    };
    switch (keys.dtype()) {
      case DType::bf16: return as(cpu::Bf16{});
      case DType::f16: return as(cpu::F16{});
      default: return as(float{});
    }
  }
}

// Quantized paged index keys (fp8 e4m3 codes + f32 per-token scales, or fp4 packed e2m1
// codes + e4m3 per-16 scales) as the CPU kernels read them: dequantized block by block.
cpu::StoredBlocks quantized_index_key_blocks(const Tensor& codes, const Tensor& scale,
                                             int64_t dim, const Tensor& page_table,
                                             int block_size) {
  const int32_t* table = page_table.data<int32_t>();
  const int64_t columns = page_table.size(1);
  if (codes.dtype() == DType::e4m3)
    return cpu::Fp8Blocks{
        .codes = paged_blocks(static_cast<const cpu::E4m3*>(codes.raw()), 1, dim, block_size,
                              table, columns),
        .scale = paged_blocks(scale.data<float>(), 1, 1, block_size, table, columns),
        .block_size = block_size,
        .dim = dim};
  return cpu::Fp4IndexKeys{
      .codes = paged_blocks(static_cast<const uint8_t*>(codes.raw()), 1, dim / 2, block_size,
                            table, columns),
      .scale = paged_blocks(static_cast<const cpu::E4m3*>(scale.raw()), 1, dim / 16, block_size,
                            table, columns),
      .block_size = block_size,
      .dim = dim};
}

// An fp8 K or V cache (e4m3 codes [pages, Hkv, B, D] with its f32 scale, validated) as the
// CPU kernels read it: dequantized block by block. A per-tensor scale [1] becomes a scale
// KeyBlocks whose strides are all 0 (every token and head reads scale[0]).
cpu::StoredBlocks fp8_kv_blocks(const Tensor& codes, const Tensor& scale, const Tensor& page_table) {
  const int64_t heads = codes.size(1), block_size = codes.size(2), dim = codes.size(3);
  const int32_t* table = page_table.data<int32_t>();
  const int64_t columns = page_table.size(1);
  KeyBlocks<float> scales = paged_blocks(scale.data<float>(), heads, 1, block_size, table, columns);
  if (scale.dim() == 1)  // per tensor: [1]; per token and head: [pages, Hkv, B]
    scales.token_stride = scales.head_stride = scales.block_stride = 0;
  return cpu::Fp8Blocks{
      .codes = paged_blocks(static_cast<const cpu::E4m3*>(codes.raw()), heads, dim, block_size,
                            table, columns),
      .scale = scales,
      .block_size = block_size,
      .dim = dim};
}

BlockSource selection_of(const Tensor& topk) { return {topk.data<int32_t>(), topk.size(2)}; }

#ifdef MSA_WITH_CUDA
// Impl::cuda needs a visible device; say so before any allocation fails obscurely.
void require_cuda_device() {
  if (cuda::device_count() == 0)
    throw Error("impl 'cuda': no CUDA device is visible (this build has the CUDA backend; "
                "use 'cpu' or 'reference' here)");
}
#endif

// The MSA ops are causal by definition: only the dense attention ops take causal = false.
void require_causal(const MsaParams& params, const char* op) {
  if (!params.causal)
    throw_arg_error("causal", std::string("true for ") + op +
                    " (MSA is causal; bidirectional attention is dense_attention with causal = "
                    "false)", "false");
}

#ifdef MSA_WITH_CUDA
// Impl::cuda's backward kernels are causal only (the bidirectional mode is forward-only: the
// vision tower runs inference).
void require_causal_on_cuda(const Batch& batch, const char* op) {
  if (!batch.causal)
    throw_arg_error("causal", std::string("true for ") + op +
                    " on impl 'cuda' (its backward kernels are causal only; use impl 'cpu' or "
                    "'reference' for the bidirectional backward)", "false");
}
#endif

// Indexer inputs, shared by the varlen and paged forms.
void check_index_queries(const Tensor& qi) {
  check_shape(qi, "qi", {-1, -1, -1});
  check_float(qi, "qi");
  if (qi.size(1) < 1) throw_arg_error("qi", "at least one index head", qi.size(1));
}

}  // namespace
}  // namespace detail

using namespace detail;

std::string_view impl_name(Impl impl) {
  switch (impl) {
    case Impl::reference: return "reference";
    case Impl::cpu: return "cpu";
    case Impl::cuda: return "cuda";
  }
  return "?";
}

Impl impl_from_name(std::string_view name) {
  if (name == "reference" || name == "ref") return Impl::reference;
  if (name == "cpu") return Impl::cpu;
  if (name == "cuda") return Impl::cuda;
  throw_arg_error("device", "one of cpu, reference, cuda", std::string("\"") + std::string(name) + "\"");
}

bool impl_available(Impl impl) {
#ifdef MSA_WITH_CUDA
  return impl != Impl::cuda || cuda::device_count() > 0;
#else
  return impl != Impl::cuda;
#endif
}

void validate_params(const MsaParams& params) {
  MSA_CHECK_ARG(params.block_size >= 1, "block_size", "a positive block size", params.block_size);
  MSA_CHECK_ARG(params.topk >= 1, "topk", "at least 1 selected block", params.topk);
  MSA_CHECK_ARG(params.local_blocks >= 1, "local_blocks", "at least 1 (the query's own block)",
                params.local_blocks);
  MSA_CHECK_ARG(params.init_blocks >= 0, "init_blocks", "a non-negative count", params.init_blocks);
  MSA_CHECK_ARG(params.local_blocks + params.init_blocks <= params.topk, "local_blocks + init_blocks",
                "at most topk = " + std::to_string(params.topk),
                params.local_blocks + params.init_blocks);
  MSA_CHECK_ARG(std::isfinite(params.scale), "scale", "a finite number (0 for 1/sqrt(D))",
                params.scale);
  MSA_CHECK_ARG(std::isfinite(params.index_scale), "index_scale",
                "a finite number (0 for 1/sqrt(Di))", params.index_scale);
  MSA_CHECK_ARG(params.temperature > 0 && std::isfinite(params.temperature), "temperature",
                "a positive finite number", params.temperature);
  MSA_CHECK_ARG(std::isfinite(params.kl_coefficient), "kl_coefficient", "a finite number",
                params.kl_coefficient);
  MSA_CHECK_ARG(params.index_compute == IndexCompute::exact ||
                    params.index_compute == IndexCompute::fp8,
                "index_compute", "IndexCompute::exact or IndexCompute::fp8",
                static_cast<int>(params.index_compute));
}

std::string_view index_compute_name(IndexCompute compute) {
  switch (compute) {
    case IndexCompute::exact: return "exact";
    case IndexCompute::fp8: return "fp8";
  }
  return "?";
}

IndexCompute index_compute_from_name(std::string_view name) {
  if (name == "exact") return IndexCompute::exact;
  if (name == "fp8") return IndexCompute::fp8;
  throw_arg_error("index_compute", "exact or fp8", std::string("\"") + std::string(name) + "\"");
}

namespace {
// The index branch on validated arguments, varlen or paged (see key_blocks). `key_scale`
// (paged only) marks quantized index keys: `keys` are then their codes; the reference
// dequantizes them whole (f64, exact), the CPU kernels block by block.
IndexerOutput run_indexer(const Tensor& qi, const Tensor& keys, const Tensor* page_table,
                          const Batch& batch, const MsaParams& params, Impl impl, bool want_lse,
                          const Tensor* key_scale = nullptr) {
  const int64_t heads = qi.size(1), dim = qi.size(2);
#ifdef MSA_WITH_CUDA
  if (impl == Impl::cuda) {
    require_cuda_device();
    return cuda_indexer(qi, {keys, 1, dim}, batch, page_table, params, index_scale(params, dim),
                        want_lse, key_scale);
  }
#endif
  return dispatch<Indexer>(impl, qi, [&]<class T>(T) {
    const Tensor qi_c = as_dtype(qi, dtype_of<T>());
    const Tensor keys_c = !key_scale ? key_storage<T>(keys)
                          : std::is_same_v<T, double>
                              ? dequantize_index_keys(keys, *key_scale, DType::f64)
                              : keys;
    const auto index_blocks = [&] {
      if constexpr (std::is_same_v<T, float>)
        if (key_scale)
          return quantized_index_key_blocks(keys, *key_scale, dim, *page_table,
                                            params.block_size);
      return forward_key_blocks<T>(keys_c, 1, dim, batch, page_table, params.block_size);
    };
    const auto ki = index_blocks();
    // index_compute fp8 (see IndexCompute in msa/ops.h): the selection ranks by the
    // fp8-dequantized qi rows and keys (the recipe of msa/quantized_index_keys.h; an fp8
    // cache is ranked as stored); the LSE scores the inputs as given.
    const bool fp8 = params.index_compute == IndexCompute::fp8;
    Tensor rank_qi, rank_keys;
    auto rank_ki = ki;
    if (fp8) {
      const QuantizedIndexKeys qi_fp8 = quantize_index_keys_fp8(qi);  // one scale per (query, head)
      rank_qi = dequantize_index_keys(qi_fp8.codes, qi_fp8.scale, dtype_of<T>());
      if (!key_scale) {
        const QuantizedIndexKeys ki_fp8 = quantize_index_keys_fp8(keys);  // one scale per token
        rank_keys = dequantize_index_keys(ki_fp8.codes, ki_fp8.scale, dtype_of<T>());
        rank_ki = forward_key_blocks<T>(rank_keys, 1, dim, batch, page_table, params.block_size);
      }
    }
    using Ranking = std::conditional_t<std::is_same_v<T, double>, ref::RankingInputs, cpu::IndexRanking>;
    const Ranking ranking{fp8 ? ptr<T>(rank_qi) : nullptr, &rank_ki};
    Indexer out;
    out.topk = Tensor::zeros({heads, batch.total_q(), params.topk}, DType::i32);
    if (want_lse) out.lse = Tensor::zeros({heads, batch.total_q()}, dtype_of<T>());
    indexer(ptr<T>(qi_c), heads, dim, ki, batch, params, static_cast<T>(index_scale(params, dim)),
            out.topk.data<int32_t>(), want_lse ? out.lse.data<T>() : nullptr, fp8 ? &ranking : nullptr);
    return out;
  });
}
}  // namespace

IndexerOutput indexer(const Tensor& qi, const Tensor& ki, const Tensor& cu_seqlens_q,
                      const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl) {
  validate_params(params);
  require_causal(params, "indexer");
  check_index_queries(qi);
  check_shape(ki, "ki", {-1, qi.size(2)});
  check_float(ki, "ki");
  const Batch batch = varlen_batch(cu_seqlens_q, cu_seqlens_k, qi.size(0), ki.size(0));
  return run_indexer(qi, ki, nullptr, batch, params, impl, /*want_lse=*/true);
}

namespace {
// The main-branch forward on validated arguments, varlen or paged (see key_blocks).
// `kv_scales` (paged only) marks fp8 K/V: k and v are then e4m3 codes with these scales
// (msa/quantized_kv_cache.h); the reference dequantizes them whole (f64, exact), the CPU
// kernels block by block, CUDA reads the codes on its decode path.
struct KvScales {
  const Tensor& k;
  const Tensor& v;
};
AttentionOutput run_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor* page_table, const Tensor* topk,
                              const AttentionDims& dims, const Batch& batch,
                              const MsaParams& params, Impl impl,
                              const KvScales* kv_scales = nullptr) {
#ifdef MSA_WITH_CUDA
  if (impl == Impl::cuda) {
    require_cuda_device();
    return cuda_attention(q, {k, dims.kv_heads, dims.head_dim}, {v, dims.kv_heads, dims.head_dim},
                          batch, page_table, topk, dims, params, main_scale(params, dims.head_dim),
                          cuda::OutputType::f32,
                          kv_scales ? &kv_scales->k : nullptr, kv_scales ? &kv_scales->v : nullptr);
  }
#endif
  return dispatch<Attention>(impl, q, [&]<class T>(T) {
    const auto storage = [&](const Tensor& values, const Tensor* scale) {
      if (!scale) return key_storage<T>(values);
      return std::is_same_v<T, double> ? dequantize_kv(values, *scale, DType::f64) : values;
    };
    const Tensor q_c = as_dtype(q, dtype_of<T>()),
                 k_c = storage(k, kv_scales ? &kv_scales->k : nullptr),
                 v_c = storage(v, kv_scales ? &kv_scales->v : nullptr);
    Attention out;
    out.o = Tensor::zeros(q.shape(), dtype_of<T>());
    out.lse = Tensor::zeros({batch.total_q(), dims.q_heads}, dtype_of<T>());
    const auto blocks = [&](const Tensor& t, const Tensor* scale) {
      if constexpr (std::is_same_v<T, float>)
        if (scale) return fp8_kv_blocks(t, *scale, *page_table);
      return forward_key_blocks<T>(t, dims.kv_heads, dims.head_dim, batch, page_table,
                                   params.block_size);
    };
    attention_forward(ptr<T>(q_c), blocks(k_c, kv_scales ? &kv_scales->k : nullptr),
                      blocks(v_c, kv_scales ? &kv_scales->v : nullptr), dims, batch,
                      topk ? selection_of(*topk) : BlockSource{},
                      static_cast<T>(main_scale(params, dims.head_dim)), out.o.data<T>(),
                      out.lse.data<T>());
    return out;
  });
}

AttentionOutput attention_op(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor* topk, const Tensor& cu_seqlens_q,
                             const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl) {
  validate_params(params);
  if (topk) require_causal(params, "sparse_attention");
  const AttentionDims dims = check_qkv(q, k, v);
  Batch batch = varlen_batch(cu_seqlens_q, cu_seqlens_k, q.size(0), k.size(0));
  batch.causal = params.causal;
  if (topk) check_selection(*topk, batch, dims.kv_heads, params.block_size);
  return run_attention(q, k, v, nullptr, topk, dims, batch, params, impl);
}
}  // namespace

AttentionOutput sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& topk, const Tensor& cu_seqlens_q,
                                 const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl) {
  return attention_op(q, k, v, &topk, cu_seqlens_q, cu_seqlens_k, params, impl);
}

AttentionOutput dense_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                const MsaParams& params, Impl impl) {
  return attention_op(q, k, v, nullptr, cu_seqlens_q, cu_seqlens_k, params, impl);
}

namespace {
// The main-branch backward on validated arguments. `kl_teacher` (optional, CUDA only, sparse,
// group sizes cuda::backward_writes_kl_teacher): receives the KL's teacher on the device.
AttentionGrads run_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor* topk, const Tensor& o, const Tensor& lse,
                                      const Tensor& grad_o, const AttentionDims& dims,
                                      const Batch& batch, const MsaParams& params, Impl impl,
                                      [[maybe_unused]] cuda::DeviceBuffer* kl_teacher = nullptr) {
#ifdef MSA_WITH_CUDA
  if (impl == Impl::cuda) {
    require_causal_on_cuda(batch, topk ? "sparse_attention_backward" : "dense_attention_backward");
    require_cuda_device();
    return cuda_attention_backward({q, k, v, o, lse, grad_o}, batch, topk, dims, params,
                                   main_scale(params, dims.head_dim), kl_teacher);
  }
#endif
  return dispatch<Grads>(impl, q, [&]<class T>(T) {
    const DType dt = dtype_of<T>();
    const Tensor q_c = as_dtype(q, dt), k_c = as_dtype(k, dt), v_c = as_dtype(v, dt),
                 o_c = as_dtype(o, dt), lse_c = as_dtype(lse, dt), do_c = as_dtype(grad_o, dt);
    Grads out;
    out.dq = Tensor::zeros(q.shape(), dt);
    out.dk = Tensor::zeros(k.shape(), dt);
    out.dv = Tensor::zeros(v.shape(), dt);
    const auto blocks = [&](const Tensor& t) {
      return varlen_blocks(ptr<T>(t), dims.kv_heads, dims.head_dim, params.block_size,
                           batch.k_start);
    };
    attention_backward(ptr<T>(q_c), blocks(k_c), blocks(v_c), dims, batch,
                       topk ? selection_of(*topk) : BlockSource{},
                       static_cast<T>(main_scale(params, dims.head_dim)), ptr<T>(o_c),
                       ptr<T>(lse_c), ptr<T>(do_c), out.dq.data<T>(), out.dk.data<T>(),
                       out.dv.data<T>());
    return out;
  });
}

AttentionGrads attention_backward_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor* topk, const Tensor& o, const Tensor& lse,
                                     const Tensor& grad_o, const Tensor& cu_seqlens_q,
                                     const Tensor& cu_seqlens_k, const MsaParams& params,
                                     Impl impl) {
  validate_params(params);
  if (topk) require_causal(params, "sparse_attention_backward");
  const AttentionDims dims = check_qkv(q, k, v);
  check_shape(o, "o", {q.size(0), q.size(1), q.size(2)});
  check_float(o, "o");
  check_shape(grad_o, "do", {q.size(0), q.size(1), q.size(2)});
  check_float(grad_o, "do");
  check_shape(lse, "lse", {q.size(0), q.size(1)});
  check_float(lse, "lse");
  Batch batch = varlen_batch(cu_seqlens_q, cu_seqlens_k, q.size(0), k.size(0));
  batch.causal = params.causal;
  if (topk) check_selection(*topk, batch, dims.kv_heads, params.block_size);
  return run_attention_backward(q, k, v, topk, o, lse, grad_o, dims, batch, params, impl);
}
}  // namespace

AttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& topk, const Tensor& o, const Tensor& lse,
                                         const Tensor& grad_o, const Tensor& cu_seqlens_q,
                                         const Tensor& cu_seqlens_k, const MsaParams& params,
                                         Impl impl) {
  return attention_backward_op(q, k, v, &topk, o, lse, grad_o, cu_seqlens_q, cu_seqlens_k, params,
                               impl);
}

AttentionGrads dense_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& o, const Tensor& lse, const Tensor& grad_o,
                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                        const MsaParams& params, Impl impl) {
  return attention_backward_op(q, k, v, nullptr, o, lse, grad_o, cu_seqlens_q, cu_seqlens_k,
                               params, impl);
}

namespace {
// The KL objective on validated arguments. `student_lse` (optional, [Hi, total_q]): the
// indexer's selected LSE of the same rows and params, which the CUDA KL then reads instead of
// recomputing it; the CPU paths always compute their own (the reference stays self-contained).
// `student_lse_out` (optional, CUDA only, student_lse null): receives the LSE the CUDA KL computed.
// `teacher` (optional, CUDA only): the teacher run_attention_backward left on the device.
IndexerKlOutput run_indexer_kl(const Tensor& q, const Tensor& k, const Tensor& lse,
                               const Tensor& qi, const Tensor& ki, const Tensor& topk,
                               const AttentionDims& dims, const Batch& batch,
                               const MsaParams& params, Impl impl,
                               [[maybe_unused]] const Tensor* student_lse = nullptr,
                               [[maybe_unused]] Tensor* student_lse_out = nullptr,
                               [[maybe_unused]] const cuda::DeviceBuffer* teacher = nullptr) {
  const int64_t index_dim = qi.size(2);
#ifdef MSA_WITH_CUDA
  if (impl == Impl::cuda) {
    require_cuda_device();
    return cuda_indexer_kl({q, k, lse, qi, ki, topk, student_lse}, batch, dims, params,
                           main_scale(params, dims.head_dim), index_scale(params, index_dim), teacher,
                           student_lse_out);
  }
#endif
  return dispatch<Kl>(impl, q, [&]<class T>(T) {
    const DType dt = dtype_of<T>();
    const Tensor q_c = as_dtype(q, dt), k_c = as_dtype(k, dt), lse_c = as_dtype(lse, dt),
                 qi_c = as_dtype(qi, dt), ki_c = as_dtype(ki, dt);
    Kl out;
    out.dqi = Tensor::zeros(qi.shape(), dt);
    out.dki = Tensor::zeros(ki.shape(), dt);
    const double loss = indexer_kl(
        ptr<T>(q_c),
        varlen_blocks(ptr<T>(k_c), dims.kv_heads, dims.head_dim, params.block_size, batch.k_start),
        ptr<T>(lse_c), dims, ptr<T>(qi_c),
        varlen_blocks(ptr<T>(ki_c), 1, index_dim, params.block_size, batch.k_start), index_dim,
        batch, selection_of(topk), params, static_cast<T>(main_scale(params, dims.head_dim)),
        static_cast<T>(index_scale(params, index_dim)), out.dqi.data<T>(), out.dki.data<T>());
    out.loss = Tensor::full({}, dt, loss);
    return out;
  });
}
}  // namespace

IndexerKlOutput indexer_kl(const Tensor& q, const Tensor& k, const Tensor& lse, const Tensor& qi,
                           const Tensor& ki, const Tensor& topk, const Tensor& cu_seqlens_q,
                           const Tensor& cu_seqlens_k, const MsaParams& params, Impl impl) {
  validate_params(params);
  require_causal(params, "indexer_kl");
  check_shape(q, "q", {-1, -1, -1});
  check_float(q, "q");
  check_shape(k, "k", {-1, -1, q.size(2)});
  check_float(k, "k");
  const AttentionDims dims = check_qkv(q, k, k);
  check_shape(lse, "lse", {q.size(0), q.size(1)});
  check_float(lse, "lse");
  check_shape(qi, "qi", {q.size(0), dims.kv_heads, -1});
  check_float(qi, "qi");
  check_shape(ki, "ki", {k.size(0), qi.size(2)});
  check_float(ki, "ki");
  const Batch batch = varlen_batch(cu_seqlens_q, cu_seqlens_k, q.size(0), k.size(0));
  check_selection(topk, batch, dims.kv_heads, params.block_size);
  return run_indexer_kl(q, k, lse, qi, ki, topk, dims, batch, params, impl);
}

// ---- paged forms ----

IndexerOutput paged_indexer(const Tensor& qi, const PagedKvCache& cache,
                            const Tensor& cu_seqlens_q, const MsaParams& params, Impl impl,
                            bool want_lse) {
  validate_params(params);
  require_causal(params, "paged_indexer");
  check_index_queries(qi);
  const IndexKeyFormat key_format =
      check_paged_index_keys(cache, params.block_size, qi.size(2));
  if (params.index_compute == IndexCompute::fp8 && key_format == IndexKeyFormat::fp4)
    throw_arg_error("index_compute", "exact with fp4 index keys (fp8 compute reads float or fp8 "
                    "index keys)", "fp8");
  const Batch batch = paged_batch(cu_seqlens_q, cache.seq_lens, cache.page_table,
                                  cache.index_key_cache.size(0), params.block_size, qi.size(0));
  return run_indexer(qi, cache.index_key_cache, &cache.page_table, batch, params, impl, want_lse,
                     key_format == IndexKeyFormat::plain ? nullptr : &cache.index_key_scale);
}

namespace {
AttentionOutput paged_attention_op(const Tensor& q, const PagedKvCache& cache, const Tensor* topk,
                                   const Tensor& cu_seqlens_q, const MsaParams& params,
                                   Impl impl) {
  validate_params(params);
  if (topk) require_causal(params, "paged_sparse_attention");
  const AttentionDims dims = check_paged_qkv(q, cache, params.block_size);
  Batch batch = paged_batch(cu_seqlens_q, cache.seq_lens, cache.page_table,
                            cache.k_cache.size(0), params.block_size, q.size(0));
  batch.causal = params.causal;
  if (topk) check_selection(*topk, batch, dims.kv_heads, params.block_size);
  const KvScales scales{cache.k_scale, cache.v_scale};
  return run_attention(q, cache.k_cache, cache.v_cache, &cache.page_table, topk, dims, batch,
                       params, impl, is_fp8_kv(cache) ? &scales : nullptr);
}
}  // namespace

AttentionOutput paged_sparse_attention(const Tensor& q, const PagedKvCache& cache,
                                       const Tensor& topk, const Tensor& cu_seqlens_q,
                                       const MsaParams& params, Impl impl) {
  return paged_attention_op(q, cache, &topk, cu_seqlens_q, params, impl);
}

AttentionOutput paged_dense_attention(const Tensor& q, const PagedKvCache& cache,
                                      const Tensor& cu_seqlens_q, const MsaParams& params,
                                      Impl impl) {
  return paged_attention_op(q, cache, nullptr, cu_seqlens_q, params, impl);
}

bool msa_equals_dense(const PagedKvCache& cache, const MsaParams& params) {
  validate_params(params);
  check_shape(cache.seq_lens, "seq_lens", {-1});
  check_int32(cache.seq_lens, "seq_lens");
  for (int32_t length : cache.seq_lens.span<int32_t>())
    if (!msa_equals_dense(length, params.topk, params.block_size)) return false;
  return true;
}

MsaOutput paged_msa_attention(const Tensor& q, const Tensor& qi, const PagedKvCache& cache,
                              const Tensor& cu_seqlens_q, const MsaParams& params, Impl impl) {
  validate_params(params);
  require_causal(params, "paged_msa_attention");
  check_paged_qkv(q, cache, params.block_size);  // a bad K/V cache fails before the indexer runs
  MsaOutput out;
  if (msa_equals_dense(cache, params)) {
    out.attention = paged_dense_attention(q, cache, cu_seqlens_q, params, impl);
    return out;
  }
  out.topk = paged_indexer(qi, cache, cu_seqlens_q, params, impl).topk;
  out.attention = paged_sparse_attention(q, cache, out.topk, cu_seqlens_q, params, impl);
  return out;
}

void append_kv_cache(PagedKvCache& cache, const Tensor& k, const Tensor& v,
                     const Tensor& slot_mapping, Impl impl) {
  const std::vector<int64_t> slots = check_kv_append(cache, k, v, slot_mapping);
  switch (impl) {
    case Impl::reference:
      ref::append_kv(k, slots, cache.k_cache, cache.k_scale);
      ref::append_kv(v, slots, cache.v_cache, cache.v_scale);
      return;
    case Impl::cpu:
      cpu::append_kv(k, slots, cache.k_cache, cache.k_scale);
      cpu::append_kv(v, slots, cache.v_cache, cache.v_scale);
      return;
    case Impl::cuda:
#ifdef MSA_WITH_CUDA
      require_cuda_device();
      cuda_append_kv(cache, k, v, slots);
      return;
#else
      throw Error("impl 'cuda': this build has no CUDA backend (configure with -DMSA_CUDA=ON on "
                  "a machine with nvcc)");
#endif
  }
}

// ---- the varlen ops on validated arguments (validated_ops.h) ----

namespace detail {

IndexerOutput validated_indexer(const Tensor& qi, const Tensor& ki, const Batch& batch,
                                const MsaParams& params, Impl impl, bool want_lse) {
  return run_indexer(qi, ki, nullptr, batch, params, impl, want_lse);
}

AttentionOutput validated_sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& topk, const AttentionDims& dims,
                                           const Batch& batch, const MsaParams& params,
                                           Impl impl) {
  return run_attention(q, k, v, nullptr, &topk, dims, batch, params, impl);
}

AttentionGrads validated_sparse_attention_backward(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& topk,
                                                   const AttentionOutput& forward,
                                                   const Tensor& grad_o, const AttentionDims& dims,
                                                   const Batch& batch, const MsaParams& params,
                                                   Impl impl) {
  return run_attention_backward(q, k, v, &topk, forward.o, forward.lse, grad_o, dims, batch,
                                params, impl);
}

IndexerKlOutput validated_indexer_kl(const Tensor& q, const Tensor& k, const Tensor& main_lse,
                                     const Tensor& qi, const Tensor& ki, const Tensor& topk,
                                     const AttentionDims& dims, const Batch& batch,
                                     const MsaParams& params, Impl impl, const Tensor* index_lse,
                                     Tensor* index_lse_out) {
  if (index_lse) check_shape(*index_lse, "index lse", {dims.kv_heads, q.size(0)});
  return run_indexer_kl(q, k, main_lse, qi, ki, topk, dims, batch, params, impl, index_lse, index_lse_out);
}

BackwardAndKl validated_backward_and_kl(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& topk, const AttentionOutput& forward,
                                        const Tensor& grad_o, const Tensor& qi, const Tensor& ki,
                                        const AttentionDims& dims, const Batch& batch,
                                        const MsaParams& params, Impl impl, const Tensor* index_lse,
                                        Tensor* index_lse_out) {
  if (index_lse) check_shape(*index_lse, "index lse", {dims.kv_heads, q.size(0)});
  cuda::DeviceBuffer* teacher = nullptr;  // the hand-over, where there is one
#ifdef MSA_WITH_CUDA
  cuda::DeviceBuffer teacher_buffer;
  if (impl == Impl::cuda && cuda::backward_writes_kl_teacher(dims.q_heads / dims.kv_heads)) teacher = &teacher_buffer;
#endif
  BackwardAndKl out;
  out.grads = run_attention_backward(q, k, v, &topk, forward.o, forward.lse, grad_o, dims, batch, params, impl,
                                     teacher);
  out.kl = run_indexer_kl(q, k, forward.lse, qi, ki, topk, dims, batch, params, impl, index_lse, index_lse_out,
                          teacher);
  return out;
}

}  // namespace detail

}  // namespace msa
