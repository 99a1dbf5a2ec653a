// msa bench --device cuda --kv-cache: fp8 K/V caches quantized on the device, shared by the
// decode and prefill rows.
#include "bench_cuda/common.h"
#include "bench_cuda/inputs.h"
#include "msa/cuda/quantize.h"

namespace msa::cli::bench_cuda {

namespace {

// The per-tensor scale of the fp8 caches. The caches hold normal(0, 1) values, whose largest
// of 10^9 is ~6.1: 8 / 448 never saturates them.
constexpr float kPerTensorKvScale = 8.0f / 448.0f;

}  // namespace

const char* layout_name(cuda::KvScaleLayout layout) {
  return layout == cuda::KvScaleLayout::per_tensor ? "per_tensor" : "per_token_head";
}

double fp8_bytes_per_element(cuda::KvScaleLayout layout, int64_t head_dim) {
  return layout == cuda::KvScaleLayout::per_tensor ? 1.0 : 1.0 + 4.0 / static_cast<double>(head_dim);
}

size_t fp8_kv_set_bytes(cuda::KvScaleLayout layout, size_t cache_elems, int64_t head_dim) {
  const size_t scales = layout == cuda::KvScaleLayout::per_tensor ? 1 : cache_elems / static_cast<size_t>(head_dim);
  return 2 * (cache_elems + scales * sizeof(float));
}

Fp8KvSet quantize_fp8_kv(Session& s, cuda::KvAppendParams append, size_t cache_elems, int64_t Hkv, int64_t B,
                         cuda::KvScaleLayout layout, const cuda::AttentionLaunch& paged) {
  Fp8KvSet f;
  const bool per_tensor = layout == cuda::KvScaleLayout::per_tensor;
  const size_t scales = per_tensor ? 1 : cache_elems / static_cast<size_t>(append.head_dim);  // per operand
  f.k_codes = DeviceBuffer(cache_elems);
  f.v_codes = DeviceBuffer(cache_elems);
  f.k_scale = DeviceBuffer(scales * 4);
  f.v_scale = DeviceBuffer(scales * 4);
  if (per_tensor) {
    f.k_scale.upload(&kPerTensorKvScale, 4);
    f.v_scale.upload(&kPerTensorKvScale, 4);
  }
  append.k_cache = f.k_codes.as<uint8_t>();
  append.v_cache = f.v_codes.as<uint8_t>();
  append.k_scale = f.k_scale.as<float>();
  append.v_scale = f.v_scale.as<float>();
  append.k_layout = append.v_layout = layout;
  cuda::append_kv_fp8(append, s.stream);
  const auto scales_of = [&](const DeviceBuffer& scale) {
    return per_tensor ? cuda::kv_scale_per_tensor(scale.as<float>())
                      : cuda::kv_scales_per_token_head(scale.as<float>(), Hkv, B);
  };
  f.sparse = paged;
  f.sparse.kv_format = cuda::KvFormat::fp8;
  f.sparse.k_fp8 = {f.k_codes.as<uint8_t>(), scales_of(f.k_scale)};
  f.sparse.v_fp8 = {f.v_codes.as<uint8_t>(), scales_of(f.v_scale)};
  f.dense = dense_of(f.sparse);
  return f;
}

}  // namespace msa::cli::bench_cuda
