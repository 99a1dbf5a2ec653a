// Linear layers of the CUDA text model through cuBLASLt: y = x * w^T (+ y), row-major,
// bf16 (or f32) inputs, f32 accumulation, bf16 or f32 output. One handle and workspace per
// object; matmul descriptors, layouts and the heuristic's algorithm are cached per shape
// (and per operand alignment, which the heuristic is told). Host-only header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "cuda/common/device_buffer.h"
#include "msa/dtype.h"

namespace msa::model::gpu {

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t{64} << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[rows, out] (row stride ldy) = x[rows, in] (row stride ldx) * w[out, in]^T
  //                                  + (accumulate ? y : 0).
  // x and w: both bf16, or both f32 (exact f32, no TF32); y: f32 or bf16 (accumulate needs
  // f32). Device pointers; `stream` is a cudaStream_t. rows == 0 does nothing.
  void linear(const void* x, int64_t ldx, const void* w, DType in_dtype, int64_t rows,
              int64_t out, int64_t in, void* y, DType y_dtype, int64_t ldy, bool accumulate,
              void* stream);

 private:
  struct Plan;
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int, int>;
  Plan& plan_for(const Key& key);

  void* handle_ = nullptr;  // cublasLtHandle_t
  msa::cuda::DeviceBuffer workspace_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace msa::model::gpu
