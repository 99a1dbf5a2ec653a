// Tensor maps for the bulk tensor copy engine (TMA, sm_90): encoded on the host through the
// driver's cuTensorMapEncodeTiled (found with cudaGetDriverEntryPointByVersion, so nothing
// links libcuda), passed to a kernel by value as a __grid_constant__ parameter.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace msa::cuda {

// A row-major bf16 matrix [rows, cols] (rows `cols` elements apart, base 16-byte aligned)
// read in boxes of box_rows x box_cols with the 128-byte swizzle (box_cols * 2 == 128: the
// K-major wgmma operand layout, wgmma.cuh swizzled_offset). Elements past `rows` read
// as zeros. Errors name the argument and what the driver or the layout required.
CUtensorMap bf16_rows_tensor_map(const void* base, int64_t rows, int cols, int box_rows, int box_cols);

}  // namespace msa::cuda
