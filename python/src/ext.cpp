// msa._ext: the module definition, DLPack arrays as the ops read them, the argument checks
// and the dispatch of each op to its host (ext_cpu.cpp) or CUDA (ext_cuda.cpp) form.
#include "ext.h"

#include <cstring>
#include <sstream>

namespace msa::python {

// ---- arrays ----

namespace {
std::optional<DType> dtype_of_dlpack(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  // DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat, 10 float8_e4m3fn.
  switch (t.code) {
    case 0:
      if (t.bits == 32) return DType::i32;
      if (t.bits == 64) return DType::i64;
      break;
    case 1:
      if (t.bits == 8) return DType::u8;
      break;
    case 2:
      if (t.bits == 32) return DType::f32;
      if (t.bits == 64) return DType::f64;
      if (t.bits == 16) return DType::f16;
      break;
    case 4:
      if (t.bits == 16) return DType::bf16;
      break;
    case 10:
      if (t.bits == 8) return DType::e4m3;
      break;
  }
  return std::nullopt;
}

// Python's names for msa's element types, as the messages say them.
const char* torch_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::e4m3: return "float8_e4m3fn";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "?";
}
}  // namespace

int64_t Array::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool Array::contiguous() const {
  int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string Array::dtype_text() const { return dtype ? torch_name(*dtype) : "an unsupported dtype"; }

std::string Array::shape_text() const {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < rank; ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

Array array(const Nd& nd, const char* name) {
  Array a;
  a.name = name;
  a.present = true;
  a.data = const_cast<void*>(nd.data());
  a.dtype = dtype_of_dlpack(nd.dtype());
  if (nd.ndim() > static_cast<size_t>(kMaxRank))
    value_error(name, "at most " + std::to_string(kMaxRank) + " dimensions",
                std::to_string(nd.ndim()));
  a.rank = static_cast<int>(nd.ndim());
  for (int i = 0; i < a.rank; ++i) {
    a.shape[i] = static_cast<int64_t>(nd.shape(i));
    a.strides[i] = static_cast<int64_t>(nd.stride(i));
  }
  a.cuda = nd.device_type() == nb::device::cuda::value;
  if (!a.cuda && nd.device_type() != nb::device::cpu::value)
    value_error(name, "a CPU or CUDA array", "device type " + std::to_string(nd.device_type()));
  a.device_id = nd.device_id();
  return a;
}

Array array(const OptNd& nd, const char* name) {
  if (!nd) {
    Array a;
    a.name = name;
    return a;
  }
  return array(*nd, name);
}

// ---- checks ----

void type_error(const char* name, const std::string& expected, const std::string& got) {
  throw nb::type_error(("argument '" + std::string(name) + "': expected " + expected + ", got " + got).c_str());
}
void value_error(const char* name, const std::string& expected, const std::string& got) {
  throw nb::value_error(("argument '" + std::string(name) + "': expected " + expected + ", got " + got).c_str());
}

void expect_rank(const Array& a, int rank) {
  if (a.rank != rank)
    value_error(a.name, "rank " + std::to_string(rank), "rank " + std::to_string(a.rank) + " (shape " + a.shape_text() + ")");
}

void expect_dtype(const Array& a, DType dtype) {
  if (a.dtype != dtype) type_error(a.name, std::string("dtype ") + torch_name(dtype), a.dtype_text());
}

void expect_float(const Array& a) {
  if (!a.dtype || !dtype_is_float(*a.dtype) || *a.dtype == DType::e4m3)
    type_error(a.name, "a float32, bfloat16, float16 or float64 tensor", a.dtype_text());
}

void expect_contiguous(const Array& a) {
  if (!a.contiguous())
    value_error(a.name, "a contiguous tensor (call .contiguous())", "strides not those of shape " + a.shape_text());
}

void expect_shape(const Array& a, std::initializer_list<int64_t> dims) {
  bool ok = a.rank == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && a.shape[i] != d) ok = false;
    ++i;
  }
  if (ok) return;
  std::ostringstream expected;
  expected << "shape [";
  i = 0;
  for (int64_t d : dims) {
    expected << (i++ ? ", " : "");
    if (d >= 0) expected << d; else expected << "*";
  }
  expected << "]";
  value_error(a.name, expected.str(), a.shape_text());
}

void expect_same_device(const Array& a, const Array& ref) {
  if (a.cuda != ref.cuda || (a.cuda && a.device_id != ref.device_id)) {
    const auto where = [](const Array& x) { return x.cuda ? "cuda:" + std::to_string(x.device_id) : std::string("cpu"); };
    value_error(a.name, "a tensor on " + where(ref) + " (the device of '" + ref.name + "')", "one on " + where(a));
  }
}

Impl impl_of(int impl) {
  if (impl < 0 || impl > 2) value_error("impl", "0 (reference), 1 (cpu) or 2 (cuda)", std::to_string(impl));
  return static_cast<Impl>(impl);
}

Tensor host_tensor(const Array& a) {
  if (!a.dtype) type_error(a.name, "a float or integer tensor msa knows", "an unsupported dtype");
  expect_contiguous(a);
  Shape shape(a.shape, a.shape + a.rank);
  return Tensor::wrap(a.data, shape, *a.dtype, nullptr);
}

void copy_out(const Tensor& result, const Array& out) {
  expect_contiguous(out);
  if (result.dim() != out.rank) value_error(out.name, "an output of shape " + shape_string(result.shape()), out.shape_text());
  for (int i = 0; i < out.rank; ++i)
    if (result.size(i) != out.shape[i]) value_error(out.name, "an output of shape " + shape_string(result.shape()), out.shape_text());
  if (!out.dtype) type_error(out.name, "a float or int32 output", "an unsupported dtype");
  const Tensor converted = result.dtype() == *out.dtype ? result : result.to(*out.dtype);
  if (converted.nbytes()) std::memcpy(out.data, converted.raw(), converted.nbytes());
}

KeySource key_source(const OptNd& cu_seqlens_k, const OptNd& page_table, const OptNd& seq_lens) {
  KeySource s{array(cu_seqlens_k, "cu_seqlens_k"), array(page_table, "page_table"), array(seq_lens, "seq_lens")};
  if (s.page_table.present != s.seq_lens.present)
    value_error(s.page_table.present ? "seq_lens" : "page_table", "page_table and seq_lens together (paged keys)",
                "only one of them");
  if (s.paged() == s.cu_seqlens_k.present)
    value_error("cu_seqlens_k", "either cu_seqlens_k (packed keys) or page_table + seq_lens (paged keys)",
                s.paged() ? "both" : "neither");
  return s;
}

MsaParams op_params(int block_size, int topk, int local_blocks, int init_blocks, double scale,
                    double index_scale, double temperature, double kl_coefficient,
                    bool deterministic, bool fp8) {
  MsaParams m;
  m.block_size = block_size;
  m.topk = topk;
  m.local_blocks = local_blocks;
  m.init_blocks = init_blocks;
  m.scale = scale;
  m.index_scale = index_scale;
  m.temperature = temperature;
  m.kl_coefficient = kl_coefficient;
  m.deterministic = deterministic;
  m.index_compute = fp8 ? IndexCompute::fp8 : IndexCompute::exact;
  return m;
}

bool msa_forward_is_dense(int64_t max_seqlen_k, const MsaParams& p) {
  return msa_equals_dense(max_seqlen_k, p.topk, p.block_size);
}

namespace {

Launch launch_of(int64_t max_seqlen_q, int64_t max_seqlen_k, uintptr_t stream) {
  return {max_seqlen_q, max_seqlen_k, stream};
}

// msa::Error names the argument of a bad value ("argument 'x': ..."): ValueError; the rest
// (CUDA failures, internal errors) RuntimeError.
void register_errors() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const std::string_view message = e.what();
      if (message.rfind("argument '", 0) == 0 || message.find(": expected ") != std::string_view::npos)
        PyErr_SetString(PyExc_ValueError, e.what());
      else
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

int64_t run_indexer(const Nd& qi, const Nd& ki, const Nd& cu_q, const OptNd& cu_k, const OptNd& page_table,
                    const OptNd& seq_lens, const Nd& topk_out, const OptNd& lse_out, const OptNd& workspace,
                    int block_size, int topk, int local_blocks, int init_blocks, double index_scale,
                    double temperature, bool fp8, int64_t max_q, int64_t max_k, uintptr_t stream, int impl) {
  IndexerArgs a{array(qi, "qi"), array(ki, "ki"), array(cu_q, "cu_seqlens_q"), array(topk_out, "topk_out"),
                array(lse_out, "lse_out"), array(workspace, "workspace"), key_source(cu_k, page_table, seq_lens)};
  const MsaParams p = op_params(block_size, topk, local_blocks, init_blocks, 0, index_scale, temperature, 1, true, fp8);
  const Impl which = impl_of(impl);
  return which == Impl::cuda ? indexer_cuda(a, p, launch_of(max_q, max_k, stream)) : indexer_cpu(a, p, which);
}

int64_t run_attention(const Nd& q, const Nd& k, const Nd& v, const OptNd& topk, const Nd& cu_q, const OptNd& cu_k,
                      const OptNd& page_table, const OptNd& seq_lens, const Nd& o, const Nd& lse,
                      const OptNd& workspace, int block_size, double scale, int64_t max_q, int64_t max_k,
                      uintptr_t stream, int impl, const OptNd& k_scale, const OptNd& v_scale) {
  AttentionArgs a{array(q, "q"),        array(k, "k"),     array(v, "v"),
                  array(topk, "topk"),  array(cu_q, "cu_seqlens_q"),
                  array(o, "o"),        array(lse, "lse"), array(workspace, "workspace"),
                  key_source(cu_k, page_table, seq_lens),
                  array(k_scale, "k_scale"), array(v_scale, "v_scale")};
  const MsaParams p = op_params(block_size, 16, 1, 0, scale, 0, 1, 1, true, false);
  const Impl which = impl_of(impl);
  return which == Impl::cuda ? attention_cuda(a, p, launch_of(max_q, max_k, stream)) : attention_cpu(a, p, which);
}

int64_t run_msa_forward(const Nd& q, const Nd& k, const Nd& v, const Nd& qi, const Nd& ki, const Nd& cu_q,
                        const OptNd& cu_k, const OptNd& page_table, const OptNd& seq_lens, const Nd& topk_out,
                        const Nd& o, const Nd& lse, const OptNd& workspace, int block_size, int topk,
                        int local_blocks, int init_blocks, double scale, bool fp8, int64_t max_q, int64_t max_k,
                        uintptr_t stream) {
  MsaForwardArgs a{array(q, "q"), array(k, "k"), array(v, "v"), array(qi, "qi"), array(ki, "ki"),
                   array(cu_q, "cu_seqlens_q"), array(topk_out, "topk_out"), array(o, "o"), array(lse, "lse"),
                   array(workspace, "workspace"), key_source(cu_k, page_table, seq_lens)};
  const MsaParams p = op_params(block_size, topk, local_blocks, init_blocks, scale, 0, 1, 1, true, fp8);
  return msa_forward_cuda(a, p, launch_of(max_q, max_k, stream));
}

int64_t run_backward(const Nd& q, const Nd& k, const Nd& v, const OptNd& topk, const Nd& o, const Nd& lse,
                     const Nd& grad_o, const Nd& cu_q, const Nd& cu_k, const Nd& dq, const Nd& dk, const Nd& dv,
                     const OptNd& workspace, int block_size, double scale, bool deterministic, int64_t max_q,
                     int64_t max_k, uintptr_t stream, int impl) {
  BackwardArgs a{array(q, "q"), array(k, "k"), array(v, "v"), array(topk, "topk"), array(o, "o"),
                 array(lse, "lse"), array(grad_o, "grad_o"), array(cu_q, "cu_seqlens_q"),
                 array(cu_k, "cu_seqlens_k"), array(dq, "dq"), array(dk, "dk"), array(dv, "dv"),
                 array(workspace, "workspace")};
  const MsaParams p = op_params(block_size, 16, 1, 0, scale, 0, 1, 1, deterministic, false);
  const Impl which = impl_of(impl);
  return which == Impl::cuda ? attention_backward_cuda(a, p, launch_of(max_q, max_k, stream))
                             : attention_backward_cpu(a, p, which);
}

int64_t run_kl(const Nd& q, const Nd& k, const Nd& lse, const Nd& qi, const Nd& ki, const Nd& topk, const Nd& cu_q,
               const Nd& cu_k, const Nd& loss, const Nd& dqi, const Nd& dki, const OptNd& student_lse,
               const OptNd& workspace, int block_size, double scale, double index_scale, double temperature,
               double kl_coefficient, bool deterministic, int64_t max_q, int64_t max_k, uintptr_t stream, int impl) {
  KlArgs a{array(q, "q"), array(k, "k"), array(lse, "lse"), array(qi, "qi"), array(ki, "ki"), array(topk, "topk"),
           array(cu_q, "cu_seqlens_q"), array(cu_k, "cu_seqlens_k"), array(loss, "loss"), array(dqi, "dqi"),
           array(dki, "dki"), array(student_lse, "student_lse"), array(workspace, "workspace")};
  const MsaParams p = op_params(block_size, 16, 1, 0, scale, index_scale, temperature, kl_coefficient,
                               deterministic, false);
  const Impl which = impl_of(impl);
  return which == Impl::cuda ? indexer_kl_cuda(a, p, launch_of(max_q, max_k, stream)) : indexer_kl_cpu(a, p, which);
}

}  // namespace

}  // namespace msa::python

NB_MODULE(_ext, m) {
  namespace nb = nanobind;
  using namespace msa::python;
  m.doc() = "msa's compiled ops over DLPack arrays (the `msa` package's low-level layer; use msa.torch)";
  register_errors();
  const auto none = [](const char* name) { return nb::arg(name).none(); };

  m.def("indexer", &run_indexer, nb::arg("qi"), nb::arg("ki"), nb::arg("cu_seqlens_q"), none("cu_seqlens_k"),
        none("page_table"), none("seq_lens"), nb::arg("topk_out"), none("lse_out"), none("workspace"),
        nb::arg("block_size"), nb::arg("topk"), nb::arg("local_blocks"), nb::arg("init_blocks"),
        nb::arg("index_scale"), nb::arg("temperature"), nb::arg("fp8_index_compute"), nb::arg("max_seqlen_q"),
        nb::arg("max_seqlen_k"), nb::arg("stream"), nb::arg("impl"),
        "Selection rows (and optionally the selected LSE) into topk_out / lse_out. CUDA: returns the "
        "workspace bytes when workspace is None (nothing launched), else 0.");
  m.def("attention", &run_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), none("topk"), nb::arg("cu_seqlens_q"),
        none("cu_seqlens_k"), none("page_table"), none("seq_lens"), nb::arg("o"), nb::arg("lse"), none("workspace"),
        nb::arg("block_size"), nb::arg("scale"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("stream"),
        nb::arg("impl"), nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        "Sparse (topk given) or dense causal attention into o / lse; fp8 paged K/V with k_scale / v_scale.");
  m.def("msa_forward", &run_msa_forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("qi"), nb::arg("ki"),
        nb::arg("cu_seqlens_q"), none("cu_seqlens_k"), none("page_table"), none("seq_lens"), nb::arg("topk_out"),
        nb::arg("o"), nb::arg("lse"), none("workspace"), nb::arg("block_size"), nb::arg("topk"),
        nb::arg("local_blocks"), nb::arg("init_blocks"), nb::arg("scale"), nb::arg("fp8_index_compute"),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("stream"),
        "CUDA msa_forward: the indexer then sparse attention, dense where every context <= topk * B.");
  m.def(
      "msa_forward_is_dense",
      [](int64_t max_seqlen_k, int block_size, int topk) {
        return msa_forward_is_dense(max_seqlen_k, op_params(block_size, topk, 1, 0, 0, 0, 1, 1, true, false));
      },
      nb::arg("max_seqlen_k"), nb::arg("block_size"), nb::arg("topk"),
      "Whether msa_forward runs dense (every context <= topk * block_size).");
  m.def("attention_backward", &run_backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), none("topk"), nb::arg("o"),
        nb::arg("lse"), nb::arg("grad_o"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("dq"),
        nb::arg("dk"), nb::arg("dv"), none("workspace"), nb::arg("block_size"), nb::arg("scale"),
        nb::arg("deterministic"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("stream"),
        nb::arg("impl"), "dq, dk, dv of sparse (topk given) or dense causal attention.");
  m.def("indexer_kl", &run_kl, nb::arg("q"), nb::arg("k"), nb::arg("lse"), nb::arg("qi"), nb::arg("ki"),
        nb::arg("topk"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("loss"), nb::arg("dqi"),
        nb::arg("dki"), none("student_lse"), none("workspace"), nb::arg("block_size"), nb::arg("scale"),
        nb::arg("index_scale"), nb::arg("temperature"), nb::arg("kl_coefficient"), nb::arg("deterministic"),
        nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("stream"), nb::arg("impl"),
        "The indexer's KL loss and its gradients in qi and ki.");
  m.def("set_num_threads", &msa::set_num_threads, nb::arg("threads"),
        "Threads of the optimised CPU ops (0: all cores).");
  m.def("num_threads", &msa::num_threads);
  m.def("built_with_cuda", &built_with_cuda, "Whether this build has the CUDA kernels.");
  m.def("cuda_device_count", &cuda_device_count);
  bind_decode_plan(m);
}
