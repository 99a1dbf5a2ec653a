#include "cuda/common/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <string>

#include "msa/error.h"

namespace msa::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000, cudaEnableDefault, &found);
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || !pointer)
      throw_arg_error("driver", "cuTensorMapEncodeTiled (CUDA 12.0+ driver)",
                      std::string(cudaGetErrorString(status)));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pointer);
  }();
  return function;
}

}  // namespace

CUtensorMap bf16_rows_tensor_map(const void* base, int64_t rows, int cols, int box_rows, int box_cols) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0)
    throw_arg_error("q", "a 16-byte aligned base for the bulk tensor copy", reinterpret_cast<uintptr_t>(base));
  if (rows < 1 || rows >= (int64_t{1} << 31)) throw_arg_error("rows", "1 .. 2^31 - 1 tensor-map rows", rows);
  if (box_cols * 2 != 128) throw_arg_error("box_cols", "64 (128-byte rows of the 128-byte swizzle)", box_cols);
  if (box_rows < 1 || box_rows > 256) throw_arg_error("box_rows", "1 .. 256", box_rows);
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw_arg_error("tensor map", "cuTensorMapEncodeTiled to accept a bf16 [" + std::to_string(rows) + ", " +
                                      std::to_string(cols) + "] matrix in " + std::to_string(box_rows) + " x " +
                                      std::to_string(box_cols) + " boxes",
                    "CUresult " + std::to_string(static_cast<int>(result)));
  return map;
}

}  // namespace msa::cuda
