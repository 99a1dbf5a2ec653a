#include "msa/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace msa {

std::string_view device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

std::string shape_string(const Shape& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t count = 1;
  for (int64_t extent : shape) {
    if (extent < 0) throw_arg_error("shape", "non-negative extents", shape_string(shape));
    if (__builtin_mul_overflow(count, extent, &count))
      throw_arg_error("shape", "an element count that fits in 64 bits", shape_string(shape));
  }
  return count;
}

std::string index_string(const Shape& shape, int64_t flat_index) {
  Shape index(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] > 0) {
      index[i] = flat_index % shape[i];
      flat_index /= shape[i];
    }
  }
  return shape_string(index);
}

namespace {
// Non-finite by the bits: all exponent bits set (e4m3fn has no infinity; S.1111.111 is NaN).
template <class Bits>
int64_t scan_bits(const void* data, int64_t begin, int64_t count, Bits exponent, Bits negative_inf,
                  bool allow_negative_infinity) {
  const Bits* bits = static_cast<const Bits*>(data);
  for (int64_t i = begin; i < begin + count; ++i)
    if ((bits[i] & exponent) == exponent && !(allow_negative_infinity && bits[i] == negative_inf))
      return i;
  return -1;
}
}  // namespace

int64_t first_non_finite(const Tensor& tensor, int64_t begin, int64_t count,
                         bool allow_negative_infinity) {
  MSA_CHECK_ARG(tensor.device() == Device::cpu && tensor.is_contiguous(), "tensor",
                "a contiguous cpu tensor", "another layout");
  MSA_CHECK_ARG(begin >= 0 && count >= 0 && begin <= tensor.numel() - count, "range",
                "elements inside the tensor's " + std::to_string(tensor.numel()),
                "[" + std::to_string(begin) + ", +" + std::to_string(count) + ")");
  const void* data = tensor.raw();
  switch (tensor.dtype()) {
    case DType::f32:
      return scan_bits<uint32_t>(data, begin, count, 0x7f800000u, 0xff800000u, allow_negative_infinity);
    case DType::f64:
      return scan_bits<uint64_t>(data, begin, count, 0x7ff0000000000000ull, 0xfff0000000000000ull,
                                 allow_negative_infinity);
    case DType::bf16:
      return scan_bits<uint16_t>(data, begin, count, uint16_t(0x7f80), uint16_t(0xff80),
                                 allow_negative_infinity);
    case DType::f16:
      return scan_bits<uint16_t>(data, begin, count, uint16_t(0x7c00), uint16_t(0xfc00),
                                 allow_negative_infinity);
    case DType::e4m3:
      return scan_bits<uint8_t>(data, begin, count, uint8_t(0x7f), uint8_t(0x7f), false);
    default: return -1;
  }
}

int64_t first_non_finite(const Tensor& tensor, bool allow_negative_infinity) {
  const Tensor contiguous = tensor.is_contiguous() ? tensor : tensor.clone();
  return first_non_finite(contiguous, 0, contiguous.numel(), allow_negative_infinity);
}

namespace {
Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}
}  // namespace

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner,
                    Device device) {
  Tensor out;
  out.data_ = data;
  out.owner_ = std::move(owner);
  out.shape_ = shape;
  out.strides_ = contiguous_strides(shape);
  out.dtype_ = dtype;
  out.device_ = device;
  shape_numel(shape);  // validates extents
  return out;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  // 64-byte alignment so vector loads of rows never split cache lines needlessly.
  void* memory = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  if (!memory) MSA_FAIL("out of memory allocating ", bytes, " bytes for a tensor of shape ",
                        shape_string(shape));
  std::memset(memory, 0, bytes);
  return wrap(memory, shape, dtype, std::shared_ptr<void>(memory, std::free));
}

Tensor Tensor::full(const Shape& shape, DType dtype, double value) {
  Tensor out = zeros(shape, dtype);
  for (int64_t i = 0, n = out.numel(); i < n; ++i) out.set(i, value);
  return out;
}

int64_t Tensor::size(int64_t axis) const {
  const int64_t rank = dim();
  if (axis < 0) axis += rank;
  if (axis < 0 || axis >= rank)
    throw_arg_error("axis", "an axis of a rank-" + std::to_string(rank) + " tensor", axis);
  return shape_[static_cast<size_t>(axis)];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

double Tensor::get(int64_t flat_index) const {
  if (device_ != Device::cpu) throw Error("tensor: element access needs a cpu tensor");
  if (!is_contiguous()) throw Error("tensor: element access needs a contiguous tensor");
  return load_as_double(data_, dtype_, flat_index);
}

void Tensor::set(int64_t flat_index, double value) {
  if (device_ != Device::cpu) throw Error("tensor: element access needs a cpu tensor");
  if (!is_contiguous()) throw Error("tensor: element access needs a contiguous tensor");
  store_from_double(data_, dtype_, flat_index, value);
}

Tensor Tensor::clone() const {
  if (!is_contiguous()) throw Error("tensor: clone needs a contiguous tensor");
  Tensor out = zeros(shape_, dtype_);
  if (nbytes()) std::memcpy(out.data_, data_, nbytes());
  return out;
}

Tensor Tensor::to(DType target) const {
  if (target == dtype_) return clone();
  if (device_ != Device::cpu) throw Error("tensor: element access needs a cpu tensor");
  if (!is_contiguous()) throw Error("tensor: element access needs a contiguous tensor");
  Tensor out = zeros(shape_, target);
  // Element-wise, so threads change nothing but the time (test inputs reach 10^9 elements).
  const int64_t n = numel();
  constexpr int64_t kParallelFrom = int64_t{1} << 16;
  if (dtype_ == DType::bf16 && target == DType::f32) {  // the common fast path
    const auto* in = static_cast<const uint16_t*>(data_);
    auto* dst = static_cast<float*>(out.data_);
#pragma omp parallel for schedule(static) if (n >= kParallelFrom)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(in[i]);
    return out;
  }
#pragma omp parallel for schedule(static) if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; ++i) store_from_double(out.data_, target, i, load_as_double(data_, dtype_, i));
  return out;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (!is_contiguous()) throw Error("tensor: reshape needs a contiguous tensor");
  if (shape_numel(shape) != numel())
    throw_arg_error("shape", std::to_string(numel()) + " elements", shape_string(shape));
  Tensor out = *this;
  out.shape_ = shape;
  out.strides_ = contiguous_strides(shape);
  return out;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  if (dim() == 0) throw Error("tensor: slice0 needs rank >= 1");
  if (begin < 0 || end < begin || end > shape_[0])
    throw_arg_error("slice", "0 <= begin <= end <= " + std::to_string(shape_[0]),
                    std::to_string(begin) + ".." + std::to_string(end));
  Tensor out = *this;
  out.data_ = static_cast<char*>(data_) +
              static_cast<size_t>(begin * strides_[0]) * dtype_size(dtype_);
  out.shape_[0] = end - begin;
  return out;
}

}  // namespace msa
