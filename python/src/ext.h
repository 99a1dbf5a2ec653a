// msa._ext, the compiled half of the `msa` Python package: what its three sources share.
//
// Every op takes DLPack arrays (nb::ndarray: a torch tensor's capsule, a CuPy or JAX array),
// never copies an input, writes outputs the caller allocated, and runs where the arrays are:
// host arrays through the host-tensor ops of msa/ops.h (ext_cpu.cpp), CUDA arrays through the
// public device API of msa/cuda/*.h on the caller's stream (ext_cuda.cpp). A bad argument
// raises TypeError (dtype) or ValueError (shape, device, layout, value) whose message names
// the argument as msa::Error does: "argument 'q': expected ..., got ...".
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "msa/dtype.h"
#include "msa/ops.h"
#include "msa/tensor.h"

namespace msa::python {

namespace nb = nanobind;
using Nd = nb::ndarray<>;
using OptNd = std::optional<nb::ndarray<>>;

constexpr int kMaxRank = 4;

// One array argument as the ops read it: element type, shape and strides (in elements),
// device. `dtype` is nullopt for element types msa has no name for.
struct Array {
  const char* name = "";
  bool present = false;
  void* data = nullptr;
  std::optional<DType> dtype;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
  bool cuda = false;
  int device_id = 0;

  int64_t size(int axis) const { return shape[axis]; }
  int64_t stride(int axis) const { return strides[axis]; }
  int64_t numel() const;
  bool contiguous() const;
  std::string dtype_text() const;
  std::string shape_text() const;
};

Array array(const Nd& nd, const char* name);
Array array(const OptNd& nd, const char* name);  // absent: present = false

// ---- argument checks (messages in msa::Error's form) ----
[[noreturn]] void type_error(const char* name, const std::string& expected, const std::string& got);
[[noreturn]] void value_error(const char* name, const std::string& expected, const std::string& got);
void expect_rank(const Array& a, int rank);
void expect_dtype(const Array& a, DType dtype);
void expect_float(const Array& a);  // f32, f64, bf16 or f16
void expect_contiguous(const Array& a);
// shape with -1 as "any": checks rank too.
void expect_shape(const Array& a, std::initializer_list<int64_t> dims);
// Same device kind and id as `ref` (the op's first tensor).
void expect_same_device(const Array& a, const Array& ref);

// The op's implementation: msa::Impl values (0 reference, 1 cpu, 2 cuda).
Impl impl_of(int impl);

// Host arrays as msa::Tensor views (contiguous, known dtype; zero copy).
Tensor host_tensor(const Array& a);
// Copies a host op's result into a caller-allocated host array of the same shape, converting
// its element type (f32 results into bf16 / f16 / f64 outputs).
void copy_out(const Tensor& result, const Array& out);

// The op parameters the Python layer passes, explicit, as msa::MsaParams (fp8: index_compute).
MsaParams op_params(int block_size, int topk, int local_blocks, int init_blocks, double scale,
                    double index_scale, double temperature, double kl_coefficient, bool deterministic,
                    bool fp8);

// Keys of one op: packed (cu_seqlens_k) or paged (page_table + seq_lens).
struct KeySource {
  Array cu_seqlens_k, page_table, seq_lens;
  bool paged() const { return page_table.present; }
};
KeySource key_source(const OptNd& cu_seqlens_k, const OptNd& page_table, const OptNd& seq_lens);

// Host values the CUDA launches are sized by (flash-attn's max_seqlen_q / max_seqlen_k).
struct Launch {
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  uintptr_t stream = 0;  // cudaStream_t of the caller (torch.cuda.current_stream())
};

// ---- the ops: host (ext_cpu.cpp) and CUDA (ext_cuda.cpp) ----
// Each CUDA op returns the workspace bytes it needs when `workspace` is absent (and launches
// nothing), else launches and returns 0. Host ops return 0.
struct IndexerArgs {
  Array qi, ki, cu_seqlens_q, topk_out, lse_out, workspace;
  KeySource keys;
};
int64_t indexer_cpu(const IndexerArgs& a, const MsaParams& p, Impl impl);
int64_t indexer_cuda(const IndexerArgs& a, const MsaParams& p, const Launch& l);

struct AttentionArgs {
  Array q, k, v, topk, cu_seqlens_q, o, lse, workspace;
  KeySource keys;
  // fp8 K/V (docs/msa.md §6.6): k, v float8_e4m3fn paged caches with f32 scales, [1] (per
  // tensor) or [pages, kv_heads, B] (per token and head); absent for bf16 / float K/V.
  Array k_scale, v_scale;
};
int64_t attention_cpu(const AttentionArgs& a, const MsaParams& p, Impl impl);
int64_t attention_cuda(const AttentionArgs& a, const MsaParams& p, const Launch& l);

struct MsaForwardArgs {
  Array q, k, v, qi, ki, cu_seqlens_q, topk_out, o, lse, workspace;
  KeySource keys;
};
int64_t msa_forward_cuda(const MsaForwardArgs& a, const MsaParams& p, const Launch& l);
bool msa_forward_is_dense(int64_t max_seqlen_k, const MsaParams& p);

struct BackwardArgs {
  Array q, k, v, topk, o, lse, grad_o, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, workspace;
};
int64_t attention_backward_cpu(const BackwardArgs& a, const MsaParams& p, Impl impl);
int64_t attention_backward_cuda(const BackwardArgs& a, const MsaParams& p, const Launch& l);

struct KlArgs {
  Array q, k, lse, qi, ki, topk, cu_seqlens_q, cu_seqlens_k, loss, dqi, dki, student_lse,
      workspace;
};
int64_t indexer_kl_cpu(const KlArgs& a, const MsaParams& p, Impl impl);
int64_t indexer_kl_cuda(const KlArgs& a, const MsaParams& p, const Launch& l);

// DecodePlan (msa/cuda/decode_plan.h) for Python; CUDA builds only.
void bind_decode_plan(nb::module_& m);

bool built_with_cuda();
int cuda_device_count();

}  // namespace msa::python
