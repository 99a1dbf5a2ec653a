// cuBLASLt for the CUDA text model. cuBLASLt is column-major: the row-major product
// Y[rows, out] = X[rows, in] * W[out, in]^T is, seen column-major, Y^T = W^T(T) * X^T(N):
// A = W (col-major [in, out], ld in, transposed), B = X (col-major [in, rows], ld ldx),
// C = D = Y (col-major [out, rows], ld ldy). This "TN" form is cuBLASLt's fast bf16 path.
#include "gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/cuda_check.h"
#include "msa/error.h"

#define MSA_CUBLAS_CHECK(call)                                                            \
  do {                                                                                    \
    const cublasStatus_t msa_cublas_status = (call);                                      \
    if (msa_cublas_status != CUBLAS_STATUS_SUCCESS)                                       \
      MSA_FAIL("cuBLASLt error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",         \
               cublasLtGetStatusName(msa_cublas_status), " (",                            \
               cublasLtGetStatusString(msa_cublas_status), ")");                          \
  } while (0)

namespace msa::model::gpu {

namespace {

// Plans are cheap but not free; a step mix with ever-new row counts (MoE experts) would
// otherwise grow the cache without bound.
constexpr size_t kMaxPlans = 4096;

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    default: throw_arg_error("gemm dtype", "bf16 or f32", dtype_name(dtype));
  }
}

// The largest power of two (<= 256) dividing the address: the heuristic assumes 256-byte
// aligned operands unless told otherwise.
int alignment_of(const void* pointer) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};

  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

Gemm::Gemm(size_t workspace_bytes) : workspace_(workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  MSA_CUBLAS_CHECK(cublasLtCreate(&handle));
  handle_ = handle;
}

Gemm::~Gemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

Gemm::Plan& Gemm::plan_for(const Key& key) {
  const auto found = plans_.find(key);
  if (found != plans_.end()) return *found->second;
  if (plans_.size() >= kMaxPlans) plans_.clear();

  const auto [rows, out, in, ldx, ldy, in_type, y_type, align_x, align_w, align_y] = key;
  const cudaDataType_t ab = cuda_type(static_cast<DType>(in_type));
  const cudaDataType_t cd = cuda_type(static_cast<DType>(y_type));
  auto plan = std::make_unique<Plan>();
  MSA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  MSA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                  sizeof transpose));
  MSA_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep));
  MSA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, ab, static_cast<uint64_t>(in),
                                              static_cast<uint64_t>(out), in));
  MSA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, ab, static_cast<uint64_t>(in),
                                              static_cast<uint64_t>(rows), ldx));
  MSA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, cd, static_cast<uint64_t>(out),
                                              static_cast<uint64_t>(rows), ldy));

  cublasLtMatmulPreference_t preference = nullptr;
  MSA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  struct PreferenceGuard {
    cublasLtMatmulPreference_t p;
    ~PreferenceGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } guard{preference};
  const uint64_t workspace = workspace_.bytes();
  MSA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
  const uint32_t alignments[4] = {static_cast<uint32_t>(align_w), static_cast<uint32_t>(align_x),
                                  static_cast<uint32_t>(align_y), static_cast<uint32_t>(align_y)};
  const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    MSA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i],
                                                          &alignments[i], sizeof alignments[i]));
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  MSA_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->op,
                                                  plan->a, plan->b, plan->c, plan->c, preference, 1,
                                                  &result, &found_count));
  if (found_count < 1)
    MSA_FAIL("cuBLASLt has no algorithm for the linear layer rows=", rows, " out=", out, " in=", in,
             " ldx=", ldx, " ldy=", ldy, " (", dtype_name(static_cast<DType>(in_type)), " -> ",
             dtype_name(static_cast<DType>(y_type)), ", alignments x/w/y ", align_x, "/", align_w,
             "/", align_y, " bytes)");
  plan->algo = result.algo;
  Plan& stored = *plan;
  plans_.emplace(key, std::move(plan));
  return stored;
}

void Gemm::linear(const void* x, int64_t ldx, const void* w, DType in_dtype, int64_t rows,
                  int64_t out, int64_t in, void* y, DType y_dtype, int64_t ldy, bool accumulate,
                  void* stream) {
  if (rows == 0) return;
  MSA_CHECK_ARG(rows > 0 && out > 0 && in > 0, "linear shape", "positive rows, out and in",
                std::to_string(rows) + ", " + std::to_string(out) + ", " + std::to_string(in));
  MSA_CHECK_ARG(ldx >= in && ldy >= out, "linear strides", "ldx >= in and ldy >= out",
                std::to_string(ldx) + ", " + std::to_string(ldy));
  MSA_CHECK_ARG(!accumulate || y_dtype == DType::f32, "linear output", "f32 when accumulating",
                dtype_name(y_dtype));
  MSA_CHECK_ARG(x && w && y, "linear operands", "device pointers", "null");
  const Key key{rows,
                out,
                in,
                ldx,
                ldy,
                static_cast<int>(in_dtype),
                static_cast<int>(y_dtype),
                alignment_of(x),
                alignment_of(w),
                alignment_of(y)};
  Plan& plan = plan_for(key);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  MSA_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.op, &alpha, w,
                                  plan.a, x, plan.b, &beta, y, plan.c, y, plan.c, &plan.algo,
                                  workspace_.get(), workspace_.bytes(),
                                  static_cast<cudaStream_t>(stream)));
}

}  // namespace msa::model::gpu
