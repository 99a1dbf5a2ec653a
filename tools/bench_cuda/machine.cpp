// msa bench --device cuda: the GPU's description and its measured ceilings (bf16 matmul
// through cuBLASLt, device-to-device copy, streaming read).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <ctime>
#include <fstream>
#include <sstream>
#include <string>

#include "bench_cuda/common.h"
#include "bench_cuda/bench_kernels.h"
#ifdef MSA_WITH_CUDNN
#include "cudnn/cudnn_sdpa.h"
#endif

#define BENCH_CUBLAS(call)                                                               \
  do {                                                                                   \
    const cublasStatus_t bench_status = (call);                                          \
    if (bench_status != CUBLAS_STATUS_SUCCESS)                                           \
      MSA_FAIL("cuBLASLt error at ", __FILE__, ":", __LINE__, ": ", #call, ": ",        \
               cublasLtGetStatusName(bench_status), " (",                                \
               cublasLtGetStatusString(bench_status), ")");                              \
  } while (0)

namespace msa::cli::bench_cuda {

void fill_normal(const DeviceBuffer& buffer, uint64_t seed, cudaStream_t stream) {
  cuda::bench::fill_normal_bf16(buffer.as<uint16_t>(), buffer.bytes() / 2, seed, 1.0f, stream);
}

void measure_matmul(Machine& m, int n, int repeats, cudaStream_t stream) {
  const size_t elems = static_cast<size_t>(n) * n;
  DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 2);
  const size_t workspace_bytes = size_t{64} << 20;
  DeviceBuffer workspace(workspace_bytes);
  fill_normal(a, 101, stream);
  fill_normal(b, 102, stream);

  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  auto release = [&] {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  };
  try {
    BENCH_CUBLAS(cublasLtCreate(&lt));
    BENCH_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;  // "TN", row-major A
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                                sizeof transa));
    BENCH_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                                sizeof transb));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
    BENCH_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    BENCH_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof workspace_bytes));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    BENCH_CUBLAS(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heuristic, &found));
    if (found < 1) MSA_FAIL("cuBLASLt: no bf16 matmul algorithm for ", n, "^3");
    const float alpha = 1, beta = 0;
    m.matmul = time_events(stream, 3, repeats, [&](int) {
      BENCH_CUBLAS(cublasLtMatmul(lt, op, &alpha, a.get(), la, b.get(), lb, &beta, c.get(), lc,
                                  c.get(), lc, &heuristic.algo, workspace.get(), workspace_bytes,
                                  stream));
    });
  } catch (...) {
    release();
    throw;
  }
  release();
  m.matmul_size = n;
  m.matmul_tflops = 2.0 * n * n * static_cast<double>(n) / (m.matmul.ms * 1e-3) / 1e12;
}

void measure_memory(Machine& m, int repeats, cudaStream_t stream) {
  const size_t copy_bytes = size_t{1} << 30, read_bytes = size_t{2} << 30;
  {
    DeviceBuffer src(copy_bytes), dst(copy_bytes);
    fill_normal(src, 103, stream);
    m.copy = time_events(stream, 2, repeats, [&](int) {
      MSA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, stream));
    });
    m.copy_gbs = 2.0 * copy_bytes / (m.copy.ms * 1e-3) / 1e9;
  }
  DeviceBuffer data(read_bytes), sink(16);
  fill_normal(data, 104, stream);
  m.read = time_events(stream, 2, repeats, [&](int) {
    cuda::bench::stream_read(data.get(), read_bytes, sink.as<uint32_t>(), stream);
  });
  m.read_gbs = read_bytes / (m.read.ms * 1e-3) / 1e9;
}

Machine describe_machine() {
  Machine m;
  int device = 0;
  MSA_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MSA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  m.gpu = prop.name;
  m.cc_major = prop.major;
  m.cc_minor = prop.minor;
  m.sms = prop.multiProcessorCount;
  m.memory_gib = prop.totalGlobalMem / double(1 << 30);
  m.l2_mib = prop.l2CacheSize / double(1 << 20);
  MSA_CUDA_CHECK(cudaDriverGetVersion(&m.driver));
  MSA_CUDA_CHECK(cudaRuntimeGetVersion(&m.runtime));
  m.cublaslt = cublasLtGetVersion();
  if (std::ifstream proc("/proc/driver/nvidia/version"); proc) {
    // "NVRM version: NVIDIA UNIX [Open] Kernel Module [for x86_64]  580.159.04  Release ...":
    // the release is the first word made of digits and dots.
    std::string line;
    std::getline(proc, line);
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      if (!word.empty() && word.find_first_not_of("0123456789.") == std::string::npos &&
          word.find('.') != std::string::npos) {
        m.driver_release = word;
        break;
      }
    }
  }
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  m.date = date;
#ifdef MSA_WITH_CUDNN
  m.cudnn = cuda::cudnn_version_string() + " (frontend " + cuda::cudnn_frontend_version_string() + ")";
#endif
  return m;
}

}  // namespace msa::cli::bench_cuda
